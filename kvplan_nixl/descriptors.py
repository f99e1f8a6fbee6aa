"""Pure lowering: a plan's byte runs + region bases -> NIXL descriptor lists and index arrays.

Theory of operation. At connect time each side of a region pair is described once as a
*ladder* of NIXL strided rows ``(address, length, device, stride, count)``: rung ``k`` cuts the
region into dense pieces of ``unit << k`` bytes, where ``unit`` is the map's granule for that
region pair (it divides every offset and length any plan of the map can produce). A ladder has
``floor(log2(nbytes // unit)) + 1`` rungs, so its size grows with ``log(num_blocks)`` only, and
NIXL prepares a strided row in O(1).

At request time a run ``[offset, offset + length)`` is placed on the highest rung whose piece
size divides its two offsets and its length, capped by both ladders' top rungs, and is addressed
by ``length / piece`` consecutive indices of that rung. Consecutive pieces of one rung are
contiguous on both sides, and NIXL merges contiguous descriptors within one strided row, so each
run posts as exactly one NIXL descriptor. Everything here is numpy arithmetic over the runs: no
Python loop per run.

Every run is checked against the registered bounds of both sides before any index is produced;
:class:`~kvplan_nixl.errors.BoundsError` names the first bad run in the notation
``p1 L3 [0:4096) -> d0 L3 [4096:8192)``.

Bottom layer: pure numpy, no NIXL call; it may import only ``errors``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from kvplan_nixl.errors import BoundsError

#: Rungs per ladder at most: pieces of ``unit << 40`` bytes would exceed any real region.
MAX_RUNGS = 41


def _ro(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.flags.writeable = False
    return a


@attrs.frozen(eq=False)
class Ladder:
    """One side's regions as strided rungs; index ``first[r, k] + i`` is piece ``i`` of rung ``k``.

    ``unit[r]`` is 0 for a region the map never copies (it gets no rung). ``rungs[r]`` is the
    number of rungs of region ``r``; ``first[r, k]`` is -1 for ``k >= rungs[r]``.
    """

    names: tuple[str, ...]
    nbytes: np.ndarray  # registered bytes per region
    unit: np.ndarray
    rungs: np.ndarray
    first: np.ndarray  # (regions, MAX_RUNGS)
    count: np.ndarray  # (regions, MAX_RUNGS): pieces per rung, 0 where absent

    @classmethod
    def build(cls, names: Sequence[str], nbytes: Sequence[int], units: Sequence[int]) -> Ladder:
        """Ladder over regions of ``nbytes`` bytes with the given units (0: region unused).

        Post-conditions: every rung lies inside its region; rungs of one region are numbered
        ``0..rungs-1`` and their index ranges do not overlap.
        """
        nb = np.asarray(nbytes, dtype=np.int64)
        un = np.asarray(units, dtype=np.int64)
        if len(names) != len(nb) or len(nb) != len(un):
            raise ValueError(f"{len(names)} names, {len(nb)} sizes and {len(un)} units differ")
        if (un < 0).any() or (nb < 0).any():
            raise ValueError(f"negative size or unit: sizes {nb.tolist()}, units {un.tolist()}")
        used = (un > 0) & (nb >= np.where(un > 0, un, 1))
        pieces = np.where(used, nb // np.where(un > 0, un, 1), 0)
        # floor(log2(pieces)) + 1, exactly, from the bit length of a positive int64
        rungs = np.zeros(len(nb), dtype=np.int64)
        rungs[used] = [int(p).bit_length() for p in pieces[used]]  # once per region, at connect
        rungs = np.minimum(rungs, MAX_RUNGS)
        k = np.arange(MAX_RUNGS, dtype=np.int64)
        present = k[None, :] < rungs[:, None]
        count = np.where(present, pieces[:, None] >> np.minimum(k, 62)[None, :], 0)
        flat = count.ravel()
        starts = np.cumsum(flat) - flat
        first = np.where(present, starts.reshape(count.shape), -1)
        return cls(tuple(names), _ro(nb), _ro(un), _ro(rungs), _ro(first), _ro(count))

    @property
    def size(self) -> int:
        """Number of descriptors the prepared list holds once NIXL expands the strided rows."""
        return int(self.count.sum())

    def rows(self, bases: Sequence[int], device: Sequence[int] | int = 0) -> np.ndarray:
        """The Nx5 int64 array ``(address, piece, device, piece, count)``, one row per rung.

        Row order equals index order (region-major, rung-minor), so ``first`` addresses it.
        """
        base = np.asarray(bases, dtype=np.int64)
        dev = np.broadcast_to(np.asarray(device, dtype=np.int64), base.shape)
        r, k = np.nonzero(self.count > 0)
        piece = self.unit[r] << k
        return np.stack([base[r], piece, dev[r], piece, self.count[r, k]], axis=1)


@attrs.frozen(eq=False)
class Lowered:
    """Index arrays for one peer: ``local[i]`` and ``remote[i]`` pair, ``runs`` NIXL descriptors."""

    local: np.ndarray
    remote: np.ndarray
    runs: int
    nbytes: int
    pieces: np.ndarray | None = None  # descriptors of each run, in order (None: unknown)


def kind_shifts(ladder: Ladder, kinds: Sequence[int]) -> np.ndarray:
    """Per ladder entry, what to subtract from its indices to address the list of its memory
    kind alone (``kinds[r]``: entry ``r``'s kind, a small int). A rank with buffers of two
    memory kinds prepares one list per kind, each holding its entries' rows in ladder order, so
    an entry's indices there are its ladder indices less the pieces of the entries of other
    kinds before it. All zero when every entry is of one kind."""
    kind = np.asarray(kinds, dtype=np.int64)
    size = ladder.count.sum(axis=1)
    shift = np.zeros(len(kind), dtype=np.int64)
    before = np.cumsum(size) - size
    for k in np.unique(kind):  # at most one pass per memory kind
        mine = np.where(kind == k, size, 0)
        sel = kind == k
        shift[sel] = (before - (np.cumsum(mine) - mine))[sel]
    return shift


def split_kinds(lw: Lowered, length: np.ndarray, local_kind: np.ndarray,
                remote_kind: np.ndarray, local_shift: np.ndarray,
                remote_shift: np.ndarray) -> list[tuple[int, int, Lowered]]:
    """Group one peer's lowered runs by (local kind, remote kind) into one :class:`Lowered`
    each, its indices moved into the lists of those kinds (see :func:`kind_shifts`).

    ``length``, ``local_kind``, ``remote_kind``, ``local_shift`` and ``remote_shift`` hold one
    value per run of ``lw`` (whose ``pieces`` says how many descriptors each run took). Returns
    ``[(local_kind, remote_kind, lowered)]`` in ascending kind order, each run in exactly one
    group, in its order; a single group with no shift is ``lw`` itself. Numpy only.
    """
    lk = np.asarray(local_kind, dtype=np.int64)
    rk = np.asarray(remote_kind, dtype=np.int64)
    if lw.runs == 0:
        return []
    code = lk * (int(rk.max()) + 1) + rk
    codes = np.unique(code)
    ls, rs = np.asarray(local_shift), np.asarray(remote_shift)
    if len(codes) == 1 and not ls.any() and not rs.any():
        return [(int(lk[0]), int(rk[0]), lw)]
    if lw.pieces is None:
        raise ValueError("split_kinds needs the descriptors of each run (Lowered.pieces)")
    pieces = lw.pieces
    li = lw.local - np.repeat(ls, pieces)
    ri = lw.remote - np.repeat(rs, pieces)
    per_desc = np.repeat(code, pieces)
    length = np.asarray(length, dtype=np.int64)
    out = []
    for c in codes:  # one group per kind pair present: at most four
        runs, descs = code == c, per_desc == c
        first = int(np.flatnonzero(runs)[0])
        out.append((int(lk[first]), int(rk[first]),
                    Lowered(li[descs], ri[descs], int(runs.sum()), int(length[runs].sum()),
                            pieces[runs])))
    return out


def run_text(
    src: tuple[str, int, int, int], dst: tuple[str, int, int, int], length: int
) -> str:
    """One run in the project's notation: ``p1 L3 [0:4096) -> d0 L3 [4096:8192)``."""
    (sp, sr, sreg, so), (dp, dr, dreg, do) = src, dst
    return f"{sp}{sr} L{sreg} [{so}:{so + length}) -> {dp}{dr} L{dreg} [{do}:{do + length})"


def lower(
    local: Ladder,
    remote: Ladder,
    local_region: np.ndarray,
    local_offset: np.ndarray,
    remote_region: np.ndarray,
    remote_offset: np.ndarray,
    length: np.ndarray,
    *,
    describe=None,
) -> Lowered:
    """Check runs against both ladders' bounds and turn them into paired index arrays.

    ``describe(i, reason)`` builds the error message for bad run ``i`` (the caller knows the
    ranks and which side is the source). Raises :class:`BoundsError` before producing anything
    if any run has a region index out of range, a region the map does not copy, an offset or
    end outside the registered bytes, a non-positive length, or offsets and length that are
    not multiples of the pair's unit.

    Post-conditions: ``len(local) == len(remote) == sum(length) / piece`` per run; the pieces
    of run ``i`` are consecutive indices of one rung on each side and cover exactly its bytes.
    """
    lr, lo, rr, ro, ln = (
        np.ascontiguousarray(a, dtype=np.int64)
        for a in (local_region, local_offset, remote_region, remote_offset, length)
    )
    n = len(ln)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Lowered(empty, empty, 0, 0)
    nl, nr = len(local.nbytes), len(remote.nbytes)
    bad_region = (lr < 0) | (lr >= nl) | (rr < 0) | (rr >= nr)
    if bad_region.any():
        lrc, rrc = np.where(bad_region, 0, lr), np.where(bad_region, 0, rr)
    else:
        lrc, rrc = lr, rr
    unit = local.unit[lrc]
    safe = np.maximum(unit, 1)
    # offsets and length in units; exact division is checked by multiplying back
    ql, qr, qn = lo // safe, ro // safe, ln // safe
    bad = (
        bad_region
        | (unit == 0)
        | (unit != remote.unit[rrc])
        | (ln <= 0)
        | (lo < 0)
        | (ro < 0)
        | (lo > local.nbytes[lrc] - ln)
        | (ro > remote.nbytes[rrc] - ln)
        | (ql * safe != lo)
        | (qr * safe != ro)
        | (qn * safe != ln)
    )
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise BoundsError(_why(local, remote, i, lr, lo, rr, ro, ln, describe))
    q = ql | qr | qn
    low_bit = q & -q  # the largest power of two dividing all three (exact in a float64)
    rung = (low_bit.astype(np.float64).view(np.int64) >> 52) - 1023  # its exponent
    rung = np.minimum(rung, np.minimum(local.rungs[lrc], remote.rungs[rrc]) - 1)
    count = qn >> rung
    li = np.take(local.first, lrc * MAX_RUNGS + rung) + (ql >> rung)
    ri = np.take(remote.first, rrc * MAX_RUNGS + rung) + (qr >> rung)
    total = int(count.sum())
    if total != n:  # some runs span several pieces: expand to consecutive indices
        before = np.cumsum(count) - count
        step = np.arange(total, dtype=np.int64)
        li = np.repeat(li - before, count) + step
        ri = np.repeat(ri - before, count) + step
    return Lowered(li, ri, n, int(ln.sum()), count)


def _why(local, remote, i, lr, lo, rr, ro, ln, describe) -> str:
    """The reason run ``i`` is refused, for the error message (one run, off the hot path)."""
    a, b, c, d, e = int(lr[i]), int(lo[i]), int(rr[i]), int(ro[i]), int(ln[i])
    if not 0 <= a < len(local.nbytes):
        reason = f"local region {a} does not exist ({len(local.nbytes)} regions)"
    elif not 0 <= c < len(remote.nbytes):
        reason = f"remote region {c} does not exist ({len(remote.nbytes)} regions)"
    elif local.unit[a] == 0:
        reason = f"region {local.names[a]!r} is not copied by this map"
    elif local.unit[a] != remote.unit[c]:
        reason = (
            f"local region {local.names[a]!r} is paired with remote region "
            f"{remote.names[c]!r}, not its counterpart"
        )
    elif e <= 0:
        reason = f"length {e} is not positive"
    elif local.nbytes[a] == 0:
        reason = f"this rank holds no region {local.names[a]!r} (another pipeline stage)"
    elif remote.nbytes[c] == 0:
        reason = f"the peer rank holds no region {remote.names[c]!r} (another pipeline stage)"
    elif b < 0 or b + e > local.nbytes[a]:
        reason = (
            f"local run [{b}:{b + e}) is outside the {int(local.nbytes[a])} registered bytes of "
            f"region {local.names[a]!r}"
        )
    elif d < 0 or d + e > remote.nbytes[c]:
        reason = (
            f"remote run [{d}:{d + e}) is outside the {int(remote.nbytes[c])} registered bytes "
            f"of region {remote.names[c]!r}"
        )
    else:
        reason = (
            f"offsets {b}, {d} and length {e} are not all multiples of the {int(local.unit[a])}-"
            f"byte granule of region {local.names[a]!r}"
        )
    where = describe(i, reason) if describe is not None else f"run {i}: {reason}"
    return where
