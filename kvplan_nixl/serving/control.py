"""The two sides of the hold protocol in ``KvplanConnector`` (docs/vllm.md, "Never serving
freed KV"): :class:`Sends`, a prefill rank's hold table and the side channel server that
answers from it; :class:`Control`, a decode rank's RENEW / LEASE / CONFIRM / RETURN / RELEASE
messages, sent on
bounded pools of threads so that none runs on the engine step, and CONFIRM / RENEW never wait
behind a RELEASE (the class docstring says why).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvplan_nixl.errors import ArgumentError, ExecutorError
from kvplan_nixl.serving import sidechannel as sc
from kvplan_nixl.serving.holds import Holds, Verdict
from kvplan_nixl.serving.host_pools import HostPool
from kvplan_nixl.serving.locks import FairLock

if TYPE_CHECKING:
    from kvplan_nixl.serving.loads import Load

logger = logging.getLogger(__name__)

#: Side channel server counters that are dropped messages (``num_side_channel_dropped``).
DROPPED = ("malformed", "unsigned", "forged", "replayed", "oversized")
#: CONFIRM / RENEW jobs waiting at most (beyond, asked again at the next poll).
URGENT_QUEUE = 1024
#: RELEASE jobs waiting at most (beyond, dropped: the prefill's lease frees the blocks).
RELEASE_QUEUE = 1024
#: Threads sending RELEASE messages.
RELEASE_WORKERS = 8
#: What :meth:`Control.lease` answers for a prefill that does not know LEASE (an older
#: kvplan: its side channel answers an unknown verb ``ERR malformed``).
UNKNOWN_VERB = "the prefill rank does not know LEASE (an older kvplan)"


class Sends:
    """A prefill rank's holds: one per finished request, under its scheduler's generation,
    answered on the side channel (``server``); :meth:`finished` hands out only requests whose
    hold ended, so vLLM frees no block a decode may still be confirming."""

    def __init__(self, host: str, port: int, identity: str, metadata: bytes, *,
                 secret: str | None, lease: float) -> None:
        self.lease = lease
        # the table's: the server's thread answers from it (fair: a step never makes a
        # CONFIRM's answer wait behind its own repeated holds)
        self.lock = FairLock()
        self.holds = Holds(floor=time.time_ns())  # an old instance's generations: NO at once
        self.unheld: set[str] = set()  # whose hold could not be made: freed at once
        # a taken port raises PortInUseError, naming it and the config key to change
        self.server = sc.SideChannelServer(host, port, identity, metadata=metadata,
                                           secret=secret, holds=self.holds, lock=self.lock)

    def hold(self, sends: Iterable[tuple[str, int]]) -> None:
        """Hold each ``(request, generation)`` for the lease, from now."""
        now = time.monotonic()
        with self.lock:
            for req, gen in sends:
                try:
                    self.holds.hold(req, now, self.lease, gen)
                except ArgumentError as e:  # never held: no CONFIRM can succeed
                    logger.error("kvplan: prefill req=%s cannot be held (%s); its blocks are "
                                 "freed now and its decode will recompute", req, e)
                    self.unheld.add(req)

    def release(self, req: str, generation: int) -> None:
        """End ``req``'s hold under ``generation`` here (its push ended)."""
        with self.lock:
            self.holds.release(req, generation)

    def finished(self) -> tuple[set[str], dict[str, int]]:
        """Requests whose hold ended since the last call (their blocks may be freed now), and
        the cumulative counters: the table's and ``dropped`` (side channel messages)."""
        now = time.monotonic()
        with self.lock:
            expired = self.holds.expire(now)
            done = set(self.holds.finished(now)) | self.unheld
            counts = dict(self.holds.counts)
        self.unheld = set()
        for r in expired:
            logger.warning("kvplan: prefill req=%s lease of %g s ran out", r, self.lease)
        for r in done.difference(expired):
            logger.info("kvplan: prefill req=%s released", r)
        counts["dropped"] = sum(self.server.stats[k] for k in DROPPED)
        return done, counts

    def close(self) -> None:
        self.server.close()


class Control:
    """A decode rank's control messages to prefill ranks, each bounded by ``timeout``, on two
    pools of their own (:class:`~kvplan_nixl.serving.host_pools.HostPool`; a slow or dead
    prefill costs a pool thread, never the step).

    The address of each message is the request's ``remote_host`` / ``remote_port``, which
    its HTTP client chose, so the pools are split by what waits on them: CONFIRM and RENEW
    (:meth:`submit`; a pull is reported only after its CONFIRM) run on ``workers`` threads
    that RELEASE never takes, so no RELEASE to a silent host, however many, delays them.
    RELEASE (:meth:`release`) is one job per prefill rank on a small pool of its own, at most
    :data:`RELEASE_QUEUE` waiting (an eighth of them for one host) and each (address,
    request, generation) once; one that does not fit is dropped with a warning: nothing
    waits on it, and the prefill's lease frees the blocks it would have freed. Both pools
    serve hosts in turn, a few threads per host, so messages to one host never queue behind
    those to another.
    """

    def __init__(self, secret: str | None, timeout: float, workers: int = 16) -> None:
        self.secret, self.timeout = secret, timeout
        # a quarter per host: a host that answers nothing holds up no other host's CONFIRMs
        self.urgent = HostPool("kvplan-ctl", workers=workers, per_host=max(1, workers // 4),
                            per_address=max(1, workers // 4), queued=URGENT_QUEUE,
                            queued_per_host=URGENT_QUEUE // 4)
        self.releases = HostPool("kvplan-release", workers=RELEASE_WORKERS, per_host=2,
                              per_address=1, queued=RELEASE_QUEUE,
                              queued_per_host=RELEASE_QUEUE // 8)
        # connections opened ahead of a LEASE: the next request's is one send from the
        # posting thread and one answer (sidechannel.Spares)
        self.spares = sc.Spares()

    def submit(self, load: Load, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` (a CONFIRM or RENEW of ``load``) on the pool; False when the
        pool refused it (full or closed): the caller asks again later."""
        return self.urgent.submit((load.host, load.port), lambda: fn(*args))

    def send(self, load: Load, rank: int, verb: str, readers: int = 0) -> Verdict | str:
        """One message to prefill rank ``rank`` of ``load`` (blocking, in a pool thread); its
        verdict, or why it failed (a CONFIRM's LATER is asked again until the timeout)."""
        kw = dict(identity=sc.server_identity(load.engine, rank), secret=self.secret,
                  timeout=self.timeout)
        try:
            if verb in ("CONFIRM", "RETURN"):  # RETURN: a leasing reader's, returns its pin
                ok = sc.confirm(load.host, load.port + rank, load.remote_req, load.generation,
                                readers=readers, leased=verb == "RETURN", **kw)
                return Verdict.YES if ok else Verdict.NO
            return sc.control(load.host, load.port + rank, verb, load.remote_req,
                              load.generation, **kw)
        except (ExecutorError, OSError) as e:
            return f"{type(e).__name__}: {e}"

    def send_lease(self, load: Load, rank: int, pin: float) -> sc.SentLease | None:
        """Send ``load``'s LEASE to prefill rank ``rank`` now, from the calling thread, on
        a spare connection opened after the last message to that rank (:meth:`lease` reads
        the answer); None when there is no young spare, or it failed (:meth:`lease` then
        sends it as usual)."""
        identity = sc.server_identity(load.engine, rank)
        spare = self.spares.take(load.host, load.port + rank, identity)
        if spare is None:
            return None
        try:
            return sc.send_lease(*spare, load.remote_req, load.generation, pin,
                                 identity=identity, secret=self.secret)
        except (ExecutorError, OSError):
            return None

    def lease(self, load: Load, rank: int, pin: float, first: sc.SentLease | None = None
              ) -> tuple[Verdict | str, float]:
        """LEASE ``load`` on prefill rank ``rank`` for ``pin`` seconds (blocking, in a pool
        thread), or read the answer of the one :meth:`send_lease` sent (``first``): its
        verdict, or why it failed (:data:`UNKNOWN_VERB` for a prefill that lacks LEASE), and
        the ``time.monotonic()`` taken just before the answered message was sent (the pin runs
        from after it)."""
        kw = dict(identity=sc.server_identity(load.engine, rank), secret=self.secret,
                  timeout=self.timeout)
        try:
            return sc.lease(load.host, load.port + rank, load.remote_req, load.generation,
                            pin, first=first, **kw)
        except sc.SideChannelRejected as e:
            return (UNKNOWN_VERB if e.reason == "malformed" else f"{type(e).__name__}: {e}",
                    0.0)
        except (ExecutorError, OSError) as e:
            return f"{type(e).__name__}: {e}", 0.0

    def spare(self, load: Load, ranks: Iterable[int]) -> None:
        """Open a spare connection to each of ``load``'s prefill ranks ``ranks`` (blocking,
        in a pool thread, after the LEASE answers were handed on): the next request's LEASE
        to them is then one send and one answer (:meth:`send_lease`)."""
        for r in ranks:
            try:
                self.spares.fill(load.host, load.port + r, sc.server_identity(load.engine, r),
                                 self.timeout)
            except (ExecutorError, OSError) as e:  # the next LEASE opens its own
                logger.debug("kvplan: no spare connection to prefill rank %d of %s: %s", r,
                             load.engine, e)

    def release(self, load: Load, ranks: Iterable[int]) -> None:
        """End ``load``'s holds on ``ranks`` (nobody reads them, or the pull failed): one
        RELEASE job per rank, deduplicated; those the pool cannot take are dropped."""
        for r in ranks:
            where = (load.host, load.port + r)
            if not self.releases.submit(where, lambda r=r: self._release(load, r),
                                        key=(*where, load.remote_req, load.generation)):
                logger.warning("kvplan: the RELEASE queue is full (%d waiting, at most %d for "
                               "host %s); req=%s is not released on prefill rank %d and after "
                               "(their lease frees the blocks)", self.releases.waiting,
                               self.releases.queued_per_host, load.host, load.remote_req, r)
                return

    def _release(self, load: Load, rank: int) -> None:
        v = self.send(load, rank, "RELEASE")
        if isinstance(v, str):  # the prefill's lease frees the blocks anyway
            logger.warning("kvplan: could not release req=%s on prefill rank %d: %s",
                           load.remote_req, rank, v)

    def close(self) -> None:
        """Wait for the messages in flight (each bounded by the timeout); drop queued ones."""
        self.urgent.close()
        self.releases.close()
        self.spares.close()
