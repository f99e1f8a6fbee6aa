"""The transfer digest of a pull: its words (no I/O), and the connector's pull path over real
NIXL agents and real side channels (in the vLLM venv: it imports vLLM), verified when clean,
failing the request when one byte was flipped in flight, and refused by name when the prefill
has the digest off."""

from __future__ import annotations

import pytest

from kvplan_nixl.digest import Digest
from kvplan_nixl.serving.pull_digests import DIGASK, DIGEST, DigestAsk, digest_answer, parse_answer
from kvplan_nixl.serving.pushes import MAX_MESSAGE
from tests.nixl_util import DIGEST_SCRIPT_SETUP


def _ask(**kw) -> DigestAsk:
    d = dict(req="p-1", generation=7, decode_req="d-1", host="10.0.0.2", port=5600,
             lists=((3, 4, 5), ()), start=0, end=40)
    d.update(kw)
    return DigestAsk(**d)


def test_a_question_round_trips_and_bad_ones_are_named():
    a = _ask()
    assert DigestAsk.decode(a.encode()) == a
    for bad, word in ((_ask(port=0), "bad numbers"), (_ask(start=50), "bad numbers"),
                      (_ask(generation=0), "bad generation"), (_ask(req=""), "bad names"),
                      (_ask(lists=((-1,),)), "lists must be lists of block ids"),
                      (_ask(lists=((True,),)), "lists must be lists of block ids")):
        with pytest.raises(ValueError, match=word):
            DigestAsk.decode(bad.encode())
    with pytest.raises(ValueError, match="not a pull digest question"):
        DigestAsk.decode(DIGEST + b"{}")
    with pytest.raises(ValueError, match="above"):  # never parsed: bounded
        DigestAsk.decode(DIGASK + b" " * MAX_MESSAGE)
    with pytest.raises(ValueError, match="not JSON"):
        DigestAsk.decode(DIGASK + b"[" * 100000)


def test_an_answer_carries_a_digest_or_why_not():
    d = Digest(4096, 12345, 678)
    assert parse_answer(digest_answer("d-1", d)) == ("d-1", d, "")
    assert parse_answer(digest_answer("d-1", None, "off here")) == ("d-1", None, "off here")
    assert parse_answer(DIGASK + b"{}") is None  # a question is not an answer
    assert parse_answer(b"kvplan-push-done {}") is None
    req, d, why = parse_answer(DIGEST + b'{"decode_req":"d","digest":"nope"}')
    assert (req, d) == ("d", None) and why.startswith("a malformed digest: a digest must be")
    with pytest.raises(ValueError, match="bad decode_req"):
        parse_answer(DIGEST + b'{"decode_req":5}')


# -- the connector's pull path, without engines -------------------------------------------------

CONNECTOR_PULL = DIGEST_SCRIPT_SETUP + r"""
import socket, threading, time
from types import SimpleNamespace
import numpy as np
from kvplan.pairs import pair_runs
from kvplan_nixl.serving.handshakes import Handshakes, identity
from kvplan_nixl.serving.holds import new_generation
from kvplan_nixl.serving.pushes import PushSend
from kvplan_nixl.serving.sidechannel import SideChannelServer, server_identity
from kvplan_nixl.serving.control import Control, Sends
from kvplan_nixl.serving.pull_digest_io import Answers
from kvplan_nixl.serving.pulls import Pulls
from kvplan_nixl.serving.settings import Settings
from kvplan_nixl.serving.transfer_params import Peer

def free_ports(n):  # n consecutive free ports on the loopback
    for _ in range(100):
        s = socket.socket(); s.bind(("127.0.0.1", 0)); base = s.getsockname()[1]; s.close()
        try:
            held = [socket.create_server(("127.0.0.1", base + i)) for i in range(n)]
        except OSError:
            continue
        for h in held:
            h.close()
        return base
    raise SystemExit("no free ports")

class Stats:
    def __init__(self):
        self.counts = {}
    def record(self, key, n=1):
        self.counts[key] = self.counts.get(key, 0) + n
    def record_transfer(self, *a):
        self.record("transfers")

class Prefill:  # what Answers reads of a prefill worker rank; a real hold table and server
    def __init__(self, p, ep, base, bufs):
        self.rank, self.ep, self.groups, self.whole = p, ep, groups, False
        self.lock, self.hs_timeout = threading.Lock(), 5.0
        self.digester = digester(src, p, bufs)
        self.sends = Sends("127.0.0.1", base + p, server_identity("prefill", p), ep.metadata(),
                           secret=None, lease=60.0)
        self.hs = Handshakes(self._connect, lock=self.lock, timeout=5.0, identify=identity(None))
        self.answers = Answers(self, self.hs)
    def _connect(self, engine, rank, blob):  # as Writes connects a decode: push mode
        self.ep.connect(blob, mode="push")
        return tuple(self.ep.map(engine, "push").peers)

class Decode:  # what Pulls reads of a decode worker rank; fail() records the verdict
    def __init__(self, ep, base, d):
        self.c = Settings("decode", "127.0.0.1", base, 1, extra={"digest": True})
        self.rank, self.ep, self.groups, self.whole, self.digester = 0, ep, groups, False, d
        self.lock, self.timeout, self.hs_timeout = threading.Lock(), 10.0, 5.0
        self.secret, self.lease, self.heartbeat, self.sends = None, 60.0, 20.0, None
        # no LEASE: this test counts CONFIRMs at the report (tests/test_lease_report.py
        # reports inside a lease)
        self.lease_pin, self.lease_margin = 0.0, 0.1
        self.stats, self.ctl = Stats(), Control(None, 5.0)
        self.hs = SimpleNamespace(forget=lambda engine: None)
        self.engines, self.recv_done, self.waiting, self.failed = {}, set(), {}, []
        self.admitted, self.reporting = {}, {}  # the pulls' timelines (rank.Rank)
        # its metadata, served as a decode rank's side channel serves it (the prefill fetches)
        self.server = SideChannelServer("127.0.0.1", base, server_identity("decode", 0),
                                        metadata=ep.metadata())
        self.pulls = Pulls(self)
    def fail(self, load, why, peers=()):
        self.failed.append(why)
        self.ctl.release(load, peers)

def pull(pr, P, D, pbase, req, flip=False, silent=False):
    gen = new_generation()
    for pf in P:  # each prefill rank holds it and keeps the lists it handed
        pf.sends.hold([(req, gen)])
        with pf.lock:
            pf.answers.add([PushSend(req, gen, "", (tuple(ids),), (0,))])
    load = SimpleNamespace(req_id="d-" + req, remote_req=req, engine="prefill",
                           host="127.0.0.1", port=pbase, remote_tp=2, remote_ids=[ids],
                           remote_first=[0], local_ids=[mine], start=0, end=end, parked=True,
                           generation=gen, push=False, key="", refused="", peer=Peer.KVPLAN)
    restore = None
    if flip:  # in flight: the read carries a byte prefill rank 1 does not hold
        plan = D.ep.map("prefill").plan(groups.remote([ids], [0]), groups.local([mine]),
                                        tokens=(0, end))
        row = pair_runs(plan, 1, 0)[3]
        buf = pr.src_bufs[(1, int(row["src_region"]))].reshape(-1).view(np.uint8)
        at = int(row["src_offset"]) + int(row["length"]) // 2
        buf[at] ^= 0x20
        def restore():
            buf[at] ^= 0x20
    with D.lock:
        D.pulls.post(load, D.ep.map("prefill"), [1, 1])
    failed, deadline = len(D.failed), time.monotonic() + 30
    while load.req_id not in D.recv_done and len(D.failed) == failed:
        assert time.monotonic() < deadline, ("no verdict", D.pulls.inflight)
        now = time.monotonic()
        p = D.pulls.inflight.get(load.req_id)
        asked = p is None or p.asked_until > 0
        if asked and restore is not None:  # the read is over: the prefill holds the original
            restore()
            restore = None
        for pf in P:
            with pf.lock:
                if not asked or silent:  # a target is progressed: the read completes
                    pf.ep.progress()
                    continue
                for n in pf.ep.notifications():
                    assert pf.answers.notice(n, now), n
                pf.answers.progress(now)
        with D.lock:
            for n in D.ep.notifications():
                assert D.pulls.notice(n, now), n
            D.pulls.progress(now)
        time.sleep(0.002)
    return load.req_id, gen

with pair(src, dst) as pr:
    pr.connect("pull")
    pbase, dbase = free_ports(2), free_ports(1)
    P = [Prefill(p, ep, pbase, pr.src_bufs) for p, ep in enumerate(pr.p)]
    D = Decode(pr.d[0], dbase, digester(dst, 0, pr.dst_bufs))
    req, _ = pull(pr, P, D, pbase, "clean")
    assert D.recv_done == {req} and D.failed == [], (D.recv_done, D.failed)
    assert [pf.sends.holds.counts["confirmed"] for pf in P] == [1, 1]
    pr.check([ids], [mine], ())  # the oracle agrees the bytes arrived
    # a byte flipped in flight: failed before any CONFIRM (the holds are released, not used)
    req, _ = pull(pr, P, D, pbase, "flipped", flip=True)
    assert req not in D.recv_done and len(D.failed) == 1, (D.recv_done, D.failed)
    assert "DigestMismatch" in D.failed[0] and "rank 1: digest mismatch: source" in \
        D.failed[0] and "rank 0: digest mismatch" not in D.failed[0], D.failed
    assert D.stats.counts.get("num_failed_transfers") == 1, D.stats.counts
    assert [pf.sends.holds.counts["confirmed"] for pf in P] == [1, 1]
    deadline = time.monotonic() + 10  # the RELEASEs run on the Control pool
    while sum(pf.sends.holds.counts["released"] for pf in P) < 4:
        assert time.monotonic() < deadline, [pf.sends.holds.counts for pf in P]
        time.sleep(0.01)
    # a prefill with the digest off answers so: refused by name, not passed unchecked
    for pf in P:
        pf.digester = None
    req, _ = pull(pr, P, D, pbase, "unsigned")
    assert req not in D.recv_done and len(D.failed) == 2, D.failed
    assert "the transfer digest is off at this prefill" in D.failed[1], D.failed
    assert [pf.sends.holds.counts["confirmed"] for pf in P] == [1, 1]
    # prefill ranks that never answer: failed once the answers are due (transfer_timeout_s)
    D.timeout = 1.0
    t0 = time.monotonic()
    req, _ = pull(pr, P, D, pbase, "silent", silent=True)
    assert req not in D.recv_done and len(D.failed) == 3, D.failed
    assert D.failed[2].count("no digest within transfer_timeout_s") == 2 and "{0: " in \
        D.failed[2] and ", 1: " in D.failed[2] and time.monotonic() - t0 < 10, D.failed
    assert [pf.sends.holds.counts["confirmed"] for pf in P] == [1, 1]
    D.ctl.close(); D.server.close(); D.pulls.close()
    for pf in P:
        pf.hs.close(); pf.sends.close(); pf.answers.close()
print("ok")
"""


def test_connector_pull_checks_the_digest_before_its_confirm(vllm_python):
    from tests.test_vllm_serving import _in_vllm_venv

    _in_vllm_venv(vllm_python, CONNECTOR_PULL)
