"""Holds: the prefill's per-request hold table, so that no request is served from freed KV.

A prefill keeps a finished request's blocks for its decode (vLLM's ``delay_free``) until the
connector reports the send finished; vLLM then frees them and may give them to another request
at once. A decode whose read of those blocks completes after that has read someone else's KV.
This table is what the prefill answers from, and it guarantees:

    a CONFIRM of ``(req, generation)`` is answered yes only while that hold is live, and a hold
    ends (released, confirmed by all its readers, or its lease ran out) *before* the connector
    may report it finished to vLLM (:meth:`Holds.finished` is the only way out).

So a yes at time ``t`` means the blocks were held from the hold's start to ``t``, which covers
the whole read (the decode learnt the blocks only after the hold started, and asks after its
read completed). Once a generation's hold ended it is never live again: :meth:`Holds.hold`
takes only generations above every generation the table has seen (a high-water mark, O(1)
memory), so "no" is forever for that generation.

The decode's flow (see docs/vllm.md, "Never serving freed KV"): read completes -> CONFIRM ->
only a confirmed pull is reported finished; a refused or unanswered CONFIRM sends the blocks
to vLLM's ``kv_load_failure_policy``. While a pull is pending the decode sends RENEW (a
heartbeat) every ``lease / 3`` or less, so that a slow but live decode is not cut off and one
lost heartbeat costs nothing.

Leases (docs/vllm.md, "Reporting inside a lease"): a decode that wants to report its pull
without waiting for a CONFIRM asks :meth:`Holds.lease` (the side channel's LEASE) before its
read completes. A yes extends the hold to at least ``now + pin`` and *pins* it until then: a
release that arrives while the hold is pinned is deferred (the hold ends when the last pin
is returned by its reader's :meth:`Holds.confirm` with ``leased=True``, or at the pin's end),
and a request whose hold is superseded while pinned is not reported finished before that
pin's end, so nothing but the readers' own confirmations and the clock can end a pinned hold
under a read. Pins are bounded: at most
:data:`MAX_PINNED` holds pinned at once, :data:`MAX_PINS` per hold, each for at most
:data:`MAX_PIN_S`; past those a LEASE is answered no (the decode then waits for its CONFIRM,
as it would without leases).

Generations: the prefill's scheduler chooses one per request when it returns the request's
params (:func:`new_generation`: wall-clock nanoseconds, strictly increasing in a process), and
its workers hold under it. Wall-clock based, a restarted prefill's generations are above the
old instance's, and a table created with ``floor=time.time_ns()`` answers an old instance's
generation "no" at once (not "later").

Pure (no I/O, no clock, no threads): every call takes ``now`` (``time.monotonic()``
seconds), and the caller serialises calls (the side channel server holds its lock). It may
import only :mod:`kvplan_nixl.errors` and the standard library.
"""

from __future__ import annotations

import collections
import enum
import math
import threading
import time
from dataclasses import dataclass

from kvplan_nixl.errors import ArgumentError

__all__ = ["MAX_PINNED", "MAX_PINS", "MAX_PIN_S", "Holds", "Pin", "Verdict", "new_generation"]

#: Early releases remembered (a RELEASE that arrives before the hold is registered).
MAX_EARLY_RELEASES = 65536
#: Holds pinned by a LEASE at once (one more LEASE is answered no: its decode waits for the
#: CONFIRM instead); as many as early releases, so that the pins cost no more than they do.
MAX_PINNED = 65536
#: LEASEs outstanding on one hold (one per decode rank reading it; a decode's TP is far below).
MAX_PINS = 1024
#: The longest pin a LEASE may ask (seconds): a deferred release waits at most this long.
MAX_PIN_S = 600.0

_last_generation = 0
_generation_lock = threading.Lock()


def new_generation() -> int:
    """A fresh generation: wall-clock nanoseconds, strictly above the last one this process
    made (so a restarted engine's generations are above its previous instance's)."""
    global _last_generation
    with _generation_lock:
        _last_generation = max(_last_generation + 1, time.time_ns())
        return _last_generation


class Verdict(enum.Enum):
    """What the table says of a ``(req, generation)``: held now, ended or never held here
    (``NO``), or newer than anything registered yet (``LATER``: its hold may not have reached
    this worker; its blocks cannot have been freed through this table)."""

    YES = "YES"
    NO = "NO"
    LATER = "LATER"


@dataclass(frozen=True)
class Pin:
    """What the LEASEs granted on one hold promise, as one value: a transition makes a new
    one (:meth:`granted`, :meth:`returned`, :meth:`releasing`), so that a hold's pin is never
    half-updated and reads as one state.

    ``leases``: LEASEs granted and not returned yet (a reader returns its own with its
    confirmation; a reader that never does is covered by ``until``). ``until``: the end of the
    latest pin granted (monotonic seconds of the prefill); past it the pin promises nothing.
    ``released``: a release arrived while pinned; the hold ends when the pin does.
    """

    leases: int
    until: float
    released: bool = False

    def live(self, now: float) -> bool:
        """Whether the pin still keeps the hold from ending by a release."""
        return self.leases > 0 and now < self.until

    def granted(self, until: float) -> Pin:
        """One more LEASE, pinned until ``until`` (or longer: an earlier grant's end)."""
        return Pin(self.leases + 1, max(self.until, until), self.released)

    def returned(self) -> Pin:
        """One reader that held a LEASE confirmed: its pin is over."""
        return Pin(max(0, self.leases - 1), self.until, self.released)

    def releasing(self) -> Pin:
        """A release arrived under the pin: deferred to the pin's end."""
        return Pin(self.leases, self.until, True)


@dataclass
class _Hold:
    generation: int
    deadline: float
    lease: float
    readers: int  # confirmations still needed before the hold ends by itself (0: not counted)
    counted: bool = False  # readers set (at hold() or by the first confirm): never reset
    pin: Pin | None = None  # the LEASEs granted on it (None: never leased)


class Holds:
    """The hold table of one prefill worker rank (see the module docstring).

    ``floor``: generations at or below it are never held (pass ``time.time_ns()`` at start-up
    when generations come from :func:`new_generation`).
    """

    def __init__(self, floor: int = 0) -> None:
        self._holds: dict[str, _Hold] = {}
        self._floor = _check_generation("floor", floor, low=0)
        self._ended: list[str] = []  # ended, not yet taken by finished()
        self._early: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self._pinned: set[str] = set()  # requests whose hold has a pin (maybe run out)
        # requests whose superseded hold was pinned -> the pin's end: not reported before it
        # (at most one per pinned hold: bounded as the pins are)
        self._covered: dict[str, float] = {}
        #: counters: holds made, leases that ran out, releases, confirmations given and
        #: refused, renewals, early releases remembered, LEASEs granted and refused (not held,
        #: or past the bounds on pins), releases deferred by a pin
        self.counts = {"held": 0, "expired": 0, "released": 0, "confirmed": 0, "refused": 0,
                       "renewed": 0, "early_releases": 0, "superseded": 0, "leased": 0,
                       "lease_refused": 0, "deferred": 0}

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, req: object) -> bool:
        return req in self._holds

    def generation(self, req: str) -> int | None:
        """The generation ``req`` is held under now, or None."""
        h = self._holds.get(req)
        return None if h is None else h.generation

    def hold(self, req: str, now: float, lease: float, generation: int | None = None,
             readers: int = 0) -> int:
        """Hold ``req``'s blocks for ``lease`` seconds from ``now``; returns the generation.

        ``generation`` must be above every generation this table has seen (None: the next
        one). A hold of ``req`` under an older generation ends (it is superseded). ``readers``:
        how many confirmations end the hold by themselves (0: only a release or the lease).
        """
        _check_now(now)
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) \
                or not math.isfinite(lease) or lease <= 0:
            raise ArgumentError(f"lease must be a finite number of seconds > 0, got {lease!r}")
        readers = _check_count("readers", readers)
        if generation is None:
            generation = self._floor + 1
        generation = _check_generation("generation", generation, low=0)
        if generation <= self._floor:
            raise ArgumentError(
                f"generation {generation} of request {req!r} is not above {self._floor}, the "
                "highest this hold table has seen: a generation is held once, never again "
                "(make them with new_generation(), in the order the scheduler made them)")
        self._floor = generation
        if req in self._holds:  # the old generation ends unreported: ``req`` stays held
            old = self._holds.pop(req)
            self.counts["superseded"] += 1
            if old.pin is not None and old.pin.live(now):
                # a leased read of the old generation may still be running, and its decode
                # reports it without asking again: ``req`` is not reported finished (its
                # blocks not freed) before that pin's end, however the new hold ends. Its
                # readers' confirmations name the old generation and are refused, so nothing
                # ends this wait early.
                self._covered[req] = max(self._covered.get(req, now), old.pin.until)
        self._holds[req] = _Hold(generation, now + lease, float(lease), readers, readers > 0)
        self.counts["held"] += 1
        if self._early.pop((req, generation), False) is not False:
            self._end(req)  # released before it reached this worker
            self.counts["released"] += 1
        # early releases of generations now below the floor can never match a hold
        while self._early and next(iter(self._early))[1] <= self._floor:
            self._early.popitem(last=False)
        return generation

    def verdict(self, req: str, generation: int, now: float) -> Verdict:
        """YES if ``req`` is held under ``generation`` at ``now`` (its lease not run out),
        LATER if ``generation`` is newer than any held here, else NO. Changes nothing but
        ending a hold whose lease ran out."""
        _check_now(now)
        h = self._live(req, now)
        if h is not None and h.generation == generation:
            return Verdict.YES
        if not isinstance(generation, int) or generation > self._floor:
            return Verdict.LATER
        return Verdict.NO

    def renew(self, req: str, generation: int, now: float) -> bool:
        """A live decode's heartbeat: extend the hold to ``now + lease``. False (and nothing
        changed) when the hold is not live under ``generation``."""
        if self.verdict(req, generation, now) is not Verdict.YES:
            return False
        h = self._holds[req]
        if h.pin is not None and h.pin.released:  # it ends at its pin's end: not extended
            return False
        h.deadline = max(h.deadline, now + h.lease)
        self.counts["renewed"] += 1
        return True

    def lease(self, req: str, generation: int, now: float, pin: float) -> Verdict:
        """A decode's LEASE: renew the hold and pin it for ``pin`` seconds from ``now``.

        YES: ``req`` is held under ``generation``, now held until at least ``now + pin``,
        and until then only its readers' confirmations (or the return of every pin) can end
        it: a release in the meantime is deferred (:meth:`release`). NO: not held, released
        already, or past the bounds on pins (the decode waits for its CONFIRM then). LATER:
        a generation not registered yet (asked again)."""
        if isinstance(pin, bool) or not isinstance(pin, (int, float)) \
                or not 0 < pin <= MAX_PIN_S:
            raise ArgumentError(f"pin must be a number of seconds in (0, {MAX_PIN_S:g}], "
                                f"got {pin!r}")
        v = self.verdict(req, generation, now)
        if v is not Verdict.YES:
            if v is Verdict.NO:
                self.counts["lease_refused"] += 1
            return v
        h = self._holds[req]
        old = h.pin if h.pin is not None and h.pin.live(now) else None
        released = h.pin is not None and h.pin.released  # nobody should start reading it
        full = old.leases >= MAX_PINS if old is not None else not self._room_to_pin(now)
        if released or full:
            self.counts["lease_refused"] += 1
            return Verdict.NO
        h.pin = (old or Pin(0, now)).granted(now + pin)
        h.deadline = max(h.deadline, now + h.lease, h.pin.until)
        self._pinned.add(req)
        self.counts["leased"] += 1
        return Verdict.YES

    def _room_to_pin(self, now: float) -> bool:
        """Whether one more hold may be pinned (:data:`MAX_PINNED`); forgets ended and
        run-out pins first when the set is full (a scan of the set: only a table with
        MAX_PINNED pins outstanding pays it, once per LEASE)."""
        if len(self._pinned) < MAX_PINNED:
            return True
        self._pinned = {r for r in self._pinned if (h := self._holds.get(r)) is not None
                        and h.pin is not None and h.pin.live(now)}
        return len(self._pinned) < MAX_PINNED

    def confirm(self, req: str, generation: int, now: float, readers: int = 0,
                leased: bool = False) -> bool:
        """True only if ``req`` has been held under ``generation`` continuously until ``now``.
        A true answer counts as one reader's end of use (the hold ends after its
        ``readers``-th); a false one is counted as refused. ``readers``: how many readers
        the hold has, as the first confirming reader says (the decode knows it, the prefill
        does not); ignored once the hold counts readers. ``leased``: the reader holds a
        LEASE (the side channel's RETURN), which it returns: a release deferred by the pin
        takes effect once every pin is returned."""
        readers = _check_count("readers", readers)
        if self.verdict(req, generation, now) is not Verdict.YES:
            self.counts["refused"] += 1
            return False
        self.counts["confirmed"] += 1
        h = self._holds[req]
        if leased and h.pin is not None:
            # only a reader that said it holds a LEASE returns one: a plain CONFIRM (a
            # reader whose LEASE was refused, or lost) must not end another reader's pin
            h.pin = h.pin.returned()
            if h.pin.released and h.pin.leases == 0:
                self._end(req)
                self.counts["released"] += 1
                return True
        if readers and not h.counted:
            h.readers, h.counted = readers, True
        if h.readers:
            h.readers -= 1
            if h.readers == 0:
                self._end(req)
                self.counts["released"] += 1
        return True

    def release(self, req: str, generation: int | None = None,
                now: float | None = None) -> bool:
        """Nobody will read ``req`` (under ``generation``; None: whatever is held): end its
        hold. A release of a generation newer than any held here is remembered (bounded) and
        ends that hold as soon as it is made. True if a live hold ended (with ``now``, a hold
        whose lease ran out by then ends as expired, and the answer is False), or will end
        when its pin does (a LEASE granted it: :meth:`lease`; ``now`` None counts any pin
        with a LEASE outstanding as live, and its end still bounds the wait)."""
        h = self._holds.get(req) if now is None else self._live(req, now)
        if h is not None and (generation is None or h.generation == generation):
            if h.pin is not None and (now is None or h.pin.live(now)) and h.pin.leases:
                # a leased read may be running and be reported without a CONFIRM: the hold
                # ends when its pins are returned or run out, never under that read
                if not h.pin.released:
                    h.pin = h.pin.releasing()
                    h.deadline = min(h.deadline, h.pin.until)
                    self.counts["deferred"] += 1
                return True
            self._end(req)
            self.counts["released"] += 1
            return True
        if isinstance(generation, int) and generation > self._floor:
            self._early[(req, generation)] = None
            self.counts["early_releases"] += 1
            while len(self._early) > MAX_EARLY_RELEASES:  # bounded: the lease frees them
                self._early.popitem(last=False)
        return False

    def expire(self, now: float) -> list[str]:
        """End every hold whose lease ran out by ``now``; returns those requests (they also
        come out of :meth:`finished`, as do releases deferred to a pin that ended by ``now``,
        which are not returned: they were released, not expired)."""
        _check_now(now)
        due = [r for r, h in self._holds.items() if h.deadline <= now]
        # a release deferred to its pin's end ends now too, as released (not returned)
        return [r for r in due if self._run_out(r)]

    def finished(self, now: float) -> list[str]:
        """Every request whose hold ended since the last call (expired at ``now`` included),
        each once: the sends the connector reports finished to vLLM, which frees their
        blocks. Nothing else may report them (a request held again since, under a newer
        generation, is not reported until that hold ends)."""
        self.expire(now)
        self._covered = {r: t for r, t in self._covered.items() if t > now}
        # one that is held again (a new generation) is reported when that hold ends; one
        # whose superseded hold's pin is still live, at a later call after the pin's end
        ended = dict.fromkeys(self._ended)
        out = [r for r in ended if r not in self._holds and r not in self._covered]
        self._ended = [r for r in ended if r in self._covered and r not in self._holds]
        return out

    def _live(self, req: str, now: float) -> _Hold | None:
        h = self._holds.get(req)
        if h is not None and h.deadline <= now:  # ran out: ended now, never live again
            self._run_out(req)
            return None
        return h

    def _run_out(self, req: str) -> bool:
        """End ``req``'s hold at its deadline: a deferred release's (the pin's end) counts as
        released, any other as expired (True)."""
        h = self._holds[req]
        expired = h.pin is None or not h.pin.released
        self.counts["expired" if expired else "released"] += 1
        self._end(req)
        return expired

    def _end(self, req: str) -> None:
        del self._holds[req]
        self._pinned.discard(req)
        self._ended.append(req)


def _check_now(now: object) -> None:
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
        raise ArgumentError(f"now must be a finite number of seconds, got {now!r}")


def _check_generation(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 1 << 63:
        raise ArgumentError(f"{name} must be an int in [{low}, 2**63), got {value!r}")
    return value


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ArgumentError(f"{name} must be an int >= 0, got {value!r}")
    return value
