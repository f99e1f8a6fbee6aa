"""Block sizes that do not divide each other: planned by granules of their gcd.

Worked cases (prefill block 48 -> decode block 64 and back, kernel blocks, every region kind,
pull and push) against the oracle, which locates every position on its own and never assumed
sizes divide; hypothesis over block-size pairs with exactly-once coverage; the phase rule is
the old one wherever sizes divide (so no plan changes there); the size budget's refusal.
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import kvplan.strategies as ks
from kvplan import EngineSpec, IncompatibleLayoutError, SpecError, pull_map
from kvplan.granules import MAX_PHASE_ATOMS, phase_offset, phases
from tests.test_ranges import check_against_oracle, copy_rows, pulls_and_pushes

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def attn(bs, heads=4, nb=12, name="l0.attn", **kw):
    return {"name": name, "kind": "attention", "num_blocks": nb, "block_size": bs,
            "dtype": "bfloat16", "num_kv_heads": heads, "head_dim": 4, **kw}


def tok(kind, bs, nb=12, name=None, **kw):
    return {"name": name or f"l0.{kind}", "kind": kind, "num_blocks": nb, "block_size": bs,
            "dtype": "uint8", "dim": 6, **kw}


def state(nb=6, name="l1.state", group=1, **kw):
    return {"name": name, "kind": "state", "num_blocks": nb, "dtype": "bfloat16",
            "group": group, "parts": [{"name": "x", "units": 4, "unit_bytes": 6},
                                      {"name": "ssm", "units": 2, "unit_bytes": 10}], **kw}


def hybrid(tp, bs, kernel=None, window=None):
    """Attention (optionally windowed, with kernel blocks), MLA and indexer in group 0, a
    Mamba-like state region in group 1: every region kind one request moves."""
    k = {"kernel_block_size": kernel} if kernel else {}
    return {"tp_size": tp, "regions": [
        attn(bs, window=window, **k), tok("mla", bs, **k), tok("indexer", bs), state()]}


SB, DB = [[3, 1, 5, 7], [2, 0, 4]], [[2, 7, 0, 4, 9, 6], [5, 1, 3]]  # 4 x 48 = 3 x 64 positions


@pytest.mark.parametrize(("a", "b"), [(48, 64), (64, 48)])
@pytest.mark.parametrize("tps", [(1, 1), (2, 4), (4, 2)])
def test_prefill_48_decode_64_and_back_every_kind(a, b, tps):
    s, d = hybrid(tps[0], a), hybrid(tps[1], b)
    sb, db = (SB, DB) if a == 48 else (DB, SB)
    assert check_against_oracle(s, d, sb, db) > 0
    for tokens in ((5, 150), (0, 192), (47, 49), (64, 130)):  # inside blocks of either side
        assert check_against_oracle(s, d, sb, db, tokens=tokens) > 0


@pytest.mark.parametrize(("a", "ka", "b", "kb"), [(48, 16, 64, 32), (48, 48, 64, 16),
                                                  (24, 8, 64, 64), (96, 32, 64, 16)])
def test_kernel_blocks_of_non_dividing_sizes(a, ka, b, kb):
    s, d = hybrid(2, a, kernel=ka), hybrid(1, b, kernel=kb)
    n = math.lcm(a, b) // a
    sb = [[(7 * k + 3) % 12 for k in range(n)], [2, 0, 4]]  # distinct, non-adjacent ids
    db = [[(5 * k + 2) % 12 for k in range(math.lcm(a, b) // b)], [5, 1, 3]]
    assert check_against_oracle(s, d, sb, db) > 0
    assert check_against_oracle(s, d, sb, db, tokens=(3, math.lcm(a, b) - 5)) > 0


def test_windows_and_pools_with_non_dividing_sizes():
    pool = {"pool": "p0", "layout": "BLHNC"}
    s = {"tp_size": 2, "regions": [attn(48, window=70), tok("mla", 48, name="l0.mla", **pool),
                                   state(nb=8, **pool)]}
    d = {"tp_size": 4, "regions": [attn(64, window=70), tok("mla", 64, name="l0.mla", **pool),
                                   state(nb=8, **pool)]}
    sb, db = [[3, 1, 5, 7], [2, 0, 4]], [[2, 7, 0], [5, 1, 3]]
    assert check_against_oracle(s, d, sb, db) > 0
    assert check_against_oracle(s, d, sb, db, tokens=(10, 171)) > 0


@pytest.mark.parametrize(("a", "b"), [(48, 64), (64, 48), (6, 4)])
def test_push_equals_pull_for_non_dividing_sizes(a, b):
    src, dst = EngineSpec.from_dict(hybrid(2, a)), EngineSpec.from_dict(hybrid(4, b))
    n = math.lcm(a, b)
    sb = [list(range(n // a))[::-1], [2, 0, 4]]
    db = [list(range(n // b)), [5, 1, 3]]
    pulls, pushes = pulls_and_pushes(src, dst, sb, db, tokens=(1, n - 1))
    assert copy_rows(pulls) == copy_rows(pushes) and len(copy_rows(pulls)) > 0


def test_phase_rule_is_the_old_one_where_sizes_divide():
    for a in range(1, 65):
        for b in range(1, 65):
            if a % b == 0 or b % a == 0:  # the rule before granules: a // b phases at b steps
                assert phases(a, b) == max(1, a // b)
                assert [phase_offset(p, a, b) for p in range(phases(a, b))] == [
                    p * b for p in range(max(1, a // b))]
            # every phase starts on a granule, and the phases cover all of them once
            g = math.gcd(a, b)
            assert sorted(phase_offset(p, a, b) for p in range(phases(a, b))) == list(
                range(0, a, g))


def test_runs_48_to_64_are_as_few_as_the_blocks_allow():
    """HND attention tp 1 -> 1: a 64-token destination block gets its K and V of each head
    from at most two 48-token source blocks, so (heads x streams x source pieces) runs."""
    s = {"tp_size": 1, "regions": [attn(48, heads=2)]}
    d = {"tp_size": 1, "regions": [attn(64, heads=2)]}
    m = pull_map(EngineSpec.from_dict(s), EngineSpec.from_dict(d), 0)
    pieces = sum(len({(j * 64 + t) // 48 for t in range(64)}) for j in range(3))  # 2+2+2
    plan = m.plan([[5, 3, 9, 1]], [[2, 0, 4]])  # non-adjacent ids: nothing merges across blocks
    assert len(plan.copies()) == 2 * 2 * pieces
    assert check_against_oracle(s, d, [[5, 3, 9, 1]], [[2, 0, 4]]) == 2 * 2 * 192 * 4 * 2


def test_size_budget_refuses_naming_the_spans():
    s = {"tp_size": 1, "regions": [tok("mla", 4099, nb=2)]}
    d = {"tp_size": 1, "regions": [tok("mla", 4096, nb=2)]}
    assert math.lcm(4099, 4096) > MAX_PHASE_ATOMS
    with pytest.raises(IncompatibleLayoutError, match=r"region 'l0.mla': block ids of 4099 "
                       r"\(source\) and 4096 \(destination\) positions meet every lcm = "
                       r"16789504 positions \(granule gcd = 1\)"):
        pull_map(EngineSpec.from_dict(s), EngineSpec.from_dict(d), 0)


@st.composite
def non_dividing_cases(draw):
    src_d, dst_d = draw(ks.spec_pairs(max_groups=2))
    sizes = (2, 3, 4, 5, 6, 8, 9, 12, 16)
    for r in src_d["regions"]:  # redraw token regions' block sizes: often coprime or not dividing
        if r["kind"] == "state":
            continue
        other = next(x for x in dst_d["regions"] if x["name"] == r["name"])
        a, b = draw(st.sampled_from(sizes)), draw(st.sampled_from(sizes))
        for x, bs in ((r, a), (other, b)):
            x["block_size"] = bs
            if x.get("kernel_block_size"):
                x["kernel_block_size"] = draw(st.sampled_from(
                    [k for k in range(1, bs + 1) if bs % k == 0]))
            if x.get("pool") is not None:
                x.pop("page_bytes", None)  # the page follows the new block size
    for side in (src_d, dst_d):
        for r in side["regions"]:
            if r.get("pool") is not None:
                r.pop("page_bytes", None)
    try:
        EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    except SpecError:  # e.g. a kernel block the new size no longer fits: not a case here
        reject()
    return (src_d, dst_d, *draw(ks.token_requests(src_d, dst_d)))


@SETTINGS
@given(non_dividing_cases())
def test_any_block_sizes_copy_exactly_the_oracle_bytes(case):
    check_against_oracle(*case)


@settings(SETTINGS, max_examples=25)
@given(non_dividing_cases())
def test_any_block_sizes_push_equals_pull_and_deterministic(case):
    src_d, dst_d, sb, db, tokens, dst_from = case
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    pulls, pushes = pulls_and_pushes(src, dst, sb, db, tokens=tokens, dst_from=dst_from)
    assert copy_rows(pulls) == copy_rows(pushes)
    again = pull_map(EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d), 0)
    assert np.array_equal(again.plan(sb, db, tokens=tokens, dst_from=dst_from).copies(),
                          pulls[0].copies())
