"""End to end over real NIXL agents: a request posted layer by layer, with one completion.

Bytes are checked against the oracle (token range included); notifications are counted: one
per part and peer rank when asked, and exactly one request notification per peer rank.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvplan_nixl import PlanMismatchError, RequestTransfer
from tests import oracle
from tests.nixl_util import attn, mla, notifications, pair, spec

LAYERS = 4


def _engines():
    src = spec(2, *[attn(f"layers.{k}.attn", heads=4, bs=16, nb=24) for k in range(LAYERS)],
               mla("draft.0.mla", bs=16, nb=24))
    dst = spec(4, *[attn(f"layers.{k}.attn", heads=4, bs=32, nb=12) for k in range(LAYERS)],
               mla("draft.0.mla", bs=32, nb=12))
    return src, dst


def _check(pr, sb, db, tokens, ranks=None) -> None:
    sd, dd = pr.src.to_dict(), pr.dst.to_dict()
    for r in range(pr.dst.num_ranks) if ranks is None else ranks:
        expected, _ = oracle.expected_destination(sd, dd, sb, db, r, pr.src_bufs, pr.before,
                                                  tokens=tokens)
        for j, exp in expected.items():
            assert np.array_equal(pr.dst_bufs[(r, j)], exp), (r, pr.dst.regions[j].name)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_layerwise_request_moves_the_oracle_bytes_and_completes_once(mode):
    src, dst = _engines()
    sb, db = [[7, 3, 11, 0, 5, 9]], [[4, 1, 8]]
    tokens = (10, 90)
    names = [r.name for r in src.regions]
    with pair(src, dst) as pr:
        pr.connect(mode)
        initiators, targets = (pr.d, pr.p) if mode == "pull" else (pr.p, pr.d)
        remote = "prefill" if mode == "pull" else "decode"
        reqs: list[RequestTransfer] = []
        for ep in initiators:
            plan = ep.map(remote, mode).plan(sb, db, tokens=tokens)
            reqs.append(ep.request(plan, remote, notify=b"req-1", timeout=30))
        per_part = 0
        for k, name in enumerate(names):  # "layer k is computed": post it everywhere
            for req in reqs:
                t = req.post(req.plan.part([name]), notify=b"part-%d" % k)
                per_part += len(t.peers)
            assert not any(r.done for r in reqs)
        for req in reqs:
            req.end()
        for req in reqs:
            req.wait(30, progress=targets)
            assert req.ok and req.done and len(req.transfers) == len(names)
        _check(pr, sb, db, tokens)
        final = sum(len(r.peers) for r in reqs)
        got = notifications(targets, per_part + final)
        msgs = [n.message for _, n in got]
        assert msgs.count(b"req-1") == final  # one completion per request and peer rank
        assert len(msgs) == per_part + final
        # the request's message comes after every part's message from the same initiator
        for rank, n in got:
            if n.message == b"req-1":
                later = [m for r2, m in got[got.index((rank, n)) + 1:]
                         if r2 == rank and m.engine == n.engine and m.rank == n.rank]
                assert not later


def test_request_refusals():
    src, dst = _engines()
    sb, db = [[0, 1, 2, 3]], [[0, 1]]
    with pair(src, dst) as pr:
        pr.connect("pull")
        ep = pr.d[0]
        plan = ep.map("prefill").plan(sb, db)
        req = ep.request(plan, "prefill")
        req.post(["layers.0.attn", "layers.1.attn"])
        with pytest.raises(PlanMismatchError,
                           match=r"\['layers\.1\.attn'\] already posted in part 0"):
            req.post(plan.part(["layers.1.attn"]))
        other = ep.map("prefill").plan(sb, db)  # an equal plan, but not this request's
        with pytest.raises(PlanMismatchError, match="not a slice of this request's plan"):
            req.post(other.part(["layers.2.attn"]))
        with pytest.raises(PlanMismatchError,
                           match=r"never posted: layers\.2\.attn, layers\.3\.attn"):
            req.end()
        with pytest.raises(PlanMismatchError, match="call end"):
            req.wait(1)
        req.post(["layers.2.attn", "layers.3.attn", "draft.0.mla"])
        req.end()
        with pytest.raises(PlanMismatchError, match="already ended"):
            req.post(["layers.0.attn"])
        req.wait(30, progress=pr.p)
        with pytest.raises(PlanMismatchError, match="whole plan"):
            ep.request(plan.part(["layers.0.attn"]), "prefill")
        _check(pr, sb, db, None, ranks=[0])


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_dcp_pair_over_nixl(mode):
    """vLLM PR 50611's case, over NIXL: P TP4 DCP4 -> D TP2 DCP2 (MLA and one KV head)."""
    src = spec(4, mla("l0.mla", bs=16, nb=16), attn("l0.attn", heads=1, bs=16, nb=16))
    dst = spec(2, mla("l0.mla", bs=16, nb=32), attn("l0.attn", heads=1, bs=16, nb=32))
    src = src.from_dict({**src.to_dict(), "dcp_size": 4, "dcp_interleave": 4})
    dst = dst.from_dict({**dst.to_dict(), "dcp_size": 2, "dcp_interleave": 4})
    sb, db = [[5, 2, 9]], [[1, 7, 3, 12, 0, 6]]  # 3 x 64 positions = 6 x 32
    tokens = (20, 185)
    with pair(src, dst) as pr:
        pr.connect(mode)
        initiators, targets = (pr.d, pr.p) if mode == "pull" else (pr.p, pr.d)
        remote = "prefill" if mode == "pull" else "decode"
        posted = []
        for ep in initiators:
            plan = ep.map(remote, mode).plan(sb, db, tokens=tokens)
            posted.append((ep.read if mode == "pull" else ep.write)(plan, remote))
        for t in posted:
            t.wait(30, progress=targets)
        _check(pr, sb, db, tokens)
        if mode == "pull":  # D0 holds the even interleave runs of a block id: P0 and P2 have them
            assert pr.d[0].map("prefill").peers == (0, 2)


def test_request_opened_before_every_peer_is_connected_lowers_each_part():
    """A peer connected after request() gets its part lowered at post (the slow path)."""
    src, dst = _engines()
    sb, db = [[0, 1, 2, 3]], [[0, 1]]
    with pair(src, dst) as pr:
        ep = pr.d[0]
        metas = [p.metadata() for p in pr.p]
        ep.connect(metas[1])  # a rank this one never reads from: the map, not its peer
        plan = ep.map("prefill").plan(sb, db)
        assert plan.peers == (0,)
        req = ep.request(plan, "prefill", notify=b"late")
        assert req._pre is None  # its peer was not connected yet
        ep.connect(metas[0])
        for name in [r.name for r in src.regions]:
            req.post([name])
        req.end()
        req.wait(30, progress=pr.p)
        assert req.ok
        _check(pr, sb, db, None, ranks=[0])
        got = notifications(pr.p, len(plan.peers))
        assert [r for r, _ in got] == [0]
        assert sorted(n.message for _, n in got) == [b"late"] * len(plan.peers)
