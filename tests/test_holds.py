"""The prefill's hold table (kvplan_nixl/serving/holds.py): a CONFIRM is yes only while the hold is
live, a hold is reported finished (its blocks freed by vLLM) only after it ended, and an ended
generation never comes back. Examples, then a state machine checked against a reference model
and against the safety property itself."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvplan_nixl.errors import ArgumentError
from kvplan_nixl.serving.holds import Holds, Verdict, new_generation


def test_confirm_only_while_held_and_never_again_after_expiry():
    h = Holds()
    g = h.hold("r", now=0.0, lease=10.0)
    assert h.confirm("r", g, 9.9)
    assert not h.confirm("r", g, 10.0)  # the lease ran out at 10.0
    assert h.finished(10.0) == ["r"]
    assert not h.renew("r", g, 10.5)  # a heartbeat after expiry does not resurrect it
    assert not h.confirm("r", g, 10.5)
    assert h.counts["expired"] == 1 and h.counts["refused"] == 2
    with pytest.raises(ArgumentError, match="held once, never again"):
        h.hold("r", 11.0, 10.0, generation=g)


def test_heartbeats_keep_a_slow_decode_alive():
    h = Holds()
    g = h.hold("r", 0.0, 1.0)
    for t in (0.5, 1.2, 1.9, 2.6):  # every lease/2 or so; past the first lease many times
        assert h.renew("r", g, t)
    assert h.finished(3.0) == []
    assert h.confirm("r", g, 3.5)
    assert not h.confirm("r", g, 3.6 + 1.0)


def test_release_and_readers_end_the_hold_before_it_is_reported():
    h = Holds()
    g = h.hold("a", 0.0, 10.0, readers=2)
    assert h.confirm("a", g, 1.0) and "a" in h
    assert h.confirm("a", g, 1.0) and "a" not in h  # the second reader ended it
    assert not h.confirm("a", g, 1.0)
    g2 = h.hold("b", 0.0, 10.0)
    assert h.release("b", g2) and not h.confirm("b", g2, 1.0)
    assert h.finished(1.0) == ["a", "b"] and h.finished(1.0) == []


def test_a_generation_not_registered_yet_is_later_and_an_early_release_is_kept():
    h = Holds()
    assert h.verdict("r", 5, 0.0) is Verdict.LATER
    assert not h.release("r", 5)  # arrives before the hold: remembered
    assert h.hold("r", 0.0, 10.0, generation=5) == 5
    assert "r" not in h and h.finished(0.0) == ["r"]
    assert h.verdict("r", 5, 0.0) is Verdict.NO
    assert h.verdict("r", 4, 0.0) is Verdict.NO  # below the floor: never held, never will be


def test_floor_refuses_a_previous_instances_generation_at_once():
    floor = new_generation()
    old = floor - 10**9  # made by the instance before a restart
    h = Holds(floor=new_generation())
    assert h.verdict("0", old, 0.0) is Verdict.NO
    assert new_generation() > floor


def test_a_newer_generation_supersedes_without_reporting():
    h = Holds()
    g1 = h.hold("r", 0.0, 10.0)
    g2 = h.hold("r", 1.0, 10.0)
    assert g2 > g1 and not h.confirm("r", g1, 1.0) and h.confirm("r", g2, 1.0)
    assert h.finished(2.0) == []  # still held, under g2


@pytest.mark.parametrize("bad", [dict(lease=0), dict(lease=float("inf")), dict(now=float("nan")),
                                 dict(generation=-1), dict(generation=True), dict(readers=-1)])
def test_arguments_are_checked(bad):
    args = dict(now=0.0, lease=1.0) | bad
    with pytest.raises(ArgumentError):
        Holds().hold("r", **args)


REQS = ("a", "b", "c")


class HoldMachine(RuleBasedStateMachine):
    """Random operations on a Holds, against a model and the safety property."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Holds()
        self.t = 0.0
        self.gens: list[tuple[str, int]] = []  # every (req, generation) held so far
        # the model: live (req, gen) -> [deadline, lease, readers]
        self.live: dict[tuple[str, int], list] = {}
        self.freed: set[tuple[str, int]] = set()  # reported finished: blocks gone
        self.dead: set[tuple[str, int]] = set()  # answered NO once the hold existed
        self.ended_unreported: set[str] = set()
        self.early: set[tuple[str, int]] = set()  # released before held
        self.floor = 0

    def _expire_model(self) -> None:
        for k, (dl, *_) in list(self.live.items()):
            if dl <= self.t:
                self._end_model(k)

    def _end_model(self, k: tuple[str, int]) -> None:
        del self.live[k]
        self.ended_unreported.add(k[0])

    def _pick(self, data: st.DataObject, req: str) -> int:
        mine = [g for r, g in self.gens if r == req]
        return data.draw(st.sampled_from([*mine, 0, 10**12]) if mine else st.just(1))

    @rule(dt=st.floats(0, 3))
    def advance(self, dt: float) -> None:
        self.t += dt

    @rule(req=st.sampled_from(REQS), lease=st.floats(0.1, 5), readers=st.integers(0, 2))
    def hold(self, req: str, lease: float, readers: int) -> None:
        self._expire_model()
        g = self.h.hold(req, self.t, lease, readers=readers)
        for k in [k for k in self.live if k[0] == req]:
            del self.live[k]  # superseded, unreported
        assert g == self.floor + 1
        self.floor = g
        self.live[(req, g)] = [self.t + lease, lease, readers, readers > 0]
        self.gens.append((req, g))
        if (req, g) in self.early:  # its release came first: it ends at once
            self._end_model((req, g))

    @rule(req=st.sampled_from(REQS), data=st.data())
    def renew(self, req: str, data: st.DataObject) -> None:
        g = self._pick(data, req)
        self._expire_model()
        ok = self.h.renew(req, g, self.t)
        assert ok == ((req, g) in self.live)
        if ok:
            m = self.live[(req, g)]
            m[0] = max(m[0], self.t + m[1])

    @rule(req=st.sampled_from(REQS), data=st.data(), readers=st.integers(0, 2))
    def confirm(self, req: str, data: st.DataObject, readers: int) -> None:
        g = self._pick(data, req)
        self._expire_model()
        ok = self.h.confirm(req, g, self.t, readers)
        assert ok == ((req, g) in self.live)
        if ok:  # the safety property: never yes for blocks already reported freed
            assert (req, g) not in self.freed and (req, g) not in self.dead
            m = self.live[(req, g)]
            if readers and not m[3]:  # the first reader that says how many there are
                m[2], m[3] = readers, True
            if m[2]:
                m[2] -= 1
                if m[2] == 0:
                    self._end_model((req, g))
        elif (req, g) in self.gens:
            self.dead.add((req, g))

    @rule(req=st.sampled_from(REQS), data=st.data())
    def release(self, req: str, data: st.DataObject) -> None:
        g = self._pick(data, req)
        self._expire_model()
        ok = self.h.release(req, g, self.t)
        assert ok == ((req, g) in self.live)
        if ok:
            self._end_model((req, g))
        elif g > self.floor:
            self.early.add((req, g))

    @precondition(lambda self: self.gens)
    @rule()
    def finished(self) -> None:
        self._expire_model()
        out = self.h.finished(self.t)
        assert len(out) == len(set(out))
        held_now = {r for r, _ in self.live}
        assert set(out) == self.ended_unreported - held_now
        for r in out:  # vLLM frees the blocks: every ended generation of r is gone
            self.freed |= {(r, g) for rr, g in self.gens if rr == r}
        self.ended_unreported &= held_now

    @invariant()
    def table_matches_model(self) -> None:
        live = {r: g for (r, g), m in self.live.items() if m[0] > self.t}
        for r in REQS:
            if r in live:
                assert self.h.verdict(r, live[r], self.t) is Verdict.YES


TestHoldMachine = HoldMachine.TestCase
TestHoldMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- leases: a LEASE pins the hold, so that a read inside it may be reported without a CONFIRM

def test_a_release_racing_a_leased_read_is_deferred_to_the_readers_return():
    h = Holds()
    g = h.hold("r", 0.0, 10.0, readers=1)
    assert h.lease("r", g, 1.0, pin=5.0) is Verdict.YES
    assert h.release("r", g, 2.0)  # the proxy's: deferred, the hold lives on under the read
    assert "r" in h and h.finished(2.0) == [] and h.counts["deferred"] == 1
    assert not h.renew("r", g, 2.5)  # released: a heartbeat no longer extends it
    assert h.lease("r", g, 2.5, pin=5.0) is Verdict.NO  # nor is it pinned again
    assert h.confirm("r", g, 3.0, readers=1, leased=True)  # the reader returns its LEASE
    assert "r" not in h and h.finished(3.0) == ["r"]
    assert h.counts["released"] == 1 and h.counts["expired"] == 0


def test_a_deferred_release_takes_effect_at_the_pins_end():
    h = Holds()
    g = h.hold("r", 0.0, 100.0, readers=2)
    assert h.lease("r", g, 1.0, pin=5.0) is Verdict.YES  # until 6.0
    assert h.release("r", g, 2.0) and h.finished(5.9) == []
    assert h.verdict("r", g, 5.9) is Verdict.YES
    assert h.finished(6.0) == ["r"] and h.counts["released"] == 1
    assert not h.confirm("r", g, 6.0, leased=True)  # too late: refused, never a yes


def test_only_a_reader_holding_a_lease_returns_one():
    """A plain CONFIRM (a reader whose own LEASE was refused or lost) must not end another
    reader's pin: with the release deferred, that would free the blocks under its read."""
    h = Holds()
    g = h.hold("r", 0.0, 100.0, readers=3)
    assert h.lease("r", g, 0.0, pin=5.0) is Verdict.YES
    assert h.release("r", g, 1.0)
    assert h.confirm("r", g, 2.0) and h.confirm("r", g, 2.0, leased=False)  # not pinned ones
    assert "r" in h and h.finished(2.0) == []  # readers 3: two counted, the pin holds it
    assert h.confirm("r", g, 3.0, leased=True) and "r" not in h


def test_an_unreleased_leased_hold_ends_by_its_readers_as_before():
    h = Holds()
    g = h.hold("r", 0.0, 10.0)
    assert h.lease("r", g, 0.0, pin=30.0) is Verdict.YES
    assert h.finished(20.0) == []  # the pin extends the hold beyond its lease
    assert h.confirm("r", g, 20.0, readers=2, leased=True) and "r" in h
    assert h.confirm("r", g, 20.0, readers=2) and "r" not in h
    assert h.finished(20.0) == ["r"] and h.counts["leased"] == 1


def test_lease_answers_later_and_no_as_a_renew_would():
    h = Holds()
    assert h.lease("r", 5, 0.0, pin=1.0) is Verdict.LATER
    g = h.hold("r", 0.0, 1.0, generation=5)
    assert h.lease("r", g - 1, 0.0, pin=1.0) is Verdict.NO
    assert h.release("r", g, 0.5) and h.lease("r", g, 0.6, pin=1.0) is Verdict.NO  # unpinned
    assert h.counts["lease_refused"] == 2
    for bad in (0, -1.0, float("nan"), True, 601.0):
        with pytest.raises(ArgumentError, match="pin must be"):
            h.lease("r", g, 0.0, pin=bad)


def test_a_hold_superseded_under_a_pin_is_not_reported_before_the_pins_end():
    h = Holds()
    g1 = h.hold("r", 0.0, 10.0)
    assert h.lease("r", g1, 1.0, pin=5.0) is Verdict.YES  # a read of g1 under way
    g2 = h.hold("r", 2.0, 1.0)  # the request held again: g1 ends unreported
    assert h.release("r", g2, 2.5)  # deferred: r's blocks are under g1's read until 6.0
    assert h.finished(5.9) == [] and h.finished(6.0) == ["r"]


def test_pins_are_bounded(monkeypatch):
    from kvplan_nixl.serving import holds as holds_mod

    monkeypatch.setattr(holds_mod, "MAX_PINNED", 3)
    monkeypatch.setattr(holds_mod, "MAX_PINS", 2)
    h = Holds()
    gens = {r: h.hold(r, 0.0, 100.0) for r in "abcde"}
    assert [h.lease(r, gens[r], 0.0, pin=1.0) for r in "abcd"] == [Verdict.YES] * 3 + [
        Verdict.NO]  # a fourth hold pinned at once: refused (its decode waits for CONFIRM)
    assert h.lease("a", gens["a"], 0.0, pin=1.0) is Verdict.YES  # a's second reader
    assert h.lease("a", gens["a"], 0.0, pin=1.0) is Verdict.NO  # a third pin on one hold
    assert h.lease("d", gens["d"], 2.0, pin=1.0) is Verdict.YES  # run-out pins are forgotten
    assert h.counts["lease_refused"] == 2 and len(h._pinned) <= 3
    # a release is deferred by at most MAX_PIN_S, whatever a LEASE asks
    assert h.release("d", gens["d"], 2.5) and h.finished(3.0) == ["d"]


class LeaseMachine(RuleBasedStateMachine):
    """Random holds, LEASEs, releases, confirmations and clock steps, checked against the
    property the decode relies on: while a LEASE granted at ``t`` for ``pin`` is not returned
    and ``now < t + pin``, the hold is live (a CONFIRM would say yes) and the request is never
    reported finished (its blocks never freed). Readers behave as decode ranks do: each hold
    has ``n`` of them (the count the decode computes), each asks at most one LEASE and sends
    one CONFIRM (RETURN when its LEASE was granted); releases come from anyone, any time."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Holds()
        self.t = 0.0
        self.gens: dict[str, int] = {}  # the latest generation of each request
        # readers of each (req, g) that have not confirmed: reader -> its LEASE's end or None
        self.readers: dict[tuple[str, int], dict[int, float | None]] = {}
        self.asked: set[tuple[str, int, int]] = set()  # readers that asked their one LEASE

    def _covered(self, req: str) -> list[tuple[int, float]]:
        return [(g, end) for (r, g), rs in self.readers.items() if r == req
                for end in rs.values() if end is not None and self.t < end]

    def _reader(self, data: st.DataObject) -> tuple[str, int, int] | None:
        req = data.draw(st.sampled_from(sorted(self.gens)))
        rs = self.readers[(req, self.gens[req])]
        if not rs:
            return None
        return req, self.gens[req], data.draw(st.sampled_from(sorted(rs)))

    @rule(dt=st.floats(0, 2))
    def advance(self, dt: float) -> None:
        self.t += dt

    @rule(req=st.sampled_from(REQS), lease=st.floats(0.1, 3), n=st.integers(1, 3))
    def hold(self, req: str, lease: float, n: int) -> None:
        self.gens[req] = g = self.h.hold(req, self.t, lease, readers=n)
        self.readers[(req, g)] = dict.fromkeys(range(n))

    @precondition(lambda self: self.gens)
    @rule(data=st.data(), pin=st.floats(0.1, 3))
    def lease(self, data: st.DataObject, pin: float) -> None:
        who = self._reader(data)
        if who is None or who in self.asked:
            return
        self.asked.add(who)
        req, g, i = who
        if self.h.lease(req, g, self.t, pin) is Verdict.YES:
            self.readers[(req, g)][i] = self.t + pin

    @precondition(lambda self: self.gens)
    @rule(data=st.data())
    def confirm(self, data: st.DataObject) -> None:
        who = self._reader(data)
        if who is None:
            return
        req, g, i = who
        leased = self.readers[(req, g)].pop(i) is not None  # its read ended: it confirms
        self.h.confirm(req, g, self.t, leased=leased)

    @precondition(lambda self: self.gens)
    @rule(data=st.data(), anyone=st.booleans())
    def release(self, data: st.DataObject, anyone: bool) -> None:
        req = data.draw(st.sampled_from(sorted(self.gens)))
        self.h.release(req, None if anyone else self.gens[req], self.t)

    @rule()
    def finished(self) -> None:
        for req in self.h.finished(self.t):
            assert not self._covered(req), (req, self._covered(req), self.t)

    @invariant()
    def a_leased_hold_is_live(self) -> None:
        for req in REQS:
            for g, _ in self._covered(req):
                if self.gens[req] == g:  # superseded ones: kept by the successor (finished())
                    assert self.h.verdict(req, g, self.t) is Verdict.YES, (req, g, self.t)


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
