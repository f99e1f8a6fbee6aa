"""Reporting a pull inside a lease (docs/vllm.md, "Reporting inside a lease"): the decode
connector's pull path over real NIXL agents and real, signed side channels (in the vLLM venv:
the connector imports vLLM), one TP 2 prefill read by one decode rank. A pull whose read is
seen complete inside the LEASE both prefill ranks granted is reported before its CONFIRM
(sent after, as a RETURN); one whose read outlasts the lease's margin waits for it; a RELEASE
racing a leased read is deferred until the reader's RETURN; a prefill without LEASE (an older
kvplan) makes the decode wait for the CONFIRM, and is not asked again at once. The holds'
side of the promise: tests/test_holds.py and tests/test_sidechannel.py."""

from __future__ import annotations

from tests.nixl_util import DIGEST_SCRIPT_SETUP

LEASED_PULLS = DIGEST_SCRIPT_SETUP + r"""
import socket, threading, time
from types import SimpleNamespace
from kvplan_nixl.serving import sidechannel as sc
from kvplan_nixl.serving.holds import new_generation, Verdict
from kvplan_nixl.serving.control import Control, Sends
from kvplan_nixl.serving.pull_state import LeaseState
from kvplan_nixl.serving.pulls import Pulls
from kvplan_nixl.serving.settings import Settings
from kvplan_nixl.serving.transfer_params import Peer

SECRET = "lease-test-secret"

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

class Prefill:  # a prefill worker rank's holds and its side channel (kvplan_nixl.serving.control)
    def __init__(self, p, ep, base):
        self.ep = ep
        self.sends = Sends("127.0.0.1", base + p, sc.server_identity("prefill", p),
                           ep.metadata(), secret=SECRET, lease=60.0)

class Decode:  # what Pulls reads of a decode worker rank (rank.Rank); fail() records why
    def __init__(self, ep):
        self.c = Settings("decode", "127.0.0.1", 1, 1)
        self.rank, self.ep, self.groups, self.whole, self.digester = 0, ep, groups, False, None
        self.lock, self.timeout, self.hs_timeout = threading.Lock(), 10.0, 5.0
        self.secret, self.lease, self.heartbeat, self.sends = SECRET, 60.0, 20.0, None
        self.lease_pin, self.lease_margin = 5.0, 0.1  # lease_pin_s, lease_margin_s
        self.stats, self.ctl = Stats(), Control(SECRET, 5.0)
        self.engines, self.recv_done, self.waiting, self.failed = {}, set(), {}, []
        self.admitted, self.reporting = {}, {}  # the pulls' timelines
        self.pulls = Pulls(self)
    def fail(self, load, why, peers=()):
        self.failed.append(why)
        self.ctl.release(load, peers)

def counts(key):
    return [pf.sends.holds.counts[key] for pf in P]

def wait(cond, what, seconds=10):
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.005)

def pull(req, *, read_after=0.0, when_held=None):
    '''Post ``req``'s pull (both prefill ranks hold it) and drive it until it is reported.
    The decode polls it (and the prefill ranks are progressed) only from ``read_after`` s
    after the post, and with ``when_held`` once the pull's LEASEs were all granted (it is
    called then, and what it returns is called at the report). Returns the load, its Pull
    and what the prefill ranks had confirmed when it was reported.'''
    gen = new_generation()
    for pf in P:
        pf.sends.hold([(req, gen)])
    load = SimpleNamespace(req_id="d-" + req, remote_req=req, engine="prefill",
                           host="127.0.0.1", port=pbase, remote_tp=2, remote_ids=[ids],
                           remote_first=[0], local_ids=[mine], start=0, end=end, parked=True,
                           generation=gen, push=False, key="", refused="", peer=Peer.KVPLAN)
    with D.lock:
        D.pulls.post(load, D.ep.map("prefill"), [1, 1])
        p = D.pulls.inflight[load.req_id]
    t0, after = time.monotonic(), None
    while load.req_id not in D.recv_done:
        assert time.monotonic() < t0 + 30 and not D.failed, (D.failed, D.pulls.inflight)
        if when_held is not None and after is None and p.lease.value.state is LeaseState.HELD:
            after = when_held(load) or (lambda: None)
        if time.monotonic() - t0 >= read_after and (when_held is None or after is not None):
            for pf in P:  # a target is progressed: the read completes
                pf.ep.progress()
            with D.lock:  # and only now may the decode see it complete (a loopback read
                D.ep.notifications()  # may complete without the target's progress)
                D.pulls.progress(time.monotonic())
        time.sleep(0.002)
    at_report = counts("confirmed")
    if after is not None:
        after()
    pr.check([ids], [mine], ())  # the bytes arrived
    return load, p, at_report

with pair(src, dst) as pr:
    pr.connect("pull")
    pbase = free_ports(2)
    P = [Prefill(p, ep, pbase) for p, ep in enumerate(pr.p)]
    D = Decode(pr.d[0])

    # 1. inside the lease: reported while the CONFIRMs (RETURNs) cannot even be answered
    def stall_side_channels(load):
        for pf in P:  # the prefill ranks' side channel threads wait for the hold table
            pf.sends.lock.acquire()
        def resume():
            assert counts("confirmed") == [0, 0] and counts("leased") == [1, 1]
            for pf in P:
                pf.sends.lock.release()
        return resume
    load, p, at_report = pull("inside", when_held=stall_side_channels)
    assert at_report == [0, 0] and D.stats.counts.get("num_leased_pulls") == 1, D.stats.counts
    assert p.lease.value.granted == {0, 1} and p.seen_done < p.lease.value.until
    marks = D.reporting[load.req_id]  # admitted, started, posted, read, confirmed
    assert marks[3] == p.seen_done and marks[4] >= marks[3], marks
    wait(lambda: counts("confirmed") == [1, 1], "the RETURNs after the report")
    assert all("inside" not in pf.sends.holds for pf in P)  # each rank's one reader: ended
    assert [pf.sends.finished()[0] for pf in P] == [{"inside"}, {"inside"}]

    # 2. a read that outlasts the lease's margin: reported only after its CONFIRMs (RETURN)
    D.lease_pin, D.lease_margin = 0.3, 0.1
    load, p, at_report = pull("slow", read_after=0.5)
    assert p.lease.value.state is LeaseState.HELD and p.seen_done >= p.lease.value.until, (
        p.lease.value, p.seen_done, counts("leased"), counts("lease_refused"))
    assert at_report == [2, 2] and D.stats.counts.get("num_leased_pulls") == 1, at_report
    assert counts("leased") == [2, 2]
    D.lease_pin, D.lease_margin = 5.0, 0.1

    # 3. the proxy's RELEASE races a leased read: deferred, the read is reported inside the
    # lease, and the hold ends at the reader's RETURN (answered yes: held throughout)
    def proxy_release(load):
        for r in range(2):
            assert sc.control("127.0.0.1", pbase + r, "RELEASE", load.remote_req,
                              load.generation, identity=sc.server_identity("prefill", r),
                              secret=SECRET) is Verdict.YES
        assert counts("deferred") == [1, 1] and all("raced" in pf.sends.holds for pf in P)
    load, p, at_report = pull("raced", when_held=proxy_release)
    assert D.stats.counts.get("num_leased_pulls") == 2, D.stats.counts
    wait(lambda: counts("confirmed") == [3, 3], "the RETURNs after the report")
    assert "num_returns_refused" not in D.stats.counts, D.stats.counts
    assert [pf.sends.finished()[0] for pf in P] == [{"raced", "slow"}] * 2

    # the ranks that granted a LEASE got a spare connection each: the next LEASEs leave
    # from the posting thread, one send each, and are answered there (no new connection)
    wait(lambda: len(D.ctl.spares) == 2, "the spare connections after a granted LEASE")
    accepted = [pf.sends.server.stats["accepted"] for pf in P]
    load, p, at_report = pull("spare", when_held=lambda load: None)
    assert p.lease.value.state is LeaseState.HELD and p.lease.value.granted == {0, 1}
    wait(lambda: counts("confirmed") == [4, 4], "the RETURNs after the report")
    wait(lambda: len(D.ctl.spares) == 2, "the spare connections after the next LEASE")
    # two connections a rank: the RETURN's and the next spare; a LEASE of its own is a third
    assert [pf.sends.server.stats["accepted"] for pf in P] == [a + 2 for a in accepted], (
        accepted, [pf.sends.server.stats["accepted"] for pf in P])

    # 4. a prefill that does not know LEASE (an older kvplan answers ERR malformed): the pull
    # waits for its CONFIRM, and the next one asks no LEASE (both ranks were asked at once:
    # the LEASEs left together on their spare connections)
    answer = sc.SideChannelServer._answer
    def old_answer(self, c, line):
        if line.split(b" ", 1)[0] in (b"LEASE", b"RETURN"):
            return self._refuse("malformed")
        return answer(self, c, line)
    sc.SideChannelServer._answer = old_answer
    try:
        load, p, at_report = pull("old", read_after=0.2)
        assert p.lease.value.state is LeaseState.REFUSED and at_report == [5, 5], at_report
        assert "prefill" in D.pulls.no_lease and D.stats.counts.get("num_leased_pulls") == 3
        load, p, at_report = pull("old-again")
        assert p.lease.value.state is LeaseState.NONE and at_report == [6, 6], at_report
        assert [pf.sends.server.stats["malformed"] for pf in P] == [1, 1]  # asked once
    finally:
        sc.SideChannelServer._answer = answer
    assert not D.failed, D.failed
    D.ctl.close(); D.pulls.close()
    for pf in P:
        pf.sends.close()
print("ok")
"""


def test_pulls_reported_inside_their_lease_and_the_fallbacks(vllm_python):
    from tests.test_vllm_serving import _in_vllm_venv

    _in_vllm_venv(vllm_python, LEASED_PULLS)
