"""Across OS processes: metadata passed through files, peers stalled and killed for real.

Prefill ranks 0 and 1 run as two processes (``tests/nixl_peer.py``); decode rank 0 is this
process. The tests of this module run in file order on the same two peers: correct pull, a
stalled peer (deadline), then a killed peer and its replacement.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time

import numpy as np
import pytest

from kvplan import pull_map, push_map, simulate
from kvplan_nixl import Endpoint, State, TransferFailed, TransferTimeout
from tests import oracle
from tests.nixl_util import PeerProc, attn, mla, spec

SRC = spec(2, attn(heads=4, nb=64), mla(nb=64))
DST = spec(1, attn(heads=4, nb=64), mla(nb=64))
SEED = 21
SRC_BLOCKS = [list(range(40, 8, -1))]  # 32 blocks, descending
DST_BLOCKS = [list(range(0, 64, 2))]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peers")
    peers = [PeerProc(tmp, "prefill", SRC, r, seed=SEED) for r in range(2)]
    bufs = [np.zeros(DST.rank_region_nbytes(i), np.uint8) for i in range(len(DST.regions))]
    ep = Endpoint("decode", DST, 0, bufs)
    try:
        metas = [p.ready() for p in peers]
        yield {"tmp": tmp, "peers": peers, "ep": ep, "bufs": bufs, "metas": metas}
    finally:
        ep.close()
        for p in peers:
            p.kill()


def _expected(before):
    src = oracle.source_buffers(SRC.to_dict(), seed=SEED)
    ref = {(0, i): b.copy() for i, b in enumerate(before)}
    simulate(pull_map(SRC, DST, 0).plan(SRC_BLOCKS, DST_BLOCKS), src, ref)
    return [ref[(0, i)] for i in range(len(before))]


def _read_verified(world, notify: bytes):
    ep, bufs = world["ep"], world["bufs"]
    for b in bufs:
        b[:] = 0
    plan = ep.map("prefill").plan(SRC_BLOCKS, DST_BLOCKS)
    t = ep.read(plan, "prefill", notify=notify)
    assert t.wait(20) == {0: State.DONE, 1: State.DONE}
    for got, want in zip(bufs, _expected([np.zeros_like(b) for b in bufs]), strict=True):
        assert np.array_equal(got, want)


def test_pull_across_processes(world):
    ep = world["ep"]
    for m in world["metas"]:  # metadata written by the other processes, read from files
        ep.connect(m)
    assert [(p.engine, p.rank) for p in ep.peers()] == [("prefill", 0), ("prefill", 1)]
    _read_verified(world, b"first")
    # and against the independent oracle, untouched bytes included
    src = oracle.source_buffers(SRC.to_dict(), seed=SEED)
    before = {(0, i): np.zeros_like(b) for i, b in enumerate(world["bufs"])}
    expected, _ = oracle.expected_destination(
        SRC.to_dict(), DST.to_dict(), SRC_BLOCKS, DST_BLOCKS, 0, src, before
    )
    for j, want in expected.items():
        assert np.array_equal(world["bufs"][j], want)
    assert ep.handles()["xfer"] == 0


def test_stalled_peer_hits_the_deadline_then_recovers(world):
    ep, stalled = world["ep"], world["peers"][1]
    plan = ep.map("prefill").plan(SRC_BLOCKS, DST_BLOCKS)
    stalled.proc.send_signal(signal.SIGSTOP)
    try:
        t = ep.read(plan, "prefill", notify=b"stalled")
        start = time.monotonic()
        with pytest.raises(TransferTimeout) as info:
            t.wait(timeout=0.3)
        assert time.monotonic() - start < 5
        # an abort from the caller: cancel releases the in-flight part, reported like a failure
        c = ep.read(plan, "prefill", notify=b"cancelled")
        assert c.poll()[1] is State.PENDING
        c.cancel("request aborted", peers=[1])  # only the stalled part; rank 0's completes
        with pytest.raises(TransferFailed, match="rank 1: request aborted") as aborted:
            c.wait(timeout=10)
        assert not isinstance(aborted.value, TransferTimeout)
        assert aborted.value.peer_ranks == (1,)
        assert c.states() == {0: State.DONE, 1: State.FAILED}
    finally:
        stalled.proc.send_signal(signal.SIGCONT)
    err = info.value
    assert err.peer_rank == 1 and err.peer_ranks == (1,)
    assert "deadline" in err.reasons[1]
    assert np.array_equal(err.blocks[0], DST_BLOCKS[0])
    assert t.states() == {0: State.DONE, 1: State.FAILED}
    assert ep.handles()["xfer"] == 0 and ep.handles()["transfers"] == 0
    _read_verified(world, b"after-stall")  # the same connection works again


def test_killed_peer_fails_the_transfer_and_a_restarted_one_replaces_it(world):
    ep, victim = world["ep"], world["peers"][1]
    plan = ep.map("prefill").plan(SRC_BLOCKS, DST_BLOCKS)
    victim.proc.send_signal(signal.SIGSTOP)  # hold its part in flight ...
    t = ep.read(plan, "prefill", notify=b"doomed")
    assert t.poll()[1] is State.PENDING
    victim.proc.kill()  # ... and kill the process during the transfer
    victim.proc.wait(30)
    with pytest.raises(TransferFailed) as info:
        t.wait(timeout=10)
    err = info.value
    assert not isinstance(err, TransferTimeout)
    assert err.peer_ranks == (1,) and "NIXL_ERR_REMOTE_DISCONNECT" in err.reasons[1]
    assert np.array_equal(err.blocks[0], DST_BLOCKS[0])
    assert "destination blocks that may not have arrived: group 0 [0 2 4" in str(err)
    assert ep.handles()["xfer"] == 0
    # a new request to the dead rank fails at once, named, with no handle left
    with pytest.raises(TransferFailed, match="rank 1"):
        ep.read(plan, "prefill").wait(timeout=10)
    assert ep.handles()["xfer"] == 0
    # the rank restarts (new agent): connecting its metadata replaces the dead peer
    world["peers"][1] = PeerProc(world["tmp"], "prefill", SRC, 1, seed=SEED)
    before = ep.handles()
    ep.connect(world["peers"][1].ready())
    assert ep.handles() == before
    _read_verified(world, b"replaced")


def test_peers_received_notifications(world):
    first, replaced = (p.finish() for p in world["peers"])
    assert [n[2] for n in first["notifications"]] == [
        "first", "stalled", "cancelled", "after-stall", "doomed", "replaced"
    ]
    assert {tuple(n[:2]) for n in first["notifications"]} == {("decode", 0)}
    assert [n[2] for n in replaced["notifications"]] == ["replaced"]


def test_push_into_another_process(tmp_path):
    target = PeerProc(tmp_path, "decode", DST, 0, seed=SEED, fill="sentinel")
    src = oracle.source_buffers(SRC.to_dict(), seed=SEED)
    eps = [Endpoint("prefill", SRC, r, [src[(r, i)] for i in range(len(SRC.regions))])
           for r in range(2)]
    try:
        meta = target.ready()
        posted = []
        for ep in eps:
            ep.connect(meta, mode="push")
            plan = ep.map("decode", "push").plan(SRC_BLOCKS, DST_BLOCKS)
            assert plan.map == push_map(SRC, DST, ep.rank)
            posted.append(ep.write(plan, "decode", notify=b"pushed"))
        for t in posted:
            t.wait(20)
        out = target.finish()
    finally:
        for ep in eps:
            ep.close()
        target.kill()
    before = oracle.destination_buffers(DST.to_dict(), seed=SEED)
    expected, _ = oracle.expected_destination(
        SRC.to_dict(), DST.to_dict(), SRC_BLOCKS, DST_BLOCKS, 0, src, before
    )
    ref = {k: v.copy() for k, v in before.items()}
    for t in posted:
        simulate(t.plan, src, ref)
    digest = [hashlib.sha256(ref[(0, j)].tobytes()).hexdigest() for j in range(len(DST.regions))]
    assert out["sha256"] == digest  # the executor moved exactly the plans' bytes
    oracle_digest = [hashlib.sha256(expected[j].tobytes()).hexdigest() for j in sorted(expected)]
    assert out["sha256"] == oracle_digest  # and the plans are the oracle's
    assert sorted(n[1] for n in out["notifications"]) == [0, 1]
    assert os.path.exists(target.md_path)
