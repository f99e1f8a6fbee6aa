"""Staged transfers: a registered pool of staging slots, a notification protocol, torch legs.

Theory of operation. ``kvplan.staging.stage`` turns a plan into gather -> bulk -> scatter, in
chunks of one slot each. Both endpoints of a peer pair run a :class:`Stager` (one pool of
``pool_bytes`` in ``slot_bytes`` slots, registered with NIXL once, before the endpoint's
metadata is handed out). The side that planned (the *initiator*: the destination for pull,
the source for push) always posts the bulk NIXL transfer; the other side (the *server*) derives
the same legs for the pair from the block ids (push and pull plans agree on them) and runs its
local leg. Messages are NIXL notifications beginning with ``kvs1``:

push (initiator = source)               pull (initiator = destination)
  I -> S  OPEN rid, block ids             I -> S  OPEN rid, block ids
  S -> I  ACK rid, its pool               S -> I  ACK rid, its pool
  S -> I  GRANT rid k slot (a credit)     S       gathers chunk k into a slot
  I       gathers chunk k, WRITEs it      S -> I  READY rid k slot
          with notification DATA rid k    I       READs it with notification TAKEN rid k,
  S       scatters chunk k, frees slot            scatters it, frees its slot
  S -> I  DONE rid (all scattered)        S       frees its slot on TAKEN
  I -> S  ABORT rid reason / S -> I FAIL rid reason: free all the request holds

Credits. A slot is a credit. A side takes a slot only for a step that finishes on its own (a
posted transfer, a local copy), never while waiting for the other side, and the server hands
out at most ``window`` chunks of one request at a time, so requests interleave and queue
FIFO for slots, and no cycle of waits can form: a full pool delays, never deadlocks. With
``window`` 2 the gather of chunk k+1 runs while chunk k is in flight.

Failures. Every request ends DONE or FAILED per peer, naming the destination blocks. A NIXL
error, the deadline, ``cancel`` or ``close`` frees the request's slots and handles on this side
and sends FAIL to the other; a server also drops a request whose own deadline (the
initiator's timeout, or :data:`SERVE_TIMEOUT`) passes, so a dead initiator cannot hold its
slots.

The user's ``notify`` travels in the OPEN (after the block ids) and the server queues it into
its endpoint's ``notifications()`` when its part is DONE: push after the last scatter, pull on
the last TAKEN; never for a failed request.

Not thread-safe: drive a Stager (``poll``, or a transfer's ``wait``) from its endpoint's thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from kvplan import KVPlanError, Mode, TransferPlan
from kvplan.staging import Costs, prefer_staged, stage
from kvplan_nixl.staged import legs
from kvplan_nixl._nixl import NIXL_LOCAL
from kvplan_nixl.descriptors import Ladder, lower
from kvplan_nixl.errors import (
    NotConnectedError,
    is_nixl_error,
    nixl_call,
    nixl_code,
    release_counted,
)
from kvplan_nixl.staged.transfer import MixedTransfer, StagedTransfer, _Job, _Pool
from kvplan_nixl.transfer import WAKE, State, drive

if TYPE_CHECKING:
    from kvplan_nixl.endpoint import Endpoint

__all__ = ["DEFAULT_COSTS", "SERVE_TIMEOUT", "StagedTransfer", "Stager"]

#: Protocol tag: the first five bytes of every staged message.
TAG = b"kvs1 "
#: Bulk transfers are whole multiples of this many bytes (slots are too): one NIXL piece size
#: serves every chunk, so each chunk posts as exactly one descriptor.
PIECE = 4096
#: How long a server keeps a request whose initiator gave no timeout (seconds).
SERVE_TIMEOUT = 60.0
#: Costs assumed before any measurement: UCX over CMA on one host (2.5 us per descriptor,
#: 10 GB/s), local index copies at 4 GB/s, 1 ms per chunk (a notification round trip with a
#: peer that polls about every millisecond, as tests/nixl_peer.py does).
DEFAULT_COSTS = Costs(per_descriptor=2.5e-6, per_byte=1e-10, local_per_byte=2.5e-10,
                      per_chunk=1e-3)


def _encode(*fields: object, body: bytes = b"") -> bytes:
    return TAG + " ".join(str(f) for f in fields).encode() + (b"\n" + body if body else b"")


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
        if slot_bytes <= 0 or slot_bytes % PIECE or pool_bytes < slot_bytes or (
                pool_bytes % slot_bytes):
            raise ValueError(
                f"slot_bytes ({slot_bytes}) must be a positive multiple of {PIECE} dividing "
                f"pool_bytes ({pool_bytes})")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.ep = endpoint
        agent = endpoint._require()
        self.window = window
        self.cpu_threads = cpu_threads
        self._running: collections.deque = collections.deque()
        self.slot_bytes = slot_bytes
        # the rank's buffers as flat byte tensors, by index in spec.buffers (the legs' rows
        # name buffers; a region's K and V may live in two)
        by_addr = {}
        for buf in endpoint._buffers:
            t = legs.byte_tensor(buf)
            by_addr[t.data_ptr()] = t
        spec = endpoint.spec
        self._buffers: dict[int, torch.Tensor] = {}
        for i in spec.regions_on(endpoint.rank):
            self._buffers[spec.buffer_of(i)] = by_addr[endpoint._bases[i]]
            if spec.regions[i].separate_kv:
                self._buffers[spec.buffer_of(i, 1)] = by_addr[endpoint._v_bases[i]]
        device = next(iter(self._buffers.values())).device if self._buffers else torch.device(
            "cpu")
        # zeroed now: the pool's pages are faulted in once, not during the first requests
        self.pool = _Pool(torch.zeros(pool_bytes, dtype=torch.uint8, device=device), slot_bytes)
        t = self.pool.tensor
        self._mem = endpoint.mem_type
        self._dev = (t.device.index or 0) if t.device.type == "cuda" else 0
        with nixl_call("register_memory", f"staging pool of {pool_bytes} bytes"):
            self._reg = agent.register_memory([(t.data_ptr(), pool_bytes, self._dev, "")],
                                              self._mem)
        self._ladder = Ladder.build(["staging"], [pool_bytes], [PIECE])
        self._live = collections.Counter({"registrations": 1})
        try:
            self._local_dlist = self._prep(agent, NIXL_LOCAL, self._ladder.rows(
                [t.data_ptr()], self._dev), self._mem)
        except BaseException:
            agent.deregister_memory(self._reg)
            raise
        self._remote: dict[str, tuple[Ladder, Any]] = {}  # agent -> its pool's ladder, dlist
        self._ids = itertools.count()
        self._inbox: collections.deque[tuple[str, bytes]] = collections.deque()
        self._mine: dict[str, tuple[StagedTransfer, dict[int, _Job]]] = {}  # rid -> request
        self._served: dict[tuple[str, str], _Job] = {}  # (agent, rid) -> server job
        self.costs: dict[str, Costs] = {}
        self._hello: set[str] = set()  # calibration requests awaiting POOL
        # local legs on a worker thread, so gather/scatter of one chunk overlap NIXL on others
        self._worker = (concurrent.futures.ThreadPoolExecutor(1, "kvplan-staged-leg")
                        if overlap else None)
        endpoint._notif_hooks[TAG] = lambda agent_name, msg: self._inbox.append(
            (agent_name, msg))

    # -- public ------------------------------------------------------------------------------

    def read(self, plan: TransferPlan, remote: str, *, notify: bytes | None = None,
             timeout: float | None = None) -> StagedTransfer:
        """Pull ``plan`` (from this rank's pull map for ``remote``) through staging.

        ``notify`` is delivered to each peer rank (the source; its ``Endpoint.notifications()``,
        as ``Notification(engine, rank, message)`` naming this rank) once that rank saw this
        side take its last chunk, as a direct ``Endpoint.read`` delivers it; never on failure.
        """
        return self._start(plan, remote, Mode.PULL, timeout, notify)

    def write(self, plan: TransferPlan, remote: str, *, notify: bytes | None = None,
              timeout: float | None = None) -> StagedTransfer:
        """Push ``plan`` (from this rank's push map for ``remote``) through staging.

        ``notify`` is delivered to each peer rank (the destination) once its last chunk is
        scattered into its KV cache, as a direct ``Endpoint.write`` delivers it; never on
        failure.
        """
        return self._start(plan, remote, Mode.PUSH, timeout, notify)

    def post(self, plan: TransferPlan, remote: str, *, how: str = "auto",
             notify: bytes | None = None, timeout: float | None = None):
        """Read (pull plan) or write (push plan) ``plan`` directly or staged.

        ``how``: ``"direct"``, ``"staged"`` or ``"auto"``, which decides per peer rank with
        :meth:`staged_peers` and the costs of ``remote`` (measured by :meth:`calibrate`, else
        :data:`DEFAULT_COSTS`). Returns a :class:`~kvplan_nixl.Transfer`, a
        :class:`StagedTransfer`, or, when ``auto`` stages only some peers, a
        :class:`MixedTransfer` of the two (the plan's runs split by peer rank). ``notify``
        reaches every peer rank once, by whichever part serves it (see :meth:`read`).
        """
        if how not in ("auto", "direct", "staged"):
            raise ValueError(f"how must be 'auto', 'direct' or 'staged', got {how!r}")
        pull = plan.map.mode is Mode.PULL
        post = self.ep.read if pull else self.ep.write
        if how == "auto":
            staged = self.staged_peers(plan, remote)
            if not staged:
                how = "direct"
            elif set(staged) == set(plan.peers):
                how = "staged"
            else:
                direct = [r for r in plan.peers if r not in staged]
                # post the staged part first: its OPENs travel while the direct part runs
                st = self._start(_subset(plan, staged), remote, plan.map.mode, timeout, notify)
                try:
                    dt = post(_subset(plan, direct), remote, notify=notify, timeout=timeout)
                except BaseException:
                    st.cancel("the direct part could not be posted")
                    raise
                return MixedTransfer(plan, dt, st)
        if how == "direct":
            return post(plan, remote, notify=notify, timeout=timeout)
        return self._start(plan, remote, plan.map.mode, timeout, notify)

    def staged_peers(self, plan: TransferPlan, remote: str) -> tuple[int, ...]:
        """The peer ranks of ``plan`` for which the cost model predicts staging beats direct
        posting (``kvplan.staging.prefer_staged`` with that peer's runs, bytes and chunks)."""
        costs = self.costs.get(remote, DEFAULT_COSTS)
        rows = plan.copies()
        col = "src_rank" if plan.map.mode is Mode.PULL else "dst_rank"
        out = []
        for peer in np.unique(rows[col]).tolist():
            sel = rows["length"][rows[col] == peer]
            nbytes = int(sel.sum())
            chunks = -(-nbytes // self.slot_bytes)
            if prefer_staged(len(sel), nbytes, chunks, costs, overlap=self.pool.tensor.is_cuda):
                out.append(int(peer))
        return tuple(out)

    def prefer(self, plan: TransferPlan, remote: str) -> bool:
        """True when the cost model predicts staging ``plan`` beats posting it directly.

        Decided per peer rank (each peer's runs and bytes); the plan is staged when most of
        its bytes go to peers where staging wins. Plans with at most one run per chunk stay
        direct (``kvplan.staging.prefer_staged``).
        """
        costs = self.costs.get(remote, DEFAULT_COSTS)
        rows = plan.copies()
        col = "src_rank" if plan.map.mode is Mode.PULL else "dst_rank"
        won = total = 0
        for peer in np.unique(rows[col]).tolist():
            sel = rows["length"][rows[col] == peer]
            nbytes = int(sel.sum())
            chunks = -(-nbytes // self.slot_bytes)
            total += nbytes
            if prefer_staged(len(sel), nbytes, chunks, costs, overlap=self.pool.tensor.is_cuda):
                won += nbytes
        return total > 0 and 2 * won > total

    def calibrate(self, remote: str, *, progress: Iterable[Any] = (), timeout: float = 10.0
                  ) -> Costs:
        """Measure the costs :meth:`prefer` weighs against one connected peer rank of
        ``remote`` and store them in ``self.costs[remote]``; see
        :func:`kvplan_nixl.calibration.calibrate` (``progress``: other Stagers of this process
        to poll meanwhile, as the peer's Stager must be polled)."""
        from kvplan_nixl.staged.calibration import calibrate

        self.costs[remote] = costs = calibrate(self, remote, progress=progress, timeout=timeout)
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
        n = self.ep.progress() + self._reap()
        while self._inbox:
            agent_name, msg = self._inbox.popleft()
            self._handle(agent_name, msg)
            n += 1
        now = time.monotonic()
        for t, jobs in list(self._mine.values()):
            for j in list(jobs.values()):
                n += self._advance(j)
                if j.state is State.PENDING and j.deadline is not None and now > j.deadline:
                    self._fail(j, "deadline passed before completion", "timeout")
            self._settle(t)
        for j in list(self._served.values()):
            if now > j.deadline:
                self._drop_served(j, "server deadline passed", tell=True)
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
        limit = None if timeout is None else time.monotonic() + timeout
        return drive(self.poll, until, (), limit)

    def handles(self) -> dict[str, int]:
        """What this stager holds: slots in use, NIXL transfers in flight, descriptor lists
        (its own pool's and one per peer pool it learnt), requests (as initiator and as
        server), registrations. Idle: no slot, transfer or request; after close: all 0."""
        return {"slots_in_use": self.pool.in_use, "xfer": self._live["xfer"],
                "dlist": self._live["dlist"], "requests": len(self._mine),
                "serving": len(self._served), "registrations": self._live["registrations"]}

    def close(self) -> None:
        """Fail every request (telling peers), release lists, deregister the pool."""
        agent = self.ep._agent_or_none()
        for t, _ in list(self._mine.values()):
            t.cancel("stager closed")
        for j in list(self._served.values()):
            self._drop_served(j, "stager closed", tell=True)
        # peers may still send about requests this Stager dropped (a DONE, a HELLO): protocol,
        # never the user's notifications
        self.ep._notif_hooks[TAG] = _ignore
        if self._worker is not None:  # legs still running write into the pool: let them end
            self._worker.shutdown(wait=True)
            self._worker = None
            self._reap()
        if agent is None:  # the endpoint went first: NIXL freed everything with the agent
            self._live.clear()
            return
        for _, dl in self._remote.values():
            self._release_dlist(dl)
        self._remote.clear()
        if self._local_dlist is not None:
            self._release_dlist(self._local_dlist)
            self._local_dlist = None
        if self._live["registrations"]:
            with nixl_call("deregister_memory", "staging pool"):
                agent.deregister_memory(self._reg)
            self._live["registrations"] -= 1

    def __enter__(self) -> Stager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- initiator ---------------------------------------------------------------------------

    def _start(self, plan: TransferPlan, remote: str, mode: Mode, timeout: float | None,
               notify: bytes | None = None) -> StagedTransfer:
        route = self.ep._route(remote, mode)
        self.ep._check_plan(plan, route, remote, mode)
        # OPEN first, then derive the legs: the server plans and stages its side (and, for
        # pull, gathers chunk 0) while this side stages (profile_staged.py: ~10 ms each for
        # 40,960 runs, which used to run one after the other before the first chunk moved)
        rows = plan.copies()
        col = rows["src_rank" if mode is Mode.PULL else "dst_rank"]
        peers = np.unique(col).tolist()
        per_peer = {r: int(rows["length"][col == r].sum()) for r in peers}
        rid = f"{next(self._ids)}"
        deadline = None if timeout is None else time.monotonic() + timeout
        agents = {p.rank: p.agent for p in self.ep.peers() if p.engine == remote}
        missing = [r for r in peers if r not in agents]
        if missing:
            raise NotConnectedError(
                f"staged {mode.value}: ranks {missing} of engine {remote!r} are not connected")
        body = np.concatenate([*plan.src_blocks, *plan.dst_blocks]).astype("<i8").tobytes()
        lens = [len(b) for b in plan.src_blocks] + [len(b) for b in plan.dst_blocks]
        tmo = 0 if timeout is None else max(1, int(timeout * 1000))
        note = b"" if notify is None else bytes(notify)  # the user's, after the ids
        unsent = set()
        for r in peers:
            msg = _encode("OPEN", rid, mode.value, self.slot_bytes, tmo, per_peer[r],
                          -(-per_peer[r] // self.slot_bytes), len(plan.src_blocks),
                          len(plan.dst_blocks), *lens, len(note), body=body + note)
            if not self._send(agents[r], msg):
                unsent.add(r)
        try:
            sp = stage(plan, self.slot_bytes)
            jobs = [_Job(rid, agents[r], r, sp, mode, deadline) for r in sp.peers]
            if [j.peer for j in jobs] != peers or any(
                    j.nbytes != per_peer[j.peer] or len(j.chunks) != -(-j.nbytes // self.slot_bytes)
                    for j in jobs):
                raise RuntimeError("staged plan disagrees with the OPEN sent")  # a bug
        except BaseException:
            for r in peers:
                if r not in unsent:
                    self._send(agents[r], _encode("ABORT", rid, "initiator could not stage"))
            raise
        t = StagedTransfer(self, sp, remote, jobs)
        t.rid = rid
        self._mine[rid] = (t, t._jobs)
        for j in jobs:
            if j.peer in unsent:
                self._fail(j, "peer unreachable (OPEN not sent)", "error", tell=False)
        self._settle(t)
        return t

    def _advance(self, j: _Job) -> int:
        """Poll the job's transfers in flight; finish what completed; how many did."""
        if j.state is not State.PENDING:
            return 0
        done = 0
        agent = self.ep._agent_or_none()
        for k, h in list(j.xfers.items()):
            try:
                s = agent.check_xfer_state(h)
            except Exception as exc:
                if not is_nixl_error(exc):
                    raise
                self._fail(j, f"{nixl_code(exc)} while chunk {k} in flight", "error")
                return 1
            if s == "PROC":
                continue
            if s != "DONE":
                self._fail(j, f"NIXL state {s} for chunk {k}", "error")
                return 1
            del j.xfers[k]
            done += 1
            self._release_xfer(h)
            if j.mode is Mode.PULL:  # the chunk landed: scatter it, then free the slot
                self._leg(j, k, "scatter", lambda k=k: self._chunk_done(j, k))
            else:
                self.pool.release(j.slots.pop(k))
        self._check_done(j)
        return done

    def _chunk_done(self, j: _Job, k: int) -> None:
        self.pool.release(j.slots.pop(k))
        j.finished += 1
        self._check_done(j)

    def _check_done(self, j: _Job) -> None:
        if j.state is State.PENDING and not j.xfers and not j.busy and (
            (j.mode is Mode.PULL and j.finished == len(j.chunks))
            or (j.mode is Mode.PUSH and j.remote_done)
        ):
            j.state = State.DONE

    def _on_credit(self, j: _Job, k: int, rslot: int) -> None:
        """GRANT (push) or READY (pull) of chunk k in remote slot ``rslot``: take a local slot,
        then gather + WRITE (push) or READ (pull)."""

        def go(slot: int) -> None:
            if j.state is not State.PENDING:
                self.pool.release(slot)
                return
            j.slots[k] = slot
            if j.mode is Mode.PUSH:
                self._leg(j, k, "gather", lambda: self._post(j, k, slot, rslot))
            else:
                self._post(j, k, slot, rslot)

        self.pool.acquire(j, go)

    def _post(self, j: _Job, k: int, slot: int, rslot: int) -> None:
        agent = self.ep._agent_or_none()
        if j.agent not in self._remote:
            self._fail(j, f"protocol: credit for chunk {k} before the peer's pool", "error")
            return
        ladder, dlist = self._remote[j.agent]
        n = int(j.chunks["nbytes"][k])
        padded = min(-(-n // PIECE) * PIECE, self.slot_bytes)
        lw = lower(self._ladder, ladder, np.zeros(1), np.array([slot * self.slot_bytes]),
                   np.zeros(1), np.array([rslot * self.slot_bytes]), np.array([padded]))
        op, note = ("WRITE", "DATA") if j.mode is Mode.PUSH else ("READ", "TAKEN")
        try:
            h = agent.make_prepped_xfer(op, self._local_dlist, lw.local, dlist, lw.remote,
                                        _encode(note, j.rid, k))
        except Exception as exc:
            if not is_nixl_error(exc):
                raise
            self._fail(j, f"{nixl_code(exc)} making chunk {k}", "error")
            return
        self._live["xfer"] += 1
        j.xfers[k] = h
        j.posted += 1
        try:
            agent.transfer(h)
        except Exception as exc:
            if not is_nixl_error(exc):
                raise
            self._fail(j, f"{nixl_code(exc)} posting chunk {k}", "error")

    def _fail(self, j: _Job, reason: str, kind: str, *, tell: bool = True) -> None:
        """Leave PENDING once: release handles and slots, drop slot waits, tell the peer."""
        if j.state is not State.PENDING:
            return
        j.state, j.reason, j.kind = State.FAILED, reason, kind
        for h in j.xfers.values():
            self._release_xfer(h)
        j.xfers.clear()
        self._free_slots(j)
        if tell:
            self._send(j.agent, _encode("ABORT", j.rid, reason))

    def _free_slots(self, j: _Job) -> None:
        """Drop ``j``'s slot waits and free its slots, but those a running leg still uses
        (freed when the leg returns, see :meth:`_after_leg`)."""
        self.pool.forget(j)
        for k in [k for k in j.slots if k not in j.busy]:
            self.pool.release(j.slots.pop(k))

    def _settle(self, t: StagedTransfer) -> None:
        if t.done:
            if t.finished is None:
                t.finished = time.perf_counter()
            self._mine.pop(t.rid, None)

    # -- server ------------------------------------------------------------------------------

    def _serve_open(self, agent_name: str, f: list[str], body: bytes) -> None:
        from kvplan_nixl.endpoint import _parse_agent

        rid = f[1]
        mode = Mode(f[2])
        chunk, tmo, nbytes, nchunks, ng, ngd = (int(x) for x in f[3:9])
        # then one length per block id list, then the length of the user's notify, which
        # follows the block ids in the body
        if ng < 0 or ngd < 0 or len(f) != 10 + ng + ngd:
            raise _Refuse(f"OPEN has {len(f)} fields for {ng} + {ngd} block id lists")
        lens = [int(x) for x in f[9:9 + ng + ngd]]
        nnote = int(f[-1])
        if not 0 <= nnote <= len(body):
            raise _Refuse(f"notify of {nnote} bytes in a body of {len(body)}")
        note = body[len(body) - nnote:]
        body = body[:len(body) - nnote]
        engine, rank = _parse_agent(agent_name)
        if chunk != self.slot_bytes:
            raise _Refuse(f"slot sizes differ: initiator {chunk} bytes, this side "
                          f"{self.slot_bytes}")
        if len(body) % 8:
            raise _Refuse(f"block ids of {len(body)} bytes, not a multiple of 8")
        ids = np.frombuffer(body, dtype="<i8")
        if len(ids) != sum(lens) or len(lens) != ng + ngd or min(lens, default=0) < 0:
            raise _Refuse(f"block id lists malformed: {len(ids)} ids for lengths {lens}")
        cuts = np.cumsum([0, *lens])
        lists = [ids[a:b].tolist() for a, b in itertools.pairwise(cuts)]
        mine = Mode.PULL if mode is Mode.PUSH else Mode.PUSH  # this side's map to them
        try:
            tmap = self.ep.map(engine, mine)
        except NotConnectedError as exc:
            raise _Refuse(str(exc)) from exc
        sp = stage(tmap.plan(lists[:ng], lists[ng:]), self.slot_bytes)
        deadline = time.monotonic() + (tmo / 1000 if tmo else SERVE_TIMEOUT)
        j = _Job(rid, agent_name, rank, sp, mine, deadline)
        j.server = True
        j.notify = note
        if j.nbytes != nbytes or len(j.chunks) != nchunks:
            raise _Refuse(f"plans disagree: initiator {nbytes} bytes in {nchunks} chunks, this "
                          f"side {j.nbytes} bytes in {len(j.chunks)} chunks")
        t = self.pool.tensor
        self._served[(agent_name, rid)] = j
        self._send(agent_name, _encode("ACK", rid, t.data_ptr(), t.numel(), self.slot_bytes,
                                       self._dev, self._mem))
        self._serve_pump(j)

    def _serve_pump(self, j: _Job) -> None:
        """Hand out the next chunks of a served request, at most ``window`` in flight."""
        while j.state is State.PENDING and j.next < len(j.chunks) and (
                j.next - j.finished < self.window):
            k = j.next
            j.next += 1

            def go(slot: int, k: int = k) -> None:
                if j.state is not State.PENDING:
                    self.pool.release(slot)
                    return
                j.slots[k] = slot

                def tell(note: str) -> None:
                    if not self._send(j.agent, _encode(note, j.rid, k, slot)):
                        self._drop_served(j, "initiator unreachable", tell=False)

                if j.mode is Mode.PUSH:  # pull initiator: this side gathers, then says READY
                    self._leg(j, k, "gather", lambda: tell("READY"))
                else:
                    tell("GRANT")

            self.pool.acquire(j, go)

    def _serve_step(self, j: _Job, k: int) -> None:
        """DATA (push: scatter) or TAKEN (pull: nothing to copy) of chunk k: free its slot."""
        if k not in j.slots or k in j.busy:
            return
        if j.mode is Mode.PULL:
            self._leg(j, k, "scatter", lambda: self._serve_done(j, k))
        else:
            self._serve_done(j, k)

    def _serve_done(self, j: _Job, k: int) -> None:
        self.pool.release(j.slots.pop(k))
        j.finished += 1
        if j.finished == len(j.chunks):
            j.state = State.DONE
            del self._served[(j.agent, j.rid)]
            # the user's notify, as a direct transfer delivers it: for a push once the last
            # scatter into this rank's buffers returned, for a pull once the last TAKEN (the
            # initiator's last READ completed) came; a failed request never gets here
            if j.notify:
                self.ep._deliver(j.agent, j.notify)
            if j.mode is Mode.PULL:
                self._send(j.agent, _encode("DONE", j.rid))
        else:
            self._serve_pump(j)

    def _drop_served(self, j: _Job, reason: str, *, tell: bool) -> None:
        if self._served.pop((j.agent, j.rid), None) is None:
            return
        j.state, j.reason = State.FAILED, reason
        self._free_slots(j)
        if tell:
            self._send(j.agent, _encode("FAIL", j.rid, reason))

    # -- messages ----------------------------------------------------------------------------

    def _handle(self, agent_name: str, msg: bytes) -> None:
        head, _, body = msg[len(TAG):].partition(b"\n")
        f = head.decode(errors="replace").split(" ")
        op = f[0]
        try:
            if op == "OPEN":
                try:
                    self._serve_open(agent_name, f, body)
                except (_Refuse, KVPlanError) as exc:  # e.g. block ids that do not fit
                    self._send(agent_name, _encode("FAIL", f[1], f"refused: {exc}"))
                return
            if op == "HELLO":  # calibration: tell the asker where this pool is
                t = self.pool.tensor
                self._send(agent_name, _encode("POOL", f[1], t.data_ptr(), t.numel(),
                                               self.slot_bytes, self._dev, self._mem))
                return
            if op == "POOL":
                self._learn_pool(agent_name, int(f[2]), int(f[3]), int(f[5]), f[6])
                self._hello.discard(f[1])
                return
            rid = f[1]
            if op in ("DATA", "TAKEN"):
                j = self._served.get((agent_name, rid))
                if j is not None:
                    self._serve_step(j, int(f[2]))
                return
            if op == "ABORT":
                j = self._served.get((agent_name, rid))
                if j is not None:
                    self._drop_served(j, "initiator aborted: " + " ".join(f[2:]), tell=False)
                return
            entry = self._mine.get(rid)
            j = entry[1].get(self._peer_of(entry[0], agent_name)) if entry else None
            if j is None or j.state is not State.PENDING:
                return
            if op == "FAIL":
                why = " ".join(f[2:])
                kind = "timeout" if why.startswith("server deadline") else "error"
                self._fail(j, "peer failed: " + why, kind, tell=False)
            elif op == "ACK":
                self._learn_pool(agent_name, int(f[2]), int(f[3]), int(f[5]), f[6])
            elif op in ("GRANT", "READY"):
                self._on_credit(j, int(f[2]), int(f[3]))
            elif op == "DONE":
                j.remote_done = True
                self._advance(j)
            self._settle(entry[0])
        except (IndexError, ValueError) as exc:  # a malformed message: refuse, never crash
            if len(f) > 1:  # answer on the channel of the request it names
                back = "FAIL" if op in ("OPEN", "DATA", "TAKEN", "ABORT") else "ABORT"
                self._send(agent_name, _encode(back, f[1], f"malformed {op}: {exc}"))

    @staticmethod
    def _peer_of(t: StagedTransfer, agent_name: str) -> int | None:
        for r, j in t._jobs.items():
            if j.agent == agent_name:
                return r
        return None

    def _learn_pool(self, agent_name: str, addr: int, nbytes: int, dev: int, mem: str) -> None:
        if agent_name in self._remote:
            return
        ladder = Ladder.build(["staging"], [nbytes], [PIECE])
        dl = self._prep(self.ep._agent_or_none(), agent_name, ladder.rows([addr], dev), mem)
        self._remote[agent_name] = (ladder, dl)

    def _send(self, agent_name: str, msg: bytes) -> bool:
        agent = self.ep._agent_or_none()
        if agent is None:
            return False
        try:
            agent.send_notif(agent_name, msg)
        except Exception as exc:
            if not is_nixl_error(exc):
                raise
            return False
        return True

    # -- local legs and NIXL objects ---------------------------------------------------------

    def _leg(self, j: _Job, k: int, which: str, then: Callable[[], None]) -> None:
        """Run chunk k's local leg (its slot is ``j.slots[k]``), then ``then()`` on this thread
        if ``j`` is still pending. With ``overlap`` the leg runs on the worker thread (torch and
        numpy release the GIL) while this thread keeps posting and progressing NIXL."""
        j.busy.add(k)
        if self._worker is None:
            try:
                self._local_leg(j, k, j.slots[k], which)
            except Exception as exc:
                self._after_leg(j, k, then, exc)
                raise
            self._after_leg(j, k, then, None)
            return
        fut = self._worker.submit(self._local_leg, j, k, j.slots[k], which)
        fut.add_done_callback(_wake)  # a waiting drive() polls now, not after its nap
        self._running.append((fut, j, k, then))

    def _reap(self) -> int:
        """Finish the legs the worker completed, in submission order; how many."""
        n = 0
        while self._running and self._running[0][0].done():
            fut, j, k, then = self._running.popleft()
            self._after_leg(j, k, then, fut.exception())
            n += 1
        return n

    def _after_leg(self, j: _Job, k: int, then: Callable[[], None],
                   exc: BaseException | None) -> None:
        j.busy.discard(k)
        if exc is not None:
            why = f"local {type(exc).__name__} on chunk {k}: {exc}"
            if j.server:
                self._drop_served(j, why, tell=True)
            else:
                self._fail(j, why, "error")
        if j.state is not State.PENDING:  # failed while the leg ran: its slot is free now
            slot = j.slots.pop(k, None)
            if slot is not None:
                self.pool.release(slot)
            return
        then()

    def _local_leg(self, j: _Job, k: int, slot: int, which: str) -> None:
        sp = j.sp
        if j.index is None:  # once per job, on the leg thread (one per Stager: no race)
            mine = slice(int(j.chunks["row_start"][0]), int(j.chunks["row_end"][-1]))
            j.index = legs.SideIndex(sp, "src" if which == "gather" else "dst", mine)
        ops = j.index.chunk(j.chunks[k])
        dest = self.pool.slot(slot)
        with legs.cpu_threads(self.cpu_threads, dest):
            (legs.gather if which == "gather" else legs.scatter)(ops, self._buffers, dest,
                                                                   sp.granule)
        legs.synchronize(dest)

    def _prep(self, agent, name: str, rows: np.ndarray, mem: str):
        with nixl_call("prep_xfer_dlist", f"staging pool of {name}"):
            h = agent.prep_xfer_dlist(name, rows, mem)
        self._live["dlist"] += 1
        return h

    def _release_dlist(self, h) -> None:
        release_counted(h, self._live, "dlist")

    def _release_xfer(self, h) -> None:
        release_counted(h, self._live, "xfer")


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


def _wake(_fut) -> None:
    WAKE.set()


def _ignore(_agent_name: str, _msg: bytes) -> None:
    """The notification hook of a closed Stager: drops late protocol messages."""


class _Refuse(Exception):
    """An OPEN this server cannot serve; its text goes back in a FAIL."""

