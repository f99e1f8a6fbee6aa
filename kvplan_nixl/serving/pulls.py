"""Pull mode of ``KvplanConnector`` on one decode rank: post a request's read, renew the
prefill's holds while it is in flight, confirm it before it is reported (docs/vllm.md, "Never
serving freed KV").

Each pull is one kvplan plan over every KV-cache group: the prefill's handed lists and the
decode's own blocks become kvplan lists (:class:`kvplan.adapters.vllm.TransferGroups`: null
blocks absent, a state group's running slot), ``tokens=(held, end)`` bounds the token
groups, and state slots move whole. A read that completed is reported only once the prefill
ranks it read proved they held its blocks throughout: by a LEASE each answered yes before the
read was seen complete, within the lease's margin (reported at once; its CONFIRM, sent as a
RETURN, follows off the critical path), else by every CONFIRM answered yes (docs/vllm.md,
"Reporting inside a lease"). LEASE, RENEW, CONFIRM and RETURN run on the rank's
:class:`kvplan_nixl.serving.control.Control` pool, never on the engine step. With the transfer
digest on, the report waits for each prefill rank's digest of what it read, and no CONFIRM is
sent for a read that does not match (:mod:`kvplan_nixl.serving.pull_digest_io`).

A prefill running vLLM's own NixlConnector (``load.peer is Peer.NIXL``) speaks its own protocol
instead, over NIXL notifications (``pull_worker.py``): no RENEW, CONFIRM or RELEASE; while the
read is in flight ``HB:<its request id>`` every ``kv_lease_duration / 6`` (NixlConnector's key
and interval; before, while queued, the scheduler's ``KvplanMetadata.beats``) extends its
lease, and once
the read ended (done or failed) each prefill rank read is told ``<its request id>:<n>``, ``n``
the decode ranks that read it (it frees its blocks after ``n`` of them); decode rank 0 tells
the ranks nobody reads ``<id>:1`` as soon as it posted; a read refused before it was posted
(its plan or post raised) is told the same (:func:`tell_unposted`). The read is used without a
CONFIRM
(counted ``num_unconfirmed_pulls``): such a prefill keeps its blocks until told, or until its
own timeout, with nothing that says which came first.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvplan_nixl.serving import pull_digest_io
from kvplan_nixl.serving.control import UNKNOWN_VERB
from kvplan_nixl.serving.holds import Verdict
from kvplan_nixl.serving.pull_digests import parse_answer
from kvplan_nixl.serving.pull_state import ASKING, Lease, LeaseSlot, LeaseState, Pull
from kvplan_nixl.serving.spans import lacking, span
from kvplan_nixl.serving.transfer_params import Peer

if TYPE_CHECKING:
    from kvplan_nixl.notifications import Notification
    from kvplan_nixl.serving.loads import Load
    from kvplan_nixl.serving.rank import Rank
    from kvplan_nixl.serving.sidechannel import SentLease

logger = logging.getLogger(__name__)

#: How far the two hosts' monotonic clocks may differ in rate (NTP slews a clock by at most
#: 500 ppm): the pin a prefill grants for ``pin`` of its seconds lasts at least
#: ``pin * (1 - RHO)`` of this rank's.
RHO = 1e-3
#: A prefill that answered LEASE as an unknown verb is not asked again for this long (s):
#: an older kvplan, or one upgraded in place, is probed once a minute, not every request.
LEASE_RETRY_S = 60.0


class Pulls:
    """A decode rank's pulls in flight (see the module docstring)."""

    def __init__(self, rank: Rank) -> None:
        self.w = rank
        self.inflight: dict[str, Pull] = {}
        self.pool: ThreadPoolExecutor | None = None  # the digests of reads (made when needed)
        # prefill engines that lack LEASE -> when to ask again (one entry per engine read)
        self.no_lease: dict[str, float] = {}
        self.unreturned: list[Pull] = []  # reported inside a lease, RETURN not queued yet

    def post(self, load: Load, tmap: Any, counts: list[int]) -> None:
        """Plan ``load`` with the pull map ``tmap`` of its connected prefill and post it."""
        w = self.w
        started = time.monotonic()
        try:
            src = w.groups.remote(load.remote_ids, load.remote_first)
            dst = w.groups.local(load.local_ids)
            # the LEASEs leave before the read is planned and posted: their round trips
            # overlap both (a job that outlives a refused post only pins the hold a while)
            lease = self._ask_lease(load, tuple(tmap.peers), started)
            start, end = span(w.groups, w.whole, load.start, load.end, src, dst)
            plan = tmap.plan(src, dst, tokens=(start, end))
            t0 = time.perf_counter()
            t = w.ep.read(plan, load.engine, timeout=w.timeout)
        except Exception:  # refused before anything was posted: the caller fails the load
            if load.peer is Peer.NIXL:
                tell_unposted(w, load, tmap.peers, counts)
            raise
        post_s = time.perf_counter() - t0
        posted = time.monotonic()
        written = lacking(w.groups, dst, start, end)
        blocks = max((len(x) for x, k in zip(written, w.groups.kinds) if k != "state"),
                     default=0)
        logger.info("kvplan: pull req=%s remote=%s rank=%d blocks=%d tokens=[%d,%d) bytes=%d "
                    "runs=%d peers=%s prompt=%d groups=%s", load.req_id, load.remote_req,
                    w.rank, blocks, start, end, plan.nbytes, len(plan), list(tmap.peers),
                    load.end, "+".join(w.groups.kinds))
        unread = [p for p, n in enumerate(counts) if n == 0]
        if w.rank == 0 and unread and load.peer is Peer.NIXL:  # nobody reads them: free them now
            _tell(w, load, unread, f"{load.remote_req}:1")
        elif w.rank == 0 and unread:  # prefill ranks nobody reads: release them now
            w.ctl.release(load, unread)
        # a pull shorter than heartbeat_s (the usual one) sends no RENEW at all; a
        # NixlConnector prefill's is beaten at once (its queued beats stopped at scheduling)
        beat = time.monotonic() + (0.0 if load.peer is Peer.NIXL else w.heartbeat)
        self.inflight[load.req_id] = Pull(
            load, t, counts, tuple(tmap.peers), post_s, len(plan), sum(t.runs().values()), beat,
            admitted=w.admitted.get(load.req_id, started), started=started, posted=posted,
            lease=lease)

    def _ask_lease(self, load: Load, peers: tuple[int, ...], now: float) -> LeaseSlot:
        """Send ``load``'s LEASE to each prefill rank in ``peers`` on the pool (a kvplan
        prefill, leases on, not known to lack LEASE); the slot its answers fill."""
        w = self.w
        slot = LeaseSlot()
        if load.peer is not Peer.KVPLAN or not w.lease_pin or not peers \
                or self.no_lease.get(load.engine, 0.0) > now:
            return slot
        slot.value = ASKING
        # sent from here where a spare connection is open (one send): the pool thread then
        # only reads the answers, and its wake-up overlaps their round trip
        first = {r: f for r in peers if (f := w.ctl.send_lease(load, r, w.lease_pin))}
        if not w.ctl.submit(load, ask_leases, w, self.no_lease, slot, load, peers, first):
            for f in first.values():  # the pool is full: no answer will be read
                f.close()
            slot.value = Lease(LeaseState.NONE)
        return slot

    def progress(self, now: float) -> None:
        """Poll the reads in flight: heartbeats while pending; once complete, reported at
        once inside its lease, else after its CONFIRM."""
        w = self.w
        if self.unreturned:  # RETURNs the pool could not take: queued again
            self.unreturned = [p for p in self.unreturned
                               if not w.ctl.submit(p.load, self._return, p)]
        for req_id, p in list(self.inflight.items()):
            if p.confirming:
                continue
            p.t.poll()
            if p.t.done and not p.seen_done:
                # taken after the poll that saw it: the read ended before this time (``now``
                # came before the poll, maybe before the read ended; a lease needs after)
                p.seen_done = time.monotonic()
            if p.load.peer is Peer.NIXL:
                self._nixl(req_id, p, now)
                continue
            if not p.t.done:
                if now >= p.next_beat and not p.beating:
                    p.next_beat, p.beating = now + w.heartbeat, True  # before the job ends it
                    if not w.ctl.submit(p.load, self._renew, p):  # the pool is full
                        p.beating = False  # the next beat tries again
                continue
            if p.t.ok and w.digester is not None and not self._digested(p, now):
                continue  # asked, or waiting for the prefill ranks' digests
            if p.t.ok:  # the read completed: reported inside its lease, or once confirmed
                lease = p.lease.value
                if lease.state is LeaseState.ASKING and now < p.seen_done + w.timeout:
                    continue  # its answers were sent for before the read: they come first
                # (still asking after transfer_timeout_s: a job the closing pool dropped)
                if lease.state is LeaseState.HELD and p.seen_done < lease.until:
                    self._report_leased(p, lease)
                    continue
                p.confirming = True
                if not w.ctl.submit(p.load, self._confirm, p):  # the pool is full
                    p.confirming = False  # asked again at the next poll
            else:
                del self.inflight[req_id]
                w.stats.record("num_failed_transfers")
                # the prefill may have died or restarted in place: connected afresh and read
                # once more if it answers with new agents (kvplan_nixl.serving.restarts), else
                # failed; either way the next request handshakes again
                if not w.restarts.connect_again(p.load, p.t.error(), p.peers):
                    w.fail(p.load, str(p.t.error()), p.peers)

    def _nixl(self, req_id: str, p: Pull, now: float) -> None:
        """A pull from a NixlConnector prefill (module docstring): heartbeats while in flight;
        once it ended, each rank read is told, and the pull reported."""
        w, load = self.w, p.load
        if not p.t.done:
            if now >= p.next_beat:
                p.next_beat = now + w.nixl_heartbeat
                _tell(w, load, p.peers, f"HB:{load.remote_req}")
            return
        del self.inflight[req_id]
        for r in p.peers:  # done or failed: this rank reads them no more
            _tell(w, load, [r], f"{load.remote_req}:{p.counts[r]}")
        if not p.t.ok:
            w.stats.record("num_failed_transfers")
            # it may have restarted in place: forgotten, so that the next request connects
            # afresh; this one fails (a stock prefill confirms nothing: the new instance may
            # not hold its blocks, kvplan_nixl.serving.restarts)
            w.restarts.connect_again(load, p.t.error(), p.peers)
            w.fail(load, str(p.t.error()), p.peers)
            return
        w.recv_done.add(req_id)
        w.reporting[req_id] = (p.admitted, p.started, p.posted, now, now)  # no CONFIRM
        w.stats.record_transfer(p.t.seconds or 0.0, p.post_s, p.t.plan.nbytes, p.runs,
                                p.descriptors)
        w.stats.record("num_unconfirmed_pulls")
        logger.info("kvplan: pull req=%s done in %.4f s from NixlConnector prefill %s rank(s) "
                    "%s, not confirmed (it holds no lease of ours)", req_id,
                    p.t.seconds or 0.0, load.engine, list(p.peers))

    # -- the transfer digest ----------------------------------------------------------------

    def _digested(self, p: Pull, now: float) -> bool:
        """Whether ``p`` (its read complete) may be CONFIRMed: its digests came and match. Asks
        them first; a failed check fails the request (never CONFIRMed: the holds are
        released)."""
        w = self.w
        if p.verified:
            return True
        if not p.asked_until:
            p.asked_until, p.seen_done = now + w.timeout, p.seen_done or now
            try:
                pull_digest_io.ask(w, p)
            except Exception as e:  # cannot ask: never used unchecked
                p.digests = {r: (None, f"not asked: {type(e).__name__}: {e}") for r in p.peers}
            # while the prefill ranks digest their side (the two sides in parallel), on a
            # thread of its own: the engine step never waits for it
            if self.pool is None:
                self.pool = ThreadPoolExecutor(1, thread_name_prefix="kvplan-digest")
            p.received = self.pool.submit(pull_digest_io.received, w, p)
        if (len(p.digests) < len(p.peers) and now < p.asked_until) or not p.received.done():
            return False
        why = pull_digest_io.check(w, p, p.digests)
        if why is None:
            p.verified = True
            return True
        del self.inflight[p.load.req_id]
        w.stats.record("num_failed_transfers")
        w.fail(p.load, why, p.peers)
        return False

    def notice(self, n: Notification, now: float) -> bool:
        """Take a prefill rank's ``DIGEST`` answer (a malformed digest counts as its refusal;
        an answer whose request cannot be read is dropped, and the pull fails when its answers
        are due); False for any other message. Only a rank the pull read answers for it."""
        try:
            parsed = parse_answer(n.message)
        except ValueError as e:
            logger.warning("kvplan: malformed pull digest answer from %s rank %d: %s",
                           n.engine, n.rank, e)
            return True
        if parsed is None:
            return False
        req, digest, why = parsed
        p = self.inflight.get(req)
        if p is None or p.load.engine != n.engine or n.rank not in p.peers \
                or not p.asked_until:
            logger.warning("kvplan: dropped a pull digest answer for req=%s from %s rank %d: "
                           "no such pull asked it", req, n.engine, n.rank)
            return True
        p.digests.setdefault(n.rank, (digest, why))
        return True

    def close(self) -> None:
        """Stop the digest thread (a digest running ends first)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    # -- control messages, on the rank's Control pool ----------------------------------------

    def _renew(self, p: Pull) -> None:
        try:
            for r in p.peers:
                v = self.w.ctl.send(p.load, r, "RENEW")
                if v is not Verdict.YES:  # the CONFIRM will say; logged to explain it early
                    logger.warning("kvplan: heartbeat of req=%s to prefill rank %d: %s",
                                   p.load.req_id, r, getattr(v, "value", v))
        finally:
            p.beating = False

    def _report_leased(self, p: Pull, lease: Lease) -> None:
        """``p``'s read was seen complete inside its lease: reported loaded now (under the
        rank's lock, by the progress loop); its RETURNs follow on the pool."""
        w = self.w
        del self.inflight[p.load.req_id]
        w.recv_done.add(p.load.req_id)
        w.reporting[p.load.req_id] = (p.admitted, p.started, p.posted, p.seen_done,
                                      max(p.seen_done, lease.answered))
        w.stats.record_transfer(p.t.seconds or 0.0, p.post_s, p.t.plan.nbytes, p.runs,
                                p.descriptors)
        w.stats.record("num_leased_pulls")
        logger.info("kvplan: pull req=%s done in %.4f s, inside its lease on prefill rank(s) "
                    "%s (%.1f ms to spare); its RETURN follows", p.load.req_id,
                    p.t.seconds or 0.0, list(p.peers), (lease.until - p.seen_done) * 1e3)
        if not w.ctl.submit(p.load, self._return, p):  # the pool is full: queued again
            self.unreturned.append(p)

    def _return(self, p: Pull) -> None:
        """The CONFIRM of a pull reported inside its lease, as the reader's release (RETURN:
        its pin ends too). Awaited by nothing: a refusal is logged and counted, no more (the
        read was inside the lease; the hold then ends at the pin's or the lease's end)."""
        w = self.w
        granted = p.lease.value.granted
        answers = {r: w.ctl.send(p.load, r, "RETURN" if r in granted else "CONFIRM",
                                 p.counts[r]) for r in p.peers}
        refused = {r: getattr(v, "value", v) for r, v in answers.items()
                   if v is not Verdict.YES}
        if refused:
            logger.warning("kvplan: pull req=%s, reported inside its lease: its RETURN was "
                           "answered %s (the read was covered; the prefill frees the blocks "
                           "at the pin's end)", p.load.req_id, refused)
            with w.lock:
                w.stats.record("num_returns_refused")

    def _confirm(self, p: Pull) -> None:
        w = self.w
        granted = p.lease.value.granted  # ranks that pinned it: RETURN ends their pins too
        try:
            answers = {r: w.ctl.send(p.load, r, "RETURN" if r in granted else "CONFIRM",
                                     p.counts[r]) for r in p.peers}
            refused = {r: getattr(v, "value", v) for r, v in answers.items()
                       if v is not Verdict.YES}
        except Exception as e:  # never leave the pull unreported: not confirmed
            refused = {"?": f"{type(e).__name__}: {e}"}
        confirmed = time.monotonic()
        with w.lock:
            if self.inflight.pop(p.load.req_id, None) is None or w.ep is None \
                    or w.ep.closed:
                return
            if not refused:
                w.recv_done.add(p.load.req_id)
                w.reporting[p.load.req_id] = (p.admitted, p.started, p.posted, p.seen_done,
                                              confirmed)
                w.stats.record_transfer(p.t.seconds or 0.0, p.post_s, p.t.plan.nbytes,
                                        p.runs, p.descriptors)
                logger.info("kvplan: pull req=%s done in %.4f s, confirmed by prefill "
                            "rank(s) %s in %.4f s", p.load.req_id, p.t.seconds or 0.0,
                            list(p.peers), time.monotonic() - p.seen_done)
                return
            w.stats.record("num_failed_transfers")
            w.fail(p.load, f"not confirmed by prefill rank(s) {refused}: the prefill "
                           "may no longer hold the blocks read (its lease ran out or the "
                           "request was released), so the KV read is not used", p.peers)


def tell_unposted(w: Rank, load: Load, peers: tuple[int, ...], counts: list[int]) -> None:
    """A NixlConnector prefill's read that was refused before it was posted (its plan or its
    post raised): tell each prefill rank this rank would have read ``<id>:<n>``, as after a
    read that ended, and on rank 0 the ranks nobody reads ``<id>:1``, so that it frees the
    request's blocks now, not at its lease (``kv_lease_duration``)."""
    for r in peers:
        _tell(w, load, [r], f"{load.remote_req}:{counts[r]}")
    unread = [p for p, n in enumerate(counts) if n == 0]
    if w.rank == 0 and unread:
        _tell(w, load, unread, f"{load.remote_req}:1")


def _tell(w: Rank, load: Load, ranks: list[int] | tuple[int, ...], msg: str) -> None:
    """Send a NixlConnector prefill's ranks ``msg``; a failure is logged, never raised (those
    ranks free the request's blocks at their own timeout)."""
    try:
        w.ep.notify(load.engine, ranks, msg)
    except Exception as e:
        logger.warning("kvplan: could not tell NixlConnector prefill %s rank(s) %s %r: %s: %s",
                       load.engine, list(ranks), msg, type(e).__name__, e)


def ask_leases(w: Rank, no_lease: dict[str, float], slot: LeaseSlot, load: Load,
               peers: tuple[int, ...], sent_first: dict[int, SentLease] | None = None) -> None:
    """Ask each rank in ``peers`` for a LEASE of ``load`` (a pool job of
    :meth:`Pulls.post`; ``sent_first``: the ranks whose LEASE it already sent on a spare
    connection, ``Control.send_lease``, whose answers are read here); fill ``slot`` with what
    they proved: HELD (every one said yes) with the time a read must be seen complete before,
    else REFUSED (the first that did not; the rest are not asked, and LEASEs already sent
    are dropped unread: a pin they got runs out). A prefill that answered LEASE as an
    unknown verb goes in ``no_lease`` (``Pulls.no_lease``) until it is asked again. The ranks
    that granted it then get a spare connection for the next LEASE."""
    granted: list[int] = []
    pending = dict(sent_first or {})
    first = float("inf")  # the earliest send: its pin binds first
    try:
        for r in peers:
            v, sent = w.ctl.lease(load, r, w.lease_pin, pending.pop(r, None))
            if v is not Verdict.YES:
                why = getattr(v, "value", v)
                if v == UNKNOWN_VERB:  # an older kvplan: CONFIRM as before, asked again later
                    with w.lock:
                        no_lease[load.engine] = time.monotonic() + LEASE_RETRY_S
                logger.info("kvplan: pull req=%s not leased by prefill rank %d (%s): reported "
                            "after its CONFIRM", load.req_id, r, why)
                slot.value = Lease(LeaseState.REFUSED, granted=frozenset(granted),
                                   answered=time.monotonic(), why=f"rank {r}: {why}")
                return
            granted.append(r)
            first = min(first, sent)
        # the pin, as sent (whole ms), lasts at least pin * (1 - RHO) of this clock from
        # before the first LEASE left; the margin keeps a read seen complete near its end out
        pin = int(w.lease_pin * 1000) / 1000
        slot.value = Lease(LeaseState.HELD, until=first + pin * (1 - RHO) - w.lease_margin,
                           granted=frozenset(granted), answered=time.monotonic())
    finally:  # whatever went wrong, the pull never waits for a lease nobody asks
        for f in pending.values():
            f.close()
        if slot.value.state is LeaseState.ASKING:
            slot.value = Lease(LeaseState.REFUSED, answered=time.monotonic(),
                               why="the LEASE job failed")
    w.ctl.spare(load, granted)
