"""Token-exact requests: ``plan(src, dst, tokens=(start, end), dst_from=...)`` against the oracle.

Hypothesis draws ranges anywhere inside blocks of either side (both block-size directions,
windows, pools, state groups, pipeline stages); worked cases pin the engine conventions: a
prefix-cache hit on the destination, a partly filled last block, vLLM's "destination lists the
blocks it lacks", windows measured from ``end``, state slots moving whole.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvplan.strategies as ks
from kvplan import EngineSpec, RequestError, pull_map, push_map, simulate
from tests import oracle

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _bytes(offsets, lengths):
    if len(lengths) == 0:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(o, o + n) for o, n in zip(offsets.tolist(),
                                                                lengths.tolist())])


def check_against_oracle(src_d, dst_d, src_blocks, dst_blocks, tokens=None, dst_from="zero"):
    """Every destination rank: exact bytes, each required byte written once, nothing else.

    Returns the total bytes the plans copy (so a test can tell an empty case from a real one).
    """
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    src_bufs = oracle.source_buffers(src_d, seed=3, request_blocks=src_blocks)
    total = 0
    for rank in range(dst.num_ranks):
        plan = pull_map(src, dst, rank).plan(src_blocks, dst_blocks, tokens=tokens,
                                             dst_from=dst_from)
        total += plan.nbytes
        before = oracle.destination_buffers(dst_d, seed=4)
        expected, must = oracle.expected_destination(
            src_d, dst_d, src_blocks, dst_blocks, rank, src_bufs, before, tokens=tokens,
            dst_from=dst_from)
        got = oracle.clone_buffers(before, rank)
        simulate(plan, src_bufs, got)
        c = plan.copies()
        for j in expected:
            assert np.array_equal(got[(rank, j)], expected[j]), dst.regions[j].name
            sel = c[c["dst_region"] == j]
            written = np.zeros(dst.rank_region_nbytes(j), np.int64)
            np.add.at(written, _bytes(sel["dst_offset"], sel["length"]), 1)
            assert np.array_equal(written, must[j].astype(np.int64)), dst.regions[j].name
    return total


def pulls_and_pushes(src, dst, sb, db, spread_pcp=True, **plan):
    """One request's plans: every destination rank's pull and every source rank's push."""
    pulls = [pull_map(src, dst, r, spread_pcp=spread_pcp).plan(sb, db, **plan)
             for r in range(dst.num_ranks)]
    pushes = [push_map(src, dst, r).plan(sb, db, **plan) for r in range(src.num_ranks)]
    return pulls, pushes


def copy_rows(plans):
    """The rows of several plans as one sorted list (to compare unions of plans)."""
    return sorted(tuple(x) for p in plans for x in p.copies().tolist())


@st.composite
def ranged_cases(draw, **spec_kwargs):
    src_d, dst_d = draw(ks.spec_pairs(**spec_kwargs))
    for r in src_d["regions"]:  # often a window short enough to cut into the drawn range
        if r["kind"] == "attention" and spec_kwargs.get("windows", True) and draw(st.booleans()):
            r["window"] = draw(st.integers(1, 24))
            next(x for x in dst_d["regions"] if x["name"] == r["name"])["window"] = r["window"]
    return (src_d, dst_d, *draw(ks.token_requests(src_d, dst_d)))


@SETTINGS
@given(ranged_cases(max_groups=1))
def test_token_range_copies_exactly_its_positions(case):
    check_against_oracle(*case)


@settings(SETTINGS, max_examples=30)
@given(ranged_cases())
def test_token_range_over_several_groups(case):
    check_against_oracle(*case)


@SETTINGS
@given(ranged_cases(state=False, pools=False, max_pp=1))
def test_token_range_push_equals_pull_and_runs_are_maximal(case):
    src_d, dst_d, sb, db, tokens, dst_from = case
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    pulls = [pull_map(src, dst, r).plan(sb, db, tokens=tokens, dst_from=dst_from)
             for r in range(dst.num_ranks)]
    pushes = [push_map(src, dst, r).plan(sb, db, tokens=tokens, dst_from=dst_from)
              for r in range(src.num_ranks)]
    rows = lambda plans: sorted(tuple(x) for p in plans for x in p.copies().tolist())  # noqa: E731
    assert rows(pulls) == rows(pushes)
    for p in pulls:
        c = p.copies()
        for k in range(len(p.lane_bounds) - 1):
            seg = c[p.lane_bounds[k]:p.lane_bounds[k + 1]]
            join = (seg["src_offset"][1:] == seg["src_offset"][:-1] + seg["length"][:-1]) & (
                seg["dst_offset"][1:] == seg["dst_offset"][:-1] + seg["length"][:-1])
            assert not join.any()


@SETTINGS
@given(ranged_cases(state=False, pools=False, max_pp=1, windows=False), st.data())
def test_ranges_split_a_request_into_disjoint_pieces(case, data):
    """Copying [a, m) then [m, b) writes exactly what [a, b) writes (chunked prefill)."""
    src_d, dst_d, sb, db, (a, b), dst_from = case
    if dst_from != "zero":
        return
    m = data.draw(st.integers(a, b))
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    tm = pull_map(src, dst, 0)

    def spans(tokens):
        c = tm.plan(sb, db, tokens=tokens).copies()
        return sorted(zip(*(_bytes(c[f"{side}_offset"], c["length"]).tolist()
                            for side in ("src", "dst")), strict=True))

    whole = spans((a, b))
    assert whole == sorted(spans((a, m)) + spans((m, b)))


# -- worked cases ---------------------------------------------------------------------------


def attn(bs, nb=16, heads=4, window=None, layout="HND", group=0, name="l0.attn"):
    return {"name": name, "kind": "attention", "group": group, "num_blocks": nb,
            "block_size": bs, "dtype": "bfloat16", "num_kv_heads": heads, "head_dim": 8,
            "layout": layout, "kv": "split", "window": window}


def spec(tp, *regions):
    return {"tp_size": tp, "regions": list(regions)}


def positions_written(src_d, dst_d, sb, db, **kw):
    """Destination positions (over all ranks and heads) whose bytes some run writes, decoded
    from offsets of the HND split layout: a stream is ``num_blocks`` blocks of ``heads x bs``
    tokens of ``head_dim * 2`` bytes."""
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    r0 = dst.regions[0]
    bs, tok = r0.block_size, r0.head_dim * 2
    block = dst.rank_block_nbytes(0) // 2  # one stream
    tokens = kw.get("tokens")
    first = tokens[0] // bs if kw.get("dst_from") == "start" else 0
    where = {b: first + j for j, b in enumerate(db[0])}
    out = set()
    for r in range(dst.num_ranks):
        c = pull_map(src, dst, r).plan(sb, db, **kw).copies()
        c = c[c["dst_region"] == 0]
        o = _bytes(c["dst_offset"], c["length"]) % (r0.num_blocks * block)
        for b, t in set(zip((o // block).tolist(), ((o % block) % (bs * tok) // tok).tolist())):
            out.add(where[b] * bs + t)
    return out


def test_prefix_hit_on_destination_copies_only_the_missing_positions():
    s, d = spec(2, attn(16)), spec(2, attn(16))
    sb, db = [[5, 1, 9, 3]], [[0, 7, 2, 4]]
    assert check_against_oracle(s, d, sb, db, tokens=(32, 60)) > 0
    assert positions_written(s, d, sb, db, tokens=(32, 60)) == set(range(32, 60))


def test_start_inside_blocks_of_both_sides_with_different_block_sizes():
    for bs_s, bs_d in ((16, 32), (32, 16), (12, 8), (8, 12)):
        if max(bs_s, bs_d) % min(bs_s, bs_d):
            continue
        s, d = spec(2, attn(bs_s, nb=24)), spec(1, attn(bs_d, nb=24))
        n = 96
        sb = [list(range(23, 23 - n // bs_s, -1))]
        db = [list(range(n // bs_d))]
        assert check_against_oracle(s, d, sb, db, tokens=(21, 83)) > 0
        assert check_against_oracle(s, d, sb, db, tokens=(5, 11)) > 0  # one partial block
        assert positions_written(s, d, sb, db, tokens=(21, 83)) == set(range(21, 83))


def test_vllm_convention_destination_lists_the_blocks_it_lacks():
    s, d = spec(1, attn(16)), spec(2, attn(16))
    full_db = [6, 2, 8, 1, 4]
    sb = [[0, 1, 2, 3, 4]]
    kept = [full_db[40 // 16:]]  # the destination holds positions [0, 40) already
    a = pull_map(EngineSpec.from_dict(s), EngineSpec.from_dict(d), 0)
    whole = a.plan(sb, [full_db], tokens=(40, 75))
    lacking = a.plan(sb, kept, tokens=(40, 75), dst_from="start")
    assert np.array_equal(whole.copies(), lacking.copies())
    assert check_against_oracle(s, d, sb, kept, tokens=(40, 75), dst_from="start") > 0


def test_partly_filled_last_block_and_unequal_lists_without_a_range():
    s, d = spec(2, attn(16)), spec(4, attn(16))
    sb, db = [[3, 4, 5]], [[9, 8, 7, 6, 5]]
    assert check_against_oracle(s, d, sb, db, tokens=(0, 37)) > 0
    assert positions_written(s, d, sb, db, tokens=(0, 37)) == set(range(37))
    # Without a range, unequal lists copy what both cover: the shorter side's whole blocks.
    assert positions_written(s, d, sb, db) == set(range(48))


def test_window_is_measured_from_end():
    s = spec(1, attn(16, window=20, name="w"))
    d = spec(1, attn(16, window=20, name="w"))
    sb, db = [list(range(6))], [list(range(10, 16))]
    check_against_oracle(s, d, sb, db, tokens=(3, 70))
    # (20 // 16 + 1) * 16 = 32 positions back from end 70
    assert positions_written(s, d, sb, db, tokens=(3, 70)) == set(range(38, 70))
    assert positions_written(s, d, sb, db, tokens=(60, 70)) == set(range(60, 70))


def test_state_slots_move_whole_whatever_the_range():
    state = {"name": "l1.ssm", "kind": "state", "group": 1, "num_blocks": 4,
             "dtype": "bfloat16", "parts": [{"name": "conv", "units": 4, "unit_bytes": 6},
                                            {"name": "ssm", "units": 4, "unit_bytes": 10}]}
    s, d = spec(2, attn(16), state), spec(1, attn(16), state)
    sb, db = [[1, 2, 3], [2]], [[4, 5, 6], [0]]
    check_against_oracle(s, d, sb, db, tokens=(17, 18))
    m = pull_map(EngineSpec.from_dict(s), EngineSpec.from_dict(d), 0)
    c = m.plan(sb, db, tokens=(17, 18)).copies()
    assert c[c["dst_region"] == 1]["length"].sum() == 4 * 6 + 4 * 10  # all units of the slot


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tokens": (0, 80)}, r"group 0 \(region 'l0.attn'\): tokens 0:80 need source positions "
                              r"up to 80, but 4 source block\(s\) of 16 positions cover \[0, 64\)"),
        ({"tokens": (0, 50)}, r"need destination positions up to 50, but 3 destination"),
        ({"tokens": (20, 10)}, r"tokens \(20, 10\): need 0 <= start <= end"),
        ({"tokens": (-1, 10)}, r"need 0 <= start"),
        ({"tokens": (1.5, 10)}, r"start must be an integer"),
        ({"tokens": 7}, r"tokens must be a pair"),
        ({"dst_from": "start"}, r"pass tokens"),
        ({"tokens": (0, 1), "dst_from": "end"}, r"dst_from must be one of"),
    ],
)
def test_refusals_name_the_group_and_numbers(kw, match):
    s, d = EngineSpec.from_dict(spec(1, attn(16))), EngineSpec.from_dict(spec(1, attn(16)))
    with pytest.raises(RequestError, match=match):
        pull_map(s, d, 0).plan([[0, 1, 2, 3]], [[0, 1, 2]], **kw)


def test_plan_records_its_range():
    s, d = EngineSpec.from_dict(spec(1, attn(16))), EngineSpec.from_dict(spec(1, attn(16)))
    m = pull_map(s, d, 0)
    p = m.plan([[0, 1]], [[1]], tokens=(16, 20), dst_from="start")
    assert p.tokens == (16, 20) and p.dst_from == "start"
    assert p != m.plan([[0, 1]], [[1, 0]], tokens=(16, 20))
    assert "tokens 16:20" in p.summary()
