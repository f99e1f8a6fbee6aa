"""Hypothesis properties of whole plans over generated engine pairs, against tests/oracle.py.

Each property is a post-condition the docs promise: exact bytes and exactly-once coverage,
runs inside their regions, determinism, push = pull, maximal runs, even replica load.
"""

from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvplan.strategies as ks
from kvplan import EngineSpec, Placement, held_heads, pull_map, push_map, simulate
from tests import oracle

SETTINGS = settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    src_d, dst_d = draw(ks.layout_spec_pairs())  # any axis order, allocations, K/V buffers
    src_blocks, dst_blocks = draw(ks.requests(src_d, dst_d))
    return src_d, dst_d, src_blocks, dst_blocks


def _lane_key(c):
    return np.stack([c["src_rank"], c["src_buffer"], c["dst_rank"], c["dst_buffer"]], axis=1)


def _bytes(offsets, lengths):
    if len(lengths) == 0:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(o, o + n) for o, n in zip(offsets.tolist(),
                                                                lengths.tolist())])


def _named(spec, rank, bufs):
    """The oracle's buffers of ``rank`` keyed ``(rank, buffer name)`` (one array per name)."""
    out = {}
    for name_index, name in enumerate(spec.buffers):
        key = (rank, name)
        if key in bufs:
            out[key] = bufs[key]
        else:
            regions = [i for i in spec.buffer_regions(name_index) if (rank, i) in bufs]
            if regions:
                out[key] = bufs[(rank, regions[0])]
    return out


@SETTINGS
@given(cases())
def test_every_destination_byte_exactly_once_and_nothing_else(case):
    src_d, dst_d, src_blocks, dst_blocks = case
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    src_bufs = oracle.source_buffers(src_d, seed=3, request_blocks=src_blocks)
    for rank in range(dst.num_ranks):
        plan = pull_map(src, dst, rank).plan(src_blocks, dst_blocks)
        before = oracle.destination_buffers(dst_d, seed=4)
        expected, must = oracle.expected_buffers(
            src_d, dst_d, src_blocks, dst_blocks, rank, src_bufs, before)
        got = _named(dst, rank, oracle.clone_buffers(before, rank))
        simulate(plan, src_bufs, got)
        c = plan.copies()
        assert (c["dst_rank"] == rank).all()
        assert {n for _, n in got} == set(expected)
        for b, name in enumerate(dst.buffers):
            if name not in expected:
                continue
            assert got[(rank, name)].size == dst.rank_buffer_nbytes(b)
            assert np.array_equal(got[(rank, name)], expected[name]), name
            sel = c[c["dst_buffer"] == b]
            written = np.zeros(dst.rank_buffer_nbytes(b), np.int64)
            np.add.at(written, _bytes(sel["dst_offset"], sel["length"]), 1)
            want = sum(m.astype(np.int64) for (j, n), m in must.items() if n == name)
            assert np.array_equal(written, want), name
            for j in set(sel["dst_region"].tolist()):  # a run names a region in its buffer
                assert b in (dst.buffer_of(j, 0), dst.buffer_of(j, 1))
        # Bounds on the source side too, and no source byte read twice by this rank.
        for sr, sb in set(map(tuple, _lane_key(c)[:, :2].tolist())):
            sel = c[(c["src_rank"] == sr) & (c["src_buffer"] == sb)]
            read = _bytes(sel["src_offset"], sel["length"])
            assert read.min() >= 0 and read.max() < src.rank_buffer_nbytes(sb)
            assert len(np.unique(read)) == len(read)


@SETTINGS
@given(cases())
def test_push_equals_pull_and_plans_are_deterministic(case):
    src_d, dst_d, src_blocks, dst_blocks = case
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    pulls = [pull_map(src, dst, r).plan(src_blocks, dst_blocks) for r in range(dst.num_ranks)]
    pushes = [push_map(src, dst, r).plan(src_blocks, dst_blocks) for r in range(src.num_ranks)]
    for p in pushes:
        assert (p.copies()["src_rank"] == p.map.rank).all()
    as_set = lambda plans: sorted(  # noqa: E731
        tuple(row) for p in plans for row in p.copies().tolist())
    assert as_set(pulls) == as_set(pushes)
    # Same inputs, same plan: from a fresh map and from fresh specs.
    again = pull_map(EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d), 0)
    assert again.plan(src_blocks, dst_blocks) == pulls[0]
    assert again.plan(src_blocks, dst_blocks).copies().tobytes() == pulls[0].copies().tobytes()


@SETTINGS
@given(cases())
def test_runs_are_maximal(case):
    src_d, dst_d, src_blocks, dst_blocks = case
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    # Runs are maximal within a region pair, and across the layer slots of one allocation.
    s_slots = np.array([src.slot_of(i)[1] > 1 for i in range(len(src.regions))])
    d_slots = np.array([dst.slot_of(i)[1] > 1 for i in range(len(dst.regions))])
    for r in range(dst.num_ranks):
        c = pull_map(src, dst, r).plan(src_blocks, dst_blocks).copies()
        across = s_slots[c["src_region"]] & d_slots[c["dst_region"]]
        key = np.stack([c["src_rank"], np.where(across, -1, c["src_region"]), c["src_buffer"],
                        c["dst_rank"], np.where(across, -1, c["dst_region"]), c["dst_buffer"]],
                       axis=1)
        o = np.lexsort((c["dst_offset"], *key.T[::-1]))
        c, key = c[o], key[o]
        same = (key[1:] == key[:-1]).all(axis=1)
        joinable = (c["src_offset"][1:] == c["src_offset"][:-1] + c["length"][:-1]) & (
            c["dst_offset"][1:] == c["dst_offset"][:-1] + c["length"][:-1])
        assert not (same & joinable).any()


@SETTINGS
@given(ks.spec_pairs())
def test_replicas_share_load_evenly(pair):
    src, dst = (EngineSpec.from_dict(d) for d in pair)
    maps = [pull_map(src, dst, r) for r in range(dst.num_ranks)]
    for j, region in enumerate(dst.regions):
        i = src.region_index(region.name)
        base = src.stage_of(i) * src.tp_size
        for c, comp in enumerate(region.components):
            for h in range(comp.units):
                load = Counter(
                    lane.src_rank
                    for m in maps for lane in m.lanes if lane.dst_region == j
                    for u in lane.units if u.component == c and u.start <= h < u.stop
                )
                holders = [base + r for r in range(src.tp_size)
                           if h in held_heads(comp.units, src.tp_size, r)]
                counts = [load[r] for r in holders]
                assert set(load) <= set(holders)
                assert max(counts) - min(counts) <= 1, (region.name, comp.name, h, counts)
        if region.is_replicated:
            assert all(lane.placement is Placement.REPLICATE
                       for m in maps for lane in m.lanes if lane.dst_region == j)
