"""Prefill context parallelism: PCP replicas and sharded PCP + DCP, against the oracle.

vLLM 0.33 (docs/concepts.md): ranks PP x PCP x TP; every PCP rank holds a full replica of its
stage's cache (``v1/attention/ops/pcp.py`` all-gathers the KV; ``block_table.py``: only DCP
shards the cache), only PCP rank 0 publishes and sends (``nixl/connector.py``); with TP 1 and
PCP = DCP the PCP ranks hold distinct DCP shards and each serves its own. The oracle derives who
holds what from those rules on its own (tests/oracle.py).
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvplan.strategies as ks
from kvplan import EngineSpec, SpecError, held_heads, pull_map, push_map
from kvplan.cp import cp_label, dcp_rank, pcp_rank, stage_base, tp_rank
from tests.test_ranges import check_against_oracle, copy_rows, pulls_and_pushes

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def mla(bs=16, nb=12, name="l0.mla"):
    return {"name": name, "kind": "mla", "num_blocks": nb, "block_size": bs, "dtype": "uint8",
            "dim": 6}


def attn(heads=4, bs=16, nb=12, name="l0.attn"):
    return {"name": name, "kind": "attention", "num_blocks": nb, "block_size": bs,
            "dtype": "bfloat16", "num_kv_heads": heads, "head_dim": 4}


def state(nb=6):
    return {"name": "l1.state", "kind": "state", "num_blocks": nb, "dtype": "bfloat16",
            "group": 1, "parts": [{"name": "x", "units": 4, "unit_bytes": 6}]}


def spec(tp, *regions, pcp=1, dcp=1, il=1, pp=1):
    d = {"tp_size": tp, "regions": list(regions)}
    for k, v in (("pcp_size", pcp), ("dcp_size", dcp), ("pp_size", pp)):
        if v > 1:
            d[k] = v
    if dcp > 1:
        d["dcp_interleave"] = il
    return d


SB, DB = [[3, 1, 5, 7], [2, 0]], [[2, 7, 0, 4, 9, 6, 11, 8], [5, 1]]


def test_rank_order_is_pp_pcp_tp():
    s = EngineSpec.from_dict(spec(2, mla(), mla(name="l1.mla"), pcp=3, pp=2))
    assert s.num_ranks == 12
    assert [(tp_rank(s, r), pcp_rank(s, r), r // 6) for r in (0, 1, 2, 5, 6, 11)] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 2, 0), (0, 0, 1), (1, 2, 1)]
    assert s.regions_on(5) == (0,) and s.regions_on(6) == (1,)
    assert stage_base(s, 1, 2) == 10
    assert EngineSpec.from_dict(s.to_dict()) == s and s.to_dict()["pcp_size"] == 3
    assert "pcp=3 replicated" in str(s)


@pytest.mark.parametrize(("d", "match"), [
    (spec(2, mla(), pcp=2, dcp=2), r"pcp_size 2 with dcp_size 2 over tp_size 2: vLLM 0.33 "
                                   r"stores PCP with DCP only as sharded PCP"),
    (spec(1, mla(), pcp=2, dcp=4), r"pcp_size 2 with dcp_size 4 over tp_size 1"),
    (spec(1, mla(), pcp=4, dcp=2), r"pcp_size 4 with dcp_size 2 over tp_size 1"),
    (spec(1, mla(), dcp=2), r"dcp_size 2 does not divide tp_size 1"),
    ({"tp_size": 1, "pcp_size": 0, "regions": [mla()]}, r"pcp_size must be a positive integer"),
])
def test_combinations_no_engine_stores_are_refused(d, match):
    with pytest.raises(SpecError, match=match):
        EngineSpec.from_dict(d)


@pytest.mark.parametrize("dst_tp", [1, 2, 4])
def test_replicated_pcp_source_pull_spreads_over_replicas(dst_tp):
    s, d = spec(1, attn(), mla(), state(), pcp=4), spec(dst_tp, attn(), mla(), state())
    assert check_against_oracle(s, d, SB, DB) > 0
    assert check_against_oracle(s, d, SB, DB, tokens=(5, 60)) > 0
    src, dst = EngineSpec.from_dict(s), EngineSpec.from_dict(d)
    maps = [pull_map(src, dst, r) for r in range(dst_tp)]
    for j in range(3):  # per region, the readers spread evenly over the 4 replicas
        load = Counter(x.src_rank for m in maps for x in m.lanes if x.dst_region == j)
        counts = [load[q] for q in range(4)]
        assert max(counts) - min(counts) <= 1 and sum(counts) >= dst_tp, (j, counts)
    vllm = [pull_map(src, dst, r, spread_pcp=False).peers for r in range(dst_tp)]
    assert vllm == [(0,)] * dst_tp  # vLLM reads replica 0


def test_replicated_pcp_push_sends_from_replica_zero_only():
    s, d = spec(2, attn(), mla(), pcp=2), spec(4, attn(), mla())
    src, dst = EngineSpec.from_dict(s), EngineSpec.from_dict(d)
    pushes = [push_map(src, dst, r) for r in range(4)]
    assert [bool(m.lanes) for m in pushes] == [True, True, False, False]  # PCP rank 0: 0, 1
    pulls = [pull_map(src, dst, r, spread_pcp=False) for r in range(4)]
    assert copy_rows(p.plan(SB[:1], DB[:1]) for p in pulls) == copy_rows(
        p.plan(SB[:1], DB[:1]) for p in pushes)
    spread = [pull_map(src, dst, r) for r in range(4)]
    assert {x for m in spread for x in m.peers} == {0, 1, 2, 3}  # pull uses both replicas


def test_replica_load_is_even():
    src = EngineSpec.from_dict(spec(2, attn(heads=2), mla(), pcp=3))
    dst = EngineSpec.from_dict(spec(4, attn(heads=2), mla(), pcp=2))
    load = Counter(lane.src_rank for r in range(dst.num_ranks)
                   for lane in pull_map(src, dst, r).lanes if lane.dst_region == 1)
    assert sorted(load) == list(range(6)) and max(load.values()) - min(load.values()) <= 1


@pytest.mark.parametrize("il", [1, 4, 16])
@pytest.mark.parametrize("dst", [spec(1, mla(), state()), spec(2, mla(), state()),
                                 spec(4, mla(), state(), dcp=2, il=8),
                                 spec(1, mla(), state(), pcp=2, dcp=2, il=2)])
def test_sharded_pcp_each_rank_serves_its_own_shard(il, dst):
    s = spec(1, mla(), state(), pcp=4, dcp=4, il=il)
    # the oracle fills PCP rank q with the positions of DCP shard q only: any token read
    # from another rank would carry another position's bytes
    assert check_against_oracle(s, dst, SB, DB) > 0
    assert check_against_oracle(s, dst, SB, DB, tokens=(3, 61)) > 0
    src, d = EngineSpec.from_dict(s), EngineSpec.from_dict(dst)
    assert [dcp_rank(src, r) for r in range(4)] == [0, 1, 2, 3]
    latent = {lane.src_rank for r in range(d.num_ranks) for lane in pull_map(src, d, r).lanes
              if lane.dst_region == 0}
    assert latent == {0, 1, 2, 3}  # every shard is read, from the rank holding it
    pulls, pushes = pulls_and_pushes(src, d, SB, DB, spread_pcp=False)
    assert copy_rows(pulls) == copy_rows(pushes)
    assert all(push_map(src, d, r).lanes for r in range(4))  # every shard sends its own


def test_labels_name_dcp_and_pcp_shares():
    src = EngineSpec.from_dict(spec(1, mla(), attn(heads=2), pcp=2, dcp=2, il=4))
    dst = EngineSpec.from_dict(spec(4, mla(), attn(heads=2), dcp=2, il=8))
    m = pull_map(src, dst, 1)
    text = m.summary()
    assert "PCP source 2 sharded (DCP over PCP)" in text
    assert "l0.mla: DCP 1/2 (positions 8:16 of every 16), K" in text  # not R: half the tokens
    assert "S(heads 0:1) DCP 1/2 (positions 8:16 of every 16)" in text
    assert "from PCP shard 1/2 (positions 4:8 of every 8)" in text
    rep = EngineSpec.from_dict(spec(2, mla(), attn(heads=2), pcp=2))
    assert cp_label(rep, 3, rep.regions[0]) == "PCP replica 1/2"
    assert {x.describe(rep) for x in pull_map(dst, rep, 3).lanes} == {
        "R PCP replica 1/2", "S(heads 1:2) PCP replica 1/2"}
    from kvplan.views import rank_map
    labels = {f.label for e in rank_map(m) for f in e.flows}
    # a picture labels a flow as the text does (its placement and the rank's DCP share)
    assert labels == {"MLA DCP 1/2 (positions 8:16 of every 16)",
                      "S(heads 0:1) DCP 1/2 (positions 8:16 of every 16)"}


@st.composite
def pcp_cases(draw):
    src_d, dst_d = draw(ks.pcp_spec_pairs(max_groups=2, max_tp=4))
    return (src_d, dst_d, *draw(ks.token_requests(src_d, dst_d)))


@SETTINGS
@given(pcp_cases())
def test_pcp_pairs_copy_exactly_the_oracle_bytes(case):
    check_against_oracle(*case)


@settings(SETTINGS, max_examples=30)
@given(pcp_cases())
def test_pcp_push_equals_pull_from_replica_zero_and_spread_is_even(case):
    src_d, dst_d, sb, db, tokens, dst_from = case
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    plan = dict(tokens=tokens, dst_from=dst_from)
    pulls, pushes = pulls_and_pushes(src, dst, sb, db, spread_pcp=False, **plan)
    assert copy_rows(pulls) == copy_rows(pushes)
    spread = [pull_map(src, dst, r).plan(sb, db, **plan) for r in range(dst.num_ranks)]
    assert sum(p.nbytes for p in spread) == sum(p.nbytes for p in pulls)
    again = pull_map(EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d), 0)
    assert again.plan(sb, db, **plan) == spread[0]  # deterministic from fresh specs


@settings(SETTINGS, max_examples=30)
@given(ks.pcp_spec_pairs(max_groups=2, max_tp=4))
def test_readers_spread_evenly_over_source_replicas(pair):
    """Each (head or unit) is read by the destination ranks holding it from the source ranks
    holding it, over every PCP replica, loads differing by at most one."""
    src, dst = (EngineSpec.from_dict(d) for d in pair)
    if src.dcp_size > 1:  # DCP decides the source rank of each token: no choice to spread
        return
    maps = [pull_map(src, dst, r) for r in range(dst.num_ranks)]
    for j, region in enumerate(dst.regions):
        i = src.region_index(region.name)
        if not region.is_state and dst.dcp_size > 1:
            continue  # a destination DCP rank reads only its tokens: loads differ by share
        for c, comp in enumerate(region.components):
            for h in range(comp.units):
                load = Counter(lane.src_rank for m in maps for lane in m.lanes
                               if lane.dst_region == j for u in lane.units
                               if u.component == c and u.start <= h < u.stop)
                holders = [stage_base(src, src.stage_of(i), q) + t
                           for q in range(src.pcp_size) for t in range(src.tp_size)
                           if h in held_heads(comp.units, src.tp_size, t)]
                assert set(load) <= set(holders)
                counts = [load[r] for r in holders]
                assert max(counts) - min(counts) <= 1, (region.name, h, counts)
