"""The reference executor: apply a plan to numpy byte buffers, for tests and notebooks.

Layer 4 (built on plans): imports plan and staging; nothing in the core imports it.
:func:`check_plan` is its validation on its own (a plan against its map's geometry), which
executors apply before posting.
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
    col = _columns(rows)  # strided: slow to read
    _check_columns(plan, col)  # the plan against its map's geometry (as executors check it)
    length = col["length"]
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
            _check_inside(col[f"{c}_offset"][sel], length[sel], buf.size,
                          f"{side} buffer {name!r} of rank {rank}")
            bufs.append(buf)
        jobs.append((*bufs, sel))
    for src, dst, sel in jobs:
        _copy(src, dst, col["src_offset"][sel], col["dst_offset"][sel], length[sel])


def check_plan(plan: TransferPlan | Leg) -> None:
    """Raise :class:`~kvplan.PlanError` unless every run of ``plan`` fits its map's geometry.

    The checks :func:`simulate` applies before copying a byte, on the plan alone (no
    buffers), so that an executor can apply exactly them before posting (``kvplan_nixl``
    does, once per plan): a plan is a value that can be edited, serialised and handed
    around, and its arrays are trusted no more than this. Refused, naming the run and the
    numbers: a run of no bytes; a rank outside its engine; a buffer or region index outside
    its spec (a staged leg's staging side, :data:`~kvplan.staging.STAGING`, excepted); a region
    of another pipeline stage than the run's rank, or not living in the run's buffer; a run
    outside its buffer (``EngineSpec.rank_buffer_nbytes``); two runs writing one destination
    byte; and for a :class:`~kvplan.TransferPlan`, a local rank other than the map's or a peer
    rank the map does not name (``map.peers``).

    Cost: numpy over the runs (no Python step per run): a few element-wise passes and one
    sort of the destination keys when the runs are not already in order
    (docs/performance.md, "Checking plans").
    """
    rows = plan.copies()
    if len(rows):
        _check_columns(plan, _columns(rows))


def _columns(rows: np.ndarray) -> dict[str, np.ndarray]:
    """The plan's columns as contiguous int64 arrays: one transposed copy when the rows are
    packed int64 records (COPY_DTYPE; a third of the time of a strided copy per field)."""
    names = rows.dtype.names
    dt = rows.dtype
    if dt.itemsize == 8 * len(names) and all(dt[n] == np.int64 for n in names) and \
            rows.flags.c_contiguous:
        flat = rows.view(np.int64).reshape(len(rows), len(names)).T.copy()
        return {n: flat[dt.fields[n][1] // 8] for n in names}
    return {c: np.ascontiguousarray(rows[c]) for c in names}


def _check_columns(plan: TransferPlan | Leg, col: Mapping[str, np.ndarray]) -> None:
    """:func:`check_plan` on the plan's columns (contiguous copies)."""
    length = col["length"]
    if (length <= 0).any():
        k = int(np.flatnonzero(length <= 0)[0])
        raise PlanError(f"run {k} copies {int(length[k])} bytes (source offset "
                        f"{int(col['src_offset'][k])}): every run copies at least one byte")
    m = plan.map
    for side, spec, c in (("source", m.src, "src"), ("destination", m.dst, "dst")):
        _check_side(side, spec, col[f"{c}_rank"], col[f"{c}_buffer"], col[f"{c}_region"],
                    col[f"{c}_offset"], length)
    nbuf = len(m.dst.buffers) + 1
    _check_disjoint(col["dst_offset"], length, col["dst_rank"] * nbuf + col["dst_buffer"] + 1)
    if isinstance(plan, TransferPlan):
        _check_ranks(plan, col)


def _geometry(spec) -> tuple[np.ndarray, ...]:
    """Per region: its pipeline stage, its (K) buffer, its V buffer (-2 when K and V share
    one); per buffer: its bytes on a rank. Not cached: a loop over regions, not runs (tens of
    microseconds), and the core keeps no state between calls."""
    n = len(spec.regions)
    stage = np.array([spec.stage_of(i) for i in range(n)], dtype=np.int64)
    kbuf = np.array([spec.buffer_of(i) for i in range(n)], dtype=np.int64)
    vbuf = np.array([spec.buffer_of(i, 1) if spec.regions[i].separate_kv else -2
                     for i in range(n)], dtype=np.int64)
    size = np.array([spec.rank_buffer_nbytes(b) for b in range(len(spec.buffers))],
                    dtype=np.int64)
    return stage, kbuf, vbuf, size


def _check_side(side: str, spec, rank: np.ndarray, buffer: np.ndarray, region: np.ndarray,
                offset: np.ndarray, length: np.ndarray) -> None:
    """One side's columns against ``spec`` (a staging side, buffer STAGING, is not the
    spec's: its runs are skipped here, checked against the staging area by simulate)."""
    real = buffer != STAGING
    if not real.all():
        rank, buffer, region, offset, length = (a[real] for a in
                                                (rank, buffer, region, offset, length))
    if not len(rank):
        return
    stage, kbuf, vbuf, size = _geometry(spec)
    _first_bad(side, "rank", rank, (rank < 0) | (rank >= spec.num_ranks),
               f"the engine has ranks 0..{spec.num_ranks - 1}")
    nb, nr = len(size), len(stage)
    bad = (buffer < 0) | (buffer >= nb)
    if bad.any():
        b = int(buffer[np.flatnonzero(bad)[0]])
        raise PlanError(f"a run names {side} buffer {b}, but the engine has {nb} buffers: the "
                        f"plan was made for another spec ({int(bad.sum())} runs do)")
    _first_bad(side, "region", region, (region < 0) | (region >= nr),
               f"the engine has regions 0..{nr - 1}")
    bad = stage[region] != rank // (spec.tp_size * spec.pcp_size)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise PlanError(
            f"a run names {side} rank {int(rank[k])} region {int(region[k])}, but that rank "
            f"holds no region {spec.regions[int(region[k])].name!r} (another pipeline stage: "
            f"{int(stage[region[k]])}; {int(bad.sum())} runs do)")
    bad = (kbuf[region] != buffer) & (vbuf[region] != buffer)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise PlanError(
            f"a run names {side} rank {int(rank[k])} region {int(region[k])} in buffer "
            f"{int(buffer[k])}, but that region lives in buffer {int(kbuf[region[k]])} "
            f"({int(bad.sum())} runs disagree so)")
    _check_inside(offset, length, size[buffer], f"{side} buffer", names=spec.buffers,
                  buffer=buffer, rank=rank)


def _first_bad(side: str, what: str, values: np.ndarray, bad: np.ndarray, have: str) -> None:
    if bad.any():
        raise PlanError(f"a run names {side} {what} {int(values[np.flatnonzero(bad)[0]])}, "
                        f"but {have} ({int(bad.sum())} runs do)")


def _pairing(m) -> tuple[np.ndarray, np.ndarray]:
    """Per source region the destination region of its name (-1: none); per destination
    region the map's granule (0: the map copies nothing of it)."""
    ids = m.region_ids
    pair = np.array([ids.get(r.name, -1) for r in m.src.regions], dtype=np.int64)
    gran = np.array(m.region_granules, dtype=np.int64)
    return pair, gran


def _check_ranks(plan: TransferPlan, col: Mapping[str, np.ndarray]) -> None:
    """The local side is the map's rank, the other side a rank the map reads or writes; each
    run pairs a region with its namesake, in whole granules of the map's (the units an executor
    describes a region in)."""
    m = plan.map
    pair, gran = _pairing(m)
    sr, dr = col["src_region"], col["dst_region"]
    bad = pair[sr] != dr
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise PlanError(f"run {k} pairs source region {m.src.regions[int(sr[k])].name!r} with "
                        f"destination region {m.dst.regions[int(dr[k])].name!r}: the map pairs "
                        f"regions by name ({int(bad.sum())} runs do)")
    g = gran[dr]
    safe = np.maximum(g, 1)
    bad = (g == 0) | ((col["src_offset"] % safe) | (col["dst_offset"] % safe)
                      | (col["length"] % safe) != 0)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise PlanError(
            f"run {k} (source offset {int(col['src_offset'][k])}, destination offset "
            f"{int(col['dst_offset'][k])}, {int(col['length'][k])} bytes) is not in whole "
            f"{int(g[k])}-byte granules of region {m.dst.regions[int(dr[k])].name!r} "
            f"(0: the map copies nothing of it; {int(bad.sum())} runs do)")
    pull = m.mode.value == "pull"
    local, other = ("dst", "src") if pull else ("src", "dst")
    mine = col[f"{local}_rank"]
    _first_bad("destination" if pull else "source", "rank", mine, mine != m.rank,
               f"the plan's map is {m.mode.value} rank {m.rank}'s")
    theirs = col[f"{other}_rank"]  # in range: checked with its side
    named = np.zeros((m.src if pull else m.dst).num_ranks, dtype=bool)
    named[list(m.peers)] = True
    _first_bad("source" if pull else "destination", "rank", theirs,
               ~named[theirs], f"the map names ranks {list(m.peers)}")


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


def _check_inside(offset: np.ndarray, length: np.ndarray, size, what: str, *,
                  names=None, buffer=None, rank=None) -> None:
    """Every run inside its buffer: ``size`` (one number, or per run) bytes. Written as
    ``offset > size - length`` (lengths are positive), which no int64 offset overflows."""
    bad = (offset < 0) | (offset > size - length)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        n = int(size if np.isscalar(size) else size[k])
        if names is not None:
            what = f"{what} {names[int(buffer[k])]!r} of rank {int(rank[k])}"
        raise PlanError(
            f"a run at bytes {int(offset[k])}:{int(offset[k]) + int(length[k])} lies outside "
            f"the {n}-byte {what} ({int(bad.sum())} of {len(bad)} runs do)"
        )


def _check_disjoint(offset: np.ndarray, length: np.ndarray, key: np.ndarray) -> None:
    """No destination byte is written by two runs (``key``: the run's rank and buffer).
    Plans list a lane's runs by destination offset, so the sort is often skipped."""
    span = int(offset.max()) + 1
    if int(key.max()) * span < 1 << 62 and int(key.min()) >= 0 and int(offset.min()) >= 0:
        whole = key * span + offset  # one int64 sort key: faster than a lexsort
        if (whole[1:] >= whole[:-1]).all():  # plans list a lane's runs by offset
            order = np.arange(len(key))
        else:
            order = np.argsort(whole, kind="stable")
    else:
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
