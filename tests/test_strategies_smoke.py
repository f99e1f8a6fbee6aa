"""Smoke tests: generated spec pairs and requests satisfy their invariants, and the oracle
agrees on them with a second, view-based reference (numpy reshape/transpose, per token)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
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


def _ok(a, b):
    return a % b == 0 or b % a == 0


def check_pair_invariants(src, dst, max_bytes=None):
    assert _ok(src["tp_size"], dst["tp_size"])
    s_regs = [oracle.normalize_region(r) for r in src["regions"]]
    d_regs = [oracle.normalize_region(r) for r in dst["regions"]]
    s_by_name = {r["name"]: r for r in s_regs}
    assert len(s_by_name) == len(s_regs) == len(d_regs)
    assert set(s_by_name) == {r["name"] for r in d_regs}
    groups = {r["group"] for r in s_regs}
    assert groups == set(range(len(groups)))
    for d in d_regs:
        s = s_by_name[d["name"]]
        for key in ("kind", "dtype", "group", "window", "num_kv_heads", "head_dim", "dim"):
            assert s.get(key) == d.get(key), key
        assert _ok(s["block_size"], d["block_size"])
        assert s["dtype"] in oracle.ELEMENT_SIZE
        assert s["num_blocks"] >= 1 and d["num_blocks"] >= 1
        if s["kind"] == "attention":
            k = s["num_kv_heads"]
            assert _ok(k, src["tp_size"]) and _ok(k, dst["tp_size"])
            for r in (s, d):
                assert r["layout"] in ("HND", "NHD") and r["kv"] in ("split", "joint")
        else:
            assert s["kind"] in ("mla", "indexer")
    if max_bytes is not None:
        for sp in (src, dst):
            total = sum(
                oracle.rank_region_nbytes(r, sp["tp_size"]) * sp["tp_size"] for r in sp["regions"]
            )
            assert total <= max_bytes


def check_request_invariants(src, dst, src_blocks, dst_blocks):
    n_groups = 1 + max(r.get("group", 0) for r in src["regions"])
    assert len(src_blocks) == len(dst_blocks) == n_groups
    for sp, blocks in ((src, src_blocks), (dst, dst_blocks)):
        for g, ids in enumerate(blocks):
            limit = min(r["num_blocks"] for r in sp["regions"] if r.get("group", 0) == g)
            assert len(set(ids)) == len(ids)
            assert all(isinstance(i, int) and 0 <= i < limit for i in ids)


def view_reference(src, dst, src_blocks, dst_blocks, rank, sbuf, before):
    """Second reference: copy token rows between logical views, last holder of each head."""
    out = {}
    s_idx = {r["name"]: i for i, r in enumerate(src["regions"])}
    for j, d in enumerate(dst["regions"]):
        d = oracle.normalize_region(d)
        i = s_idx[d["name"]]
        s = oracle.normalize_region(src["regions"][i])
        buf = before[(rank, j)].copy()
        dview = oracle.logical_view(d, dst["tp_size"], buf)
        sl, dl = src_blocks[s["group"]], dst_blocks[d["group"]]
        bs_s, bs_d = s["block_size"], d["block_size"]
        n = min(len(sl) * bs_s, len(dl) * bs_d)
        start = 0
        if d["window"] is not None:
            start = max(0, n - (d["window"] // bs_d + 1) * bs_d)
        if d["kind"] == "attention":
            k = d["num_kv_heads"]
            heads = oracle.heads_on_rank(k, dst["tp_size"], rank)
            holders = []
            for gh in heads:
                src_rank = max(
                    r
                    for r in range(src["tp_size"])
                    if gh in oracle.heads_on_rank(k, src["tp_size"], r)
                )
                holders.append(
                    (src_rank, oracle.heads_on_rank(k, src["tp_size"], src_rank).index(gh))
                )
        else:
            holders = [(src["tp_size"] - 1, 0)]
        for hd, (sr, hs) in enumerate(holders):
            sview = oracle.logical_view(s, src["tp_size"], sbuf[(sr, i)])
            for p in range(start, n):
                dview[:, dl[p // bs_d], hd, p % bs_d] = sview[:, sl[p // bs_s], hs, p % bs_s]
        out[j] = buf
    return out


@SETTINGS
@given(data=st.data())
def test_spec_pairs_requests_and_oracle(data):
    src, dst = data.draw(ks.spec_pairs(max_tp=16, max_regions=4, max_blocks=16))
    check_pair_invariants(src, dst, max_bytes=2 << 20)
    src_blocks, dst_blocks = data.draw(ks.requests(src, dst))
    check_request_invariants(src, dst, src_blocks, dst_blocks)
    sbuf = oracle.source_buffers(src)
    before = oracle.destination_buffers(dst)
    for rank in range(dst["tp_size"]):
        exp, mw = oracle.expected_destination(src, dst, src_blocks, dst_blocks, rank, sbuf, before)
        ref = view_reference(src, dst, src_blocks, dst_blocks, rank, sbuf, before)
        assert set(exp) == set(range(len(dst["regions"])))
        for j in exp:
            assert exp[j].dtype == np.uint8 and mw[j].dtype == np.bool_
            assert np.array_equal(exp[j], ref[j])
            assert np.array_equal(exp[j][~mw[j]], before[(rank, j)][~mw[j]])
            # sentinel and content differ almost everywhere, so written bytes changed
            if mw[j].sum() > 64:
                assert np.mean(exp[j][mw[j]] != before[(rank, j)][mw[j]]) > 0.9


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_spec_pairs_cover_kinds_and_defaults(data):
    src, dst = data.draw(
        ks.spec_pairs(max_tp=12, kinds=("attention",), max_regions=2, omit_defaults=False)
    )
    check_pair_invariants(src, dst, max_bytes=2 << 20)
    for r in src["regions"] + dst["regions"]:
        assert {"group", "window", "layout", "kv"} <= set(r)


def test_block_lists_respect_range_and_length():
    @settings(max_examples=50, deadline=None)
    @given(st.integers(0, 40).flatmap(lambda n: st.tuples(st.just(n), ks.block_lists(n, None))))
    def inner(args):
        n, ids = args
        assert len(set(ids)) == len(ids) and all(0 <= i < n for i in ids)

    inner()
