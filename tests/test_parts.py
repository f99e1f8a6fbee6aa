"""Layer-wise parts: ``plan.part(names)`` is a slice of the whole plan, never a re-plan.

Properties over region subsets: a part holds exactly the whole plan's rows of its regions, in
the same order; the parts of any partition of the regions together hold the whole plan's rows,
byte for byte, and executing them one after another leaves the oracle's destination.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvplan.strategies as ks
from kvplan import EngineSpec, RequestError, pull_map, push_map, simulate
from kvplan.examples import request_blocks
from kvplan.presets import spec as preset
from tests import oracle

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def partitioned(draw):
    src_d, dst_d = draw(ks.dcp_spec_pairs())  # DCP on either side, or none
    sb, db, tokens, dst_from = draw(ks.token_requests(src_d, dst_d))
    names = [r["name"] for r in dst_d["regions"]]
    labels = draw(st.lists(st.integers(0, 3), min_size=len(names), max_size=len(names)))
    parts = [[n for n, lab in zip(names, labels, strict=True) if lab == k] for k in range(4)]
    return src_d, dst_d, sb, db, tokens, dst_from, [p for p in parts if p]


@SETTINGS
@given(partitioned(), st.booleans())
def test_parts_of_a_partition_are_the_whole_plan(case, push):
    src_d, dst_d, sb, db, tokens, dst_from, parts = case
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    ranks = range(src.num_ranks) if push else range(dst.num_ranks)
    make = push_map if push else pull_map
    for r in ranks:
        whole = make(src, dst, r).plan(sb, db, tokens=tokens, dst_from=dst_from)
        c = whole.copies()
        pieces = [whole.part(p) for p in parts]
        for names, piece in zip(parts, pieces, strict=True):
            idx = [dst.region_index(n) for n in names]
            assert piece.regions == tuple(sorted(idx))
            # exactly the whole plan's rows of those regions, in the whole plan's order
            assert np.array_equal(piece.copies(), c[np.isin(c["dst_region"], idx)])
            assert piece.lane_bounds[-1] == len(piece)
            assert not piece.copies().flags.writeable
        both = np.concatenate([p.copies() for p in pieces])
        assert sorted(both.tolist()) == sorted(c.tolist())
        assert sum(p.nbytes for p in pieces) == whole.nbytes


@settings(SETTINGS, max_examples=25)
@given(partitioned())
def test_executing_the_parts_leaves_the_oracle_destination(case):
    src_d, dst_d, sb, db, tokens, dst_from, parts = case
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    src_bufs = oracle.source_buffers(src_d, seed=5, request_blocks=sb)
    for rank in range(dst.num_ranks):
        whole = pull_map(src, dst, rank).plan(sb, db, tokens=tokens, dst_from=dst_from)
        before = oracle.destination_buffers(dst_d, seed=6)
        expected, _ = oracle.expected_destination(src_d, dst_d, sb, db, rank, src_bufs, before,
                                                  tokens=tokens, dst_from=dst_from)
        got = oracle.clone_buffers(before, rank)
        for names in parts:
            simulate(whole.part(names), src_bufs, got)
        for j in expected:
            assert np.array_equal(got[(rank, j)], expected[j]), dst.regions[j].name


def test_part_refusals_name_the_region():
    s = preset("llama-3.1-8b", tp_size=2, num_blocks=64)
    b = request_blocks(s, 64)
    p = pull_map(s, s, 0).plan(b, b)
    with pytest.raises(RequestError, match=r"no region named 'layers\.99\.attn'"):
        p.part(["layers.99.attn"])
    one = p.part(["layers.0.attn", "layers.1.attn"])
    with pytest.raises(RequestError, match=r"region 'layers\.2\.attn' is not in this part"):
        one.part(["layers.2.attn"])
    assert one.part("layers.1.attn") == p.part(["layers.1.attn"])


def test_summary_names_the_part():
    s = preset("llama-3.1-8b", tp_size=2, num_blocks=64)
    b = request_blocks(s, 64)
    p = pull_map(s, s, 0).plan(b, b, tokens=(3, 50))
    text = p.part([f"layers.{k}.attn" for k in range(5)]).summary()
    assert "tokens 3:50" in text
    assert "part of 32 regions: layers.0.attn, layers.1.attn, layers.2.attn, ... (5)" in text


def test_explain_shows_the_range_and_the_part():
    from kvplan.cli.explain import explain

    s = preset("llama-3.1-8b", tp_size=2, num_blocks=64)
    d = preset("llama-3.1-8b", tp_size=1, num_blocks=64)
    whole = explain(s, d, 100)
    doc = explain(s, d, 100, cached=37, part=["layers.0.attn", "layers.1.attn"])
    assert doc["range"] == [37, 100] and doc["part"] == ["layers.0.attn", "layers.1.attn"]
    assert "range" not in whole and "part" not in whole
    # 63 positions of 2 layers, 8 heads x 128 x bf16 x K+V each: exactly that, nothing else
    assert doc["ranks"][0]["nbytes"] == 63 * 2 * 8 * 128 * 2 * 2
    assert whole["ranks"][0]["nbytes"] == 112 * 32 * 8 * 128 * 2 * 2  # 7 whole blocks


def _random_buffers(spec: EngineSpec, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {(r, name): rng.integers(0, 256, spec.rank_buffer_nbytes(b), dtype=np.uint8)
            for r in range(spec.num_ranks) for b, name in enumerate(spec.buffers)}


@pytest.mark.parametrize("layout", ["BLHNC", "BHLNC"])
def test_a_plan_merged_across_layer_slots_is_not_cut_into_parts(layout):
    """With cross-layer blocks one run can copy several layers: a part of such a plan would
    carry layers that are not computed yet, so part() refuses it, and merge_slots=False gives
    a plan of the same bytes whose parts are exact."""
    src = preset("llama-3.1-8b", 4, num_blocks=32, layout=layout)
    dst = preset("llama-3.1-8b", 4 if layout == "BLHNC" else 2, num_blocks=32, layout=layout)
    sb, db = request_blocks(src, 160, seed=1), request_blocks(dst, 160, seed=2)
    names = [r.name for r in dst.regions]
    src_bufs = _random_buffers(src, 3)
    for r in range(dst.num_ranks):
        tmap = pull_map(src, dst, r)
        merged = tmap.plan(sb, db, tokens=(7, 150))
        assert merged.spans_regions
        with pytest.raises(RequestError, match="merge_slots=False"):
            merged.part(names[:1])
        layered = tmap.plan(sb, db, tokens=(7, 150), merge_slots=False)
        assert not layered.spans_regions and len(layered) > len(merged)
        assert layered.nbytes == merged.nbytes
        # every run of a layer-wise part stays inside its own layer's slot
        for name in names[:3]:
            piece = layered.part([name])
            j = dst.region_index(name)
            assert set(piece.copies()["dst_region"].tolist()) <= {j}
        # the parts, executed one after another, land what the merged plan lands
        got, want = _random_buffers(dst, 4), _random_buffers(dst, 4)
        simulate(merged, src_bufs, want)
        for k in range(0, len(names), 7):
            simulate(layered.part(names[k:k + 7]), src_bufs, got)
        for key in want:
            assert np.array_equal(got[key], want[key]), key
