"""The local legs of a staged transfer: gather into and scatter out of a staging slot, in torch.

A leg's rows (``kvplan.staging``) have offsets and lengths that are multiples of the staged
plan's ``granule``, so every engine buffer and the slot are viewed as 2-D ``(rows, granule)``
uint8 tensors and one chunk is copied with one index operation per buffer it touches: the index
is
the flat int64 list of granule numbers the chunk's runs cover, built with numpy arithmetic (no
Python loop per run). The same code runs on CPU and CUDA tensors; indices are moved to the
tensors' device.

One exception, measured (docs/performance.md): on CPU, torch's ``index_copy_`` and
``index_put_`` copy element by element (0.07x of a memcpy for uint8 rows of 4 KiB, 0.4x for
int64 rows) while ``index_select`` copies each row as one block (0.6-0.9x). So the CPU scatter
writes through numpy fancy indexing over the same memory (``Tensor.numpy()`` shares it, 0.6x);
CUDA tensors use ``index_copy_``.

Owns the copies only (no NIXL, no protocol, no request state); it may import no other module
of kvplan_nixl.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from kvplan.staging import StagedPlan

#: Guards :data:`_SHARED`, the state of :func:`cpu_threads` (torch's intra-op thread count is
#: per process): legs asking for the same count share the setting and run together; a leg
#: asking for another count waits until they are done.
_THREADS = threading.Condition()
#: [count in force, legs holding it, the setting to restore when the last one leaves]
_SHARED: list = [None, 0, None]

__all__ = ["Chunk", "SideIndex", "byte_tensor", "cpu_threads", "gather", "granule_index",
           "scatter", "synchronize"]


def byte_tensor(buf: Any) -> torch.Tensor:
    """A flat uint8 tensor sharing the memory of ``buf``: a contiguous tensor, a C-contiguous
    numpy array or an ``(address, nbytes)`` pair of host memory (as Endpoint accepts)."""
    if isinstance(buf, torch.Tensor):
        return buf.reshape(-1).view(torch.uint8)
    if isinstance(buf, np.ndarray):
        return torch.from_numpy(buf.reshape(-1).view(np.uint8))
    addr, nbytes = int(buf[0]), int(buf[1])
    arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
    return torch.from_numpy(arr)


def granule_index(offsets: np.ndarray, lengths: np.ndarray, granule: int) -> np.ndarray:
    """Every granule number covered by runs ``(offset, length)``, run after run (int64).

    Offsets and lengths must be multiples of ``granule`` (the staged plan guarantees it).
    """
    first = offsets // granule
    count = lengths // granule
    total = int(count.sum())
    if total == len(count):  # one granule per run: the common fragmented case
        return first.astype(np.int64, copy=False)
    starts = np.repeat(first - (np.cumsum(count) - count), count)
    return starts + np.arange(total, dtype=np.int64)


class Chunk:
    """One chunk's copy operations: per buffer stretch, (buffer, slot granules [a, b), index)."""

    __slots__ = ("nbytes", "ops")

    def __init__(self, ops: list[tuple[int, int, int, np.ndarray]], nbytes: int) -> None:
        self.ops = ops
        self.nbytes = nbytes


class SideIndex:
    """One engine side of a staged plan's local leg, as granule numbers in staging order.

    Built once per request, side (``kvplan.staging.StagedPlan.side``: ``"src"`` for the gather,
    ``"dst"`` for the scatter) and range of pieces (``pieces``: one peer's, as each peer's job
    needs only its own); :meth:`chunk` then cuts one chunk's operations out of it by slicing,
    so a chunk costs a few ``searchsorted`` calls, not a pass over its runs. Pieces are packed
    in the staging space (each chunk's from its first byte), so the granules of a chunk land in
    its slot in the order they are listed here.
    """

    def __init__(self, sp: StagedPlan, side: str, pieces: slice = slice(None)) -> None:
        buffer, offset, length, _ = sp.side(side, pieces)
        self.granule = g = sp.granule
        self.first = pieces.start or 0  # piece numbers in chunk rows are the plan's
        self.buffer = buffer
        self.index = granule_index(offset, length, g)
        self.start = np.concatenate(([0], np.cumsum(length // g)))  # granule of each piece
        # pieces where the buffer changes: each stretch between is one index copy
        self.cuts = np.flatnonzero(buffer[1:] != buffer[:-1]) + 1

    def chunk(self, ch: np.void) -> Chunk:
        """The operations of chunk row ``ch`` (of ``StagedPlan.chunks``, within ``pieces``)."""
        rs, re = int(ch["row_start"]) - self.first, int(ch["row_end"]) - self.first
        a = int(np.searchsorted(self.cuts, rs, side="right"))
        b = int(np.searchsorted(self.cuts, re, side="left"))
        bounds = [rs, *self.cuts[a:b].tolist(), re]
        g0 = int(self.start[rs])
        ops = []
        for lo, hi in itertools.pairwise(bounds):  # per buffer stretch, not per run
            ga, gb = int(self.start[lo]), int(self.start[hi])
            ops.append((int(self.buffer[lo]), ga - g0, gb - g0, self.index[ga:gb]))
        return Chunk(ops, (int(self.start[re]) - g0) * self.granule)


def _rows(t: torch.Tensor, granule: int) -> torch.Tensor:
    n = t.numel() // granule
    return t[: n * granule].view(n, granule)


def gather(ops: Chunk, buffers: dict[int, torch.Tensor], slot: torch.Tensor,
           granule: int) -> None:
    """Copy the chunk's runs from the engine ``buffers`` (flat uint8 per index of
    ``EngineSpec.buffers``) into ``slot`` (flat uint8, the chunk's staging bytes from 0)."""
    slot2 = _rows(slot, granule)
    for buffer, a, b, idx in ops.ops:
        src = _rows(buffers[buffer], granule)
        torch.index_select(src, 0, torch.from_numpy(idx).to(src.device), out=slot2[a:b])


def scatter(ops: Chunk, buffers: dict[int, torch.Tensor], slot: torch.Tensor,
            granule: int) -> None:
    """Copy the chunk's bytes from ``slot`` to their places in the engine ``buffers``."""
    slot2 = _rows(slot, granule)
    for buffer, a, b, idx in ops.ops:
        dst = _rows(buffers[buffer], granule)
        if dst.device.type == "cpu":  # see the module doc: torch's CPU scatter is per element
            # one granule as one numpy void item: a memcpy per row (1.3x the uint8 rows' rate)
            void = np.dtype((np.void, granule))
            dst.numpy().reshape(-1).view(void)[idx] = slot2[a:b].numpy().reshape(-1).view(void)
        else:
            dst.index_copy_(0, torch.from_numpy(idx).to(dst.device), slot2[a:b])


@contextlib.contextmanager
def cpu_threads(n: int | None, t: torch.Tensor) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads when ``t`` is on the CPU (restored
    after); ``None`` or a CUDA tensor leaves torch's setting alone.

    Why: a leg is a few index copies of about a MiB per buffer; on a busy host, splitting each
    over threads costs more in synchronisation than it gains (measured on 2 shared cores: 1.4
    GB/s with one thread, 0.05-0.5 GB/s with two).

    Legs asking for the same ``n`` (every Stager of a process by default) hold the setting
    together, so the legs of several Stagers in one process overlap; an earlier version held
    one lock per leg, which ran every leg of a process one after another (measured with
    ``benchmarks/profile_staged.py``, docs/performance.md).
    """
    if n is None or t.device.type != "cpu":
        yield
        return
    with _THREADS:  # legs of several stagers wanting the same count run together
        while _SHARED[1] and _SHARED[0] != n:
            _THREADS.wait()
        if not _SHARED[1]:
            _SHARED[0], _SHARED[2] = n, torch.get_num_threads()
        _SHARED[1] += 1
        torch.set_num_threads(n)  # also on this thread: OpenMP keeps the count per thread
    try:
        yield
    finally:
        with _THREADS:
            _SHARED[1] -= 1
            if not _SHARED[1]:
                torch.set_num_threads(_SHARED[2])
                _SHARED[0] = None
                _THREADS.notify_all()


def synchronize(t: torch.Tensor) -> None:
    """Wait for queued kernels on ``t``'s device (a no-op on CPU) before NIXL reads the bytes."""
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()
