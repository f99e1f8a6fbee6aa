"""Table-driven plans with numbers worked out by hand from domain.md, and request refusals."""

import numpy as np
import pytest

from kvplan import EngineSpec, Mode, RequestError, pull_map, push_map

NB = 8


def engine(tp, **kw):
    r = {"name": "attn", "kind": "attention", "num_blocks": NB, "block_size": 16,
         "dtype": "bfloat16", "num_kv_heads": 8, "head_dim": 128}
    r.update(kw)
    return EngineSpec.from_dict({"tp_size": tp, "regions": [r]})


def mla_engine(tp, **kw):
    r = {"name": "mla", "kind": "mla", "num_blocks": NB, "block_size": 16, "dtype": "bfloat16",
         "dim": 576}
    r.update(kw)
    return EngineSpec.from_dict({"tp_size": tp, "regions": [r]})


def rows(plan):
    c = plan.copies()
    return [tuple(int(x) for x in row) for row in c[["src_rank", "src_offset", "dst_offset",
                                                     "length"]]]


def test_domain_example_p_tp2_to_d_tp4():
    # domain.md s.3: each stream block is 8192 B on D; D rank r reads P rank r//2 at offset
    # (r%2)*8192, length 8192. P ranks hold 4 heads: 16384 B per stream block.
    src, dst = engine(2), engine(4)
    for r in range(4):
        plan = pull_map(src, dst, r).plan([[5]], [[2]])
        k_src, v_src = 5 * 16384 + (r % 2) * 8192, NB * 16384 + 5 * 16384 + (r % 2) * 8192
        assert rows(plan) == [
            (r // 2, k_src, 2 * 8192, 8192),
            (r // 2, v_src, NB * 8192 + 2 * 8192, 8192),
        ]


def test_domain_example_p_tp4_to_d_tp2_places_slots():
    # T < R: D rank t reads whole blocks from P ranks 2t, 2t+1 and puts the i-th at slot i.
    src, dst = engine(4), engine(2)  # P: 2 heads = 8192 B per stream block; D: 16384 B
    plan = pull_map(src, dst, 1).plan([[3]], [[6]])
    assert rows(plan) == [
        (2, 3 * 8192, 6 * 16384, 8192),
        (2, NB * 8192 + 3 * 8192, NB * 16384 + 6 * 16384, 8192),
        (3, 3 * 8192, 6 * 16384 + 8192, 8192),
        (3, NB * 8192 + 3 * 8192, NB * 16384 + 6 * 16384 + 8192, 8192),
    ]


@pytest.mark.parametrize(("big", "small"), [(8, 2), (2, 8), (4, 4)])
def test_mla_reads_whole_block_key_only_from_t_r_over_t(big, small):
    blk = 16 * 576 * 2
    for src_tp, dst_tp in [(big, small), (small, big)]:
        for t in range(dst_tp):
            plan = pull_map(mla_engine(src_tp), mla_engine(dst_tp), t).plan([[1]], [[4]])
            assert rows(plan) == [(t * src_tp // dst_tp, blk, 4 * blk, blk)]


def test_consecutive_blocks_merge_into_one_run():
    # Same TP, joint HND: a block is one contiguous run on both sides; 3 consecutive ids on
    # both sides become one run, the fourth (not consecutive) its own.
    src = dst = engine(2, kv="joint")
    blk = 2 * 4 * 16 * 256
    plan = pull_map(src, dst, 0).plan([[1, 2, 3, 7]], [[4, 5, 6, 0]])
    assert rows(plan) == [(0, 7 * blk, 0, blk), (0, 1 * blk, 4 * blk, 3 * blk)]


def test_blocks_consecutive_in_memory_but_reversed_in_the_request_still_merge():
    src = dst = engine(1, kv="joint")
    blk = 2 * 8 * 16 * 256
    plan = pull_map(src, dst, 0).plan([[3, 2]], [[6, 5]])
    assert rows(plan) == [(0, 2 * blk, 5 * blk, 2 * blk)]


def test_nhd_under_hetero_tp_is_one_run_per_token():
    src, dst = engine(2, layout="NHD"), engine(4, layout="NHD")
    plan = pull_map(src, dst, 1).plan([[0]], [[0]])
    # D rank 1 holds heads 2,3 = the second half of P rank 0's 4 heads, per token.
    c = plan.copies()
    assert len(c) == 2 * 16
    k = c[:16]
    assert (k["src_offset"] == np.arange(16) * 4 * 256 + 2 * 256).all()
    assert (k["dst_offset"] == np.arange(16) * 2 * 256).all()
    assert (c["length"] == 512).all()


def test_destination_block_spanning_two_source_blocks():
    # P block 16, D block 32, same TP, HND: each D head-run is two 16-token pieces.
    src, dst = engine(1, block_size=16), engine(1, block_size=32)
    plan = pull_map(src, dst, 0).plan([[2, 5]], [[1]])
    c = plan.copies()
    head_s, head_d = 16 * 256, 32 * 256
    k = c[c["dst_offset"] < NB * 8 * head_d]
    assert len(k) == 16  # 8 heads x 2 source blocks
    first = k[k["dst_offset"] == 1 * 8 * head_d]
    assert (int(first["src_offset"][0]), int(first["length"][0])) == (2 * 8 * head_s, head_s)
    second = k[k["dst_offset"] == 1 * 8 * head_d + head_s]
    assert int(second["src_offset"][0]) == 5 * 8 * head_s


def test_source_block_spanning_two_destination_blocks():
    src, dst = engine(1, block_size=32), engine(1, block_size=16)
    plan = pull_map(src, dst, 0).plan([[3]], [[6, 2]])
    c = plan.copies()
    k = c[(c["dst_offset"] // (8 * 16 * 256)) == 2]  # D block 2 holds tokens 16..31
    assert int(k["src_offset"].min()) == 3 * 8 * 32 * 256 + 16 * 256
    assert c["length"].sum() == 2 * 2 * 8 * 16 * 256


def test_sliding_window_copies_only_the_tail():
    # window 20, block 16: the last (20 // 16 + 1) * 16 = 32 positions of the covered range.
    src = dst = engine(1, window=20, kv="joint")
    plan = pull_map(src, dst, 0).plan([[0, 1, 2, 3]], [[4, 5, 6, 7]])
    blk = 2 * 8 * 16 * 256
    assert rows(plan) == [(0, 2 * blk, 6 * blk, 2 * blk)]


def test_uncovered_tail_is_left_alone():
    # D lists 3 blocks, P only 2: only positions 0..31 are copied.
    src = dst = engine(1, kv="joint")
    plan = pull_map(src, dst, 0).plan([[0, 1]], [[4, 5, 6]])
    assert plan.nbytes == 2 * 2 * 8 * 16 * 256


def test_partial_block_is_cut_per_token():
    # P block 16, D block 32 with three P blocks: D's second block holds only tokens 0..15.
    src, dst = engine(1, block_size=16, kv="joint"), engine(1, block_size=32, kv="joint")
    plan = pull_map(src, dst, 0).plan([[0, 1, 2]], [[0, 1]])
    assert plan.nbytes == 3 * 2 * 8 * 16 * 256


def test_empty_request_is_an_empty_plan():
    plan = pull_map(engine(2), engine(4), 0).plan([[]], [[]])
    assert len(plan) == 0 and plan.nbytes == 0 and plan.peers == ()


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks", "words"),
    [
        ([[1]], [[1], [2]], ["destination", "2 lists", "1 KV-cache group"]),
        ([[1, 8]], [[1, 2]], ["source group 0", "block id 8", "position 1", "[0, 8)", "'attn'"]),
        ([[1]], [[-2]], ["destination group 0", "block id -2"]),
        ([[1, 1]], [[1, 2]], ["source group 0", "block id 1 appears twice"]),
        ([[1.5]], [[1]], ["source group 0", "integers"]),
        ([1, 2], [[1, 2]], ["source", "2 lists"]),
        ("ab", [[1]], ["source"]),
    ],
)
def test_request_errors_name_group_and_id(src_blocks, dst_blocks, words):
    with pytest.raises(RequestError) as e:
        pull_map(engine(2), engine(2), 0).plan(src_blocks, dst_blocks)
    assert isinstance(e.value, ValueError)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_plans_are_immutable_comparable_values():
    m = pull_map(engine(2), engine(4), 0)
    a, b = m.plan([[1, 2]], [[3, 4]]), m.plan([[1, 2]], [[3, 4]])
    assert a == b and a is not b
    assert a != m.plan([[1, 2]], [[3, 5]])
    assert m == pull_map(engine(2), engine(4), 0)
    assert m != push_map(engine(2), engine(4), 0)
    with pytest.raises(ValueError):
        a.copies()["length"][0] = 1
    with pytest.raises(ValueError):
        a.dst_blocks[0][0] = 1
    assert m.mode is Mode.PULL and "pull" in repr(a) and "runs=4" in repr(a)


def test_push_map_of_a_source_rank_covers_every_destination_it_serves():
    # MLA with D TP > P TP: every D rank must receive the blocks (PR 49762).
    src, dst = mla_engine(2), mla_engine(8)
    targets = {r: push_map(src, dst, r).plan([[1]], [[2]]).peers for r in range(2)}
    assert targets == {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}


def test_summary_names_peers_regions_and_placements():
    src = EngineSpec.from_dict({"tp_size": 4, "regions": [
        {"name": "attn", "kind": "attention", "num_blocks": 8, "block_size": 16,
         "dtype": "bfloat16", "num_kv_heads": 8, "head_dim": 128},
        {"name": "mla", "kind": "mla", "num_blocks": 8, "block_size": 16, "dtype": "bfloat16",
         "dim": 576}]})
    dst = EngineSpec.from_dict(dict(src.to_dict(), tp_size=2))
    text = pull_map(src, dst, 1).plan([[0, 1]], [[2, 3]]).summary()
    assert "pull d1" in text and "p2:" in text and "p3:" in text
    assert "attn: S(heads 4:6) K+V" in text and "mla: R K, 36.0 KiB in 1 runs" in text


def test_granule_divides_every_run():
    src, dst = engine(2, layout="NHD"), engine(4)
    m = pull_map(src, dst, 1)
    g = m.granule("attn")
    c = m.plan([[0, 3, 4]], [[7, 1, 2]]).copies()
    assert g > 0
    for f in ("src_offset", "dst_offset", "length"):
        assert (c[f] % g == 0).all()


def test_maps_and_plans_survive_pickle_as_read_only_values():
    import pickle

    m = pull_map(engine(4), engine(2), 1)
    p = m.plan([[1, 2]], [[3, 4]])
    m2, p2 = pickle.loads(pickle.dumps(m)), pickle.loads(pickle.dumps(p))
    assert m2 == m and p2 == p and p2.summary() == p.summary()
    assert not p2.copies().flags.writeable and not p2.dst_blocks[0].flags.writeable
    assert not m2.lanes[0].templates[0].src.flags.writeable
    assert m2.plan([[1, 2]], [[3, 4]]) == p


def _bytes(plan):
    """Every copied byte of a plan as rows (source rank, source offset, destination offset)."""
    c = plan.copies()
    n = c["length"]
    run = np.repeat(np.arange(len(c)), n)
    off = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    return np.stack([c["src_rank"][run], c["src_offset"][run] + off,
                     c["dst_offset"][run] + off], axis=1)


@pytest.mark.parametrize("stp,dtp,bs", [(1, 1, 16), (2, 4, 16), (4, 2, 16), (1, 2, 8), (2, 1, 32)])
def test_absent_blocks_are_neither_read_nor_written(stp, dtp, bs):
    """ABSENT (-1) drops exactly the bytes of that block position: the plan copies the full
    plan's bytes less those read from the absent source block or written to the absent
    destination block."""
    from kvplan import ABSENT

    src, dst = engine(stp, head_dim=8), engine(dtp, block_size=bs, head_dim=8)
    # one stream's block (K and V are split: block b of stream s at (s * NB + b) * page)
    s_page, d_page = 16 * (8 // stp) * 8 * 2, bs * (8 // dtp) * 8 * 2
    s_ids, d_ids = [3, 7, 6, 2], [0, 1, 2, 5, 6, 3, 4, 7][: 64 // bs]
    for d in range(dtp):
        m = pull_map(src, dst, d)
        full = _bytes(m.plan([s_ids], [d_ids]))
        for hole_src, hole_dst in ((1, None), (None, 1), (0, 0)):
            s2, d2 = list(s_ids), list(d_ids)
            gone_src = gone_dst = -2
            if hole_src is not None:
                gone_src, s2[hole_src] = s_ids[hole_src], ABSENT
            if hole_dst is not None:
                gone_dst, d2[hole_dst] = d_ids[hole_dst], ABSENT
            keep = ((full[:, 1] // s_page) % NB != gone_src) & \
                ((full[:, 2] // d_page) % NB != gone_dst)
            want = full[keep]
            got = _bytes(m.plan([s2], [d2]))
            assert 0 < len(got) < len(full)
            order = np.lexsort(got.T[::-1])
            np.testing.assert_array_equal(got[order], want[np.lexsort(want.T[::-1])])
