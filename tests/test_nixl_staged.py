"""Staged transfers end to end with real NIXL agents in one process (kvplan_nixl/staged.py).

Every engine rank has an Endpoint and a Stager; both sides connect to each other. After a
staged push or pull every destination byte must equal the oracle's expectation (untouched bytes
included), and afterwards no staging slot, NIXL transfer or request may be left on any side.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from kvplan import Costs, pull_map, simulate
from kvplan_nixl import NotConnectedError, State, TransferFailed, TransferTimeout
from kvplan_nixl.endpoint import Notification
from kvplan_nixl.staged import StagedTransfer, Stager
from tests import oracle
from tests.nixl_util import ZERO, attn, blocks, mla, notifications, pair, spec

IDLE = {"slots_in_use": 0, "xfer": 0, "requests": 0, "serving": 0}
SLOT = 64 << 10


def _idle(st: Stager) -> dict:
    return {k: v for k, v in st.handles().items() if k in IDLE}


def drain(stagers, timeout: float = 10.0) -> None:
    """Poll every stager until all are idle: a server frees its last slots when the
    initiator's final notification (TAKEN, ABORT) arrives, a moment after the initiator is done."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for st in stagers:
            st.poll()
        if all(_idle(st) == IDLE for st in stagers):
            return
        time.sleep(1e-3)


@contextlib.contextmanager
def staged_pair(src, dst, *, pool_slots: int = 4, window: int = 2, **kw):
    with pair(src, dst, **kw) as pr:
        stagers = {}
        try:
            for ep in pr.endpoints:
                stagers[ep] = Stager(ep, pool_bytes=pool_slots * SLOT, slot_bytes=SLOT,
                                     window=window)
            pr.connect("pull")
            pr.connect("push")
            pr.stagers = stagers
            yield pr
            drain(stagers.values())
            for st in stagers.values():
                assert _idle(st) == IDLE, st.handles()
        finally:
            for st in stagers.values():
                st.close()
            for st in stagers.values():
                assert st.handles()["dlist"] == st.handles()["registrations"] == 0


def _run(pr, mode: str, sb, db, *, timeout: float = 30.0):
    initiators = pr.d if mode == "pull" else pr.p
    remote = "prefill" if mode == "pull" else "decode"
    others = list(pr.stagers.values())
    posted = []
    for ep in initiators:
        st = pr.stagers[ep]
        plan = ep.map(remote, mode).plan(sb, db)
        posted.append((st.read if mode == "pull" else st.write)(plan, remote, timeout=timeout))
    for t in posted:
        t.wait(timeout, progress=others)
    return posted


SRC = spec(2, attn(heads=4, nb=64), mla(nb=64), attn("layers.1.attn", heads=4, nb=64,
                                                     layout="NHD"))
DST = spec(1, attn(heads=4, nb=64), mla(nb=64), attn("layers.1.attn", heads=4, nb=64,
                                                     layout="NHD"))


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_staged_hetero_tp_lands_the_oracle_bytes_in_chunks(mode):
    """TP2 -> TP1, HND + MLA + NHD, scattered ids: more bytes per peer than the pool holds."""
    rng = np.random.default_rng(5)
    sb, db = blocks(rng, SRC, 40), blocks(rng, DST, 40)
    with staged_pair(SRC, DST, pool_slots=3) as pr:
        ts = _run(pr, mode, sb, db)
        pr.check(sb, db, plans=[t.plan for t in ts])
        for t in ts:
            assert t.ok and t.states() == {r: State.DONE for r in t.peers}
            assert t.chunks > 2 * len(t.peers)  # larger than the pool: streamed
            assert t.descriptors == t.chunks  # one NIXL descriptor per chunk
            assert len(t.plan) > 4 * t.chunks  # many more runs than descriptors


def test_staged_and_direct_agree_and_post_chooses():
    """Same request direct and staged land the same bytes; post() picks by the cost model."""
    rng = np.random.default_rng(6)
    sb, db = blocks(rng, SRC, 24), blocks(rng, DST, 24)
    with staged_pair(SRC, DST) as pr:
        d = pr.d[0]
        st = pr.stagers[d]
        plan = d.map("prefill").plan(sb, db)
        t = st.post(plan, "prefill", how="staged")
        t.wait(30, progress=list(pr.stagers.values()))
        pr.check(sb, db, plans=[plan])
        t = st.post(plan, "prefill", how="direct")
        t.wait(30, progress=pr.p)
        pr.check(sb, db, plans=[plan])
        same = list(range(24))
        one = spec(1, attn(heads=4, nb=64))
        merged = pull_map(one, one, 0).plan([same], [same])
        assert len(merged) == 2  # K and V: two big runs
        assert not st.prefer(merged, "prefill")  # mergeable plans stay direct
        assert not st.prefer(plan, "prefill")  # 0.6 MB in 10 chunks: round trips dominate
        st.costs["prefill"] = Costs(per_descriptor=2.5e-6, per_byte=1e-10,
                                    local_per_byte=2.5e-10, per_chunk=1e-5)
        assert st.prefer(plan, "prefill")  # with cheap round trips (a fast peer): staged
        assert not st.prefer(merged, "prefill")  # still: at most one run per chunk
        with pytest.raises(ValueError, match="how"):
            st.post(plan, "prefill", how="fast")


def test_full_pool_queues_requests_and_all_complete():
    """Three requests at once through a 2-slot pool with window 1: they wait, none deadlocks."""
    rng = np.random.default_rng(7)
    with staged_pair(SRC, DST, pool_slots=2, window=1) as pr:
        d = pr.d[0]
        st = pr.stagers[d]
        reqs = []
        free = rng.permutation(64).tolist()
        for _ in range(3):
            sb = blocks(rng, SRC, 12)
            db = [free[:12]]
            free = free[12:]
            reqs.append((sb, db, st.read(d.map("prefill").plan(sb, db), "prefill", timeout=30)))
        peak = 0
        while not all(t.done for *_, t in reqs):
            for s in pr.stagers.values():
                s.poll()
                peak = max(peak, s.handles()["slots_in_use"])
        assert peak <= 2
        cur = dict(pr.before)  # the oracle, request after request (disjoint destinations)
        for sb, db, t in reqs:
            assert t.ok, t.error()
            expected, _ = oracle.expected_destination(
                SRC.to_dict(), DST.to_dict(), sb, db, 0, pr.src_bufs, cur)
            cur = {(0, j): a for j, a in expected.items()}
        for k, want in cur.items():
            assert np.array_equal(pr.dst_bufs[k], want), k


def test_deadline_frees_both_sides_and_names_blocks():
    """The server (prefill) is never polled: the deadline fails the pull, frees the slots."""
    rng = np.random.default_rng(8)
    sb, db = blocks(rng, SRC, 8), blocks(rng, DST, 8)
    with staged_pair(SRC, DST) as pr:
        d = pr.d[0]
        st = pr.stagers[d]
        t = st.read(d.map("prefill").plan(sb, db), "prefill", timeout=0.2)
        with pytest.raises(TransferTimeout) as ei:
            t.wait()
        assert set(ei.value.peer_ranks) == {0, 1}
        assert np.array_equal(np.sort(ei.value.blocks[0]), np.sort(db[0]))
        assert _idle(st) == IDLE
        drain(pr.stagers.values())  # the servers get OPEN, then ABORT: nothing stays held
        for s in pr.stagers.values():
            assert _idle(s) == IDLE, s.handles()


def test_cancel_mid_push_frees_slots_everywhere():
    rng = np.random.default_rng(9)
    sb, db = blocks(rng, SRC, 40), blocks(rng, DST, 40)
    with staged_pair(SRC, DST, pool_slots=2) as pr:
        p0 = pr.p[0]
        st = pr.stagers[p0]
        t = st.write(p0.map("decode", "push").plan(sb, db), "decode", timeout=30)
        for _ in range(3):  # some chunks move
            for s in pr.stagers.values():
                s.poll()
        t.cancel("user cancelled")
        assert t.done and not t.ok
        with pytest.raises(TransferFailed, match="user cancelled"):
            t.wait()
        drain(pr.stagers.values())
        for s in pr.stagers.values():
            assert _idle(s) == IDLE, s.handles()


def test_refused_when_slot_sizes_differ():
    rng = np.random.default_rng(10)
    sb, db = blocks(rng, SRC, 4), blocks(rng, DST, 4)
    with pair(SRC, DST) as pr:
        sts = [Stager(ep, pool_bytes=4 * SLOT, slot_bytes=SLOT * (2 if ep in pr.p else 1))
               for ep in pr.endpoints]
        try:
            pr.connect("pull")
            pr.connect("push")
            d = pr.d[0]
            t = sts[-1].read(d.map("prefill").plan(sb, db), "prefill", timeout=10)
            with pytest.raises(TransferFailed, match="slot sizes differ"):
                t.wait(progress=sts)
        finally:
            for s in sts:
                s.close()
    assert ZERO  # the pair context checked every endpoint released everything


def test_calibrate_measures_costs_the_chooser_then_uses():
    rng = np.random.default_rng(11)
    sb, db = blocks(rng, SRC, 24), blocks(rng, DST, 24)
    with staged_pair(SRC, DST) as pr:
        d = pr.d[0]
        st = pr.stagers[d]
        others = [s for s in pr.stagers.values() if s is not st]
        costs = st.calibrate("prefill", progress=others)
        assert st.costs["prefill"] is costs
        assert costs.per_byte > 0 and costs.per_descriptor > 0 and costs.local_per_byte > 0
        assert costs.per_chunk > 0
        # a 4 KiB descriptor costs more than moving its 4 KiB inside a big one
        assert costs.per_descriptor > 4096 * costs.per_byte / 10
        plan = d.map("prefill").plan(sb, db)
        t = st.post(plan, "prefill")  # auto, with the measured costs
        t.wait(30, progress=list(pr.stagers.values()))
        pr.check(sb, db, plans=[plan])
        with pytest.raises(NotConnectedError, match="no rank of engine"):
            st.calibrate("nobody")


@pytest.mark.parametrize("extra", [[], ["--push", "--prefill-tp", "2", "--decode-tp", "4"]])
def test_demo_shows_both_modes(capsys, extra):
    from kvplan.cli import main

    rc = main(["demo", "--tokens", "256", "--num-blocks", "32", *extra])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "staged: moved" in out and "NIXL descriptors for" in out
    assert "verified: all" in out  # the final check covers the staged result
    rc = main(["demo", "--tokens", "256", "--num-blocks", "32", "--direct-only", *extra])
    assert rc == 0 and "staged:" not in capsys.readouterr().out


def test_malformed_and_foreign_messages_are_refused_not_raised():
    """A server answers garbage with FAIL and keeps serving; nothing is held afterwards."""
    rng = np.random.default_rng(12)
    sb, db = blocks(rng, SRC, 8), blocks(rng, DST, 8)
    with staged_pair(SRC, DST) as pr:
        d, p0 = pr.d[0], pr.p[0]
        server = pr.stagers[p0]
        open_ = b"kvs1 OPEN 9 pull 65536 0 10 1 1 1 "
        ids = np.array([999, 999], "<i8").tobytes()
        garbage = (b"kvs1 OPEN 9 push x", open_ + b"1 1 0\n" + b"\0" * 16,
                   open_ + b"1 1 0\n" + ids, open_ + b"-1 3 0\n",
                   # the notify's length: missing, negative, past the body, not a number,
                   # cutting the ids to a non-multiple of 8
                   open_ + b"1 1\n" + ids, open_ + b"1 1 -1\n" + ids,
                   open_ + b"1 1 17\n" + ids, open_ + b"1 1 x\n" + ids,
                   open_ + b"1 1 3\n" + ids, b"kvs1 OPEN 9 pull 65536 0 10 -1 0 0\n" + ids,
                   b"kvs1 DATA", b"kvs1 GRANT 77 0 0", b"kvs1 NOPE 1")
        for msg in garbage:
            server.channel.inbox.append((d.agent_name, msg))
        server.poll()  # no exception
        assert server.handles()["serving"] == 0
        assert p0.notifications() == []  # a refused OPEN delivers no notify
        t = pr.stagers[d].read(d.map("prefill").plan(sb, db), "prefill", timeout=30)
        t.wait(progress=list(pr.stagers.values()))
        pr.check(sb, db)


def test_empty_plan_is_done_at_once_and_holds_nothing():
    with staged_pair(SRC, DST) as pr:
        d = pr.d[0]
        st = pr.stagers[d]
        t = st.read(d.map("prefill").plan([[]], [[]]), "prefill")
        assert t.done and t.ok and t.peers == () and t.chunks == 0
        assert st.handles()["requests"] == 0


@pytest.mark.parametrize("kw,match", [
    ({"slot_bytes": 1000}, "multiple of 4096"),
    ({"pool_bytes": 3 * SLOT + 4096, "slot_bytes": SLOT}, "dividing"),
    ({"pool_bytes": SLOT, "slot_bytes": 2 * SLOT}, "dividing"),
    ({"window": 0}, "window"),
])
def test_stager_arguments_are_checked_before_anything_is_allocated(kw, match):
    with pytest.raises(ValueError, match=match):
        Stager(None, **kw)


def test_server_frees_a_silent_initiators_slots_at_its_deadline():
    """The initiator stops acting after OPEN (as if dead, no ABORT): the servers hold gathered
    slots until the deadline the OPEN carried, then free them."""
    rng = np.random.default_rng(13)
    sb, db = blocks(rng, SRC, 40), blocks(rng, DST, 40)
    with staged_pair(SRC, DST) as pr:
        d = pr.d[0]
        st = pr.stagers[d]
        t = st.read(d.map("prefill").plan(sb, db), "prefill", timeout=0.5)
        servers = [pr.stagers[p] for p in pr.p]
        held = 0
        end = time.monotonic() + 10
        while time.monotonic() < end:
            d.progress()  # the initiator's agent answers NIXL, its Stager does nothing
            for s in servers:
                s.poll()
            held = max(held, sum(s.handles()["slots_in_use"] for s in servers))
            if held and all(_idle(s) == IDLE for s in servers):
                break
            time.sleep(1e-3)
        assert held > 0  # they had gathered chunks for it
        assert all(_idle(s) == IDLE for s in servers), [s.handles() for s in servers]
        with pytest.raises(TransferTimeout):
            t.wait()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_staged_between_layouts_and_separate_kv_buffers(mode):
    """TensorRT-LLM's block-major pool (TP2) <-> SGLang's separate K and V buffers (TP1),
    staged: the legs name buffers, not regions, and land the oracle's bytes."""
    from tests.test_nixl_layouts import BufferPair, model

    src, dst = (model(2, "trt"), model(1, "sglang")) if mode == "pull" else (
        model(1, "sglang"), model(2, "trt"))
    rng = np.random.default_rng(14)
    sb, db = blocks(rng, src, 12), blocks(rng, dst, 12)
    pr = BufferPair(src, dst)
    stagers = {}
    try:
        stagers = {ep: Stager(ep, pool_bytes=4 * SLOT, slot_bytes=SLOT) for ep in pr.endpoints}
        pr.connect("pull")
        pr.connect("push")
        pr.stagers = stagers
        ts = _run(pr, mode, sb, db)
        pr.check(sb, db)
        assert all(t.ok and t.descriptors == t.chunks for t in ts)
        drain(stagers.values())
        for st in stagers.values():
            assert _idle(st) == IDLE, st.handles()
    finally:
        for st in stagers.values():
            st.close()
        pr.close()


def test_auto_splits_a_request_by_peer_when_the_model_says_so(monkeypatch):
    """post(how="auto") stages the peers the cost model picks and posts the others directly:
    one MixedTransfer, the bytes of both parts exact, failures of both parts named together."""
    from kvplan_nixl import MixedTransfer

    rng = np.random.default_rng(15)
    sb, db = blocks(rng, SRC, 24), blocks(rng, DST, 24)
    with staged_pair(SRC, DST) as pr:
        d = pr.d[0]
        st = pr.stagers[d]
        from kvplan_nixl.staged import stager as stager_mod

        real = stager_mod._peer_choices  # the cost model's per-peer verdicts: peer 1 staged
        monkeypatch.setattr(stager_mod, "_peer_choices", lambda *a: [
            (p, r, b, c, p == 1) for p, r, b, c, _ in real(*a)])
        plan = d.map("prefill").plan(sb, db)
        t = st.post(plan, "prefill", timeout=30)
        assert isinstance(t, MixedTransfer)
        assert t.direct.peers == (0,) and t.staged.peers == (1,) and t.peers == (0, 1)
        assert t.nbytes == plan.nbytes
        t.wait(progress=list(pr.stagers.values()))
        assert t.ok and t.seconds is not None
        pr.check(sb, db, plans=[plan])
        # nobody serves the staged part: it fails at the deadline, the direct part (one-sided
        # reads) completes; the error names the staged peer only
        st.measured.rate.clear()  # (else auto would now measure the direct mode once)
        t = st.post(plan, "prefill", timeout=0.3)
        with pytest.raises(TransferTimeout) as info:
            t.wait()
        assert info.value.peer_ranks == (1,) and t.direct.ok and not t.ok
        drain(pr.stagers.values())


def test_auto_takes_the_mode_measured_faster_and_re_measures_the_other():
    """The cost model decides a shape's first request; once the shape was moved direct and
    staged (any ``post``), auto posts the mode whose seconds per byte were lower, and one
    request in EXPLORE the other one; a failed request is not counted."""
    from kvplan_nixl.staged.measured import EXPLORE, Measured

    rng = np.random.default_rng(16)
    sb, db = blocks(rng, SRC, 24), blocks(rng, DST, 24)
    with staged_pair(SRC, DST) as pr:
        d = pr.d[0]
        st = pr.stagers[d]
        others = list(pr.stagers.values())
        plan = d.map("prefill").plan(sb, db)
        key = Measured.shape("prefill", "pull", len(plan), plan.nbytes)

        def post(how="auto"):
            t = st.post(plan, "prefill", how=how, timeout=30)
            t.wait(30, progress=others)
            drain(others)  # the Stager stamps and records the request as it polls
            return t

        t = post()
        assert "cost model" in st.last_choice
        first = "staged" if isinstance(t, StagedTransfer) else "direct"
        t = post()  # the other mode, once
        assert "other mode" in st.last_choice
        assert isinstance(t, StagedTransfer) == (first == "direct")
        rates = st.measured.rate[key]
        assert set(rates) == {"direct", "staged"} and all(v > 0 for v in rates.values())
        fast = min(rates, key=rates.__getitem__)
        t = post()
        assert "measured fastest" in st.last_choice
        assert isinstance(t, StagedTransfer) == (fast == "staged")
        pr.check(sb, db, plans=[plan])
        # pretend staging measured faster: auto follows the measurement, not the model, and
        # re-measures direct one request in EXPLORE while the two are close (within CLOSE)
        picks = []
        while len(picks) < 2 * EXPLORE:
            rates["staged"], rates["direct"] = 1e-10, 1.2e-10  # (each sample moves them)
            picks.append(isinstance(post(), StagedTransfer))
        assert picks.count(False) == 2
        # ... and one in 16 * EXPLORE when direct measured far slower (100x here)
        picks = []
        while len(picks) < 2 * EXPLORE:
            rates["staged"], rates["direct"] = 1e-12, 1e-10
            picks.append(isinstance(post(), StagedTransfer))
        assert all(picks)
        # a request that fails is not a sample
        before = dict(rates)
        t = st.post(plan, "prefill", how="staged", timeout=1e-3)
        with pytest.raises(TransferTimeout):
            t.wait(5)
        drain(others)
        assert st.measured.rate[key] == before


# -- the user's notify on staged requests ------------------------------------------------------


def _landed(plan, src_bufs, dst_bufs) -> dict:
    """``{key: (mask, values)}``: where ``plan`` writes on the destination and what, found by
    simulating it onto two destinations that differ in every byte (only written bytes agree)."""
    lo = {k: np.zeros_like(v) for k, v in dst_bufs.items()}
    hi = {k: np.full_like(v, 255) for k, v in dst_bufs.items()}
    simulate(plan, src_bufs, lo)
    simulate(plan, src_bufs, hi)
    return {k: (lo[k] == hi[k], lo[k]) for k in lo}


def _served_notes(pr, mode, sb, db, post, *, check_bytes=False, timeout=30.0) -> list[tuple]:
    """Post ``mode`` on every initiator with ``post(stager, endpoint, plan, remote)``, poll
    every side, and collect ``(receiver rank, Notification)`` from the servers until all
    transfers are done and no notification came for 50 ms. The destination starts from its
    initial bytes. With ``check_bytes`` (push), the sender's bytes must be in the destination
    buffers when its notification is observed."""
    for k, b in pr.dst_bufs.items():
        b[:] = pr.before[k]
    initiators, servers = (pr.d, pr.p) if mode == "pull" else (pr.p, pr.d)
    remote = "prefill" if mode == "pull" else "decode"
    plans = {ep.rank: ep.map(remote, mode).plan(sb, db) for ep in initiators}
    posted = [post(pr.stagers[ep], ep, plans[ep.rank], remote) for ep in initiators]
    got: list[tuple] = []
    quiet = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for st in pr.stagers.values():
            st.poll()
        for t in posted:  # a direct Transfer advances only when polled
            t.poll()
        new = [(ep.rank, n) for ep in servers for n in ep.notifications()]
        for _, n in new:
            if check_bytes:  # at this very moment the sender's part is in the KV cache
                landed = _landed(plans[n.rank], pr.src_bufs, pr.dst_bufs)
                assert sum(int(m.sum()) for m, _ in landed.values()) == plans[n.rank].nbytes
                for k, (mask, want) in landed.items():
                    assert np.array_equal(pr.dst_bufs[k][mask], want[mask]), (n, k)
        got += new
        if new or not all(t.done for t in posted):
            quiet = None
        elif quiet is None:
            quiet = time.monotonic() + 0.05
        elif time.monotonic() > quiet:
            break
        time.sleep(1e-4)
    assert all(t.ok for t in posted), [t.error() for t in posted]
    return got


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_staged_notify_reaches_every_peer_once_like_direct(mode, monkeypatch):
    """Staged requests deliver the user's notify as direct ones do: once per peer rank, same
    Notification(engine, rank, message); for push only once the bytes are in place."""
    rng = np.random.default_rng(16)
    sb, db = blocks(rng, SRC, 40), blocks(rng, DST, 40)
    with staged_pair(SRC, DST, pool_slots=3) as pr:
        for ep in pr.d:  # slow scatters (on the worker thread): a notify delivered before
            st = pr.stagers[ep]  # the last one returned would be seen with bytes missing

            def slow(j, k, slot, which, leg=st.legs._local_leg):
                if which == "scatter" and j.server:
                    time.sleep(0.02)
                leg(j, k, slot, which)

            monkeypatch.setattr(st.legs, "_local_leg", slow)
        pr.run(mode, sb, db, notify=b"req-9")  # direct, for reference
        targets = pr.p if mode == "pull" else pr.d
        direct = notifications(targets, 2)
        assert len(direct) == 2  # two peer pairs: TP2 <-> TP1

        def staged(st, ep, plan, remote):
            t = (st.read if mode == "pull" else st.write)(plan, remote, notify=b"req-9",
                                                          timeout=30)
            assert t.chunks > 2 * len(t.peers)  # streamed: many chunks before the notify
            return t

        got = _served_notes(pr, mode, sb, db, staged, check_bytes=(mode == "push"))
        assert sorted(got, key=repr) == sorted(direct, key=repr)
        pr.check(sb, db)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_post_carries_notify_direct_staged_and_mixed(mode, monkeypatch):
    """Stager.post passes notify on every path; with how="auto" a pull is split into a
    MixedTransfer (prefill rank 0 direct, rank 1 staged) and each peer rank is notified once,
    by the part that served it; a push stages prefill rank 1's request and posts rank 0's
    directly (TP2 -> TP1: one destination peer each)."""
    from kvplan_nixl import MixedTransfer

    rng = np.random.default_rng(17)
    sb, db = blocks(rng, SRC, 16), blocks(rng, DST, 16)
    with staged_pair(SRC, DST) as pr:
        for how in ("direct", "staged", "mixed"):
            if how == "mixed":
                for ep, st in pr.stagers.items():
                    pick = ((lambda plan, remote, *_: (1,)) if mode == "pull" else
                            (lambda plan, remote, *_, r=ep.rank: tuple(plan.peers) if r else ()))
                    monkeypatch.setattr(st, "staged_peers", pick)
                    st.measured.rate.clear()  # else auto follows the two modes just timed

            def post(st, ep, plan, remote, how=how):
                t = st.post(plan, remote, how="auto" if how == "mixed" else how,
                            notify=how.encode(), timeout=30)
                assert not (how == "mixed" and mode == "pull") or isinstance(t, MixedTransfer)
                return t

            got = _served_notes(pr, mode, sb, db, post, check_bytes=(mode == "push"))
            sender = "decode" if mode == "pull" else "prefill"
            want = ([(0, Notification(sender, 0, how.encode())),
                     (1, Notification(sender, 0, how.encode()))] if mode == "pull" else
                    [(0, Notification(sender, 0, how.encode())),
                     (0, Notification(sender, 1, how.encode()))])
            assert sorted(got, key=repr) == want, how
            pr.check(sb, db)


def test_failed_staged_requests_deliver_no_notify():
    """A cancelled push, a cancelled pull, a server closed mid-push and an initiator gone
    silent (the server drops it at its deadline): the notify is never delivered."""
    rng = np.random.default_rng(18)
    sb, db = blocks(rng, SRC, 40), blocks(rng, DST, 40)
    with staged_pair(SRC, DST, pool_slots=2) as pr:
        d, p0 = pr.d[0], pr.p[0]
        everyone = list(pr.stagers.values())
        # cancelled push and pull, after some chunks moved
        for st, plan, remote in ((pr.stagers[p0], p0.map("decode", "push").plan(sb, db),
                                  "decode"),
                                 (pr.stagers[d], d.map("prefill").plan(sb, db), "prefill")):
            t = st.post(plan, remote, how="staged", notify=b"never", timeout=30)
            end = time.monotonic() + 10
            while not any(j.posted for j in t._jobs.values()) and time.monotonic() < end:
                for s in everyone:
                    s.poll()
            assert not t.done and any(j.posted for j in t._jobs.values())
            t.cancel("user cancelled")
            drain(everyone)
        # the server (decode) closes its stager in the middle of a push
        t = pr.stagers[p0].write(p0.map("decode", "push").plan(sb, db), "decode",
                                 notify=b"never", timeout=30)
        end = time.monotonic() + 10
        while not t._jobs[0].posted and time.monotonic() < end:
            for s in everyone:
                s.poll()
        assert not t.done and t._jobs[0].posted
        pr.stagers[d].close()
        with pytest.raises(TransferFailed, match="stager closed"):
            t.wait(progress=everyone)
        drain(everyone)
        # (a closed stager's endpoint hands protocol messages that arrive later to
        # notifications(): only the user's message matters here)
        assert [n for ep in pr.endpoints for n in ep.notifications()
                if n.message == b"never"] == []


def test_silent_initiator_dropped_at_the_deadline_delivers_no_notify():
    rng = np.random.default_rng(19)
    sb, db = blocks(rng, SRC, 40), blocks(rng, DST, 40)
    with staged_pair(SRC, DST) as pr:
        d = pr.d[0]
        t = pr.stagers[d].read(d.map("prefill").plan(sb, db), "prefill", notify=b"never",
                               timeout=0.3)
        servers = [pr.stagers[p] for p in pr.p]
        end = time.monotonic() + 10
        served = False
        while time.monotonic() < end:
            d.progress()  # the initiator's agent answers NIXL, its Stager does nothing
            for s in servers:
                s.poll()
            served = served or any(s.handles()["serving"] for s in servers)
            if served and not any(s.handles()["serving"] for s in servers):
                break
            time.sleep(1e-3)
        assert served and not any(s.handles()["serving"] for s in servers)
        with pytest.raises(TransferTimeout):
            t.wait()
        drain(pr.stagers.values())
        assert [n for ep in pr.p for n in ep.notifications()] == []


def test_serve_answers_requests_until_asked_to_stop():
    """Prefill ranks driven only by ``Stager.serve`` on their own threads (one agent per
    thread) serve a staged pull that the decode rank waits for without polling them; ``serve``
    returns True once ``until`` holds and False at its timeout."""
    import threading

    rng = np.random.default_rng(12)
    sb, db = blocks(rng, SRC, 24), blocks(rng, DST, 24)
    with staged_pair(SRC, DST) as pr:
        d = pr.d[0]
        servers = [s for ep, s in pr.stagers.items() if ep is not d]
        stop = threading.Event()
        results: list = []
        threads = [threading.Thread(target=lambda s=s: results.append(s.serve(stop.is_set)))
                   for s in servers]
        for th in threads:
            th.start()
        try:
            plan = d.map("prefill").plan(sb, db)
            t = pr.stagers[d].read(plan, "prefill", timeout=30)
            t.wait(30)  # no progress= : only the serving threads answer
        finally:
            stop.set()
            for th in threads:
                th.join(10)
        assert results == [True] * len(servers)
        pr.check(sb, db, plans=[plan])
        t0 = time.monotonic()
        assert servers[0].serve(lambda: False, timeout=0.05) is False
        assert 0.05 <= time.monotonic() - t0 < 2


def test_protocol_messages_after_close_never_reach_user_notifications():
    """A peer's staged messages arriving after this side's Stager closed are dropped, not
    handed to the user as notifications."""
    with pair(SRC, DST) as pr:
        d = pr.d[0]
        sts = [Stager(ep, pool_bytes=2 * SLOT, slot_bytes=SLOT) for ep in pr.endpoints]
        try:
            pr.connect("pull")
            pr.connect("push")
            for ep, st in zip(pr.endpoints, sts, strict=True):
                if ep is not d:
                    st.close()  # no prefill rank answers: d's HELLO reaches a closed Stager
            with pytest.raises(TimeoutError, match="did not answer"):
                sts[pr.endpoints.index(d)].calibrate("prefill", timeout=0.3)
            deadline = time.monotonic() + 0.3
            seen = []
            while time.monotonic() < deadline:
                d.progress()  # the sender too: its HELLO may need its worker to go out
                for p in pr.p:
                    seen += p.notifications()
            assert seen == []
        finally:
            for st in sts:
                st.close()
        assert all(st.handles()["registrations"] == 0 for st in sts)
