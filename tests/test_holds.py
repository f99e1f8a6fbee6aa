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
