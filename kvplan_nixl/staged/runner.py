"""The runner of local legs: a chunk's gather or scatter, inline or on a worker thread.

Owns the worker thread and the legs in flight on it. A leg copies between the rank's engine
buffers and one slot (:mod:`kvplan_nixl.staged.legs` does the copy); when it returns, the
runner finishes it on the polling thread (:meth:`LegRunner.reap`): the job's slot is freed if
the job failed meanwhile, else the leg's continuation runs. It decides nothing about the
protocol: continuations and the failure callback come from the initiator or the server. It may
not import them, the protocol or the Stager.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable
from typing import Any

import torch

from kvplan_nixl.staged import legs
from kvplan_nixl.staged.pool import SlotPool
from kvplan_nixl.transfer import WAKE, State

__all__ = ["LegRunner"]

#: ``fail(job, reason)``: what a leg that raised does to its job
Fail = Callable[[Any, str], None]


class LegRunner:
    """Local legs of the jobs of one Stager (``overlap``: on a worker thread)."""

    def __init__(self, pool: SlotPool, buffers: dict[int, torch.Tensor],
                 cpu_threads: int | None, overlap: bool) -> None:
        self.pool = pool
        self.buffers = buffers  # flat byte tensors by index in spec.buffers
        self.cpu_threads = cpu_threads
        self._running: collections.deque = collections.deque()
        # local legs on a worker thread, so gather/scatter of one chunk overlap NIXL on others
        self._worker = (concurrent.futures.ThreadPoolExecutor(1, "kvplan-staged-leg")
                        if overlap else None)

    def run(self, j: Any, k: int, which: str, then: Callable[[], None], fail: Fail) -> None:
        """Run chunk k's leg ``which`` ("gather" or "scatter"; its slot is ``j.slots[k]``),
        then ``then()`` on the polling thread if ``j`` is still pending. With a worker the leg
        runs there (torch and numpy release the GIL) while the polling thread keeps posting and
        progressing NIXL."""
        j.busy.add(k)
        if self._worker is None:
            try:
                self._local_leg(j, k, j.slots[k], which)
            except Exception as exc:
                self._after(j, k, then, fail, exc)
                raise
            self._after(j, k, then, fail, None)
            return
        fut = self._worker.submit(self._local_leg, j, k, j.slots[k], which)
        fut.add_done_callback(_wake)  # a waiting drive() polls now, not after its nap
        self._running.append((fut, j, k, then, fail))

    def reap(self) -> int:
        """Finish the legs the worker completed, in submission order; how many."""
        n = 0
        while self._running and self._running[0][0].done():
            fut, j, k, then, fail = self._running.popleft()
            self._after(j, k, then, fail, fut.exception())
            n += 1
        return n

    def close(self) -> None:
        """Wait for the legs still running (they write into the pool), then finish them."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
            self.reap()

    def _after(self, j: Any, k: int, then: Callable[[], None], fail: Fail,
               exc: BaseException | None) -> None:
        j.busy.discard(k)
        if exc is not None:
            fail(j, f"local {type(exc).__name__} on chunk {k}: {exc}")
        if j.state is not State.PENDING:  # failed while the leg ran: its slot is free now
            slot = j.slots.pop(k, None)
            if slot is not None:
                self.pool.release(slot)
            return
        then()

    def _local_leg(self, j: Any, k: int, slot: int, which: str) -> None:
        sp = j.sp
        if j.index is None:  # once per job, on the leg thread (one per Stager: no race)
            mine = slice(int(j.chunks["row_start"][0]), int(j.chunks["row_end"][-1]))
            j.index = legs.SideIndex(sp, "src" if which == "gather" else "dst", mine)
        ops = j.index.chunk(j.chunks[k])
        dest = self.pool.slot(slot)
        with legs.cpu_threads(self.cpu_threads, dest):
            (legs.gather if which == "gather" else legs.scatter)(ops, self.buffers, dest,
                                                                   sp.granule)
        legs.synchronize(dest)


def _wake(_fut) -> None:
    WAKE.set()
