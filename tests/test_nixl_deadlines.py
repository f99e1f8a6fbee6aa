"""Deadlines of the executor's blocking calls against a real peer process that stops progressing.

The peer (tests/nixl_peer.py --stager, its own OS process) answers this side's HELLO and is
then stopped with SIGSTOP: its agent never progresses again, so a READ from its staging pool,
a staged request or a direct transfer from it cannot complete. Every blocking call must still
return by its deadline with a typed error naming the peer, and leave nothing held here.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvplan_nixl import Endpoint, PeerTimeout, TransferTimeout
from kvplan_nixl.staged import Stager
from tests.nixl_util import PeerProc, attn, spec

SRC = spec(1, attn(heads=4, nb=64))
DST = spec(1, attn(heads=4, nb=64))
SLOT = 64 << 10
POOL = 4 * SLOT
IDLE = {"slots_in_use": 0, "xfer": 0, "requests": 0, "serving": 0}


class _StopAfterPool:
    """Passed in ``progress=`` of calibrate: polled in each of its waits, it SIGSTOPs the peer
    process the first time the HELLO it sent was answered (the nonce left ``asking``)."""

    def __init__(self, st: Stager, proc) -> None:
        self.st, self.proc, self.stopped_at = st, proc, None
        self.seen = False

    def poll(self) -> int:
        if self.st._asking:
            self.seen = True
        elif self.seen and self.stopped_at is None:
            self.proc.send_signal(signal.SIGSTOP)
            self.stopped_at = time.monotonic()
        return 0


@pytest.fixture
def stalled(tmp_path, monkeypatch):
    """(endpoint, stager, peer process): decode rank 0 here, prefill rank 0 in its own process
    with a Stager, connected both ways (pull here, push there), UCX over TCP only on loopback.

    TCP because over CMA a READ is one-sided: once UCX had wired the connection up before the
    stop (a race with the HELLO's answer), a read from the stopped peer completed and the
    calibration deadline test failed about one run in six; over TCP the target must answer
    every read, so a stopped peer stalls it whenever the stop landed."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # read when each agent's UCX context is created
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    bufs = [np.zeros(DST.rank_region_nbytes(i), np.uint8) for i in range(len(DST.regions))]
    ep = Endpoint("decode", DST, 0, bufs)
    st = Stager(ep, pool_bytes=POOL, slot_bytes=SLOT)
    me = str(tmp_path / "decode.md")
    peer = PeerProc(tmp_path, "prefill", SRC, 0, seed=5,
                    extra=["--stager", f"{POOL},{SLOT}", "--connect", me, "push"])
    try:
        meta = peer.ready()
        with open(me + ".tmp", "wb") as f:
            f.write(ep.metadata())
        os.replace(me + ".tmp", me)
        assert peer.line() == "connected"
        ep.connect(meta, mode="pull")
        yield ep, st, peer
    finally:
        peer.kill()
        st.close()
        ep.close()


def test_calibrate_returns_by_its_deadline_when_the_peer_stops_after_hello(stalled):
    _, st, peer = stalled
    stop = _StopAfterPool(st, peer.proc)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout) as info:
        st.calibrate("prefill", timeout=2.0, progress=[stop])
    took = time.monotonic() - t0
    assert stop.stopped_at is not None, "the peer never answered HELLO"
    assert took < 2.0 + 1.0, took
    assert info.value.peer == "engine 'prefill' rank 0"
    assert "READ" in str(info.value) and "prefill" in str(info.value)
    assert "prefill" not in st.costs
    assert {k: v for k, v in st.handles().items() if k in IDLE} == IDLE, st.handles()


def test_staged_and_direct_waits_end_by_their_deadline_against_a_stopped_peer(stalled):
    ep, st, peer = stalled
    plan = ep.map("prefill").plan([list(range(8))], [list(range(8, 16))])
    peer.proc.send_signal(signal.SIGSTOP)
    for post in (lambda: st.read(plan, "prefill"), lambda: ep.read(plan, "prefill")):
        t = post()
        t0 = time.monotonic()
        try:
            t.wait(1.0)
        except TransferTimeout as exc:
            assert exc.peer_ranks == (0,)
        # a direct READ over loopback may complete without the stopped peer (the kernel copies
        # its memory): then it returned at once, which is within the deadline too
        assert time.monotonic() - t0 < 1.0 + 1.0
    assert {k: v for k, v in st.handles().items() if k in IDLE} == IDLE, st.handles()
    assert ep.handles()["xfer"] == 0
    t0 = time.monotonic()  # a server loop with nothing to do returns at its timeout
    assert st.serve(lambda: False, timeout=0.3) is False
    assert 0.3 <= time.monotonic() - t0 < 1.3

