"""A peer stays known while any route to it lives (issue 28, points 1 and 2).

Prefill and decode are connected both ways: decode pulls from prefill (prefill knows decode by
its verified hello), prefill has a push route to decode (decode knows prefill by its hello too).
Disconnecting one direction must leave the other working, direct and staged, with its
``notify=`` delivered once: every order of connecting the two directions, each side
disconnecting. Then: the staged protocol's bytes never reach ``notifications()``, and an OPEN to
an endpoint that cannot serve it fails at once, naming the peer. Real NIXL agents, a secret on
every endpoint.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from kvplan_nixl import ArgumentError, Endpoint, TransferFailed
from kvplan_nixl.endpoint import Notification
from kvplan_nixl.staged import Stager
from tests.nixl_util import attn, pair, spec

KEY = b"kvplan-test-deployment-secret-28"
SRC = spec(1, attn(heads=4, nb=64))
DST = spec(1, attn(heads=4, nb=64))
SLOT = 64 << 10
SB, DB = [list(range(1, 21))], [list(range(30, 50))]
IDLE = {"slots_in_use": 0, "xfer": 0, "requests": 0, "serving": 0}


def _idle(st: Stager) -> dict:
    return {k: v for k, v in st.handles().items() if k in IDLE}


def _pump(things, seconds: float = 0.05) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for x in things:
            x.poll() if isinstance(x, Stager) else x.progress()
        time.sleep(1e-3)


def _notes(ep: Endpoint, things, want: int, timeout: float = 5.0) -> list[Notification]:
    got: list[Notification] = []
    end = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < end:
        _pump(things, 0.002)
        got += ep.notifications()
    _pump(things, 0.02)  # nothing more may come
    return got + ep.notifications()


@contextlib.contextmanager
def _both_ways(order: str, staged: bool):
    with pair(SRC, DST, secret=KEY) as pr:
        sts = ({ep: Stager(ep, pool_bytes=4 * SLOT, slot_bytes=SLOT) for ep in pr.endpoints}
               if staged else {})
        try:
            for mode in order.split(","):
                pr.connect(mode)
                _pump([*pr.endpoints])  # the hello lands
            pr.stagers = sts
            yield pr
        finally:
            for st in sts.values():
                st.close()


def _move(pr, mode: str, how: str, notify: bytes):
    """One request ``how`` (direct / staged) in ``mode`` with ``notify``; the receiver's
    notifications afterwards."""
    ini, tgt = (pr.d[0], pr.p[0]) if mode == "pull" else (pr.p[0], pr.d[0])
    remote = "prefill" if mode == "pull" else "decode"
    plan = ini.map(remote, mode).plan(SB, DB)
    things = list(pr.stagers.values()) or pr.endpoints
    if how == "staged":
        st = pr.stagers[ini]
        t = (st.read if mode == "pull" else st.write)(plan, remote, notify=notify, timeout=10)
    else:
        t = (ini.read if mode == "pull" else ini.write)(plan, remote, notify=notify, timeout=10)
    t.wait(10, progress=things)
    pr.check(SB, DB)
    return _notes(tgt, things, 1)


@pytest.mark.parametrize("how", ["direct", "staged"])
@pytest.mark.parametrize("order", ["pull,push", "push,pull"])
@pytest.mark.parametrize("gone", ["push", "pull"])
def test_disconnecting_one_direction_keeps_the_other(gone, order, how):
    """``gone``: the direction disconnected (push: prefill drops its route to decode; pull:
    decode drops its route to prefill); the other direction keeps working, notify included."""
    with _both_ways(order, how == "staged") as pr:
        p, d = pr.p[0], pr.d[0]
        kept = "pull" if gone == "push" else "push"
        if gone == "push":
            p.disconnect("decode", 0)
        else:
            d.disconnect("prefill", 0)
        receiver, sender = (p, "decode") if kept == "pull" else (d, "prefill")
        for i in range(2):
            note = f"req-{i}".encode()
            assert _move(pr, kept, how, note) == [Notification(sender, 0, note)]
        assert receiver.stats()["unknown"] == 0
        # the dropped direction is really gone, and comes back on a connect
        gone_ep = p if gone == "push" else d
        remote = "decode" if gone == "push" else "prefill"
        assert all(peer.engine != remote for peer in gone_ep.peers())
        pr.connect(gone)
        _pump(pr.endpoints)
        back_from = "prefill" if gone == "push" else "decode"
        assert _move(pr, gone, how, b"back") == [Notification(back_from, 0, b"back")]
        assert _move(pr, kept, how, b"still") == [Notification(sender, 0, b"still")]
        for st in pr.stagers.values():
            assert _idle(st) == IDLE


def test_both_directions_disconnected_then_reconnected():
    with _both_ways("pull,push", True) as pr:
        p, d = pr.p[0], pr.d[0]
        p.disconnect("decode", 0)
        d.disconnect("prefill", 0)
        assert p.peers() == () and d.peers() == ()
        pr.connect("push")
        pr.connect("pull")
        _pump(pr.endpoints)
        for mode in ("pull", "push"):
            for how in ("direct", "staged"):
                got = _move(pr, mode, how, b"x")
                assert [n.message for n in got] == [b"x"], (mode, how, got)


def test_close_notice_still_drops_a_peer_known_both_ways():
    """The hello keeps an agent known across a disconnect, not across its close."""
    with _both_ways("pull,push", False) as pr:
        p, d = pr.p[0], pr.d[0]
        p.disconnect("decode", 0)
        assert d.agent_name in p._peers.loaded  # known by its hello
        d.close()
        _pump([p], 0.05)
        assert d.agent_name not in p._peers.loaded
        assert p.handles()["remote_agents"] == 0


# -- point 2: reserved prefixes never reach notifications(); an unserved OPEN fails at once ------


@pytest.mark.parametrize("closed", [False, True])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_staged_request_to_an_endpoint_without_a_stager_fails_at_once(mode, closed):
    """The target has no Stager (or closed its own): the OPEN never reaches its
    ``notifications()`` and is answered at once, so the initiator fails naming the target
    long before its deadline, holding nothing."""
    with pair(SRC, DST, secret=KEY) as pr:
        pr.connect("pull")
        pr.connect("push")
        ini, tgt = (pr.d[0], pr.p[0]) if mode == "pull" else (pr.p[0], pr.d[0])
        remote, who = ("prefill", "engine 'prefill' rank 0") if mode == "pull" else \
            ("decode", "engine 'decode' rank 0")
        st = Stager(ini, pool_bytes=4 * SLOT, slot_bytes=SLOT)
        theirs = Stager(tgt, pool_bytes=4 * SLOT, slot_bytes=SLOT) if closed else None
        try:
            if theirs is not None:
                theirs.close()
            plan = ini.map(remote, mode).plan(SB, DB)
            t0 = time.monotonic()
            t = (st.read if mode == "pull" else st.write)(plan, remote, notify=b"n",
                                                           timeout=20)
            with pytest.raises(TransferFailed, match=who + " serves no staged request") as e:
                t.wait(20, progress=[st, tgt])
            assert time.monotonic() - t0 < 5.0  # not the 20 s deadline
            assert e.value.blocks[0].tolist() == DB[0]
            _pump([st, tgt], 0.02)
            assert tgt.notifications() == []
            assert tgt.stats()["unserved"] == 1
            assert _idle(st) == IDLE
            # the endpoint still moves requests directly, notify included
            assert _move_direct(pr, mode) == [b"ok"]
        finally:
            st.close()


def _move_direct(pr, mode):
    pr.stagers = {}
    return [n.message for n in _move(pr, mode, "direct", b"ok")]


def test_reserved_prefixes_never_reach_notifications_nor_leave_as_notify():
    with pair(SRC, DST, secret=KEY) as pr:
        pr.connect("pull")
        p, d = pr.p[0], pr.d[0]
        plan = d.map("prefill").plan(SB, DB)
        for bad in (b"kvs1 OPEN 0 pull", "kvs1 DONE 3", b"\x00kvplan_nixl\x00close"):
            with pytest.raises(ArgumentError, match="reserved"):
                d.read(plan, "prefill", notify=bad)
        assert d.handles()["transfers"] == 0 and d.handles()["xfer"] == 0
        # sent anyway by a peer (sealed under the secret: a genuine but foreign message)
        for m in (b"kvs1 OPEN 7 pull 0 1000 1 1 1 0", b"kvs1 DONE 7", b"kvs1 OPEN zz\xff",
                  b"kvs1 OPEN " + b"9" * 40):
            d._agent.send_notif(p.agent_name, d._seal(p.agent_name, m))
        _pump([p, d], 0.1)
        assert p.notifications() == []
        assert p.stats()["unserved"] == 4
        _pump([d], 0.05)
        assert d.notifications() == []  # the one FAIL (a valid id) was dropped too
        assert d.stats()["unserved"] == 1
