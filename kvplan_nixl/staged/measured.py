"""What ``how="auto"`` learns from the requests it moved: seconds per byte of each mode.

The cost model (``kvplan.staging.prefer_staged`` on costs from ``Stager.calibrate``) decides
before anything was measured, but its inputs are micro-measurements taken once, and on a busy
machine or over a link whose per-descriptor cost depends on the descriptors' size they can
mislead it: between two hosts over TCP it chose staging for an MLA request (18 KiB runs) that
moved 15-19% faster direct (docs/performance.md, "Two hosts"). So every request a Stager posts
is timed once complete, per *shape* (the remote engine, the direction, and the request's mean
run size, in powers of two), as an exponentially weighted mean of seconds per byte for the
mode that moved it (``direct``, ``staged``, or ``mixed`` when auto split the peers). Once a
shape has been moved both direct and staged, auto posts the mode with the lower mean; until
then it tries the mode not yet measured, after the cost model's choice; and one request in
:data:`EXPLORE` re-measures the mode it would not pick (one in 256 when that mode was more
than :data:`CLOSE` times slower), so a choice follows the link when it changes. A request
that fails is not counted. Requests the cost model never stages (at most one run per chunk:
nothing to gather) are not decided here: they go direct.

Owns the measurements only: the Stager asks :meth:`Measured.pick` and hands every posted
transfer to :meth:`Measured.watch`; :meth:`Measured.reap` (called by ``Stager.poll``) records
the finished ones. It imports no other module of the staged executor.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ALPHA", "CLOSE", "EXPLORE", "MODES", "WATCHED", "Measured"]

#: Modes compared (a ``mixed`` request is measured too, and picked when it was the fastest).
MODES = ("direct", "staged")
#: Weight of a new sample in a shape's mean (the rest is its history).
ALPHA = 0.3
#: One request in this many (per shape) re-measures the mode not currently picked, while the
#: two modes' rates are within :data:`CLOSE` of each other; one in ``16 * EXPLORE`` when they
#: are further apart (a re-measure then costs more and changes nothing unless the link did).
EXPLORE = 16
CLOSE = 1.5
#: Transfers timed at once at most (the oldest is forgotten beyond: a transfer nobody waits
#: for must not grow this list).
WATCHED = 4096


class Measured:
    """Seconds per byte by (shape, mode), from the requests that completed."""

    def __init__(self) -> None:
        self.rate: dict[tuple, dict[str, float]] = {}
        self.decisions: dict[tuple, int] = {}
        self._watching: list[tuple[Any, tuple, str, int]] = []

    @staticmethod
    def shape(remote: str, mode: str, runs: int, nbytes: int) -> tuple:
        """The key requests are compared under: engine, direction, mean run size (log2)."""
        mean = nbytes / max(runs, 1)
        return (remote, mode, int(math.log2(mean)) if mean >= 1 else 0)

    def pick(self, key: tuple, model: str) -> tuple[str, str]:
        """(mode, why) for the next request of ``key``; ``model`` is the cost model's
        choice (``direct``, ``staged`` or ``mixed``)."""
        seen = self.rate.get(key, {})
        n = self.decisions[key] = self.decisions.get(key, 0) + 1
        if model not in seen:
            return model, "cost model (not measured yet)"
        missing = [m for m in MODES if m not in seen]
        if missing:
            return missing[0], "measuring the other mode once"
        best = min(seen, key=seen.__getitem__)
        other = min((m for m in seen if m != best), key=seen.__getitem__)
        every = EXPLORE if seen[other] <= CLOSE * seen[best] else 16 * EXPLORE
        if n % every == 0:
            return other, f"re-measuring (one request in {every})"
        return best, f"measured fastest ({seen[best] * 1e9:.3f} s/GB)"

    def watch(self, transfer: Any, key: tuple, mode: str, nbytes: int) -> None:
        """Time ``transfer`` (``mode`` of a request of ``key``) once it completed."""
        if nbytes > 0:
            self._watching.append((transfer, key, mode, nbytes))
            del self._watching[:-WATCHED]

    def reap(self) -> None:
        """Record the watched transfers that ended (those that failed are dropped)."""
        keep = []
        for t, key, mode, nbytes in self._watching:
            seconds = t.seconds if t.done else None
            if seconds is None and (not t.done or t.ok):  # its end not stamped yet
                keep.append((t, key, mode, nbytes))
                continue
            if t.ok and seconds > 0:
                rates = self.rate.setdefault(key, {})
                sample = seconds / nbytes
                old = rates.get(mode)
                rates[mode] = sample if old is None else (1 - ALPHA) * old + ALPHA * sample
        self._watching = keep
