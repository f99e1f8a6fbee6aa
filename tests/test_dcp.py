"""Decode context parallelism: token-sharded ranks on either side, planned by the one rule.

Properties against the oracle (which derives who holds a token from vLLM's slot mapping on its
own) over DCP settings on each side, with token ranges; worked cases of vLLM PR 50611 and the
refusals.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvplan.strategies as ks
from kvplan import EngineSpec, SpecError, pull_map, push_map
from kvplan.placement import TokenSharding
from tests.test_ranges import check_against_oracle

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def dcp_cases(draw, **kw):
    src_d, dst_d = draw(ks.dcp_spec_pairs(**kw))
    return (src_d, dst_d, *draw(ks.token_requests(src_d, dst_d)))


@SETTINGS
@given(dcp_cases(max_groups=1))
def test_dcp_pairs_copy_exactly_the_oracle_bytes(case):
    check_against_oracle(*case)


@settings(SETTINGS, max_examples=30)
@given(dcp_cases(state=False, pools=False, max_pp=1))
def test_dcp_push_equals_pull(case):
    src_d, dst_d, sb, db, tokens, dst_from = case
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    rows = lambda plans: sorted(tuple(x) for p in plans for x in p.copies().tolist())  # noqa: E731
    pulls = [pull_map(src, dst, r).plan(sb, db, tokens=tokens, dst_from=dst_from)
             for r in range(dst.num_ranks)]
    pushes = [push_map(src, dst, r).plan(sb, db, tokens=tokens, dst_from=dst_from)
              for r in range(src.num_ranks)]
    assert rows(pulls) == rows(pushes)


def mla(bs=16, nb=16, name="l0.mla"):
    return {"name": name, "kind": "mla", "num_blocks": nb, "block_size": bs,
            "dtype": "bfloat16", "dim": 576}


def attn(heads, bs=16, nb=16, name="l0.attn"):
    return {"name": name, "kind": "attention", "num_blocks": nb, "block_size": bs,
            "dtype": "bfloat16", "num_kv_heads": heads, "head_dim": 8}


def spec(tp, *regions, dcp=1, il=1):
    d = {"tp_size": tp, "regions": list(regions)}
    if dcp > 1:
        d.update(dcp_size=dcp, dcp_interleave=il)
    return d


def test_pr_50611_p_dcp4_to_d_dcp2_reads_p0_p2_into_d0():
    s, d = spec(4, mla(), dcp=4), spec(2, mla(), dcp=2)
    src, dst = EngineSpec.from_dict(s), EngineSpec.from_dict(d)
    assert pull_map(src, dst, 0).peers == (0, 2)
    assert pull_map(src, dst, 1).peers == (1, 3)
    sb, db = [[3, 1, 5]], [[2, 7, 0, 4, 9, 6]]  # 3 x 64 positions = 6 x 32
    assert check_against_oracle(s, d, sb, db) > 0
    assert check_against_oracle(s, d, sb, db, tokens=(5, 150)) > 0


@pytest.mark.parametrize(("s", "d"), [
    (spec(4, mla(), dcp=4, il=1), spec(1, mla())),          # DCP on the source only
    (spec(2, mla()), spec(8, mla(), dcp=8, il=4)),          # DCP on the destination only
    (spec(8, attn(2), dcp=4, il=16), spec(4, attn(2), dcp=2, il=8)),  # GQA, interleaves differ
    (spec(8, attn(4, bs=32), mla(bs=32), dcp=2, il=8), spec(2, attn(4, bs=16), mla(bs=16))),
])
def test_dcp_settings_on_each_side(s, d):
    src, dst = EngineSpec.from_dict(s), EngineSpec.from_dict(d)
    vs, vd = src.positions_per_block(0), dst.positions_per_block(0)
    n = 2 * max(vs, vd)  # positions: whole block ids on both sides
    sb, db = [list(range(n // vs))[::-1]], [list(range(n // vd))]
    assert check_against_oracle(s, d, sb, db) > 0
    assert check_against_oracle(s, d, sb, db, tokens=(7, n - 5)) > 0


def test_each_destination_byte_is_read_once_and_ranks_share_the_load():
    s, d = spec(8, attn(2), dcp=4, il=2), spec(2, attn(2))
    src, dst = EngineSpec.from_dict(s), EngineSpec.from_dict(d)
    for r in range(dst.num_ranks):
        m = pull_map(src, dst, r)
        c = m.plan([[0, 1, 2, 3]], [list(range(8))]).copies()
        # head r of D is held by P ranks 4r..4r+3, one per DCP rank: all four are read
        assert m.peers == tuple(range(4 * r, 4 * r + 4))
        per_peer = [int(c[c["src_rank"] == p]["length"].sum()) for p in m.peers]
        assert len(set(per_peer)) == 1


def test_token_sharding_matches_vllm_slot_mapping():
    t = TokenSharding(block_size=16, dcp=4, interleave=2)
    o = np.arange(64)
    assert t.holder(o).tolist()[:10] == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0]
    for rank in range(4):
        local = t.local(o[t.holder(o) == rank])
        assert local.tolist() == list(range(16))  # each rank fills its block densely


@pytest.mark.parametrize(("d", "error", "match"), [
    (spec(6, mla(), dcp=4), SpecError, r"dcp_size 4 does not divide tp_size 6"),
    (spec(4, attn(4), dcp=2), SpecError,
     r"region 'l0.attn': dcp_size 2 needs every DCP group to hold the same heads"),
    (spec(4, mla(bs=16), dcp=2, il=3), SpecError,
     r"region 'l0.mla': dcp_interleave 3 does not divide block_size 16 \(16 % 3 = 1\): "
     r"vLLM's slot mapping would give DCP rank 0 17 of a kernel block's 32 positions, 1 past"),
    ({"tp_size": 2, "dcp_size": 0, "regions": [mla()]}, SpecError,
     r"dcp_size must be a positive integer"),
])
def test_dcp_refusals(d, error, match):
    with pytest.raises(error, match=match):
        EngineSpec.from_dict(d)


def test_positions_per_block_id_need_not_divide():
    """48 positions per source block id (16 x dcp 3) against 32 (16 x dcp 2): granules of 16."""
    s, d = spec(6, mla(bs=16), dcp=3), spec(2, mla(bs=16), dcp=2)
    sb, db = [[3, 1, 5, 0]], [[2, 7, 0, 4, 9, 6]]  # 4 x 48 = 6 x 32 positions
    assert check_against_oracle(s, d, sb, db) == 192 * 576 * 2  # each position once, one rank
    assert check_against_oracle(s, d, sb, db, tokens=(5, 170)) > 0


def test_spec_round_trip_and_str():
    s = EngineSpec.from_dict(spec(4, mla(), dcp=4, il=8))
    assert EngineSpec.from_dict(s.to_dict()) == s
    assert s.to_dict()["dcp_size"] == 4 and s.to_dict()["dcp_interleave"] == 8
    assert "dcp=4 interleave 8" in str(s)
    assert "dcp_size" not in EngineSpec.from_dict(spec(4, mla())).to_dict()


def test_oracle_fills_dcp_ranks_by_vllms_slot_mapping():
    """Third derivation: vLLM's slot mapping, written out here, against the oracle's buffers."""
    from tests import oracle

    bs, dcp, il, nb = 4, 4, 2, 3
    region = {**mla(bs=bs, nb=nb), "dim": 2, "dtype": "uint8"}
    s = spec(4, region, dcp=dcp, il=il)
    bufs = oracle.source_buffers(s, seed=9)
    for b in range(nb):
        for p in range(bs * dcp):  # offset in block id b
            rank = (p // il) % dcp
            slot = b * bs + (p // (dcp * il)) * il + p % il  # block_numbers * bs + offset
            got = bufs[(rank, 0)].reshape(-1, 2)[slot]
            want = oracle.content_hash("l0.mla", 9, 0, b, p, 0, np.arange(2), 0)
            assert np.array_equal(got, want), (b, p)


def test_map_summary_names_the_token_share():
    src = EngineSpec.from_dict(spec(4, mla(), dcp=4))
    dst = EngineSpec.from_dict(spec(2, mla(), dcp=2))
    text = pull_map(src, dst, 1).summary()
    assert "DCP source 4 (interleave 1), destination 2 (interleave 1)" in text
    # D1 holds 16 of a block id's 32 positions; P3 holds 8 of those: 8 x 576 x 2 bytes
    assert ("p3 -> d1  l0.mla: DCP 1/2 (positions 1:2 of every 2), K, 9216 B and 8 runs per "
            "block id (32 positions), tokens of p-DCP rank 3 held by d-DCP rank 1") in text


def _vllm_slot_mapping(positions, block_table, kernel_bs, dcp, il, dcp_rank):
    """vLLM's ``_compute_slot_mapping_kernel`` (``vllm/v1/worker/block_table.py``; the block
    table holds kernel block ids, ``map_to_kernel_blocks``), written out in numpy: the slot of
    each position on DCP rank ``dcp_rank``, -1 where the position is not that rank's."""
    virtual = kernel_bs * dcp
    block_numbers = block_table[positions // virtual]
    offsets = positions - (positions // virtual) * virtual
    is_local = (offsets // il) % dcp == dcp_rank
    local = (offsets // (dcp * il)) * il + offsets % il
    return np.where(is_local, block_numbers * kernel_bs + local, -1)


@pytest.mark.parametrize(("bs", "kbs", "dcp", "il"), [
    (16, 16, 2, 1), (16, 16, 4, 4), (32, 16, 2, 8), (64, 16, 4, 16), (48, 16, 2, 2)])
def test_token_sharding_is_vllms_slot_mapping_with_kernel_blocks(bs, kbs, dcp, il):
    """Where the interleave divides the kernel block, kvplan's TokenSharding over logical blocks
    puts every position on the rank and at the slot vLLM's slot mapping does."""
    spec_ = EngineSpec.from_dict(spec(dcp, {**mla(bs=bs), "kernel_block_size": kbs},
                                      dcp=dcp, il=il))
    n = bs // kbs
    logical = np.array([5, 2, 7])
    kernel_table = (logical[:, None] * n + np.arange(n)).ravel()  # map_to_kernel_blocks
    pos = np.arange(len(logical) * bs * dcp)
    t = TokenSharding(bs, dcp, il)
    o = pos % (bs * dcp)
    for rank in range(dcp):
        vllm = _vllm_slot_mapping(pos, kernel_table, kbs, dcp, il, rank)
        mine = t.holder(o) == rank
        assert np.array_equal(vllm >= 0, mine)
        kv_slot = logical[pos // (bs * dcp)] * bs + t.local(o)  # logical block x its tokens
        assert np.array_equal(vllm[mine], kv_slot[mine])
    assert spec_.dcp_interleave == il


@pytest.mark.parametrize(("kbs", "dcp", "il", "rank0"), [(16, 2, 64, 32), (16, 2, 6, 18),
                                                         (16, 4, 32, 32), (8, 2, 3, 9)])
def test_interleave_not_dividing_the_kernel_block_degenerates_in_vllm_and_is_refused(
        kbs, dcp, il, rank0):
    """vLLM's formula with I not dividing the kernel block: DCP rank 0 gets more than a block's
    tokens (all of them when I >= kernel block x DCP) and writes past its kernel block into the
    next one; kvplan refuses such a spec, naming the count."""
    pos = np.arange(kbs * dcp)
    slots = _vllm_slot_mapping(pos, np.array([0, 1]), kbs, dcp, il, 0)
    held = slots[slots >= 0]
    assert len(held) == rank0 > kbs and held.max() >= kbs  # spills into kernel block 1
    if il >= kbs * dcp:
        assert len(held) == kbs * dcp  # every position on rank 0
    with pytest.raises(SpecError, match=rf"dcp_interleave {il} does not divide "
                       rf"(kernel_)?block_size {kbs} .*DCP rank 0 {rank0} of a kernel block's "
                       rf"{kbs * dcp} positions, {rank0 - kbs} past"):
        EngineSpec.from_dict(spec(dcp, {**mla(bs=2 * kbs), "kernel_block_size": kbs},
                                  dcp=dcp, il=il))
