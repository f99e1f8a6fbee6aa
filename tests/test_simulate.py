"""``kvplan.simulate`` against the algorithm it replaced, and its typed refusals.

The reference below is the former ``simulate``: one index array of every byte of a pair of
buffers, built with ``repeat``/``cumsum``. The new one copies long runs one slice each and the
short ones by index arrays in units of their common divisor, a bounded number at a time; on
random plans (staged legs too) both must leave every buffer byte-identical, on every path
(forced by lowering the thresholds). Speed is measured in benchmarks/bench_simulate.py.
"""

from __future__ import annotations

import sys

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvplan.strategies as ks
from kvplan import EngineSpec, KVPlanError, PlanError, pull_map, push_map, simulate
from kvplan.examples import llama3_70b
from kvplan.staging import STAGING, stage
from tests import oracle

SIM = sys.modules["kvplan.simulate"]  # the module (kvplan.simulate is the function)


def reference(plan, src_buffers, dst_buffers) -> None:
    """The former simulate: one byte index per copied byte, per pair of buffers."""
    rows = plan.copies()
    if len(rows) == 0:
        return

    def index(offsets, lengths):
        starts = np.repeat(offsets - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
        return starts + np.arange(int(lengths.sum()), dtype=np.int64)

    def name(spec, b):
        return STAGING if b == STAGING else spec.buffers[b]

    def lookup(buffers, rank, nm, region):
        return buffers[(rank, nm)] if (rank, nm) in buffers else buffers[(rank, region)]

    key = np.stack([rows["src_rank"], rows["src_buffer"], rows["dst_rank"], rows["dst_buffer"]],
                   axis=1)
    pairs, first, which = np.unique(key, axis=0, return_index=True, return_inverse=True)
    for k, (sr, sb, dr, db) in enumerate(pairs.tolist()):
        sel = rows[which.ravel() == k]
        row = rows[first[k]]
        src = lookup(src_buffers, sr, name(plan.map.src, sb), int(row["src_region"]))
        dst = lookup(dst_buffers, dr, name(plan.map.dst, db), int(row["dst_region"]))
        dst[index(sel["dst_offset"], sel["length"])] = src[index(sel["src_offset"],
                                                                 sel["length"])]


@st.composite
def cases(draw):
    src_d, dst_d = draw(ks.spec_pairs())
    src_blocks, dst_blocks = draw(ks.requests(src_d, dst_d))
    push = draw(st.booleans())
    chunk = draw(st.sampled_from([None, 64, 4096]))
    # thresholds: default, every run long (slices), every run short in tiny steps
    paths = draw(st.sampled_from([(SIM.LONG_RUN, SIM.UNITS_PER_STEP), (1, 1 << 22),
                                  (1 << 40, 7)]))
    return src_d, dst_d, src_blocks, dst_blocks, push, chunk, paths


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_simulate_equals_the_former_algorithm_on_random_plans(case):
    src_d, dst_d, src_blocks, dst_blocks, push, chunk, (long_run, step) = case
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    src_bufs = oracle.source_buffers(src_d, seed=3, request_blocks=src_blocks)
    before = oracle.destination_buffers(dst_d, seed=4)
    old = SIM.LONG_RUN, SIM.UNITS_PER_STEP
    SIM.LONG_RUN, SIM.UNITS_PER_STEP = long_run, step
    try:
        ranks = range(src.num_ranks) if push else range(dst.num_ranks)
        make = push_map if push else pull_map
        got, want = oracle.clone_buffers(before), oracle.clone_buffers(before)
        for r in ranks:
            plan = make(src, dst, r).plan(src_blocks, dst_blocks)
            if chunk is None:
                simulate(plan, src_bufs, got)
                reference(plan, src_bufs, want)
                continue
            g, b, s = stage(plan, chunk).legs  # legs: staging areas keyed (rank, STAGING)
            for fn, out in ((simulate, got), (reference, want)):
                end = max([int((leg.copies()["dst_offset"] + leg.copies()["length"]).max())
                           for leg in (g, b) if len(leg)], default=0)
                area = {(rank, STAGING): np.zeros(end, np.uint8) for rank in range(64)}
                there = {k: v.copy() for k, v in area.items()}
                fn(g, src_bufs, area)
                fn(b, area, there)
                fn(s, there, out)
        _same(got, want)
    finally:
        SIM.LONG_RUN, SIM.UNITS_PER_STEP = old


def _llama_plan():
    src, dst = llama3_70b(2, num_blocks=8), llama3_70b(1, num_blocks=8)
    plan = pull_map(src, dst, 0).plan([[1, 3]], [[0, 2]])
    srcs = {(r, n): np.arange(src.rank_buffer_nbytes(b), dtype=np.int64).astype(np.uint8)
            for r in range(2) for b, n in enumerate(src.buffers)}
    dsts = {(0, n): np.zeros(dst.rank_buffer_nbytes(b), np.uint8)
            for b, n in enumerate(dst.buffers)}
    return plan, srcs, dsts


def _with_rows(plan, edit):
    rows = plan.copies().copy()
    edit(rows)
    rows.flags.writeable = False
    return attrs.evolve(plan, rows=rows)


@pytest.mark.parametrize(("edit", "words"), [
    (lambda r: r["dst_offset"].__setitem__(0, 8 * 2**30), "outside the"),
    (lambda r: r["src_offset"].__setitem__(1, -4), "outside the"),
    (lambda r: r["length"].__setitem__(2, 0), "copies 0 bytes"),
    (lambda r: r["dst_offset"].__setitem__(1, r["dst_offset"][0] + 1), "two runs write"),
    (lambda r: r["src_buffer"].__setitem__(0, 999), "buffer 999"),
])
def test_an_inconsistent_plan_is_refused_with_a_typed_error_before_any_byte(edit, words):
    plan, srcs, dsts = _llama_plan()
    bad = _with_rows(plan, edit)
    with pytest.raises(PlanError, match=words) as info:
        simulate(bad, srcs, dsts)
    assert isinstance(info.value, KVPlanError) and not isinstance(info.value, IndexError)
    assert not any(d.any() for d in dsts.values())  # refused before copying a byte
    simulate(plan, srcs, dsts)  # the consistent plan itself copies
    assert any(d.any() for d in dsts.values())


def test_missing_or_wrongly_typed_buffers_are_refused_by_name():
    plan, srcs, dsts = _llama_plan()
    some = next(iter(srcs))
    with pytest.raises(PlanError, match="no source buffer for rank"):
        simulate(plan, {k: v for k, v in srcs.items() if k != some}, dsts)
    with pytest.raises(PlanError, match="1-D uint8"):
        simulate(plan, {**srcs, some: srcs[some].view(np.int16)}, dsts)
    with pytest.raises(PlanError, match="1-D uint8"):
        simulate(plan, {**srcs, some: srcs[some].tolist()}, dsts)
