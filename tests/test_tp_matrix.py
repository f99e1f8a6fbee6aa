"""Every power-of-two TP pair up to 16, both ways, on a mixed GQA + MLA + indexer engine, checked
byte for byte against the oracle for every destination rank (replicated heads included: 8 KV
heads at TP16)."""

import itertools

import numpy as np
import pytest

from kvplan import EngineSpec, pull_map, push_map, simulate
from tests import oracle

TPS = (1, 2, 4, 8, 16)


def spec(tp, layout):
    return {"tp_size": tp, "regions": [
        {"name": "attn", "kind": "attention", "num_blocks": 6, "block_size": 4,
         "dtype": "bfloat16", "num_kv_heads": 8, "head_dim": 4, "layout": layout},
        {"name": "mla", "kind": "mla", "num_blocks": 6, "block_size": 4, "dtype": "bfloat16",
         "dim": 9},
        {"name": "idx", "kind": "indexer", "num_blocks": 6, "block_size": 4, "dtype": "uint8",
         "dim": 5},
    ]}


@pytest.mark.parametrize(("src_tp", "dst_tp"), list(itertools.product(TPS, TPS)))
def test_pull_and_push_for_every_power_of_two_pair(src_tp, dst_tp):
    src_d, dst_d = spec(src_tp, "HND"), spec(dst_tp, "NHD")
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    sb, db = [[4, 1, 2]], [[0, 5, 3]]
    src_bufs = oracle.source_buffers(src_d, seed=5)
    rows = []
    for rank in range(dst_tp):
        plan = pull_map(src, dst, rank).plan(sb, db)
        rows += plan.copies().tolist()
        before = oracle.destination_buffers(dst_d, seed=6)
        expected, _ = oracle.expected_destination(src_d, dst_d, sb, db, rank, src_bufs, before)
        got = oracle.clone_buffers(before, rank)
        simulate(plan, src_bufs, got)
        for j in expected:
            assert np.array_equal(got[(rank, j)], expected[j]), (rank, dst.regions[j].name)
    pushed = [r for s in range(src_tp) for r in push_map(src, dst, s).plan(sb, db).copies()
              .tolist()]
    assert sorted(rows) == sorted(pushed)
