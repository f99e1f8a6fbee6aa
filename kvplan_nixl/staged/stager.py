"""Stager: the facade of the staged executor for one Endpoint (see :mod:`kvplan_nixl.staged`).

Owns one of each collaborator (the registered pool, the channel, the leg runner, the initiator
and the server) and wires them together; routes each staged message to the side it concerns;
chooses direct or staged (the cost model per peer, then what ``measured`` timed). It holds
no request state of its own and makes no NIXL transfer itself. It may not be imported by any
other module of the staged executor (they receive what they need from it: callbacks,
collaborators).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import numpy as np
import torch

from kvplan import Mode, TransferPlan, check_plan
from kvplan.staging import Costs, prefer_staged
from kvplan_nixl.arguments import (
    check_choice,
    check_int,
    check_request,
    check_str,
    check_timeout,
)
from kvplan_nixl.buffers import memory_text
from kvplan_nixl.endpoint import Endpoint
from kvplan_nixl.errors import ArgumentError, BufferSizeError, NixlError
from kvplan_nixl.staged import legs
from kvplan_nixl.staged import protocol as proto
from kvplan_nixl.staged.calibration import calibrate
from kvplan_nixl.staged.channel import Channel
from kvplan_nixl.staged.initiator import Initiator
from kvplan_nixl.staged.measured import Measured
from kvplan_nixl.staged.pool import PIECE, RegisteredPool
from kvplan_nixl.staged.runner import LegRunner
from kvplan_nixl.staged.server import Server
from kvplan_nixl.staged.transfer import MixedTransfer, StagedTransfer
from kvplan_nixl.transfer import drive

__all__ = ["DEFAULT_COSTS", "Stager"]

#: Costs assumed before any measurement: UCX over CMA on one host (2.5 us per descriptor,
#: 10 GB/s), local index copies at 4 GB/s, 1 ms per chunk (a notification round trip with a
#: peer that polls about every millisecond, as tests/nixl_peer.py does).
DEFAULT_COSTS = Costs(per_descriptor=2.5e-6, per_byte=1e-10, local_per_byte=2.5e-10,
                      per_chunk=1e-3)


class Stager:
    """Staged transfers for one :class:`~kvplan_nixl.Endpoint` (see the module doc).

    ``pool_bytes`` of staging memory (on the device of the endpoint's buffers) are allocated
    and registered now, in slots of ``slot_bytes`` (a multiple of 4096 dividing
    ``pool_bytes``); create the Stager before handing out ``endpoint.metadata()`` (a peer's
    NIXL metadata must include the pool). Both sides of a peer pair need a Stager with the same
    ``slot_bytes`` and must be connected to each other (each ``connect``s the other's
    metadata: the initiator in its mode, the server in the other). ``window`` bounds the chunks
    of one request in flight per peer. ``cpu_threads``: torch intra-op threads of the local
    legs on CPU memory (``None``: torch's setting; see ``legs.cpu_threads``). ``overlap``: run
    the local legs on a worker thread, so that gathering or scattering one chunk overlaps the
    NIXL transfer of another (``False``: inline, on the polling thread). ``close()`` before the
    endpoint's. A request's ``notify`` reaches each peer rank's ``Endpoint.notifications()``
    once, when that rank's part is complete, as in direct mode (see :meth:`read`).
    """

    def __init__(self, endpoint: Endpoint, *, pool_bytes: int = 64 << 20,
                 slot_bytes: int = 16 << 20, window: int = 2,
                 cpu_threads: int | None = 1, overlap: bool = True) -> None:
        check_int("pool_bytes", pool_bytes, low=1)
        check_int("slot_bytes", slot_bytes, low=1)
        if slot_bytes % PIECE or pool_bytes < slot_bytes or pool_bytes % slot_bytes:
            raise ArgumentError(
                f"slot_bytes ({slot_bytes}) must be a positive multiple of {PIECE} dividing "
                f"pool_bytes ({pool_bytes})")
        check_int("window", window, low=1)
        if cpu_threads is not None:
            check_int("cpu_threads", cpu_threads, low=1)
        if not isinstance(overlap, bool):
            raise ArgumentError(f"overlap must be a bool, got {overlap!r}")
        if not isinstance(endpoint, Endpoint):
            raise ArgumentError(f"endpoint must be a kvplan_nixl.Endpoint, got "
                                f"{type(endpoint).__name__}")
        if endpoint.mem_type is None:  # its legs gather every buffer into one pool's memory
            raise BufferSizeError(
                f"staged transfers need the buffers of {endpoint!r} in one memory kind; it "
                f"holds {memory_text(endpoint.spec, endpoint.mem_types)}: use direct transfers")
        self.ep = endpoint
        agent = endpoint._require()
        self.window = window
        self.cpu_threads = cpu_threads
        self.slot_bytes = slot_bytes
        buffers = _buffer_tensors(endpoint)
        device = next(iter(buffers.values())).device if buffers else torch.device("cpu")
        self._pool = RegisteredPool(agent, pool_bytes, slot_bytes, device, endpoint.mem_type)
        self.pool = self._pool.slots
        self.costs: dict[str, Costs] = {}
        #: seconds per byte of each mode by request shape, from completed requests: what
        #: ``how="auto"`` picks by once both modes were measured (see ``staged.measured``)
        self.measured = Measured()
        #: why the last ``how="auto"`` request went the way it did
        self.last_choice = ""
        self._ids = itertools.count()
        self._asking: set[str] = set()  # calibration nonces awaiting POOL
        self.channel = Channel(endpoint)
        self.legs = LegRunner(self.pool, buffers, cpu_threads, overlap)
        self._initiator = Initiator(endpoint, self._pool, self.legs, self.channel, self._ids,
                                    self.poll)
        self._server = Server(endpoint, self._pool, self.legs, self.channel, window)
        #: staged messages dropped, by why (see :meth:`stats`)
        self._dropped = {"malformed": 0, "stray": 0}
        endpoint._peers.on_unload(self._peer_gone)
        endpoint._peers.on_drop(self._peer_dropped)

    # -- public ------------------------------------------------------------------------------

    def read(self, plan: TransferPlan, remote: str, *, notify: bytes | None = None,
             timeout: float | None = None) -> StagedTransfer:
        """Pull ``plan`` (from this rank's pull map for ``remote``) through staging.

        ``notify`` is delivered to each peer rank (the source; its ``Endpoint.notifications()``,
        as ``Notification(engine, rank, message)`` naming this rank) once that rank saw this
        side take its last chunk, as a direct ``Endpoint.read`` delivers it; never on failure.
        """
        notify, timeout = check_request(remote, notify, timeout)
        return self._initiator.start(plan, remote, Mode.PULL, timeout, notify)

    def write(self, plan: TransferPlan, remote: str, *, notify: bytes | None = None,
              timeout: float | None = None) -> StagedTransfer:
        """Push ``plan`` (from this rank's push map for ``remote``) through staging.

        ``notify`` is delivered to each peer rank (the destination) once its last chunk is
        scattered into its KV cache, as a direct ``Endpoint.write`` delivers it; never on
        failure.
        """
        notify, timeout = check_request(remote, notify, timeout)
        return self._initiator.start(plan, remote, Mode.PUSH, timeout, notify)

    def post(self, plan: TransferPlan, remote: str, *, how: str = "auto",
             notify: bytes | None = None, timeout: float | None = None):
        """Read (pull plan) or write (push plan) ``plan`` directly or staged.

        ``how``: ``"direct"``, ``"staged"`` or ``"auto"``. ``auto`` first decides per peer
        rank with :meth:`staged_peers` and the costs of ``remote`` (measured by
        :meth:`calibrate`, else :data:`DEFAULT_COSTS`); every request posted here is timed
        once complete, and once requests of the same shape (engine, direction, mean run size)
        were moved both direct and staged, auto takes the mode measured faster, re-measuring
        the other one request in 16 (:mod:`kvplan_nixl.staged.measured`; why the last auto
        request went its way: :attr:`last_choice`). Returns a :class:`~kvplan_nixl.Transfer`,
        a :class:`StagedTransfer`, or, when ``auto`` stages only some peers, a
        :class:`MixedTransfer` of the two (the plan's runs split by peer rank). ``notify``
        reaches every peer rank once, by whichever part serves it (see :meth:`read`).
        """
        check_choice("how", how, ("auto", "direct", "staged"))
        notify, timeout = check_request(remote, notify, timeout)
        if not isinstance(plan, TransferPlan):
            raise ArgumentError(f"plan must be a kvplan.TransferPlan, got {type(plan).__name__}")
        key = Measured.shape(remote, plan.map.mode.value, len(plan), plan.nbytes)
        choices = None
        if how == "auto":  # the cost model evaluated once per request (not per decision step)
            choices = self._choices(plan, remote)
            how, self.last_choice = self._auto(plan, remote, key, choices)
        t = _post(self, plan, remote, how, notify, timeout, choices)
        self.measured.watch(t, key, how, plan.nbytes)
        return t

    def _auto(self, plan: TransferPlan, remote: str, key: tuple,
              shapes: list) -> tuple[str, str]:
        """(mode, why) of an auto request: the cost model's choice until both modes were
        measured for requests of its shape, then the one measured faster (``measured``)."""
        if not any(runs > max(chunks, 1) for _, runs, _, chunks, _ in shapes):
            return "direct", "at most one run per chunk: nothing to gather"
        staged = set(self.staged_peers(plan, remote, shapes))
        model = "direct" if not staged else "staged" if staged == set(plan.peers) else "mixed"
        return self.measured.pick(key, model)

    def staged_peers(self, plan: TransferPlan, remote: str,
                     choices: list | None = None) -> tuple[int, ...]:
        """The peer ranks of ``plan`` for which the cost model predicts staging beats direct
        posting (``kvplan.staging.prefer_staged`` with that peer's runs, bytes and chunks;
        ``choices``: those verdicts, when the caller computed them already)."""
        choices = self._choices(plan, remote) if choices is None else choices
        return tuple(peer for peer, *_, wins in choices if wins)

    def prefer(self, plan: TransferPlan, remote: str) -> bool:
        """True when the cost model predicts staging ``plan`` beats posting it directly.

        Decided per peer rank (each peer's runs and bytes); the plan is staged when most of
        its bytes go to peers where staging wins. Plans with at most one run per chunk stay
        direct (``kvplan.staging.prefer_staged``).
        """
        won = total = 0
        for _, _, nbytes, _, wins in self._choices(plan, remote):
            total += nbytes
            won += nbytes if wins else 0
        return total > 0 and 2 * won > total

    def _choices(self, plan: TransferPlan, remote: str
                 ) -> list[tuple[int, int, int, int, bool]]:
        """Per peer rank of ``plan``: (rank, runs, bytes, chunks, whether staging wins)."""
        if not isinstance(plan, TransferPlan):
            raise ArgumentError(f"plan must be a kvplan.TransferPlan, got {type(plan).__name__}")
        return _peer_choices(plan, self.costs.get(remote, DEFAULT_COSTS), self.slot_bytes,
                             self.pool.tensor.is_cuda)

    def calibrate(self, remote: str, *, progress: Iterable[Any] = (), timeout: float = 10.0
                  ) -> Costs:
        """Measure the costs :meth:`prefer` weighs against one connected peer rank of
        ``remote`` and store them in ``self.costs[remote]``; see
        :func:`kvplan_nixl.staged.calibration.calibrate` (``progress``: other Stagers of this
        process to poll meanwhile, as the peer's Stager must be polled)."""
        check_str("remote", remote)
        self.costs[remote] = costs = calibrate(
            self.ep, self._pool, self._hello, self._asking, self.poll, remote,
            cpu_threads=self.cpu_threads, progress=progress, timeout=timeout)
        return costs

    def poll(self) -> int:
        """Progress the endpoint, handle protocol messages, advance transfers, enforce
        deadlines. Never blocks; the initiator and the server both call it (or a ``wait``).

        Returns how many things happened (messages handled, legs finished, chunk transfers
        completed): a polling loop that got 0 may nap, one that got more should poll again
        soon (``transfer.drive`` does both; :data:`kvplan_nixl.transfer.WAKE` is set when a
        leg finishes, to end a nap early)."""
        if self.ep.closed:
            return 0
        n = self.ep.progress() + self.legs.reap()
        for agent_name, msg in self.channel.drain():
            self._handle(agent_name, msg)
            n += 1
        now = time.monotonic()
        n += self._initiator.step(now)
        self._server.step(now)
        self.measured.reap()  # after the step that stamps a transfer's end; not work done
        return n

    def progress(self) -> int:
        """:meth:`poll`, under the name ``Transfer.wait(progress=...)`` calls on endpoints, so a
        Stager can be passed where an Endpoint is expected."""
        return self.poll()

    def serve(self, until: Callable[[], bool], *, timeout: float | None = None) -> bool:
        """Poll on this thread until ``until()`` returns true (checked after every poll): the
        loop of a rank that answers staged requests without waiting on its own (a prefill
        rank under pull, a decode rank under push), run on its endpoint's thread.

        Naps as every ``wait`` does (:func:`kvplan_nixl.transfer.drive`): 10 us after a poll
        that did something, doubling to 1 ms while idle, woken at once when a leg ends; a
        server polled less often adds its period to every chunk it serves. User notifications
        stay queued for ``endpoint.notifications()`` (``until`` may drain them). Returns False
        when ``timeout`` seconds passed first."""
        if not callable(until):
            raise ArgumentError(f"until must be a callable returning a bool, got {until!r}")
        timeout = check_timeout("timeout", timeout)
        limit = None if timeout is None else time.monotonic() + timeout
        return drive(self.poll, until, (), limit)

    def handles(self) -> dict[str, int]:
        """What this stager holds: slots in use, NIXL transfers in flight, descriptor lists
        (its own pool's and one per peer pool it learnt), requests (as initiator and as
        server), registrations. Idle: no slot, transfer or request; after close: all 0."""
        live = self._pool.handles.live
        return {"slots_in_use": self.pool.in_use, "xfer": live["xfer"],
                "dlist": live["dlist"], "requests": len(self._initiator.mine),
                "serving": len(self._server.served), "registrations": live["registrations"]}

    def stats(self) -> dict[str, int]:
        """Staged messages dropped since construction, by why: ``malformed`` (fields that do
        not parse or are out of bounds: answered with a FAIL or ABORT of the request it names),
        ``stray`` (naming no request of its sender, a chunk not in flight, a repeated OPEN or
        credit, a POOL nobody asked for). What the endpoint's envelope dropped before (unknown
        senders, forged, replayed) is in ``Endpoint.stats()``."""
        return dict(self._dropped)

    def close(self) -> None:
        """Fail every request (telling peers), release lists, deregister the pool."""
        self.ep._peers.off_unload(self._peer_gone)
        self.ep._peers.off_drop(self._peer_dropped)
        self._initiator.close()
        self._server.close()
        self.channel.close()
        self.legs.close()  # legs still running write into the pool: let them end
        self._pool.close(self.ep._agent_or_none())

    def __enter__(self) -> Stager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- messages ----------------------------------------------------------------------------

    def _handle(self, agent_name: str, msg: bytes) -> None:
        """Route one staged message to the side it concerns; count a stray one, answer a
        malformed one (never raise: a genuine ``wait`` polls here)."""
        m = proto.decode(msg)
        try:
            if m.op == "OPEN":
                handled = self._server.on_open(agent_name, m)
            elif m.op in ("DATA", "TAKEN", "ABORT"):
                handled = self._server.on_message(agent_name, m)
            elif m.op == "PING":  # a liveness probe (see initiator.PROBE_S): nothing to answer
                handled = True
            elif m.op == "HELLO":  # calibration: tell the asker where this pool is
                handled = self.channel.send(agent_name, self._pool.info().encode("POOL", m.rid))
            elif m.op == "POOL":
                handled = m.rid in self._asking  # only the answer to our own HELLO
                if handled:
                    self._pool.learn(self.ep._agent_or_none(), agent_name,
                                     proto.PoolInfo.decode(m))
                    self._asking.discard(m.rid)
            else:
                handled = self._initiator.on_message(agent_name, m)
            if not handled:
                self._dropped["stray"] += 1
        except (IndexError, ValueError, OverflowError, NixlError) as exc:
            # a malformed message (or a pool NIXL refuses): refuse, never crash
            self._dropped["malformed"] += 1
            if m.fields:  # answer on the channel of the request it names
                back = "FAIL" if m.op in ("OPEN", "DATA", "TAKEN", "ABORT") else "ABORT"
                self.channel.send(agent_name,
                                  proto.encode(back, m.rid, f"malformed {m.op}: {exc}"))

    def _peer_gone(self, agent_name: str) -> None:
        """Agent ``agent_name`` was unloaded (disconnect, close notice, restart): its requests
        fail (as initiator, naming their blocks) or are dropped (as server), and its pool's
        list is released, so that a reconnected or restarted peer is learnt afresh."""
        self._initiator.peer_gone(agent_name)
        self._server.peer_gone(agent_name)
        self._pool.forget(agent_name)

    def _peer_dropped(self, peer: Any, _why: str, _errors: list[BaseException]) -> None:
        """Our route to ``peer`` went: our requests with it fail, its pool's list goes."""
        self._initiator.peer_gone(peer.agent)
        self._pool.forget(peer.agent)

    def _hello(self, agent_name: str) -> str | None:
        """Ask ``agent_name`` where its pool is (HELLO); the nonce, in ``_asking`` until the
        POOL comes (None: not sent)."""
        nonce = f"h{next(self._ids)}"
        if not self.channel.send(agent_name, proto.encode("HELLO", nonce)):
            return None
        self._asking.add(nonce)
        return nonce


def _post(st: Stager, plan: TransferPlan, remote: str, how: str, notify: bytes | None,
          timeout: float | None, choices: list | None = None):
    """Post ``plan`` ``how`` (``direct``, ``staged`` or ``mixed``: the peers the cost model
    stages staged, the others direct; ``choices``: its per-peer verdicts already computed)
    through ``st``."""
    post = st.ep.read if plan.map.mode is Mode.PULL else st.ep.write
    staged = st.staged_peers(plan, remote, choices) if how == "mixed" else ()
    if how == "mixed" and not staged:  # the costs changed since the mix was measured
        how = "direct"
    elif how == "mixed" and set(staged) == set(plan.peers):
        how = "staged"
    if how == "mixed":  # the peers the cost model stages staged, the others direct
        direct = [r for r in plan.peers if r not in staged]
        # post the staged part first: its OPENs travel while the direct part runs
        sx = st._initiator.start(_subset(plan, staged), remote, plan.map.mode, timeout, notify)
        try:
            dt = post(_subset(plan, direct), remote, notify=notify, timeout=timeout)
        except BaseException:
            sx.cancel("the direct part could not be posted")
            raise
        return MixedTransfer(plan, dt, sx)
    if how == "direct":
        return post(plan, remote, notify=notify, timeout=timeout)
    return st._initiator.start(plan, remote, plan.map.mode, timeout, notify)


def _peer_choices(plan: TransferPlan, costs: Costs, slot_bytes: int, overlap: bool
                  ) -> list[tuple[int, int, int, int, bool]]:
    """:meth:`Stager._choices`: one pass per column (bincount), not a mask per peer, since it
    runs on every auto request."""
    rows = plan.copies()
    m = plan.map
    pull = m.mode is Mode.PULL
    peer = np.ascontiguousarray(rows["src_rank" if pull else "dst_rank"])
    n = (m.src if pull else m.dst).num_ranks
    if len(peer) and not 0 <= int(peer.min()) <= int(peer.max()) < n:
        check_plan(plan)  # an edited plan: refused with simulate's PlanError, naming the rank
    runs = np.bincount(peer, minlength=n)
    nbytes = np.bincount(peer, weights=np.ascontiguousarray(rows["length"]), minlength=n)
    out = []
    for p in np.flatnonzero(runs).tolist():
        b = int(nbytes[p])
        chunks = -(-b // slot_bytes)
        out.append((p, int(runs[p]), b, chunks,
                    prefer_staged(int(runs[p]), b, chunks, costs, overlap=overlap)))
    return out


def _buffer_tensors(endpoint: Endpoint) -> dict[int, torch.Tensor]:
    """The rank's buffers as flat byte tensors, by index in ``spec.buffers`` (the legs' rows
    name buffers; a region's K and V may live in two)."""
    by_addr = {}
    for buf in endpoint._buffers:
        t = legs.byte_tensor(buf)
        by_addr[t.data_ptr()] = t
    spec = endpoint.spec
    out: dict[int, torch.Tensor] = {}
    for i in spec.regions_on(endpoint.rank):
        out[spec.buffer_of(i)] = by_addr[endpoint._bases[i]]
        if spec.regions[i].separate_kv:
            out[spec.buffer_of(i, 1)] = by_addr[endpoint._v_bases[i]]
    return out


def _subset(plan: TransferPlan, peers) -> TransferPlan:
    """The same request restricted to the runs with ``peers`` (the map's lanes keep their
    order; a lane belongs to one peer rank, so lane bounds are only recounted)."""
    m = plan.map
    col = "src_rank" if m.mode is Mode.PULL else "dst_rank"
    keep = np.isin(plan.rows[col], list(peers))
    rows = plan.rows[keep]
    rows.flags.writeable = False
    lane_peer = np.array([lane.src_rank if m.mode is Mode.PULL else lane.dst_rank
                          for lane in m.lanes], dtype=np.int64)
    sizes = np.where(np.isin(lane_peer, list(peers)), np.diff(plan.lane_bounds), 0)
    bounds = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    bounds.flags.writeable = False
    return attrs.evolve(plan, rows=rows, lane_bounds=bounds)
