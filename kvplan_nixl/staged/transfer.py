"""A staged request's state: per-peer jobs, :class:`StagedTransfer` and :class:`MixedTransfer`.

Owns what a request *is* on one side (a :class:`Job` per peer rank: its chunks, slots held,
handles in flight, state) and the user's surface over it, the same as
:class:`kvplan_nixl.Transfer`'s. It drives nothing itself: a StagedTransfer asks its *driver*
(the initiator of :mod:`kvplan_nixl.staged.initiator`, a :class:`Driver`) to poll or to fail a
job. It may not import the driver, the pool or the protocol.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

from kvplan import Mode
from kvplan.staging import StagedPlan
from kvplan_nixl.arguments import check_progress, check_timeout
from kvplan_nixl.errors import TransferFailed, TransferTimeout
from kvplan_nixl.transfer import State, drive

__all__ = ["Driver", "Job", "MixedTransfer", "StagedTransfer"]


class Job:
    """One peer rank's part of a staged request, on either side (internal, mutable)."""

    def __init__(self, rid: str, agent: str, peer: int, sp: StagedPlan, mode: Mode,
                 deadline: float | None) -> None:
        self.rid, self.agent, self.peer, self.sp, self.mode = rid, agent, peer, sp, mode
        self.chunks = sp.peer_chunks(peer)
        self.index = None  # this side's legs.SideIndex, built by the first local leg
        self.deadline = deadline
        self.state = State.PENDING
        self.reason, self.kind = "", ""
        self.slots: dict[int, int] = {}  # chunk -> local slot held
        self.busy: set[int] = set()  # chunks whose local leg is running (slot kept till done)
        self.server = False
        self.xfers: dict[int, Any] = {}  # chunk -> NIXL handle in flight
        self.credited: set[int] = set()  # initiator: chunks a GRANT/READY came for (once each)
        self.finished = 0  # chunks through their local leg on this side
        self.next = 0  # next chunk to grant (push server) or gather (pull server)
        self.remote_done = False  # push initiator: DONE received
        self.notify = b""  # server: the user's notify, delivered here when the part is DONE
        self.posted = 0  # bulk descriptors posted
        self.heard = time.monotonic()  # last sign of the peer: a message, or a probe that left

    @property
    def nbytes(self) -> int:
        return int(self.chunks["nbytes"].sum())


class Driver(Protocol):
    """What a :class:`StagedTransfer` needs of the side that drives it."""

    #: who posts, for error messages: ``'decode' rank 0``
    label: str

    def poll(self) -> int:
        """Drive every request once (messages, transfers, deadlines)."""

    def fail(self, j: Job, reason: str, kind: str) -> None:
        """Fail job ``j`` now (release its slots and handles, tell the peer)."""


class StagedTransfer:
    """One staged request to or from every peer rank of its plan (from :meth:`Stager.read` /
    :meth:`Stager.write`); the same surface as :class:`kvplan_nixl.Transfer`: ``poll``,
    ``wait``, ``cancel``, ``ok``, ``error``, plus ``chunks`` and ``descriptors``."""

    def __init__(self, driver: Driver, sp: StagedPlan, remote: str, jobs: list[Job]) -> None:
        self._st = driver
        self.staged = sp
        self.plan = sp.plan
        self.remote = remote
        self._jobs = {j.peer: j for j in jobs}
        self.rid = ""  # the request id its Stager gave it
        self.started = time.perf_counter()
        self.finished: float | None = None

    @property
    def peers(self) -> tuple[int, ...]:
        """Peer ranks of this transfer, ascending."""
        return tuple(sorted(self._jobs))

    @property
    def done(self) -> bool:
        """True once no peer part is PENDING."""
        return all(j.state is not State.PENDING for j in self._jobs.values())

    @property
    def ok(self) -> bool:
        """True once every peer part is DONE."""
        return all(j.state is State.DONE for j in self._jobs.values())

    @property
    def nbytes(self) -> int:
        """Bytes this transfer moves, over all peer ranks."""
        return self.staged.nbytes

    @property
    def chunks(self) -> int:
        """Chunks (= staging slots filled, = bulk descriptors) over all peer ranks."""
        return len(self.staged.chunks)

    @property
    def descriptors(self) -> int:
        """NIXL descriptors posted so far by this side (one per chunk)."""
        return sum(j.posted for j in self._jobs.values())

    @property
    def seconds(self) -> float | None:
        """From posting to the last part leaving PENDING, once done."""
        return None if self.finished is None else self.finished - self.started

    def states(self) -> dict[int, State]:
        """``{peer_rank: State}`` as of the last poll."""
        return {r: self._jobs[r].state for r in self.peers}

    def poll(self) -> dict[int, State]:
        """Drive the stager once (messages, transfers, deadlines) and report. Never blocks."""
        self._st.poll()
        return self.states()

    def wait(self, timeout: float | None = None, *, progress: Iterable[Any] = ()
             ) -> dict[int, State]:
        """Block until every part is DONE; raise :class:`TransferFailed` /
        :class:`TransferTimeout` otherwise. ``progress`` lists other Stagers (polled) or
        Endpoints (progressed) of this process to drive while waiting."""
        timeout = check_timeout("timeout", timeout)
        if timeout is not None:
            limit = time.monotonic() + timeout
            for j in self._jobs.values():
                if j.deadline is None or limit < j.deadline:
                    j.deadline = limit
        drive(self._st.poll, lambda: self.done, check_progress(progress))
        err = self.error()
        if err is not None:
            raise err
        return self.states()

    def cancel(self, reason: str = "cancelled") -> None:
        """Fail the pending parts now: their slots and handles are freed, the peer told."""
        for j in self._jobs.values():
            self._st.fail(j, reason, "cancelled")

    def error(self) -> TransferFailed | None:
        """The exception ``wait`` raises, or None while pending or when every part is DONE."""
        failed = {r: j for r, j in self._jobs.items() if j.state is State.FAILED}
        if not failed or not self.done:
            return None
        m = self.plan.map
        rows = self.plan.copies()
        col = "src_rank" if m.mode is Mode.PULL else "dst_rank"
        groups = np.unique(
            np.array([r.group for r in m.dst.regions])[rows["dst_region"][
                np.isin(rows[col], list(failed))]])
        blocks = tuple(np.asarray(b) if g in groups else np.zeros(0, dtype=np.int64)
                       for g, b in enumerate(self.plan.dst_blocks))
        way = "from" if m.mode is Mode.PULL else "to"
        what = f"staged {m.mode.value} by {self._st.label} {way} {self.remote!r} failed"
        cls = TransferTimeout if all(j.kind == "timeout" for j in failed.values()) else (
            TransferFailed)
        return cls(what, {r: j.reason for r, j in failed.items()}, blocks)

    def __repr__(self) -> str:
        st = ", ".join(f"{r}: {s.value}" for r, s in self.states().items())
        return (f"StagedTransfer({self.plan.map.mode.value} {self.remote!r}, "
                f"{self.chunks} chunks, {{{st}}})")


class MixedTransfer:
    """A request split by peer rank: a direct :class:`~kvplan_nixl.Transfer` for some peers and
    a :class:`StagedTransfer` for the others (``Stager.post(how="auto")``); the same surface."""

    def __init__(self, plan, direct, staged: StagedTransfer) -> None:
        self.plan = plan
        self.direct = direct
        self.staged = staged
        self.started = min(direct.started, staged.started)

    @property
    def parts(self) -> tuple:
        """``(direct transfer, staged transfer)``."""
        return self.direct, self.staged

    @property
    def peers(self) -> tuple[int, ...]:
        """Peer ranks of both parts, ascending."""
        return tuple(sorted((*self.direct.peers, *self.staged.peers)))

    @property
    def done(self) -> bool:
        """True once both parts are done."""
        return self.direct.done and self.staged.done

    @property
    def ok(self) -> bool:
        """True once both parts are done and every peer part succeeded."""
        return self.direct.ok and self.staged.ok

    @property
    def nbytes(self) -> int:
        """Bytes both parts move."""
        return self.direct.nbytes + self.staged.nbytes

    @property
    def seconds(self) -> float | None:
        """From the first post to the last part's end, once done."""
        ends = [p.finished for p in self.parts]
        return None if None in ends else max(ends) - self.started

    def states(self) -> dict[int, State]:
        """``{peer_rank: State}`` of both parts."""
        return {**self.direct.states(), **self.staged.states()}

    def poll(self) -> dict[int, State]:
        """Poll both parts once. Never blocks."""
        self.direct.poll()
        self.staged.poll()
        return self.states()

    def wait(self, timeout: float | None = None, *, progress: Iterable[Any] = ()
             ) -> dict[int, State]:
        """Block until both parts are done; raise as :meth:`StagedTransfer.wait` does, naming
        the failed peers of both parts."""
        timeout = check_timeout("timeout", timeout)
        limit = None if timeout is None else time.monotonic() + timeout
        if not drive(self.poll, lambda: self.done, check_progress(progress), limit):
            self.cancel("deadline passed before completion")
        err = self.error()
        if err is not None:
            raise err
        return self.states()

    def cancel(self, reason: str = "cancelled") -> None:
        """Cancel both parts' pending peers."""
        self.direct.cancel(reason)
        self.staged.cancel(reason)

    def error(self) -> TransferFailed | None:
        """The failures of both parts as one exception, or None."""
        errs = [e for e in (self.direct.error(), self.staged.error()) if e is not None]
        if not errs or not self.done:
            return None
        reasons = {r: why for e in errs for r, why in e.reasons.items()}
        blocks = tuple(np.union1d(*(e.blocks[g] for e in errs)) if len(errs) > 1
                       else errs[0].blocks[g] for g in range(len(errs[0].blocks)))
        cls = TransferTimeout if all(isinstance(e, TransferTimeout) for e in errs) else (
            TransferFailed)
        what = str(errs[0]).split(":")[0].replace("staged ", "") + " (direct and staged parts)"
        return cls(what, reasons, blocks)

    def __repr__(self) -> str:
        return f"MixedTransfer({self.direct!r}, {self.staged!r})"
