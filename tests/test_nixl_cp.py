"""Issue 19's engine pairs over real NIXL agents, pull and push, byte for byte against the
oracle: block sizes that do not divide (48 <-> 64), PCP replicas and sharded PCP + DCP, and a
destination that groups its regions otherwise."""

from __future__ import annotations

import pytest

from kvplan import EngineSpec
from tests.nixl_util import pair


def _spec(tp: int, regions: list[dict], **extra) -> EngineSpec:
    return EngineSpec.from_dict({"tp_size": tp, "regions": regions, **extra})


def _attn(bs: int, group: int = 0) -> dict:
    return {"name": "layers.0.attn", "kind": "attention", "num_blocks": 16, "block_size": bs,
            "dtype": "bfloat16", "num_kv_heads": 4, "head_dim": 16, "group": group}


def _mla(bs: int, group: int = 0, name: str = "layers.1.mla") -> dict:
    return {"name": name, "kind": "mla", "num_blocks": 16, "block_size": bs,
            "dtype": "bfloat16", "dim": 40, "group": group}


CASES = [
    ("blocks-48-to-64", _spec(2, [_attn(48), _mla(48)]), _spec(4, [_attn(64), _mla(64)]),
     [[3, 1, 5, 7]], [[2, 7, 0]]),
    ("blocks-64-to-48", _spec(4, [_attn(64), _mla(64)]), _spec(2, [_attn(48), _mla(48)]),
     [[2, 7, 0]], [[3, 1, 5, 7]]),
    ("pcp-replicas", _spec(1, [_attn(16), _mla(16)], pcp_size=2),
     _spec(2, [_attn(16), _mla(16)]), [[3, 1, 5, 7]], [[2, 7, 0, 4]]),
    ("pcp-sharded", _spec(1, [_mla(16), _mla(16, name="layers.2.mla")], pcp_size=2, dcp_size=2,
                          dcp_interleave=4),
     _spec(2, [_mla(16), _mla(16, name="layers.2.mla")]), [[3, 1]], [[2, 7, 0, 4]]),
    ("regrouped", _spec(2, [_mla(16), _mla(16, name="layers.2.mla")]),
     _spec(1, [_mla(32), _mla(48, group=1, name="layers.2.mla")]),
     [[3, 1, 5, 7, 9, 11]], [[2, 7, 0], [4, 6]]),
]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("src", "dst", "sb", "db"),
                         [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_issue_19_pairs_over_nixl(src, dst, sb, db, mode):
    with pair(src, dst, src_blocks=sb) as pr:
        pr.connect(mode)
        posted = pr.run(mode, sb, db)
        assert all(t.ok and t.done for t in posted)
        assert pr.check(sb, db, [t.plan for t in posted]) > 0
        if mode == "push" and src.pcp_size > 1 and not src.pcp_sharded:
            assert [t.nbytes > 0 for t in posted] == [True, False]  # PCP rank 0 sends
        if mode == "pull" and src.pcp_size > 1:
            used = {p for t in posted for p in t.peers}
            assert used == {0, 1}  # both PCP ranks serve (replicas spread, or shards)
