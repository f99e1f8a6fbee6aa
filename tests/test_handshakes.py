"""Background handshakes (kvplan_nixl/serving/handshakes.py) against real side channel servers on
127.0.0.1: the caller never blocks, connect runs under the caller's lock with the fetches
outside it, a dead or hostile prefill fails its own handshake only, and close joins the threads.
The blobs here are stand-ins ``b"ENGINE#RANK"`` (``ident`` reads them); the attacks with real
endpoints and signed metadata are in tests/test_pool_attacks.py."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import ExitStack, closing

import pytest

from kvplan_nixl.errors import ArgumentError, ClosedError, MetadataError
from kvplan_nixl.serving import handshakes
from kvplan_nixl.serving import sidechannel as sc
from kvplan_nixl.serving.handshakes import FAILED, PENDING, READY, Handshakes

HOST = "127.0.0.1"


def ident(blob: bytes) -> tuple[str, int]:
    """The stand-in blobs' identity: ``b"P#1"`` is engine P's rank 1."""
    engine, _, rank = blob.decode().rpartition("#")
    return engine, int(rank)


def hshakes(connect=lambda e, r, b: None, **kw) -> Handshakes:
    return Handshakes(connect, lock=kw.pop("lock", threading.Lock()), identify=ident, **kw)


def wait_for(hs: Handshakes, key: tuple, kind: str, within: float = 5.0):
    end = time.monotonic() + within
    while (s := hs.state(*key)) is None or s.kind != kind:
        assert time.monotonic() < end, s
        time.sleep(0.005)
    return s


@pytest.fixture
def engine():
    """A prefill engine of 2 ranks: their servers and an address function."""
    with ExitStack() as stack:
        srvs = [stack.enter_context(sc.SideChannelServer(
            HOST, 0, sc.server_identity("P", r), metadata=f"P#{r}".encode())) for r in range(2)]
        yield srvs, (lambda r: (HOST, srvs[r].port, sc.server_identity("P", r)))


def at(srvs, engine="P"):
    """start()'s arguments for an engine whose rank 0 serves on ``srvs[0]``."""
    return engine, HOST, srvs[0].port


def test_connects_every_rank_connect_names_under_the_lock(engine):
    srvs, address = engine
    lock = threading.Lock()
    seen = []

    def connect(eng, rank, blob):
        assert lock.locked()  # the caller's Endpoint lock is held around connect
        seen.append((eng, rank, blob))
        return [0, 1]  # rank 0 names both (itself is skipped)

    before = threading.active_count()
    with hshakes(connect, lock=lock, timeout=2) as hs:
        with lock:  # the engine step holds the lock: fetches still happen, connect waits
            t0 = time.monotonic()
            assert hs.start(*at(srvs), address=address).kind == PENDING
            assert time.monotonic() - t0 < 0.05
            end = time.monotonic() + 5
            while srvs[0].stats["metadata"] == 0:
                assert time.monotonic() < end
                time.sleep(0.005)
            assert hs.state(*at(srvs)).kind == PENDING and seen == []
        s = wait_for(hs, at(srvs), READY)
        assert s.ranks == (0, 1) and seen == [("P", 0, b"P#0"), ("P", 1, b"P#1")]
        assert hs.start(*at(srvs), address=address) is hs.state(*at(srvs))  # nothing again
        assert srvs[0].stats["metadata"] == 1
    assert threading.active_count() == before


def test_a_silent_prefill_never_blocks_the_caller_and_fails_alone(engine):
    srvs, address = engine
    silent = socket.create_server((HOST, 0))  # accepts (backlog), never answers
    with closing(silent), hshakes(timeout=0.3, workers=2) as hs:
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        hs.start("dead", HOST, port)
        hs.start(*at(srvs), address=address)
        for _ in range(100):  # an engine step polling: every call returns at once
            hs.state("dead", HOST, port)
        assert time.monotonic() - t0 < 0.05
        assert wait_for(hs, at(srvs), READY).ranks == (0,)
        s = wait_for(hs, ("dead", HOST, port), FAILED)
        assert "SideChannelTimeout" in s.reason and f"127.0.0.1:{port}" in s.reason
        assert "(try 2 of 2)" in s.reason  # a timed-out fetch is tried once more by default


def test_a_fetch_that_times_out_once_is_tried_again_and_said_aloud(engine):
    """A prefill starved for one timeout (a loaded host) still connects, with a warning; the
    same stall with attempts=1 fails the handshake, naming the try."""
    srvs, address = engine
    stalls = []

    def fetch(host, port, **kw):
        if not stalls:  # the first fetch: a real side channel that never answers
            with closing(socket.create_server((HOST, 0))) as mute:
                stalls.append(port)
                return sc.fetch_metadata(HOST, mute.getsockname()[1], **kw)
        return sc.fetch_metadata(host, port, **kw)

    warned = []
    with hshakes(timeout=0.3, fetch=fetch, warn=warned.append) as hs:
        hs.start(*at(srvs), address=address)
        assert wait_for(hs, at(srvs), READY).ranks == (0,)
    assert len(warned) == 1 and "rank 0" in warned[0] and "try 2 of 2" in warned[0]
    assert "SideChannelTimeout" not in warned[0] and "no answer within 0.3 s" in warned[0]
    stalls.clear()
    with hshakes(timeout=0.3, fetch=fetch, attempts=1, warn=warned.append) as hs:
        hs.start(*at(srvs), address=address)
        s = wait_for(hs, at(srvs), FAILED)
    assert "(try 1 of 1)" in s.reason and len(warned) == 1


def test_a_fetch_the_server_closes_early_is_tried_again(engine):
    """A side channel closes a connection it cannot serve (here: over its connection cap, the
    same close a starved client meets past the server's deadline): the fetch is tried once
    more, said aloud, and the handshake completes; with attempts=1 it fails by that name."""
    srvs, address = engine
    closes = []

    def fetch(host, port, **kw):
        if not closes:  # the first fetch: a real server at its cap of one connection
            with sc.SideChannelServer(HOST, 0, "full", metadata=b"x", max_connections=1) as full, \
                    closing(socket.create_connection((HOST, full.port))):
                end = time.monotonic() + 5
                while full.stats["accepted"] == 0:  # the cap's one slot is taken
                    assert time.monotonic() < end
                    time.sleep(0.005)
                closes.append(port)
                return sc.fetch_metadata(HOST, full.port, **kw)
        return sc.fetch_metadata(host, port, **kw)

    warned = []
    with hshakes(timeout=2, fetch=fetch, warn=warned.append) as hs:
        hs.start(*at(srvs), address=address)
        assert wait_for(hs, at(srvs), READY).ranks == (0,)
    assert len(warned) == 1 and "closed the connection" in warned[0] and "try 2 of 2" in warned[0]
    closes.clear()
    with hshakes(timeout=2, fetch=fetch, attempts=1) as hs:
        hs.start(*at(srvs), address=address)
        s = wait_for(hs, at(srvs), FAILED)
    assert "SideChannelClosed" in s.reason and "(try 1 of 1)" in s.reason, s.reason


def test_a_refused_connection_is_not_tried_again(engine):
    """Nothing listens: the handshake fails at once, with no retry and no warning."""
    with closing(socket.create_server((HOST, 0))) as s:
        port = s.getsockname()[1]  # a port nothing listens on once closed
    warned = []
    with hshakes(timeout=2, warn=warned.append) as hs:
        hs.start("gone", HOST, port)
        st = wait_for(hs, ("gone", HOST, port), FAILED)
    assert warned == [] and "try" not in st.reason, st.reason


@pytest.mark.parametrize("attempts", [0, -1, 1.5, True])
def test_attempts_must_be_a_positive_int(attempts):
    with pytest.raises(ArgumentError, match="attempts"):
        hshakes(attempts=attempts)


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
    with closing(lsock), hshakes() as hs:
        hs.start("P", HOST, lsock.getsockname()[1])
        assert "above the limit" in wait_for(hs, ("P", HOST, lsock.getsockname()[1]),
                                             FAILED).reason
    t.join(5)

    def refuse(eng, rank, blob):
        raise MetadataError("not signed with this endpoint's secret")
    with sc.SideChannelServer(HOST, 0, "P#0", metadata=b"P#0") as srv, hshakes(refuse) as hs:
        hs.start("P", HOST, srv.port)
        assert "MetadataError: not signed" in wait_for(hs, at([srv]), FAILED).reason


def test_a_failed_address_is_retried_after_retry_after_s():
    with closing(socket.create_server((HOST, 0))) as s:
        gone = s.getsockname()[1]
    with hshakes(timeout=1, retry_after_s=0.2) as hs:
        hs.start("P", HOST, gone)
        failed = wait_for(hs, ("P", HOST, gone), FAILED)
        assert "cannot connect" in failed.reason
        with sc.SideChannelServer(HOST, gone, "P#0", metadata=b"P#0"):  # the prefill is back
            assert hs.start("P", HOST, gone) == failed  # too soon
            time.sleep(0.25)
            assert hs.start("P", HOST, gone).kind == PENDING
            wait_for(hs, ("P", HOST, gone), READY)
        hs.forget("P")
        assert hs.state("P", HOST, gone) is None


def test_state_is_kept_per_address_named():
    """A request naming engine P at a dead address fails that handshake only: P at its real
    address connects at once, before and after, and forgetting P forgets both."""
    with closing(socket.create_server((HOST, 0))) as s:
        dead = s.getsockname()[1]
    with sc.SideChannelServer(HOST, 0, "P#0", metadata=b"P#0") as srv, \
            hshakes(retry_after_s=60) as hs:
        hs.start("P", HOST, dead)
        assert wait_for(hs, ("P", HOST, dead), FAILED)
        hs.start("P", HOST, srv.port)
        assert wait_for(hs, ("P", HOST, srv.port), READY).ranks == (0,)
        assert hs.start("P", HOST, dead).failed  # still within its retry time
        hs.forget("P")
        assert hs.state("P", HOST, dead) is None and hs.state("P", HOST, srv.port) is None


def test_a_port_serving_another_ranks_metadata_fails_before_connect():
    seen = []
    # the banner says rank 0 (what the client checks); the blob is rank 1's
    with sc.SideChannelServer(HOST, 0, "P#0", metadata=b"P#1") as srv, \
            hshakes(lambda e, r, b: seen.append(r)) as hs:
        hs.start("P", HOST, srv.port)
        s = wait_for(hs, ("P", HOST, srv.port), FAILED)
    assert seen == [] and s.ranks == ()
    assert f"{HOST}:{srv.port} served the metadata of engine 'P' rank 1, not of engine 'P' " \
           "rank 0" in s.reason


def test_a_full_pool_refuses_at_once_and_records_nothing():
    with ExitStack() as stack:
        port, other = (stack.enter_context(closing(socket.create_server((h, 0)))).getsockname()[1]
                       for h in (HOST, "127.0.0.2"))
        hs = stack.enter_context(hshakes(timeout=1, workers=1, per_host=1, queued=4))
        assert hs.start("A", HOST, port).pending  # runs
        assert hs.start("B", HOST, port).pending  # waits: one per address
        t0 = time.monotonic()
        s = hs.start("C", HOST, port)  # a quarter of the queue for one host: full
        assert time.monotonic() - t0 < 0.05
        assert s.failed and "pool is full (1 waiting; at most 4 in all and 1 for host " \
            "127.0.0.1)" in s.reason
        assert hs.state("C", HOST, port) is None  # the next request tries again
        assert hs.start("D", "127.0.0.2", other).pending  # another host still gets in


def test_close_during_a_handshake_joins_its_thread():
    silent = socket.create_server((HOST, 0))
    before = threading.active_count()
    with closing(silent):
        hs = hshakes(timeout=0.5)
        hs.start("S", HOST, silent.getsockname()[1])
        t0 = time.monotonic()
        hs.close()
        assert time.monotonic() - t0 < 1.5
    assert threading.active_count() == before
    with pytest.raises(ClosedError):
        hs.start("S", HOST, 1)


def test_the_table_of_addresses_is_bounded(monkeypatch):
    """Each request may name a new address: past MAX_STATES a new one fails at once, until
    failed ones are past their retry time (then they are dropped to make room)."""
    monkeypatch.setattr(handshakes, "MAX_STATES", 2)
    dead = []
    for _ in range(3):
        with closing(socket.create_server((HOST, 0))) as s:
            dead.append(s.getsockname()[1])
    with hshakes(retry_after_s=0.3) as hs:
        for p in dead[:2]:
            hs.start("P", HOST, p)
            wait_for(hs, ("P", HOST, p), FAILED)
        s = hs.start("P", HOST, dead[2])
        assert s.failed and "2 prefill addresses are known" in s.reason
        assert hs.state("P", HOST, dead[2]) is None
        time.sleep(0.35)
        assert hs.start("P", HOST, dead[2]).pending
        assert hs.state("P", HOST, dead[0]) is None and hs.state("P", HOST, dead[1]) is None
