"""The notification channel as a trust boundary, attacked by a raw NIXL agent (issue 18).

The attacker is a bare NIXL agent made here: it never holds the secret, loads the victim's NIXL
metadata (anyone who read the published blob can) and sends notifications, under a name of its
own or under a genuine peer's name (NIXL reports whatever name a sender gives itself). Every
attack must leave the victim's bytes, slots, handles and user notifications as a genuine run
leaves them, and be counted in ``Endpoint.stats()`` / ``Stager.stats()``. Replays re-send
messages a genuine endpoint sealed (captured on their way to NIXL). Then: state keyed by a peer
goes with the peer (disconnect, close, restart), and 2,000 connect/disconnect cycles keep
descriptor lists, handles, slots and file descriptors flat.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time

import numpy as np
import pytest

from kvplan_nixl import (
    DeadlinePassed,
    Endpoint,
    NotConnectedError,
    PlanMismatchError,
    TransferFailed,
)
from kvplan_nixl._nixl import make_agent
from kvplan_nixl.endpoint import Notification
from kvplan_nixl.envelope import MAGIC
from kvplan_nixl.staged import Stager
from kvplan_nixl.staged.server import SERVE_TIMEOUT
from tests.nixl_util import attn, pair, spec

KEY = b"kvplan-test-deployment-secret-18"
SRC = spec(1, attn(heads=4, nb=64))
DST = spec(1, attn(heads=4, nb=64))
SLOT = 64 << 10
SB, DB = [list(range(1, 21))], [list(range(30, 50))]
IDLE = {"slots_in_use": 0, "xfer": 0, "requests": 0, "serving": 0}


def _idle(st: Stager) -> dict:
    return {k: v for k, v in st.handles().items() if k in IDLE}


class Attacker:
    """A bare NIXL agent named ``name`` that loaded ``victim``'s NIXL metadata."""

    def __init__(self, name: str, victim: Endpoint) -> None:
        self.agent = make_agent(name, ("UCX",), False)
        self.victim = victim.agent_name
        self.agent.add_remote_agent(victim._agent.get_agent_metadata())

    def send(self, *msgs: bytes) -> None:
        for m in msgs:
            self.agent.send_notif(self.victim, m)

    def progress(self) -> None:  # its notices leave on its own progress
        self.agent.get_new_notifs()

    def poll(self) -> None:
        self.progress()

    def close(self) -> None:
        self.agent.remove_remote_agent(self.victim)
        self.agent = None


def _pump(*things, rounds: int = 60) -> None:
    """Progress/poll everything a while (the attacker's notices leave, the victim reads)."""
    for _ in range(rounds):
        for x in things:
            (x.poll if hasattr(x, "poll") else x.progress)()
        time.sleep(1e-3)


def _until(cond, things, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        _pump(*things, rounds=1)
    return True


class _Capture:
    """Records what an endpoint's NIXL agent sends (sealed, as it leaves)."""

    def __init__(self, monkeypatch, ep: Endpoint) -> None:
        self.sent: list[tuple[str, bytes]] = []
        real = ep._agent.send_notif

        def spy(name, msg):
            self.sent.append((name, bytes(msg)))
            return real(name, msg)

        monkeypatch.setattr(ep._agent, "send_notif", spy)

    def find(self, needle: bytes) -> bytes:
        return next(m for _, m in self.sent if needle in m)


def _forged(msg: bytes) -> bytes:
    """An envelope with a made-up tag (what an attacker without the secret can make)."""
    return MAGIC + struct.pack(">Q", time.time_ns()) + os.urandom(16) + msg


@contextlib.contextmanager
def staged(secret=KEY, **kw):
    with pair(SRC, DST, secret=secret, **kw) as pr:
        sts = {ep: Stager(ep, pool_bytes=4 * SLOT, slot_bytes=SLOT) for ep in pr.endpoints}
        try:
            pr.connect("pull")
            pr.connect("push")
            pr.stagers = sts
            yield pr
        finally:
            for st in sts.values():
                st.close()


def _staged_run(pr, mode: str, *, notify=None, attack=None):
    """One staged request, genuine; ``attack()`` runs right after it is posted."""
    ini = pr.d[0] if mode == "pull" else pr.p[0]
    remote = "prefill" if mode == "pull" else "decode"
    st = pr.stagers[ini]
    t = (st.read if mode == "pull" else st.write)(ini.map(remote, mode).plan(SB, DB), remote,
                                                   notify=notify, timeout=30)
    if attack is not None:
        attack()
    t.wait(30, progress=list(pr.stagers.values()))
    return t


def _settled(pr) -> None:
    sts = list(pr.stagers.values())
    assert _until(lambda: all(_idle(s) == IDLE for s in sts), sts), [s.handles() for s in sts]


# -- point 1: a forged POOL never re-points a Stager --------------------------------------------


@pytest.mark.parametrize("secret", [KEY, None])
def test_forged_pool_cannot_repoint_staged_pushes(secret):
    with staged(secret) as pr:
        p, d = pr.p[0], pr.d[0]
        sts = list(pr.stagers.values())
        target = d._bases[0] + 4096  # decode's own KV memory: what the forger wants written
        pool = f"kvs1 POOL h0 {target} {4 * SLOT} {SLOT} 0 DRAM".encode()
        # under the genuine decode agent's name, and under a name of its own
        liar, stranger = Attacker(d.agent_name, p), Attacker("decode#0#f00d", p)
        pr.stagers[p]._asking.add("h0")  # even a POOL the victim waits for
        if secret is not None:
            liar.send(pool, _forged(pool))
        stranger.send(pool, _forged(pool))
        _pump(liar, stranger, *sts)
        for _ in range(3):  # every later push lands exactly
            _staged_run(pr, "push")
            pr.check(SB, DB)
        s = p.stats()
        assert s["unknown"] == 2
        if secret is not None:
            assert s["unsigned"] == 1 and s["forged"] == 1
        _settled(pr)
        liar.close()
        stranger.close()


# -- point 2: forged DONE / DATA never make a request report wrong bytes -------------------------


def test_forged_done_and_data_are_dropped():
    with staged() as pr:
        p, d = pr.p[0], pr.d[0]
        to_p, to_d = Attacker(d.agent_name, p), Attacker(p.agent_name, d)

        def attack():
            for rid in range(4):
                to_p.send(f"kvs1 DONE {rid}".encode(), _forged(f"kvs1 DONE {rid}".encode()))
                for k in range(4):
                    m = f"kvs1 DATA {rid} {k}".encode()
                    to_d.send(m, _forged(m))
            _pump(to_p, to_d, rounds=5)

        t = _staged_run(pr, "push", notify=b"req-7", attack=attack)
        assert t.ok and t.nbytes > 0
        pr.check(SB, DB)
        got = d.notifications()
        assert got == [Notification("prefill", 0, b"req-7")]
        both = (to_p, to_d, *pr.stagers.values())
        assert _until(lambda: p.stats()["forged"] + p.stats()["unsigned"] == 8, both)
        assert _until(lambda: d.stats()["forged"] + d.stats()["unsigned"] == 32, both)
        assert p.stats()["forged"] == 4 and d.stats()["forged"] == 16
        _settled(pr)
        to_p.close()
        to_d.close()


# -- point 3: no fake completion reaches notifications() ----------------------------------------


@pytest.mark.parametrize("secret", [KEY, None])
def test_fake_user_notifications_are_never_delivered(secret):
    with pair(SRC, DST, secret=secret) as pr:
        pr.connect("pull")
        p, d = pr.p[0], pr.d[0]
        assert _until(lambda: d.agent_name in p._peers.loaded, [p, d])  # decode's hello came
        stranger = Attacker("decode#0#bad0", p)
        stranger.send(b"req-42", _forged(b"req-42"), b"\x00kvplan_nixl\x00close")
        attackers = [stranger]
        if secret is not None:
            liar = Attacker(d.agent_name, p)  # a connected peer's name, without the secret
            liar.send(b"req-42", _forged(b"req-42"), _forged(b"\x00kvplan_nixl\x00close"))
            attackers.append(liar)
        want = 3 if secret is None else 6
        assert _until(lambda: sum(p.stats().values()) == want, [*attackers, p])
        assert p.notifications() == []
        assert p.stats()["unknown"] == 3
        if secret is not None:
            assert p.stats()["unsigned"] == 1 and p.stats()["forged"] == 2
            assert len(p._peers.loaded) == 1  # the forged close dropped nobody
        # the genuine message arrives with the user's bytes unchanged
        pr.run("pull", SB, DB, notify=b"req-42\x00\xff")
        assert _until(lambda: p._router.queue, [p])
        assert p.notifications() == [Notification("decode", 0, b"req-42\x00\xff")]
        pr.check(SB, DB)
        for a in attackers:
            a.close()


# -- point 4: replays, huge timeouts and sizes, forged aborts, malformed fields ------------------


def test_replayed_open_ready_and_notify_are_refused(monkeypatch):
    with staged() as pr:
        p, d = pr.p[0], pr.d[0]
        cap_d, cap_p = _Capture(monkeypatch, d), _Capture(monkeypatch, p)
        _staged_run(pr, "pull", notify=b"done-1")
        pr.check(SB, DB)
        _settled(pr)
        assert p.notifications() == [Notification("decode", 0, b"done-1")]
        sealed_open, sealed_ready = cap_d.find(b"kvs1 OPEN"), cap_p.find(b"kvs1 READY")
        to_p, to_d = Attacker(d.agent_name, p), Attacker(p.agent_name, d)
        before = p.stats()["replayed"], d.stats()["replayed"]
        for _ in range(3):
            to_p.send(sealed_open)
            to_d.send(sealed_ready)
        sts = list(pr.stagers.values())
        assert _until(lambda: (p.stats()["replayed"], d.stats()["replayed"]) == (
            before[0] + 3, before[1] + 3), [to_p, to_d, *sts])
        assert all(_idle(s) == IDLE for s in sts)
        assert p.notifications() == []
        # from an older connection: decode disconnects and reconnects prefill; prefill's
        # messages of the first connection are refused, the new connection works
        d.disconnect("prefill", 0)
        d.connect(p.metadata(), mode="pull")
        to_d.send(sealed_ready)
        assert _until(lambda: d.stats()["replayed"] == before[1] + 4, [to_d, *sts])
        _staged_run(pr, "pull")
        pr.check(SB, DB)
        _settled(pr)
        to_p.close()
        to_d.close()


def test_wire_values_are_bounded_and_duplicates_hold_nothing(monkeypatch):
    """What a peer holding the secret (or any peer, without one) sends is still bounded: a
    10**12 ms timeout holds slots at most the server's own limit, a repeated OPEN or credit
    takes nothing, malformed pool fields are dropped and counted, never raised out of a wait."""
    with staged(None) as pr:
        p, d = pr.p[0], pr.d[0]
        sp, sd = pr.stagers[p], pr.stagers[d]
        cap = _Capture(monkeypatch, d)
        _staged_run(pr, "pull")
        _settled(pr)
        genuine_open = cap.find(b"kvs1 OPEN")
        head, body = genuine_open.split(b"\n", 1)
        f = head.split(b" ")
        f[2], f[5] = b"77", str(10**12).encode()  # a new request id, a 10**12 ms timeout
        huge = b" ".join(f) + b"\n" + body
        sp.channel.inbox.extend([(d.agent_name, huge), (d.agent_name, huge)])  # + a duplicate
        sp.poll()
        job = sp._server.served[(d.agent_name, "77")]
        assert job.deadline <= time.monotonic() + SERVE_TIMEOUT
        assert sp.stats()["stray"] == 1 and len(sp._server.served) == 1
        sp._server._drop(job, "test", tell=False)
        # malformed pool fields and a repeated credit during a genuine request: no exception
        sd._asking.add("h9")
        bad = [b"kvs1 POOL h9 %d 4096 4096 0 DRAM" % (1 << 70),
               b"kvs1 POOL h9 4096 -1 4096 0 DRAM", b"kvs1 POOL h9 4096 8192 4096 0 NOPE",
               b"kvs1 POOL h9 x"]

        def attack():
            sd.channel.inbox.extend((p.agent_name, m) for m in bad)

        _staged_run(pr, "pull", attack=attack)
        pr.check(SB, DB)
        assert sd.stats()["malformed"] == 4
        _settled(pr)
        assert d.handles()["xfer"] == 0 and sd.handles()["dlist"] == 2


def test_unknown_senders_cost_nothing_and_forged_aborts_kill_nothing():
    with staged() as pr:
        p, d = pr.p[0], pr.d[0]
        stranger = Attacker("decode#0#beef", p)
        liar, liar_d = Attacker(d.agent_name, p), Attacker(p.agent_name, d)
        big = b"kvs1 OPEN 5 pull 65536 0 10 1 1 1 " + b"1 " * 30000 + b"0\n" + b"\0" * 4096
        t0 = time.perf_counter()
        stranger.send(big, big, big)
        assert _until(lambda: p.stats()["unknown"] == 3, [stranger, p])
        assert time.perf_counter() - t0 < 2.0

        def attack():  # ABORT to the server, FAIL to the initiator, in the other's name
            for rid in range(3):
                m = f"kvs1 ABORT {rid} x".encode()
                liar.send(m, _forged(m))
                m = f"kvs1 FAIL {rid} server deadline passed".encode()
                liar_d.send(m, _forged(m))
            _pump(liar, liar_d, rounds=5)

        t = _staged_run(pr, "pull", attack=attack)
        assert t.ok
        pr.check(SB, DB)
        _settled(pr)
        assert _until(lambda: d.stats()["forged"] == 3 and p.stats()["forged"] == 3,
                      [liar, liar_d, *pr.stagers.values()])
        for a in (stranger, liar, liar_d):
            a.close()


# -- point 5: state keyed by a peer goes with the peer ------------------------------------------


@pytest.mark.parametrize("secret", [KEY, None])
def test_reconnected_peer_works_staged_and_direct(secret):
    with staged(secret) as pr:
        p, d = pr.p[0], pr.d[0]
        sd = pr.stagers[d]
        for _ in range(3):
            d.disconnect("prefill", 0)
            assert sd.handles()["dlist"] == 1  # the peer pool's list went with the peer
            d.connect(p.metadata(), mode="pull")
            _staged_run(pr, "pull")
            pr.check(SB, DB)
            pr.run("pull", SB, DB)
            pr.check(SB, DB)
        _settled(pr)


def test_in_flight_staged_request_fails_naming_its_blocks_when_its_peer_goes():
    with staged() as pr:
        d = pr.d[0]
        sd, sp = pr.stagers[d], pr.stagers[pr.p[0]]
        t = sd.read(d.map("prefill").plan(SB, DB), "prefill", timeout=30)
        sd.poll()  # the server is never polled: the request stays pending
        d.disconnect("prefill", 0)
        with pytest.raises(TransferFailed) as e:
            t.wait(5)
        assert e.value.blocks[0].tolist() == DB[0]
        assert _idle(sd) == IDLE and sd.handles()["dlist"] == 1
        sp.poll()


def _restart(pr, spec_=SRC):
    """Prefill restarts (a new endpoint and stager over the same buffers), both sides connect."""
    old = pr.p[0]
    pr.stagers.pop(old).close()
    old.close()
    bufs = {spec_.regions[0].name: pr.src_bufs[(0, 0)]}
    p = Endpoint("prefill", spec_, 0, bufs, secret=KEY)
    pr.p[0] = p
    pr.stagers[p] = Stager(p, pool_bytes=4 * SLOT, slot_bytes=SLOT)
    return p


def test_ten_restarts_keep_the_initiators_lists_flat():
    with staged() as pr:
        d = pr.d[0]
        sd = pr.stagers[d]
        for _ in range(10):
            p = _restart(pr)
            d.connect(p.metadata(), mode="pull")
            p.connect(d.metadata(), mode="push")
            _staged_run(pr, "pull")
            pr.check(SB, DB)
            assert sd.handles()["dlist"] == 2, sd.handles()  # its own and the live peer's
            assert d.handles()["remote_agents"] == 1 and len(d._peers.loaded) == 1
        _settled(pr)


def test_layerwise_request_after_its_peer_closes_or_changes_layout():
    two = spec(1, attn(heads=4, nb=64), attn("layers.1.attn", heads=4, nb=64))
    with pair(two, two, secret=KEY) as pr:
        pr.connect("pull")
        d = pr.d[0]
        plan = d.map("prefill").plan(SB, DB)
        req = d.request(plan, "prefill")
        req.post(["layers.0.attn"]).wait(10, progress=pr.p)
        pr.p[0].close()  # the peer closes: its notice drops it
        _pump(d)
        with pytest.raises(NotConnectedError):
            req.post(["layers.1.attn"])
        # a restart with another layout of the same size: an old part is refused
        other = spec(1, attn(heads=4, nb=64, layout="NHD"), attn("layers.1.attn", heads=4,
                                                                   nb=64))
        bufs = {r.name: pr.src_bufs[(0, i)] for i, r in enumerate(other.regions)}
        pr.p[0] = Endpoint("prefill", other, 0, bufs, secret=KEY)
        d.connect(pr.p[0].metadata(), mode="pull")
        with pytest.raises(PlanMismatchError):
            req.post(["layers.1.attn"])
        with pytest.raises(PlanMismatchError):
            d.read(plan.part(["layers.1.attn"]), "prefill")
        assert d.handles()["xfer"] == 0 and d.handles()["transfers"] == 0


# -- point 7: 2,000 connect/disconnect cycles stay flat ------------------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_two_thousand_connect_disconnect_cycles_stay_flat():
    """2,000 disconnect/connect cycles of one live peer (a staged and a direct transfer every
    250): file descriptors, NIXL handles, lists and slots end where they began. NIXL leaks two
    sockets per remove_remote_agent of a live agent; the endpoint parks a disconnected agent
    and takes it back on reconnect (docs/executor.md, "Close and restart")."""
    with staged() as pr:
        p, d = pr.p[0], pr.d[0]
        sd = pr.stagers[d]
        meta = p.metadata()
        _staged_run(pr, "pull")
        pr.run("pull", SB, DB)
        _settled(pr)
        base = _fds(), d.handles(), p.handles(), sd.handles()
        t0 = time.perf_counter()
        for i in range(2000):
            d.disconnect("prefill", 0)
            d.connect(meta, mode="pull")
            if i % 250 == 0:
                _staged_run(pr, "pull")
                pr.run("pull", SB, DB)
        _staged_run(pr, "pull")  # the reconnected peer's pool is learnt again
        pr.check(SB, DB)
        _settled(pr)
        took = time.perf_counter() - t0
        assert (_fds(), d.handles(), p.handles(), sd.handles()) == base
        assert took < 120, took


# -- issue 28: a tampered plan through the staged path, a disconnect of one direction ----------


def test_tampered_plan_is_refused_by_the_staged_path_before_any_open(monkeypatch):
    """The staged initiator applies kvplan.check_plan too: an edited plan (a run naming buffer
    -64, two runs on one destination byte) is refused with simulate's PlanError before an OPEN
    leaves; nothing is held on either side."""
    import attrs
    import numpy as np

    from kvplan import PlanError

    with staged() as pr:
        d = pr.d[0]
        sd = pr.stagers[d]
        cap = _Capture(monkeypatch, d)
        plan = d.map("prefill").plan(SB, DB)
        for edit in ({"dst_buffer": -64}, {"dst_offset": int(plan.copies()["dst_offset"][1])}):
            rows = plan.copies().copy()
            for k, v in edit.items():
                rows[k][0] = v
            rows.flags.writeable = False
            bad = attrs.evolve(plan, rows=rows)
            for how in ("staged", "auto", "direct"):
                with pytest.raises(PlanError):
                    sd.post(bad, "prefill", how=how, timeout=5)
        assert not [m for _, m in cap.sent if b"kvs1 OPEN" in m]
        assert _idle(sd) == IDLE and d.handles()["xfer"] == 0
        assert np.array_equal(pr.dst_bufs[(0, 0)], pr.before[(0, 0)])
        _settled(pr)


def test_prefill_dropping_its_push_route_keeps_decodes_pull_notifications():
    """The held-out escape of issue 28: prefill disconnects its push route; decode, still
    pulling, reads with notify, direct and staged; nothing of decode's is dropped as unknown."""
    with staged() as pr:
        p = pr.p[0]
        p.disconnect("decode", 0)
        for how in ("direct", "staged"):
            if how == "direct":
                pr.run("pull", SB, DB, notify=b"n-direct")
            else:
                _staged_run(pr, "pull", notify=b"n-staged")
            pr.check(SB, DB)
            assert _until(lambda: p._router.queue, list(pr.stagers.values()))
            assert [n.message for n in p.notifications()] == [f"n-{how}".encode()]
        assert p.stats()["unknown"] == 0
        _settled(pr)


def test_a_part_posted_after_the_requests_deadline_is_refused_and_writes_nothing():
    """Issue 36, item 3 (the executor's half): a layer-wise part whose request's deadline
    passed (a slow forward) is never posted with its time clamped to 0: DeadlinePassed,
    nothing handed to NIXL, the decode's bytes of that layer untouched."""
    layers = [attn(f"layers.{k}.attn", heads=4, bs=16, nb=8) for k in range(2)]
    src, dst = spec(1, *layers), spec(1, *layers)
    with pair(src, dst) as pr:
        pr.connect("push")
        p = pr.p[0]
        req = p.request(p.map("decode", "push").plan([[1, 2]], [[3, 4]]), "decode",
                        notify=b"req", timeout=0.5)
        first = req.post(["layers.0.attn"])
        time.sleep(0.6)  # the forward of layer 1 took past the window
        with pytest.raises(DeadlinePassed, match=r"not posted"):
            req.post(["layers.1.attn"])
        assert req.transfers == [first]  # nothing else posted
        assert _until(lambda: (first.poll(), first.done)[1], pr.d)
        # layer 1's region was never written, whatever became of layer 0's part
        j = [r.name for r in dst.regions].index("layers.1.attn")
        assert np.array_equal(pr.dst_bufs[(0, j)], pr.before[(0, j)])


def test_refused_opens_are_refused_before_any_planning(monkeypatch):
    """Issue 36, item 7: an OPEN whose chunk count does not fit its bytes, or that asks more
    bytes than the blocks it lists hold on this rank, is refused (FAIL) without planning:
    the planner and the stager are never called for it; a genuine request still is."""
    from kvplan_nixl.staged import server as srv

    with staged(None) as pr:
        p, d = pr.p[0], pr.d[0]
        sp = pr.stagers[p]
        cap_d, cap_p = _Capture(monkeypatch, d), _Capture(monkeypatch, p)
        _staged_run(pr, "pull")
        _settled(pr)
        head, body = cap_d.find(b"kvs1 OPEN").split(b"\n", 1)
        calls = []
        tmap_cls = type(p.map("decode", "push"))
        real_plan, real_stage = tmap_cls.plan, srv.stage
        monkeypatch.setattr(tmap_cls, "plan", lambda *a, **k: calls.append("plan")
                            or real_plan(*a, **k))
        monkeypatch.setattr(srv, "stage", lambda *a, **k: calls.append("stage")
                            or real_stage(*a, **k))
        f = head.split(b" ")
        slot, nbytes = int(f[4]), int(f[6])  # kvs1 OPEN rid mode slot timeout nbytes chunks
        held = len(SB[0]) * SRC.rank_block_nbytes(0)  # what the listed blocks hold
        assert 0 < nbytes <= held
        bad = {b"81": (nbytes, -(-nbytes // slot) + 1),  # one chunk too many
               b"82": (held + slot, -(-(held + slot) // slot))}  # more than the blocks hold
        for rid, (n, chunks) in bad.items():
            g = list(f)
            g[2], g[6], g[7] = rid, str(n).encode(), str(chunks).encode()
            sp.channel.inbox.append((d.agent_name, b" ".join(g) + b"\n" + body))
        sp.poll()
        fails = [m for _, m in cap_p.sent if b"FAIL" in m and b"refused" in m]
        assert len(fails) == 2, cap_p.sent[-4:]
        assert any(b"chunks of" in m for m in fails), fails
        assert any(b"more than the" in m for m in fails), fails
        assert calls == [] and not sp._server.served  # no plan, no stage, nothing held
        _staged_run(pr, "pull")  # a genuine one plans as before
        assert "plan" in calls and "stage" in calls
        pr.check(SB, DB)
