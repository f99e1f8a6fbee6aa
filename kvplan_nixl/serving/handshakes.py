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

**Restarts and identity** (docs/vllm.md, "Restarts in place"). States change only as
:data:`TRANSITIONS` says: :meth:`Handshakes.start` moves an unknown handshake (or a failed one
past ``retry_after_s``) to PENDING, its job to READY or FAILED, and :meth:`Handshakes.forget`
(the engine's peer closed, a post or a read with it failed) to unknown, so that the next
request naming the engine connects afresh: a prefill restarted at the same address is
connected again, its new agents replacing the old ones. With ``pin`` (peers whose metadata is
not signed: a stock NixlConnector prefill, a kvplan one without a secret) an engine id is
bound to the first address whose handshake connected it, and stays bound for the life of the
decode, forget included: a request naming that engine at another address fails at once,
:class:`AddressConflict`, nothing dialled, until another engine id completes a handshake at
that address (the engine there restarted under a new id: the old id's pin is dropped, so that
restarts under vLLM's default ids, a new one each start, never fill the table). ``admit`` may
refuse an address before anything is dialled (an allow-list).

No NIXL, no vLLM: the standard library, the side channel client and the metadata format.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvplan_nixl import metadata as md
from kvplan_nixl.errors import ArgumentError, ClosedError, MetadataError, ParamsError
from kvplan_nixl.serving.host_pools import HostPool
from kvplan_nixl.serving.locks import FairLock
from kvplan_nixl.serving.sidechannel import (
    SideChannelClosed,
    SideChannelTimeout,
    fetch_metadata,
    server_identity,
)

__all__ = ["FAILED", "MAX_STATES", "PENDING", "READY", "TRANSITIONS", "AddressConflict",
           "AddressRefused", "HandshakeState", "Handshakes", "Pin", "identity", "step"]

PENDING, READY, FAILED = "pending", "ready", "failed"
#: What happens to a handshake: ``start`` (a request names it), ``retry`` (``start`` of a
#: failed one past ``retry_after_s``), ``done`` / ``error`` (its job ended), ``forget`` (its
#: peer closed, a post or read with it failed: its engine may have restarted).
START, RETRY, DONE, ERROR, FORGET = "start", "retry", "done", "error", "forget"
#: ``(kind or None: unknown, event) -> next kind`` (None: unknown again, the next start
#: connects afresh). A pair not listed leaves the state as it is (a start of a pending or
#: ready handshake, a job's end after its handshake was forgotten).
TRANSITIONS: dict[tuple[str | None, str], str | None] = {
    (None, START): PENDING,
    (FAILED, RETRY): PENDING,
    (PENDING, DONE): READY,
    (PENDING, ERROR): FAILED,
    (PENDING, FORGET): None,
    (READY, FORGET): None,
    (FAILED, FORGET): None,
}


def step(kind: str | None, event: str) -> str | None:
    """The kind a handshake of ``kind`` (None: unknown) moves to on ``event``
    (:data:`TRANSITIONS`; unchanged for a pair it does not list)."""
    return TRANSITIONS.get((kind, event), kind)


class AddressConflict(ParamsError):
    """A request names an engine id at another address than the one that engine was connected
    at (``pinned``), and the engine's metadata is not signed: its identity is its address, so
    the request is refused without dialling (restarting a prefill at the *same* address is
    not a conflict: it is connected afresh). ``engine``, ``address`` (the request's
    ``host:port``) and ``pinned`` say which."""

    def __init__(self, engine: str, address: str, pinned: str) -> None:
        self.engine, self.address, self.pinned = engine, address, pinned
        super().__init__("remote_engine_id", engine,
                         f"that engine is connected at {pinned}, this request names it at "
                         f"{address}: an unsigned peer's engine id is bound to the address it "
                         "was first connected at (a prefill moved elsewhere needs a new "
                         "engine_id, or the decode a restart); nothing was dialled")


class AddressRefused(ParamsError):
    """A request names a prefill address (``address``, ``host:port``) that the decode's
    configuration does not allow (``admit`` refused it, e.g. not in ``stock_prefills``:
    ``why``); nothing was dialled."""

    def __init__(self, engine: str, address: str, why: str) -> None:
        self.engine, self.address = engine, address
        super().__init__("remote_host", address, f"engine {engine!r}: {why}; nothing was "
                         "dialled")


@dataclass(frozen=True)
class Pin:
    """Where an engine id is bound (``pin``): ``host``, ``port``; ``held`` once a handshake
    there completed (kept for the decode's life), else only claimed by the handshake in
    progress (released if it fails)."""

    host: str
    port: int
    held: bool = False

    @property
    def address(self) -> str:
        """``host:port``."""
        return f"{self.host}:{self.port}"
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


def identity(secret: bytes | str | None,
             check: Callable[[md.PeerInfo], None] | None = None) -> Identify:
    """An ``identify`` that decodes the blob (its signature checked under ``secret``) and
    returns the engine and rank it advertises; ``check`` may refuse the peer first (raising:
    KvplanConnector's vLLM versions), before anything of it is connected."""
    def identify(blob: bytes) -> tuple[str, int]:
        info = md.decode(blob, secret)
        if check is not None:
            check(info)
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
    ``pin``: bind each engine id to the address first connected (see the module docstring).
    ``admit(engine, host, port)``: why that address may not be dialled, or None (it may).
    """

    def __init__(self, connect: Connect, *, lock: threading.Lock | FairLock, identify: Identify,
                 timeout: float = 5.0, workers: int = 32, per_host: int = 8,
                 queued: int = 64, retry_after_s: float = 5.0, attempts: int = 2,
                 warn: Callable[[str], None] | None = None,
                 fetch: Callable[..., bytes] = fetch_metadata,
                 clock: Callable[[], float] = time.monotonic, pin: bool = False,
                 admit: Callable[[str, str, int], str | None] | None = None) -> None:
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
        self.pin, self._admit = pin, admit
        self._pins: dict[str, Pin] = {}  # engine -> where it is bound (with pin)

    def start(self, engine: str, host: str, port: int, *, first: int = 0,
              address: Address | None = None) -> HandshakeState:
        """Start connecting ``engine`` through the side channels at ``host``, ``port`` + rank
        (``address``: another rank -> (host, port, identity) mapping, for tests), rank
        ``first`` then the ranks ``connect`` names, unless that handshake is pending, ready,
        or failed less than ``retry_after_s`` ago; returns its state. Never blocks on the
        network. A handshake the pool cannot take now fails without being recorded.

        Raises :class:`AddressRefused` (``admit`` refused the address) and
        :class:`AddressConflict` (with ``pin``: the engine is bound to another address),
        before anything is dialled or recorded."""
        if self._stop.is_set():
            raise ClosedError("Handshakes is closed")
        key = (engine, host, port)
        where = (host, port)
        if self._admit is not None:
            why = self._admit(engine, host, port)
            if why is not None:
                raise AddressRefused(engine, f"{host}:{port}", why)
        if address is None:
            def address(r: int) -> tuple[str, int, str]:
                return host, port + r, server_identity(engine, r)
        with self._mu:
            self._check_pin(engine, host, port)
            s = self._states.get(key)
            now = self._clock()
            event = START if s is None else RETRY if (
                s.failed and now - s.since >= self.retry_after_s) else None
            if event is None or step(s and s.kind, event) != PENDING:
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
        :meth:`start` connects afresh); a job in flight for it changes nothing any more. The
        engine's pin stays: a restart at its address is connected afresh, another address is
        still a conflict."""
        with self._mu:
            for key in [k for k in self._states if k[0] == engine]:
                if step(self._states[key].kind, FORGET) is None:
                    del self._states[key]
                    self._epochs.pop(key, None)

    def drop_failed(self, engine: str, host: str, port: int) -> bool:
        """Drop the handshake with ``engine`` at ``host``, ``port`` if it failed, so that the
        next :meth:`start` connects afresh at once, not after ``retry_after_s``: for a caller
        whose next start asks for something else than the failed one did (a stock prefill's
        handshake for another claimed TP size). True if one was dropped."""
        key = (engine, host, port)
        with self._mu:
            s = self._states.get(key)
            if s is None or not s.failed:
                return False
            del self._states[key]
            self._epochs.pop(key, None)
            return True

    def pinned(self, engine: str) -> Pin | None:
        """Where ``engine`` is bound (with ``pin``), or None."""
        with self._mu:
            return self._pins.get(engine)

    def _check_pin(self, engine: str, host: str, port: int) -> None:
        """With ``pin``, refuse ``engine`` at another address than its pin's (under _mu)."""
        p = self._pins.get(engine) if self.pin else None
        if p is not None and (p.host, p.port) != (host, port):
            raise AddressConflict(engine, f"{host}:{port}", p.address)

    def _claim(self, key: Key) -> None:
        """Bind the key's engine to its address before its first rank is connected (with
        ``pin``; under _mu): refused if bound elsewhere meanwhile, or too many are bound."""
        engine, host, port = key
        self._check_pin(engine, host, port)
        if self.pin and engine not in self._pins:
            if len(self._pins) >= MAX_STATES:
                raise MetadataError(f"{MAX_STATES} engines are bound to addresses; engine "
                                    f"{engine!r} is refused")
            self._pins[engine] = Pin(host, port)

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
                    with self._mu:
                        if self._epochs.get(key) != epoch:
                            return
                        self._claim(key)
                    more = self._connect(engine, rank, blob)
                done.append(rank)
                todo += [r for r in (more or ()) if r not in done and r not in todo]
        except Exception as e:  # any failure is this handshake's alone: recorded, never raised
            self._set(key, epoch, ERROR, HandshakeState(
                FAILED, f"rank {rank}: {type(e).__name__}: {e}", self._clock(), tuple(done)))
            return
        self._set(key, epoch, DONE, HandshakeState(READY, None, self._clock(), tuple(done)))

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

    def _set(self, key: Key, epoch: int, event: str, s: HandshakeState) -> None:
        """The job of ``epoch`` ended with ``event`` (DONE or ERROR): its state ``s``, if the
        transition applies and the key is still the job's; then the engine's pin is held (DONE,
        with ``pin``). Otherwise (failed, or forgotten meanwhile) a claim it made is released,
        unless a newer job for the key runs."""
        engine, host, port = key
        with self._mu:
            cur = self._states.get(key)
            live = self._epochs.get(key) == epoch and cur is not None \
                and step(cur.kind, event) == s.kind
            if live:
                self._states[key] = s
            if live and event == DONE:  # one port serves one engine: another id's handshake
                # there is an earlier incarnation's (kept, it would fill MAX_STATES for good)
                for k in [k for k in self._states if k[1:] == key[1:] and k[0] != engine]:
                    del self._states[k]
                    self._epochs.pop(k, None)
            pin = self._pins.get(engine)
            if live and event == DONE and self.pin:
                self._pins[engine] = Pin(host, port, held=True)
                # the address now serves this engine (its fetched metadata said so): an engine
                # id held there before is gone (a restart in place under a new id, vLLM's
                # default), and its pin would only fill the table (MAX_STATES), for good
                for e in [e for e, p in self._pins.items()
                          if e != engine and (p.host, p.port) == (host, port) and p.held]:
                    del self._pins[e]
            elif pin is not None and not pin.held and (pin.host, pin.port) == (host, port) \
                    and self._epochs.get(key) in (None, epoch):
                del self._pins[engine]
