"""The three legs of a staged transfer (kvplan/staging.py) against the independent oracle.

Gather, bulk and scatter are ordinary runs, so ``kvplan.simulate`` applies them; after the three
the destination must equal ``oracle.expected_destination`` byte for byte, exactly as after the
direct plan. Plus the post-conditions the executor relies on: chunk bounds, one bulk run per
chunk, every staging byte written once, and push and pull agreeing on a peer pair's legs (the
two sides of a staged transfer derive them independently).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvplan.strategies as ks
from kvplan import EngineSpec, RequestError, pull_map, push_map, simulate
from kvplan.examples import llama3_70b
from kvplan.staging import STAGING, Costs, prefer_staged, stage
from tests import oracle

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    src_d, dst_d = draw(ks.spec_pairs())
    src_blocks, dst_blocks = draw(ks.requests(src_d, dst_d))
    chunk = draw(st.sampled_from([1, 2, 6, 64, 100, 4096, 1 << 20]))
    return src_d, dst_d, src_blocks, dst_blocks, chunk


def _staging(sp, ranks) -> dict:
    end = int((sp.chunks["offset"] + sp.chunks["nbytes"]).max()) if len(sp.chunks) else 0
    return {(r, STAGING): np.full(end, 0xA5, np.uint8) for r in ranks}


def _run_legs(sp, src_bufs, dst_bufs) -> None:
    """gather -> bulk -> scatter with simulate, through fresh staging buffers on both sides."""
    g, b, s = sp.legs
    src_stage = _staging(sp, np.unique(g.copies()["dst_rank"]))
    dst_stage = _staging(sp, np.unique(s.copies()["src_rank"]))
    simulate(g, src_bufs, src_stage)
    simulate(b, src_stage, dst_stage)
    simulate(s, dst_stage, dst_bufs)


def _check_shape(sp) -> None:
    g, b, s = (leg.copies() for leg in sp.legs)
    c = sp.chunks
    assert g.flags.writeable is False and c.flags.writeable is False
    assert sp.gather.nbytes == sp.bulk.nbytes == sp.scatter.nbytes == sp.plan.nbytes
    assert len(b) == len(c) and (c["nbytes"] > 0).all() and (c["nbytes"] <= sp.chunk_bytes).all()
    assert (c["offset"] % sp.chunk_bytes == 0).all()
    assert np.array_equal(g["dst_offset"], s["src_offset"])
    assert np.array_equal(g["length"], s["length"])
    assert (g["dst_region"] == STAGING).all() and (s["src_region"] == STAGING).all()
    assert (b["src_offset"] == b["dst_offset"]).all()
    for k, ch in enumerate(c):  # a chunk's rows lie inside its span and fill it exactly
        rows = g[ch["row_start"]:ch["row_end"]]
        assert rows["length"].sum() == ch["nbytes"], k
        assert (rows["dst_offset"] >= ch["offset"]).all()
        assert (rows["dst_offset"] + rows["length"] <= ch["offset"] + ch["nbytes"]).all()
        peer = (g if sp.plan.map.mode.value == "pull" else s)[ch["row_start"]:ch["row_end"]]
        assert (peer["src_rank" if sp.plan.map.mode.value == "pull" else "dst_rank"]
                == ch["peer"]).all()
    for arr in (g, s):  # granule divides every offset and length
        for col in ("src_offset", "dst_offset", "length"):
            assert (arr[col] % sp.granule == 0).all()
    if len(g):  # staging bytes of each peer span are each written once, in order
        assert (np.diff(g["dst_offset"]) > 0).all()


@settings(SETTINGS, max_examples=12)  # the oracle is the slow part; legs of many more cases
@given(cases())                       # are checked against simulate in test_staged_legs.py
def test_gather_bulk_scatter_lands_exactly_the_oracle_bytes(case):
    src_d, dst_d, src_blocks, dst_blocks, chunk = case
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    src_bufs = oracle.source_buffers(src_d, seed=3, request_blocks=src_blocks)
    before = oracle.destination_buffers(dst_d, seed=4)
    for rank in range(dst.num_ranks):
        plan = pull_map(src, dst, rank).plan(src_blocks, dst_blocks)
        sp = stage(plan, chunk)
        _check_shape(sp)
        expected, _ = oracle.expected_destination(
            src_d, dst_d, src_blocks, dst_blocks, rank, src_bufs, before)
        got = oracle.clone_buffers(before, rank)
        _run_legs(sp, src_bufs, got)
        for j in expected:
            assert np.array_equal(got[(rank, j)], expected[j]), dst.regions[j].name
    # push: every source rank stages its own plan; together they land the oracle's bytes
    got = oracle.clone_buffers(before)
    for rank in range(src.num_ranks):
        sp = stage(push_map(src, dst, rank).plan(src_blocks, dst_blocks), chunk)
        _check_shape(sp)
        _run_legs(sp, src_bufs, got)
    for rank in range(dst.num_ranks):
        expected, _ = oracle.expected_destination(
            src_d, dst_d, src_blocks, dst_blocks, rank, src_bufs, before)
        for j in expected:
            assert np.array_equal(got[(rank, j)], expected[j]), dst.regions[j].name


def _pair_legs(sp, peer: int):
    """(gather rows, scatter rows) of one peer with staging offsets from the peer's span."""
    c = sp.peer_chunks(peer)
    if len(c) == 0:
        return None
    a, b, base = int(c["row_start"][0]), int(c["row_end"][-1]), int(c["offset"][0])
    g, s = sp.gather.copies()[a:b].copy(), sp.scatter.copies()[a:b].copy()
    g["dst_offset"] -= base
    s["src_offset"] -= base
    return g.tobytes(), s.tobytes()


@SETTINGS
@given(cases())
def test_push_and_pull_derive_the_same_legs_for_a_peer_pair(case):
    src_d, dst_d, src_blocks, dst_blocks, chunk = case
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    pulls = [stage(pull_map(src, dst, d).plan(src_blocks, dst_blocks), chunk)
             for d in range(dst.num_ranks)]
    for s in range(src.num_ranks):
        push = stage(push_map(src, dst, s).plan(src_blocks, dst_blocks), chunk)
        for d in range(dst.num_ranks):
            assert _pair_legs(push, d) == _pair_legs(pulls[d], s), (s, d)


def test_scattered_hetero_request_needs_few_bulk_runs():
    """Llama-3-70B-like P TP8 -> D TP4, scattered blocks: thousands of runs, a few chunks."""
    src, dst = llama3_70b(8, num_blocks=64), llama3_70b(4, num_blocks=64)
    rng = np.random.default_rng(0)
    sb, db = [rng.permutation(64)[:32].tolist()], [rng.permutation(64)[:32].tolist()]
    plan = pull_map(src, dst, 0).plan(sb, db)
    sp = stage(plan, 4 << 20)
    assert len(plan) == 80 * 2 * 32 * 2  # layers x streams x blocks x peers
    assert len(sp.bulk) == 2 * 5  # 20 MiB per peer in chunks of 4 MiB
    assert sp.granule == 4096
    assert sp.peers == (0, 1)
    assert "chunks=10" in repr(sp)


@pytest.mark.parametrize("bad", [0, -4096, 1.5, True, "4096"])
def test_chunk_size_must_be_a_positive_integer(bad):
    src = llama3_70b(1, num_blocks=4)
    plan = pull_map(src, src, 0).plan([[0]], [[1]])
    with pytest.raises(RequestError, match="chunk_bytes"):
        stage(plan, bad)


def test_empty_plan_stages_to_empty_legs():
    src = llama3_70b(1, num_blocks=4)
    sp = stage(pull_map(src, src, 0).plan([[]], [[]]), 4096)
    assert len(sp.chunks) == len(sp.bulk) == len(sp.gather) == 0 and sp.nbytes == 0


def test_chooser_keeps_mergeable_plans_direct_and_stages_fragmented_ones():
    costs = Costs(per_descriptor=2.5e-6, per_byte=1 / 10e9, local_per_byte=1 / 8e9,
                  per_chunk=200e-6)
    # 16 runs of 16 MiB in 16 chunks: never staged, whatever the costs say
    assert not prefer_staged(16, 256 << 20, 16, costs)
    # 40,960 runs of 4 KiB (160 MiB) in 10 chunks: staged
    assert prefer_staged(40_960, 160 << 20, 10, costs)
    # a few hundred large runs: direct
    assert not prefer_staged(320, 160 << 20, 10, costs)
    with pytest.raises(RequestError, match="per_byte"):
        Costs(per_descriptor=1e-6, per_byte=-1.0, local_per_byte=0.0, per_chunk=0.0)
