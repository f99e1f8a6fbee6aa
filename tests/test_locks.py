"""kvplan_nixl/serving/locks.py: FairLock hands the lock to its waiters in the order they asked,
so a thread that keeps taking it back (an engine step) never starves another (a handshake's
connect, the progress loop); timeouts and non-blocking tries leave nothing queued."""

from __future__ import annotations

import threading
import time

import pytest

from kvplan_nixl.serving.locks import FairLock


def queued(lock: FairLock, n: int, within: float = 10.0) -> None:
    """Wait until ``n`` threads wait for ``lock``."""
    end = time.monotonic() + within
    while len(lock._waiters) < n:
        assert time.monotonic() < end, len(lock._waiters)
        time.sleep(0.001)


def test_waiters_take_it_in_the_order_they_asked_before_the_holder_again():
    lock, order = FairLock(), []

    def take(name: str) -> None:
        with lock:
            order.append(name)

    lock.acquire()
    threads = []
    for i, name in enumerate(("first", "second", "third")):
        threads.append(threading.Thread(target=take, args=(name,)))
        threads[-1].start()
        queued(lock, i + 1)
    lock.release()
    take("holder again")  # asks after all three: served last, however fast it asks
    for t in threads:
        t.join()
    assert order == ["first", "second", "third", "holder again"]
    assert not lock.locked() and not lock._waiters


def test_timeouts_and_tries_leave_nothing_queued():
    lock = FairLock()
    assert lock.acquire() and lock.locked()
    assert not lock.acquire(blocking=False)
    t0 = time.monotonic()
    got = []
    th = threading.Thread(target=lambda: got.append(lock.acquire(timeout=0.05)))
    th.start()
    th.join()
    assert got == [False] and time.monotonic() - t0 >= 0.05 and not lock._waiters
    lock.release()
    assert not lock.locked() and lock.acquire(timeout=0.01)
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()
