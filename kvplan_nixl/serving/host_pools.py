"""HostPool: a bounded thread pool whose jobs each talk to one network address, served so that
jobs for one host cannot hold up jobs for another.

The connector's handshakes and control messages are jobs of this kind, and the address each
goes to comes from a request's ``kv_transfer_params``, which any HTTP client chooses. A plain
FIFO pool lets a few requests naming silent addresses take every thread for a timeout each,
while genuine requests queue behind them. Here:

* at most ``workers`` jobs run at once, at most ``per_host`` of them for one host and at most
  ``per_address`` for one (host, port); so requests naming one host cost that host's slots and
  no more, and distinct hosts run side by side;
* waiting jobs are served host by host in turn (round-robin), and within a host port by port,
  so a new host's job starts as soon as a thread is free, ahead of a second job of any host;
* at most ``queued`` jobs wait in all, and at most ``queued_per_host`` for one host:
  :meth:`HostPool.submit` refuses more at once (the caller fails or drops that job; nothing
  queues without bound, and requests naming one host cannot fill the queue for the others);
* a job whose ``key`` is waiting or running already is not added twice (the same RELEASE sent
  for many requests' failures is sent once).

Each job is expected to bound its own time (the side channel's deadlines do), so a slot is
never held for longer than one timeout. Only the standard library.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

from kvplan_nixl.errors import ArgumentError

__all__ = ["HostPool"]

logger = logging.getLogger(__name__)

#: (host, port) a job talks to.
Where = tuple[str, int]


class HostPool:
    """Jobs by address on a bounded pool, fair across hosts (see the module docstring)."""

    def __init__(self, name: str, *, workers: int, per_host: int, per_address: int,
                 queued: int, queued_per_host: int | None = None) -> None:
        if queued_per_host is None:
            queued_per_host = queued
        for what, v in (("workers", workers), ("per_host", per_host),
                        ("per_address", per_address), ("queued", queued),
                        ("queued_per_host", queued_per_host)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ArgumentError(f"{what} must be an int >= 1, got {v!r}")
        self.workers, self.per_host, self.per_address, self.queued = \
            workers, per_host, per_address, queued
        self.queued_per_host = queued_per_host
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._mu = threading.Lock()
        # waiting jobs: host -> port -> [(key, job)]; both levels in serving order
        self._waiting: collections.OrderedDict[
            str, collections.OrderedDict[int, collections.deque]] = collections.OrderedDict()
        self._count = 0  # jobs waiting
        self._host_waiting: collections.Counter[str] = collections.Counter()
        self._hosts: collections.Counter[str] = collections.Counter()  # running per host
        self._addresses: collections.Counter[Where] = collections.Counter()  # running
        self._running = 0
        self._keys: set[Hashable] = set()  # keys waiting or running
        self._closed = False

    @property
    def waiting(self) -> int:
        """Jobs waiting for a thread."""
        return self._count

    @property
    def running(self) -> int:
        """Jobs running now."""
        return self._running

    def submit(self, where: Where, job: Callable[[], object],
               key: Hashable | None = None) -> bool:
        """Run ``job()`` on a thread once ``where``'s host and address have a free slot.
        False when refused: ``queued`` jobs wait already (or ``queued_per_host`` for that
        host), or the pool is closed. A ``key``
        already waiting or running: not added again (True: that job will run)."""
        with self._mu:
            if self._closed:
                return False
            if key is not None and key in self._keys:
                return True
            if self._count >= self.queued \
                    or self._host_waiting[where[0]] >= self.queued_per_host:
                return False
            if key is not None:
                self._keys.add(key)
            ports = self._waiting.setdefault(where[0], collections.OrderedDict())
            ports.setdefault(where[1], collections.deque()).append((key, job))
            self._count += 1
            self._host_waiting[where[0]] += 1
            self._dispatch()
        return True

    def close(self) -> None:
        """Drop the waiting jobs and wait for the running ones (each bounded by its own
        deadline). Idempotent."""
        with self._mu:
            self._closed = True
            self._waiting.clear()
            self._host_waiting.clear()
            self._count = 0
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _dispatch(self) -> None:
        """Start waiting jobs while threads are free (under ``_mu``)."""
        while self._running < self.workers and self._count:
            picked = self._pick()
            if picked is None:
                return
            where, key, job = picked
            self._running += 1
            self._hosts[where[0]] += 1
            self._addresses[where] += 1
            self._pool.submit(self._run, where, key, job)

    def _pick(self) -> tuple[Where, Hashable | None, Callable[[], object]] | None:
        """The next job by host, then by port, in turn; None if every waiting job's host or
        address is at its limit. A host or port served moves to the end of its order."""
        for host, ports in self._waiting.items():
            if self._hosts[host] >= self.per_host:
                continue
            for port, jobs in ports.items():
                if self._addresses[(host, port)] >= self.per_address:
                    continue
                key, job = jobs.popleft()
                self._count -= 1
                self._host_waiting[host] -= 1
                if not self._host_waiting[host]:
                    del self._host_waiting[host]
                if jobs:
                    ports.move_to_end(port)
                else:
                    del ports[port]
                if ports:
                    self._waiting.move_to_end(host)
                else:
                    del self._waiting[host]
                return (host, port), key, job
        return None

    def _run(self, where: Where, key: Hashable | None, job: Callable[[], object]) -> None:
        try:
            job()
        except Exception:  # a job reports its own failures; this is a bug's last resort
            logger.exception("kvplan: a job for %s:%d failed", *where)
        finally:
            with self._mu:
                self._running -= 1
                self._hosts[where[0]] -= 1
                if not self._hosts[where[0]]:
                    del self._hosts[where[0]]
                self._addresses[where] -= 1
                if not self._addresses[where]:
                    del self._addresses[where]
                self._keys.discard(key)
                if not self._closed:
                    self._dispatch()
