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


def spec(tp, *regions):
    return {"tp_size": tp, "regions": list(regions)}


def run(src, dst, src_blocks, dst_blocks, rank):
    sbuf = oracle.source_buffers(src)
    before = oracle.destination_buffers(dst)
    exp, mw = oracle.expected_destination(src, dst, src_blocks, dst_blocks, rank, sbuf, before)
    return sbuf, before, exp, mw


def assert_untouched_outside(exp, mw, before, rank):
    for j in exp:
        assert np.array_equal(exp[j][~mw[j]], before[(rank, j)][~mw[j]])


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
