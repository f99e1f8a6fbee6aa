"""A lock its waiters take in the order they asked: :class:`FairLock`.

A ``threading.Lock`` is not fair: when its holder releases it and asks again at once (an
engine step that takes a rank's lock for every call, the 2 ms progress loop), the holder
usually wins, because a waiter must first be woken and scheduled. On a loaded machine (two
cores, engine processes busy-looping) a waiter then waits for many holds: measured in
``tests/test_handshake_load.py``, a progress loop waited 0.68 s behind a step that held a
``threading.Lock`` 4 ms at a time and took it again at once, and a handshake's ``connect``
waits the same way. With :class:`FairLock` the lock passes on release straight to the thread
that has waited longest, so a waiter waits for the holds queued ahead of it, never for a
thread that keeps taking the lock back.

Standard library only: no NIXL, no engine.
"""

from __future__ import annotations

import collections
import threading

__all__ = ["FairLock"]


class FairLock:
    """A mutual exclusion lock, first come first served: :meth:`release` hands the lock to the
    longest waiter (its ownership passes on without being free in between), so a thread that
    releases and asks again queues behind every thread already waiting. Not reentrant; used
    as ``threading.Lock`` is (``with lock:``, :meth:`acquire`, :meth:`release`,
    :meth:`locked`). An uncontended acquire and release cost a few microseconds."""

    def __init__(self) -> None:
        self._mu = threading.Lock()  # guards the two fields below, never held while waiting
        self._owned = False
        self._waiters: collections.deque[threading.Lock] = collections.deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the lock: at once if it is free and nobody waits, else after every thread
        that asked before (``blocking`` False: only at once; ``timeout`` seconds at most when
        >= 0). True once held."""
        with self._mu:
            if not self._owned:
                self._owned = True
                return True
            if not blocking:
                return False
            gate = threading.Lock()
            gate.acquire()
            self._waiters.append(gate)
        if gate.acquire(timeout=timeout if timeout >= 0 else -1):
            return True  # released to us: we own the lock now
        with self._mu:  # timed out, unless the lock was handed to us meanwhile
            try:
                self._waiters.remove(gate)
                return False
            except ValueError:
                pass
        gate.acquire()  # handed over: the gate is open, this returns at once
        return True

    def release(self) -> None:
        """Give the lock to the longest waiter, or free it if nobody waits."""
        with self._mu:
            if not self._owned:
                raise RuntimeError("release of an unlocked FairLock")
            if self._waiters:
                self._waiters.popleft().release()  # it owns the lock from now on
            else:
                self._owned = False

    def locked(self) -> bool:
        """Whether some thread holds the lock."""
        return self._owned

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
