"""The side channel (kvplan_nixl/serving/sidechannel.py) over real sockets on 127.0.0.1, real
threads: the protocol, then attacks (forged, replayed, unsigned, malformed, oversized, a hostile
metadata server, slow clients, a taken port), each asserting what the protection prevents."""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
import tracemalloc
from contextlib import closing, contextmanager
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplan_nixl.errors import ArgumentError, ExecutorError
from kvplan_nixl.serving import sidechannel as sc
from kvplan_nixl.serving.holds import Holds, Verdict

SECRET = b"deployment-secret-0123456789"
ID = sc.server_identity("prefill", 0)
HOST = "127.0.0.1"


@contextmanager
def server(secret=SECRET, **kw):
    holds, lock = Holds(), threading.Lock()
    before = threading.active_count()
    srv = sc.SideChannelServer(HOST, 0, ID, metadata=kw.pop("metadata", b"blob"),
                               secret=secret, holds=holds, lock=lock, **kw)
    try:
        yield srv, holds
    finally:
        srv.close()
    assert threading.active_count() == before  # the server's thread is gone


def held(holds: Holds, srv, req="r", lease=30.0, readers=0) -> int:
    with srv.lock:
        return holds.hold(req, time.monotonic(), lease, readers=readers)


def raw(port: int, line: bytes, wait=True) -> tuple[str, bytes]:
    """(the banner's nonce, the answer) of one hand-made request line."""
    with closing(socket.create_connection((HOST, port), timeout=5)) as s:
        f = s.makefile("rb")
        banner = f.readline().decode().split()
        s.sendall(line)
        return banner[1], (f.read() if wait else b"")


def signed_line(nonce: str, verb="RELEASE", req="r", gen=1, secret=SECRET, ident=ID,
                client_nonce=None) -> bytes:
    fields = [verb, quote(req, safe=""), str(gen), "0", nonce,
              client_nonce or os.urandom(16).hex()]
    mac = sc._request_mac(sc._key(secret), ident, fields)
    return (" ".join([*fields, mac.hex()]) + "\n").encode()


# -- the protocol -------------------------------------------------------------------------------

def test_metadata_and_control_round_trip():
    blob = os.urandom(3 << 20)
    with server(metadata=blob) as (srv, holds):
        assert sc.fetch_metadata(HOST, srv.port, identity=ID) == blob
        g = held(holds, srv, "req with spaces/é", readers=1)
        kw = dict(identity=ID, secret=SECRET)
        assert sc.control(HOST, srv.port, "RENEW", "req with spaces/é", g, **kw) is Verdict.YES
        assert sc.confirm(HOST, srv.port, "req with spaces/é", g, **kw) is True
        # the one reader confirmed: the hold ended, so a second CONFIRM is refused
        assert sc.confirm(HOST, srv.port, "req with spaces/é", g, **kw) is False
        assert holds.finished(time.monotonic()) == ["req with spaces/é"]
        assert srv.stats["metadata"] == 1 and srv.stats["control"] == 3


def test_the_last_of_the_readers_the_decode_names_ends_the_hold():
    with server() as (srv, holds):
        g = held(holds, srv)  # the prefill does not know how many decode ranks read it
        kw = dict(identity=ID, secret=SECRET, readers=2)
        assert sc.confirm(HOST, srv.port, "r", g, **kw) and "r" in holds
        assert sc.confirm(HOST, srv.port, "r", g, **kw) and "r" not in holds
        assert holds.finished(time.monotonic()) == ["r"]


def test_without_a_secret_peers_are_trusted():
    with server(secret=None) as (srv, holds):
        g = held(holds, srv)
        assert sc.control(HOST, srv.port, "RELEASE", "r", g, identity=ID) is Verdict.YES
        assert "r" not in holds


def test_confirm_waits_for_a_hold_that_has_not_reached_the_worker_yet():
    with server() as (srv, holds):
        gen = 10**15

        def late():
            time.sleep(0.05)
            with srv.lock:
                holds.hold("r", time.monotonic(), 30.0, generation=gen)
        t = threading.Thread(target=late)
        t.start()
        # a generous timeout: on a loaded host the LATER answers may take seconds to turn
        assert sc.confirm(HOST, srv.port, "r", gen, identity=ID, secret=SECRET, timeout=10)
        t.join()
        # and never: LATER until the deadline, then not confirmed
        assert not sc.confirm(HOST, srv.port, "r", gen + 1, identity=ID, secret=SECRET,
                              timeout=0.1)


def test_lease_runs_out_without_heartbeats_and_not_with_them():
    with server() as (srv, holds):
        kw = dict(identity=ID, secret=SECRET)
        a = held(holds, srv, "a", lease=0.3)
        b = held(holds, srv, "b", lease=0.3)
        for _ in range(6):  # a live decode: a heartbeat every lease / 3
            time.sleep(0.1)
            assert sc.control(HOST, srv.port, "RENEW", "b", b, **kw) is Verdict.YES
        assert not sc.confirm(HOST, srv.port, "a", a, **kw)  # past its lease: freed
        assert sc.control(HOST, srv.port, "RENEW", "a", a, **kw) is Verdict.NO
        assert sc.confirm(HOST, srv.port, "b", b, **kw)
        assert holds.counts["expired"] == 1 and holds.counts["refused"] == 1


def test_a_lease_pins_the_hold_and_its_reader_returns_it():
    """LEASE (docs/vllm.md, "Reporting inside a lease"): a yes renews and pins the hold; a
    RELEASE meanwhile is deferred (answered yes: it will end), and the leasing reader's RETURN
    (its CONFIRM) ends it; the time the client returns was taken before the message left."""
    with server() as (srv, holds):
        g = held(holds, srv, lease=0.2, readers=2)
        kw = dict(identity=ID, secret=SECRET)
        before = time.monotonic()
        v, sent = sc.lease(HOST, srv.port, "r", g, 5.0, **kw)
        assert v is Verdict.YES and before <= sent <= time.monotonic()
        assert sc.control(HOST, srv.port, "RELEASE", "r", g, **kw) is Verdict.YES
        time.sleep(0.3)  # past the hold's own lease: the pin keeps it
        assert "r" in holds and holds.counts["deferred"] == 1
        assert sc.control(HOST, srv.port, "RENEW", "r", g, **kw) is Verdict.NO  # released
        assert sc.confirm(HOST, srv.port, "r", g, readers=2, leased=True, **kw)
        assert "r" not in holds and holds.finished(time.monotonic()) == ["r"]
        assert sc.lease(HOST, srv.port, "r", g, 5.0, **kw)[0] is Verdict.NO  # ended
        # a generation not held yet: asked again until the timeout, then LATER
        assert sc.lease(HOST, srv.port, "r", g + 10**9, 1.0, timeout=0.05,
                        **kw)[0] is Verdict.LATER
        with pytest.raises(ArgumentError, match="pin_s"):
            sc.lease(HOST, srv.port, "r", g, 601.0, **kw)


def test_a_lease_sent_on_a_spare_connection_is_one_send_and_one_answer():
    """A spare (Spares): opened and its banner read ahead, so the LEASE is sent at once from
    the caller's thread and its answer read later; one spare per rank, taken once; too old,
    closed and not handed out; a spare the server dropped at its deadline (it acted on
    nothing) is sent again on a new connection; a spare to another identity is never kept."""
    with server(deadline_s=0.3) as (srv, holds):
        g = held(holds, srv, lease=0.2, readers=1)
        kw = dict(identity=ID, secret=SECRET)
        spares = sc.Spares()
        assert spares.take(HOST, srv.port, ID) is None
        spares.fill(HOST, srv.port, ID, 5.0)
        accepted = srv.stats["accepted"]
        spares.fill(HOST, srv.port, ID, 5.0)  # a young spare is there: no second connection
        assert srv.stats["accepted"] == accepted and len(spares) == 1
        got = spares.take(HOST, srv.port, ID)
        assert got is not None and spares.take(HOST, srv.port, ID) is None and not len(spares)
        before = time.monotonic()
        first = sc.send_lease(*got, "r", g, 5.0, **kw)
        assert before <= first.sent <= time.monotonic()
        v, sent = sc.lease(HOST, srv.port, "r", g, 5.0, first=first, **kw)
        assert v is Verdict.YES and sent == first.sent and holds.counts["leased"] == 1
        assert srv.stats["accepted"] == accepted  # answered on the spare: no new connection
        assert sc.confirm(HOST, srv.port, "r", g, readers=1, leased=True, **kw)
        assert "r" not in holds  # the RETURN ended it: the pin was the reader's

        g = held(holds, srv, req="s", readers=1)  # the server drops a silent spare at 0.3 s
        spares.fill(HOST, srv.port, ID, 5.0)
        time.sleep(0.6)
        first = sc.send_lease(*spares.take(HOST, srv.port, ID), "s", g, 5.0, **kw)
        v, sent = sc.lease(HOST, srv.port, "s", g, 5.0, first=first, **kw)
        assert v is Verdict.YES and sent > first.sent and holds.counts["leased"] == 2
        assert srv.stats["timeouts"] >= 1

        old = sc.Spares(max_age=0.05)  # too old on our side: closed, not handed out
        old.fill(HOST, srv.port, ID, 5.0)
        time.sleep(0.1)
        assert old.take(HOST, srv.port, ID) is None and not len(old)
        with pytest.raises(sc.SideChannelRejected, match="serves"):
            spares.fill(HOST, srv.port, sc.server_identity("other", 0), 5.0)
        assert not len(spares)
        spares.fill(HOST, srv.port, ID, 5.0)
        spares.close()
        assert not len(spares)
        spares.fill(HOST, srv.port, ID, 5.0)  # after close: none kept
        assert not len(spares)


def test_a_server_without_lease_refuses_it_and_acts_on_nothing():
    """An older kvplan prefill knows RELEASE, RENEW and CONFIRM only: its parser answers an
    unknown verb ``ERR malformed`` and acts on nothing (as _parse_control did before LEASE);
    the client raises SideChannelRejected, and the decode waits for its CONFIRM."""
    old_verbs = ("RELEASE", "RENEW", "CONFIRM")

    class OldServer(sc.SideChannelServer):  # today's server with the old parser's verbs
        def _answer(self, c, line):
            if line.split(b" ", 1)[0].decode(errors="replace") not in (*old_verbs, "MD"):
                return self._refuse("malformed")
            return super()._answer(c, line)

    holds, lock = Holds(), threading.Lock()
    with OldServer(HOST, 0, ID, secret=SECRET, holds=holds, lock=lock) as srv:
        g = held(holds, srv, readers=1)
        with pytest.raises(sc.SideChannelRejected, match="malformed") as e:
            sc.lease(HOST, srv.port, "r", g, 5.0, identity=ID, secret=SECRET)
        assert e.value.reason == "malformed" and holds.counts["leased"] == 0
        assert sc.control(HOST, srv.port, "RELEASE", "r", g, identity=ID,
                          secret=SECRET) is Verdict.YES  # not pinned: ends at once
        assert "r" not in holds


def test_a_forged_or_unsigned_lease_is_refused_and_pins_nothing():
    with server() as (srv, holds):
        g = held(holds, srv)
        with pytest.raises(sc.SideChannelRejected, match="forged"):
            sc.lease(HOST, srv.port, "r", g, 5.0, identity=ID, secret=b"other")
        _, ans = raw(srv.port, f"LEASE r {g} 5000 {'0' * 32} {'1' * 32} -\n".encode())
        assert ans == b"ERR unsigned\n"
        with closing(socket.create_connection((HOST, srv.port))) as s:  # signed, pin too long
            f = s.makefile("rb")
            nonce = f.readline().split()[1].decode()
            line = signed_line(nonce, "LEASE", gen=g).replace(b" 0 " + nonce.encode(),
                                                              b" 600001 " + nonce.encode())
            s.sendall(line)
            assert f.read() == b"ERR malformed\n"
        assert holds.counts["leased"] == 0
        assert sc.control(HOST, srv.port, "RELEASE", "r", g, identity=ID,
                          secret=SECRET) is Verdict.YES and "r" not in holds  # not deferred
        assert (srv.stats["forged"], srv.stats["unsigned"], srv.stats["malformed"]) == (1, 1, 1)


def test_identity_mismatch_is_refused_by_the_client():
    with server() as (srv, _):
        with pytest.raises(sc.SideChannelRejected, match="serves 'prefill#0', not 'prefill#1'"):
            sc.fetch_metadata(HOST, srv.port, identity=sc.server_identity("prefill", 1))


# -- attacks under a secret ---------------------------------------------------------------------

def test_forged_release_and_confirm_are_dropped():
    with server() as (srv, holds):
        g = held(holds, srv, readers=1)
        with pytest.raises(sc.SideChannelRejected, match="forged") as e:
            sc.control(HOST, srv.port, "RELEASE", "r", g, identity=ID, secret=b"other")
        assert e.value.reason == "forged" and e.value.port == srv.port
        # hand-made: a nonce of no connection, a random mac
        _, ans = raw(srv.port, signed_line("0" * 32, gen=g)[:-65] + b"f" * 64 + b"\n")
        assert ans == b"ERR replayed\n"  # echoes a nonce this connection never issued
        with closing(socket.create_connection((HOST, srv.port))) as s:
            f = s.makefile("rb")
            nonce = f.readline().split()[1].decode()
            s.sendall(f"CONFIRM r {g} 0 {nonce} {'1' * 32} {'a' * 64}\n".encode())
            assert f.read() == b"ERR forged\n"
        _, ans = raw(srv.port, f"RELEASE r {g} 0 {'0' * 32} {'1' * 32} -\n".encode())
        assert ans == b"ERR unsigned\n"
        assert holds.generation("r") == g  # nothing acted on
        assert holds.counts["confirmed"] == holds.counts["released"] == 0
        assert (srv.stats["forged"], srv.stats["replayed"], srv.stats["unsigned"]) == (2, 1, 1)
        # the genuine one still works
        assert sc.control(HOST, srv.port, "RELEASE", "r", g, identity=ID,
                          secret=SECRET) is Verdict.YES


def test_a_recorded_message_replayed_is_refused():
    with server() as (srv, holds):
        g = held(holds, srv, readers=2)
        with closing(socket.create_connection((HOST, srv.port))) as s:
            f = s.makefile("rb")
            nonce = f.readline().split()[1].decode()
            line = signed_line(nonce, "CONFIRM", gen=g)
            s.sendall(line)
            assert f.read().startswith(b"YES ")  # the genuine message, recorded
        assert holds.generation("r") == g  # one of two readers
        _, ans = raw(srv.port, line)  # replayed verbatim on a new connection
        assert ans == b"ERR replayed\n"
        with closing(socket.create_connection((HOST, srv.port))) as s:  # nonce rewritten
            f = s.makefile("rb")
            fresh = f.readline().split()[1].decode()
            s.sendall(line.replace(nonce.encode(), fresh.encode()))
            assert f.read() == b"ERR forged\n"
        # had either replay counted as the second reader, the hold would have ended
        assert holds.generation("r") == g and holds.counts["confirmed"] == 1
        wrong_rank = signed_line(nonce, "CONFIRM", gen=g, ident=sc.server_identity("p", 1))
        with closing(socket.create_connection((HOST, srv.port))) as s:  # made for rank 1
            f = s.makefile("rb")
            fresh = f.readline().split()[1].decode()
            s.sendall(wrong_rank.replace(nonce.encode(), fresh.encode()))
            assert f.read() == b"ERR forged\n"
        assert holds.generation("r") == g


def fake_server(answer: bytes | None, *, banner=True, nonce="0" * 32, drip=False):
    """A listening socket that answers one connection as given (a hostile or foreign port)."""
    lsock = socket.create_server((HOST, 0))
    stop = threading.Event()

    def run():
        with closing(lsock):
            lsock.settimeout(5)
            try:
                s, _ = lsock.accept()
            except OSError:
                return
            with closing(s):
                if banner:
                    s.sendall(f"KVPSC1 {nonce} {quote(ID, safe='')}\n".encode())
                s.settimeout(5)
                try:
                    s.recv(4096)
                    if drip:  # one byte every 0.2 s, never finishing
                        for b in answer:
                            if stop.wait(0.2):
                                return
                            s.sendall(bytes([b]))
                    elif answer is not None:
                        s.sendall(answer)
                    stop.wait(5)
                except OSError:
                    pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return lsock.getsockname()[1], stop, t


@contextmanager
def fake(*args, **kw):
    port, stop, t = fake_server(*args, **kw)
    try:
        yield port
    finally:
        stop.set()
        t.join(10)


def test_a_forged_or_replayed_answer_is_not_a_yes():
    with fake(b"YES " + b"ab" * 32 + b"\n") as port:
        with pytest.raises(sc.SideChannelProtocolError, match="does not verify"):
            sc.confirm(HOST, port, "r", 1, identity=ID, secret=SECRET)
    # a genuine answer recorded from the real server, replayed by a host that took the port
    with server() as (srv, holds):
        g = held(holds, srv)
        with closing(socket.create_connection((HOST, srv.port))) as s:
            f = s.makefile("rb")
            nonce = f.readline().split()[1].decode()
            s.sendall(signed_line(nonce, "CONFIRM", gen=g))
            recorded = f.read()
    assert recorded.startswith(b"YES ")
    with fake(recorded, nonce=nonce) as port:  # even the same server nonce: our nonce differs
        with pytest.raises(sc.SideChannelProtocolError, match="does not verify"):
            sc.confirm(HOST, port, "r", g, identity=ID, secret=SECRET)


def test_a_4gib_length_prefix_is_refused_unread():
    tracemalloc.start()
    try:
        with fake(b"\xff\xff\xff\xff" + b"x" * 1000) as port:
            t0 = time.monotonic()
            with pytest.raises(sc.SideChannelProtocolError, match="4294967295 bytes, above"):
                sc.fetch_metadata(HOST, port, timeout=5)
            assert time.monotonic() - t0 < 1.0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # nothing near the advertised size was allocated
    assert sc.MAX_METADATA < 64 << 20


def test_a_slow_or_silent_metadata_server_meets_the_deadline():
    with fake(b"\x00\x00\x00\x10" + b"y" * 16, drip=True) as port:
        t0 = time.monotonic()
        with pytest.raises(sc.SideChannelTimeout, match=f"127.0.0.1:{port}.*within 0.5 s"):
            sc.fetch_metadata(HOST, port, timeout=0.5)
        assert time.monotonic() - t0 < 1.0  # one deadline for it all, not per byte
    with fake(None, banner=False) as port:
        with pytest.raises(sc.SideChannelTimeout):
            sc.control(HOST, port, "RENEW", "r", 1, identity=ID, timeout=0.3)


def test_an_answer_that_came_while_the_client_was_held_up_is_taken():
    """A client thread held up past its deadline (a busy process: the GIL) still reads the
    banner and answer waiting in its socket: the peer answered in time. Only nothing there is
    a timeout (the client is the module's own, as fetch_metadata and control use it)."""
    with server() as (srv, _):
        with sc._Client(HOST, srv.port, 0.3, "metadata") as c:
            time.sleep(0.6)  # the banner came long ago; the deadline passed meanwhile
            c.banner(ID)
            c.send(b"MD\n")
            time.sleep(0.3)  # the metadata, too
            n = int.from_bytes(c.exact(4, "reading the metadata length"), "big")
            assert c.exact(n, "reading the metadata") == b"blob"
        with sc._Client(HOST, srv.port, 0.3, "metadata") as c:
            time.sleep(0.5)
            c.banner(ID)  # nothing asked: nothing more comes, and that is a timeout now
            with pytest.raises(sc.SideChannelTimeout, match=r"within 0\.3 s.*reading more"):
                c.line(64, "reading more")


def test_nothing_listening_names_host_and_port():
    with closing(socket.create_server((HOST, 0))) as s:
        port = s.getsockname()[1]
    with pytest.raises(sc.SideChannelError, match=f"127.0.0.1:{port}.*cannot connect") as e:
        sc.fetch_metadata(HOST, port, timeout=1)
    assert isinstance(e.value, ExecutorError) and e.value.port == port


def test_an_oversized_line_closes_the_connection_and_the_server_keeps_serving():
    with server(max_line=1024) as (srv, _):
        with closing(socket.create_connection((HOST, srv.port), timeout=5)) as s:
            s.recv(4096)
            sent = 0
            with pytest.raises(OSError):
                for _ in range(4096):  # up to 64 MiB without a newline
                    s.sendall(b"A" * 16384)
                    sent += 16384
            # closed long before: the kernel buffers are all it took in
        assert sent < 16 << 20
        assert srv.stats["oversized"] == 1 and srv.connections == 0
        assert sc.fetch_metadata(HOST, srv.port) == b"blob"


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(line=st.one_of(
    st.binary(max_size=300),
    st.lists(st.sampled_from(["RELEASE", "CONFIRM", "RENEW", "LEASE", "RETURN", "r", "1", "-",
                              "0" * 32, "x" * 64,
                              "%ff", "", "99999999999999999999"]),
             max_size=8).map(lambda p: " ".join(p).encode())))
def test_malformed_lines_are_dropped_and_never_acted_on(shared_server, line):
    srv, holds, g = shared_server
    line = line.replace(b"\n", b"") + b"\n"
    _, ans = raw(srv.port, line)
    assert ans.startswith(b"ERR ") or ans == b"\x00\x00\x00\x04blob"  # MD alone: the blob
    assert holds.generation("r") == g and holds.counts["released"] == 0
    assert holds.counts["leased"] == 0


@pytest.fixture(scope="module")
def shared_server():
    with server() as (srv, holds):
        yield srv, holds, held(holds, srv, lease=3600)
        assert srv.stats["malformed"] > 0


def test_slow_clients_cannot_stall_it_or_hold_it_forever():
    with server(max_connections=8, deadline_s=0.5) as (srv, _):
        slow = [socket.create_connection((HOST, srv.port)) for _ in range(8)]
        try:
            for s in slow:
                s.sendall(b"RELE")  # a request line begun, never finished
            time.sleep(0.05)
            assert srv.connections == 8
            # one more: closed at once, not queued behind the slow ones
            with closing(socket.create_connection((HOST, srv.port), timeout=2)) as extra:
                t0 = time.monotonic()
                assert extra.recv(100) == b""
                assert time.monotonic() - t0 < 0.3
            assert srv.stats["rejected"] >= 1
            time.sleep(0.7)  # past their deadline: every slot is free again
            assert srv.stats["timeouts"] == 8 and srv.connections == 0
            assert sc.fetch_metadata(HOST, srv.port) == b"blob"
        finally:
            for s in slow:
                s.close()
    with server(deadline_s=5) as (srv, _):  # one slow client does not delay anyone else
        with closing(socket.create_connection((HOST, srv.port))):
            t0 = time.monotonic()
            for _ in range(20):
                sc.fetch_metadata(HOST, srv.port)
            assert time.monotonic() - t0 < 1.0


def test_a_taken_port_names_the_port_and_the_config_key():
    with server() as (srv, _):
        with pytest.raises(sc.PortInUseError, match=rf"port {srv.port} on 127.0.0.1 is already "
                           r"in use.*side_channel_port") as e:
            sc.SideChannelServer(HOST, srv.port, ID)
        assert e.value.errno == errno.EADDRINUSE and isinstance(e.value, OSError)
        assert isinstance(e.value, ExecutorError) and e.value.port == srv.port


def test_close_releases_the_port_and_open_connections():
    with server() as (srv, _):
        idle = socket.create_connection((HOST, srv.port))
        port = srv.port
        while srv.connections == 0:  # accepted, and then left open by the client
            time.sleep(0.01)
    with closing(idle):
        idle.settimeout(2)
        assert idle.recv(4096).startswith(b"KVPSC1") and idle.recv(10) == b""
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((HOST, port), timeout=1).close()
    sc.SideChannelServer(HOST, port, ID).close()  # and it can be bound again


def test_port_formula_gives_each_dp_and_tp_rank_its_own_port():
    ports = [sc.side_channel_port(5700, t, 4, d) for d in range(2) for t in range(4)]
    assert ports == list(range(5700, 5708))
    for bad in [dict(tp_rank=4), dict(dp_rank=-1), dict(base=65535, tp_rank=1),
                dict(tp_size=0)]:
        args = dict(base=5700, tp_rank=0, tp_size=4, dp_rank=0) | bad
        with pytest.raises(ArgumentError):
            sc.side_channel_port(**args)


def test_client_arguments_are_checked():
    for bad in [dict(verb="FREE"), dict(req=""), dict(req="x" * 600), dict(generation=-1),
                dict(timeout=0)]:
        args = dict(verb="RELEASE", req="r", generation=1, timeout=1.0) | bad
        with pytest.raises(ArgumentError):
            sc.control(HOST, 1, identity=ID, **args)
