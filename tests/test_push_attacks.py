"""Push mode's decode side under a peer holding the secret (issue 36, items 4 and 5), with
real NIXL agents: a decode rank's :class:`kvplan_nixl.serving.push_io.Receives` takes the
notifications a genuine prefill and an intruder engine send, sealed, over loopback.

Run by the vLLM venv's python (the connector package imports vLLM). The rank the parts
belong to is a small stand-in holding a real Endpoint (the worker's attributes the parts
read, :class:`kvplan_nixl.serving.rank.Rank`); nothing of NIXL is mocked. The prefill side's
refusal of a key used twice (item 2) runs the same way: a prefill rank's
:class:`kvplan_nixl.serving.push_io.Writes` with a real endpoint, a real hold table and side
channel, connecting the decode through the decode's real side channel server.
"""

from __future__ import annotations

from tests.test_vllm_serving import _in_vllm_venv

PUSH_CHECK = r"""
import threading, time
import numpy as np
from kvplan_nixl import Endpoint
from kvplan_nixl.serving.pushes import MAX_UNSEEN, PUSHED, PUSHFAIL, push_done
from kvplan_nixl.serving.push_io import Receives
from kvplan_nixl.serving.loads import Load
from kvplan_nixl.serving.settings import Settings
from kvplan_nixl.vllm.stats import KvplanStats
from tests.nixl_util import attn, pair, spec

KEY = b"kvplan-test-deployment-secret-18"
SP = spec(1, attn(heads=2, nb=16))

class Rank:  # the worker attributes Receives reads; its endpoint is real
    def __init__(self, ep):
        self.c = Settings("decode", "127.0.0.1", 5800, 1, extra={"push_timeout_s": 3})
        self.rank, self.lock, self.ep, self.hs_timeout = 0, threading.Lock(), ep, 1.0
        self.stats, self.waiting, self.recv_done, self.failed = KvplanStats(), {}, set(), []
        self.digester = None  # the transfer digest off
    def fail(self, load, why, peers=()):
        self.failed.append((load.req_id, why))
        self.recv_done.add(load.req_id)

def load(req):
    return Load(req_id=req, remote_req="", engine="prefill", host="127.0.0.1", port=5700,
                remote_tp=1, remote_ids=[[]], remote_first=[0], local_ids=[[3, 4]], start=0,
                end=32, parked=True, push=True, key="k-" + req)

def deliver(rx, d, n, timeout=10.0):  # what the worker's progress loop does
    got, end = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < end:
        got += d.notifications()
        for sender in SENDERS:  # (a sender's agent is progressed by its own loop)
            sender.progress()
    assert len(got) == n, (len(got), n)
    for m in got:
        assert rx.notice(m, time.monotonic()), m  # taken (or dropped) without raising

with pair(SP, SP, secret=KEY) as pr:
    pr.connect("pull"); pr.connect("push")
    p, d = pr.p[0], pr.d[0]
    evil = Endpoint("intruder", SP, 0, {"layers.0.attn": np.zeros_like(pr.src_bufs[(0, 0)])},
                    secret=KEY)  # holds the secret: its messages are sealed
    d.connect(evil.metadata(), mode="pull"); evil.connect(d.metadata(), mode="push")
    SENDERS = (p, evil)
    w = Rank(d)
    rx = Receives(w)
    tmap = d.map("prefill")
    ok = lambda req: push_done(PUSHED, req, {0: 64}, {0: 1})
    # item 4: an early PUSHED from an engine the request does not name never counts
    w.waiting["A"] = (load("A"), time.monotonic() + 5)
    evil.notify("decode", [0], ok("A"))
    deliver(rx, d, 1)
    w.waiting.pop("A")
    rx.register(load("A"), tmap, time.monotonic(), time.monotonic())
    assert "A" in rx.waiting and "A" not in w.recv_done
    evil.notify("decode", [0], ok("A"))  # nor once it waits
    deliver(rx, d, 1)
    assert "A" in rx.waiting
    p.notify("decode", [0], ok("A"))  # the engine it names: done
    deliver(rx, d, 1)
    assert "A" in w.recv_done and not w.failed
    # early answers for requests not seen yet: bounded per engine, the genuine one kept
    p.notify("decode", [0], ok("B"))
    for i in range(MAX_UNSEEN + 40):
        evil.notify("decode", [0], ok(f"junk-{i}"))
    deliver(rx, d, MAX_UNSEEN + 41)
    assert len(rx.early.table) == MAX_UNSEEN + 1 and "B" in rx.early.table
    rx.register(load("B"), tmap, time.monotonic(), time.monotonic())
    assert "B" in w.recv_done and not w.failed
    rx.progress(time.monotonic() + 5)  # past ttl: the junk expired
    assert rx.early.table == {}
    # item 5: one batch: nested 50,000 deep, a non-integer byte count, a forged key set, a
    # genuine PUSHED; the bad ones dropped, the genuine one taken, nothing raised
    rx.register(load("C"), tmap, time.monotonic(), time.monotonic())
    deep = b"[" * 50_000 + b"]" * 50_000
    for m in (PUSHED + b'{"decode_req":"C","bytes":' + deep + b',"runs":{}}',
              PUSHED + b'{"decode_req":"C","bytes":{"0":"x"},"runs":{}}',
              PUSHED + deep, PUSHFAIL + b'{"decode_req":"C","bytes":{"0":1.5},"runs":{}}',
              ok("C")):
        p.notify("decode", [0], m)
    deliver(rx, d, 5)
    assert "C" in w.recv_done and not w.failed and not rx.waiting
    # a PUSHED whose body is malformed never completes a request: it waits, then its deadline
    rx.register(load("D"), tmap, time.monotonic(), time.monotonic())
    p.notify("decode", [0], PUSHED + b'{"decode_req":"D","bytes":{"0":"7"},"runs":{}}')
    deliver(rx, d, 1)
    assert "D" in rx.waiting
    rx.progress(time.monotonic() + 10)
    assert w.failed == [("D", w.failed[0][1])] and "did not write" in w.failed[0][1]
    evil.close()
print("ok")
"""


#: the worker attributes Writes reads (endpoint, holds and side channels are real), for the
#: scripts below (each defines KEY before it)
WRITER_RANK = r"""
class Rank:  # the worker attributes Writes reads; endpoint, holds, side channels are real
    def __init__(self, ep):
        self.c = Settings("prefill", "127.0.0.1", 5700, 1)
        self.rank, self.lock, self.ep = 0, threading.Lock(), ep
        self.hs_timeout, self.lease = 2.0, 5.0
        self.stats, self.whole = KvplanStats(), False
        self.secret, self.digester = KEY, None  # handshakes check signed metadata; no digest
        self.check_peer = check_peer("0.32.0")  # decodes of another version are refused
        self.groups = TransferGroups((0,), ("full",), (16,), (None,), (0,))
        self.sends = Sends("127.0.0.1", 0, sc.server_identity("prefill", 0), ep.metadata(),
                           secret=KEY, lease=self.lease)
"""

COLLISION_CHECK = r"""
import threading, time
from kvplan.adapters.vllm import TransferGroups
from kvplan_nixl.serving import sidechannel as sc
from kvplan_nixl.serving.holds import new_generation
from kvplan_nixl.serving.pushes import PushSend, Registration, parse_done
from kvplan_nixl.serving.control import Sends
from kvplan_nixl.serving.push_io import Writes
from kvplan_nixl.serving.settings import Settings
from kvplan_nixl.vllm.stats import KvplanStats
from kvplan_nixl.vllm.versions import check_peer
from tests.nixl_util import attn, pair, spec

KEY = "kvplan-test-deployment-secret-18"
SP = spec(1, attn(heads=2, nb=16))

{WRITER_RANK}
with pair(SP, SP, secret=KEY.encode()) as pr:
    pr.connect("pull")  # the decode reached the prefill (it registers through it)
    p, d = pr.p[0], pr.d[0]
    dside = Sends("127.0.0.1", 0, sc.server_identity("decode", 0), d.metadata(), secret=KEY,
                  lease=5.0)  # the decode's side channel: how the prefill connects it
    w = Rank(p)
    wr = Writes(w)
    def reg(req):
        return Registration(key="reused", decode_req=req, engine="decode", host="127.0.0.1",
                            port=dside.server.port, tp=1, lists=((3, 4),), start=0, end=32,
                            ttl=5.0, sent=time.time())
    for req in ("dA", "dB"):  # two decode requests of one key (a reused X-Request-Id)
        d.notify("prefill", [0], reg(req).encode())
    got, end = 0, time.monotonic() + 10
    while got < 2 and time.monotonic() < end:
        for n in p.notifications():
            got += wr.notice(n, time.monotonic())
        d.progress()
    assert got == 2
    gen = new_generation()
    w.sends.hold([("pre-1", gen)])
    wr.add([PushSend("pre-1", gen, "reused", ((1, 2),), (0,))], time.monotonic())
    told, end = {}, time.monotonic() + 15
    while len(told) < 2 and time.monotonic() < end:  # PUSHFAIL to both, once connected
        wr.progress(time.monotonic())
        for n in d.notifications():
            ok, f = parse_done(n.message)
            told[f["decode_req"]] = (ok, f["why"])
        p.progress()
        time.sleep(0.005)
    assert set(told) == {"dA", "dB"} and not any(ok for ok, _ in told.values()), told
    assert all("more than one request" in why for _, why in told.values()), told
    assert not wr.inflight and not wr.matched  # nothing written into either
    done, _ = w.sends.finished()
    assert done == {"pre-1"}, done  # the prefill's hold ended: vLLM frees its blocks
    wr.close(); w.sends.close(); dside.close()
print("ok")
"""


def test_a_transfer_key_registered_twice_fails_both_and_writes_neither(vllm_python):
    """Item 2: two decode requests registering one key are both answered PUSHFAIL (over a
    real NIXL connection the prefill makes through the decode's real side channel), the
    prefill request of that key is written into neither and its hold ends."""
    _in_vllm_venv(vllm_python, COLLISION_CHECK.replace("{WRITER_RANK}", WRITER_RANK))


LATE_CHECK = r"""
import threading, time
import numpy as np
from kvplan.adapters.vllm import TransferGroups
from kvplan_nixl.serving import sidechannel as sc
from kvplan_nixl.serving.pushes import PushSend, Registration, parse_done
from kvplan_nixl.serving.control import Sends
from kvplan_nixl.serving.push_io import Writes
from kvplan_nixl.serving.settings import Settings
from kvplan_nixl.vllm.stats import KvplanStats
from kvplan_nixl.vllm.versions import check_peer
from tests.nixl_util import attn, pair, spec

KEY = "kvplan-test-deployment-secret-18"
SP = spec(1, *[attn(f"layers.{k}.attn", heads=2, nb=16) for k in range(2)])

{WRITER_RANK}
with pair(SP, SP, secret=KEY.encode()) as pr:
    pr.connect("pull")
    p, d = pr.p[0], pr.d[0]
    dside = Sends("127.0.0.1", 0, sc.server_identity("decode", 0), d.metadata(), secret=KEY,
                  lease=5.0)
    w = Rank(p)
    wr = Writes(w)
    reg = Registration(key="lw", decode_req="dL", engine="decode", host="127.0.0.1",
                       port=dside.server.port, tp=1, lists=((3, 4),), start=0, end=32,
                       ttl=1.5, sent=time.time())
    d.notify("prefill", [0], reg.encode())
    end = time.monotonic() + 10
    while time.monotonic() < end:  # the registration, then the decode connected
        for n in p.notifications():
            assert wr.notice(n, time.monotonic())
        d.progress()
        st = wr.hs.state("decode", "127.0.0.1", dside.server.port)
        if st is not None and st.ready:
            break
        time.sleep(0.005)
    assert st is not None and st.ready, st
    wr.begin([PushSend("pL", 0, "lw", ((1, 2),), (0,))], time.monotonic())
    assert wr.open and "pL" in wr.layers
    with w.lock:
        wr.save_layer("layers.0.attn")  # inside the window: posted
    time.sleep(1.6)  # a slow forward: the window closed before layer 1 was computed
    with w.lock:
        wr.save_layer("layers.1.attn")
    lw = wr.layers["pL"]
    assert lw.parts == 1 and lw.over, (lw.parts, lw.over)  # layer 1 never posted
    told, end = None, time.monotonic() + 10
    while told is None and time.monotonic() < end:
        for n in d.notifications():
            told = parse_done(n.message)
        p.progress()
    assert told is not None and not told[0] and "window closed" in told[1]["why"], told
    j = [r.name for r in SP.regions].index("layers.1.attn")
    assert np.array_equal(pr.dst_bufs[(0, j)], pr.before[(0, j)])  # nothing of it landed
    wr.close(); w.sends.close(); dside.close()
print("ok")
"""


def test_a_layer_computed_after_the_window_closed_is_never_posted(vllm_python):
    """Item 3: layer-wise, a layer hook that fires after the decode's window closed (a slow
    forward) posts nothing (its time is never clamped to 0 and posted): the push fails
    with PUSHFAIL to the decode, whose blocks of that layer are untouched."""
    _in_vllm_venv(vllm_python, LATE_CHECK.replace("{WRITER_RANK}", WRITER_RANK))


def test_push_answers_count_only_from_the_named_engine_and_malformed_ones_drop_alone(vllm_python):
    """Items 4 and 5: PUSHED from another engine (early or not) never completes a request;
    early answers are bounded per engine without losing the genuine one and expire; a
    batch of malformed answers (deep nesting, non-integer bytes) is dropped message by
    message, the genuine one in it taken, and a request they name ends loaded or failed."""
    _in_vllm_venv(vllm_python, PUSH_CHECK)
