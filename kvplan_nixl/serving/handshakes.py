"""Handshakes: a decode's connections to prefill engines, made off the engine step.

The first pull from a prefill engine needs its ranks' metadata (a TCP fetch from each rank's
side channel, up to a timeout each) and ``Endpoint.connect`` for each; done inside
``start_load_kv`` it stalls every request of the engine step. :class:`Handshakes` runs them on
threads instead: the connector calls :meth:`Handshakes.start` when a request names an engine,
and each engine step polls :meth:`Handshakes.state` (never blocking); a request's load starts
once its handshake is ``ready`` and goes to the failure policy once it is ``failed``.

**Keyed by what was verified, not by what a request claims.** A request names an engine id
*and* the host and port of its side channel, and anyone who can send the decode an HTTP
request chooses both. So the state is kept per (engine, host, port): a request naming a
genuine engine at a dead address fails its own handshake, never the engine's state at its
real address. A rank counts as connected only once the metadata fetched from its port was
verified (``identify``: signed under the deployment secret) to be that engine's *that* rank:
an address serving another rank's metadata fails, so READY means every rank verified its own
rank, and nothing of a wrong claim reaches ``connect``.

**Bounded.** The jobs run on :class:`~kvplan_nixl.serving.host_pools.HostPool`: a fixed number of
threads, a quarter of them per host and one per address, hosts served in turn, a bounded number
waiting, a quarter of them per host (beyond, the handshake fails at once, unrecorded, so the next
request tries again). Requests naming silent side channels on one host cost that host's slots for
``attempts`` timeouts each and delay no handshake with another host; a handshake waits only while
requests name that many silent addresses at once, each for at most ``attempts`` timeouts. The table
holds at most :data:`MAX_STATES` addresses (failed ones past their retry time are dropped first).

The fetches and the identity checks run without any lock; the caller's ``connect`` runs under
the lock passed in (the one every use of the Endpoint takes), one rank at a time, and says
which ranks to connect next (those ``TransferMap.peers`` names, known only once the first
rank's spec is in). Metadata reads are bounded
(:data:`~kvplan_nixl.serving.sidechannel.MAX_METADATA`, one deadline per fetch).

No NIXL, no vLLM: the standard library, the side channel client and the metadata format.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvplan_nixl import metadata as md
from kvplan_nixl.errors import ArgumentError, ClosedError, MetadataError
from kvplan_nixl.serving.host_pools import HostPool
from kvplan_nixl.serving.sidechannel import (
    SideChannelClosed,
    SideChannelTimeout,
    fetch_metadata,
    server_identity,
)

__all__ = ["FAILED", "MAX_STATES", "PENDING", "READY", "HandshakeState", "Handshakes",
           "identity"]

PENDING, READY, FAILED = "pending", "ready", "failed"
#: Addresses whose handshake state is kept at most (each request may name a new one).
MAX_STATES = 1024

#: ``rank -> (host, port, identity)`` of a prefill engine's ranks (identity None: unchecked).
Address = Callable[[int], "tuple[str, int, str | None]"]
#: ``connect(engine, rank, blob)``: connect one rank (under the lock); returns the ranks to
#: connect next (already connected ones are skipped), or None.
Connect = Callable[[str, int, bytes], "Iterable[int] | None"]
#: ``identify(blob)``: the (engine, rank) a metadata blob verifies as; raises if it does not.
Identify = Callable[[bytes], "tuple[str, int]"]
#: A handshake's key: (engine, host, port of rank 0's side channel).
Key = tuple[str, str, int]


def identity(secret: bytes | str | None) -> Identify:
    """An ``identify`` that decodes the blob (its signature checked under ``secret``) and
    returns the engine and rank it advertises."""
    def identify(blob: bytes) -> tuple[str, int]:
        info = md.decode(blob, secret)
        return info.engine, info.rank
    return identify


@dataclass(frozen=True)
class HandshakeState:
    """Where a handshake is: ``kind`` is PENDING, READY or FAILED; ``reason`` says why it
    failed; ``since`` is when it got there (the clock's reading); ``ranks`` connected, each
    verified to be the rank it was fetched as."""

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

    ``timeout``: the deadline of each metadata fetch. ``workers`` threads in all (each
    mostly waits on a socket: many are cheap, and requests must name that many silent
    addresses at once to make a handshake wait), ``per_host`` of them for one host,
    ``queued`` handshakes waiting at most (a quarter of them for one host).
    ``retry_after_s``: a failed handshake is tried again by a :meth:`start` this long after
    it failed (a restarted prefill comes back); before that, :meth:`start` returns the failure.
    ``attempts``: fetches of one rank's metadata that time out, or that the server closes
    before answering, before the handshake fails. A side channel that answers nothing within
    ``timeout`` is most often a prefill process starved for a moment (a loaded host), not a
    dead one; a server closes a connection whose request came after its own deadline (this
    process starved: seen in CI with a TP 2 decode on two busy cores) or over its connection
    cap. Each retry is reported to ``warn`` (loud, never silent), and a silent address costs
    ``attempts`` timeouts of one thread; a refused connection (nothing listens) is not retried.
    """

    def __init__(self, connect: Connect, *, lock: threading.Lock, identify: Identify,
                 timeout: float = 5.0, workers: int = 32, per_host: int = 8,
                 queued: int = 64, retry_after_s: float = 5.0, attempts: int = 2,
                 warn: Callable[[str], None] | None = None,
                 fetch: Callable[..., bytes] = fetch_metadata,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout > 0 or not retry_after_s >= 0 or isinstance(attempts, bool) \
                or not isinstance(attempts, int) or attempts < 1:
            raise ArgumentError("timeout must be > 0, retry_after_s >= 0 and attempts an int "
                                f">= 1, got {timeout!r}, {retry_after_s!r}, {attempts!r}")
        self.attempts, self._warn = attempts, warn
        self._connect, self._lock, self._fetch = connect, lock, fetch
        self._identify = identify
        self.timeout, self.retry_after_s, self._clock = timeout, retry_after_s, clock
        # one job per address at a time: a second engine id named at the same silent port
        # waits behind the first instead of taking another thread
        self._pool = HostPool("kvplan-hs", workers=workers, per_host=per_host, per_address=1,
                            queued=queued, queued_per_host=max(1, queued // 4))
        self._mu = threading.Lock()  # guards the table below (never held while waiting)
        self._states: dict[Key, HandshakeState] = {}
        # the epoch of each key's current job, from one counter: a job whose epoch is no
        # longer its key's (forgotten, restarted) changes nothing
        self._epochs: dict[Key, int] = {}
        self._epoch = 0
        self._stop = threading.Event()

    def start(self, engine: str, host: str, port: int, *, first: int = 0,
              address: Address | None = None) -> HandshakeState:
        """Start connecting ``engine`` through the side channels at ``host``, ``port`` + rank
        (``address``: another rank -> (host, port, identity) mapping, for tests), rank
        ``first`` then the ranks ``connect`` names, unless that handshake is pending, ready,
        or failed less than ``retry_after_s`` ago; returns its state. Never blocks on the
        network. A handshake the pool cannot take now fails without being recorded."""
        if self._stop.is_set():
            raise ClosedError("Handshakes is closed")
        key = (engine, host, port)
        where = (host, port)
        if address is None:
            def address(r: int) -> tuple[str, int, str]:
                return host, port + r, server_identity(engine, r)
        with self._mu:
            s = self._states.get(key)
            now = self._clock()
            if s is not None and (s.kind != FAILED or now - s.since < self.retry_after_s):
                return s
            if s is None and len(self._states) >= MAX_STATES and not self._prune(now):
                return HandshakeState(FAILED, f"{MAX_STATES} prefill addresses are known or "
                                      "connecting; try again later", now)
            self._epoch += 1
            epoch = self._epochs[key] = self._epoch
            s = self._states[key] = HandshakeState(PENDING, since=now)
        if not self._pool.submit(where, lambda: self._run(key, address, first, epoch)):
            with self._mu:  # refused: forgotten, so that the next request tries again
                if self._epochs.get(key) == epoch:
                    del self._states[key], self._epochs[key]
            pool = self._pool
            return HandshakeState(FAILED, f"the handshake pool is full ({pool.waiting} "
                                  f"waiting; at most {pool.queued} in all and "
                                  f"{pool.queued_per_host} for host {host}); try again later",
                                  self._clock())
        return s

    def state(self, engine: str, host: str, port: int) -> HandshakeState | None:
        """The handshake's state, or None if never started (or forgotten). Never blocks."""
        with self._mu:
            return self._states.get((engine, host, port))

    def forget(self, engine: str) -> None:
        """Drop what is known of ``engine`` at every address (its prefill restarted: the next
        :meth:`start` connects afresh); a job in flight for it changes nothing any more."""
        with self._mu:
            for key in [k for k in self._states if k[0] == engine]:
                del self._states[key]
                self._epochs.pop(key, None)

    def close(self) -> None:
        """Stop: jobs end at their next step (a fetch within its timeout), threads joined."""
        self._stop.set()
        self._pool.close()

    def __enter__(self) -> Handshakes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prune(self, now: float) -> bool:
        """Drop failed handshakes past their retry time (under ``_mu``); True if any was."""
        old = [k for k, s in self._states.items()
               if s.failed and now - s.since >= self.retry_after_s]
        for k in old:
            del self._states[k]
            self._epochs.pop(k, None)
        return bool(old)

    def _run(self, key: Key, address: Address, first: int, epoch: int) -> None:
        engine = key[0]
        done: list[int] = []
        todo, rank = [first], first
        try:
            while todo:
                if self._stop.is_set():
                    raise ClosedError("Handshakes closed during the handshake")
                rank = todo.pop(0)
                if rank in done:
                    continue
                host, port, ident = address(rank)
                blob = self._fetch_rank(engine, rank, host, port, ident)
                got = self._identify(blob)
                if got != (engine, rank):  # checked before anything of it is connected
                    raise MetadataError(
                        f"the side channel at {host}:{port} served the metadata of engine "
                        f"{got[0]!r} rank {got[1]}, not of engine {engine!r} rank {rank}: the "
                        "request's remote_host/remote_port do not lead to that engine's ranks")
                with self._lock:
                    if not self._current(key, epoch):
                        return
                    more = self._connect(engine, rank, blob)
                done.append(rank)
                todo += [r for r in (more or ()) if r not in done and r not in todo]
        except Exception as e:  # any failure is this handshake's alone: recorded, never raised
            self._set(key, epoch, HandshakeState(
                FAILED, f"rank {rank}: {type(e).__name__}: {e}", self._clock(), tuple(done)))
            return
        self._set(key, epoch, HandshakeState(READY, None, self._clock(), tuple(done)))

    def _fetch_rank(self, engine: str, rank: int, host: str, port: int,
                    ident: str | None) -> bytes:
        """One rank's metadata, fetched again after a timeout or an early close, ``attempts``
        tries in all."""
        attempt = 1
        while True:
            try:
                return self._fetch(host, port, timeout=self.timeout, identity=ident)
            except (SideChannelTimeout, SideChannelClosed) as e:
                if attempt >= self.attempts or self._stop.is_set():
                    raise type(e)(f"{e} (try {attempt} of {self.attempts})", host, port) from e
                attempt += 1
                if self._warn is not None:
                    self._warn(f"handshake with engine {engine!r} rank {rank}: {e}; trying "
                               f"again (try {attempt} of {self.attempts})")

    def _current(self, key: Key, epoch: int) -> bool:
        with self._mu:
            return self._epochs.get(key) == epoch

    def _set(self, key: Key, epoch: int, s: HandshakeState) -> None:
        with self._mu:
            if self._epochs.get(key) == epoch:
                self._states[key] = s
