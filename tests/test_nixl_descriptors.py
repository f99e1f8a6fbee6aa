"""Descriptor lowering, pure: ladders and index arrays against an independent expansion.

The oracle expands the Nx5 rows exactly as NIXL documents them (``count`` pieces of ``length``
bytes, ``stride`` apart, indexed in row order) and checks that the indices of each run address
exactly that run's bytes, on both sides, in order.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan_nixl.descriptors import MAX_RUNGS, Ladder, lower
from kvplan_nixl.errors import BoundsError


def expand(rows: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(address, length) of each index into a strided list (independent of Ladder)."""
    counts = rows[:, 4]
    ends = np.cumsum(counts)
    assert (idx >= 0).all() and (idx < ends[-1]).all()
    row = np.searchsorted(ends, idx, side="right")
    first = ends[row] - counts[row]
    return rows[row, 0] + (idx - first) * rows[row, 3], rows[row, 1]


def bytes_of(addr: np.ndarray, length: np.ndarray) -> np.ndarray:
    return np.concatenate([np.arange(a, a + n) for a, n in zip(addr, length, strict=True)])


@st.composite
def ladders_and_runs(draw):
    n = draw(st.integers(1, 4))
    units = [draw(st.sampled_from([1, 2, 6, 64, 256, 576, 4096])) for _ in range(n)]
    pieces_l = [draw(st.integers(1, 300)) for _ in range(n)]
    pieces_r = [draw(st.integers(1, 300)) for _ in range(n)]
    extra_l = [draw(st.integers(0, u - 1)) for u in units]  # sizes need not be multiples
    nb_l = [p * u + e for p, u, e in zip(pieces_l, units, extra_l, strict=True)]
    nb_r = [p * u for p, u in zip(pieces_r, units, strict=True)]
    runs = []
    for _ in range(draw(st.integers(0, 30))):
        i = draw(st.integers(0, n - 1))
        room = min(pieces_l[i], pieces_r[i])
        k = draw(st.integers(1, room))
        lo = draw(st.integers(0, pieces_l[i] - k))
        ro = draw(st.integers(0, pieces_r[i] - k))
        runs.append((i, lo * units[i], i, ro * units[i], k * units[i]))
    return units, nb_l, nb_r, runs


@settings(max_examples=150, deadline=None)
@given(ladders_and_runs())
def test_indices_address_exactly_the_runs(case):
    units, nb_l, nb_r, runs = case
    names = [f"r{i}" for i in range(len(units))]
    lad_l = Ladder.build(names, nb_l, units)
    lad_r = Ladder.build(names, nb_r, units)
    base_l = np.cumsum([0, *nb_l])[:-1] + 10**6  # disjoint fake address spaces
    base_r = np.cumsum([0, *nb_r])[:-1] + 10**9
    rows_l, rows_r = lad_l.rows(base_l), lad_r.rows(base_r)
    # every strided row lies inside its region
    for rows, base, nb in ((rows_l, base_l, nb_l), (rows_r, base_r, nb_r)):
        assert (rows[:, 1] == rows[:, 3]).all() and (rows[:, 4] > 0).all()
        end = rows[:, 0] + rows[:, 3] * rows[:, 4]
        owner = np.searchsorted(base, rows[:, 0], side="right") - 1
        assert (end <= base[owner] + np.asarray(nb)[owner]).all()
    a = np.array(runs, dtype=np.int64).reshape(-1, 5)
    low = lower(lad_l, lad_r, a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4])
    assert low.runs == len(a) and low.nbytes == int(a[:, 4].sum())
    assert len(low.local) == len(low.remote)
    if not len(a):
        return
    la, ll = expand(rows_l, low.local)
    ra, rl = expand(rows_r, low.remote)
    assert (ll == rl).all()
    want_l = bytes_of(base_l[a[:, 0]] + a[:, 1], a[:, 4])
    want_r = bytes_of(base_r[a[:, 2]] + a[:, 3], a[:, 4])
    assert np.array_equal(bytes_of(la, ll), want_l)
    assert np.array_equal(bytes_of(ra, rl), want_r)
    # one rung per run: a run's pieces are consecutive indices of one strided row on both
    # sides (NIXL merges those into one descriptor), so breaks happen only between runs
    row_l = np.searchsorted(np.cumsum(rows_l[:, 4]), low.local, side="right")
    row_r = np.searchsorted(np.cumsum(rows_r[:, 4]), low.remote, side="right")
    breaks = (
        (np.diff(low.local) != 1) | (np.diff(low.remote) != 1)
        | (np.diff(row_l) != 0) | (np.diff(row_r) != 0)
    )
    assert int(breaks.sum()) <= len(a) - 1


def test_aligned_runs_take_one_index_each():
    lad = Ladder.build(["a"], [1 << 20], [256])
    off = np.arange(0, 1 << 20, 8192, dtype=np.int64)
    z = np.zeros_like(off)
    low = lower(lad, lad, z, off, z, off[::-1].copy(), np.full_like(off, 8192))
    assert len(low.local) == len(off)  # 8 KiB runs at 8 KiB alignment: rung 5, one piece each


def test_ladder_grows_with_log_blocks_only():
    small = Ladder.build(["a"], [256 * 1000], [256])
    big = Ladder.build(["a"], [256 * 1_000_000], [256])
    assert small.rows([0]).shape == (10, 5) and big.rows([0]).shape == (20, 5)
    assert len(big.rows([0])) <= MAX_RUNGS


def test_unused_region_has_no_rows():
    lad = Ladder.build(["a", "b"], [4096, 4096], [0, 512])
    rows = lad.rows([1000, 9000])
    assert (rows[:, 0] == 9000).all()


LAD = Ladder.build(["attn", "mla"], [1 << 16, 1 << 14], [256, 1152 // 2])


@pytest.mark.parametrize(
    ("run", "msg"),
    [
        ((0, 0, 0, 0, 0), "length 0 is not positive"),
        ((0, 1 << 16, 0, 0, 256), r"local run \[65536:65792\) is outside the 65536 registered"),
        ((0, 0, 0, -256, 256), r"remote run \[-256:0\) is outside"),
        ((0, 128, 0, 0, 256), "not all multiples of the 256-byte granule of region 'attn'"),
        ((2, 0, 0, 0, 256), "local region 2 does not exist"),
        ((0, 0, 5, 0, 256), "remote region 5 does not exist"),
        ((0, 0, 1, 0, 256), "paired with remote region 'mla'"),
    ],
)
def test_bad_runs_refused_by_name(run, msg):
    a = np.array([(0, 0, 0, 0, 256), run], dtype=np.int64)
    with pytest.raises(BoundsError, match=msg) as info:
        lower(LAD, LAD, *a.T)
    assert str(info.value).startswith("run 1:")


def test_unused_region_refused():
    lad = Ladder.build(["a", "b"], [4096, 4096], [0, 512])
    with pytest.raises(BoundsError, match="region 'a' is not copied by this map"):
        lower(lad, lad, [0], [0], [0], [0], [512])
