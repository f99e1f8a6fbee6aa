"""Endpoint: one rank of one engine, the facade of the direct executor.

Lifecycle: construct (buffers checked against the spec, then registered) -> ``metadata()`` out,
peers' metadata in through ``connect`` (layout check with kvplan, descriptor lists prepared once
per route and per peer) -> ``read``/``write``/``request`` per request -> ``close``. Everything
that decides which bytes move comes from the plan.

Owns the NIXL agent and the registration of the rank's buffers, and one of each collaborator,
wired together: a :class:`~kvplan_nixl.handles.Handles` ledger, the
:class:`~kvplan_nixl.peers.PeerTable` (per-peer state and its teardown), the
:class:`~kvplan_nixl.routes.RouteTable` (maps and descriptor lists), the
:class:`~kvplan_nixl.handshake.Handshake` (connect, hello and close notices), the
:class:`~kvplan_nixl.notifications.NotificationRouter` and the
:class:`~kvplan_nixl.posting.Poster` (transfers in flight). It holds no logic of theirs: it
checks arguments, delegates, and orders close. Nothing below it may import it; the staged
executor (``kvplan_nixl.staged``) builds on it.

Not thread-safe: use an Endpoint, and its Transfers, from one thread.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvplan import EngineSpec, Mode, TransferMap, TransferPlan
from kvplan_nixl import metadata as md
from kvplan_nixl._nixl import make_agent
from kvplan_nixl.arguments import (
    check_int,
    check_mode,
    check_names,
    check_notify,
    check_request,
    check_str,
)
from kvplan_nixl.buffers import declared_memory, resolve_buffers
from kvplan_nixl.envelope import Envelope
from kvplan_nixl.errors import (
    ArgumentError,
    ClosedError,
    MetadataError,
    NixlError,
    NotConnectedError,
    nixl_call,
)
from kvplan_nixl.handles import Handles
from kvplan_nixl.handshake import CTRL, HELLO, Handshake
from kvplan_nixl.notifications import Notification, NotificationRouter
from kvplan_nixl.parts import RequestTransfer
from kvplan_nixl.peers import Peer, PeerTable
from kvplan_nixl.posting import Poster
from kvplan_nixl.reserved import STAGED, unserved_answer
from kvplan_nixl.routes import Route, RouteTable
from kvplan_nixl.transfer import Transfer

__all__ = ["Endpoint", "Notification", "Peer"]


class Endpoint:
    """One rank of one engine: NIXL agent, registered regions, connected peers.

    ``rank`` is a flat rank in ``[0, spec.num_ranks)``, ``pp_rank * tp_size + tp_rank``; the
    rank holds only the regions of its pipeline stage (``spec.regions_on(rank)``).
    ``buffers``: one per *buffer of the spec* the rank holds (``spec.buffers``), by name or in
    spec order, of ``spec.rank_buffer_nbytes(b)`` bytes: a contiguous torch tensor (CPU ->
    DRAM, CUDA -> VRAM), a C-contiguous numpy array or an ``(address, nbytes)`` pair, checked
    before NIXL is touched (:mod:`kvplan_nixl.buffers`; a :class:`BufferSizeError`).
    ``memory``: which buffer is where, ``{buffer or region name: "DRAM" | "VRAM"}``
    (``mem_types`` per buffer; ``mem_type``, the one type or None for two). The buffers must
    outlive the endpoint. ``telemetry=True`` records NIXL's descriptor counts.
    ``spread_pcp=False``: pull maps read PCP replica 0 only (by default, all replicas).

    ``secret`` (bytes or str, shared by every endpoint of a deployment) signs :meth:`metadata`,
    makes :meth:`connect` refuse metadata not signed with it before NIXL sees a byte, and seals
    every notification (docs/executor.md, "Trust boundary"). ``progress_thread=True`` lets
    NIXL progress transfers and notifications on its own thread (it spins one core at 100%);
    by default the endpoint is progressed by its own calls (``Transfer.wait``/``poll``,
    :meth:`progress`, :meth:`notifications`). ``num_threads`` (int >= 0; 0 keeps NIXL's
    default): UCX threads sharing a transfer's posting. ``app``: a few ``{name: value}``
    strings :meth:`metadata` advertises, signed with the layout, for the application's own
    check of a peer (KvplanConnector: its vLLM version, kvplan_nixl/vllm/versions.py).
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
        memory: Mapping[str, str] | None = None,
        spread_pcp: bool = True,
        app: Mapping[str, str] | None = None,
    ) -> None:
        spec = _check_args(engine, spec, rank, num_threads, backends, memory, spread_pcp)
        self.app = md.check_app(app or {}, f"Endpoint {engine!r} rank {rank}")
        self._secret = md.check_secret(secret)
        allocs = resolve_buffers(spec, rank, buffers,
                                 declared_memory(spec, memory, md.MEM_TYPES))
        self.engine, self.spec, self.rank = engine, spec, rank
        self.telemetry, self.progress_thread = bool(telemetry), bool(progress_thread)
        self.num_threads = num_threads
        self.mem_types, self.mem_type = _memory_types(spec, allocs)
        self._bases, self._nbytes, self._devices, self._v_bases = _layout(spec, rank, allocs)
        self._buffers = [b for b, _ in allocs.values()]  # keep them alive while registered
        regs = [reg for _, reg in allocs.values()]
        self.agent_name = md.agent_name(engine, rank, f"{os.getpid():x}{secrets.token_hex(4)}")
        label = f"{engine!r} rank {rank}"
        _wire(self, label, spread_pcp)
        self._agent = None
        with nixl_call("agent creation", f"backends {list(backends)}"):
            agent = make_agent(self.agent_name, tuple(backends), self.telemetry,
                               self.progress_thread, num_threads)
        self._regs = _register(agent, backends, regs, f"{engine} rank {rank}", self._handles)
        self._agent = agent

    # -- identity and peers ------------------------------------------------------------------

    def metadata(self) -> bytes:
        """What a peer passes to ``connect``: versioned, checksummed (signed under the secret),
        a few hundred bytes + spec."""
        agent = self._require()
        with nixl_call("get_agent_metadata"):
            agent_md = agent.get_agent_metadata()
        return md.encode(md.PeerInfo(
            engine=self.engine, rank=self.rank, agent=self.agent_name, spec=self.spec,
            mem_type=self.mem_type or next(m for m in self.mem_types if m),
            memory=self.mem_types if self.mem_type is None else (), bases=self._bases,
            nbytes=self._nbytes, devices=self._devices, agent_metadata=agent_md,
            v_bases=self._v_bases if any(self._v_bases) else (), app=self.app), self._secret)

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
        return self._handshake.connect(self._require(), metadata, check_mode(mode))

    def connect_foreign(self, engine: str, rank: int, spec: EngineSpec | Mapping[str, Any],
                        buffers: Sequence[Any] | Mapping[str, Any], agent_metadata: bytes, *,
                        mode: str | Mode = "pull", memory: Mapping[str, str] | None = None,
                        device: int = 0) -> Peer:
        """Add rank ``rank`` of ``engine``, run by another connector (vLLM's NixlConnector):
        its ``spec``, its ``buffers`` as ``(address, nbytes)`` by buffer name (in ``memory``'s
        types, on NIXL device ``device``) and its agent's NIXL metadata, as the caller read
        them from that connector (no signature is checked). Unlike :meth:`connect`'s peers it
        is sent no hello or close notice, and messages reach it as given, never sealed."""
        info = _foreign_info(engine, rank, spec, buffers, agent_metadata, memory, device)
        return self._handshake.attach(self._require(), info, check_mode(mode), foreign=True)

    def map(self, remote: str, mode: str | Mode = "pull") -> TransferMap:
        """The TransferMap connect built for ``remote`` (make plans with its ``plan``)."""
        return self._route(check_str("remote", remote), check_mode(mode)).map

    def peers(self) -> tuple[Peer, ...]:
        """The connected peer ranks, ordered by (engine, rank)."""
        return self._peers.sorted()

    def disconnect(self, remote: str, rank: int) -> None:
        """Forget one peer rank: its transfers fail, its lists go (its hello keeps it known)."""
        agent, key = self._require(), (check_str("remote", remote), check_int("rank", rank))
        if (peer := self._peers.peers.get(key)) is None:
            raise NotConnectedError(f"engine {remote!r} rank {rank} is not connected")
        self._peers.drop(agent, peer, park=True)  # alive: NIXL keeps it for a reconnect

    def on_peer_gone(self, fn: Callable[[str, int, str], None] | None) -> None:
        """Call ``fn(engine, rank, why)`` once a connected peer rank went on its own (its close
        notice came: stopped or restarted), inside the call that progressed; None: stop."""
        self._handshake.gone = fn  # (a serving layer connects that engine afresh next time)

    @property
    def ignored_notices(self) -> int:
        """Notifications ignored, all reasons of :meth:`stats` together."""
        return sum(self.stats().values())

    def stats(self) -> dict[str, int]:
        """Notifications dropped since construction, by why: ``unknown`` (from an agent that
        is neither a connected peer nor a verified initiator), ``unsigned``, ``forged`` (its
        tag does not verify under the secret), ``replayed`` (a counter seen before, or of an
        older connection), ``control`` (a control notice that made no sense: a hello carrying
        another agent's metadata, a close from an agent not loaded), ``unserved`` (staged
        messages no Stager serves here; an OPEN is answered with a FAIL). See docs/executor.md."""
        return {**self._envelope.dropped, "control": self._handshake.ignored,
                "unserved": self._unserved_count}

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
        return self._poster.post(plan, remote, Mode.PULL, notify, timeout)

    def write(
        self,
        plan: TransferPlan,
        remote: str,
        *,
        notify: bytes | None = None,
        timeout: float | None = None,
    ) -> Transfer:
        """Push: post the writes of ``plan`` (made by this rank's push map for ``remote``)."""
        return self._poster.post(plan, remote, Mode.PUSH, notify, timeout)

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
        notify, timeout = check_request(remote, notify, timeout)
        if not isinstance(plan, TransferPlan):
            raise ArgumentError(f"plan must be a kvplan.TransferPlan, got {type(plan).__name__}")
        self._route(remote, plan.map.mode)  # connected in that mode, or NotConnectedError
        deadline = None if timeout is None else time.monotonic() + timeout
        return RequestTransfer(self._poster, plan, remote, notify, deadline)

    def notify(self, remote: str, ranks: int | Iterable[int], message: bytes | str) -> None:
        """Send ``message`` to ``ranks`` of connected ``remote``, no transfer: :func:`_notify`."""
        _notify(self, remote, ranks, message)

    # -- notifications and progress ----------------------------------------------------------

    def progress(self) -> int:
        """Progress this agent (a target must be progressed) and queue new notifications."""
        agent = self._agent
        return 0 if agent is None else self._router.progress(agent)

    def notifications(self) -> list[Notification]:
        """Messages peers attached to transfers that completed here, oldest first (drained)."""
        self.progress()
        return self._router.drain()

    def _hook(self, prefix: bytes, fn: Callable[[str, bytes], None] | None) -> None:
        """Internal: hand messages starting with ``prefix`` (5 bytes) to ``fn(agent_name,
        message)`` instead of :meth:`notifications` (a protocol layered on this endpoint: the
        staged executor's ``kvs1``; None: its owner closed, a reserved prefix is dropped)."""
        self._router.hooks[prefix] = fn

    def _deliver(self, agent_name: str, message: bytes) -> None:
        """Internal: queue ``message`` for :meth:`notifications` as if NIXL had delivered it
        from ``agent_name`` (a layered protocol delivering a user's ``notify``)."""
        self._router.deliver(agent_name, message)

    def _seal(self, agent_name: str, message: bytes) -> bytes:
        """Internal: ``message`` as it must leave for agent ``agent_name`` (sealed under the
        secret: a layered protocol's messages, sent or attached to its transfers)."""
        return self._envelope.seal(agent_name, message)

    # -- resources ---------------------------------------------------------------------------

    def handles(self) -> dict[str, int]:
        """Live NIXL objects this endpoint holds, by kind (all 0 after close)."""
        live = self._handles.live
        return {**{k: live[k] for k in ("xfer", "dlist", "remote_agents", "registrations")},
                "transfers": len(self._poster.transfers)}

    def close(self) -> None:
        """Tell peers, fail pending transfers, release every handle and list, forget peers,
        deregister and destroy the NIXL agent. Every agent loaded here but a foreign one gets
        a close notice: at its next ``progress`` it fails its transfers with this endpoint,
        naming their blocks, and drops the peer (docs/executor.md, "Close")."""
        agent = self._agent
        if agent is None:
            return
        errors: list[BaseException] = []
        try:  # peers that closed first are dropped now, not sent a notice they cannot receive
            self.progress()
        except Exception as exc:
            errors.append(exc)
        self._handshake.send_close(agent, flush=not self.progress_thread)
        self._poster.cancel_all("endpoint closed")
        self._peers.close(agent, "endpoint closed", errors)
        self._routes_table.close(errors)
        _deregister(agent, self._regs, self._handles, errors)
        self._regs = []
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
        state = "closed" if self._agent is None else f"{len(self._peers.peers)} peers"
        pp = f", pp={self.spec.pp_size}" if self.spec.pp_size > 1 else ""
        return f"Endpoint({self.engine!r}, rank={self.rank}, tp={self.spec.tp_size}{pp}, {state})"

    # -- internals (the staged executor builds on them) ----------------------------------------

    def _require(self) -> Any:
        if self._agent is None:
            raise ClosedError(f"endpoint {self.engine!r} rank {self.rank} is closed")
        return self._agent

    def _agent_or_none(self) -> Any | None:
        return self._agent

    def _route(self, remote: str, mode: Mode) -> Route:
        return self._routes_table.get(remote, mode)

    def _check_plan(self, plan: TransferPlan, route: Route, remote: str, mode: Mode) -> None:
        self._routes_table.check_plan(plan, route, remote, mode)


def _notify(ep: Endpoint, remote: Any, ranks: Any, message: Any) -> None:
    """:meth:`Endpoint.notify` (sealed as a transfer's notify, unordered with transfers in
    flight): ``ranks`` an int or ints, ``message`` bytes or str (a reserved
    prefix refused, as a transfer's ``notify``); a rank never connected raises
    :class:`NotConnectedError` and nothing is sent."""
    check_str("remote", remote)
    msg = check_notify(message)
    if msg is None:
        raise ArgumentError("notify: message must be bytes or str, got None")
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        raise ArgumentError(f"notify: ranks must be ints, got {ranks!r}")
    ep._require()
    known = {r for (e, r) in ep._peers.peers if e == remote}
    missing = sorted(set(ranks) - known)
    if missing:
        raise NotConnectedError(f"notify: ranks {missing} of engine {remote!r} are not "
                                f"connected to {ep.engine!r} rank {ep.rank}; connected: "
                                f"{sorted(known)}")
    ep._poster.notify(remote, ranks, msg)


def _wire(ep: Endpoint, label: str, spread_pcp: bool) -> None:
    """Build ``ep``'s collaborators and wire them together (see the module doc): every message
    leaves through the envelope's ``seal`` and arrives through its ``open``."""
    ep._handles = handles = Handles()
    ep._unserved_count = 0
    ep._peers = peers = PeerTable(handles)
    ep._routes_table = routes = RouteTable(
        ep.engine, ep.spec, ep.rank, handles, bases=ep._bases, nbytes=ep._nbytes,
        devices=ep._devices, v_bases=ep._v_bases, memory=ep.mem_types,
        spread_pcp=spread_pcp)
    ep._routes = routes.routes
    ep._envelope = env = Envelope(ep.agent_name, ep._secret, peers.loaded.__contains__, HELLO,
                                  peers.foreign.__contains__)
    peers.on_unload(env.retire)
    ep._handshake = Handshake(ep.agent_name, ep._secret, peers, routes, ep.metadata,
                              ep.progress, env.seal)
    ep._router = NotificationRouter(
        CTRL, lambda name, m: ep._handshake.on_control(ep._agent, name, m), env.open,
        reserved={STAGED: lambda name, m: _unserved(ep, name, m)})
    ep._poster = Poster(label, ep.rank, routes, peers, handles, lambda: ep._agent, ep.progress,
                        ep.telemetry, env.seal)
    peers.on_drop(ep._poster.drop_peer)  # transfers with a dropped peer fail,
    peers.on_drop(routes.drop_peer)  # then its lists are released


def _unserved(ep: Endpoint, agent_name: str, message: bytes) -> None:
    """A staged message with no Stager on ``ep`` to serve it: dropped, counted (``unserved``),
    never a user notification; an OPEN is answered with a FAIL at once so that its initiator
    fails now, naming this endpoint (best effort: a peer gone learns nothing)."""
    ep._unserved_count += 1
    answer = unserved_answer(message, f"engine {ep.engine!r} rank {ep.rank}")
    agent = ep._agent
    if answer is None or agent is None:
        return
    try:
        with nixl_call("send_notif", agent_name):
            agent.send_notif(agent_name, ep._envelope.seal(agent_name, answer))
    except NixlError:
        pass



def _foreign_info(engine: Any, rank: Any, spec: Any, buffers: Any, agent_metadata: Any,
                  memory: Any, device: Any) -> md.PeerInfo:
    """:meth:`Endpoint.connect_foreign`'s arguments checked, as the peer's metadata would say
    them (buffers resolved as the Endpoint's own are)."""
    sp = _check_args(engine, spec, rank, 0, ("UCX",), memory, True)
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ArgumentError(f"device must be an int >= 0, got {device!r}")
    if not isinstance(agent_metadata, (bytes, bytearray)):
        raise ArgumentError(f"agent_metadata must be bytes, got "
                            f"{type(agent_metadata).__name__}")
    name = md.nixl_agent_name(bytes(agent_metadata))
    if name is None:
        raise MetadataError(f"engine {engine!r} rank {rank}: agent_metadata is not NIXL "
                            "agent metadata")
    allocs = resolve_buffers(sp, rank, buffers, declared_memory(sp, memory, md.MEM_TYPES))
    kinds, one = _memory_types(sp, allocs)
    bases, nbytes, _, v_bases = _layout(sp, rank, allocs)
    return md.PeerInfo(
        engine=engine, rank=rank, agent=name, spec=sp,
        mem_type=one or next(m for m in kinds if m), memory=kinds if one is None else (),
        bases=bases, nbytes=nbytes, devices=tuple(device if n else 0 for n in nbytes),
        agent_metadata=bytes(agent_metadata), v_bases=v_bases if any(v_bases) else ())


def _layout(spec: EngineSpec, rank: int, allocs: Mapping[int, Any]) -> tuple[tuple[int, ...], ...]:
    """Per region index: (bases, nbytes, devices, V bases) of the rank's resolved buffers
    (pooled regions share their pool's; 0 for regions of another stage)."""
    n = len(spec.regions)
    bases, nbytes, devices, v_bases = [0] * n, [0] * n, [0] * n, [0] * n
    for i in spec.regions_on(rank):
        addr, size, dev, _ = allocs[spec.buffer_of(i)][1]
        bases[i], nbytes[i], devices[i] = addr, size, dev
        if spec.regions[i].separate_kv:  # its V buffer: a ladder entry of its own
            v_bases[i] = allocs[spec.buffer_of(i, 1)][1][0]
    return tuple(bases), tuple(nbytes), tuple(devices), tuple(v_bases)


def _memory_types(spec: EngineSpec,
                  allocs: Mapping[int, Any]) -> tuple[tuple[str, ...], str | None]:
    """Per buffer of the spec, the NIXL memory type of the rank's resolved buffer ("" for
    buffers of other stages); and the rank's one memory type, None when it holds two."""
    kinds = tuple(allocs[b][1][3] if b in allocs else "" for b in range(len(spec.buffers)))
    mems = sorted({m for m in kinds if m})
    return kinds, (mems[0] if len(mems) == 1 else None)


def _register(agent: Any, backends: Sequence[str], regs: list, who: str,
              handles: Handles) -> list[Any]:
    """Check the agent has every backend asked for, then register the rank's buffers: one
    registration per memory type (NIXL registers a list of one type), counted in ``handles``.
    A failure deregisters those already made."""
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise NixlError("create_backend", "NIXL_ERR_NOT_FOUND", f"no backend {missing}")
    out: list[Any] = []
    try:
        for mem in sorted({r[3] for r in regs}):
            mine = [(a, n, d, "") for a, n, d, m in regs if m == mem]
            with nixl_call("register_memory", f"{len(mine)} {mem} allocations of {who}"):
                out.append(agent.register_memory(mine, mem))
            handles.live["registrations"] += 1
    except BaseException:
        _deregister(agent, out, handles, [])  # best effort: the agent is destroyed next
        raise
    return out


def _deregister(agent: Any, regs: list[Any], handles: Handles,
                errors: list[BaseException]) -> None:
    """Deregister each registration of ``regs``, a failure appended to ``errors``."""
    for reg in regs:
        try:
            with nixl_call("deregister_memory"):
                agent.deregister_memory(reg)
            handles.live["registrations"] -= 1
        except Exception as exc:
            errors.append(exc)


def _check_args(engine: Any, spec: Any, rank: Any, num_threads: Any, backends: Any,
                memory: Any, spread_pcp: Any) -> EngineSpec:
    """Refuse bad constructor arguments (before anything is allocated); the spec as a value."""
    check_names("backends", backends)
    if not isinstance(spread_pcp, bool):
        raise ArgumentError(f"spread_pcp must be a bool, got {type(spread_pcp).__name__}")
    if memory is not None and not isinstance(memory, Mapping):
        raise ArgumentError(f"memory must be a mapping of buffer name to 'DRAM' or 'VRAM', "
                            f"got {type(memory).__name__}")
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 0:
        raise ArgumentError(f"num_threads must be a non-negative int (0: NIXL's default), "
                            f"got {num_threads!r}")
    if not isinstance(engine, str) or not engine:
        raise ArgumentError(f"engine must be a non-empty name, got {engine!r}")
    if isinstance(spec, Mapping):
        spec = EngineSpec.from_dict(spec)
    if not isinstance(spec, EngineSpec):
        raise ArgumentError(f"spec must be an EngineSpec or its dict, got {type(spec).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < spec.num_ranks:
        pp = f" (tp {spec.tp_size} x pp {spec.pp_size})" if spec.pp_size > 1 else ""
        raise ArgumentError(
            f"rank {rank!r} is not in [0, {spec.num_ranks}) of engine {engine!r}{pp}"
        )
    return spec
