"""The transfer digest of a pull in ``KvplanConnector`` (``kv_connector_extra_config["digest"]``;
docs/vllm.md, "Transfer digest"): both sides, the words in :mod:`kvplan_nixl.serving.pull_digests`.

- Decode (:func:`ask`, :func:`check`, called by :class:`kvplan_nixl.serving.pulls.Pulls`): once
  a read completed, each prefill rank it read is asked (``DIGASK``) for the digest of what this
  rank read from it; the CONFIRM waits until every answer came (or ``transfer_timeout_s``), and
  a missing, refused, malformed or different digest fails the request into
  ``kv_load_failure_policy`` before its first token, never CONFIRMed as used.
- Prefill (:class:`Answers`): keeps its own handed lists of each pull send it holds (the
  scheduler sends them with the digest on), connects the asking decode in push mode (the
  push's verified handshakes, :attr:`kvplan_nixl.serving.push_io.Writes.hs`), plans the request
  with its push map from its lists and the decode's blocks, digests its side while the hold is
  live (checked before and after), and answers ``DIGEST``. A prefill with the digest off
  answers that it is off, so the decode fails by name instead of at its timeout.

Both are called under the worker's lock from its progress loop, and no call here waits on the
network; the digests themselves run on a thread of their own (``kvplan-digest``, one per rank
and side), outside that lock, so neither the engine step nor the rank's other transfers wait
for them.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvplan import KVPlanError
from kvplan_nixl.digest import Digest
from kvplan_nixl.notifications import Notification
from kvplan_nixl.serving.holds import Verdict
from kvplan_nixl.serving.pull_digests import DIGASK, DigestAsk, digest_answer
from kvplan_nixl.serving.spans import span

if TYPE_CHECKING:
    from kvplan import TransferPlan
    from kvplan_nixl.serving.handshakes import Handshakes
    from kvplan_nixl.serving.pull_state import Pull
    from kvplan_nixl.serving.pushes import PushSend
    from kvplan_nixl.serving.rank import Rank

logger = logging.getLogger(__name__)

#: Questions a prefill rank keeps waiting for their decode's handshake at most (beyond,
#: dropped with a warning: that decode fails the request at its timeout).
MAX_ASKS = 4096

#: Why a prefill with the digest off answers no digest.
OFF = ("the transfer digest is off at this prefill (kv_connector_extra_config['digest'] must "
       "be true on both engines)")


def ask(w: Rank, p: Pull) -> None:
    """Ask each prefill rank ``p`` read for its digest of what it read (a completed read)."""
    load = p.load
    if load.generation <= 0:  # params without a hold: nothing the prefill could vouch for
        raise ValueError(f"the params of req={load.req_id} name no hold generation "
                         "(remote_generation)")
    msg = DigestAsk(req=load.remote_req, generation=load.generation, decode_req=load.req_id,
                    host=w.c.host, port=w.c.rank_port(0),
                    lists=tuple(tuple(map(int, g)) for g in load.local_ids),  # no loop in Python
                    start=load.start, end=load.end).encode()
    w.ep.notify(load.engine, p.peers, msg)


def received(w: Rank, p: Pull) -> tuple[dict[int, Digest] | str, float]:
    """This rank's digests of what ``p`` read from each prefill rank (or why they could not be
    made), and the seconds they took (on the digest thread: reads memory, takes no lock)."""
    t0 = time.perf_counter()
    try:
        got: dict[int, Digest] | str = w.digester.digests(p.t.plan, "dst")
    except Exception as e:  # never lost: the check says why
        got = f"{type(e).__name__}: {e}"
    return got, time.perf_counter() - t0


def check(w: Rank, p: Pull, got: Mapping[int, tuple[Digest | None, str]]) -> str | None:
    """None when every prefill rank ``p`` read answered a digest equal to what this rank
    received from it (``got``: each rank's answer; ``p.received``: the finished future of
    :func:`received`), else why not, naming the ranks."""
    reasons = {r: "no digest within transfer_timeout_s (is kv_connector_extra_config"
                  f"['digest'] on at {p.load.engine}?)" for r in p.peers if r not in got}
    reasons.update({r: why for r, (d, why) in got.items() if d is None})
    if reasons:
        return f"transfer digest: prefill rank(s) {reasons}"
    mine, secs = p.received.result()
    if isinstance(mine, str):
        return f"transfer digest: this rank's digest: {mine}"
    try:
        w.digester.verify(p.t.plan, {r: d for r, (d, _) in got.items()}, mine)
    except (KVPlanError, ValueError) as e:  # DigestMismatch names every rank that differs
        return f"transfer digest: {type(e).__name__}: {e}"
    logger.info("kvplan: pull req=%s rank=%d digest verified: %d bytes from prefill rank(s) %s "
                "(its own digest %.4f s, answers %.4f s after the read)", p.load.req_id, w.rank,
                p.t.plan.nbytes, list(p.peers), secs, time.monotonic() - p.seen_done)
    return None


@dataclass
class _Asked:
    engine: str
    rank: int  # the asking decode rank
    ask: DigestAsk
    until: float  # monotonic: not answered by then (decode not connected), dropped


class Answers:
    """A prefill rank's answers to pull digest questions (see the module docstring). ``hs``
    connects decode engines in push mode (the push's :class:`Handshakes`). The plan is made
    under the worker's lock (milliseconds), the digest on a thread of its own (``kvplan-digest``:
    the engine step never waits for it), the answer sent at the next progress."""

    def __init__(self, w: Rank, hs: Handshakes) -> None:
        self.w, self.hs = w, hs
        self.sources: dict[str, PushSend] = {}  # held pull sends: this rank's handed lists
        self.asked: list[_Asked] = []
        self.busy = 0  # questions on the digest thread (bounded with the waiting ones)
        self.done: collections.deque[tuple[_Asked, Digest | None, str]] = collections.deque()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kvplan-digest")

    def add(self, sends: Iterable[PushSend]) -> None:
        """Pull sends this rank holds now, with the lists it handed (the scheduler's)."""
        for s in sends:
            self.sources[s.req_id] = s

    def forget(self, reqs: Iterable[str]) -> None:
        """Their holds ended: nothing of them is answered any more."""
        for r in reqs:
            self.sources.pop(r, None)

    def notice(self, n: Notification, now: float) -> bool:
        """Take a ``DIGASK`` (a malformed one is dropped and logged); False for any other."""
        if not n.message.startswith(DIGASK):
            return False
        try:
            a = DigestAsk.decode(n.message)
        except ValueError as e:  # its decode fails the request at its timeout
            logger.warning("kvplan: dropped a pull digest question from %s rank %d: %s",
                           n.engine, n.rank, e)
            return True
        if len(self.asked) + self.busy >= MAX_ASKS:  # bounded: that decode fails at its timeout
            logger.warning("kvplan: dropped a pull digest question of %s req=%s from rank "
                           "%d: %d questions wait already", n.engine, a.decode_req, n.rank,
                           MAX_ASKS)
            return True
        self.asked.append(_Asked(n.engine, n.rank, a, now + 2 * self.w.hs_timeout))
        if self.hs.state(n.engine, a.host, a.port) is None:
            self.hs.start(n.engine, a.host, a.port)
        return True

    def progress(self, now: float) -> None:
        """Send the digests made; plan the questions whose decode is connected (push mode)."""
        while self.done:
            self.busy -= 1
            self._answer(*self.done.popleft())
        for q in list(self.asked):
            st = self.hs.state(q.engine, q.ask.host, q.ask.port) \
                or self.hs.start(q.engine, q.ask.host, q.ask.port)
            if st.pending and now < q.until:
                continue
            self.asked.remove(q)
            if not st.ready:
                logger.error("kvplan: pull digest of req=%s for %s req=%s rank %d not "
                             "answered: %s", q.ask.req, q.engine, q.ask.decode_req, q.rank,
                             st.reason if st.failed else "decode not connected in time")
                continue
            plan = self._plan(q)
            if isinstance(plan, str):
                self._answer(q, None, plan)
                continue
            self.busy += 1
            try:
                self.pool.submit(self._digest, q, plan)
            except RuntimeError:  # shut down: nobody answers (the decode's timeout)
                self.busy -= 1

    def _answer(self, q: _Asked, digest: Digest | None, why: str) -> None:
        try:
            self.w.ep.notify(q.engine, [q.rank], digest_answer(q.ask.decode_req, digest, why))
        except Exception as e:  # gone: its timeout fails the request
            logger.warning("kvplan: could not answer the pull digest of %s req=%s: %s",
                           q.engine, q.ask.decode_req, e)

    def _live(self, a: DigestAsk) -> bool:
        sends = self.w.sends
        with sends.lock:
            return sends.holds.verdict(a.req, a.generation, time.monotonic()) is Verdict.YES

    def _plan(self, q: _Asked) -> TransferPlan | str:
        """The plan of what decode rank ``q.rank`` read, made here from this rank's own lists
        (under the worker's lock), or why there is none."""
        w, a = self.w, q.ask
        s = self.sources.get(a.req)
        if w.digester is None:
            return OFF
        if s is None or s.generation != a.generation or not self._live(a):
            return (f"prefill req={a.req} is not held here under generation {a.generation} "
                    "(released, expired or another request)")
        try:
            tmap = w.ep.map(q.engine, "push")
            src = w.groups.remote([list(g) for g in s.ids], list(s.first))
            dst = w.groups.local([list(g) for g in a.lists])
            start, end = span(w.groups, w.whole, a.start, a.end, src, dst)
            return tmap.plan(src, dst, tokens=(start, end))
        except (KVPlanError, ValueError, TypeError, KeyError) as e:  # lists it cannot plan
            return f"{type(e).__name__}: {e}"

    def _digest(self, q: _Asked, plan: TransferPlan) -> None:
        """On the digest thread: this rank's digest of ``plan``'s bytes to ``q.rank``, queued
        for :meth:`progress` to send (or why there is none)."""
        a, t0 = q.ask, time.perf_counter()
        try:
            d = self.w.digester.digests(plan, "src").get(q.rank, Digest(0, 0, 0))
            # the bytes digested were held throughout: the hold was live before and after
            why = "" if self._live(a) else f"prefill req={a.req}'s hold ended while digested"
        except Exception as e:  # never lost: the decode learns why
            d, why = None, f"{type(e).__name__}: {e}"
        if why:
            d = None
        else:
            logger.info("kvplan: pull req=%s digest of %d bytes for %s req=%s rank %d in "
                        "%.4f s", a.req, d.nbytes, q.engine, a.decode_req, q.rank,
                        time.perf_counter() - t0)
        self.done.append((q, d, why))

    def close(self) -> None:
        """Stop the digest thread (a digest running ends first; queued ones are dropped)."""
        self.pool.shutdown(wait=True, cancel_futures=True)
