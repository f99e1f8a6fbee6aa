"""The handshake and control pools attacked through a request's params (issue 36, item 6).

Anyone who can send the decode an HTTP request chooses its ``kv_transfer_params``: the engine
id, ``remote_host``, ``remote_port``, ``tp_size``. Here the decode's side is real: a NIXL
endpoint connecting a TP2 prefill of real endpoints whose metadata is signed under the
deployment secret and served by real side channel servers; the attacker's addresses are real
sockets (dead ports, listeners that never answer, a server it runs itself replaying metadata
it fetched). Each test measures that a genuine request's handshake or CONFIRM is not delayed
(bounds well under what each attack used to cost) and that no state it relies on is poisoned.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from contextlib import ExitStack, closing

import pytest

from kvplan_nixl.serving import sidechannel as sc
from kvplan_nixl.serving.handshakes import FAILED, READY, Handshakes, identity
from tests.nixl_util import attn, pair, spec
from tests.test_handshakes import wait_for
from tests.test_vllm_serving import _in_vllm_venv

KEY = b"kvplan-test-deployment-secret-36"
HOST = "127.0.0.1"
SRC, DST = spec(2, attn(heads=4, nb=64)), spec(1, attn(heads=4, nb=64))
SB, DB = [list(range(1, 21))], [list(range(30, 50))]


def serve(stack: ExitStack, host: str, blobs: list[bytes], engine: str = "prefill",
          secret: bytes | None = KEY) -> int:
    """Side channel servers for ``blobs`` on consecutive ports of ``host`` (rank r's at
    base + r, as the connector lays them out); returns base."""
    for _ in range(100):
        base = random.randrange(20000, 60000)
        with ExitStack() as tries:
            try:
                for r, blob in enumerate(blobs):
                    tries.enter_context(sc.SideChannelServer(
                        host, base + r, sc.server_identity(engine, r), metadata=blob,
                        secret=secret))
            except sc.PortInUseError:
                continue
            stack.enter_context(tries.pop_all())
            return base
    raise AssertionError("no free consecutive ports")


def silent(stack: ExitStack, host: str) -> int:
    """A listener on ``host`` that accepts connections (its backlog) and never answers."""
    s = stack.enter_context(closing(socket.create_server((host, 0), backlog=64)))
    return s.getsockname()[1]


@pytest.fixture
def world():
    """A TP2 prefill serving its signed metadata, a TP1 decode endpoint, the decode's
    Handshakes (its connect as the connector's rank 0 does it)."""
    with pair(SRC, DST, secret=KEY) as pr, ExitStack() as stack:
        base = serve(stack, HOST, [ep.metadata() for ep in pr.p])
        lock = threading.Lock()
        dec = pr.d[0]

        def connect(engine: str, rank: int, blob: bytes):
            dec.connect(blob, mode="pull")
            return range(dec.map(engine).src.tp_size)

        hs = stack.enter_context(Handshakes(connect, lock=lock, identify=identity(KEY),
                                            timeout=2.0, retry_after_s=60))
        yield pr, hs, lock, base, stack


def genuine_ready(pr, hs: Handshakes, lock, base: int) -> float:
    """Start the genuine handshake; its time to READY. Then a pull reads the right bytes."""
    t0 = time.monotonic()
    hs.start("prefill", HOST, base)
    s = wait_for(hs, ("prefill", HOST, base), READY)
    took = time.monotonic() - t0
    assert s.ranks == (0, 1)
    with lock:
        assert [(p.engine, p.rank) for p in pr.d[0].peers()] == [("prefill", 0),
                                                                   ("prefill", 1)]
        pr.run("pull", SB, DB)
    assert pr.check(SB, DB) > 0
    return took


def test_a_genuine_engine_named_at_a_dead_address_fails_that_request_only(world):
    pr, hs, lock, base, _ = world
    with closing(socket.create_server((HOST, 0))) as s:
        dead = s.getsockname()[1]
    hs.start("prefill", HOST, dead)
    assert "cannot connect" in wait_for(hs, ("prefill", HOST, dead), FAILED).reason
    # the engine's state at its real address is untouched: tried at once, and connects
    assert genuine_ready(pr, hs, lock, base) < 1.0
    assert hs.start("prefill", HOST, dead).failed  # the claim keeps its own failure


def test_an_address_serving_another_ranks_signed_metadata_connects_nothing(world):
    pr, hs, lock, base, stack = world
    rank1 = sc.fetch_metadata(HOST, base + 1, identity="prefill#1")  # public: anyone reads it
    rank0 = sc.fetch_metadata(HOST, base, identity="prefill#0")
    fake = serve(stack, HOST, [rank1])  # rank 1's blob, served as rank 0
    hs.start("prefill", HOST, fake)
    s = wait_for(hs, ("prefill", HOST, fake), FAILED)
    assert "served the metadata of engine 'prefill' rank 1, not of engine 'prefill' rank " \
           "0" in s.reason and s.ranks == ()
    with lock:
        assert pr.d[0].peers() == ()  # nothing of the wrong claim was connected
    # rank 0's genuine blob, then rank 0's again as rank 1: never READY with one rank
    fake2 = serve(stack, HOST, [rank0, rank0])
    hs.start("prefill", HOST, fake2)
    s = wait_for(hs, ("prefill", HOST, fake2), FAILED)
    assert "rank 0, not of engine 'prefill' rank 1" in s.reason and s.ranks == (0,)
    assert genuine_ready(pr, hs, lock, base) < 1.0


@pytest.mark.parametrize("hosts", [1, 12], ids=["one-host", "twelve-hosts"])
def test_silent_side_channels_do_not_delay_a_genuine_handshake(world, hosts):
    """12 requests naming listeners that never answer (each holding a thread for the 2 s
    handshake timeout): on one attacker host, or on twelve."""
    pr, hs, lock, base, stack = world
    addrs = [(h, silent(stack, h)) for h in (f"127.0.0.{2 + i % hosts}" for i in range(12))]
    for i, (h, p) in enumerate(addrs):
        assert hs.start(f"prefill-{i}", h, p).pending
    assert genuine_ready(pr, hs, lock, base) < 1.0
    assert all(hs.state(f"prefill-{i}", h, p).pending for i, (h, p) in enumerate(addrs))


CONTROL_ATTACK = r"""
import random, socket, time
from contextlib import ExitStack, closing
from types import SimpleNamespace
from kvplan_nixl.serving.holds import Verdict, new_generation
from kvplan_nixl.serving.control import RELEASE_QUEUE, Control, Sends

TP = 64
with ExitStack() as stack:
    # silent ports on the genuine prefill's own host (127.0.0.1): nobody answers on them
    while True:
        bad_port, socks = random.randrange(20000, 60000), []
        try:
            for r in range(TP):
                socks.append(socket.create_server(("127.0.0.1", bad_port + r), backlog=8))
            break
        except OSError:
            for s in socks:
                s.close()
    for s in socks:
        stack.enter_context(closing(s))
    sends = Sends("127.0.0.1", 0, "pre#0", b"md", secret="s", lease=30)
    stack.callback(sends.close)
    other = Sends("127.0.0.3", 0, "pre2#0", b"md", secret="s", lease=30)  # another host
    stack.callback(other.close)
    ctl = Control("s", timeout=3.0)
    stack.callback(ctl.close)
    load = lambda host, port, req, gen, engine="pre": SimpleNamespace(
        engine=engine, host=host, port=port, remote_req=req, generation=gen)
    evil = lambda req, tp: ctl.release(load("127.0.0.1", bad_port, req, 7, "evil"), range(tp))
    queued = lambda: ctl.releases.waiting + ctl.releases.running
    evil("x0", 10)
    assert queued() == 10, queued()
    evil("x0", 10)  # the same failure's RELEASEs again: sent once
    assert queued() == 10, queued()
    # 8 failed requests naming the silent ports with tp_size 64: 512 RELEASEs of 3 s each,
    # then one naming tp_size 10**9: bounded by the queue, refused at once past it
    for i in range(8):
        evil(f"x{i}", TP)
    t0 = time.monotonic()
    evil("huge", 10**9)
    assert time.monotonic() - t0 < 1.0 and ctl.releases.waiting <= RELEASE_QUEUE // 8
    # the genuine prefill's CONFIRM and RENEW are answered at once (same host: never
    # behind a RELEASE, whose slots for that host are all taken)
    g = new_generation()
    sends.hold([("a", g)])
    other.hold([("b", g)])
    good = load("127.0.0.1", sends.server.port, "a", g)
    out = {}
    t0 = time.monotonic()
    # one job, RENEW then CONFIRM: a CONFIRM ends the hold, so a RENEW run after it (two jobs
    # on two threads race) is rightly answered NO
    assert ctl.submit(good, lambda: (out.setdefault("renew", ctl.send(good, 0, "RENEW")),
                                     out.setdefault("confirm", ctl.send(good, 0, "CONFIRM", 1))))
    while len(out) < 2 and time.monotonic() - t0 < 10:
        time.sleep(0.002)
    urgent = time.monotonic() - t0
    assert out == {"renew": Verdict.YES, "confirm": Verdict.YES} and urgent < 1.0, out
    # and a genuine RELEASE to another host is not stuck behind the silent host's either
    before = other.finished()[0]
    ctl.release(load("127.0.0.3", other.server.port, "b", g, "pre2"), [0])
    t0 = time.monotonic()
    done = set(before)
    while "b" not in done and time.monotonic() - t0 < 10:
        time.sleep(0.005)
        done |= other.finished()[0]
    took = time.monotonic() - t0
    assert "b" in done and took < 1.0, took
    print("confirm+renew %.3f s, release %.3f s" % (urgent, took))
print("ok")
"""


def test_release_floods_to_a_silent_host_never_delay_confirm_or_renew(vllm_python):
    """8 failed requests naming silent ports of the genuine prefill's host with tp_size 64
    queue 512 RELEASEs (and one with tp_size 10**9 is bounded by the queue): a genuine
    CONFIRM and RENEW to that host are answered, and a genuine RELEASE to another host sent,
    within 1 s, where they used to wait behind every RELEASE."""
    _in_vllm_venv(vllm_python, CONTROL_ATTACK)
