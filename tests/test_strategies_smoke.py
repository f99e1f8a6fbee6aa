"""Smoke tests: generated spec pairs and requests satisfy their invariants, and the oracle
agrees on them with a second, view-based reference (numpy reshape/transpose, last replica)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from kvplan import strategies as ks

try:
    from tests import oracle
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    import oracle

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

HYBRID_KEYS = {"pool", "page_bytes", "stage", "kernel_block_size"}


def _ok(a, b):
    return a % b == 0 or b % a == 0


def engine_bytes(spec):
    """Bytes of an engine over all ranks, a pool counted once per rank."""
    seen, total = set(), 0
    for i, r in enumerate(spec["regions"]):
        key = r.get("pool") or ("region", i)
        if key not in seen:
            seen.add(key)
            total += oracle.rank_region_nbytes(r, spec["tp_size"], spec) * spec["tp_size"]
    return total


def check_pair_invariants(src, dst, max_bytes=None):
    assert _ok(src["tp_size"], dst["tp_size"])
    s_regs, d_regs = oracle.check_spec(src), oracle.check_spec(dst)
    s_by_name = {r["name"]: r for r in s_regs}
    assert len(s_by_name) == len(s_regs) == len(d_regs)
    assert set(s_by_name) == {r["name"] for r in d_regs}
    groups = {r["group"] for r in s_regs}
    assert groups == set(range(len(groups)))
    for sp, regs in ((src, s_regs), (dst, d_regs)):
        assert len(regs) >= sp.get("pp_size", 1)
        stages = oracle.region_stages(sp)
        assert set(stages) == set(range(sp.get("pp_size", 1)))  # no empty stage
        if any(r["stage"] is not None for r in regs):
            assert stages == sorted(stages)
    for d in d_regs:
        s = s_by_name[d["name"]]
        for key in ("kind", "dtype", "group", "window", "num_kv_heads", "head_dim", "dim"):
            assert s.get(key) == d.get(key), key
        assert s["dtype"] in oracle.ELEMENT_SIZE
        assert s["num_blocks"] >= 1 and d["num_blocks"] >= 1
        if s["kind"] == "state":
            assert s["parts"] == d["parts"]
            for p in s["parts"]:
                for tp in (src["tp_size"], dst["tp_size"]):
                    assert _ok(p["units"], tp)
                assert p["unit_bytes"] % oracle.ELEMENT_SIZE[s["dtype"]] == 0
            continue
        assert s["block_size"] >= 1 and d["block_size"] >= 1  # any two sizes (granules)
        for r in (s, d):
            assert r["block_size"] % r["kernel_block_size"] == 0
        if s["kind"] == "attention":
            k = s["num_kv_heads"]
            assert _ok(k, src["tp_size"]) and _ok(k, dst["tp_size"])
            for r in (s, d):
                assert r["layout"] in ("HND", "NHD") and r["kv"] in ("split", "joint")
                assert r["pool"] is None or r["kv"] == "joint"
        else:
            assert s["kind"] in ("mla", "indexer")
    if max_bytes is not None:
        for sp in (src, dst):
            assert engine_bytes(sp) <= max_bytes


def check_request_invariants(src, dst, src_blocks, dst_blocks):
    n_groups = 1 + max(r.get("group", 0) for r in src["regions"])
    assert len(src_blocks) == len(dst_blocks) == n_groups
    for sp, blocks in ((src, src_blocks), (dst, dst_blocks)):
        pools: dict[str, set] = {}
        for g, ids in enumerate(blocks):
            regs = [r for r in sp["regions"] if r.get("group", 0) == g]
            limit = min(r["num_blocks"] for r in regs)
            assert len(set(ids)) == len(ids)
            assert all(isinstance(i, int) and 0 <= i < limit for i in ids)
            for pool in {r["pool"] for r in regs if r.get("pool")}:
                assert not pools.setdefault(pool, set()) & set(ids)
                pools[pool] |= set(ids)
    for g in range(n_groups):
        if any(r["kind"] == "state" for r in src["regions"] if r.get("group", 0) == g):
            assert len(src_blocks[g]) == len(dst_blocks[g])


def _last_holder(count, tp, g):
    r = max(r for r in range(tp) if g in oracle.heads_on_rank(count, tp, r))
    return r, oracle.heads_on_rank(count, tp, r).index(g)


def view_reference(src, dst, src_blocks, dst_blocks, rank, sbuf, before):
    """Second reference: copy through the reshape-built views, last replica of each head or
    unit, pools through page views; returns ``{j: buffer}`` for the regions ``rank`` holds."""
    out, bufs = {}, {}
    s_idx = {r["name"]: i for i, r in enumerate(src["regions"])}
    s_stage = oracle.region_stages(src)
    src_tp, dst_tp = src["tp_size"], dst["tp_size"]
    t_rank = rank % dst_tp
    for j in oracle.rank_regions(dst, rank):
        d = oracle.normalize_region(dst["regions"][j])
        i = s_idx[d["name"]]
        s = oracle.normalize_region(src["regions"][i])
        key = d["pool"] or ("region", j)
        if key not in bufs:
            bufs[key] = before[(rank, j)].copy()
        buf = out[j] = bufs[key]
        d_page = oracle.page_nbytes(dst, j) if d["pool"] else None
        s_page = oracle.page_nbytes(src, i) if s["pool"] else None
        base = s_stage[i] * src_tp
        sl = np.array(src_blocks[s["group"]], dtype=np.int64)
        dl = np.array(dst_blocks[d["group"]], dtype=np.int64)
        if d["kind"] == "state":
            dviews = oracle.state_views(d, dst_tp, buf, d_page)
            for p, part in enumerate(d["parts"]):
                for ud, gu in enumerate(oracle.units_on_rank(part["units"], dst_tp, t_rank)):
                    sr, us = _last_holder(part["units"], src_tp, gu)
                    sv = oracle.state_views(s, src_tp, sbuf[(base + sr, i)], s_page)[p]
                    dviews[p][dl, ud] = sv[sl, us]
            continue
        dview = oracle.token_view(d, dst_tp, buf, d_page)
        bs_s, bs_d = s["block_size"], d["block_size"]
        kb_s, kb_d = s["kernel_block_size"], d["kernel_block_size"]
        n = min(len(sl) * bs_s, len(dl) * bs_d)
        start = 0
        if d["window"] is not None:
            start = max(0, n - (d["window"] // bs_d + 1) * bs_d)
        p = np.arange(start, n)
        if d["kind"] == "attention":
            k = d["num_kv_heads"]
            wanted = oracle.heads_on_rank(k, dst_tp, t_rank)
            holders = [_last_holder(k, src_tp, gh) for gh in wanted]
        else:
            holders = [(src_tp - 1, 0)]
        for hd, (sr, hs) in enumerate(holders):
            sview = oracle.token_view(s, src_tp, sbuf[(base + sr, i)], s_page)
            if p.size:
                dview[:, dl[p // bs_d], hd, (p % bs_d) // kb_d, p % kb_d] = sview[
                    :, sl[p // bs_s], hs, (p % bs_s) // kb_s, p % kb_s
                ]
    return out


def check_case(src, dst, src_blocks, dst_blocks, seed=0):
    sbuf = oracle.source_buffers(src, seed=seed, request_blocks=src_blocks)
    before = oracle.destination_buffers(dst)
    for sp, bufs in ((src, sbuf), (dst, before)):
        keys = {(r, j) for r in range(oracle.world_size(sp)) for j in oracle.rank_regions(sp, r)}
        assert set(bufs) == keys
        for (r, j), b in bufs.items():
            assert b.dtype == np.uint8
            assert b.size == oracle.rank_region_nbytes(sp["regions"][j], sp["tp_size"], sp)
            for m in oracle.pool_members(sp, j):
                if (r, m) in bufs:
                    assert bufs[(r, m)] is b
    for rank in range(oracle.world_size(dst)):
        exp, mw = oracle.expected_destination(src, dst, src_blocks, dst_blocks, rank, sbuf, before)
        ref = view_reference(src, dst, src_blocks, dst_blocks, rank, sbuf, before)
        assert set(exp) == set(ref) == set(oracle.rank_regions(dst, rank))
        union: dict[int, np.ndarray] = {}
        for j in exp:
            assert exp[j].dtype == np.uint8 and mw[j].dtype == np.bool_
            assert np.array_equal(exp[j], ref[j])
            anchor = id(before[(rank, j)])
            union[anchor] = union.get(anchor, np.zeros(exp[j].shape, bool))
            assert not (union[anchor] & mw[j]).any()
            union[anchor] |= mw[j]
        for j in exp:
            covered = union[id(before[(rank, j)])]
            assert np.array_equal(exp[j][~covered], before[(rank, j)][~covered])
            # sentinel and content differ almost everywhere, so written bytes changed
            if mw[j].sum() > 64:
                assert np.mean(exp[j][mw[j]] != before[(rank, j)][mw[j]]) > 0.9


@SETTINGS
@given(data=st.data())
def test_spec_pairs_requests_and_oracle(data):
    src, dst = data.draw(ks.spec_pairs(max_tp=16, max_regions=4, max_blocks=16))
    check_pair_invariants(src, dst, max_bytes=2 << 20)
    src_blocks, dst_blocks = data.draw(ks.requests(src, dst))
    check_request_invariants(src, dst, src_blocks, dst_blocks)
    check_case(src, dst, src_blocks, dst_blocks)


@SETTINGS
@given(data=st.data())
def test_hybrid_pairs_with_pipeline_stages(data):
    src, dst = data.draw(ks.spec_pairs(max_tp=8, max_regions=5, max_blocks=12, max_pp=3,
                                       kinds=("attention", "mla")))
    check_pair_invariants(src, dst, max_bytes=2 << 20)
    src_blocks, dst_blocks = data.draw(ks.requests(src, dst))
    check_request_invariants(src, dst, src_blocks, dst_blocks)
    check_case(src, dst, src_blocks, dst_blocks, seed=5)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_tp_only_pairs_have_no_hybrid_keys(data):
    src, dst = data.draw(ks.spec_pairs(state=False, pools=False, kernel_blocks=False, max_pp=1,
                                       max_blocks=16))
    check_pair_invariants(src, dst, max_bytes=2 << 20)
    for sp in (src, dst):
        assert set(sp) == {"tp_size", "regions"}
        for r in sp["regions"]:
            assert r["kind"] in ("attention", "mla", "indexer")
            assert not HYBRID_KEYS & set(r)
    src_blocks, dst_blocks = data.draw(ks.requests(src, dst))
    check_case(src, dst, src_blocks, dst_blocks)


@settings(max_examples=10, deadline=None)
@given(ks.engine_pairs(state=False, pools=False, kernel_blocks=False, max_pp=1))
def test_engine_pairs_tp_only(pair):
    src, dst = pair
    assert src.to_dict()["tp_size"] >= 1 and dst.to_dict()["regions"]


def test_defaults_generate_every_hybrid_feature():
    seen: set[str] = set()

    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(ks.spec_pairs())
    def inner(pair):
        for sp in pair:
            if sp.get("pp_size", 1) > 1:
                seen.add("pp")
            for r in sp["regions"]:
                seen.update(HYBRID_KEYS & set(r))
                if r["kind"] == "state":
                    seen.add("state")
                    if any(p["units"] < sp["tp_size"] for p in r["parts"]):
                        seen.add("replicated units")

    inner()
    assert seen >= {"pp", "state", "replicated units", *HYBRID_KEYS}, seen


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_spec_pairs_cover_kinds_and_defaults(data):
    src, dst = data.draw(
        ks.spec_pairs(max_tp=12, kinds=("attention",), max_regions=2, omit_defaults=False)
    )
    check_pair_invariants(src, dst, max_bytes=2 << 20)
    for r in src["regions"] + dst["regions"]:
        assert "group" in r
        if r["kind"] == "attention":
            assert {"window", "layout", "kv"} <= set(r)


def test_block_lists_respect_range_and_length():
    @settings(max_examples=50, deadline=None)
    @given(st.integers(0, 40).flatmap(lambda n: st.tuples(st.just(n), ks.block_lists(n, None))))
    def inner(args):
        n, ids = args
        assert len(set(ids)) == len(ids) and all(0 <= i < n for i in ids)

    inner()


@pytest.mark.parametrize("kind", ["state", "token"])
def test_state_and_token_region_pairs(kind):
    @settings(max_examples=20, deadline=None)
    @given(st.data())
    def inner(data):
        src_tp, dst_tp = data.draw(ks.tp_pairs(8))
        if kind == "state":
            s, d = data.draw(ks.state_region_pairs(0, src_tp, dst_tp, group=1))
            assert s["parts"] == d["parts"] and s["group"] == d["group"] == 1
        else:
            s, d = data.draw(ks.region_pairs(0, src_tp, dst_tp, kernel_blocks=True))
        for r, tp in ((s, src_tp), (d, dst_tp)):
            one_block = tp * oracle.rank_block_nbytes(r, tp)
            assert oracle.rank_region_nbytes(r, tp) * tp <= max(1 << 18, one_block)

    inner()


@settings(max_examples=30, deadline=None)
@given(ks.block_size_pairs(divide=True))
def test_block_size_pairs_divide_only_when_asked(pair):
    assert _ok(*pair)


def test_block_size_pairs_draw_non_dividing_pairs_by_default():
    a, b = find(ks.block_size_pairs(), lambda p: not _ok(*p))
    assert a % b and b % a
