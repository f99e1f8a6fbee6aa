"""Axis-order layouts, allocations of layer slots and separate K/V buffers (issue 8).

Byte-exact plans between every pair of layouts on a small model against the independent
oracle (which derives addresses from the order by itself), refusals, the legacy names' exact
bytes, and the run counts a layout buys.
"""

import itertools

import numpy as np
import pytest

from kvplan import EngineSpec, SpecError, pull_map, push_map, rank_layout, simulate
from kvplan.spec import VLLM_ORDERS, layout_order
from tests import oracle


def region(name, kind="attention", **kw):
    r = {"name": name, "kind": kind, "num_blocks": 5, "block_size": 4, "dtype": "bfloat16"}
    r.update({"num_kv_heads": 4, "head_dim": 4} if kind == "attention" else {"dim": 6})
    r.update(kw)
    return r


def model(tp, style, layers=3, **kw):
    """A small model (``layers`` attention layers and one MLA draft layer) laid out in a
    named style: "legacy" (per-layer HND split), "joint-nhd", a vLLM order (all attention
    layers in one allocation), "trt" (TensorRT-LLM's blocks-layers-K/V-heads-tokens-dim
    pool) or "sglang" (per layer, separate token-major K and V buffers)."""
    regions = []
    for i in range(layers):
        if style == "legacy":
            extra = {}
        elif style == "joint-nhd":
            extra = {"layout": "NHD", "kv": "joint"}
        elif style == "trt":
            extra = {"layout": "BLSHND", "allocation": "pool"}
        elif style == "sglang":
            extra = {"layout": "LBNHD", "allocation": [f"k{i}", f"v{i}"]}
        else:
            extra = {"layout": style, "allocation": "kv"}
        regions.append(region(f"layers.{i}", **{**extra, **kw}))
    mla = {} if style in ("legacy", "joint-nhd", "sglang") else {"layout": style if style in
                                                                 VLLM_ORDERS else "BLSHND"}
    regions.append(region("draft.mla", kind="mla", **mla))
    return {"tp_size": tp, "regions": regions}


STYLES = ("legacy", "joint-nhd", *VLLM_ORDERS, "trt", "sglang")


def check_pull(src_d, dst_d, src_blocks, dst_blocks):
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    sbuf = oracle.source_buffers(src_d, seed=5)
    rows = []
    for rank in range(dst.num_ranks):
        plan = pull_map(src, dst, rank).plan(src_blocks, dst_blocks)
        before = oracle.destination_buffers(dst_d, seed=6)
        expected, must = oracle.expected_buffers(src_d, dst_d, src_blocks, dst_blocks, rank,
                                                 sbuf, before)
        got = {}
        for b, name in enumerate(dst.buffers):
            if name in expected:
                held = [i for i in dst.buffer_regions(b) if (rank, i) in before]
                arr = before[(rank, name)] if (rank, name) in before else before[(rank, held[0])]
                got[(rank, name)] = arr.copy()
        simulate(plan, sbuf, got)
        for (_, name), arr in got.items():
            assert np.array_equal(arr, expected[name]), (name, rank)
            c = plan.copies()
            sel = c[c["dst_buffer"] == dst.buffers.index(name)]
            count = np.zeros(arr.size, np.int64)
            for o, n in zip(sel["dst_offset"].tolist(), sel["length"].tolist()):
                count[o:o + n] += 1
            want = sum(m.astype(np.int64) for (_, n), m in must.items() if n == name)
            assert np.array_equal(count, want), name
        rows += plan.copies().tolist()
    return sorted(rows)


@pytest.mark.parametrize("tps", [(2, 4), (4, 2), (2, 2)])
def test_every_layout_pair_is_byte_exact_pull_and_push(tps):
    src_tp, dst_tp = tps
    src_blocks, dst_blocks = [[4, 0, 1, 3]], [[2, 3, 0, 1]]
    for a, b in itertools.product(STYLES, STYLES):
        if tps == (2, 2) and a != b and "legacy" not in (a, b):
            continue  # equal TP: the diagonal and legacy <-> every style suffice
        src_d, dst_d = model(src_tp, a), model(dst_tp, b)
        pulled = check_pull(src_d, dst_d, src_blocks, dst_blocks)
        src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
        pushed = sorted(row for r in range(src.num_ranks)
                        for row in push_map(src, dst, r).plan(src_blocks, dst_blocks)
                        .copies().tolist())
        assert pushed == pulled, (a, b)


def test_windows_kernel_blocks_and_block_size_ratios_across_orders():
    src_d = model(2, "BLHNC", layers=2, block_size=8, kernel_block_size=4, window=6)
    dst_d = model(4, "sglang", layers=2, window=6)
    for r in src_d["regions"] + dst_d["regions"]:
        if r["kind"] != "attention":
            r.pop("window", None)
            r.pop("kernel_block_size", None)
    for r in src_d["regions"]:
        r["block_size"] = 8
    check_pull(src_d, dst_d, [[2, 0, 4]], [[1, 4, 0, 3, 2]])
    check_pull(dst_d, src_d, [[1, 4, 0, 3, 2]], [[2, 0, 4]])


# -- the notation ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, order", [
    ("LBHNC", "LBHNSD"), ("LBNHC", "LBNHSD"), ("LHBNC", "LHBNSD"), ("BLHNC", "BLHNSD"),
    ("BLNHC", "BLNHSD"), ("BHLNC", "BHLNSD"), ("BLSHND", "BLSHND"), ("SBHLND", "SBHLND"),
])
def test_orders_parse(name, order):
    assert layout_order(name) == order
    r = EngineSpec.from_dict(model(2, name)).regions[0]
    assert r.order == order and r.layout_name == name
    assert EngineSpec.from_dict(EngineSpec.from_dict(model(2, name)).to_dict()) == \
        EngineSpec.from_dict(model(2, name))


@pytest.mark.parametrize("layout, kv, order", [
    ("HND", "split", "LSBHND"), ("HND", "joint", "LBSHND"),
    ("NHD", "split", "LSBNHD"), ("NHD", "joint", "LBSNHD"),
])
def test_legacy_names_keep_their_exact_bytes(layout, kv, order):
    old = EngineSpec.from_dict({"tp_size": 2, "regions": [
        region("a", layout=layout, kv=kv, kernel_block_size=2)]})
    new = EngineSpec.from_dict({"tp_size": 2, "regions": [
        region("a", layout=order, kernel_block_size=2)]})
    assert old.regions[0].order == order
    for rank in range(2):
        assert rank_layout(old, 0, rank) == rank_layout(new, 0, rank)
    # the oracle's two derivations agree too: the legacy table and Horner over the order
    d = old.to_dict()
    s, b, h, t, f = np.ix_(range(2), range(5), range(2), range(4), range(4))
    legacy = oracle.element_offset(d["regions"][0], 2, s, b, h, t, f)
    generic = oracle.token_offset(d, 0, s, b, h, t, f * 2)
    assert np.array_equal(legacy, generic)


@pytest.mark.parametrize("bad, words", [
    ({"layout": "LBHND"}, ["'LBHND'", "no S axis", "allocation [k, v]"]),
    ({"layout": "LBHNS"}, ["'LBHNS'", "permutation"]),
    ({"layout": "LBSHDN"}, ["followed by 'D'"]),
    ({"layout": "BLHNC", "kv": "joint"}, ["kv 'joint'", "HND or NHD"]),
    ({"layout": "blhnc"}, ["'blhnc'"]),
    ({"layout": 3}, ["layout must be a string"]),
])
def test_bad_layouts_are_refused_naming_the_region(bad, words):
    with pytest.raises(SpecError) as e:
        EngineSpec.from_dict({"tp_size": 1, "regions": [region("l0", **bad)]})
    assert "'l0'" in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_allocation_refusals_name_both_regions_and_the_axis():
    def spec(*regions, tp=2):
        return {"tp_size": tp, "regions": list(regions)}

    cases = [
        (spec(region("a", allocation="x"), region("b", allocation="x", num_blocks=6)),
         ["'a'", "'b'", "num_blocks", "5 vs 6"]),
        (spec(region("a", allocation="x", layout="BLHNC"),
              region("b", allocation="x", layout="LBHNC")), ["'a'", "'b'", "axis order"]),
        (spec(region("a", allocation="x"), region("b", kind="mla", allocation="x")),
         ["'a'", "'b'", "units"]),
        (spec(region("m", kind="mla", allocation=["k", "v"])), ["'m'", "one stream"]),
        (spec(region("a", allocation=["k", "k"])), ["'a'", "twice"]),
        (spec(region("a", allocation="b"), region("b")), ["'b'", "distinct"]),
        (spec(region("a", pool="p", layout="LHBNC", group=0),
              region("m", kind="mla", pool="p", group=1)), ["'a'", "L and B outermost"]),
        (spec(region("a", allocation="x", stage=0), region("b", allocation="x", stage=1)) | {
            "pp_size": 2}, ["'a'", "'b'", "pipeline stages"]),
    ]
    for d, words in cases:
        with pytest.raises(SpecError) as e:
            EngineSpec.from_dict(d)
        for w in words:
            assert w in str(e.value), (str(e.value), w)


def test_buffers_sizes_and_slots():
    s = EngineSpec.from_dict(model(2, "BLHNC"))
    assert s.buffers == ("kv", "draft.mla")
    assert [s.slot_of(i) for i in range(4)] == [(0, 3), (1, 3), (2, 3), (0, 1)]
    one = 2 * 4 * 2 * 4 * 2  # K+V x tokens x local heads x head_dim x bf16
    assert s.rank_buffer_nbytes(0) == 3 * 5 * one == s.rank_region_nbytes(1)
    assert s.allocation_of(2) == 0 and s.buffer_regions(0) == (0, 1, 2)
    g = EngineSpec.from_dict(model(2, "sglang", layers=2))
    assert g.buffers == ("k0", "v0", "k1", "v1", "draft.mla")
    assert g.buffer_of(1, 0) == 2 and g.buffer_of(1, 1) == 3
    assert g.rank_buffer_nbytes(1) == 5 * one // 2
    # a stream's bytes: BLHNC interleaves layers inside a block, the address of (layer 1,
    # block 2, head 1, token 3, V) is ((((2*3 + 1)*2 + 1)*4 + 3)*2 + 1) * head bytes
    lay = rank_layout(s, 1, 0)
    assert lay.offset(0, 1, 2, 1, 3) == ((((2 * 3 + 1) * 2 + 1) * 4 + 3) * 2 + 1) * 8


# -- run counts -----------------------------------------------------------------------------


def _block_runs(src_ids, dst_ids):
    """Maximal runs of positions whose ids both step by one."""
    s, d = np.asarray(src_ids), np.asarray(dst_ids)
    return 1 + int(np.count_nonzero((np.diff(s) != 1) | (np.diff(d) != 1)))


def test_cross_layer_orders_cost_one_run_per_block_run():
    src_ids, dst_ids = [7, 8, 9, 2, 3, 11], [0, 1, 2, 5, 6, 9]
    runs = _block_runs(src_ids, dst_ids)
    big = dict(num_blocks=12)
    for style in ("BLHNC", "BLNHC", "trt"):
        d = model(2, style, layers=6, **big)
        d["regions"] = d["regions"][:-1]  # attention layers only
        s = EngineSpec.from_dict(d)
        for rank in range(2):
            plan = pull_map(s, s, rank).plan([src_ids], [dst_ids])
            assert len(plan) == runs, style  # one peer: one run per block run, not per layer
    # per-layer orders pay one per layer (and stream, for a split layout)
    d = model(2, "LBHNC", layers=6, **big)
    d["regions"] = d["regions"][:-1]
    s = EngineSpec.from_dict(d)
    assert len(pull_map(s, s, 0).plan([src_ids], [dst_ids])) == 6 * runs


def test_bhlnc_hetero_tp_costs_one_run_per_peer_and_block():
    ids = [4, 0, 9, 3]
    src_d = model(4, "BHLNC", layers=6, num_blocks=10)
    dst_d = model(2, "BHLNC", layers=6, num_blocks=10)
    for d in (src_d, dst_d):
        d["regions"] = d["regions"][:-1]
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    plan = pull_map(src, dst, 0).plan([ids], [ids])
    assert plan.peers == (0, 1)
    assert len(plan) == 2 * len(ids)  # each D block: one run from each of its two P ranks
    check_pull(src_d, dst_d, [ids], [ids])


def test_runs_never_cross_from_a_k_buffer_into_a_v_buffer():
    # K of the last block ends its buffer where, were the two buffers one space, V of block 0
    # would begin: on both sides. The runs must stop at the buffer's end.
    d = model(2, "sglang", layers=1)
    s = EngineSpec.from_dict(d)
    plan = pull_map(s, s, 0).plan([[4, 0]], [[4, 0]])
    c = plan.copies()
    assert sorted(c["dst_buffer"].tolist()) == [0, 0, 1, 1, 2, 2]  # K, V, then the MLA
    for row in c:
        assert row["dst_offset"] + row["length"] <= s.rank_buffer_nbytes(int(row["dst_buffer"]))
        assert row["src_offset"] + row["length"] <= s.rank_buffer_nbytes(int(row["src_buffer"]))
    check_pull(d, d, [[4, 0]], [[4, 0]])


def _hybrid(tp, layout, allocation):
    """Two KimiLinear-like pools (an MLA view and a state view each), as layer slots."""
    regions = []
    for p in range(2):
        extra = {"pool": f"pool.{p}", "layout": layout}
        if allocation:
            extra["allocation"] = "hyb"
        regions.append(region(f"layers.{2 * p}.mla", kind="mla", group=0, num_blocks=6, **extra))
        regions.append({"name": f"layers.{2 * p + 1}.kda", "kind": "state", "group": 1,
                        "num_blocks": 6, "dtype": "bfloat16", **extra,
                        "parts": [{"name": "conv", "units": 4, "unit_bytes": 6},
                                  {"name": "ssm", "units": 4, "unit_bytes": 10}]})
    return {"tp_size": tp, "regions": regions}


@pytest.mark.parametrize("layout", ["BLHNC", "LBHNC", "BLSHND"])
def test_pools_as_layer_slots_of_one_allocation(layout):
    # a pool is one slot: both views of pool p live in slot p of allocation "hyb"
    s = EngineSpec.from_dict(_hybrid(2, layout, True))
    assert s.buffers == ("hyb",) and [s.slot_of(i) for i in range(4)] == [(0, 2), (0, 2),
                                                                          (1, 2), (1, 2)]
    assert s.rank_buffer_nbytes(0) == 2 * 6 * s.rank_page_nbytes(0)
    src_blocks, dst_blocks = [[4, 1], [3]], [[0, 5], [2]]
    for a, b in ((_hybrid(2, layout, True), _hybrid(4, "LBHNC", False)),
                 (_hybrid(4, "LBHNC", False), _hybrid(2, layout, True))):
        sbuf = oracle.source_buffers(a, seed=5, request_blocks=src_blocks)
        src, dst = EngineSpec.from_dict(a), EngineSpec.from_dict(b)
        for rank in range(dst.num_ranks):
            plan = pull_map(src, dst, rank).plan(src_blocks, dst_blocks)
            before = oracle.destination_buffers(b, seed=6)
            expected, _ = oracle.expected_buffers(a, b, src_blocks, dst_blocks, rank, sbuf,
                                                  before)
            got = oracle.clone_buffers(before, rank)
            simulate(plan, sbuf, got)
            for name, exp in expected.items():
                b_index = dst.buffers.index(name)
                j = dst.buffer_regions(b_index)[0]
                assert np.array_equal(got[(rank, j)], exp), (layout, name, rank)


def test_pool_regions_must_name_one_allocation():
    d = _hybrid(2, "BLHNC", True)
    d["regions"][1]["allocation"] = "other"
    with pytest.raises(SpecError, match=r"pool 'pool.0': regions 'layers.0.mla' and "
                                        r"'layers.1.kda' name different allocations"):
        EngineSpec.from_dict(d)
