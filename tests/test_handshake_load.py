"""A busy decode's handshake (issue 46, item 4), with real NIXL endpoints and signed metadata
served by real side channel servers: while the rank's lock-taking threads are kept busy (an
engine step that takes the rank's lock again as soon as it let it go, and the 2 ms progress
loop), a handshake whose metadata fetch is slow (a slow network: each fetch held back) never
makes them wait for the network, and completes within its fetches plus its connects (the only
part that takes the lock) plus a few of the busy threads' own holds. The rank's lock is a
:class:`~kvplan_nixl.serving.locks.FairLock`: with a ``threading.Lock`` the progress loop
waited 0.68 s here once on a loaded machine, behind a step that kept taking the lock back.
Nothing here is a stand-in for NIXL: the connect is ``Endpoint.connect`` and the pull after it
reads the right bytes."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

from kvplan_nixl.serving import sidechannel as sc
from kvplan_nixl.serving.handshakes import READY, Handshakes, identity
from kvplan_nixl.serving.locks import FairLock
from tests.nixl_util import pair
from tests.test_handshakes import wait_for
from tests.test_pool_attacks import DB, DST, HOST, KEY, SB, SRC, serve

#: each metadata fetch is held back this long before it is sent (a slow link or prefill)
SLOW = 1.0
#: how long the busy step holds the rank's lock each time (a step's own work under it)
HOLD = 0.004


class TimedLock:
    """The rank's lock (a :class:`FairLock`, as ``Worker.lock``), with the longest wait and
    hold of each thread that took it (by name)."""

    def __init__(self) -> None:
        self.lock = FairLock()
        self.waits: dict[str, float] = {}
        self.held: dict[str, float] = {}

    def __enter__(self) -> TimedLock:
        t0 = time.monotonic()
        self.lock.acquire()
        self.t = time.monotonic()
        name = threading.current_thread().name
        self.waits[name] = max(self.waits.get(name, 0.0), self.t - t0)
        return self

    def __exit__(self, *exc: object) -> None:
        name = threading.current_thread().name
        self.held[name] = max(self.held.get(name, 0.0), time.monotonic() - self.t)
        self.lock.release()


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_busy_ranks_handshake_waits_for_no_lock_across_the_network():
    with pair(SRC, DST, secret=KEY) as pr, ExitStack() as stack:
        base = serve(stack, HOST, [ep.metadata() for ep in pr.p])
        lock, dec = TimedLock(), pr.d[0]
        fetches: list[float] = []
        connects: list[float] = []

        def fetch(host, port, *, timeout, identity):  # the real fetch, after a slow link
            t0 = time.monotonic()
            time.sleep(SLOW)
            try:
                return sc.fetch_metadata(host, port, timeout=timeout, identity=identity)
            finally:
                fetches.append(time.monotonic() - t0)

        def connect(engine: str, rank: int, blob: bytes):  # as the connector's rank 0 does
            t0 = time.monotonic()
            dec.connect(blob, mode="pull")
            connects.append(time.monotonic() - t0)
            return range(dec.map(engine).src.tp_size)

        hs = stack.enter_context(Handshakes(connect, lock=lock, identify=identity(KEY),
                                            timeout=5.0, fetch=fetch))
        stop = threading.Event()

        def step() -> None:  # an engine step under load: the lock taken again at once
            while not stop.is_set():
                with lock:
                    dec.notifications()
                    spin(HOLD)

        def progress() -> None:  # the worker's progress loop
            while not stop.wait(0.002):
                with lock:
                    dec.notifications()

        busy = [threading.Thread(target=step, name="step"),
                threading.Thread(target=progress, name="progress")]
        for t in busy:
            t.start()
        try:
            time.sleep(0.05)
            t0 = time.monotonic()
            assert hs.start("prefill", HOST, base).pending  # never blocks the caller
            assert time.monotonic() - t0 < 0.05
            s = wait_for(hs, ("prefill", HOST, base), READY, within=20)
            took = s.since - t0
        finally:
            stop.set()
            for t in busy:
                t.join()
        assert s.ranks == (0, 1) and len(fetches) == 2 and len(connects) == 2
        # the handshake: its two fetches, its two connects, and a few holds of the busy step
        # (it takes the lock between them), nothing more: well under one more fetch (the
        # bounds leave room for a loaded 2-core machine; a fetch under the lock breaks them)
        waited = took - sum(fetches) - sum(connects)
        assert waited < SLOW / 2, (took, fetches, connects, lock.waits)
        # the threads that take the rank's lock never waited for the network: at most a
        # connect (NIXL loading the peer's metadata), never a fetch of SLOW seconds
        others = {k: v for k, v in lock.waits.items() if k in ("step", "progress")}
        assert max(others.values()) < max(connects) + SLOW / 2, (others, connects)
        # nobody held the lock across a fetch: the longest hold is a connect's or the step's
        assert max(lock.held.values()) < max(connects) + SLOW / 2, (lock.held, connects)
        with lock:  # and the connection is real: a pull reads the prefill's bytes
            pr.run("pull", SB, DB)
        assert pr.check(SB, DB) > 0
