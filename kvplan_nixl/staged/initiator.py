"""The initiator side of staged transfers: OPEN a request, take credits, post the bulk leg.

Owns the requests this side planned (by request id, one :class:`~.transfer.Job` per peer rank)
from OPEN to DONE or FAILED: it sends the OPENs, answers a GRANT (push: gather, then WRITE) or
a READY (pull: READ, then scatter), polls its NIXL handles, enforces deadlines, and on failure
frees slots and handles and tells the server (ABORT). It may not touch the requests it serves
(``server``) nor parse bytes (``protocol``); it never blocks.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import numpy as np

from kvplan import Mode, TransferPlan
from kvplan.staging import stage
from kvplan_nixl.endpoint import Endpoint
from kvplan_nixl.errors import NotConnectedError, is_nixl_error, nixl_code
from kvplan_nixl.staged import protocol as proto
from kvplan_nixl.staged.channel import Channel
from kvplan_nixl.staged.pool import RegisteredPool
from kvplan_nixl.staged.runner import LegRunner
from kvplan_nixl.staged.transfer import Job, StagedTransfer
from kvplan_nixl.transfer import State

__all__ = ["Initiator"]


class Initiator:
    """The requests one Stager initiated; the :class:`~.transfer.Driver` of their transfers."""

    def __init__(self, endpoint: Endpoint, pool: RegisteredPool, runner: LegRunner,
                 channel: Channel, ids: itertools.count, poll: Callable[[], int]) -> None:
        self.ep, self.pool, self.runner, self.channel = endpoint, pool, runner, channel
        self._ids = ids
        self.poll = poll  # the Stager's: what a StagedTransfer's poll and wait drive
        self.label = f"{endpoint.engine!r} rank {endpoint.rank}"
        self.mine: dict[str, tuple[StagedTransfer, dict[int, Job]]] = {}  # rid -> request

    def start(self, plan: TransferPlan, remote: str, mode: Mode, timeout: float | None,
              notify: bytes | None = None) -> StagedTransfer:
        """Send the OPENs of ``plan``, then derive this side's legs (see the Stager's doc)."""
        ep, slot_bytes = self.ep, self.pool.slot_bytes
        ep._check_plan(plan, ep._route(remote, mode), remote, mode)
        # OPEN first, then derive the legs: the server plans and stages its side (and, for
        # pull, gathers chunk 0) while this side stages (profile_staged.py: ~10 ms each for
        # 40,960 runs, which used to run one after the other before the first chunk moved)
        rows = plan.copies()
        col = rows["src_rank" if mode is Mode.PULL else "dst_rank"]
        peers = np.unique(col).tolist()
        per_peer = {r: int(rows["length"][col == r].sum()) for r in peers}
        rid = f"{next(self._ids)}"
        deadline = None if timeout is None else time.monotonic() + timeout
        agents = {p.rank: p.agent for p in ep.peers() if p.engine == remote}
        missing = [r for r in peers if r not in agents]
        if missing:
            raise NotConnectedError(
                f"staged {mode.value}: ranks {missing} of engine {remote!r} are not connected")
        tmo = 0 if timeout is None else max(1, int(timeout * 1000))
        note = b"" if notify is None else bytes(notify)  # the user's, after the ids
        opens = proto.open_messages(rid, mode, slot_bytes, tmo, per_peer, plan.src_blocks,
                                    plan.dst_blocks, note)
        unsent = {r for r in peers if not self.channel.send(agents[r], opens[r])}
        try:
            sp = stage(plan, slot_bytes)
            jobs = [Job(rid, agents[r], r, sp, mode, deadline) for r in sp.peers]
            if [j.peer for j in jobs] != peers or any(
                    j.nbytes != per_peer[j.peer] or len(j.chunks) != -(-j.nbytes // slot_bytes)
                    for j in jobs):
                raise RuntimeError("staged plan disagrees with the OPEN sent")  # a bug
        except BaseException:
            for r in peers:
                if r not in unsent:
                    self.channel.send(agents[r],
                                      proto.encode("ABORT", rid, "initiator could not stage"))
            raise
        t = StagedTransfer(self, sp, remote, jobs)
        t.rid = rid
        self.mine[rid] = (t, t._jobs)
        for j in jobs:
            if j.peer in unsent:
                self.fail(j, "peer unreachable (OPEN not sent)", "error", tell=False)
        self._settle(t)
        return t

    def step(self, now: float) -> int:
        """Advance every request's transfers, enforce deadlines; how many chunks finished."""
        n = 0
        for t, jobs in list(self.mine.values()):
            for j in list(jobs.values()):
                n += self._advance(j)
                if j.state is State.PENDING and j.deadline is not None and now > j.deadline:
                    self.fail(j, "deadline passed before completion", "timeout")
                elif j.state is State.PENDING and now - j.heard > proto.PROBE_S:
                    self.probe(j, now)
            self._settle(t)
        return n

    def probe(self, j: Job, now: float) -> None:
        """A PING to the peer of a request waiting on it: one that cannot leave (NIXL reports
        the peer disconnected) fails the request now."""
        j.heard = now
        if not self.channel.send(j.agent, proto.encode("PING", j.rid)):
            self.fail(j, "peer unreachable: a liveness probe could not be sent (its process "
                      "or its endpoint went)", "error", tell=False)

    def on_message(self, agent_name: str, m: proto.Message) -> bool:
        """FAIL, ACK, GRANT, READY or DONE from the server of one of this side's requests;
        False when it names no pending request of that agent or repeats a credit (dropped).
        Fields out of bounds raise ``ValueError``."""
        entry = self.mine.get(m.rid)
        j = None
        if entry is not None:
            j = next((j for j in entry[1].values() if j.agent == agent_name), None)
        if j is None or j.state is not State.PENDING:
            return False
        j.heard = time.monotonic()
        if m.op in ("GRANT", "READY"):
            k, rslot = m.int(1), m.int(2)
            if k in j.credited:
                return False  # a replayed credit must not take a second slot
            remote = self.pool.remote.get(agent_name)
            nslots = None if remote is None else int(remote[0].nbytes[0]) // self.pool.slot_bytes
            if not 0 <= k < len(j.chunks) or (nslots is not None and not 0 <= rslot < nslots):
                raise ValueError(f"credit for chunk {k} in slot {rslot}: out of bounds")
        if m.op == "FAIL":
            why = m.text(1)
            kind = "timeout" if why.startswith("server deadline") else "error"
            self.fail(j, "peer failed: " + why, kind, tell=False)
        elif m.op == "ACK":
            self.pool.learn(self.ep._agent_or_none(), agent_name, proto.PoolInfo.decode(m))
        elif m.op in ("GRANT", "READY"):
            j.credited.add(k)
            self._on_credit(j, k, rslot)
        elif m.op == "DONE":
            j.remote_done = True
            self._advance(j)
        else:
            return False
        assert entry is not None
        self._settle(entry[0])
        return True

    def peer_gone(self, agent_name: str) -> None:
        """Agent ``agent_name`` was unloaded (disconnect, close notice, restart): its jobs
        fail now, naming their blocks."""
        for t, jobs in list(self.mine.values()):
            for j in jobs.values():
                if j.agent == agent_name:
                    self.fail(j, "peer went (disconnected, closed or restarted)", "error",
                              tell=False)
            self._settle(t)

    def fail(self, j: Job, reason: str, kind: str, *, tell: bool = True) -> None:
        """Leave PENDING once: release handles and slots, drop slot waits, tell the peer."""
        if j.state is not State.PENDING:
            return
        j.state, j.reason, j.kind = State.FAILED, reason, kind
        for h in j.xfers.values():
            self.pool.handles.release(h)
        j.xfers.clear()
        self.pool.slots.free_job(j)
        if tell:
            self.channel.send(j.agent, proto.encode("ABORT", j.rid, reason))

    def close(self) -> None:
        """Cancel every request (the servers are told)."""
        for t, _ in list(self.mine.values()):
            t.cancel("stager closed")

    def _leg_failed(self, j: Job, why: str) -> None:
        self.fail(j, why, "error")

    def _settle(self, t: StagedTransfer) -> None:
        if t.done:
            if t.finished is None:
                t.finished = time.perf_counter()
            self.mine.pop(t.rid, None)

    def _advance(self, j: Job) -> int:
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
                self.fail(j, f"{nixl_code(exc)} while chunk {k} in flight", "error")
                return 1
            if s == "PROC":
                continue
            if s != "DONE":
                self.fail(j, f"NIXL state {s} for chunk {k}", "error")
                return 1
            del j.xfers[k]
            done += 1
            self.pool.handles.release(h)
            if j.mode is Mode.PULL:  # the chunk landed: scatter it, then free the slot
                self.runner.run(j, k, "scatter", lambda k=k: self._chunk_done(j, k),
                                self._leg_failed)
            else:
                self.pool.slots.release(j.slots.pop(k))
        self._check_done(j)
        return done

    def _chunk_done(self, j: Job, k: int) -> None:
        self.pool.slots.release(j.slots.pop(k))
        j.finished += 1
        self._check_done(j)

    def _check_done(self, j: Job) -> None:
        if j.state is State.PENDING and not j.xfers and not j.busy and (
            (j.mode is Mode.PULL and j.finished == len(j.chunks))
            or (j.mode is Mode.PUSH and j.remote_done)
        ):
            j.state = State.DONE

    def _on_credit(self, j: Job, k: int, rslot: int) -> None:
        """GRANT (push) or READY (pull) of chunk k in remote slot ``rslot``: take a local slot,
        then gather + WRITE (push) or READ (pull)."""

        def go(slot: int) -> None:
            if j.state is not State.PENDING:
                self.pool.slots.release(slot)
                return
            j.slots[k] = slot
            if j.mode is Mode.PUSH:
                self.runner.run(j, k, "gather", lambda: self._post(j, k, slot, rslot),
                                self._leg_failed)
            else:
                self._post(j, k, slot, rslot)

        self.pool.slots.acquire(j, go)

    def _post(self, j: Job, k: int, slot: int, rslot: int) -> None:
        agent = self.ep._agent_or_none()
        if j.agent not in self.pool.remote:
            self.fail(j, f"protocol: credit for chunk {k} before the peer's pool", "error")
            return
        op, note = ("WRITE", "DATA") if j.mode is Mode.PUSH else ("READ", "TAKEN")
        try:
            h = self.pool.chunk_xfer(agent, op, j.agent, slot, rslot,
                                     int(j.chunks["nbytes"][k]),
                                     self.channel.seal(j.agent, proto.encode(note, j.rid, k)))
        except Exception as exc:
            if not is_nixl_error(exc):
                raise
            self.fail(j, f"{nixl_code(exc)} making chunk {k}", "error")
            return
        j.xfers[k] = h
        j.posted += 1
        try:
            agent.transfer(h)
        except Exception as exc:
            if not is_nixl_error(exc):
                raise
            self.fail(j, f"{nixl_code(exc)} posting chunk {k}", "error")
