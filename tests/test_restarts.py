"""Restarts in place and a stock prefill's identity (issue 44 item 1 with B1, issue 45 items 1
and 2): a prefill restarted at the same address under the same ``engine_id`` is connected
afresh by the next request and read, not recomputed; a request cannot move a known engine id
to another address, nor make the decode take one rank's metadata for another's, nor reach an
address the allow-list leaves out. docs/vllm.md, "Restarts in place" and "Who a request may
make the decode dial".

Without vLLM: the handshake table's transitions and pins (:mod:`kvplan_nixl.serving.handshakes`,
a fake fetch) and the endpoint's rule for agents and restarted engines (real NIXL endpoints).
In vLLM's venv (no engine): the connector's real decode ``Worker`` around real NIXL agents,
reading prefills that run in processes of their own and are killed or closed and started again
on the same port (tests/restart_peer.py): a stock TP2 NixlConnector prefill served by vLLM
0.32's own listener code, and a TP1 KvplanConnector prefill (its own ``Worker``).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvplan_nixl import Endpoint
from kvplan_nixl.errors import MetadataError
from kvplan_nixl.serving.handshakes import (
    FAILED,
    READY,
    TRANSITIONS,
    AddressConflict,
    AddressRefused,
    Handshakes,
    step,
)
from tests.nixl_util import attn, pair, spec
from tests.test_handshakes import wait_for
from tests.test_vllm_serving import _in_vllm_venv

HOST = "127.0.0.1"


# -- the handshake table, without NIXL -------------------------------------------------------


def test_transitions_are_a_table():
    assert step(None, "start") == "pending" and step("failed", "retry") == "pending"
    assert step("pending", "done") == "ready" and step("pending", "error") == "failed"
    assert all(step(k, "forget") is None for k in ("pending", "ready", "failed"))
    # what the table does not list leaves the state: a start of a ready one, a job's end
    # after it was forgotten
    assert step("ready", "start") == "ready" and step(None, "done") is None
    assert set(TRANSITIONS.values()) == {"pending", "ready", "failed", None}


class Fake:
    """A prefill engine of ``tp`` ranks behind a fake fetch: each fetch counted by address;
    ``fail`` makes the addresses in it refuse."""

    def __init__(self) -> None:
        self.fetched: list[tuple[str, int]] = []
        self.fail: set[tuple[str, int]] = set()
        self.connected: list[tuple[str, int]] = []
        self.hook = None  # called by each connect, with the engine

    def fetch(self, host, port, *, timeout, identity):
        self.fetched.append((host, port))
        if (host, port) in self.fail:
            raise ConnectionRefusedError(f"{host}:{port} refused")
        return identity.encode()

    def connect(self, engine, rank, blob):
        self.connected.append((engine, rank))
        if self.hook is not None:
            self.hook(engine)
        return ()


def table(fake: Fake, **kw) -> Handshakes:
    return Handshakes(fake.connect, lock=threading.Lock(), fetch=fake.fetch,
                      identify=lambda b: (b.decode().rpartition("#")[0],
                                          int(b.decode().rpartition("#")[2])),
                      retry_after_s=60, **kw)


def test_an_unsigned_engine_is_bound_to_its_first_address_and_restarts_there():
    fake = Fake()
    with table(fake, pin=True) as hs:
        hs.start("p", HOST, 5000)
        wait_for(hs, ("p", HOST, 5000), READY)
        assert hs.pinned("p").held and hs.pinned("p").address == f"{HOST}:5000"
        n = len(fake.fetched)
        with pytest.raises(AddressConflict, match=r"'remote_engine_id'\] = 'p': that engine "
                                                  rf"is connected at {HOST}:5000, this request "
                                                  rf"names it at {HOST}:6000"):
            hs.start("p", HOST, 6000)
        assert len(fake.fetched) == n and hs.state("p", HOST, 6000) is None  # not dialled
        # its peer went (restarted in place): forgotten, connected afresh at its address
        hs.forget("p")
        assert hs.state("p", HOST, 5000) is None
        hs.start("p", HOST, 5000)
        wait_for(hs, ("p", HOST, 5000), READY)
        assert len(fake.fetched) == n + 1
        hs.forget("p")  # still bound: forget is no way to move it
        with pytest.raises(AddressConflict):
            hs.start("p", HOST, 6000)
        # another engine id is free to be anywhere
        hs.start("q", HOST, 6000)
        wait_for(hs, ("q", HOST, 6000), READY)


def test_an_address_serving_a_new_engine_id_frees_the_old_ones_pin():
    """Gap (c) of issue 45: vLLM's default engine id is a new one at each start, so a prefill
    restarted in place comes back under another id. Its old id's pin and handshake state are
    dropped once the new id completes a handshake there (the address serves the new one now),
    so 1,100 restarts at one address fit the tables of MAX_STATES (1,024); before, every id's
    pin and READY state were kept for the decode's life and the 1,025th engine was refused. A
    pin at another address stays."""
    from kvplan_nixl.serving.handshakes import MAX_STATES

    fake = Fake()
    with table(fake, pin=True) as hs:
        hs.start("other", HOST, 6000)
        wait_for(hs, ("other", HOST, 6000), READY)
        for i in range(MAX_STATES + 76):
            hs.start(f"p{i}", HOST, 5000)
            wait_for(hs, (f"p{i}", HOST, 5000), READY)
            if i:  # the earlier id's pin and handshake state are gone
                assert hs.pinned(f"p{i - 1}") is None
                assert hs.state(f"p{i - 1}", HOST, 5000) is None
        assert hs.pinned(f"p{MAX_STATES + 75}").address == f"{HOST}:5000"
        # still bound: the live one elsewhere, the other one here
        with pytest.raises(AddressConflict):
            hs.start("other", HOST, 5000)
        with pytest.raises(AddressConflict):
            hs.start(f"p{MAX_STATES + 75}", HOST, 6000)


def test_a_failed_handshake_binds_nothing_and_signed_peers_are_not_bound():
    fake = Fake()
    fake.fail.add((HOST, 5000))
    with table(fake, pin=True) as hs:
        hs.start("p", HOST, 5000)  # a dead address first: no claim survives it
        wait_for(hs, ("p", HOST, 5000), FAILED)
        assert hs.pinned("p") is None
        hs.start("p", HOST, 6000)
        wait_for(hs, ("p", HOST, 6000), READY)
    with table(Fake()) as hs:  # signed metadata proves itself: no pin
        for port in (5000, 6000):
            hs.start("p", HOST, port)
            wait_for(hs, ("p", HOST, port), READY)
        assert hs.pinned("p") is None


def test_a_handshake_forgotten_midway_leaves_no_claim():
    fake = Fake()
    with table(fake, pin=True) as hs:
        fake.hook = hs.forget  # its peer went meanwhile
        hs.start("p", HOST, 5000)
        end = time.monotonic() + 5
        while hs.pinned("p") is not None or not fake.fetched:
            assert time.monotonic() < end, hs.pinned("p")
            time.sleep(0.005)
        assert hs.state("p", HOST, 5000) is None  # forgotten: the job's end changed nothing
        fake.hook = None
        hs.start("p", HOST, 6000)
        wait_for(hs, ("p", HOST, 6000), READY)
        assert hs.pinned("p").address == f"{HOST}:6000"


def test_admit_refuses_before_anything_is_dialled():
    fake = Fake()
    with table(fake, admit=lambda e, h, p: None if p == 5000 else "not on the list") as hs:
        with pytest.raises(AddressRefused, match=rf"'remote_host'\] = '{HOST}:6000': engine "
                                                 "'p': not on the list; nothing was dialled"):
            hs.start("p", HOST, 6000)
        assert fake.fetched == []
        hs.start("p", HOST, 5000)
        wait_for(hs, ("p", HOST, 5000), READY)


# -- the endpoint: one agent serves one rank; a restarted engine replaces its ranks ----------


SRC, DST = spec(2, attn(heads=4, nb=64)), spec(1, attn(heads=4, nb=64))
SB, DB = [list(range(1, 21))], [list(range(30, 50))]


def _foreign(pr, rank: int, as_rank: int, engine: str = "prefill"):
    """Connect prefill ``rank``'s agent and buffers to the decode as ``engine`` rank
    ``as_rank``, unsigned (as a stock prefill's are)."""
    ep = pr.p[rank]
    bufs = {pr.src.regions[i].name: pr.src_bufs[(rank, i)] for i in pr.src.regions_on(rank)}
    return pr.d[0].connect_foreign(engine, as_rank, pr.src, bufs, ep._agent.get_agent_metadata())


def test_metadata_naming_another_ranks_agent_is_refused_and_unloads_nothing():
    with pair(SRC, DST) as pr:
        _foreign(pr, 0, 0)
        _foreign(pr, 1, 1)
        before = pr.d[0].handles()
        # rank 1's metadata offered as rank 0 (copied), then the two swapped: refused by name
        with pytest.raises(MetadataError, match=r"is the one engine 'prefill' rank 1 is "
                                                r"connected through; one agent serves one rank"):
            _foreign(pr, 1, 0)
        with pytest.raises(MetadataError, match="rank 0 is connected through"):
            _foreign(pr, 0, 1)
        with pytest.raises(MetadataError, match="rank 1 is connected through"):
            _foreign(pr, 1, 0, engine="other")  # nor as another engine's rank
        assert pr.d[0].handles() == before  # no agent unloaded, no list made
        pr.run("pull", SB, DB)  # and both ranks still read right
        assert pr.check(SB, DB) > 0


def test_an_engine_restarted_with_another_spec_replaces_its_ranks_and_says_it_went():
    with pair(SRC, DST, secret=b"k") as pr:
        pr.connect("pull")
        deadline = time.monotonic() + 5  # the prefill ranks take the decode's hello
        while not all(ep.handles()["remote_agents"] for ep in pr.p):
            assert time.monotonic() < deadline
            for ep in pr.endpoints:
                ep.progress()
            time.sleep(0.005)
        gone = []
        pr.d[0].on_peer_gone(lambda *a: gone.append(a))
        # the prefill restarts: new agents and another block count, at once for both ranks
        big = spec(2, attn(heads=4, nb=96))
        bufs = [np.zeros(big.rank_buffer_nbytes(0), np.uint8) for _ in range(2)]
        new = [Endpoint("prefill", big, r, [bufs[r]], secret=b"k") for r in range(2)]
        try:
            for ep in pr.p:
                ep.close()  # graceful: close notices
            deadline = time.monotonic() + 5
            while len(gone) < 2 and time.monotonic() < deadline:
                pr.d[0].progress()
                time.sleep(0.005)
            assert sorted(gone) == [("prefill", 0, "peer closed its endpoint"),
                                    ("prefill", 1, "peer closed its endpoint")]
            assert pr.d[0].peers() == ()
            for ep in new:
                pr.d[0].connect(ep.metadata(), mode="pull")
            assert pr.d[0].map("prefill").src == big
            assert [p.agent for p in pr.d[0].peers()] == [ep.agent_name for ep in new]
            # no close notice came (a SIGKILL): the first rank's new agent and spec replace
            # the old incarnation's ranks, not refused as a spec that differs between ranks
            newer = [Endpoint("prefill", SRC, r, [np.zeros(SRC.rank_buffer_nbytes(0),
                                                           np.uint8)], secret=b"k")
                     for r in range(2)]
            try:
                pr.d[0].connect(newer[0].metadata(), mode="pull")
                assert [(p.rank, p.agent) for p in pr.d[0].peers()] == [
                    (0, newer[0].agent_name)]
                pr.d[0].connect(newer[1].metadata(), mode="pull")
                assert pr.d[0].map("prefill").src == SRC
            finally:
                for ep in newer:
                    ep.close()
        finally:
            for ep in new:
                ep.close()
            pr.p = []


# -- the connector's decode Worker, in vLLM's venv --------------------------------------------


DRIVER_SETUP = r"""
import logging, socket, time
from kvplan_nixl.serving.transfer_params import Peer
from tests.restart_peer import Prefill, worker, load, pull, read_back

class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []
    def emit(self, record):
        self.lines.append(record.getMessage())

log = Lines()
logging.getLogger("vllm.kvplan_nixl").addHandler(log)
logging.getLogger("vllm.kvplan_nixl").setLevel(logging.INFO)

def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
"""

#: A stock TP2 prefill read, killed and started again on its port under its engine id (new
#: agents, and once another block count); a KvplanConnector prefill closed gracefully (its
#: close notices) and killed (none), each started again on its ports. Every kvplan request
#: after each restart loads what the new prefill holds, the first one after a kill by posting
#: again after a fresh handshake (its CONFIRM proves the new prefill holds it). A stock
#: prefill confirms nothing, so the first request after its restart (which finds the old
#: agents gone) fails by name, never re-read from an instance that may not hold it; the
#: engine is forgotten, and every later request connects afresh and loads. The stock ranks
#: are told ``<id>:1`` for each request they served.
RESTARTS = DRIVER_SETUP + r"""
w, kv = worker("decode", port())
X, K = port(), port()
times = {}
for seed, nb in ((1, 16), (2, 24), (3, 24)):
    p = Prefill("stock", X, "prefill-0", 2, seed, nb)
    for i in range(3 if seed > 1 else 2):
        req = f"s{seed}{i}"
        ld = load(req, "prefill-0", X, [3 + i, 9 + i, nb - 1], [1 + i, 5 + i, 7 + i], tp=2)
        before = len(log.lines)
        ok, took = pull(w, ld)
        if seed > 1 and i == 0:  # the old agents gone, or the old map's block count
            why = "\n".join(log.lines[before:])
            assert not ok and "kv_load_failure_policy" in why, why
            assert ("NIXL_ERR_REMOTE_DISCONNECT" if nb == 24 and seed == 3
                    else "out of range [0, 16)") in why, why
            continue
        assert ok and read_back(kv, ld, seed, 2), (req, log.lines[-3:])
        times[req] = took
        end = time.monotonic() + 5
        while sorted(m for _, m in p.notifs if m == f"r-{req}:1") != [f"r-{req}:1"] * 2:
            assert time.monotonic() < end, p.notifs
            time.sleep(0.01)
    p.kill()
for seed, stop in ((1, "close"), (2, "kill"), (3, "close")):
    q = Prefill("kvplan", K, "prefill-k", seed, 16)
    for i in range(2):
        req = f"k{seed}{i}"
        q.send(f"hold r-{req}")
        gen = int(q.wait(f"gen r-{req}").split()[2])
        ld = load(req, "prefill-k", K, [1 + i, 2 + i], [12 + i, 13 + i], peer=Peer.KVPLAN,
                  generation=gen)
        ok, took = pull(w, ld)
        assert ok and read_back(kv, ld, seed, 1), (req, log.lines[-3:])
        times[req] = took
    if seed == 3:  # block ids the live prefill lacks: handshaken afresh, the same agents
        before = len(log.lines)
        q.send("hold r-bad")
        gen = int(q.wait("gen r-bad").split()[2])
        ok, _ = pull(w, load("bad", "prefill-k", K, [999], [20], peer=Peer.KVPLAN,
                             generation=gen))
        why = "\n".join(log.lines[before:])
        assert not ok and "out of range" in why and "the same prefill agents: not a " \
            "restart" in why and "kv_load_failure_policy" in why, why
    if stop == "close":
        q.send("close")
        q.wait("closed")
        q.proc.wait(30)
    else:
        q.kill()
end = time.monotonic() + 5
while len([m for m in log.lines if "went (peer closed its endpoint)" in m]) < 2 \
        and time.monotonic() < end:
    time.sleep(0.01)
again = [m for m in log.lines if "connecting the prefill afresh and posting once more" in m]
went = [m for m in log.lines if "went (peer closed its endpoint)" in m]
# the killed kvplan prefill: found by the first request, which connected afresh and read;
# the one closed gracefully: told, no request failed; the stock one's two first requests
assert [m.split()[2] for m in again] == ["req=k30", "req=bad"] and len(went) == 2, (again,
                                                                                   went)
assert len([m for m in log.lines if "kv_load_failure_policy" in m]) == 3, log.lines
print("times", {k: round(v, 3) for k, v in times.items()})
w.close()
print("ok")
"""


def test_prefills_restarted_in_place_are_read_by_the_next_request(vllm_python):
    _in_vllm_venv(vllm_python, RESTARTS)


#: The identity of a stock prefill: its address. A request naming the genuine engine id at
#: another address fails at once, nothing dialled; listeners serving the genuine prefill's
#: public metadata (rank 1's for both ranks; the two swapped) under an engine id of their own
#: are refused by name, and unload nothing: the genuine prefill's later requests read right.
#: With ``stock_prefills``, only those addresses are dialled.
IDENTITY = DRIVER_SETUP + r"""
import threading
import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata, NixlHandshakePayload)
from kvplan_nixl.vllm.nixl_peer import fetch_nixl_metadata
from tests.restart_peer import HASH

from kvplan_nixl.serving.settings import Settings

def allowed(v):
    return Settings("d", "h", 5700, 1, extra={"stock_prefills": v}).stock_prefills()

assert allowed(None) is None and allowed("a:1, p@[::1]:2/tp4") == ((None, "a", 1, None),
                                                                   ("p", "::1", 2, 4))
for bad in ("a", "a:0", "a:70000", "@a:1", [5], {"a": 1}, "a:1/", "a:1/2", "a:1/tp0",
            "a:1/tpx", "p@a:1/tp1, q@a:1/tp2"):
    try:
        allowed(bad)
        raise AssertionError(bad)
    except ValueError as e:
        assert "kv_connector_extra_config['stock_prefills']" in str(e), e

w, kv = worker("decode", port())
X = port()
p = Prefill("stock", X, "prefill-0", 2, 7, 16)

def genuine(req):
    ld = load(req, "prefill-0", X, [2, 3], [20, 21], tp=2)
    ok, _ = pull(w, ld)
    assert ok and read_back(kv, ld, 7, 2), (req, log.lines[-3:])

def refused(ld, *words):
    before = len(log.lines)
    ok, took = pull(w, ld)
    why = "\n".join(log.lines[before:])
    assert not ok and all(x in why for x in words), (words, why)
    return took

genuine("g0")
# the genuine engine id at another address: a listener that would answer anything
trap = socket.create_server(("127.0.0.1", 0))
trap.setblocking(False)
took = refused(load("x1", "prefill-0", trap.getsockname()[1], [2], [22], tp=2),
               "AddressConflict", f"connected at 127.0.0.1:{X}")
try:
    trap.accept()
    raise AssertionError("the decode dialled the other address")
except BlockingIOError:
    pass
assert took < 0.5, took
genuine("g1")

# the genuine prefill's public metadata, served by vLLM's own listener under other ids
metas = [fetch_nixl_metadata("127.0.0.1", X, r, tp_size=2, expected_hash=HASH)
         for r in range(2)]
enc = msgspec.msgpack.Encoder()
def served(order, engine):
    data = {(0, r): enc.encode(NixlHandshakePayload(HASH, enc.encode(NixlAgentMetadata(
        **dict(metas[src], engine_id=engine))))) for r, src in enumerate(order)}
    at = port()
    ready, stop = threading.Event(), threading.Event()
    threading.Thread(target=NixlBaseConnectorScheduler._nixl_handshake_listener,
                     args=(data, ready, stop, "127.0.0.1", at), daemon=True).start()
    ready.wait()
    return at
copied = served([1, 1], "evil-1")
refused(load("x2", "evil-1", copied, [2], [22], tp=2), "ranks 0 and 1 serve the same NIXL agent")
swapped = served([1, 0], "evil-2")
refused(load("x3", "evil-2", swapped, [2], [22], tp=2),
        "is the one engine 'prefill-0' rank 1 is connected through")
genuine("g2")  # nothing of the genuine prefill was unloaded

# an allow-list: only the genuine prefill's address, for its engine id, at its TP size
w1 = w
w, kv = worker("decode-2", port(), extra={"stock_prefills": [f"prefill-0@127.0.0.1:{X}/tp2"]})
w2 = w
refused(load("y1", "evil-1", copied, [2], [22], tp=2), "AddressRefused",
        f"127.0.0.1:{copied} is not in kv_connector_extra_config['stock_prefills']")
refused(load("y2", "prefill-0", copied, [2], [22], tp=2), "AddressRefused",
        f"stock_prefills binds it to 127.0.0.1:{X}")
refused(load("y3", "prefill-0", X, [2], [22], tp=1), "AddressRefused",
        "stock_prefills says it runs TP 2, the request's tp_size is 1")
genuine("g3")
p.kill()
for x in (w1, w2):
    x.close()
print("ok")
"""


def test_a_request_cannot_rebind_or_impersonate_a_stock_prefill(vllm_python):
    _in_vllm_venv(vllm_python, IDENTITY)


#: Push mode: a prefill's Worker connects a decode to write into it (``Writes``' handshakes);
#: the decode closes gracefully and starts again on its port under its engine id (a new
#: agent): the prefill forgets it at its close notice and connects the new one afresh.
PUSH = DRIVER_SETUP + r"""
wp, _ = worker("prefill-p", port())
D = port()
wd, _ = worker("decode-p", D)

def connected():
    st = wp.writes.hs.start("decode-p", "127.0.0.1", D)
    end = time.monotonic() + 10
    while not (st := wp.writes.hs.state("decode-p", "127.0.0.1", D)).ready:
        assert time.monotonic() < end and not st.failed, st
        time.sleep(0.01)
    with wp.lock:
        return [p.agent for p in wp.ep.peers() if p.engine == "decode-p"]

first = connected()
end = time.monotonic() + 10
while not wd.ep.handles()["remote_agents"]:  # the prefill's hello taken: it is told at close
    assert time.monotonic() < end
    time.sleep(0.01)
wd.close()  # its close notice reaches the prefill
end = time.monotonic() + 10
while wp.writes.hs.state("decode-p", "127.0.0.1", D) is not None:
    assert time.monotonic() < end, log.lines[-3:]
    time.sleep(0.01)
assert any("engine decode-p rank 0 went" in m for m in log.lines), log.lines
wd, _ = worker("decode-p", D)  # restarted in place
second = connected()
assert len(first) == len(second) == 1 and first != second, (first, second)
for x in (wp, wd):
    x.close()
print("ok")
"""


def test_a_push_decode_restarted_in_place_is_connected_afresh(vllm_python):
    _in_vllm_venv(vllm_python, PUSH)


#: Gap (d) of issue 45: a stock prefill restarted in place under its engine id (new agents, the
#: same block count, other contents), and a request whose prefill leg ran on the old instance
#: (admitted before) arriving after the new one is connected: it fails alone and by name, never
#: read from the new instance's blocks, and the new connection serves the requests after it. A
#: request naming block ids the live prefill lacks (what any HTTP client can send) makes nobody
#: stale: the fresh handshake finds the same agents.
STALE = DRIVER_SETUP + r"""
import attrs
w, kv = worker("decode", port())
X = port()

def at(ld, admitted):
    return attrs.evolve(ld, admitted=admitted)

def outcome(ld):
    before = len(log.lines)
    ok, took = pull(w, ld)
    return ok, "\n".join(log.lines[before:])

p = Prefill("stock", X, "prefill-0", 1, 1, 16)
ld = at(load("g0", "prefill-0", X, [2, 3], [20, 21]), time.time())
ok, why = outcome(ld)
assert ok and read_back(kv, ld, 1, 1), why
# a request naming a block id the prefill lacks: its post fails, the engine is forgotten, and
# the next request's fresh handshake finds the same agents: no restart, nobody refused
older = at(load("g1", "prefill-0", X, [4, 5], [22, 23]), time.time())
ok, why = outcome(at(load("bad", "prefill-0", X, [99], [24]), time.time()))
assert not ok and "out of range" in why, why
ok, why = outcome(older)
assert ok and read_back(kv, older, 1, 1) and "StaleStockRequest" not in why, why

stale = at(load("st", "prefill-0", X, [6, 7], [26, 27]), time.time())  # leg on the old one
p.kill()
p = Prefill("stock", X, "prefill-0", 1, 2, 16)  # in place: new agents, other contents
ok, why = outcome(at(load("r1", "prefill-0", X, [2], [28]), time.time()))
assert not ok and "NIXL_ERR_REMOTE_DISCONNECT" in why, why  # the old agents gone
ld = at(load("r2", "prefill-0", X, [8, 9], [20, 21]), time.time())
ok, why = outcome(ld)
assert ok and read_back(kv, ld, 2, 1) and "restarted in place (new agents)" in why, why
for b in (26, 27):  # what the stale request's blocks hold before
    for name in kv:
        kv[name][b].fill_(-1.0)
t0 = time.monotonic()
ok, why = outcome(stale)
took = time.monotonic() - t0
assert not ok and "StaleStockRequest: NixlConnector prefill 'prefill-0' restarted in place" \
    in why and "not read" in why and "kv_load_failure_policy" in why, why
assert all(bool((kv[name][b] == -1.0).all()) for b in (26, 27) for name in kv), "read"
assert took < 0.5, took
ld = at(load("r3", "prefill-0", X, [10, 11], [24, 25]), time.time())
ok, why = outcome(ld)  # the new connection is untouched
assert ok and read_back(kv, ld, 2, 1) and "runs vLLM's NixlConnector" not in why, why
p.kill()
w.close()
print("ok")
"""


def test_a_stale_request_after_a_stock_restart_fails_alone(vllm_python):
    _in_vllm_venv(vllm_python, STALE)
