"""End to end: real NIXL agents (UCX over loopback), real bytes, checked by the oracle."""

from __future__ import annotations

import numpy as np
import pytest

from kvplan.examples import gqa_with_mla_draft
from kvplan_nixl import Endpoint, State
from tests.nixl_util import attn, blocks, mla, notifications, pair, spec

# (id, source spec, destination spec, modes): every row of issue 3's list, small engines.
CASES = [
    ("gqa-p4-d2", spec(4, attn(heads=8)), spec(2, attn(heads=8)), ("pull", "push")),
    ("gqa-p2-d4", spec(2, attn(heads=8)), spec(4, attn(heads=8)), ("pull", "push")),
    (
        "mla+indexer-p2-d4",
        spec(2, mla("l0.mla"), mla("l0.idx", kind="indexer", dim=132, dtype="uint8", bs=64)),
        spec(4, mla("l0.mla"), mla("l0.idx", kind="indexer", dim=132, dtype="uint8", bs=64)),
        ("pull", "push"),
    ),
    (
        "gqa+mla-draft-p4-d2",
        gqa_with_mla_draft(4, layers=2, num_blocks=32),
        gqa_with_mla_draft(2, layers=2, num_blocks=32),
        ("pull", "push"),
    ),
    ("replicated-heads-p4-d2", spec(4, attn(heads=2)), spec(2, attn(heads=2)), ("pull",)),
    ("replicated-heads-p1-d4", spec(1, attn(heads=2)), spec(4, attn(heads=2)), ("pull", "push")),
    (
        "nhd-joint-p2-to-hnd-split-d4",
        spec(2, attn(heads=8, layout="NHD", kv="joint")),
        spec(4, attn(heads=8, layout="HND", kv="split")),
        ("pull", "push"),
    ),
    (
        "nhd-p4-d2",
        spec(4, attn(heads=8, layout="NHD")),
        spec(2, attn(heads=8, layout="NHD")),
        ("pull",),
    ),
    (
        "block-16-to-32",
        spec(2, attn(heads=4, bs=16, nb=64), mla(bs=16, nb=64)),
        spec(1, attn(heads=4, bs=32, nb=32), mla(bs=32, nb=32)),
        ("pull", "push"),
    ),
    (
        "block-64-to-16-window-groups",
        spec(1, attn("a", bs=64, nb=16), attn("w", bs=64, nb=16, group=1, window=40)),
        spec(2, attn("a", bs=16, nb=64), attn("w", bs=16, nb=64, group=1, window=40)),
        ("pull",),
    ),
]


@pytest.mark.parametrize(
    ("src", "dst", "mode"),
    [
        pytest.param(s, d, m, id=f"{name}-{m}")
        for name, s, d, modes in CASES
        for m in modes
    ],
)
def test_transfer_matches_oracle(src, dst, mode):
    rng = np.random.default_rng(11)
    # the destination list one block short of the source: partial blocks on one side
    n_src = [max(1, min(r.num_blocks for r in src.regions if r.group == g) // 2)
             for g in range(src.num_groups)]
    bs_src = [max(r.block_size for r in src.regions if r.group == g) for g in range(src.num_groups)]
    bs_dst = [max(r.block_size for r in dst.regions if r.group == g) for g in range(dst.num_groups)]
    n_dst = [max(1, (n * a) // b - 1) for n, a, b in zip(n_src, bs_src, bs_dst, strict=True)]
    sb, db = blocks(rng, src, n_src), blocks(rng, dst, n_dst)
    with pair(src, dst) as pr:
        pr.connect(mode)
        posted = pr.run(mode, sb, db, notify=b"req-1")
        assert all(t.ok and t.done for t in posted)
        assert all(s is State.DONE for t in posted for s in t.states().values())
        assert pr.check(sb, db, [t.plan for t in posted]) > 0
        # every part notified its target once, with the sender's engine and rank
        targets = pr.p if mode == "pull" else pr.d
        sender = "decode" if mode == "pull" else "prefill"
        want = sorted((sender, i, peer) for i, t in enumerate(posted) for peer in t.peers)
        got = notifications(targets, len(want))
        assert sorted((n.engine, n.rank, rank) for rank, n in got) == want
        assert {n.message for _, n in got} == {b"req-1"}
        assert all(ep.handles()["xfer"] == 0 for ep in pr.endpoints)


def test_descriptors_are_the_plans_runs():
    """NIXL's own descriptor count (telemetry) equals the plan's number of maximal runs."""
    src, dst = spec(4, attn(heads=8, layout="NHD")), spec(2, attn(heads=8, nb=32))
    rng = np.random.default_rng(5)
    sb, db = blocks(rng, src, 20), blocks(rng, dst, 20)
    with pair(src, dst, telemetry=True) as pr:
        pr.connect("pull")
        posted = pr.run("pull", sb, db)
        for t in posted:
            runs = t.runs()
            assert t.desc_counts() == runs
            assert sum(runs.values()) == len(t.plan.copies())
        pr.check(sb, db, [t.plan for t in posted])


def test_repeated_requests_reuse_descriptor_lists():
    src, dst = spec(2, attn(heads=4), mla()), spec(2, attn(heads=4), mla())
    rng = np.random.default_rng(9)
    with pair(src, dst) as pr:
        pr.connect("pull")
        handles = pr.d[0].handles()
        pr.d[0].connect(pr.p[1].metadata())  # connecting a connected peer again: a no-op
        assert pr.d[0].handles() == handles
        lists = handles["dlist"]
        for _ in range(5):
            sb = blocks(rng, src, int(rng.integers(1, 20)))
            db = blocks(rng, dst, len(sb[0]))
            pr.check(sb, db, [t.plan for t in pr.run("pull", sb, db)])
            pr.before = {k: v.copy() for k, v in pr.dst_bufs.items()}
        assert pr.d[0].handles()["dlist"] == lists  # nothing prepared per request


def test_empty_plan_is_done_at_once():
    src, dst = spec(1, attn()), spec(1, attn())
    with pair(src, dst) as pr:
        pr.connect("pull")
        plan = pr.d[0].map("prefill").plan([[]], [[]])
        t = pr.d[0].read(plan, "prefill")
        assert t.done and t.ok and t.peers == () and t.wait(0) == {}


def test_torch_tensors_and_address_pairs_as_buffers():
    import torch  # the README installs CPU torch; a missing torch fails, never skips
    s = spec(1, attn(heads=2), mla())
    rng = np.random.default_rng(1)
    src = [torch.from_numpy(rng.integers(0, 256, s.rank_region_nbytes(i), dtype=np.uint8))
           for i in range(2)]
    dst_np = [np.zeros(s.rank_region_nbytes(i), np.uint8) for i in range(2)]
    dst = [(a.ctypes.data, a.nbytes) for a in dst_np]
    from kvplan_nixl import Endpoint

    with Endpoint("prefill", s, 0, src) as p, Endpoint("decode", s, 0, dst) as d:
        d.connect(p.metadata())
        plan = d.map("prefill").plan([[3, 5]], [[7, 1]])
        d.read(plan, "prefill").wait(10, progress=[p])
        import kvplan

        ref = {(0, i): np.zeros_like(a) for i, a in enumerate(dst_np)}
        kvplan.simulate(plan, {(0, i): t.numpy() for i, t in enumerate(src)}, ref)
        assert all(np.array_equal(ref[(0, i)], a) for i, a in enumerate(dst_np))


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_num_threads_two_lands_the_oracle_bytes(mode):
    """NIXL's multi-threaded UCX engine (``num_threads=2`` on every agent): a hetero-TP
    request with scattered block ids (hundreds of small runs) lands byte for byte."""
    src = spec(4, attn(heads=8, nb=64), mla(nb=64))
    dst = spec(2, attn(heads=8, nb=64, layout="NHD"), mla(nb=64))
    rng = np.random.default_rng(21)
    sb, db = blocks(rng, src, 48), blocks(rng, dst, 48)
    with pair(src, dst, num_threads=2) as pr:
        assert all(ep.num_threads == 2 for ep in pr.endpoints)
        pr.connect(mode)
        posted = pr.run(mode, sb, db, notify=b"mt")
        assert all(t.ok for t in posted)
        assert sum(len(t.plan) for t in posted) > 500  # many descriptors to share
        assert pr.check(sb, db, [t.plan for t in posted]) > 0
        targets = pr.p if mode == "pull" else pr.d
        want = sum(len(t.peers) for t in posted)
        assert len(notifications(targets, want)) == want


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, None])
def test_num_threads_must_be_a_non_negative_int(bad):
    s = spec(1, attn(heads=4))
    with pytest.raises(ValueError, match=f"num_threads .* got {bad!r}"):
        Endpoint("decode", s, 0, [np.zeros(s.rank_region_nbytes(0), np.uint8)],
                 num_threads=bad)


@pytest.mark.parametrize("preset", [None, "8K"])
def test_ucx_tcp_segment_default_is_set_only_where_the_user_set_none(preset):
    """kvplan_nixl sets UCX's TCP segment size to 256 KiB (a contiguous READ over TCP ran at
    48% of a TCP stream with UCX's 8 KiB, 83-100% with 256 KiB) unless the user chose one."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_TCP_")}
    if preset is not None:
        env["UCX_TCP_TX_SEG_SIZE"] = preset
    code = ("import os, kvplan_nixl._nixl; "  # imported with the first agent
            "print(os.environ['UCX_TCP_TX_SEG_SIZE'], os.environ['UCX_TCP_RX_SEG_SIZE'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert out == ([preset or "256K", "256K"])
