"""Regions grouped differently on the two sides: each side's block ids per its own groups.

vLLM's pure-MLA pull path (``pull_worker.py``) moves caches whose two sides group their layers
differently; the oracle already takes each region's blocks from its own side's group, so these
check the planner against it, and that relabelling or splitting the destination's groups
changes no byte of any plan.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvplan.strategies as ks
from kvplan import EngineSpec, RequestError, pull_map, push_map
from tests.test_ranges import check_against_oracle

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def mla(i, group, bs=16, nb=12):
    return {"name": f"layers.{i}.mla", "kind": "mla", "group": group, "num_blocks": nb,
            "block_size": bs, "dtype": "bfloat16", "dim": 8}


def test_pure_mla_one_group_to_two_groups_of_other_sizes():
    """Source: four MLA layers in one group of 16-token blocks; destination: two groups, 64 and
    48 tokens a block (vLLM groups layers by cache spec: another engine may not)."""
    s = {"tp_size": 2, "regions": [mla(i, 0) for i in range(4)]}
    d = {"tp_size": 1, "regions": [mla(0, 0, 64), mla(1, 1, 48), mla(2, 0, 64), mla(3, 1, 48)]}
    sb = [[9, 3, 0, 11, 5, 7, 1, 2, 4, 6, 8, 10]]  # 192 positions
    db = [[2, 0, 1], [3, 1, 0, 2]]  # 3 x 64 and 4 x 48
    assert check_against_oracle(s, d, sb, db) == 4 * 192 * 8 * 2
    assert check_against_oracle(s, d, sb, db, tokens=(7, 190)) > 0
    assert check_against_oracle(d, s, db, sb) == 2 * 4 * 192 * 8 * 2  # back: 2 replicas


def test_state_lists_must_match_across_regrouped_groups():
    st_ = {"name": "l1.state", "kind": "state", "num_blocks": 4, "dtype": "bfloat16",
           "parts": [{"name": "x", "units": 2, "unit_bytes": 4}]}
    s = EngineSpec.from_dict({"tp_size": 1, "regions": [mla(0, 0), {**st_, "group": 1}]})
    d = EngineSpec.from_dict({"tp_size": 1, "regions": [{**st_, "group": 0}, mla(0, 1)]})
    m = pull_map(s, d, 0)
    assert m.plan([[1, 2], [3]], [[0], [4, 5]]).nbytes > 0
    with pytest.raises(RequestError, match=r"source group 1 / destination group 0 holds state "
                       r"slots: 2 source slot\(s\) but 1 destination slot\(s\) for regions "
                       r"\['l1.state'\]"):
        m.plan([[1, 2], [3, 0]], [[0], [4, 5]])


@st.composite
def regrouped(draw):
    """A spec pair and request, and the same pair with the destination's groups relabelled
    and one unpooled token region moved into a group of its own (its list copied)."""
    src_d, dst_d = draw(ks.spec_pairs(max_groups=3))
    sb, db = draw(ks.requests(src_d, dst_d))
    n = 1 + max(r.get("group", 0) for r in dst_d["regions"])
    perm = draw(st.permutations(range(n)))
    new = {**dst_d, "regions": [{**r, "group": perm[r.get("group", 0)]} for r in dst_d["regions"]]}
    new_db = [None] * n
    for g in range(n):
        new_db[perm[g]] = db[g]
    count = [sum(r["group"] == g for r in new["regions"]) for g in range(n)]
    movable = [k for k, r in enumerate(new["regions"]) if r["kind"] != "state"
               and r.get("pool") is None and count[r["group"]] > 1]  # no group left empty
    if movable and draw(st.booleans()):
        k = draw(st.sampled_from(movable))
        r = new["regions"][k]
        new_db.append(list(new_db[r["group"]]))
        r["group"] = n
    return src_d, dst_d, sb, db, new, new_db


@SETTINGS
@given(regrouped())
def test_regrouping_the_destination_changes_no_byte(case):
    src_d, dst_d, sb, db, new_d, new_db = case
    src, dst, new = (EngineSpec.from_dict(x) for x in (src_d, dst_d, new_d))
    check_against_oracle(src_d, new_d, sb, new_db)
    key = ("src_rank", "src_region", "src_offset", "dst_rank", "dst_region", "dst_offset",
           "length")
    rows = lambda plans: sorted(tuple(x) for p in plans for x in p.copies()[list(key)].tolist())  # noqa: E731
    for r in range(dst.num_ranks):
        a = pull_map(src, dst, r).plan(sb, db, merge_slots=False)
        b = pull_map(src, new, r).plan(sb, new_db, merge_slots=False)
        assert rows([a]) == rows([b])
    pulls = [pull_map(src, new, r).plan(sb, new_db) for r in range(new.num_ranks)]
    pushes = [push_map(src, new, r).plan(sb, new_db) for r in range(src.num_ranks)]
    assert rows(pulls) == rows(pushes)
    # and the source side regrouped the same way (each side's lists follow its own groups)
    back = [pull_map(new, src, r).plan(new_db, sb) for r in range(src.num_ranks)]
    assert sum(p.nbytes for p in back) == sum(
        pull_map(dst, src, r).plan(db, sb).nbytes for r in range(src.num_ranks))
    assert np.all([p.copies()["length"].min(initial=1) > 0 for p in back])
