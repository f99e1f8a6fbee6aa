"""Tests of the reference oracle against hand-computed facts from docs/domain.md.

Byte offsets in these tests are written out by hand from the domain.md examples and layout
table, not taken from the oracle, so that a wrong oracle fails here.
"""

from __future__ import annotations

import numpy as np
import pytest

try:
    from tests import oracle
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    import oracle


def attn(
    name="layers.0.attn",
    K=8,
    D=128,
    bs=16,
    NB=4,
    dtype="bfloat16",
    layout="HND",
    kv="split",
    group=0,
    window=None,
):
    return {
        "name": name,
        "kind": "attention",
        "group": group,
        "num_blocks": NB,
        "block_size": bs,
        "dtype": dtype,
        "num_kv_heads": K,
        "head_dim": D,
        "layout": layout,
        "kv": kv,
        "window": window,
    }


def repl(name="draft.0.mla", kind="mla", dim=576, bs=16, NB=4, dtype="bfloat16", group=0):
    return {
        "name": name,
        "kind": kind,
        "group": group,
        "num_blocks": NB,
        "block_size": bs,
        "dtype": dtype,
        "dim": dim,
    }


def spec(tp, *regions, pp=None):
    out = {"tp_size": tp, "regions": list(regions)}
    if pp is not None:
        out["pp_size"] = pp
    return out


def run(src, dst, src_blocks, dst_blocks, rank, fill_by_request=True):
    sbuf = oracle.source_buffers(src, request_blocks=src_blocks if fill_by_request else None)
    before = oracle.destination_buffers(dst)
    exp, mw = oracle.expected_destination(src, dst, src_blocks, dst_blocks, rank, sbuf, before)
    return sbuf, before, exp, mw


def assert_untouched_outside(exp, mw, before, rank):
    """Bytes outside must_write keep their old value; the regions of a pool share one array,
    so a pool's bytes outside ALL its regions' masks (and only those) must be untouched."""
    covered: dict[int, np.ndarray] = {}
    for j in exp:
        c = covered.setdefault(id(exp[j]), np.zeros(exp[j].shape, dtype=bool))
        assert not (c & mw[j]).any()
        c |= mw[j]
    for j in exp:
        c = covered[id(exp[j])]
        assert np.array_equal(exp[j][~c], before[(rank, j)][~c])


# ---------------------------------------------------------------------------------------------
# Sizes, heads, buffers
# ---------------------------------------------------------------------------------------------


def test_element_sizes():
    assert oracle.ELEMENT_SIZE == {
        "float32": 4,
        "bfloat16": 2,
        "float16": 2,
        "float8_e4m3fn": 1,
        "uint8": 1,
    }


def test_rank_region_nbytes_with_defaults():
    r = {
        "name": "a",
        "kind": "attention",
        "num_blocks": 1024,
        "block_size": 16,
        "dtype": "bfloat16",
        "num_kv_heads": 8,
        "head_dim": 128,
    }
    assert oracle.rank_region_nbytes(r, 4) == 2 * 1024 * 16 * 2 * 128 * 2  # 16 MiB
    assert oracle.rank_region_nbytes(r, 1) == 2 * 1024 * 16 * 8 * 128 * 2
    assert oracle.rank_region_nbytes(r, 16) == 2 * 1024 * 16 * 1 * 128 * 2  # K < tp
    assert oracle.rank_region_nbytes(repl(NB=1024), 8) == 1024 * 16 * 576 * 2
    assert (
        oracle.rank_region_nbytes(repl(kind="indexer", dim=132, dtype="uint8", NB=7), 3)
        == 7 * 16 * 132
    )
    assert (
        oracle.rank_region_nbytes(attn(dtype="float32", kv="joint", layout="NHD"), 2)
        == 2 * 4 * 16 * 4 * 128 * 4
    )


def test_heads_on_rank():
    assert [oracle.heads_on_rank(8, 4, r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [oracle.heads_on_rank(2, 8, r) for r in range(8)] == [[0]] * 4 + [[1]] * 4
    assert [oracle.heads_on_rank(3, 6, r) for r in range(6)] == [[0], [0], [1], [1], [2], [2]]
    assert oracle.heads_on_rank(6, 3, 2) == [4, 5]
    with pytest.raises(ValueError):
        oracle.heads_on_rank(4, 6, 0)


def test_element_offset_table_by_hand():
    # H=2 local heads (K=4, tp=2), D=3, bs=5, NB=7, e=2
    r = attn(K=4, D=3, bs=5, NB=7)
    s, b, h, t, f = 1, 4, 1, 2, 2
    assert (
        oracle.element_offset({**r, "layout": "NHD"}, 2, s, b, h, t, f)
        == ((((1 * 7 + 4) * 5 + 2) * 2 + 1) * 3 + 2) * 2
    )
    assert (
        oracle.element_offset({**r, "layout": "HND"}, 2, s, b, h, t, f)
        == ((((1 * 7 + 4) * 2 + 1) * 5 + 2) * 3 + 2) * 2
    )
    assert (
        oracle.element_offset({**r, "layout": "NHD", "kv": "joint"}, 2, s, b, h, t, f)
        == ((((4 * 2 + 1) * 5 + 2) * 2 + 1) * 3 + 2) * 2
    )
    assert (
        oracle.element_offset({**r, "layout": "HND", "kv": "joint"}, 2, s, b, h, t, f)
        == ((((4 * 2 + 1) * 2 + 1) * 5 + 2) * 3 + 2) * 2
    )
    assert (
        oracle.element_offset(repl(dim=9, bs=5, NB=7), 2, 0, 4, 0, 2, 3)
        == ((4 * 5 + 2) * 9 + 3) * 2
    )


@pytest.mark.parametrize(
    "layout,kv", [("NHD", "split"), ("HND", "split"), ("NHD", "joint"), ("HND", "joint")]
)
def test_source_bytes_match_hash_formula_and_view(layout, kv):
    region = attn(K=4, D=5, bs=3, NB=6, dtype="float32", layout=layout, kv=kv)
    tp = 2
    bufs = oracle.source_buffers(spec(tp, region), seed=7)
    rng = np.random.default_rng(0)
    for rank in range(tp):
        buf = bufs[(rank, 0)]
        view = oracle.logical_view(region, tp, buf)
        assert view.shape == (2, 6, 2, 3, 5, 4)
        for _ in range(50):
            s, b, h, t, f, k = (int(rng.integers(n)) for n in (2, 6, 2, 3, 5, 4))
            gh = 2 * rank + h
            want = oracle.content_hash(region["name"], 7, s, b, t, gh, f, k)
            off = oracle.element_offset(region, tp, s, b, h, t, f) + k
            assert buf[off] == want
            assert view[s, b, h, t, f, k] == want


def test_replicas_identical_and_heads_distinct():
    region = attn(K=2, D=8, bs=4, NB=3)
    bufs = oracle.source_buffers(spec(8, region))
    for r in range(1, 4):
        assert np.array_equal(bufs[(0, 0)], bufs[(r, 0)])
        assert np.array_equal(bufs[(4, 0)], bufs[(4 + r, 0)])
    assert np.mean(bufs[(0, 0)] == bufs[(4, 0)]) < 0.05
    m = oracle.source_buffers(spec(3, repl(dim=7, NB=2)))
    assert np.array_equal(m[(0, 0)], m[(2, 0)])


def test_hash_depends_on_name_seed_and_dst_differs():
    a = oracle.source_buffers(spec(1, attn(name="x", D=8, NB=2)), seed=0)[(0, 0)]
    b = oracle.source_buffers(spec(1, attn(name="y", D=8, NB=2)), seed=0)[(0, 0)]
    c = oracle.source_buffers(spec(1, attn(name="x", D=8, NB=2)), seed=1)[(0, 0)]
    d = oracle.destination_buffers(spec(1, attn(name="x", D=8, NB=2)))[(0, 0)]
    for other in (b, c, d):
        assert np.mean(a == other) < 0.02
    # roughly uniform byte values
    counts = np.bincount(a, minlength=256)
    assert a.size == 8192 and counts.min() > 8 and counts.max() < 64  # mean 32


# ---------------------------------------------------------------------------------------------
# domain.md section 3 examples
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("r", range(4))
def test_domain_example_tp2_to_tp4_hnd(r):
    # 8 heads, P TP2 -> D TP4, bf16, block 16, head 128: each stream block is 8192 B on D;
    # D rank r reads P rank r//2 at offset (r%2)*8192, length 8192.
    NB = 4
    src, dst = spec(2, attn(NB=NB)), spec(4, attn(NB=NB))
    sbuf, before, exp, mw = run(src, dst, [[3, 1]], [[0, 2]], r)
    e, m, src_r = exp[0], mw[0], sbuf[(r // 2, 0)]
    assert e.size == 2 * NB * 8192 and src_r.size == 2 * NB * 16384
    for sb, db in [(3, 0), (1, 2)]:
        for s in range(2):
            d0 = (s * NB + db) * 8192
            s0 = (s * NB + sb) * 16384 + (r % 2) * 8192
            assert np.array_equal(e[d0 : d0 + 8192], src_r[s0 : s0 + 8192])
            assert m[d0 : d0 + 8192].all()
            wrong = (s * NB + sb) * 16384 + (1 - r % 2) * 8192
            assert not np.array_equal(e[d0 : d0 + 8192], src_r[wrong : wrong + 8192])
    assert m.sum() == 2 * 2 * 8192
    assert_untouched_outside(exp, mw, before, r)
    for db in (1, 3):
        for s in range(2):
            d0 = (s * NB + db) * 8192
            assert np.array_equal(e[d0 : d0 + 8192], before[(r, 0)][d0 : d0 + 8192])


@pytest.mark.parametrize("t", range(2))
def test_t_less_than_r_assembles_slots(t):
    # P TP4 -> D TP2, 8 heads: D rank t reads whole blocks from P ranks 2t+i, slot i.
    NB, D, bs = 3, 16, 8
    plen = 2 * bs * D * 2  # 2 heads per P rank, bf16
    dlen = 4 * bs * D * 2
    src, dst = spec(4, attn(NB=NB, D=D, bs=bs)), spec(2, attn(NB=NB, D=D, bs=bs))
    sbuf, before, exp, mw = run(src, dst, [[2]], [[1]], t)
    for s in range(2):
        for i in range(2):
            d0 = (s * NB + 1) * dlen + i * (dlen // 2)
            s0 = (s * NB + 2) * plen
            assert np.array_equal(exp[0][d0 : d0 + plen], sbuf[(2 * t + i, 0)][s0 : s0 + plen])
    assert mw[0].sum() == 2 * dlen
    assert_untouched_outside(exp, mw, before, t)


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 4), (4, 2), (1, 1), (3, 6)])
def test_mla_whole_block_from_any_rank(src_tp, dst_tp):
    NB, blen = 5, 16 * 576 * 2
    src, dst = spec(src_tp, repl(NB=NB)), spec(dst_tp, repl(NB=NB))
    for rank in range(dst_tp):
        sbuf, before, exp, mw = run(src, dst, [[4, 0, 2]], [[1, 3, 0]], rank)
        for sb, db in [(4, 1), (0, 3), (2, 0)]:
            for r in range(src_tp):
                assert np.array_equal(
                    exp[0][db * blen : (db + 1) * blen], sbuf[(r, 0)][sb * blen : (sb + 1) * blen]
                )
        assert mw[0].sum() == 3 * blen
        assert_untouched_outside(exp, mw, before, rank)


def test_indexer_uint8_and_shuffled_destination_order():
    NB = 3
    a = attn(name="l0", K=2, D=4, bs=4, NB=NB)
    ix = repl(name="ix", kind="indexer", dim=132, dtype="uint8", bs=4, NB=NB)
    src, dst = spec(1, a, ix), spec(2, ix, a)
    sbuf, before, exp, mw = run(src, dst, [[2, 0]], [[0, 1]], 1)
    blen = 4 * 132
    # destination index 0 is the indexer, source index 1
    assert np.array_equal(exp[0][0:blen], sbuf[(0, 1)][2 * blen : 3 * blen])
    assert np.array_equal(exp[0][blen : 2 * blen], sbuf[(0, 1)][0:blen])
    assert mw[0].sum() == 2 * blen
    # destination index 1 is attention, rank 1 holds head 1: second half of P's head runs
    hl = 4 * 4 * 2
    for s in range(2):
        for sb, db in [(2, 0), (0, 1)]:
            d0 = (s * NB + db) * hl
            s0 = (s * NB + sb) * 2 * hl + hl
            assert np.array_equal(exp[1][d0 : d0 + hl], sbuf[(0, 0)][s0 : s0 + hl])
    assert_untouched_outside(exp, mw, before, 1)


@pytest.mark.parametrize("r", range(4))
def test_nhd_head_slice_is_strided(r):
    # NHD: head slice of one block is bs runs of H_slice*D*e bytes spaced H*D*e apart.
    NB, bs, D = 3, 4, 16
    src = spec(2, attn(NB=NB, bs=bs, D=D, layout="NHD"))
    dst = spec(4, attn(NB=NB, bs=bs, D=D, layout="NHD"))
    sbuf, before, exp, mw = run(src, dst, [[0, 2]], [[2, 1]], r)
    srow, drow = 4 * D * 2, 2 * D * 2
    for sb, db in [(0, 2), (2, 1)]:
        for s in range(2):
            for t in range(bs):
                d0 = ((s * NB + db) * bs + t) * drow
                s0 = ((s * NB + sb) * bs + t) * srow + (r % 2) * drow
                assert np.array_equal(exp[0][d0 : d0 + drow], sbuf[(r // 2, 0)][s0 : s0 + drow])
    assert mw[0].sum() == 2 * 2 * bs * drow
    assert_untouched_outside(exp, mw, before, r)


@pytest.mark.parametrize("r", range(2))
def test_joint_hnd(r):
    # joint HND: (NB, 2, H, bs, D); K=4, P TP1 -> D TP2.
    NB, bs, D = 4, 8, 8
    src = spec(1, attn(K=4, NB=NB, bs=bs, D=D, kv="joint"))
    dst = spec(2, attn(K=4, NB=NB, bs=bs, D=D, kv="joint"))
    sbuf, before, exp, mw = run(src, dst, [[3, 0, 1]], [[1, 2, 0]], r)
    dlen, plen = 2 * bs * D * 2, 4 * bs * D * 2
    for sb, db in [(3, 1), (0, 2), (1, 0)]:
        for s in range(2):
            d0 = (db * 2 + s) * dlen
            s0 = (sb * 2 + s) * plen + r * dlen
            assert np.array_equal(exp[0][d0 : d0 + dlen], sbuf[(0, 0)][s0 : s0 + dlen])
    assert mw[0].sum() == 3 * 2 * dlen
    assert_untouched_outside(exp, mw, before, r)


def test_mixed_layouts_element_by_element():
    # P: split NHD, D: joint HND, same TP 1, K=2, D=4, bs=4, float32. Loops by hand.
    NB, bs, K, D, e = 3, 4, 2, 4, 4
    src = spec(1, attn(K=K, D=D, bs=bs, NB=NB, dtype="float32", layout="NHD"))
    dst = spec(1, attn(K=K, D=D, bs=bs, NB=NB, dtype="float32", layout="HND", kv="joint"))
    sbuf, before, exp, mw = run(src, dst, [[1, 2]], [[2, 0]], 0)
    for sb, db in [(1, 2), (2, 0)]:
        for s in range(2):
            for h in range(K):
                for t in range(bs):
                    for f in range(D):
                        so = ((((s * NB + sb) * bs + t) * K + h) * D + f) * e
                        do = ((((db * 2 + s) * K + h) * bs + t) * D + f) * e
                        assert np.array_equal(exp[0][do : do + e], sbuf[(0, 0)][so : so + e])
    assert mw[0].sum() == 2 * 2 * K * bs * D * e
    assert_untouched_outside(exp, mw, before, 0)


# ---------------------------------------------------------------------------------------------
# Block sizes, windows, groups
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("r", range(2))
def test_destination_block_spans_two_source_blocks(r):
    # P bs 16, D bs 32, HND, TP2 both, K=4 (2 heads per rank), D=8, bf16.
    # src [5,2,7] = 48 tokens, dst [1,3] = 64 tokens -> N = 48.
    NB = 8
    src = spec(2, attn(K=4, D=8, bs=16, NB=NB))
    dst = spec(2, attn(K=4, D=8, bs=32, NB=NB))
    sbuf, before, exp, mw = run(src, dst, [[5, 2, 7]], [[1, 3]], r)
    srun, drun = 16 * 8 * 2, 32 * 8 * 2  # one head of one block
    sblk, dblk = 2 * srun, 2 * drun
    pieces = [(1, 0, 5), (1, 1, 2), (3, 0, 7)]  # (dst block, half, src block)
    for s in range(2):
        for h in range(2):
            for db, half, sb in pieces:
                d0 = (s * NB + db) * dblk + h * drun + half * srun
                s0 = (s * NB + sb) * sblk + h * srun
                assert np.array_equal(exp[0][d0 : d0 + srun], sbuf[(r, 0)][s0 : s0 + srun])
                assert mw[0][d0 : d0 + srun].all()
            d0 = (s * NB + 3) * dblk + h * drun + srun  # tokens 16..31 of dst block 3
            assert not mw[0][d0 : d0 + srun].any()
    assert mw[0].sum() == 3 * 2 * 2 * srun
    assert_untouched_outside(exp, mw, before, r)


def test_source_block_spans_two_destination_blocks():
    # P bs 32, D bs 16 (NHD on D), K=2, D=4, tp 1, float16.
    # src [1] = 32 tokens, dst [4,0,2] = 48 -> N = 32; dst block 2 untouched.
    NB = 5
    src = spec(1, attn(K=2, D=4, bs=32, NB=NB, dtype="float16"))
    dst = spec(1, attn(K=2, D=4, bs=16, NB=NB, dtype="float16", layout="NHD"))
    sbuf, before, exp, mw = run(src, dst, [[1]], [[4, 0, 2]], 0)
    e = 2
    for s in range(2):
        for h in range(2):
            for p in range(32):
                db, t = [4, 0][p // 16], p % 16
                do = ((((s * NB + db) * 16 + t) * 2 + h) * 4) * e
                so = ((((s * NB + 1) * 2 + h) * 32 + p) * 4) * e
                assert np.array_equal(exp[0][do : do + 4 * e], sbuf[(0, 0)][so : so + 4 * e])
    blk = 16 * 2 * 4 * e
    for s in range(2):
        assert not mw[0][(s * NB + 2) * blk : (s * NB + 3) * blk].any()
    assert mw[0].sum() == 32 * 2 * 2 * 4 * e
    assert_untouched_outside(exp, mw, before, 0)


def test_window_copies_only_last_blocks():
    # window 20, bs 16: last 20//16+1 = 2 blocks of 5 -> blocks dst[3], dst[4] only.
    NB = 6
    src = spec(1, attn(K=2, D=4, bs=16, NB=NB, window=20))
    dst = spec(2, attn(K=2, D=4, bs=16, NB=NB, window=20))
    slist, dlist = [0, 1, 2, 3, 4], [5, 4, 3, 2, 1]
    sbuf, before, exp, mw = run(src, dst, [slist], [dlist], 1)
    blk = 16 * 4 * 2
    for s in range(2):
        for j in range(5):
            d0 = (s * NB + dlist[j]) * blk
            if j >= 3:
                s0 = (s * NB + slist[j]) * 2 * blk + blk  # rank 1 holds head 1
                assert np.array_equal(exp[0][d0 : d0 + blk], sbuf[(0, 0)][s0 : s0 + blk])
                assert mw[0][d0 : d0 + blk].all()
            else:
                assert not mw[0][d0 : d0 + blk].any()
    assert mw[0].sum() == 2 * 2 * blk
    assert_untouched_outside(exp, mw, before, 1)


def test_window_unaligned_end_uses_destination_block_size():
    # src bs 8 x5 = 40 tokens, dst bs 16 x3 = 48 -> N = 40; window 10 -> keep
    # (10//16 + 1) * 16 = 16 positions: [24, 40) = dst block 1 tokens 8..15, block 2 tokens 0..7
    NB = 6
    src = spec(1, attn(K=1, D=3, bs=8, NB=NB, dtype="float32", window=10))
    dst = spec(1, attn(K=1, D=3, bs=16, NB=NB, dtype="float32", window=10))
    slist, dlist = [5, 4, 3, 2, 1], [0, 3, 5]
    sbuf, before, exp, mw = run(src, dst, [slist], [dlist], 0)
    row = 3 * 4
    written = set()
    for s in range(2):
        for p in range(24, 40):
            db, t = dlist[p // 16], p % 16
            sb, st = slist[p // 8], p % 8
            do = ((s * NB + db) * 16 + t) * row
            so = ((s * NB + sb) * 8 + st) * row
            assert np.array_equal(exp[0][do : do + row], sbuf[(0, 0)][so : so + row])
            written.update(range(do, do + row))
    assert set(np.flatnonzero(mw[0]).tolist()) == written
    assert_untouched_outside(exp, mw, before, 0)


def test_groups_use_their_own_block_lists_and_empty_lists():
    NB = 4
    a0 = attn(name="g0", K=1, D=2, bs=2, NB=NB, group=0)
    a1 = attn(name="g1", K=1, D=2, bs=2, NB=NB, group=1)
    m2 = repl(name="g2", dim=5, bs=2, NB=NB, group=2)
    src, dst = spec(1, a0, a1, m2), spec(1, a0, a1, m2)
    sbuf, before, exp, mw = run(src, dst, [[0], [1], [2]], [[3], [2], []], 0)
    blk = 2 * 2 * 2
    for s in range(2):
        assert np.array_equal(
            exp[0][(s * NB + 3) * blk : (s * NB + 4) * blk],
            sbuf[(0, 0)][(s * NB + 0) * blk : (s * NB + 1) * blk],
        )
        assert np.array_equal(
            exp[1][(s * NB + 2) * blk : (s * NB + 3) * blk],
            sbuf[(0, 1)][(s * NB + 1) * blk : (s * NB + 2) * blk],
        )
    assert mw[0].sum() == mw[1].sum() == 2 * blk
    assert not mw[2].any()
    assert np.array_equal(exp[2], before[(0, 2)])
    # dict form of the request gives the same answer
    _, _, exp2, mw2 = run(src, dst, {0: [0], 1: [1]}, {0: [3], 1: [2], 2: []}, 0)
    for j in exp:
        assert np.array_equal(exp[j], exp2[j]) and np.array_equal(mw[j], mw2[j])


# ---------------------------------------------------------------------------------------------
# Replicated heads (K < tp)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("r", range(8))
def test_replicated_heads_both_sides(r):
    # K=2, P TP4 (ranks 0,1 head 0; 2,3 head 1) -> D TP8 (ranks 0-3 head 0; 4-7 head 1)
    NB, bs, D = 3, 4, 8
    src, dst = spec(4, attn(K=2, D=D, bs=bs, NB=NB)), spec(8, attn(K=2, D=D, bs=bs, NB=NB))
    sbuf, before, exp, mw = run(src, dst, [[1, 2]], [[2, 0]], r)
    blk = bs * D * 2
    g = r // 4
    for s in range(2):
        for sb, db in [(1, 2), (2, 0)]:
            d = exp[0][(s * NB + db) * blk : (s * NB + db + 1) * blk]
            for pr in (2 * g, 2 * g + 1):
                assert np.array_equal(
                    d, sbuf[(pr, 0)][(s * NB + sb) * blk : (s * NB + sb + 1) * blk]
                )
            other = sbuf[(2 * (1 - g), 0)][(s * NB + sb) * blk : (s * NB + sb + 1) * blk]
            assert not np.array_equal(d, other)
    assert mw[0].sum() == 2 * 2 * blk
    assert_untouched_outside(exp, mw, before, r)


@pytest.mark.parametrize("r", range(4))
def test_replicated_heads_on_destination_only(r):
    # K=2, P TP1 (heads 0,1) -> D TP4 (rank r holds head r//2): read offset (r//2)*len.
    NB, bs, D = 2, 4, 8
    src, dst = spec(1, attn(K=2, D=D, bs=bs, NB=NB)), spec(4, attn(K=2, D=D, bs=bs, NB=NB))
    sbuf, before, exp, mw = run(src, dst, [[1]], [[0]], r)
    hl = bs * D * 2
    for s in range(2):
        d0, s0 = (s * NB + 0) * hl, (s * NB + 1) * 2 * hl + (r // 2) * hl
        assert np.array_equal(exp[0][d0 : d0 + hl], sbuf[(0, 0)][s0 : s0 + hl])
    assert mw[0].sum() == 2 * hl
    assert_untouched_outside(exp, mw, before, r)


@pytest.mark.parametrize("t", range(2))
def test_replicated_heads_on_source_only(t):
    # K=4, P TP8 (rank p holds head p//2) -> D TP2 (rank t holds heads 2t, 2t+1).
    # Only one of the two replicas of each head may be used; slot i = local head i.
    NB, bs, D = 2, 4, 4
    src, dst = spec(8, attn(K=4, D=D, bs=bs, NB=NB)), spec(2, attn(K=4, D=D, bs=bs, NB=NB))
    sbuf, before, exp, mw = run(src, dst, [[0, 1]], [[1, 0]], t)
    hl = bs * D * 2
    for s in range(2):
        for sb, db in [(0, 1), (1, 0)]:
            for i in range(2):
                d0 = (s * NB + db) * 2 * hl + i * hl
                for p in (2 * (2 * t + i), 2 * (2 * t + i) + 1):
                    s0 = (s * NB + sb) * hl
                    assert np.array_equal(exp[0][d0 : d0 + hl], sbuf[(p, 0)][s0 : s0 + hl])
    assert mw[0].sum() == 2 * 2 * 2 * hl
    assert_untouched_outside(exp, mw, before, t)


def test_mismatched_names_rejected():
    with pytest.raises(ValueError):
        run(spec(1, attn(name="a", NB=1, D=2)), spec(1, attn(name="b", NB=1, D=2)), [[0]], [[0]], 0)


# ---------------------------------------------------------------------------------------------
# State regions (domain.md section 7): parts sharded on their own units
# ---------------------------------------------------------------------------------------------


def part(name, units, unit_bytes):
    return {"name": name, "units": units, "unit_bytes": unit_bytes}


def state(name="layers.1.mamba", parts=(), NB=3, group=0, dtype="bfloat16", **extra):
    return {"name": name, "kind": "state", "group": group, "num_blocks": NB, "dtype": dtype,
            "parts": [dict(p) for p in parts], **extra}


# Nemotron-H-8B conv state: conv_dim 10240 = x 8192 + B 8 groups x 128 + C 8 groups x 128
# channels; conv kernel 4 keeps 3 columns of bf16 per channel = 6 bytes per channel. The
# temporal ssm state is scaled down here (32 heads of 64 bytes).
NEMOTRON = (part("x", 8192, 6), part("B", 8, 128 * 6), part("C", 8, 128 * 6),
            part("ssm", 32, 64))


def test_nemotron_conv_state_sizes_tp1_and_tp4():
    conv = state(parts=NEMOTRON[:3], NB=5)
    assert oracle.rank_block_nbytes(conv, 1) == 10240 * 6
    assert oracle.rank_block_nbytes(conv, 4) == 2560 * 6
    assert oracle.part_layout(conv, 1) == [(0, 8192, 6), (8192 * 6, 8, 768), (9216 * 6, 8, 768)]
    assert oracle.part_layout(conv, 4) == [(0, 2048, 6), (2048 * 6, 2, 768), (2304 * 6, 2, 768)]
    assert oracle.rank_region_nbytes(conv, 4) == 5 * 2560 * 6
    full = state(parts=NEMOTRON, NB=5)
    assert oracle.rank_block_nbytes(full, 4) == 2560 * 6 + 8 * 64
    assert [oracle.units_on_rank(8, 4, r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_state_source_bytes_by_hand():
    # TP2: x 4 units of 2 B (2 local), B 2 units of 4 B (1 local), C 1 unit of 6 B (replicated).
    # Slot = 4 + 4 + 6 = 14 bytes; rank 1 holds x units 2,3, B unit 1, C unit 0.
    reg = state(name="s", parts=[part("x", 4, 2), part("B", 2, 4), part("C", 1, 6)], NB=4)
    bufs = oracle.source_buffers(spec(2, reg), seed=9)
    assert bufs[(0, 0)].size == bufs[(1, 0)].size == 4 * 14
    b1 = bufs[(1, 0)]
    for b in range(4):
        for u, gu in enumerate((2, 3)):
            for k in range(2):
                assert b1[b * 14 + u * 2 + k] == oracle.state_hash("s", 9, 0, b, gu, k)
        for k in range(4):
            assert b1[b * 14 + 4 + k] == oracle.state_hash("s", 9, 1, b, 1, k)
            assert bufs[(0, 0)][b * 14 + 4 + k] == oracle.state_hash("s", 9, 1, b, 0, k)
        for k in range(6):
            assert b1[b * 14 + 8 + k] == oracle.state_hash("s", 9, 2, b, 0, k)
    for b in range(4):  # the replicated C part is identical on both ranks
        assert np.array_equal(bufs[(0, 0)][b * 14 + 8 : b * 14 + 14], b1[b * 14 + 8 : b * 14 + 14])
    # views agree with the offsets
    views = oracle.state_views(reg, 2, b1)
    assert [v.shape for v in views] == [(4, 2, 2), (4, 1, 4), (4, 1, 6)]
    assert views[1][3, 0, 2] == b1[oracle.state_offset(reg, 2, 3, 1, 0, 2)] == b1[3 * 14 + 6]


@pytest.mark.parametrize("r", range(4))
def test_nemotron_state_tp1_to_tp4(r):
    # D rank r reads each part's unit slice from P rank 0 and packs it at its own part starts.
    src = spec(1, state(parts=NEMOTRON, NB=3))
    dst = spec(4, state(parts=NEMOTRON, NB=3))
    sbuf, before, exp, mw = run(src, dst, [[2, 0]], [[1, 2]], r)
    ps, pd = 61440 + 32 * 64, 15360 + 8 * 64  # slot bytes on P and on D
    # (src part start, dst part start, bytes one D rank holds of the part)
    pieces = [(0, 0, 2048 * 6), (49152, 12288, 1536), (55296, 13824, 1536), (61440, 15360, 512)]
    src0 = sbuf[(0, 0)]
    for sb, db in [(2, 1), (0, 2)]:
        for s0, d0, n in pieces:
            got = exp[0][db * pd + d0 : db * pd + d0 + n]
            assert np.array_equal(got, src0[sb * ps + s0 + r * n : sb * ps + s0 + (r + 1) * n])
    assert mw[0].sum() == 2 * pd
    assert not mw[0][0:pd].any()
    assert_untouched_outside(exp, mw, before, r)


def test_nemotron_state_tp4_to_tp1():
    src = spec(4, state(parts=NEMOTRON, NB=3))
    dst = spec(1, state(parts=NEMOTRON, NB=2))
    sbuf, before, exp, mw = run(src, dst, [[1, 2]], [[1, 0]], 0)
    ps, pd = 15360 + 8 * 64, 61440 + 32 * 64
    pieces = [(0, 0, 2048 * 6), (12288, 49152, 1536), (13824, 55296, 1536), (15360, 61440, 512)]
    for sb, db in [(1, 1), (2, 0)]:
        for q in range(4):  # P rank q's slice goes to slot q of each part
            for s0, d0, n in pieces:
                got = exp[0][db * pd + d0 + q * n : db * pd + d0 + (q + 1) * n]
                assert np.array_equal(got, sbuf[(q, 0)][sb * ps + s0 : sb * ps + s0 + n])
    assert mw[0].all()
    assert_untouched_outside(exp, mw, before, 0)


# KimiLinear-like KDA layer, scaled: 8 heads; q/k/v short-conv states of 24 bytes per head and
# a recurrent state of 32 bytes per head (four states per layer).
KDA = (part("q_conv", 8, 24), part("k_conv", 8, 24), part("v_conv", 8, 24),
       part("recurrent", 8, 32))


@pytest.mark.parametrize("r", range(4))
def test_kda_four_states_tp2_to_tp4(r):
    src = spec(2, state(name="layers.0.kda", parts=KDA, NB=4))
    dst = spec(4, state(name="layers.0.kda", parts=KDA, NB=4))
    sbuf, before, exp, mw = run(src, dst, [[3, 0, 1]], [[0, 2, 3]], r)
    ps, pd = 4 * (24 * 3 + 32), 2 * (24 * 3 + 32)  # 416, 208
    starts_s, starts_d = [0, 96, 192, 288], [0, 48, 96, 144]
    for sb, db in [(3, 0), (0, 2), (1, 3)]:
        for ss, ds, ub in zip(starts_s, starts_d, (24, 24, 24, 32), strict=True):
            n = 2 * ub  # two heads
            s0 = sb * ps + ss + (r % 2) * n
            assert np.array_equal(exp[0][db * pd + ds : db * pd + ds + n],
                                  sbuf[(r // 2, 0)][s0 : s0 + n])
    assert mw[0].sum() == 3 * pd and not mw[0][pd : 2 * pd].any()
    assert_untouched_outside(exp, mw, before, r)


@pytest.mark.parametrize("t", range(2))
def test_kda_four_states_tp4_to_tp2(t):
    src = spec(4, state(name="layers.0.kda", parts=KDA, NB=2))
    dst = spec(2, state(name="layers.0.kda", parts=KDA, NB=3))
    sbuf, before, exp, mw = run(src, dst, [[1]], [[2]], t)
    ps, pd = 208, 416
    starts_s, starts_d = [0, 48, 96, 144], [0, 96, 192, 288]
    for ss, ds, ub in zip(starts_s, starts_d, (24, 24, 24, 32), strict=True):
        n = 2 * ub
        for i in range(2):  # P rank 2t+i fills slot i of each part
            d0 = 2 * pd + ds + i * n
            assert np.array_equal(exp[0][d0 : d0 + n], sbuf[(2 * t + i, 0)][ps + ss : ps + ss + n])
    assert mw[0].sum() == pd
    assert_untouched_outside(exp, mw, before, t)


BC_REPL = (part("x", 16, 2), part("B", 2, 4), part("C", 2, 4))


@pytest.mark.parametrize("r", range(8))
def test_state_units_fewer_than_destination_ranks(r):
    # B and C have 2 groups: at TP8 ranks 0-3 hold group 0 and ranks 4-7 group 1.
    # P TP2 slot = 8*2 + 4 + 4 = 24 bytes; D TP8 slot = 2*2 + 4 + 4 = 12 bytes.
    src, dst = spec(2, state(parts=BC_REPL, NB=2)), spec(8, state(parts=BC_REPL, NB=2))
    sbuf, before, exp, mw = run(src, dst, [[1]], [[0]], r)
    p = sbuf[(r // 4, 0)]
    assert np.array_equal(exp[0][0:4], p[24 + (r % 4) * 4 : 24 + (r % 4) * 4 + 4])  # x
    assert np.array_equal(exp[0][4:8], p[24 + 16 : 24 + 20])  # B group r//4 = P local 0
    assert np.array_equal(exp[0][8:12], p[24 + 20 : 24 + 24])  # C
    other = sbuf[(1 - r // 4, 0)]
    assert not np.array_equal(exp[0][4:8], other[40:44])
    assert mw[0].sum() == 12 and mw[0][:12].all()
    assert_untouched_outside(exp, mw, before, r)


@pytest.mark.parametrize("t", range(2))
def test_state_units_fewer_than_source_ranks(t):
    # P TP8 (B group q//4 on rank q) -> D TP2 (B group t): any of P ranks 4t..4t+3 will do.
    src, dst = spec(8, state(parts=BC_REPL, NB=2)), spec(2, state(parts=BC_REPL, NB=2))
    sbuf, before, exp, mw = run(src, dst, [[0]], [[1]], t)
    for i in range(4):
        q = 4 * t + i
        assert np.array_equal(exp[0][24 + i * 4 : 24 + i * 4 + 4], sbuf[(q, 0)][0:4])  # x
        assert np.array_equal(exp[0][24 + 16 : 24 + 20], sbuf[(q, 0)][4:8])  # B
        assert np.array_equal(exp[0][24 + 20 : 24 + 24], sbuf[(q, 0)][8:12])  # C
    assert mw[0].sum() == 24 and mw[0][24:].all()
    assert_untouched_outside(exp, mw, before, t)


def test_state_requests_and_specs_refused():
    reg = state(parts=BC_REPL, NB=4)
    with pytest.raises(ValueError, match="length"):
        run(spec(2, reg), spec(2, reg), [[0, 1]], [[2]], 0)
    with pytest.raises(ValueError, match="parts"):
        run(spec(2, reg), spec(2, state(parts=BC_REPL[:2], NB=4)), [[0]], [[1]], 0)
    with pytest.raises(ValueError, match="mixes"):
        oracle.source_buffers(spec(1, reg, attn(NB=2, D=2, group=0)))
    with pytest.raises(ValueError):
        oracle.rank_block_nbytes(state(parts=[part("x", 3, 2)]), 2)  # 3 units over 2 ranks
    with pytest.raises(ValueError):
        oracle.normalize_region({**reg, "block_size": 1})


# ---------------------------------------------------------------------------------------------
# Shared pools: one allocation, one view per group (KimiLinear: MLA + KDA)
# ---------------------------------------------------------------------------------------------

# MLA view: bs 4, dim 8, bf16 -> 64-byte block on every rank. KDA view: q_conv 4 heads x 8 B,
# recurrent 4 heads x 4 B -> 48 B at TP1, 24 B at TP2, 12 B at TP4. Page = 64 everywhere.
POOL_KDA = (part("q_conv", 4, 8), part("recurrent", 4, 4))


def pool_mla(NB=6, **extra):
    return {**repl(name="layers.0.mla", dim=8, bs=4, NB=NB, group=0), "pool": "kv", **extra}


def pool_kda(NB=5, **extra):
    return state(name="layers.1.kda", parts=POOL_KDA, NB=NB, group=1, pool="kv", **extra)


def test_pool_sizes_and_shared_arrays():
    sp = spec(2, pool_mla(), pool_kda())
    assert oracle.page_nbytes(sp, 0) == oracle.page_nbytes(sp, 1) == 64
    assert oracle.rank_region_nbytes(sp["regions"][1], 2, sp) == 6 * 64
    assert oracle.rank_region_nbytes(pool_mla(NB=2), 2, spec(2, pool_mla(NB=2), pool_kda())) == (
        5 * 64
    )
    with pytest.raises(ValueError):
        oracle.rank_region_nbytes(pool_kda(), 2)  # pooled: needs the spec
    big = spec(1, pool_mla(page_bytes=100), pool_kda(page_bytes=100))
    assert oracle.page_nbytes(big, 1) == 100
    assert oracle.rank_region_nbytes(pool_kda(), 1, big) == 600
    for bufs in (oracle.source_buffers(sp), oracle.destination_buffers(sp)):
        assert set(bufs) == {(0, 0), (0, 1), (1, 0), (1, 1)}
        assert bufs[(0, 0)] is bufs[(0, 1)] and bufs[(1, 0)] is bufs[(1, 1)]
        assert bufs[(0, 0)] is not bufs[(1, 0)] and bufs[(0, 0)].size == 384


def test_clone_buffers_keeps_pools_shared():
    sp = spec(2, pool_mla(), pool_kda(), attn(name="a", K=2, D=2, bs=4, NB=2, group=2))
    bufs = oracle.destination_buffers(sp)
    one = oracle.clone_buffers(bufs, rank=1)
    assert set(one) == {(1, 0), (1, 1), (1, 2)}
    assert one[(1, 0)] is one[(1, 1)] and one[(1, 0)] is not bufs[(1, 0)]
    assert np.array_equal(one[(1, 0)], bufs[(1, 0)]) and np.array_equal(one[(1, 2)], bufs[(1, 2)])
    assert len(oracle.clone_buffers(bufs)) == 6


def test_pool_source_pages_follow_the_owning_view():
    sp = spec(2, pool_mla(), pool_kda())
    bufs = oracle.source_buffers(sp, seed=4, request_blocks=[[0, 3], [1, 4]])
    fill = oracle._pool_fill("kv", 4, 384)
    for q in range(2):
        b = bufs[(q, 0)]
        for page in (0, 2, 3, 5):  # MLA's pages (0, 3) and pages nobody lists (first region)
            for t in range(4):
                for f in range(8):
                    for k in range(2):
                        want = oracle.content_hash("layers.0.mla", 4, 0, page, t, 0, f, k)
                        assert b[page * 64 + (t * 8 + f) * 2 + k] == want
        for page in (1, 4):  # the KDA view: rank q holds heads 2q, 2q+1 of each part
            for u in range(2):
                for k in range(8):
                    want = oracle.state_hash("layers.1.kda", 4, 0, page, 2 * q + u, k)
                    assert b[page * 64 + u * 8 + k] == want
                for k in range(4):
                    want = oracle.state_hash("layers.1.kda", 4, 1, page, 2 * q + u, k)
                    assert b[page * 64 + 16 + u * 4 + k] == want
            assert np.array_equal(b[page * 64 + 24 : page * 64 + 64],
                                  fill[page * 64 + 24 : page * 64 + 64])  # padding
    with pytest.raises(ValueError, match="two"):
        oracle.source_buffers(sp, request_blocks=[[0, 3], [3]])


@pytest.mark.parametrize("r", range(4))
@pytest.mark.parametrize("dst_page", [None, 100])
def test_pool_mla_and_kda_tp2_to_tp4(r, dst_page):
    extra = {} if dst_page is None else {"page_bytes": dst_page}
    page = dst_page or 64
    src = spec(2, pool_mla(), pool_kda())
    dst = spec(4, pool_kda(**extra), pool_mla(**extra))  # destination order differs
    sbuf, before, exp, mw = run(src, dst, [[0, 3], [1, 4]], [[2, 5], [0, 3]], r)
    assert set(exp) == {0, 1} and exp[0] is exp[1] and exp[0].size == 6 * page
    e = exp[0]
    for q in range(2):  # MLA pages: the whole 64-byte block, any source rank
        assert np.array_equal(e[2 * page : 2 * page + 64], sbuf[(q, 0)][0:64])
        assert np.array_equal(e[5 * page : 5 * page + 64], sbuf[(q, 0)][192:256])
    src_q = sbuf[(r // 2, 1)]  # KDA: rank r's head r from P rank r//2, local head r%2
    for sb, db in [(1, 0), (4, 3)]:
        d0, s0 = db * page, sb * 64
        assert np.array_equal(e[d0 : d0 + 8], src_q[s0 + (r % 2) * 8 : s0 + (r % 2) * 8 + 8])
        assert np.array_equal(e[d0 + 8 : d0 + 12],
                              src_q[s0 + 16 + (r % 2) * 4 : s0 + 16 + (r % 2) * 4 + 4])
    assert mw[1].sum() == 128 and mw[1][2 * page : 2 * page + 64].all()
    assert mw[0].sum() == 24 and mw[0][0:12].all() and mw[0][3 * page : 3 * page + 12].all()
    assert not (mw[0] & mw[1]).any()
    both = mw[0] | mw[1]
    assert np.array_equal(e[~both], before[(r, 0)][~both])  # padding of KDA pages untouched


def test_pool_tp4_to_tp1_assembles_heads_in_the_page():
    src = spec(4, pool_mla(), pool_kda())
    dst = spec(1, pool_mla(NB=3), pool_kda(NB=3))
    sbuf, before, exp, mw = run(src, dst, [[0], [2, 1]], [[2], [0, 1]], 0)
    e = exp[0]
    for sb, db in [(2, 0), (1, 1)]:
        for q in range(4):
            assert np.array_equal(e[db * 64 + q * 8 : db * 64 + q * 8 + 8],
                                  sbuf[(q, 1)][sb * 64 : sb * 64 + 8])
            assert np.array_equal(e[db * 64 + 32 + q * 4 : db * 64 + 32 + q * 4 + 4],
                                  sbuf[(q, 1)][sb * 64 + 8 : sb * 64 + 12])
    assert np.array_equal(e[128:192], sbuf[(3, 0)][0:64])
    assert mw[0].sum() == 64 and mw[1].sum() == 96
    assert_untouched_outside(exp, mw, before, 0)


def test_pool_source_filled_without_the_request_is_ambiguous():
    # Spec order puts KDA first, so without request_blocks MLA's pages hold the KDA view, which
    # differs between P ranks: the oracle must refuse rather than pick one.
    src = spec(2, pool_kda(), pool_mla())
    dst = spec(2, pool_kda(), pool_mla())
    with pytest.raises(ValueError, match="replicas differ"):
        run(src, dst, [[0], [1]], [[0], [1]], 0, fill_by_request=False)
    run(src, dst, [[0], [1]], [[0], [1]], 0)  # fine with the request's pages


def test_pool_rules_refused():
    with pytest.raises(ValueError, match="joint"):
        oracle.normalize_region({**attn(), "pool": "kv"})
    with pytest.raises(ValueError, match="one group"):
        oracle.check_spec(spec(1, pool_mla(), {**repl(name="b", group=0), "pool": "kv"}))
    with pytest.raises(ValueError, match="smaller"):
        oracle.check_spec(spec(1, pool_mla(page_bytes=32), pool_kda(page_bytes=32)))
    with pytest.raises(ValueError, match="some regions"):
        oracle.check_spec(spec(1, pool_mla(page_bytes=64), pool_kda()))
    with pytest.raises(ValueError, match="stages"):
        oracle.check_spec(spec(1, pool_mla(), pool_kda(), pp=2))
    sp = spec(2, pool_mla(), pool_kda())
    with pytest.raises(ValueError, match="overlap"):
        run(sp, sp, [[0], [1]], [[3], [3]], 0)


# ---------------------------------------------------------------------------------------------
# Kernel blocks: logical block L = kernel blocks L*n .. L*n+n-1
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout,kv", [("NHD", "split"), ("HND", "split"), ("NHD", "joint"), ("HND", "joint")]
)
def test_kernel_block_offsets_by_hand_and_source_view(layout, kv):
    # K=2, D=3, bs 6, kernel 2 (n=3), NB 3 -> a region of 9 kernel blocks; float16, TP1.
    r = {**attn(name="k", K=2, D=3, bs=6, NB=3, dtype="float16", layout=layout, kv=kv),
         "kernel_block_size": 2}

    def hand(s, b, h, t, f):
        kb, tk = b * 3 + t // 2, t % 2
        if (kv, layout) == ("split", "NHD"):
            return ((((s * 9 + kb) * 2 + tk) * 2 + h) * 3 + f) * 2
        if (kv, layout) == ("split", "HND"):
            return ((((s * 9 + kb) * 2 + h) * 2 + tk) * 3 + f) * 2
        if (kv, layout) == ("joint", "NHD"):
            return ((((kb * 2 + s) * 2 + tk) * 2 + h) * 3 + f) * 2
        return ((((kb * 2 + s) * 2 + h) * 2 + tk) * 3 + f) * 2

    buf = oracle.source_buffers(spec(1, r), seed=2)[(0, 0)]
    assert buf.size == 2 * 3 * 6 * 2 * 3 * 2
    seen = set()
    for s in range(2):
        for b in range(3):
            for h in range(2):
                for t in range(6):
                    for f in range(3):
                        off = hand(s, b, h, t, f)
                        assert oracle.element_offset(r, 1, s, b, h, t, f) == off
                        for k in range(2):
                            want = oracle.content_hash("k", 2, s, b, t, h, f, k)
                            assert buf[off + k] == want
                        seen.add(off)
    assert len(seen) == buf.size // 2


def test_kernel_blocks_in_pool_offsets_by_hand():
    # joint NHD attention, bs 4, kernel 2, K=2, D=2, bf16 at TP1: block 64 B; a page of 80 B.
    a = {**attn(name="a", K=2, D=2, bs=4, NB=3, layout="NHD", kv="joint"),
         "kernel_block_size": 2, "pool": "p", "page_bytes": 80}
    m = {**repl(name="m", dim=5, bs=4, NB=3, group=1), "kernel_block_size": 1, "pool": "p",
         "page_bytes": 80}
    for s in range(2):
        for b in range(3):
            for t in range(4):
                for h in range(2):
                    for f in range(2):
                        want = b * 80 + (((((t // 2) * 2 + s) * 2 + t % 2) * 2 + h) * 2 + f) * 2
                        assert oracle.element_offset(a, 1, s, b, h, t, f, page_bytes=80) == want
    assert oracle.element_offset(m, 1, 0, 2, 0, 3, 4, page_bytes=80) == 160 + (3 * 5 + 4) * 2
    bufs = oracle.source_buffers(spec(1, a, m), seed=1, request_blocks=[[0, 2], [1]])
    b = bufs[(0, 0)]
    assert b.size == 240
    assert b[2 * 80 + ((((1 * 2 + 1) * 2 + 0) * 2 + 1) * 2 + 0) * 2] == oracle.content_hash(
        "a", 1, 1, 2, 2, 1, 0, 0)  # stream 1, block 2, token 2 = kernel 1 token 0, head 1
    assert b[80 + (3 * 5 + 4) * 2 + 1] == oracle.content_hash("m", 1, 0, 1, 3, 0, 4, 1)


@pytest.mark.parametrize("r", range(2))
@pytest.mark.parametrize("src_kbs,dst_bs,dst_kbs", [(2, 8, 4), (8, 8, 1), (4, 4, 2), (1, 16, 8)])
def test_kernel_blocks_differ_between_sides(r, src_kbs, dst_bs, dst_kbs):
    # HND split, K=2, D=4, float16; P bs 8 TP1 -> D TP2 (one head each).
    NB, D, e = 4, 4, 2
    src = spec(1, {**attn(K=2, D=D, bs=8, NB=NB, dtype="float16"), "kernel_block_size": src_kbs})
    dst = spec(2, {**attn(K=2, D=D, bs=dst_bs, NB=NB, dtype="float16"),
                   "kernel_block_size": dst_kbs})
    slist, dlist = [2, 0], [3, 1, 0, 2][: 16 // dst_bs]
    sbuf, before, exp, mw = run(src, dst, [slist], [dlist], r)
    n_s, n_d = 8 // src_kbs, dst_bs // dst_kbs
    written = set()
    for s in range(2):
        for p in range(16):
            sb, st = slist[p // 8], p % 8
            db, dt = dlist[p // dst_bs], p % dst_bs
            skb, dkb = sb * n_s + st // src_kbs, db * n_d + dt // dst_kbs
            so = ((((s * NB * n_s + skb) * 2 + r) * src_kbs + st % src_kbs) * D) * e
            do = ((((s * NB * n_d + dkb) * 1 + 0) * dst_kbs + dt % dst_kbs) * D) * e
            assert np.array_equal(exp[0][do : do + D * e], sbuf[(0, 0)][so : so + D * e])
            written.update(range(do, do + D * e))
    assert set(np.flatnonzero(mw[0]).tolist()) == written
    assert_untouched_outside(exp, mw, before, r)


@pytest.mark.parametrize("r", range(2))
def test_kernel_blocks_in_pool_across_sides(r):
    # P TP1: joint NHD attention bs 4 kernel 2 (64 B block) + a state view, page 64.
    # D TP2: the same attention without kernel blocks (32 B), state 8 B, explicit page 40.
    a = attn(name="a", K=2, D=2, bs=4, NB=3, layout="NHD", kv="joint")
    st_ = state(name="s", parts=[part("h", 2, 8)], NB=3, group=1, pool="p")
    src = spec(1, {**a, "kernel_block_size": 2, "pool": "p"}, st_)
    dst = spec(2, {**a, "pool": "p", "page_bytes": 40}, {**st_, "page_bytes": 40})
    sbuf, before, exp, mw = run(src, dst, [[1], [0]], [[2], [0]], r)
    p0 = sbuf[(0, 0)]
    for s in range(2):
        for t in range(4):
            for f in range(2):
                so = 64 + (((((t // 2) * 2 + s) * 2 + t % 2) * 2 + r) * 2 + f) * 2
                do = 80 + (((s * 4 + t) * 1 + 0) * 2 + f) * 2
                assert np.array_equal(exp[0][do : do + 2], p0[so : so + 2])
    assert np.array_equal(exp[1][0:8], p0[r * 8 : r * 8 + 8])
    assert mw[0].sum() == 32 and mw[1].sum() == 8 and exp[0] is exp[1]
    assert_untouched_outside(exp, mw, before, r)


# ---------------------------------------------------------------------------------------------
# Pipeline stages: flat ranks, each stage holds a contiguous range of regions
# ---------------------------------------------------------------------------------------------


def test_region_stages_by_hand():
    regs = [repl(name=f"m{i}", NB=1, dim=3) for i in range(7)]
    assert oracle.region_stages(spec(1, *regs[:5], pp=2)) == [0, 0, 0, 1, 1]
    assert oracle.region_stages(spec(1, *regs[:4], pp=3)) == [0, 0, 1, 2]
    assert oracle.region_stages(spec(1, *regs, pp=3)) == [0, 0, 0, 1, 1, 2, 2]
    assert oracle.region_stages(spec(1, *regs[:3])) == [0, 0, 0]
    explicit = [{**r, "stage": s} for r, s in zip(regs[:3], (0, 1, 1), strict=True)]
    assert oracle.region_stages(spec(1, *explicit, pp=2)) == [0, 1, 1]
    with pytest.raises(ValueError):
        oracle.region_stages(spec(1, explicit[0], regs[1], pp=2))
    with pytest.raises(ValueError):
        oracle.region_stages(spec(1, {**regs[0], "stage": 2}, pp=2))
    assert oracle.world_size(spec(3, *regs, pp=2)) == 6
    assert oracle.rank_regions(spec(2, *regs[:5], pp=2), 3) == [3, 4]


def five_layers(NB=3):
    return [attn(name=f"l{i}", K=4, D=2, bs=2, NB=NB) for i in range(5)]


@pytest.mark.parametrize("r", range(4))
def test_pp2_tp2_to_pp1_tp4(r):
    # P: stage 0 = l0..l2 on ranks 0,1; stage 1 = l3,l4 on ranks 2,3. D: one stage, TP4,
    # regions in reverse order. D rank r holds head r: P TP rank r//2, local head r%2.
    layers = five_layers()
    src, dst = spec(2, *layers, pp=2), spec(4, *layers[::-1])
    sbuf, before, exp, mw = run(src, dst, [[2, 0]], [[1, 2]], r)
    assert set(sbuf) == {(q, i) for q in (0, 1) for i in (0, 1, 2)} | {
        (q, i) for q in (2, 3) for i in (3, 4)}
    assert set(exp) == set(range(5))
    for j in range(5):
        i = 4 - j
        src_rank = (0 if i < 3 else 2) + r // 2
        for s in range(2):
            for sb, db in [(2, 1), (0, 2)]:
                d0, s0 = (s * 3 + db) * 8, (s * 3 + sb) * 16 + (r % 2) * 8
                assert np.array_equal(exp[j][d0 : d0 + 8], sbuf[(src_rank, i)][s0 : s0 + 8])
        assert mw[j].sum() == 2 * 2 * 8
    assert_untouched_outside(exp, mw, before, r)


@pytest.mark.parametrize("q", range(4))
def test_pp1_tp4_to_pp2_tp2(q):
    # D: stage q//2, TP rank t = q%2 holds heads 2t, 2t+1 of its stage's layers, reading
    # whole head slices from P ranks 2t+i into slot i.
    layers = five_layers()
    src, dst = spec(4, *layers), spec(2, *layers, pp=2)
    sbuf, before, exp, mw = run(src, dst, [[0, 1]], [[2, 0]], q)
    held = [0, 1, 2] if q < 2 else [3, 4]
    assert set(exp) == set(mw) == set(held)
    assert {j for (rank, j) in before if rank == q} == set(held)
    t = q % 2
    for j in held:
        for s in range(2):
            for sb, db in [(0, 2), (1, 0)]:
                for i in range(2):
                    d0, s0 = (s * 3 + db) * 16 + i * 8, (s * 3 + sb) * 8
                    assert np.array_equal(exp[j][d0 : d0 + 8], sbuf[(2 * t + i, j)][s0 : s0 + 8])
        assert mw[j].sum() == 2 * 2 * 16
    assert_untouched_outside(exp, mw, before, q)


@pytest.mark.parametrize("q", range(4))
def test_pp_explicit_stages_with_a_pool_and_hetero_tp(q):
    # P: PP2 x TP1, explicit stages: stage 0 = attention l0 (group 2); stage 1 = the MLA/KDA
    # pool. D: PP2 x TP2 positional: 3 regions -> stage 0 = [kda, mla] (the pool), stage 1 =
    # [l0]. Flat P ranks: 0 = stage 0, 1 = stage 1.
    l0 = attn(name="l0", K=2, D=2, bs=4, NB=3, group=2)
    src = spec(1, {**l0, "stage": 0}, {**pool_mla(), "stage": 1}, {**pool_kda(), "stage": 1},
               pp=2)
    dst = spec(2, pool_kda(), pool_mla(), l0, pp=2)
    sbuf, before, exp, mw = run(src, dst, [[0, 3], [1], [2]], [[4, 5], [2], [1]], q)
    assert set(sbuf) == {(0, 0), (1, 1), (1, 2)}
    t = q % 2
    if q < 2:
        assert set(exp) == {0, 1} and exp[0] is exp[1]
        pk = sbuf[(1, 2)]
        assert pk is sbuf[(1, 1)]
        # KDA at D TP2: q_conv 2 x 8 B then recurrent 2 x 4 B (24 B in a 64 B page);
        # at P TP1: q_conv 4 x 8 B then recurrent 4 x 4 B. P slot 1 -> D slot 2.
        assert np.array_equal(exp[0][128 : 128 + 16], pk[64 + t * 16 : 64 + t * 16 + 16])
        assert np.array_equal(exp[0][144 : 144 + 8], pk[64 + 32 + t * 8 : 64 + 32 + t * 8 + 8])
        assert np.array_equal(exp[1][256:320], pk[0:64])
        assert np.array_equal(exp[1][320:384], pk[192:256])
        assert mw[0].sum() == 24 and mw[1].sum() == 128
    else:
        assert set(exp) == {2}
        for s in range(2):  # head t of P block 2 (HND, 2 heads x 16 B) -> D block 1
            d0, s0 = (s * 3 + 1) * 16, (s * 3 + 2) * 32 + t * 16
            assert np.array_equal(exp[2][d0 : d0 + 16], sbuf[(0, 0)][s0 : s0 + 16])
        assert mw[2].sum() == 32
    assert_untouched_outside(exp, mw, before, q)
