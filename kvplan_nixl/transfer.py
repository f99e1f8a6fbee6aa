"""Transfer: one request's NIXL transfers, one per peer rank, driven to done or failed.

State machine per peer rank: PENDING -> DONE | FAILED. A peer leaves PENDING exactly once,
and its NIXL handle is released at that moment, on every path (done, NIXL error, deadline,
cancel, endpoint closed). ``poll`` never blocks and never raises for a transfer failure;
``wait`` blocks and raises :class:`TransferFailed` or :class:`TransferTimeout` naming the
failed peers and the destination blocks that may not have arrived. A released handle is never
touched again (NIXL segfaults on ``transfer`` after ``release``).

Owns one request's state per peer rank and the wait loop of every transfer kind
(:func:`drive`). What it needs of the side that posted it (the agent, the handle ledger, the set
of transfers in flight) comes through an :class:`Owner` (``kvplan_nixl.posting.Poster``): this
module may not import the endpoint, posting or anything above them.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvplan_nixl.arguments import check_progress, check_timeout
from kvplan_nixl.errors import TransferFailed, TransferTimeout, is_nixl_error, nixl_code

if TYPE_CHECKING:
    from kvplan import TransferPlan

#: Polling backoff of ``wait``: spin this long, then sleep with doubling up to the cap.
SPIN_SECONDS = 200e-6
MAX_SLEEP_SECONDS = 1e-3
#: The first nap, and the nap after a poll that found something to do.
MIN_SLEEP_SECONDS = 10e-6

#: Set when work finishes on another thread of this process (a staged transfer's local legs):
#: a waiting :func:`drive` wakes at once instead of at the end of its nap. One event per
#: process, since a leg of one Stager may be what another Stager's request waits for.
WAKE = threading.Event()


def drive(step: Callable[[], object], done: Callable[[], bool], others: Iterable = (),
          limit: float | None = None) -> bool:
    """Call ``step`` (after progressing each of ``others``) until ``done()``.

    Spins for :data:`SPIN_SECONDS` (a loopback transfer often finishes within that), then
    naps, the naps doubling from :data:`MIN_SLEEP_SECONDS` up to :data:`MAX_SLEEP_SECONDS`, so a
    long wait costs little CPU. A poll that reports work done (``step()`` or a ``progress()``
    returning a true value: messages handled, transfers or legs finished) starts the naps over
    at the minimum, and :data:`WAKE` ends a nap early: a staged transfer's steps follow each
    other within microseconds instead of after a nap of up to a millisecond each (with 4 MiB
    slots: 0.79 -> 1.23 GB/s, docs/performance.md). Returns False when the
    ``time.monotonic()`` deadline ``limit`` passed first. The one wait loop of every transfer
    kind (direct, staged, mixed).
    """
    spin_until = time.monotonic() + SPIN_SECONDS
    nap = MIN_SLEEP_SECONDS
    while True:
        busy = False
        for o in others:
            busy = bool(o.progress()) or busy
        busy = bool(step()) or busy
        if done():
            return True
        now = time.monotonic()
        if limit is not None and now > limit:
            return False
        if busy:
            nap = MIN_SLEEP_SECONDS
        elif now > spin_until:
            WAKE.wait(nap)
            WAKE.clear()  # before the next poll: a leg ending after this is seen next time
            nap = min(nap * 2, MAX_SLEEP_SECONDS)


class State(enum.Enum):
    """Where one peer rank's part of a transfer stands."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Owner(Protocol):
    """What a :class:`Transfer` needs of the side that posted it."""

    #: who posts, for error messages: ``'decode' rank 0``
    label: str
    #: record NIXL's descriptor count of each part that completes
    telemetry: bool

    def agent_or_none(self) -> Any | None:
        """The NIXL agent, or None once closed."""

    def progress(self) -> int:
        """Progress the endpoint (a target must be progressed)."""

    def count_xfer(self) -> None:
        """A transfer handle was made."""

    def release_xfer(self, h: Any) -> None:
        """Release a transfer handle."""

    def desc_count(self, h: Any) -> int | None:
        """NIXL's descriptor count of handle ``h`` (telemetry)."""

    def forget(self, t: Transfer) -> None:
        """``t`` left PENDING for good: no longer in flight."""

    def notify(self, remote: str, ranks: tuple[int, ...], message: bytes) -> None:
        """Send ``message`` to ranks ``ranks`` of engine ``remote``."""


class _Part:
    """One peer rank's NIXL transfers (internal, mutable): one per (local, remote) memory
    kind pair its runs touch (one, unless a side holds buffers of two kinds)."""

    __slots__ = ("desc_count", "handles", "kind", "nbytes", "note", "peer", "reason", "runs",
                 "state")

    def __init__(self, peer: int, runs: int, nbytes: int) -> None:
        self.peer = peer
        self.runs = runs
        self.nbytes = nbytes
        self.handles: list[Any] = []  # the NIXL handles still in flight
        self.note = b""  # sent once DONE, when the part's transfers carry no notification
        self.state = State.PENDING
        self.reason = ""
        self.kind = ""  # "error" | "timeout" | "cancelled"
        self.desc_count: int | None = None


class Transfer:
    """The transfers of one plan to or from every peer rank it touches (from Endpoint.read/write).

    ``poll()`` returns ``{peer_rank: State}`` without blocking; ``wait(timeout)`` returns it once
    every part is DONE, or raises. A deadline given at post time (``timeout=`` of read/write) is
    enforced by both. Not thread-safe: drive a Transfer from the thread that owns its Endpoint.
    """

    def __init__(
        self,
        endpoint: Owner,
        plan: TransferPlan,
        remote: str,
        parts: list[_Part],
        groups: Mapping[int, frozenset[int]],
        deadline: float | None,
    ) -> None:
        self._ep = endpoint
        self.plan = plan
        self.remote = remote
        self._parts = {p.peer: p for p in parts}
        self._groups = groups  # peer -> destination groups its runs write to
        self._deadline = deadline
        self._pending = list(parts)
        self.started = time.perf_counter()
        self.finished: float | None = None

    # -- reporting ---------------------------------------------------------------------------

    @property
    def peers(self) -> tuple[int, ...]:
        """Peer ranks of this transfer, ascending."""
        return tuple(sorted(self._parts))

    @property
    def done(self) -> bool:
        """True once no part is PENDING (each is DONE or FAILED)."""
        return not self._pending

    @property
    def ok(self) -> bool:
        """True once every part is DONE."""
        return self.done and all(p.state is State.DONE for p in self._parts.values())

    @property
    def nbytes(self) -> int:
        """Bytes this transfer moves, over all peer ranks."""
        return sum(p.nbytes for p in self._parts.values())

    def states(self) -> dict[int, State]:
        """``{peer_rank: State}`` as of the last poll (no NIXL call)."""
        return {r: self._parts[r].state for r in self.peers}

    def runs(self) -> dict[int, int]:
        """``{peer_rank: runs}``: the plan's runs, i.e. NIXL descriptors posted, per peer."""
        return {r: self._parts[r].runs for r in self.peers}

    def bytes_per_peer(self) -> dict[int, int]:
        """Bytes this transfer moves per peer rank."""
        return {r: self._parts[r].nbytes for r in self.peers}

    def desc_counts(self) -> dict[int, int | None]:
        """NIXL's own descriptor count per peer after merging (Endpoint(telemetry=True) only)."""
        return {r: self._parts[r].desc_count for r in self.peers}

    @property
    def seconds(self) -> float | None:
        """From posting to the last part leaving PENDING, once done."""
        return None if self.finished is None else self.finished - self.started

    def error(self) -> TransferFailed | None:
        """The exception ``wait`` raises, or None while pending or when every part is DONE."""
        failed = {r: p for r, p in self._parts.items() if p.state is State.FAILED}
        if not failed or self._pending:
            return None
        reasons = {r: p.reason for r, p in failed.items()}
        groups = set().union(*(self._groups.get(r, frozenset()) for r in failed))
        blocks = tuple(
            np.asarray(b) if g in groups else np.zeros(0, dtype=np.int64)
            for g, b in enumerate(self.plan.dst_blocks)
        )
        m = self.plan.map
        way = "from" if m.mode.value == "pull" else "to"
        what = f"{m.mode.value} by {self._ep.label} {way} {self.remote!r} failed"
        timeout = all(p.kind == "timeout" for p in failed.values())
        cls = TransferTimeout if timeout else TransferFailed
        return cls(what, reasons, blocks)

    def __repr__(self) -> str:
        st = ", ".join(f"{r}: {s.value}" for r, s in self.states().items())
        return f"Transfer({self.plan.map.mode.value} {self.remote!r}, {{{st}}})"

    # -- driving -----------------------------------------------------------------------------

    def poll(self) -> dict[int, State]:
        """Advance every pending part once, enforce the deadline, and report. Never blocks."""
        if self._pending:
            agent = self._ep.agent_or_none()
            for p in self._pending:
                if agent is None:
                    self._finish(p, State.FAILED, "endpoint closed", "cancelled")
                    continue
                try:
                    states = [agent.check_xfer_state(h) for h in p.handles]
                except Exception as exc:
                    if not is_nixl_error(exc):
                        raise
                    self._finish(p, State.FAILED, f"{nixl_code(exc)} while in flight", "error")
                    continue
                bad = [s for s in states if s not in ("DONE", "PROC")]
                if bad:
                    self._finish(p, State.FAILED, f"NIXL state {bad[0]}", "error")
                elif "PROC" not in states:
                    self._finish(p, State.DONE)
            self._settle()
            if self._pending and self._deadline is not None and time.monotonic() > self._deadline:
                self._expire()
        return self.states()

    def wait(
        self, timeout: float | None = None, *, progress: Iterable[Any] = ()
    ) -> dict[int, State]:
        """Block until every part is DONE; return ``{peer_rank: State}``.

        ``timeout`` (seconds) tightens the deadline: when it passes, the unfinished parts are
        cancelled and released and :class:`TransferTimeout` is raised. Any failed part raises
        :class:`TransferFailed`. ``progress`` lists other endpoints of this process to progress
        while waiting (a peer in the same process has no progress thread of its own).
        """
        timeout = check_timeout("timeout", timeout)
        if timeout is not None:
            limit = time.monotonic() + timeout
            if self._deadline is None or limit < self._deadline:
                self._deadline = limit
        def step() -> None:
            self.poll()
            if self._pending:
                self._ep.progress()

        drive(step, lambda: not self._pending, check_progress(progress))
        err = self.error()
        if err is not None:
            raise err
        return self.states()

    def _start(self, agent, op: str, posts, msgs: list[bytes]) -> None:
        """Make and post the NIXL transfers of each part (Endpoint.read/write, once): per part,
        ``posts`` lists ``(local list, remote list, Lowered)``, one per memory kind pair, and
        ``msgs`` the notification its transfers carry, sealed for its peer (empty for a part
        of several transfers: its ``note`` is sent once all are DONE). A part is DONE when all
        of its transfers are, FAILED when any fails (the others released)."""
        for part, mine, msg in zip(self._parts.values(), posts, msgs, strict=True):
            states = []
            for local_dlist, dlist, lw in mine:
                where = "make_prepped_xfer"
                try:
                    h = agent.make_prepped_xfer(op, local_dlist, lw.local, dlist, lw.remote, msg)
                    self._ep.count_xfer()
                    part.handles.append(h)
                    where = "transfer"
                    states.append(agent.transfer(h))
                except Exception as exc:
                    if not is_nixl_error(exc):
                        self.cancel(f"not posted: {exc!r}")
                        raise
                    self._finish(part, State.FAILED, f"{nixl_code(exc)} in {where}", "error")
                    break
            if part.state is not State.PENDING:
                continue
            bad = [s for s in states if s not in ("DONE", "PROC")]
            if bad:
                self._finish(part, State.FAILED, f"NIXL state {bad[0]} at post", "error")
            elif "PROC" not in states:
                self._finish(part, State.DONE)
        self._settle()

    def cancel(self, reason: str = "cancelled", peers: Iterable[int] | None = None) -> None:
        """Fail the pending parts (of ``peers``, default all) now, releasing their handles.

        Releasing an in-flight NIXL handle aborts it; the failed parts are reported by ``wait``
        like any other failure, with the destination blocks that may not have arrived.
        """
        which = None if peers is None else set(peers)
        for p in self._pending:
            if which is None or p.peer in which:
                self._finish(p, State.FAILED, reason, "cancelled")
        self._settle()

    def _settle(self) -> None:
        self._pending = [p for p in self._parts.values() if p.state is State.PENDING]
        if not self._pending and self.finished is None:
            self.finished = time.perf_counter()

    def _expire(self) -> None:
        for p in self._pending:
            self._finish(p, State.FAILED, "deadline passed before completion", "timeout")
        self._settle()

    def _finish(self, p: _Part, state: State, reason: str = "", kind: str = "") -> None:
        """Leave PENDING exactly once; release the handle now, whatever happened."""
        p.state, p.reason, p.kind = state, reason, kind
        handles, p.handles = p.handles, []
        if self._ep.telemetry and state is State.DONE and handles:
            counts = [self._ep.desc_count(h) for h in handles]
            p.desc_count = None if None in counts else sum(counts)  # type: ignore[arg-type]
        for h in handles:
            self._ep.release_xfer(h)
        if state is State.DONE and p.note:
            try:  # best effort, like a transfer's own notification: the bytes have landed
                self._ep.notify(self.remote, (p.peer,), p.note)
            except Exception as exc:
                if not is_nixl_error(exc):
                    raise
        if all(q.state is not State.PENDING for q in self._parts.values()):
            self._ep.forget(self)
