"""Close across OS processes: a prefill rank closes its endpoint but its process (and memory)
stays alive; the decode initiator holding its metadata must stop reading it.

The peer is a small script of its own (written to a temporary file) so that it can close its
endpoint on command and report what it loaded.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time

import numpy as np
import pytest

from kvplan_nixl import Endpoint, MetadataError, NotConnectedError, TransferFailed
from tests.nixl_util import attn, peer_env, spec

SRC = spec(1, attn(heads=4, nb=16))
DST = spec(1, attn(heads=4, nb=16))
KEY = "close-test-secret"

PEER = r"""
import json, select, sys, time
import numpy as np
from kvplan import EngineSpec
from kvplan_nixl import Endpoint
spec = EngineSpec.from_dict(json.loads(sys.argv[1]))
secret = sys.argv[3] or None
buf = np.full(spec.rank_region_nbytes(0), 7, np.uint8)
ep = Endpoint("prefill", spec, 0, [buf], secret=secret)
open(sys.argv[2], "wb").write(ep.metadata())
print("ready", flush=True)
while True:
    ep.progress()
    if select.select([sys.stdin], [], [], 0.001)[0]:
        cmd = sys.stdin.readline().strip()
        if cmd == "loaded":
            print(ep.handles()["remote_agents"], flush=True)
        elif cmd == "close":
            ep.close()
            print("closed", flush=True)
        else:
            break
print(int(buf.sum() == 7 * buf.size), flush=True)  # its memory is still there, untouched
"""


class Peer:
    def __init__(self, tmp, secret: str | None) -> None:
        script = tmp / "close_peer.py"
        script.write_text(PEER)
        self.md = tmp / "peer.md"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), json.dumps(SRC.to_dict()), str(self.md), secret or ""],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=peer_env(),
        )
        assert self.line(60) == "ready"

    def line(self, timeout: float = 30.0) -> str:
        assert select.select([self.proc.stdout], [], [], timeout)[0], "peer silent"
        return self.proc.stdout.readline().strip()

    def ask(self, cmd: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.line()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.mark.parametrize("secret", [None, KEY])
def test_closed_peer_is_dropped_by_its_initiator(tmp_path, secret):
    peer = Peer(tmp_path, secret)
    dst = np.zeros(DST.rank_region_nbytes(0), np.uint8)
    ep = Endpoint("decode", DST, 0, [dst], secret=secret)
    try:
        ep.connect(peer.md.read_bytes())
        plan = ep.map("prefill").plan([[1, 2]], [[3, 4]])
        ep.read(plan, "prefill", timeout=10).wait()  # progresses ep: the hello leaves too
        deadline = time.monotonic() + 10
        while peer.ask("loaded") != "1":  # the peer loaded us from the hello
            assert time.monotonic() < deadline, "hello never arrived"
            ep.progress()
        assert peer.ask("close") == "closed"
        deadline = time.monotonic() + 10
        while ep.peers():  # the close notice arrives at our next progress
            assert time.monotonic() < deadline, "close notice never arrived"
            ep.progress()
            time.sleep(1e-3)
        dst[:] = 0
        with pytest.raises(NotConnectedError, match="no pull connection to engine 'prefill'"):
            ep.read(plan, "prefill")
        assert not dst.any()  # nothing was read after the close
        assert ep.handles()["remote_agents"] == 0 and ep.handles()["dlist"] == 0
        assert peer.ask("quit") == "1"
    finally:
        ep.close()
        peer.stop()


def test_stale_metadata_of_a_closed_peer_cannot_be_used(tmp_path):
    """An initiator that connects with metadata of an endpoint closed before: the agent behind
    it is gone, so NIXL cannot reach it and connect refuses, leaving nothing behind."""
    peer = Peer(tmp_path, None)
    dst = np.zeros(DST.rank_region_nbytes(0), np.uint8)
    ep = Endpoint("decode", DST, 0, [dst])
    try:
        stale = peer.md.read_bytes()
        assert peer.ask("close") == "closed"
        before = ep.handles()
        with pytest.raises(MetadataError, match=r"engine 'prefill' rank 0: NIXL refused its "
                                                r"agent metadata \(NIXL_ERR_BACKEND\)"):
            ep.connect(stale)
        assert ep.handles() == before and not ep.peers()
        assert peer.ask("quit") == "1"
    finally:
        ep.close()
        peer.stop()


def test_closed_peer_unreadable_even_if_its_notice_is_lost(tmp_path, monkeypatch):
    """The second line of defence: an initiator that never processes the close notice (here it
    ignores it) and already holds a UCX connection. close() destroyed the peer's NIXL agent and
    UCX worker, so UCX fails the read (remote disconnect), naming the blocks; nothing arrives."""
    peer = Peer(tmp_path, None)
    dst = np.zeros(DST.rank_region_nbytes(0), np.uint8)
    ep = Endpoint("decode", DST, 0, [dst])
    monkeypatch.setattr(ep._handshake, "on_control", lambda agent, sender, msg: None)
    try:
        ep.connect(peer.md.read_bytes())
        plan = ep.map("prefill").plan([[1, 2]], [[3, 4]])
        ep.read(plan, "prefill", timeout=10).wait()
        assert peer.ask("close") == "closed"
        dst[:] = 0
        with pytest.raises(TransferFailed, match=r"peer rank 0: NIXL_ERR_REMOTE_DISCONNECT.*"
                                                 r"group 0 \[3 4\]"):
            ep.read(plan, "prefill").wait(10)
        assert not dst.any()
        assert peer.ask("quit") == "1"
    finally:
        ep.close()
        peer.stop()
