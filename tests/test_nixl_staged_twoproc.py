"""Staged transfers across OS processes (tests/nixl_peer.py --stager), with peers killed and
stalled at chosen protocol steps.

Pull: decode rank 0 is this process, prefill ranks 0 and 1 serve from their own processes (they
gather; this side reads and scatters). Push: prefill ranks 0 and 1 are this process, decode rank
0 serves (it grants credits and scatters). After every fault, no staging slot, NIXL transfer or
request may be left on this side, nor (reported by the peer when it exits) on the peer's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time

import numpy as np
import pytest

from kvplan import simulate
from kvplan_nixl import Endpoint, State, TransferFailed, TransferTimeout
from kvplan_nixl.staged import Stager
from kvplan_nixl.staged import protocol as proto
from tests import oracle
from tests.nixl_util import PeerProc, attn, mla, spec

SRC = spec(2, attn(heads=4, nb=64), mla(nb=64))
DST = spec(1, attn(heads=4, nb=64), mla(nb=64))
SEED = 23
SLOT = 64 << 10
POOL = 4 * SLOT
SRC_BLOCKS = [list(range(50, 10, -1))]  # 40 blocks
DST_BLOCKS = [list(range(0, 64, 3))[:21] + list(range(1, 64, 3))[:19]]
IDLE = {"slots_in_use": 0, "xfer": 0, "requests": 0, "serving": 0}


def _idle(h: dict) -> dict:
    return {k: v for k, v in h.items() if k in IDLE}


def _write_md(path: str, ep: Endpoint) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(ep.metadata())
    os.replace(path + ".tmp", path)


def _peer(tmp, engine, s, rank, fill, connect: list[tuple[str, str]]) -> PeerProc:
    """One staged peer rank in its own process, connected back to this process's endpoints."""
    extra = ["--stager", f"{POOL},{SLOT}"]
    for path, mode in connect:
        extra += ["--connect", path, mode]
    return PeerProc(tmp, engine, s, rank, seed=SEED, fill=fill, extra=extra)


def _progress_until(ep: Endpoint, st: Stager, op: bytes, agent_suffix: str,
                    timeout: float = 20.0) -> None:
    """Progress only the endpoint (the stager does not act) until a message ``op`` from the
    agent ``...agent_suffix`` waits in the stager's inbox."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ep.progress()
        if any(m.startswith(b"kvs1 " + op) and a.split("#")[1] == agent_suffix
               for a, m in st.channel.inbox):
            return
        time.sleep(1e-3)
    raise AssertionError(f"no {op!r} from rank {agent_suffix} in {timeout} s")


def _expected_pull() -> dict:
    src = oracle.source_buffers(SRC.to_dict(), seed=SEED)
    before = {(0, i): np.zeros(DST.rank_region_nbytes(i), np.uint8)
              for i in range(len(DST.regions))}
    expected, _ = oracle.expected_destination(
        SRC.to_dict(), DST.to_dict(), SRC_BLOCKS, DST_BLOCKS, 0, src, before)
    return expected


@contextlib.contextmanager
def _pulling(tmp_path):
    """Decode rank 0 here (a Stager over zeroed buffers), prefill ranks 0 and 1 in their own
    processes, connected both ways: ``(bufs, ep, st, peers, plan)``; all closed after."""
    bufs = [np.zeros(DST.rank_region_nbytes(i), np.uint8) for i in range(len(DST.regions))]
    ep = Endpoint("decode", DST, 0, bufs)
    st = Stager(ep, pool_bytes=POOL, slot_bytes=SLOT)
    me = str(tmp_path / "decode.md")
    peers = [_peer(tmp_path, "prefill", SRC, r, "oracle", [(me, "push")]) for r in range(2)]
    try:
        metas = [p.ready() for p in peers]
        _write_md(me, ep)
        for p, m in zip(peers, metas, strict=True):
            assert p.line() == "connected"
            ep.connect(m, mode="pull")
        yield bufs, ep, st, peers, ep.map("prefill").plan(SRC_BLOCKS, DST_BLOCKS)
    finally:
        st.close()
        ep.close()
        for p in peers:
            p.kill()


def test_staged_pull_across_processes_and_a_peer_killed_between_gather_and_transfer(tmp_path):
    with _pulling(tmp_path) as (bufs, ep, st, peers, plan):
        t = st.read(plan, "prefill", notify=b"pull-1", timeout=30)
        assert t.wait() == {0: State.DONE, 1: State.DONE}
        assert t.chunks > 2 * len(t.peers) and t.descriptors == t.chunks
        for j, want in _expected_pull().items():
            assert np.array_equal(bufs[j], want), DST.regions[j].name
        assert _idle(st.handles()) == IDLE

        # rank 1 gathers a chunk and says READY; it dies before this side reads it
        for b in bufs:
            b[:] = 0
        t = st.read(plan, "prefill", timeout=30)
        _progress_until(ep, st, b"READY", "1")
        peers[1].proc.kill()
        peers[1].proc.wait(30)
        with pytest.raises(TransferFailed) as info:
            t.wait()
        err = info.value
        assert not isinstance(err, TransferTimeout)
        assert 1 in err.peer_ranks and "NIXL_ERR" in err.reasons[1]
        assert np.array_equal(np.sort(err.blocks[0]), np.sort(DST_BLOCKS[0]))
        assert _idle(st.handles()) == IDLE, st.handles()
        out = peers[0].finish()  # the live peer served its part and holds nothing
        assert _idle(out["stager"]) == IDLE, out["stager"]
        # the user's notify reached it once, from this rank, as a direct read delivers it
        assert out["notifications"] == [["decode", 0, "pull-1"]]


def test_staged_pull_fails_at_once_when_a_silent_peer_dies(tmp_path):
    """A peer that dies before it answered holds no NIXL transfer UCX could fail: the
    initiator's liveness probe (a PING after PROBE_S without a message) cannot leave once its
    process is gone, and the request fails then, not at its 30 s deadline."""
    with _pulling(tmp_path) as (_, _, st, peers, plan):
        assert st.read(plan, "prefill", timeout=30).wait() == {0: State.DONE, 1: State.DONE}
        peers[1].proc.send_signal(signal.SIGSTOP)  # it never answers this request's OPEN
        t = st.read(plan, "prefill", timeout=30)
        end = time.monotonic() + 2 * proto.PROBE_S
        while time.monotonic() < end:  # probes leave (the stopped peer's kernel takes them)
            st.poll()
            time.sleep(1e-3)
        assert not t.done
        peers[1].proc.kill()
        peers[1].proc.wait(30)
        killed = time.monotonic()
        with pytest.raises(TransferFailed) as info:
            t.wait()
        took = time.monotonic() - killed
        err = info.value
        assert not isinstance(err, TransferTimeout)
        assert err.peer_ranks == (1,) and "peer unreachable" in err.reasons[1], err.reasons
        assert took < 10, f"failed {took:.2f} s after the kill (deadline 30 s)"
        print(f"silent peer killed: TransferFailed {took:.3f} s after the kill (deadline 30 s)")
        assert _idle(st.handles()) == IDLE, st.handles()


def test_staged_push_across_processes_and_a_deadline_while_the_peer_scatters(tmp_path):
    src = oracle.source_buffers(SRC.to_dict(), seed=SEED)
    eps = [Endpoint("prefill", SRC, r, [src[(r, i)] for i in range(len(SRC.regions))])
           for r in range(2)]
    sts = [Stager(ep, pool_bytes=POOL, slot_bytes=SLOT) for ep in eps]
    mds = [str(tmp_path / f"prefill-{r}.md") for r in range(2)]
    target = _peer(tmp_path, "decode", DST, 0, "sentinel", [(m, "pull") for m in mds])
    try:
        meta = target.ready()
        for ep, path in zip(eps, mds, strict=True):
            _write_md(path, ep)
            ep.connect(meta, mode="push")
        assert target.line() == "connected"
        posted = [s.write(ep.map("decode", "push").plan(SRC_BLOCKS, DST_BLOCKS), "decode",
                          notify=b"push-1", timeout=30) for s, ep in zip(sts, eps, strict=True)]
        for t in posted:
            t.wait(progress=sts)
        assert all(t.ok for t in posted)

        # the server stops (SIGSTOP) after the first chunk was written: it holds a granted
        # slot and an unscattered chunk when this side's deadline passes
        t = sts[0].write(eps[0].map("decode", "push").plan(SRC_BLOCKS, DST_BLOCKS), "decode",
                         notify=b"push-2", timeout=1.0)
        job = t._jobs[0]
        while not (job.posted >= 1 and not job.xfers):
            sts[0].poll()
        target.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(TransferTimeout) as info:
                t.wait()
        finally:
            target.proc.send_signal(signal.SIGCONT)
        assert info.value.peer_ranks == (0,) and "deadline" in info.value.reasons[0]
        assert _idle(sts[0].handles()) == IDLE, sts[0].handles()
        out = target.finish()  # resumed: it got ABORT and freed the request's slots
        assert _idle(out["stager"]) == IDLE, out["stager"]
        # each completed push notified once; the one that failed at its deadline never did
        assert sorted(out["notifications"]) == [["prefill", 0, "push-1"],
                                                ["prefill", 1, "push-1"]]
    finally:
        for s in sts:
            s.close()
        for ep in eps:
            ep.close()
        target.kill()
    # bytes: the first (complete) push, then chunk(s) of the aborted one rewrite the same
    # bytes with the same values, so the result equals the oracle's
    before = oracle.destination_buffers(DST.to_dict(), seed=SEED)
    expected, _ = oracle.expected_destination(
        SRC.to_dict(), DST.to_dict(), SRC_BLOCKS, DST_BLOCKS, 0, src, before)
    ref = {k: v.copy() for k, v in before.items()}
    for p in posted:
        simulate(p.plan, src, ref)
    digest = [hashlib.sha256(expected[j].tobytes()).hexdigest() for j in sorted(expected)]
    assert out["sha256"] == digest
    assert digest == [hashlib.sha256(ref[(0, j)].tobytes()).hexdigest()
                      for j in range(len(DST.regions))]
