"""Background handshakes (kvplan_nixl/handshakes.py) against real side channel servers on
127.0.0.1: the caller never blocks, connect runs under the caller's lock with the fetches
outside it, a dead or hostile prefill fails its own engine only, and close joins the threads."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import ExitStack, closing

import pytest

from kvplan_nixl import sidechannel as sc
from kvplan_nixl.errors import ClosedError, MetadataError
from kvplan_nixl.handshakes import FAILED, PENDING, READY, Handshakes

HOST = "127.0.0.1"


def wait_for(hs: Handshakes, engine: str, kind: str, within: float = 5.0):
    end = time.monotonic() + within
    while (s := hs.state(engine)) is None or s.kind != kind:
        assert time.monotonic() < end, s
        time.sleep(0.005)
    return s


@pytest.fixture
def engine():
    """A prefill engine of 2 ranks: their servers and an address function."""
    with ExitStack() as stack:
        srvs = [stack.enter_context(sc.SideChannelServer(
            HOST, 0, sc.server_identity("P", r), metadata=f"md{r}".encode())) for r in range(2)]
        yield srvs, (lambda r: (HOST, srvs[r].port, sc.server_identity("P", r)))


def test_connects_every_rank_connect_names_under_the_lock(engine):
    srvs, address = engine
    lock = threading.Lock()
    seen = []

    def connect(eng, rank, blob):
        assert lock.locked()  # the caller's Endpoint lock is held around connect
        seen.append((eng, rank, blob))
        return [0, 1]  # rank 0 names both (itself is skipped)

    before = threading.active_count()
    with Handshakes(connect, lock=lock, timeout=2) as hs:
        with lock:  # the engine step holds the lock: fetches still happen, connect waits
            t0 = time.monotonic()
            assert hs.start("P", address).kind == PENDING
            assert time.monotonic() - t0 < 0.05
            end = time.monotonic() + 5
            while srvs[0].stats["metadata"] == 0:
                assert time.monotonic() < end
                time.sleep(0.005)
            assert hs.state("P").kind == PENDING and seen == []
        s = wait_for(hs, "P", READY)
        assert s.ranks == (0, 1) and seen == [("P", 0, b"md0"), ("P", 1, b"md1")]
        assert hs.start("P", address) is hs.state("P")  # ready: nothing started again
        assert srvs[0].stats["metadata"] == 1
    assert threading.active_count() == before


def test_a_silent_prefill_never_blocks_the_caller_and_fails_alone(engine):
    _, address = engine
    silent = socket.create_server((HOST, 0))  # accepts (backlog), never answers
    with closing(silent), Handshakes(lambda e, r, b: None, lock=threading.Lock(),
                                     timeout=0.3, workers=2) as hs:
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        hs.start("dead", lambda r: (HOST, port, None))
        hs.start("P", address)
        for _ in range(100):  # an engine step polling: every call returns at once
            hs.state("dead")
        assert time.monotonic() - t0 < 0.05
        assert wait_for(hs, "P", READY).ranks == (0,)
        s = wait_for(hs, "dead", FAILED)
        assert "SideChannelTimeout" in s.reason and f"127.0.0.1:{port}" in s.reason


def test_a_hostile_length_prefix_or_refused_metadata_fails_the_engine():
    lsock = socket.create_server((HOST, 0))

    def hostile():
        s, _ = lsock.accept()
        with closing(s):
            s.sendall(f"KVPSC1 {'0' * 32} P%230\n".encode())
            s.recv(100)
            s.sendall(b"\xff\xff\xff\xf0")
            time.sleep(1)
    t = threading.Thread(target=hostile, daemon=True)
    t.start()
    with closing(lsock), Handshakes(lambda e, r, b: None, lock=threading.Lock()) as hs:
        hs.start("H", lambda r: (HOST, lsock.getsockname()[1], "P#0"))
        assert "above the limit" in wait_for(hs, "H", FAILED).reason
    t.join(5)

    def refuse(eng, rank, blob):
        raise MetadataError("not signed with this endpoint's secret")
    with sc.SideChannelServer(HOST, 0, "P#0", metadata=b"x") as srv, \
            Handshakes(refuse, lock=threading.Lock()) as hs:
        hs.start("P", lambda r: (HOST, srv.port, "P#0"))
        assert "MetadataError: not signed" in wait_for(hs, "P", FAILED).reason


def test_a_failed_engine_is_retried_after_retry_after_s(engine):
    srvs, _ = engine
    with closing(socket.create_server((HOST, 0))) as s:
        gone = s.getsockname()[1]
    where = {"port": gone}
    with Handshakes(lambda e, r, b: None, lock=threading.Lock(), timeout=1,
                    retry_after_s=0.2) as hs:
        hs.start("P", lambda r: (HOST, where["port"], None))
        failed = wait_for(hs, "P", FAILED)
        where["port"] = srvs[0].port  # the prefill came back
        assert hs.start("P", lambda r: (HOST, where["port"], None)) == failed  # too soon
        time.sleep(0.25)
        assert hs.start("P", lambda r: (HOST, where["port"], None)).kind == PENDING
        wait_for(hs, "P", READY)
        hs.forget("P")
        assert hs.state("P") is None


def test_close_during_a_handshake_joins_its_thread():
    silent = socket.create_server((HOST, 0))
    before = threading.active_count()
    with closing(silent):
        hs = Handshakes(lambda e, r, b: None, lock=threading.Lock(), timeout=0.5)
        hs.start("S", lambda r: (HOST, silent.getsockname()[1], None))
        t0 = time.monotonic()
        hs.close()
        assert time.monotonic() - t0 < 1.5
    assert threading.active_count() == before
    with pytest.raises(ClosedError):
        hs.start("S", lambda r: (HOST, 1, None))
