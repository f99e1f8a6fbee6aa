"""Endpoint: one rank of one engine, with its NIXL agent, its registered regions and its peers.

Lifecycle: construct (buffers checked against the spec, then registered) -> ``metadata()`` out,
peers' metadata in through ``connect`` (layout check with kvplan, descriptor lists prepared once
per route and per peer) -> ``read``/``write`` per request -> ``close``. Everything that decides
which bytes move comes from the plan; this module only checks the plan fits what was connected,
lowers it (``descriptors.py``) and posts it (``transfer.py``).

Not thread-safe: use an Endpoint, and its Transfers, from one thread.
"""

from __future__ import annotations

import collections
import hmac
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvplan import EngineSpec, Mode, TransferMap, TransferPlan, pull_map, push_map
from kvplan_nixl import metadata as md
from kvplan_nixl._nixl import NIXL_LOCAL, make_agent
from kvplan_nixl.buffers import resolve_buffers
from kvplan_nixl.descriptors import Ladder, Lowered, lower, run_text
from kvplan_nixl.errors import (
    BufferSizeError,
    ClosedError,
    MetadataError,
    NixlError,
    NotConnectedError,
    PlanMismatchError,
    is_nixl_error,
    nixl_call,
    release_counted,
)
from kvplan_nixl.transfer import Transfer, _Part

if TYPE_CHECKING:
    from kvplan_nixl.parts import RequestTransfer

#: Separator of the fields of an agent name, ``engine#rank#nonce`` (parsed from the right).
_SEP = md.AGENT_SEP
#: Prefix of the control messages endpoints exchange as NIXL notifications (never delivered to
#: ``notifications()``): ``hello`` carries the connecting endpoint's metadata so that the target
#: can reach it, ``close`` says the sender closed. With a secret, a close carries a MAC.
_CTRL = b"\x00kvplan_nixl\x00"
_HELLO = _CTRL + b"hello"
_CLOSE = _CTRL + b"close"
_MAC_CLOSE = b"kvplan_nixl close\x00"
#: How long close() keeps progressing so that its notices leave: rounds x sleep (~5 ms).
_CLOSE_FLUSH_ROUNDS = 10
_CLOSE_FLUSH_SLEEP = 0.5e-3


@attrs.frozen
class Notification:
    """A message a peer attached to a transfer, delivered when its part completed here."""

    engine: str
    rank: int
    message: bytes


@attrs.frozen
class Peer:
    """A connected peer rank, as :meth:`Endpoint.connect` returns it."""

    engine: str
    rank: int
    agent: str
    spec: EngineSpec = attrs.field(repr=False)


class _Route:
    """Per (remote engine, mode): the map, the local ladder and list, and per peer rank its
    ladder and list (peers of different pipeline stages hold different regions)."""

    __slots__ = ("dst_groups", "local", "local_dlist", "map", "peer_dlists", "peer_ladders",
                 "remote_units")

    def __init__(self, tmap: TransferMap, local: Ladder, remote_units: list[int],
                 local_dlist) -> None:
        self.map = tmap
        self.local = local
        self.remote_units = remote_units
        self.local_dlist = local_dlist  # None when this rank copies nothing with that engine
        self.peer_ladders: dict[int, Ladder] = {}
        self.peer_dlists: dict[int, Any] = {}  # None for a peer holding nothing the map copies
        self.dst_groups = np.array([r.group for r in tmap.dst.regions], dtype=np.int64)


def _describer(seg: np.ndarray):
    """Error text for run ``i`` of ``seg`` (rows of one peer), in the project's run notation."""

    def describe(i: int, reason: str) -> str:
        row = seg[i]
        s = ("p", int(row["src_rank"]), int(row["src_region"]), int(row["src_offset"]))
        d = ("d", int(row["dst_rank"]), int(row["dst_region"]), int(row["dst_offset"]))
        return f"run {run_text(s, d, int(row['length']))}: {reason}"

    return describe


def _ladder_entries(spec: EngineSpec, nbytes, units, bases, devices, v_bases):
    """A ladder's entries: one per region (its K buffer when K and V are apart, else the
    buffer it lives in), then one per V buffer of a region keeping K and V apart, in region
    order. Returns (names, nbytes, units, bases, devices)."""
    sep = [i for i, r in enumerate(spec.regions) if r.separate_kv]
    if not sep:
        return [r.name for r in spec.regions], nbytes, units, bases, devices
    return (
        [r.name for r in spec.regions] + [f"{spec.regions[i].name} (V)" for i in sep],
        [*nbytes, *(nbytes[i] for i in sep)],
        [*units, *(units[i] for i in sep)],
        [*bases, *((v_bases[i] if v_bases else 0) for i in sep)],
        [*devices, *(devices[i] for i in sep)],
    )


def _entry_index(spec: EngineSpec, regions: np.ndarray, buffers: np.ndarray) -> np.ndarray:
    """The ladder entry of each run (see :func:`_ladder_entries`): its region, or that
    region's V entry when the run lies in the region's separate V buffer."""
    n = len(spec.regions)
    sep = [i for i, r in enumerate(spec.regions) if r.separate_kv]
    if not sep:
        return regions
    v_buf = np.full(n, -1, dtype=np.int64)
    v_entry = np.zeros(n, dtype=np.int64)
    for k, i in enumerate(sep):
        v_buf[i], v_entry[i] = spec.buffer_of(i, 1), n + k
    return np.where(buffers == v_buf[regions], v_entry[regions], regions)


def _parse_agent(name: str) -> tuple[str, int]:
    parsed = md.parse_agent_name(name)
    return parsed if parsed is not None else (name, -1)


def _close_mac(secret: bytes, sender: str, receiver: str) -> bytes:
    """What a close notice from ``sender`` to ``receiver`` carries under a secret (bound to both
    agent names, so it cannot be replayed to another endpoint or for another agent)."""
    return md.mac(secret, _MAC_CLOSE, f"{sender}\x00{receiver}".encode())


class Endpoint:
    """One rank of one engine: NIXL agent, registered regions, connected peers.

    ``rank`` is a flat rank in ``[0, spec.num_ranks)``, ``pp_rank * tp_size + tp_rank``; the
    rank holds only the regions of its pipeline stage (``spec.regions_on(rank)``).
    ``buffers`` holds one buffer per *buffer of the spec* the rank holds (``spec.buffers``):
    each region with its own buffer, each pool, each allocation (its regions are layer slots)
    and each K and V buffer of regions keeping them apart. Either a mapping keyed by region
    name, pool name, allocation name or buffer name (a region's name reaches the buffer it
    lives in; K and V buffers are given by their names), or a sequence in ``spec.buffers``
    order with one per buffer held (or, when no region keeps K and V apart, one per region
    held, the regions of a pool or allocation repeating its buffer). A buffer is a
    contiguous torch tensor (CPU -> DRAM, CUDA -> VRAM), a C-contiguous numpy array, or an
    ``(address, nbytes)`` pair of DRAM, of ``spec.rank_buffer_nbytes(b)`` bytes. Buffers for
    regions of another stage, a missing one, two different buffers for one pool or
    allocation, a wrong size or overlapping buffers raise :class:`BufferSizeError` before
    NIXL is touched. Each buffer is registered once. The buffers must outlive the endpoint.
    ``telemetry=True`` records NIXL's descriptor counts.

    ``secret`` (bytes or str, shared by every endpoint of a deployment) signs :meth:`metadata`
    with HMAC-SHA256 and makes :meth:`connect` refuse metadata not signed with it before any
    byte reaches NIXL; close notices are signed too. Without a secret, peers are trusted (see
    docs/executor.md, "Trust boundary"). ``progress_thread=True`` lets NIXL progress transfers
    and notifications on its own thread, which spins one CPU core at 100% for as long as the
    endpoint lives; by default (False) the endpoint is progressed by its own calls
    (``Transfer.wait``/``poll``, :meth:`progress`, :meth:`notifications`).

    ``num_threads`` (a non-negative int; 0, the default, keeps NIXL's default) is NIXL's agent
    option of that name, handed to the UCX backend: worker threads that share the posting of a
    transfer's descriptors, which helps requests of many small descriptors (scattered block
    ids, hetero TP) and costs those threads in every agent, on top of the progress thread if
    that is on. See docs/executor.md, "Parallel posting: num_threads".
    """

    def __init__(
        self,
        engine: str,
        spec: EngineSpec | Mapping[str, Any],
        rank: int,
        buffers: Sequence[Any] | Mapping[str, Any],
        *,
        backends: Sequence[str] = ("UCX",),
        telemetry: bool = False,
        secret: bytes | str | None = None,
        progress_thread: bool = False,
        num_threads: int = 0,
    ) -> None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 0:
            raise ValueError(f"num_threads must be a non-negative int (0: NIXL's default), "
                             f"got {num_threads!r}")
        if not isinstance(engine, str) or not engine:
            raise ValueError(f"engine must be a non-empty name, got {engine!r}")
        if isinstance(spec, Mapping):
            spec = EngineSpec.from_dict(spec)
        if not isinstance(spec, EngineSpec):
            raise TypeError(f"spec must be an EngineSpec or its dict, got {type(spec).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < spec.num_ranks:
            pp = f" (tp {spec.tp_size} x pp {spec.pp_size})" if spec.pp_size > 1 else ""
            raise ValueError(
                f"rank {rank!r} is not in [0, {spec.num_ranks}) of engine {engine!r}{pp}"
            )
        self._secret = md.check_secret(secret)
        allocs = resolve_buffers(spec, rank, buffers)
        mems = sorted({reg[3] for _, reg in allocs.values()})
        if len(mems) != 1:
            raise BufferSizeError(f"all regions of a rank must be in one memory, got {mems}")
        self.engine = engine
        self.spec = spec
        self.rank = rank
        self.telemetry = bool(telemetry)
        self.progress_thread = bool(progress_thread)
        self.num_threads = num_threads
        #: control notifications ignored (unknown sender, bad MAC, unreadable): see progress()
        self.ignored_notices = 0
        self.mem_type = mems[0]
        n = len(spec.regions)
        bases, nbytes, devices, v_bases = [0] * n, [0] * n, [0] * n, [0] * n
        for i in spec.regions_on(rank):  # per region index; pooled regions share the pool's
            addr, size, dev, _ = allocs[spec.buffer_of(i)][1]
            bases[i], nbytes[i], devices[i] = addr, size, dev
            if spec.regions[i].separate_kv:  # its V buffer: a ladder entry of its own
                v_bases[i] = allocs[spec.buffer_of(i, 1)][1][0]
        self._v_bases = tuple(v_bases)
        self._bases = tuple(bases)
        self._nbytes = tuple(nbytes)
        self._devices = tuple(devices)
        self._buffers = [b for b, _ in allocs.values()]  # keep them alive while registered
        regs = [reg for _, reg in allocs.values()]
        self.agent_name = md.agent_name(engine, rank, f"{os.getpid():x}{secrets.token_hex(4)}")
        self._live: collections.Counter[str] = collections.Counter()
        self._peers: dict[tuple[str, int], Peer] = {}
        self._loaded: dict[str, tuple[str, int]] = {}  # remote agents loaded: peers, listeners
        self._routes: dict[tuple[str, Mode], _Route] = {}
        self._transfers: set[Transfer] = set()
        self._notifs: collections.deque[Notification] = collections.deque()
        # prefix -> fn(agent_name, message): messages of a protocol layered on this endpoint
        # (staged transfers, kvplan_nixl.staged) go to it instead of notifications()
        self._notif_hooks: dict[bytes, Any] = {}
        with nixl_call("agent creation", f"backends {list(backends)}"):
            self._agent = make_agent(self.agent_name, tuple(backends), self.telemetry,
                                     self.progress_thread, num_threads)
        try:
            missing = [b for b in backends if b not in self._agent.backends]
            if missing:
                raise NixlError("create_backend", "NIXL_ERR_NOT_FOUND", f"no backend {missing}")
            with nixl_call("register_memory", f"{len(regs)} allocations of {engine} rank {rank}"):
                self._reg = self._agent.register_memory(
                    [(a, n, d, "") for a, n, d, _ in regs], self.mem_type
                )
            self._live["registrations"] += 1
        except BaseException:
            self._agent = None
            raise

    # -- identity and peers ------------------------------------------------------------------

    def metadata(self) -> bytes:
        """What a peer passes to ``connect``: versioned, checksummed (signed under the secret),
        a few hundred bytes + spec."""
        agent = self._require()
        with nixl_call("get_agent_metadata"):
            agent_md = agent.get_agent_metadata()
        return md.encode(
            md.PeerInfo(
                engine=self.engine,
                rank=self.rank,
                agent=self.agent_name,
                spec=self.spec,
                mem_type=self.mem_type,
                bases=self._bases,
                nbytes=self._nbytes,
                devices=self._devices,
                agent_metadata=agent_md,
                v_bases=self._v_bases if any(self._v_bases) else (),
            ),
            self._secret,
        )

    def connect(self, metadata: bytes, *, mode: str | Mode = "pull") -> Peer:
        """Add a peer rank; ``mode="pull"`` to read from it later, ``"push"`` to write to it.

        Checks the peer's layout against ours with kvplan (``kvplan.IncompatibleLayoutError``
        here, never mid-transfer) and prepares descriptor lists: once per (engine, mode) for the
        local side and once per peer rank for the remote side, as NIXL strided rows whose count
        grows with ``log(num_blocks)`` only. Connecting the same peer again is a no-op; a peer
        rank that restarted (new agent) replaces the old one.

        It suffices to connect the ranks ``map(remote, mode).peers`` names (connect any one
        first: the map is built from its spec); with pipeline stages they are the ranks of the
        stages holding this rank's regions. Other ranks may be connected too: they get no
        descriptor list, since no plan of the map names them.
        """
        agent = self._require()
        info = md.decode(metadata, self._secret)
        mode = Mode(mode)
        if info.agent == self.agent_name:
            raise MetadataError("this is the endpoint's own metadata; connect to a peer's")
        who = f"engine {info.engine!r} rank {info.rank}"
        named = md.nixl_agent_name(info.agent_metadata)
        if named != info.agent:  # checked on the bytes, before NIXL parses them
            what = "is not NIXL agent metadata" if named is None else f"names agent {named!r}"
            raise MetadataError(f"metadata of {who}: its NIXL section {what}, but the metadata "
                                f"advertises agent {info.agent!r}")
        self.progress()  # act on close notices already here before deciding anything
        key = (info.engine, mode)
        route = self._routes.get(key)
        stale = None  # a route whose only rank comes back with another spec: replaced
        if route is not None:
            other = route.map.src if mode is Mode.PULL else route.map.dst
            if other != info.spec:
                if set(route.peer_dlists) - {info.rank}:
                    raise MetadataError(
                        f"engine {info.engine!r} rank {info.rank} advertises a spec that differs "
                        f"from the one its other ranks advertised; every rank of an engine has "
                        f"one spec"
                    )
                stale, route = route, None
        old = self._peers.get((info.engine, info.rank))
        if old is not None and old.agent == info.agent and route is not None \
                and info.rank in route.peer_dlists:
            return old  # connected already
        # Build everything new aside; only a fully successful connect changes this endpoint
        # (a refused one leaves no route, list or agent, and no connected peer is touched).
        new_route = self._new_route(agent, info, mode) if route is None else None
        load = info.agent not in self._loaded
        try:
            if load:
                self._load(agent, info, who)
            try:
                ladder, dlist = self._peer_list(agent, info, new_route or route)
            except NixlError as exc:  # e.g. advertised regions its NIXL section does not register
                raise MetadataError(
                    f"metadata of {who}: NIXL refused its advertised regions ({exc.code}): they "
                    "are not what its NIXL metadata registers"
                ) from exc
        except BaseException:
            if load and info.agent in self._loaded:
                self._unload(agent, info.agent, quiet=True)
            if new_route is not None:
                self._release_dlist(new_route.local_dlist, [])
            raise
        if old is not None and old.agent != info.agent:  # the rank restarted: new agent
            try:
                self._drop_peer(agent, old, "restarted with new metadata")
            except Exception:  # best effort: the old agent is gone either way
                pass
        if stale is not None:  # what _drop_peer did not release (the same agent re-advertised)
            for h in stale.peer_dlists.values():
                self._release_dlist(h, [])
            self._release_dlist(stale.local_dlist, [])
        if new_route is not None:
            self._routes[key] = route = new_route
        assert route is not None
        peer = Peer(info.engine, info.rank, info.agent, info.spec)
        if old is not None and old.agent == info.agent and stale is None:
            peer = old
        self._peers[(info.engine, info.rank)] = peer
        route.peer_ladders[info.rank] = ladder
        route.peer_dlists[info.rank] = dlist
        self._send_hello(agent, info.agent)
        return peer

    def _load(self, agent, info: md.PeerInfo, who: str) -> None:
        """Load a peer's NIXL metadata; on any failure nothing of it stays loaded."""
        try:
            with nixl_call("add_remote_agent", who):
                loaded = agent.add_remote_agent(info.agent_metadata)
        except NixlError as exc:  # NIXL may keep a half-loaded agent: remove it by name
            self._unload(agent, info.agent, quiet=True, counted=False)
            raise MetadataError(f"metadata of {who}: NIXL refused its agent metadata "
                                f"({exc.code})") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._live["remote_agents"] += 1
        self._loaded[loaded] = (info.engine, info.rank)
        if loaded != info.agent:  # cannot happen once the prefix was checked; kept as a guard
            self._unload(agent, loaded, quiet=True)
            raise MetadataError(
                f"metadata names agent {info.agent!r} but carries NIXL metadata of {loaded!r}"
            )

    def _unload(self, agent, name: str, *, quiet: bool = False, counted: bool = True) -> None:
        self._loaded.pop(name, None)
        try:
            with nixl_call("remove_remote_agent", name):
                agent.remove_remote_agent(name)
        except NixlError:
            if not quiet:
                raise
            return
        if counted:
            self._live["remote_agents"] -= 1

    def _peer_list(self, agent, info: md.PeerInfo, route: _Route):
        """The peer's ladder and prepared remote list for ``route`` (None when not needed)."""
        names, nbytes, units, bases, devices = _ladder_entries(
            info.spec, info.nbytes, route.remote_units, info.bases, info.devices, info.v_bases)
        ladder = Ladder.build(names, nbytes, units)
        rows = ladder.rows(bases, devices)
        # a peer the map never copies with (another stage, or a TP rank whose units and
        # replicas other ranks serve) gets no list: no plan of this map names it
        needed = info.rank in route.map.peers and len(rows) > 0
        return ladder, (self._prep(agent, info.agent, rows, info.mem_type) if needed else None)

    def _new_route(self, agent, info: md.PeerInfo, mode: Mode) -> _Route:
        if mode is Mode.PULL:
            tmap = pull_map(info.spec, self.spec, self.rank)
        else:
            tmap = push_map(self.spec, info.spec, self.rank)
        mine = [tmap.granule(r.name) for r in self.spec.regions]
        theirs = [tmap.granule(r.name) for r in info.spec.regions]
        names, nbytes, units, bases, devices = _ladder_entries(
            self.spec, self._nbytes, mine, self._bases, self._devices, self._v_bases)
        local = Ladder.build(names, nbytes, units)
        rows = local.rows(bases, devices)
        dlist = self._prep(agent, NIXL_LOCAL, rows, self.mem_type) if len(rows) else None
        return _Route(tmap, local, theirs, dlist)

    # -- control notices: hello (so a target can reach its initiators) and close ---------------

    def _send_hello(self, agent, peer_agent: str) -> None:
        """Tell a peer we connected, with our metadata, so that it can notify us when it closes
        (a target never loads its initiators' metadata otherwise). Best effort."""
        try:
            with nixl_call("get_agent_metadata"):
                blob = self.metadata()
            with nixl_call("send_notif", peer_agent):
                agent.send_notif(peer_agent, _HELLO + blob)
        except NixlError:
            pass  # the peer then learns of our close by the failure of its next transfer

    def _on_control(self, sender: str, msg: bytes) -> None:
        agent = self._agent
        if agent is None:
            return
        if msg.startswith(_HELLO):
            if sender in self._loaded:
                return  # a peer already: close notices reach it anyway
            try:
                info = md.decode(msg[len(_HELLO):], self._secret)
                if info.agent != sender or md.nixl_agent_name(info.agent_metadata) != sender:
                    raise MetadataError(f"hello from {sender!r} carries another agent's metadata")
                self._load(agent, info, f"engine {info.engine!r} rank {info.rank}")
            except (MetadataError, NixlError):
                self.ignored_notices += 1
            return
        if not msg.startswith(_CLOSE) or sender not in self._loaded:
            self.ignored_notices += 1
            return
        if self._secret is not None:
            tag = msg[len(_CLOSE):]
            if not hmac.compare_digest(tag, _close_mac(self._secret, sender, self.agent_name)):
                self.ignored_notices += 1
                return
        engine, rank = self._loaded[sender]
        peer = self._peers.get((engine, rank))
        if peer is not None and peer.agent == sender:
            self._drop_peer(agent, peer, "peer closed its endpoint")
            if not any(e == engine for e, _ in self._peers):  # the engine is gone: its routes
                for key in [k for k in self._routes if k[0] == engine]:
                    self._release_dlist(self._routes.pop(key).local_dlist, [])
        else:
            self._unload(agent, sender, quiet=True)

    def _send_close(self, agent) -> None:
        """Tell every loaded agent (peers and initiators that said hello) that we close."""
        for name in list(self._loaded):
            tag = b"" if self._secret is None else _close_mac(self._secret, self.agent_name, name)
            try:
                agent.send_notif(name, _CLOSE + tag)
            except Exception as exc:  # a peer already gone: nothing to tell
                if not is_nixl_error(exc):
                    raise
        if self._loaded and not self.progress_thread:
            # the notices leave on worker progress: progress a few times before the agent is
            # destroyed, or UCX cancels them (what arrives meanwhile is of no use any more)
            for _ in range(_CLOSE_FLUSH_ROUNDS):
                try:
                    agent.get_new_notifs()
                except Exception as exc:
                    if not is_nixl_error(exc):
                        raise
                time.sleep(_CLOSE_FLUSH_SLEEP)

    def map(self, remote: str, mode: str | Mode = "pull") -> TransferMap:
        """The TransferMap connect built for ``remote`` (make plans with its ``plan``)."""
        return self._route(remote, Mode(mode)).map

    def peers(self) -> tuple[Peer, ...]:
        """The connected peer ranks, ordered by (engine, rank)."""
        return tuple(self._peers[k] for k in sorted(self._peers))

    def disconnect(self, remote: str, rank: int) -> None:
        """Forget one peer rank: its transfers in flight fail, its descriptor lists are released."""
        agent = self._require()
        peer = self._peers.get((remote, rank))
        if peer is None:
            raise NotConnectedError(f"engine {remote!r} rank {rank} is not connected")
        self._drop_peer(agent, peer)

    # -- requests ----------------------------------------------------------------------------

    def read(
        self,
        plan: TransferPlan,
        remote: str,
        *,
        notify: bytes | None = None,
        timeout: float | None = None,
    ) -> Transfer:
        """Pull: post the reads of ``plan`` (made by this rank's pull map for ``remote``).

        ``notify`` is delivered to each source rank when its part is complete (see
        :meth:`notifications`). ``plan`` may be a part (``plan.part(names)``, one layer's
        regions): it posts just those runs, with its own notification; to have one completion
        for a request posted in parts, use :meth:`request`. ``timeout`` (seconds) is a
        deadline enforced by ``poll`` and ``wait``. Before anything is posted every run is
        checked against both sides' registered bounds; a plan that does not fit raises and
        posts nothing.
        """
        return self._post(plan, remote, Mode.PULL, notify, timeout)

    def write(
        self,
        plan: TransferPlan,
        remote: str,
        *,
        notify: bytes | None = None,
        timeout: float | None = None,
    ) -> Transfer:
        """Push: post the writes of ``plan`` (made by this rank's push map for ``remote``)."""
        return self._post(plan, remote, Mode.PUSH, notify, timeout)

    def request(
        self,
        plan: TransferPlan,
        remote: str,
        *,
        notify: bytes | None = None,
        timeout: float | None = None,
    ) -> RequestTransfer:
        """Open a request to post in parts (layer-wise), read or write as ``plan``'s map says.

        ``plan`` is the whole request's plan; post its parts with ``post(plan.part(names),
        notify=...)`` as they become ready, then ``end()``. ``notify`` is the request's one
        completion message, sent to every peer rank of ``plan`` once every part is DONE;
        ``timeout`` (seconds) is a deadline for all parts. See :mod:`kvplan_nixl.parts`.
        """
        from kvplan_nixl.parts import RequestTransfer

        if not isinstance(plan, TransferPlan):
            raise TypeError(f"expected a kvplan.TransferPlan, got {type(plan).__name__}")
        self._route(remote, plan.map.mode)  # connected in that mode, or NotConnectedError
        deadline = None if timeout is None else time.monotonic() + timeout
        return RequestTransfer(self, plan, remote, notify, deadline)

    def _post(self, plan, remote, mode, notify, timeout) -> Transfer:
        agent = self._require()
        self.progress()  # a peer's close notice drops its route before we post to it
        route = self._route(remote, mode)
        self._check_plan(plan, route, remote, mode)
        rows = plan.copies()
        lside, rside = ("dst", "src") if mode is Mode.PULL else ("src", "dst")
        peer = rows[f"{rside}_rank"]
        if len(rows) and not (rows[f"{lside}_rank"] == self.rank).all():
            bad = int(rows[f"{lside}_rank"][rows[f"{lside}_rank"] != self.rank][0])
            raise PlanMismatchError(
                f"plan has runs of local rank {bad}; this endpoint is rank {self.rank}"
            )
        starts = np.flatnonzero(np.concatenate(([len(peer) > 0], peer[1:] != peer[:-1])))
        if len(np.unique(peer[starts])) != len(starts):  # a peer's rows are not contiguous
            rows = rows[np.argsort(peer, kind="stable")]
            peer = rows[f"{rside}_rank"]
            starts = np.flatnonzero(np.concatenate(([True], peer[1:] != peer[:-1])))
        ends = np.append(starts[1:], len(peer)) if len(starts) else starts
        ranks = [int(r) for r in peer[starts]]
        missing = [r for r in ranks if r not in route.peer_dlists]
        if missing:
            raise NotConnectedError(
                f"plan reads/writes ranks {missing} of engine {remote!r}, never connected in "
                f"{mode.value} mode by {self.engine!r} rank {self.rank}; connected: "
                f"{sorted(route.peer_dlists)}"
            )
        lowered: list[Lowered] = []
        for r, a, b in zip(ranks, starts, ends, strict=True):
            seg = rows[a:b]
            local_spec, remote_spec = (
                (route.map.dst, route.map.src) if mode is Mode.PULL else
                (route.map.src, route.map.dst))
            lowered.append(
                lower(route.local, route.peer_ladders[r],
                      _entry_index(local_spec, seg[f"{lside}_region"], seg[f"{lside}_buffer"]),
                      seg[f"{lside}_offset"],
                      _entry_index(remote_spec, seg[f"{rside}_region"], seg[f"{rside}_buffer"]),
                      seg[f"{rside}_offset"], seg["length"],
                      describe=_describer(seg))
            )
        groups = {
            r: frozenset(np.unique(route.dst_groups[rows["dst_region"][a:b]]).tolist())
            for r, a, b in zip(ranks, starts, ends, strict=True)
        }
        # a plan touching a rank or side with no list would have failed the bounds check
        assert all(route.peer_dlists[r] is not None for r in ranks)
        assert not ranks or route.local_dlist is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        parts = [_Part(r, lw.runs, lw.nbytes) for r, lw in zip(ranks, lowered, strict=True)]
        t = Transfer(self, plan, remote, parts, groups, deadline)
        t._start(
            agent,
            "READ" if mode is Mode.PULL else "WRITE",
            route.local_dlist,
            [route.peer_dlists[r] for r in ranks],
            lowered,
            b"" if notify is None else bytes(notify),
        )
        if not t.done:
            self._transfers.add(t)
        return t

    def _check_plan(self, plan: TransferPlan, route: _Route, remote: str, mode: Mode) -> None:
        if not isinstance(plan, TransferPlan):
            raise TypeError(f"expected a kvplan.TransferPlan, got {type(plan).__name__}")
        m = plan.map
        if m is route.map:
            return
        verb = "read" if mode is Mode.PULL else "write"
        if m.mode is not mode:
            raise PlanMismatchError(
                f"{verb} needs a {mode.value} plan (from kvplan.{mode.value}_map), got a "
                f"{m.mode.value} plan"
            )
        if m.rank != self.rank:
            raise PlanMismatchError(
                f"plan was made for rank {m.rank}; this endpoint is {self.engine!r} "
                f"rank {self.rank}"
            )
        if (m.src, m.dst) != (route.map.src, route.map.dst):
            raise PlanMismatchError(
                f"plan was made for other engine specs than {self.engine!r} and {remote!r} "
                f"exchanged at connect"
            )

    # -- notifications and progress ----------------------------------------------------------

    def progress(self) -> int:
        """Progress this agent (a target must be progressed) and queue new notifications."""
        agent = self._agent
        if agent is None:
            return 0
        with nixl_call("get_new_notifs"):
            new = agent.get_new_notifs()
        n = 0
        for name, msgs in new.items():
            name = name.decode() if isinstance(name, bytes) else name
            engine, rank = _parse_agent(name)
            for m in msgs:
                m = bytes(m)
                if m.startswith(_CTRL):
                    self._on_control(name, m)
                    continue
                hook = self._notif_hooks.get(m[:5])
                if hook is not None:
                    hook(name, m)
                    continue
                self._notifs.append(Notification(engine, rank, m))
                n += 1
        return n

    def notifications(self) -> list[Notification]:
        """Messages peers attached to transfers that completed here, oldest first (drained)."""
        self.progress()
        out = list(self._notifs)
        self._notifs.clear()
        return out

    def _hook(self, prefix: bytes, fn) -> None:
        """Hand messages starting with ``prefix`` (5 bytes) to ``fn(agent_name, message)``."""
        self._notif_hooks[prefix] = fn

    def _deliver(self, agent_name: str, message: bytes) -> None:
        """Queue ``message`` for :meth:`notifications` as if NIXL had delivered it from the
        agent ``agent_name`` (same ``Notification`` shape: that agent's engine and rank).

        Internal: a protocol layered on this endpoint (staged transfers, whose bulk transfers
        carry protocol notes) calls it to deliver a user's ``notify`` when its request's part
        completed here.
        """
        engine, rank = _parse_agent(agent_name)
        self._notifs.append(Notification(engine, rank, bytes(message)))

    # -- resources ---------------------------------------------------------------------------

    def handles(self) -> dict[str, int]:
        """Live NIXL objects this endpoint holds, by kind (all 0 after close)."""
        out = {k: self._live[k] for k in ("xfer", "dlist", "remote_agents", "registrations")}
        out["transfers"] = len(self._transfers)
        return out

    def close(self) -> None:
        """Tell peers, fail pending transfers, release every handle and list, forget peers,
        deregister and destroy the NIXL agent.

        Every agent this endpoint loaded (its peers, and the initiators that connected to it)
        gets a close notice: at its next ``progress`` (every ``read``/``write``/``wait`` does
        one) it fails its transfers with this endpoint, naming their blocks, and drops the peer
        and, when it was the engine's last, the route. See docs/executor.md, "Close".
        """
        agent = self._agent
        if agent is None:
            return
        errors: list[BaseException] = []
        try:  # peers that closed first are dropped now, not sent a notice they cannot receive
            self.progress()
        except Exception as exc:
            errors.append(exc)
        self._send_close(agent)
        for t in list(self._transfers):
            t.cancel("endpoint closed")
        for peer in list(self._peers.values()):
            try:
                self._drop_peer(agent, peer, "endpoint closed")
            except Exception as exc:  # keep releasing the rest
                errors.append(exc)
        for name in list(self._loaded):  # initiators that said hello
            try:
                self._unload(agent, name)
            except Exception as exc:
                errors.append(exc)
        for route in self._routes.values():
            self._release_dlist(route.local_dlist, errors)
        self._routes.clear()
        try:
            with nixl_call("deregister_memory"):
                agent.deregister_memory(self._reg)
            self._live["registrations"] -= 1
        except Exception as exc:
            errors.append(exc)
        self._agent = None  # the last reference: NIXL destroys the agent and its UCX worker
        del agent
        self._buffers = []
        if errors:
            raise errors[0]

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has released the agent."""
        return self._agent is None

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._agent is None else f"{len(self._peers)} peers"
        pp = f", pp={self.spec.pp_size}" if self.spec.pp_size > 1 else ""
        return f"Endpoint({self.engine!r}, rank={self.rank}, tp={self.spec.tp_size}{pp}, {state})"

    # -- internals ---------------------------------------------------------------------------

    def _require(self):
        if self._agent is None:
            raise ClosedError(f"endpoint {self.engine!r} rank {self.rank} is closed")
        return self._agent

    def _agent_or_none(self):
        return self._agent

    def _route(self, remote: str, mode: Mode) -> _Route:
        route = self._routes.get((remote, mode))
        if route is None:
            known = sorted(f"{e} ({m.value})" for e, m in self._routes)
            raise NotConnectedError(
                f"{self.engine!r} rank {self.rank} has no {mode.value} connection to engine "
                f"{remote!r}; connect(metadata, mode={mode.value!r}) first (connected: {known})"
            )
        return route

    def _prep(self, agent, name: str, rows: np.ndarray, mem: str):
        with nixl_call("prep_xfer_dlist", f"{len(rows)} strided rows for {name}"):
            h = agent.prep_xfer_dlist(name, rows, mem)
        self._live["dlist"] += 1
        return h

    def _release_dlist(self, h, errors: list[BaseException] | None = None) -> None:
        if h is None:  # a route or peer with nothing to describe had no list prepared
            return
        try:
            with nixl_call("release of a descriptor list"):
                h.release()
            self._live["dlist"] -= 1
        except Exception as exc:
            if errors is None:
                raise
            errors.append(exc)

    def _count_xfer(self) -> None:
        self._live["xfer"] += 1

    def _release_xfer(self, h) -> None:
        release_counted(h, self._live, "xfer")

    def _desc_count(self, h) -> int | None:
        try:
            return int(self._agent.get_xfer_telemetry(h).descCount)
        except Exception as exc:
            if not is_nixl_error(exc):
                raise
            return None

    def _drop_peer(self, agent, peer: Peer, why: str = "disconnected") -> None:
        errors: list[BaseException] = []
        for t in list(self._transfers):
            if t.remote == peer.engine and peer.rank in t.peers:
                t.cancel(f"peer {peer.engine!r} rank {peer.rank} {why}", [peer.rank])
        for (engine, _), route in self._routes.items():
            if engine == peer.engine and peer.rank in route.peer_dlists:
                route.peer_ladders.pop(peer.rank, None)
                self._release_dlist(route.peer_dlists.pop(peer.rank), errors)
        del self._peers[(peer.engine, peer.rank)]
        try:
            self._unload(agent, peer.agent)
        except Exception as exc:
            errors.append(exc)
        if errors:
            raise errors[0]

    def _forget(self, t: Transfer) -> None:
        self._transfers.discard(t)
