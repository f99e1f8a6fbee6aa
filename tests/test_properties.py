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

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    src_d, dst_d = draw(ks.spec_pairs())
    src_blocks, dst_blocks = draw(ks.requests(src_d, dst_d))
    return src_d, dst_d, src_blocks, dst_blocks


def _lane_key(c):
    return np.stack([c["src_rank"], c["src_region"], c["dst_rank"], c["dst_region"]], axis=1)


def _bytes(offsets, lengths):
    if len(lengths) == 0:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(o, o + n) for o, n in zip(offsets.tolist(),
                                                                lengths.tolist())])


@SETTINGS
@given(cases())
def test_every_destination_byte_exactly_once_and_nothing_else(case):
    src_d, dst_d, src_blocks, dst_blocks = case
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    src_bufs = oracle.source_buffers(src_d, seed=3, request_blocks=src_blocks)
    for rank in range(dst.num_ranks):
        plan = pull_map(src, dst, rank).plan(src_blocks, dst_blocks)
        before = oracle.destination_buffers(dst_d, seed=4)
        expected, must = oracle.expected_destination(
            src_d, dst_d, src_blocks, dst_blocks, rank, src_bufs, before)
        got = oracle.clone_buffers(before, rank)  # pooled regions keep sharing one array
        simulate(plan, src_bufs, got)
        c = plan.copies()
        assert (c["dst_rank"] == rank).all()
        assert set(expected) == set(dst.regions_on(rank))
        for j in expected:
            assert np.array_equal(got[(rank, j)], expected[j]), dst.regions[j].name
            sel = c[c["dst_region"] == j]
            written = np.zeros(dst.rank_region_nbytes(j), np.int64)
            np.add.at(written, _bytes(sel["dst_offset"], sel["length"]), 1)
            assert np.array_equal(written, must[j].astype(np.int64))
        # Bounds on the source side too, and no source byte read twice by this rank.
        for sr, sg in set(map(tuple, _lane_key(c)[:, :2].tolist())):
            sel = c[(c["src_rank"] == sr) & (c["src_region"] == sg)]
            read = _bytes(sel["src_offset"], sel["length"])
            assert read.min() >= 0 and read.max() < src.rank_region_nbytes(sg)
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
    for r in range(dst.num_ranks):
        c = pull_map(src, dst, r).plan(src_blocks, dst_blocks).copies()
        key = _lane_key(c)
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
