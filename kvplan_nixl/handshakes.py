"""Handshakes: a decode's connections to prefill engines, made off the engine step.

The first pull from a prefill engine needs its ranks' metadata (a TCP fetch from each rank's
side channel, up to a timeout each) and ``Endpoint.connect`` for each; done inside
``start_load_kv`` it stalls every request of the engine step. :class:`Handshakes` runs them on
a small pool of threads instead: the connector calls :meth:`Handshakes.start` when a request
names an engine, and each engine step polls :meth:`Handshakes.state` (never blocking); a
request's load starts once its engine is ``ready`` and goes to the failure policy once it is
``failed``.

The fetches run without any lock; the caller's ``connect`` runs under the lock passed in (the
one every use of the Endpoint takes: it is used by one thread at a time), one rank at a time,
and says which ranks to connect next (those ``TransferMap.peers`` names, known only once the
first rank's spec is in). Metadata reads are bounded (:data:`~kvplan_nixl.sidechannel.MAX_METADATA`,
one deadline per fetch): a hostile or dead prefill fails its own handshake and no other.

Only the standard library and :mod:`kvplan_nixl.sidechannel` (no NIXL, no vLLM).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvplan_nixl.errors import ArgumentError, ClosedError
from kvplan_nixl.sidechannel import fetch_metadata

__all__ = ["FAILED", "PENDING", "READY", "HandshakeState", "Handshakes"]

PENDING, READY, FAILED = "pending", "ready", "failed"

#: ``rank -> (host, port, identity)`` of a prefill engine's ranks (identity None: unchecked).
Address = Callable[[int], "tuple[str, int, str | None]"]
#: ``connect(engine, rank, blob)``: connect one rank (under the lock); returns the ranks to
#: connect next (already connected ones are skipped), or None.
Connect = Callable[[str, int, bytes], "Iterable[int] | None"]


@dataclass(frozen=True)
class HandshakeState:
    """Where an engine's handshake is: ``kind`` is PENDING, READY or FAILED; ``reason`` says
    why it failed; ``since`` is when it got there (the clock's reading); ``ranks`` connected."""

    kind: str
    reason: str | None = None
    since: float = 0.0
    ranks: tuple[int, ...] = ()

    @property
    def pending(self) -> bool:
        """kind == PENDING."""
        return self.kind == PENDING

    @property
    def ready(self) -> bool:
        """kind == READY."""
        return self.kind == READY

    @property
    def failed(self) -> bool:
        """kind == FAILED."""
        return self.kind == FAILED


class Handshakes:
    """Background handshakes with prefill engines (see the module docstring).

    ``timeout``: the deadline of each metadata fetch. ``workers``: threads (engines handshake
    in parallel up to that). ``retry_after_s``: a failed engine is tried again by a
    :meth:`start` this long after it failed (a restarted prefill comes back); before that,
    :meth:`start` returns the failure.
    """

    def __init__(self, connect: Connect, *, lock: threading.Lock, timeout: float = 5.0,
                 workers: int = 1, retry_after_s: float = 5.0,
                 fetch: Callable[..., bytes] = fetch_metadata,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ArgumentError(f"workers must be an int >= 1, got {workers!r}")
        if not timeout > 0 or not retry_after_s >= 0:
            raise ArgumentError(f"timeout must be > 0 and retry_after_s >= 0, got {timeout!r}, "
                                f"{retry_after_s!r}")
        self._connect, self._lock, self._fetch = connect, lock, fetch
        self.timeout, self.retry_after_s, self._clock = timeout, retry_after_s, clock
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvplan-hs")
        self._mu = threading.Lock()  # guards the table below (never held while waiting)
        self._states: dict[str, HandshakeState] = {}
        self._epochs: dict[str, int] = {}  # a job of an older epoch changes nothing
        self._stop = threading.Event()

    def start(self, engine: str, address: Address, first: int = 0) -> HandshakeState:
        """Start connecting ``engine`` (rank ``first``, then the ranks ``connect`` names)
        unless it is pending, ready, or failed less than ``retry_after_s`` ago; returns its
        state. Never blocks on the network."""
        if self._stop.is_set():
            raise ClosedError("Handshakes is closed")
        with self._mu:
            s = self._states.get(engine)
            now = self._clock()
            if s is not None and (s.kind != FAILED or now - s.since < self.retry_after_s):
                return s
            epoch = self._epochs.get(engine, 0) + 1
            self._epochs[engine] = epoch
            s = self._states[engine] = HandshakeState(PENDING, since=now)
        self._pool.submit(self._run, engine, address, first, epoch)
        return s

    def state(self, engine: str) -> HandshakeState | None:
        """The engine's state, or None if never started (or forgotten). Never blocks."""
        with self._mu:
            return self._states.get(engine)

    def forget(self, engine: str) -> None:
        """Drop what is known of ``engine`` (its prefill restarted: the next :meth:`start`
        connects afresh); a job in flight for it changes nothing any more."""
        with self._mu:
            self._states.pop(engine, None)
            self._epochs[engine] = self._epochs.get(engine, 0) + 1

    def close(self) -> None:
        """Stop: jobs end at their next step (a fetch within its timeout), threads joined."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Handshakes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, engine: str, address: Address, first: int, epoch: int) -> None:
        done: list[int] = []
        todo, rank = [first], first
        try:
            while todo:
                if self._stop.is_set():
                    raise ClosedError("Handshakes closed during the handshake")
                rank = todo.pop(0)
                if rank in done:
                    continue
                host, port, identity = address(rank)
                blob = self._fetch(host, port, timeout=self.timeout, identity=identity)
                with self._lock:
                    if not self._current(engine, epoch):
                        return
                    more = self._connect(engine, rank, blob)
                done.append(rank)
                todo += [r for r in (more or ()) if r not in done and r not in todo]
        except Exception as e:  # any failure is this engine's alone: recorded, never raised
            self._set(engine, epoch, HandshakeState(
                FAILED, f"rank {rank}: {type(e).__name__}: {e}", self._clock(), tuple(done)))
            return
        self._set(engine, epoch, HandshakeState(READY, None, self._clock(), tuple(done)))

    def _current(self, engine: str, epoch: int) -> bool:
        with self._mu:
            return self._epochs.get(engine) == epoch

    def _set(self, engine: str, epoch: int, s: HandshakeState) -> None:
        with self._mu:
            if self._epochs.get(engine) == epoch:
                self._states[engine] = s
