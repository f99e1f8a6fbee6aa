"""The bounded pool of kvplan_nixl/serving/host_pools.py: jobs of one host never hold up another
host's, per-host and per-address limits hold, waiting jobs are bounded and deduplicated, and close
drops what waits and joins what runs."""

from __future__ import annotations

import threading
import time

import pytest

from kvplan_nixl.errors import ArgumentError
from kvplan_nixl.serving.host_pools import HostPool


def test_a_busy_host_does_not_hold_up_another():
    gate = threading.Event()
    started: list[str] = []
    mu = threading.Lock()

    def job(tag: str, block: bool):
        def run():
            with mu:
                started.append(tag)
            if block:
                gate.wait(5)
        return run

    pool = HostPool("t", workers=4, per_host=2, per_address=1, queued=64)
    try:
        for p in range(12):  # twelve silent ports on one host
            assert pool.submit(("10.0.0.9", 7000 + p), job(f"bad{p}", True))
        time.sleep(0.05)
        assert pool.running == 2 and pool.waiting == 10  # the host's two slots only
        done = threading.Event()
        t0 = time.monotonic()
        assert pool.submit(("127.0.0.1", 5600), lambda: done.set())
        assert done.wait(1) and time.monotonic() - t0 < 0.5
    finally:
        gate.set()
        pool.close()
    assert sorted(started[:2]) == ["bad0", "bad1"]


def test_ports_of_one_host_are_served_in_turn_and_one_at_a_time():
    order: list[int] = []
    pool = HostPool("t", workers=1, per_host=1, per_address=1, queued=64)
    gate = threading.Event()
    pool.submit(("h", 1), lambda: gate.wait(5))  # holds the only thread while we queue
    for _ in range(3):
        pool.submit(("h", 1), lambda: order.append(1))
    pool.submit(("h", 2), lambda: order.append(2))
    gate.set()
    end = time.monotonic() + 5
    while len(order) < 4 and time.monotonic() < end:
        time.sleep(0.005)
    pool.close()
    assert order == [1, 2, 1, 1]  # port 2 is served before port 1's second job


def test_waiting_jobs_are_bounded_and_deduplicated():
    gate = threading.Event()
    ran: list[str] = []
    pool = HostPool("t", workers=1, per_host=1, per_address=1, queued=2)
    try:
        assert pool.submit(("h", 1), lambda: gate.wait(5))
        assert pool.submit(("h", 2), lambda: ran.append("a"), key="k")
        assert pool.submit(("h", 2), lambda: ran.append("dup"), key="k")  # not added
        assert pool.submit(("h", 3), lambda: ran.append("b"))
        assert not pool.submit(("h", 4), lambda: ran.append("c"))  # full: refused
        assert pool.waiting == 2
        gate.set()
        end = time.monotonic() + 5
        while len(ran) < 2 and time.monotonic() < end:
            time.sleep(0.005)
        assert sorted(ran) == ["a", "b"]
        assert pool.submit(("h", 2), lambda: ran.append("again"), key="k")  # done: anew
    finally:
        pool.close()


def test_close_drops_waiting_jobs_and_joins_running_ones():
    gate = threading.Event()
    ran: list[int] = []
    before = threading.active_count()
    pool = HostPool("t", workers=1, per_host=1, per_address=1, queued=8)
    pool.submit(("h", 1), lambda: (gate.wait(0.2), ran.append(0)))
    pool.submit(("h", 1), lambda: ran.append(1))
    pool.close()
    assert ran == [0] and threading.active_count() == before
    assert not pool.submit(("h", 1), lambda: ran.append(2))


def test_a_failing_job_frees_its_slot():
    pool = HostPool("t", workers=1, per_host=1, per_address=1, queued=8)
    done = threading.Event()
    try:
        pool.submit(("h", 1), lambda: 1 / 0)
        pool.submit(("h", 1), done.set)
        assert done.wait(2)
    finally:
        pool.close()


@pytest.mark.parametrize("kw", [{"workers": 0}, {"per_host": True}, {"queued": "8"}])
def test_limits_are_checked(kw):
    args = {"workers": 1, "per_host": 1, "per_address": 1, "queued": 1, **kw}
    with pytest.raises(ArgumentError, match=next(iter(kw))):
        HostPool("t", **args)
