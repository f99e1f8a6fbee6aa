"""Hybrid engines over real NIXL: shared pools (KimiLinear-like MLA + KDA state), state slots,
kernel blocks and pipeline stages, pull and push, byte for byte; and the buffer refusals that
only hybrids can provoke."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from kvplan import EngineSpec, PlanError, pull_map
from kvplan.examples import kimi_linear_like
from kvplan_nixl import BufferSizeError, Endpoint, State
from tests import oracle
from tests.nixl_util import hybrid_blocks, notifications, pair


def kimi(tp: int, pp: int = 1, kernel: int | None = 16) -> EngineSpec:
    """KimiLinear-like: per layer pair an MLA view (group 0, kernel blocks) and a KDA state view
    (group 1) of one pool; small enough for a unit test (16 pages per pool)."""
    s = kimi_linear_like(tp, layers=2, num_blocks=16, kernel_block_size=kernel)
    return s if pp == 1 else EngineSpec.from_dict({**s.to_dict(), "pp_size": pp})


def nemotron(tp: int, pp: int = 1) -> EngineSpec:
    """Nemotron-H-like, scaled down: three Mamba2 state layers (conv x, B, C with replicated
    groups beyond TP2, temporal ssm) in group 1 and one GQA layer in group 0."""
    parts = [{"name": "x", "units": 64, "unit_bytes": 6},
             {"name": "B", "units": 2, "unit_bytes": 96},
             {"name": "C", "units": 2, "unit_bytes": 96},
             {"name": "ssm", "units": 8, "unit_bytes": 512}]
    regions = [{"name": f"layers.{i}.mamba", "kind": "state", "group": 1, "num_blocks": 8,
                "dtype": "bfloat16", "parts": parts} for i in range(3)]
    regions.append({"name": "layers.3.attn", "kind": "attention", "num_blocks": 32,
                    "block_size": 16, "dtype": "bfloat16", "num_kv_heads": 4, "head_dim": 64})
    return EngineSpec.from_dict({"tp_size": tp, "pp_size": pp, "regions": regions})


# (id, source, destination, modes)
CASES = [
    ("kimi-p2-d4", kimi(2), kimi(4, kernel=32), ("pull", "push")),
    ("kimi-p4-d1", kimi(4), kimi(1, kernel=None), ("pull", "push")),
    ("kimi-p2pp2-d1", kimi(2, pp=2), kimi(1), ("pull",)),
    ("nemotron-p2pp2-d1", nemotron(2, 2), nemotron(1), ("pull", "push")),
    ("nemotron-p2-d1pp2", nemotron(2), nemotron(1, 2), ("pull", "push")),
    ("nemotron-p2pp2-d1pp2", nemotron(2, 2), nemotron(1, 2), ("pull", "push")),
]


@pytest.mark.parametrize(
    ("src", "dst", "mode"),
    [pytest.param(s, d, m, id=f"{name}-{m}") for name, s, d, modes in CASES for m in modes],
)
def test_hybrid_transfer_matches_simulate_and_oracle(src, dst, mode):
    rng = np.random.default_rng(17)
    tokens = 136  # not a multiple of any block size: a partial last block on both sides
    sb, db = hybrid_blocks(rng, src, tokens, 2), hybrid_blocks(rng, dst, tokens, 2)
    with pair(src, dst, src_blocks=sb) as pr:
        pr.connect(mode)  # every initiator to every target rank, needed or not
        posted = pr.run(mode, sb, db, notify=b"hybrid")
        assert all(t.ok and t.done for t in posted)
        assert all(s is State.DONE for t in posted for s in t.states().values())
        assert pr.check(sb, db, [t.plan for t in posted]) > 0
        # each allocation registered once; a descriptor list per route and per NEEDED peer only
        initiators, targets = (pr.d, pr.p) if mode == "pull" else (pr.p, pr.d)
        for ep, t in zip(initiators, posted, strict=True):
            assert ep.handles()["registrations"] == 1
            needed = ep.map("prefill" if mode == "pull" else "decode", mode).peers
            assert set(t.peers) <= set(needed)
            assert ep.handles()["dlist"] == 1 + len(needed)
            assert ep.handles()["remote_agents"] == len(targets)
        sender = "decode" if mode == "pull" else "prefill"
        want = sorted((sender, i, peer) for i, t in enumerate(posted) for peer in t.peers)
        got = notifications(targets, len(want))
        assert sorted((n.engine, n.rank, rank) for rank, n in got) == want


def test_pipeline_stages_connect_only_the_peers_the_map_names():
    """A decode rank connects any one prefill rank, then the ranks its map names."""
    src, dst = nemotron(2, 2), nemotron(1, 2)
    rng = np.random.default_rng(3)
    sb, db = hybrid_blocks(rng, src, 100, 1), hybrid_blocks(rng, dst, 100, 1)
    with pair(src, dst, src_blocks=sb) as pr:
        metas = [p.metadata() for p in pr.p]
        posted = []
        for d in pr.d:
            d.connect(metas[0])
            peers = d.map("prefill").peers
            assert peers == ((0, 1) if d.rank == 0 else (2, 3))  # its own stage's ranks
            for r in peers:
                d.connect(metas[r])
            plan = d.map("prefill").plan(sb, db)
            assert plan.peers == peers
            posted.append(d.read(plan, "prefill"))
        for t in posted:
            t.wait(30, progress=pr.p)
        pr.check(sb, db, [t.plan for t in posted])


def _kimi_bufs(spec: EngineSpec, rank: int) -> dict[int, np.ndarray]:
    return {a: np.zeros(spec.rank_region_nbytes(a), np.uint8)
            for a in sorted({spec.allocation_of(i) for i in spec.regions_on(rank)})}


def test_every_buffer_rule_registers_one_allocation_per_pool():
    s = kimi(2)
    a = _kimi_bufs(s, 0)  # {0: pool.0, 2: pool.1}
    forms = [
        [a[0], a[2]],  # a sequence, one per allocation
        [a[0], a[0], a[2], a[2]],  # a sequence, one per region held
        {"pool.0": a[0], "pool.1": a[2]},  # by pool name
        {"layers.1.kda": a[0], "layers.2.mla": a[2]},  # one region of each pool
        {"layers.0.mla": a[0], "layers.1.kda": a[0], "pool.0": a[0], "layers.3.kda": a[2]},
        {"layers.0.mla": (a[0].ctypes.data, a[0].nbytes), "layers.1.kda": a[0],  # same memory
         "pool.1": a[2]},
    ]
    for bufs in forms:
        with Endpoint("prefill", s, 0, bufs) as ep:
            assert ep.handles()["registrations"] == 1
            assert ep._bases == (a[0].ctypes.data,) * 2 + (a[2].ctypes.data,) * 2


def test_pool_given_two_different_buffers_refused():
    s = kimi(2)
    a = _kimi_bufs(s, 0)
    other = np.zeros_like(a[0])
    with pytest.raises(BufferSizeError, match=r"pool 'pool.0' \(regions 'layers.0.mla', "
                       r"'layers.1.kda'\): 'layers.0.mla' and 'layers.1.kda' give two different "
                       r"buffers .* share one allocation"):
        Endpoint("prefill", s, 0, {"layers.0.mla": a[0], "layers.1.kda": other, "pool.1": a[2]})
    with pytest.raises(BufferSizeError, match=r"'layers\.2\.mla' and 'layers\.3\.kda' give two"):
        Endpoint("prefill", s, 0, [a[0], a[0], a[2], np.zeros_like(a[2])])
    with pytest.raises(BufferSizeError, match=r"'pool\.0' and 'layers\.1\.kda' give two"):
        Endpoint("prefill", s, 0, {"pool.0": a[0], "layers.1.kda": other, "pool.1": a[2]})


def test_missing_pool_buffer_refused():
    s = kimi(2)
    a = _kimi_bufs(s, 0)
    with pytest.raises(BufferSizeError, match=r"rank 0 has no buffer for pool 'pool.1' \(regions "
                       r"'layers.2.mla', 'layers.3.kda'\)"):
        Endpoint("prefill", s, 0, {"layers.0.mla": a[0]})
    with pytest.raises(BufferSizeError, match=r"3 buffers for rank 0, which holds 2 allocation"
                       r"\(s\) \(or one per region it holds, 4\)"):
        Endpoint("prefill", s, 0, [a[0], a[0], a[2]])
    # a pool buffer sized for one view's blocks only (the MLA view's 16 blocks of one region)
    short = np.zeros(16 * s.rank_block_nbytes(1), np.uint8)
    with pytest.raises(BufferSizeError, match=r"pool 'pool.0' .*, given as 'layers.1.kda': "
                       r"buffer has \d+ bytes, the spec implies \d+ \(16 pages of \d+ bytes"):
        Endpoint("prefill", s, 0, {"layers.1.kda": short, "pool.1": a[2]})


def test_buffer_for_a_region_the_rank_does_not_hold_refused():
    s = nemotron(2, 2)  # stage 0: layers.0.mamba, layers.1.mamba; stage 1: the rest
    mine = {s.regions[i].name: np.zeros(s.rank_region_nbytes(i), np.uint8)
            for i in s.regions_on(1)}
    extra = np.zeros(s.rank_region_nbytes(3), np.uint8)
    with pytest.raises(BufferSizeError, match=r"region 'layers.3.attn' lies on pipeline stage 1 "
                       r"\(ranks 2..3\), not on rank 1's pipeline stage 0 \(ranks 0..1\)"):
        Endpoint("prefill", s, 1, {**mine, "layers.3.attn": extra})
    with pytest.raises(BufferSizeError, match="4 buffers for rank 1, which holds 2"):
        Endpoint("prefill", s, 1, [np.zeros(s.rank_region_nbytes(i), np.uint8) for i in range(4)])
    k = kimi(2, pp=2)
    with pytest.raises(BufferSizeError, match=r"pool 'pool\.1' lies on pipeline stage 1"):
        Endpoint("prefill", k, 0, {"pool.0": _kimi_bufs(k, 0)[0], "pool.1": extra})
    with pytest.raises(ValueError, match=r"rank 4 is not in \[0, 4\) .*\(tp 2 x pp 2\)"):
        Endpoint("prefill", s, 4, mine)


def test_run_on_a_region_of_another_stage_posts_nothing():
    src, dst = nemotron(2, 2), nemotron(1)
    rng = np.random.default_rng(5)
    sb, db = hybrid_blocks(rng, src, 64, 1), hybrid_blocks(rng, dst, 64, 1)
    with pair(src, dst, src_blocks=sb) as pr:
        pr.connect("pull")
        d = pr.d[0]
        plan = d.map("prefill").plan(sb, db)
        rows = plan.copies().copy()
        assert rows["src_rank"][0] == 0 and src.stage_of(3) == 1
        rows["src_region"][0] = rows["dst_region"][0] = 3  # a stage-1 region, read from rank 0
        rows.flags.writeable = False
        with pytest.raises(PlanError, match="source rank 0 region 3, but that rank holds no "
                           r"region 'layers.3.attn' \(another pipeline stage"):
            d.read(attrs.evolve(plan, rows=rows), "prefill")
        assert d.handles()["xfer"] == 0 and d.handles()["transfers"] == 0
        assert all(np.array_equal(pr.dst_bufs[k], v) for k, v in pr.before.items())


def test_pool_shares_one_registration_in_the_peers_metadata():
    from kvplan_nixl import metadata as md

    s = kimi(4)
    bufs = oracle.destination_buffers(s.to_dict(), seed=1)
    with Endpoint("decode", s, 2, {r.name: bufs[(2, i)] for i, r in enumerate(s.regions)}) as ep:
        info = md.decode(ep.metadata())
        assert info.held == (0, 1, 2, 3)
        assert info.bases[0] == info.bases[1] == bufs[(2, 0)].ctypes.data
        assert info.bases[2] == info.bases[3] != info.bases[0]
        assert info.nbytes == tuple(s.rank_region_nbytes(i) for i in range(4))
    assert pull_map(s, kimi(2), 0).peers  # the specs plan against each other
