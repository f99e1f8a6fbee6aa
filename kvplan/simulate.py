"""The reference executor: apply a plan to numpy byte buffers, for tests and notebooks.

Layer 4 (built on plans): imports plan and staging; nothing in the core imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import numpy as np

from kvplan.errors import PlanError
from kvplan.plan import TransferPlan
from kvplan.staging import STAGING, Leg

#: Runs at least this long are copied one slice each (a Python step of about 1 us, then a
#: memcpy at memory speed); shorter ones all at once by fancy indexing, whose cost is per
#: index (about 10 ns) rather than per run. Measured crossover: between 2 and 8 KiB.
LONG_RUN = 4096

#: The short runs' fancy indexing is done this many index units at a time, so its index arrays
#: stay under 64 MiB whatever the plan's size.
UNITS_PER_STEP = 1 << 22


def simulate(
    plan: TransferPlan | Leg,
    src_buffers: Mapping[tuple[int, int], np.ndarray],
    dst_buffers: MutableMapping[tuple[int, int], np.ndarray],
) -> None:
    """Copy every run of ``plan`` from ``src_buffers`` into ``dst_buffers``, in place.

    ``plan`` may also be one leg of a staged plan (``kvplan.staging``); a staging area is keyed
    ``(rank, STAGING)``.

    Buffers are 1-D ``uint8`` arrays keyed ``(rank, buffer name)`` (a name of the engine's
    ``EngineSpec.buffers``) or ``(rank, region_index)`` (the regions of one pool or allocation
    sharing one array; a region with separate K and V buffers needs the names).

    Raises :class:`~kvplan.PlanError` before copying a byte when the plan and the buffers
    disagree: a buffer missing or not 1-D ``uint8``, a run of no bytes or outside its buffer,
    or two runs writing the same destination byte (a plan never produces one).

    Cost: numpy over runs, no Python step per byte. Runs of :data:`LONG_RUN` bytes or more
    are copied one slice each (the loop's cost is per run, the copy's at memory speed); the
    rest of a pair of buffers at once, by index arrays over units of the greatest common
    divisor of their offsets and lengths, :data:`UNITS_PER_STEP` units at a time. A 154 MiB
    plan of 19,840 runs of 4-8 KiB takes about twice a plain ``np.copyto`` of as many bytes
    (0.2-0.45 s on a loaded 2-core machine); many short runs cost 1.5-3 us each, so a plan of
    millions of 256-byte runs takes seconds (``benchmarks/bench_simulate.py``,
    docs/performance.md). Extra memory: at most 64 MiB of indices, plus one copy of the bytes
    of the short runs in each step.
    """
    rows = plan.copies()
    if len(rows) == 0:
        return
    col = {c: np.ascontiguousarray(rows[c]) for c in rows.dtype.names}  # strided: slow to read
    length = col["length"]
    if (length <= 0).any():
        k = int(np.flatnonzero(length <= 0)[0])
        raise PlanError(f"run {k} copies {int(length[k])} bytes (source offset "
                        f"{int(col['src_offset'][k])}): every run copies at least one byte")
    m = plan.map
    # one int64 key per (rank, buffer) on each side (STAGING = -1 becomes 0), then per pair
    src_key = col["src_rank"] * (len(m.src.buffers) + 1) + col["src_buffer"] + 1
    dst_key = col["dst_rank"] * (len(m.dst.buffers) + 1) + col["dst_buffer"] + 1
    pairs, first, which = np.unique(src_key * (int(dst_key.max()) + 1) + dst_key,
                                    return_index=True, return_inverse=True)
    order = np.argsort(which, kind="stable")  # rows of pair k: order[ends[k]:ends[k + 1]]
    ends = np.concatenate(([0], np.cumsum(np.bincount(which, minlength=len(pairs)))))
    jobs = []
    for k, f in enumerate(first.tolist()):
        sel = order[ends[k]:ends[k + 1]]
        bufs = []
        for side, buffers, spec, c in (("source", src_buffers, m.src, "src"),
                                       ("destination", dst_buffers, m.dst, "dst")):
            rank, name = int(col[f"{c}_rank"][f]), _name(spec, int(col[f"{c}_buffer"][f]))
            buf = _lookup(buffers, side, rank, name, int(col[f"{c}_region"][f]))
            _check_inside(col[f"{c}_offset"][sel], length[sel], buf,
                          f"{side} buffer {name!r} of rank {rank}")
            bufs.append(buf)
        jobs.append((*bufs, sel))
    _check_disjoint(col["dst_offset"], length, dst_key)
    for src, dst, sel in jobs:
        _copy(src, dst, col["src_offset"][sel], col["dst_offset"][sel], length[sel])


def _copy(src: np.ndarray, dst: np.ndarray, so: np.ndarray, do: np.ndarray,
          length: np.ndarray) -> None:
    """``dst[do:do+length] = src[so:so+length]`` for every run: long runs one slice each, the
    short ones by fancy indexing in units of their common divisor."""
    long = length >= LONG_RUN
    for a, b, n in zip(so[long].tolist(), do[long].tolist(), length[long].tolist()):
        dst[b:b + n] = src[a:a + n]
    if long.all():
        return
    so, do, length = so[~long], do[~long], length[~long]
    unit = int(np.gcd.reduce(np.concatenate((so, do, length))))
    view = np.dtype((np.void, unit)) if unit > 1 else np.uint8
    s = src[:src.size - src.size % unit].view(view)
    d = dst[:dst.size - dst.size % unit].view(view)
    so, do, length = so // unit, do // unit, length // unit
    ends = np.cumsum(length)
    start = 0
    while start < len(length):  # runs [start, stop): at most UNITS_PER_STEP units (or one run)
        done = ends[start - 1] if start else 0
        stop = max(int(np.searchsorted(ends, done + UNITS_PER_STEP, "right")), start + 1)
        d[_index(do[start:stop], length[start:stop])] = s[
            _index(so[start:stop], length[start:stop])]
        start = stop


def _index(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every position covered by runs ``(offset, length)``, run after run."""
    total = int(lengths.sum())
    starts = np.repeat(offsets - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return starts + np.arange(total, dtype=np.int64)


def _check_inside(offset: np.ndarray, length: np.ndarray, buf: np.ndarray, what: str) -> None:
    end = offset + length
    bad = (offset < 0) | (end > buf.size)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise PlanError(
            f"a run at bytes {int(offset[k])}:{int(end[k])} lies outside the {buf.size}-byte "
            f"{what} ({int(bad.sum())} of {len(bad)} runs do)"
        )


def _check_disjoint(offset: np.ndarray, length: np.ndarray, key: np.ndarray) -> None:
    """No destination byte is written by two runs (``key``: the run's rank and buffer)."""
    order = np.lexsort((offset, key))
    o, n, k = offset[order], length[order], key[order]
    clash = (k[1:] == k[:-1]) & (o[1:] < o[:-1] + n[:-1])
    if clash.any():
        j = int(np.flatnonzero(clash)[0])
        raise PlanError(
            f"two runs write destination bytes {int(o[j + 1])}:{int(o[j] + n[j])} of one buffer "
            f"(runs {int(order[j])} and {int(order[j + 1])}, at {int(o[j])} and "
            f"{int(o[j + 1])}): a plan writes each byte once"
        )


def _name(spec, buffer: int):
    """A buffer's name, or :data:`~kvplan.staging.STAGING` for a staging area (a staged leg)."""
    if buffer == STAGING:
        return STAGING
    if not 0 <= buffer < len(spec.buffers):
        raise PlanError(f"a run names buffer {buffer}, but the engine has {len(spec.buffers)} "
                        f"buffers: the plan was made for another spec")
    return spec.buffers[buffer]


def _lookup(buffers: Mapping, side: str, rank: int, name, region: int) -> np.ndarray:
    """The array of buffer ``name`` of ``rank``: by name, else by a region living in it."""
    for key in ((rank, name), (rank, region)):
        if key in buffers:
            buf = buffers[key]
            if (not isinstance(buf, np.ndarray) or buf.ndim != 1 or buf.dtype != np.uint8
                    or buf.strides != (1,)):
                what = (f"a {buf.ndim}-D {buf.dtype} array with strides {buf.strides}"
                        if isinstance(buf, np.ndarray)
                        else type(buf).__name__)
                raise PlanError(f"{side} buffer {key!r} is {what}: simulate takes contiguous 1-D "
                                "uint8 numpy arrays (tensor.numpy().view(np.uint8).ravel())")
            return buf
    raise PlanError(f"no {side} buffer for rank {rank} buffer {name!r} (keyed {(rank, name)!r} "
                    f"or by a region in it, {(rank, region)!r}); {len(buffers)} buffers given")
