"""Push mode of ``KvplanConnector``, both sides of one worker rank (the protocol and its tables:
:mod:`kvplan_nixl.serving.pushes`; docs/vllm.md, "Push mode").

- :class:`Receives`, a decode rank: once its prefill engine is connected, rank 0 sends the
  ``REGISTER`` to every prefill rank; each rank waits for ``PUSHED`` from every prefill rank
  its pull map names (those write it: a push map is the pull map transposed), then reports the
  request's KV loaded. A ``PUSHFAIL`` or no answer within ``push_timeout_s`` plus
  ``handshake_timeout_s`` of grace fails the load (vLLM's ``kv_load_failure_policy``).
- :class:`Writes`, a prefill rank: matches its finished requests with registrations, connects
  the decode engine (push mode, on a :class:`kvplan_nixl.serving.handshakes.Handshakes` of its own),
  plans with the push map and posts one ``Endpoint.write`` whose notification is the
  ``PUSHED``; once the write ends (or no registration came within the lease) the request's
  hold ends, so vLLM frees its blocks. Layer-wise (:class:`Layered`), the request is opened
  before its forward as one ``Endpoint.request``: a part per layer from the layer's hook, the
  rest (state regions) after the forward, one ``PUSHED`` once every part completed.

Both run under the worker's lock, called from its progress loop and step: no call here waits on
the network.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvplan_nixl.errors import DeadlinePassed
from kvplan_nixl.notifications import Notification
from kvplan_nixl.serving import push_digests
from kvplan_nixl.serving.handshakes import Handshakes, identity
from kvplan_nixl.serving.pushes import (
    PUSHED,
    PUSHFAIL,
    REGISTER,
    EarlyAnswers,
    Match,
    Pusher,
    PushSend,
    Registration,
    parse_done,
    push_done,
)
from kvplan_nixl.serving.spans import span

if TYPE_CHECKING:
    from kvplan_nixl.serving.loads import Load
    from kvplan_nixl.serving.rank import Rank

logger = logging.getLogger(__name__)

@dataclass
class Receive:
    """One decode request waiting on this rank for the prefill ranks that write it."""

    load: Load
    expect: frozenset[int]
    deadline: float
    since: float
    got: dict[int, dict[str, Any]] = field(default_factory=dict)


class Receives:
    """A decode rank's pushes to wait for (see the module docstring)."""

    def __init__(self, worker: Rank) -> None:
        self.w = worker
        self.ttl = worker.c.seconds("push_timeout_s", 60.0)
        self.grace = worker.hs_timeout
        self.waiting: dict[str, Receive] = {}
        # answers before the request waits here: from the engine it names, bounded, expiring
        self.early = EarlyAnswers(self.ttl + self.grace)

    def register(self, load: Load, tmap: Any, now: float, connect_by: float) -> None:
        """``load``'s prefill is connected: register (rank 0) and wait for its writers.

        Rank 0 sent the registration now, so it may give up ``ttl + grace`` from now. Another
        rank does not know when rank 0 sent it (its own handshake may have been slower), only
        that it was by ``connect_by`` (the handshake deadline every rank's load shares): it
        waits until ``ttl + grace`` after that, so that no rank frees blocks a write may
        still reach."""
        w = self.w
        if not load.key:
            raise ValueError("the request's transfer key is empty or too long: set "
                             "kv_transfer_params['transfer_id'] (1 to 256 characters)")
        if w.rank == 0:  # one registration per request, to every prefill rank
            reg = Registration(key=load.key, decode_req=load.req_id, engine=w.c.engine_id,
                               host=w.c.host, port=w.c.rank_port(0), tp=w.c.tp_size,
                               lists=tuple(tuple(int(b) for b in g) for g in load.local_ids),
                               start=load.start, end=load.end, ttl=self.ttl,
                               sent=time.time())
            w.ep.notify(load.engine, range(load.remote_tp), reg.encode())
        sent_by = now if w.rank == 0 else max(now, connect_by)
        r = Receive(load, frozenset(tmap.peers), sent_by + self.ttl + self.grace, now)
        self.waiting[load.req_id] = r
        logger.info("kvplan: push req=%s key=%s rank=%d waits for prefill rank(s) %s of %s "
                    "(tokens [%d,%d))", load.req_id, load.key, w.rank, sorted(r.expect),
                    load.engine, load.start, load.end)
        for rank, ok, fields in self.early.take(load.req_id, load.engine):
            if load.req_id in self.waiting:  # (a PUSHFAIL among them ended it)
                self._answer(r, rank, ok, fields, now)
        if r.load.req_id in self.waiting and r.expect <= r.got.keys():
            self._done(r, now)

    def notice(self, n: Notification, now: float) -> bool:
        """Take a PUSHED / PUSHFAIL notification (a malformed one is dropped and logged);
        False for any other message. Only the engine a request names answers for it."""
        try:
            parsed = parse_done(n.message)
        except ValueError as e:
            logger.warning("kvplan: dropped a push answer from %s rank %d: %s", n.engine,
                           n.rank, e)
            return True
        if parsed is None:
            return False
        ok, fields = parsed
        req = fields["decode_req"]
        r = self.waiting.get(req)
        if r is not None and r.load.engine == n.engine:
            self._answer(r, n.rank, ok, fields, now)
            return True
        pending = self.w.waiting.get(req)  # known here, its handshake not done yet
        named = r.load.engine if r is not None else None if pending is None else (
            pending[0].engine if pending[0].push else "")
        if r is not None or not self.early.keep(req, n.engine, n.rank, ok, fields, now, named):
            logger.warning("kvplan: dropped a push answer for req=%s from %s rank %d: %s",
                           req, n.engine, n.rank, "the request names another engine"
                           if named is not None else "too many early answers from it")
        return True

    def _answer(self, r: Receive, rank: int, ok: bool, fields: dict[str, Any],
                now: float) -> None:
        if not ok:
            del self.waiting[r.load.req_id]
            self._fail(r, f"prefill rank {rank} could not write: {fields.get('why')}")
            return
        r.got[rank] = fields
        if r.expect <= r.got.keys():
            self._done(r, now)

    def _done(self, r: Receive, now: float) -> None:
        del self.waiting[r.load.req_id]
        why = None if self.w.digester is None else push_digests.check(self.w, r.load, r.got)
        if why is not None:  # before its first token: the policy recomputes or fails it
            self._fail(r, why)
            return
        me = str(self.w.rank)
        nbytes = sum(int(f["bytes"].get(me, 0)) for f in r.got.values())
        runs = sum(int(f["runs"].get(me, 0)) for f in r.got.values())
        self.w.recv_done.add(r.load.req_id)
        self.w.stats.record_transfer(now - r.since, 0.0, nbytes, runs, 0)
        logger.info("kvplan: push req=%s rank=%d written by prefill rank(s) %s: bytes=%d "
                    "runs=%d, %.4f s after it registered", r.load.req_id, self.w.rank,
                    sorted(r.got), nbytes, runs, now - r.since)

    def progress(self, now: float) -> None:
        """Fail the requests whose deadline passed (the prefill never wrote, or died)."""
        self.early.expire(now)
        for r in [r for r in self.waiting.values() if now >= r.deadline]:
            del self.waiting[r.load.req_id]
            self._fail(r, f"prefill rank(s) {sorted(r.expect - r.got.keys())} did not write "
                          f"within push_timeout_s + handshake_timeout_s = "
                          f"{self.ttl + self.grace:g} s")

    def _fail(self, r: Receive, why: str) -> None:
        self.w.stats.record("num_failed_transfers")
        self.w.fail(r.load, why)


@dataclass
class Write:
    """A push write in flight on this prefill rank."""

    match: Match
    t: Any  # kvplan_nixl.Transfer
    targets: tuple[int, ...]  # the decode ranks written
    post_s: float


@dataclass
class Layered:
    """A layer-wise push of one request on this prefill rank: opened before the request's
    forward, a part posted per layer as the forward computes it, ended after the forward. Its
    hold ends once it is over and the finished request's send (its generation) came."""

    match: Match  # its send is the forward's (generation 0)
    rt: Any  # kvplan_nixl.RequestTransfer; None once failed, or when this rank writes nothing
    left: set[str]  # regions not posted yet
    since: float  # perf_counter() at open
    post_s: float = 0.0
    parts: int = 0
    hooked: int = 0  # parts posted from a layer's hook (the others after the forward)
    ended: bool = False  # the forward is over: every region posted
    over: bool = False  # written, failed or nothing to write
    send: PushSend | None = None  # the finished request's, with its hold's generation
    drop_at: float = float("inf")  # over and no send came by then: forgotten


class Writes:
    """A prefill rank's pushes (see the module docstring)."""

    def __init__(self, worker: Rank) -> None:
        self.w = worker
        self.table = Pusher()
        self.matched: list[Match] = []
        self.inflight: dict[str, Write] = {}
        self.layers: dict[str, Layered] = {}
        self.open = False  # a layer-wise push of this step's forward is open (forward thread)
        self.hs = Handshakes(self._connect, lock=worker.lock, timeout=worker.hs_timeout,
                             identify=identity(worker.secret, worker.check_peer),
                             retry_after_s=min(5.0, worker.lease),
                             warn=lambda m: logger.warning("kvplan: push %s", m))
        self.owed = Owed(worker, self.hs)  # PUSHFAILs for refused registrations

    def _connect(self, engine: str, rank: int, blob: bytes) -> tuple[int, ...]:
        """Handshakes' ``connect`` (under the worker's lock): a decode rank, in push mode."""
        self.w.ep.connect(blob, mode="push")
        return tuple(self.w.ep.map(engine, "push").peers)

    def add(self, sends: list[PushSend], now: float) -> None:
        """Finished requests to push (those written layer-wise: their generation)."""
        for s in sends:
            lw = self.layers.get(s.req_id)
            if lw is not None:
                lw.send = s
                if lw.over:
                    self._forget(lw)
                continue
            if not s.key:  # an aborted layer-wise request whose forward wrote nothing
                self._end(s)
                continue
            m = self.table.add_send(s, now, self.w.lease)
            if m is not None:
                self.matched.append(m)

    # -- layer-wise: opened before the forward, posted from it -------------------------------

    def ready(self, s: PushSend, now: float) -> bool:
        """Layer-wise ``s`` can open: its registration is in, its decode's handshake over."""
        reg = self.table.registration(s.key, now)
        st = None if reg is None else self.hs.state(reg.engine, reg.host, reg.port)
        return st is not None and not st.pending

    def begin(self, sends: list[PushSend], now: float) -> None:
        """Open the layer-wise pushes of this step's forward: those whose registration is in
        and whose decode is connected (the others are pushed whole once finished; all of them
        with the transfer digest on, which is of the finished KV)."""
        for s in sends if self.w.digester is None else ():
            reg = self.table.registration(s.key, now)
            st = None if reg is None else self.hs.state(reg.engine, reg.host, reg.port)
            if st is None or st.pending or st.failed:
                logger.info("kvplan: push req=%s key=%s: %s before its forward; it is pushed "
                            "whole once it finished", s.req_id, s.key,
                            "no registration" if reg is None else "decode not connected")
                continue
            m = self.table.add_send(s, now, self.w.lease)  # takes the registration
            if m is None:  # (a valid registration waits, so its key is not refused)
                continue
            lw = Layered(m, None, set(), time.perf_counter())
            self.layers[s.req_id] = lw
            try:
                plan, msg, start, end = _plan(self.w, m)
                if len(plan) == 0:  # this rank writes nothing of it
                    lw.ended = True
                    self._over(lw, now)
                    continue
                lw.rt = self.w.ep.request(plan, m.reg.engine, notify=msg,
                                          timeout=m.valid_until - now)
            except Exception as e:
                self._layer_failed(lw, f"{type(e).__name__}: {e}", now)
                continue
            lw.left = {plan.map.dst.regions[j].name for j in plan.map.region_lanes}
            self.open = True
            logger.info("kvplan: push req=%s rank=%d layer-wise to %s req=%s ranks=%s "
                        "tokens=[%d,%d) bytes=%d runs=%d regions=%d", s.req_id, self.w.rank,
                        m.reg.engine, m.reg.decode_req, list(plan.peers), start, end,
                        plan.nbytes, len(plan), len(lw.left))

    def save_layer(self, name: str) -> None:
        """The forward computed layer ``name``: post its region of every open push."""
        for lw in self.layers.values():
            if lw.ended or lw.rt is None or name not in lw.left:
                continue
            lw.left.discard(name)
            self._post_part(lw, name)
            lw.hooked += 1

    def end_layers(self, now: float) -> None:
        """The forward is over: post every region no layer hook posted (state regions, pools
        of several layers), close the requests; they complete in :meth:`progress`."""
        self.open = False
        for lw in self.layers.values():
            if lw.ended:
                continue
            lw.ended = True
            if lw.rt is None:
                continue
            if lw.left:
                self._post_part(lw, sorted(lw.left))
                lw.left.clear()
            if lw.rt is None:
                continue
            try:
                lw.rt.end()
            except Exception as e:
                self._layer_failed(lw, f"{type(e).__name__}: {e}", now)

    def _post_part(self, lw: Layered, names: str | list[str]) -> None:
        t0 = time.perf_counter()
        try:  # a hook after the decode's window closed (a slow forward) posts nothing
            if time.monotonic() >= lw.match.valid_until:
                raise DeadlinePassed(f"the decode's window closed before layer(s) {names} "
                                     "were computed: nothing of them posted")
            lw.rt.post(names)
        except Exception as e:
            self._layer_failed(lw, f"{type(e).__name__}: {e}", time.monotonic())
            return
        lw.post_s += time.perf_counter() - t0
        lw.parts += 1

    def _layer_failed(self, lw: Layered, why: str, now: float) -> None:
        """Cancel what was posted (released handles: nothing lands later), tell the decode."""
        m = lw.match
        logger.error("kvplan: push req=%s to %s req=%s failed: %s", m.send.req_id,
                     m.reg.engine, m.reg.decode_req, why)
        self.w.stats.record("num_failed_transfers")
        if lw.rt is not None:
            for t in lw.rt.transfers:
                t.cancel(why)
            lw.rt = None
        _tell(self.w, m.reg, _targets(self.w, m.reg.engine), why)
        self._over(lw, now)

    def _over(self, lw: Layered, now: float) -> None:
        lw.over = True
        if lw.send is not None:
            self._forget(lw)
        else:  # its send comes with the step's output; bounded should the request vanish
            lw.drop_at = now + self.w.lease

    def _forget(self, lw: Layered) -> None:
        del self.layers[lw.match.send.req_id]
        if lw.send is not None:
            self._end(lw.send)

    def _poll_layers(self, now: float) -> None:
        for lw in list(self.layers.values()):
            if lw.over:
                if now >= lw.drop_at:
                    self._forget(lw)
                continue
            if not lw.ended or lw.rt is None or not lw.rt.poll():
                continue
            m = lw.match
            if not lw.rt.ok:
                bad = [str(t.error()) for t in lw.rt.transfers if not t.ok]
                self.hs.forget(m.reg.engine)
                self._layer_failed(lw, bad[0] if bad else "a part failed", now)
                continue
            secs = (lw.rt.finished or time.perf_counter()) - lw.since
            self.w.stats.record_transfer(secs, lw.post_s, lw.rt.plan.nbytes, len(lw.rt.plan),
                                         sum(sum(t.runs().values()) for t in lw.rt.transfers))
            logger.info("kvplan: push req=%s to %s req=%s done layer-wise in %.4f s (%d parts, "
                        "%d from layer hooks)", m.send.req_id, m.reg.engine, m.reg.decode_req,
                        secs, lw.parts, lw.hooked)
            lw.rt = None
            self._over(lw, now)

    def notice(self, n: Notification, now: float) -> bool:
        """Take a REGISTER notification; False for any other message."""
        if not n.message.startswith(REGISTER):
            return False
        try:
            reg = Registration.decode(n.message)
        except ValueError as e:
            logger.warning("kvplan: dropped a push registration from %s rank %d: %s",
                           n.engine, n.rank, e)
            return True
        if reg.engine != n.engine:
            logger.warning("kvplan: dropped a push registration from %s rank %d naming "
                           "engine %s", n.engine, n.rank, reg.engine)
            return True
        age = time.time() - reg.sent
        if age >= reg.ttl:
            logger.warning("kvplan: dropped a push registration of %s req=%s key=%s: sent %.1f s "
                           "ago, past its ttl of %g s (a stalled prefill, or clocks apart)",
                           reg.engine, reg.decode_req, reg.key, age, reg.ttl)
            return True
        logger.info("kvplan: push registration of %s req=%s key=%s at rank %d, %.3f s after it "
                    "was sent", reg.engine, reg.decode_req, reg.key, self.w.rank, age)
        m = self.table.add_registration(reg, now, age)
        if m is not None:
            self.matched.append(m)
        elif self.hs.state(reg.engine, reg.host, reg.port) is None:  # connect now: a
            self.hs.start(reg.engine, reg.host, reg.port)  # layer-wise push needs it before
        return True

    def progress(self, now: float) -> None:
        self._refuse(now)
        sends, regs = self.table.expire(now)
        for s in sends:
            logger.warning("kvplan: prefill req=%s key=%s: no decode registered within the "
                           "lease; its blocks are freed", s.req_id, s.key)
            self._end(s)
        for r in regs:
            logger.warning("kvplan: push registration of %s req=%s key=%s expired: no "
                           "prefill request of that key finished", r.engine, r.decode_req,
                           r.key)
        for m in list(self.matched):
            self._start(m, now)
        self._poll_layers(now)
        for req, wr in list(self.inflight.items()):
            wr.t.poll()
            if wr.t.done:
                del self.inflight[req]
                self._finished(wr)

    def _start(self, m: Match, now: float) -> None:
        reg = m.reg
        st = self.hs.state(reg.engine, reg.host, reg.port) \
            or self.hs.start(reg.engine, reg.host, reg.port)
        if st.pending and now < m.valid_until:
            return
        self.matched.remove(m)
        if st.pending or st.failed:
            why = "not connected in time" if st.pending else f"handshake failed: {st.reason}"
            logger.error("kvplan: push req=%s to %s req=%s: %s; its decode recomputes",
                         m.send.req_id, reg.engine, reg.decode_req, why)
            self.w.stats.record("num_failed_handshakes")
            self._end(m.send)
            return
        try:
            self._post(m, now)
        except Exception as e:  # a refused pair, bad lists: the decode must not wait
            logger.error("kvplan: push req=%s to %s req=%s failed: %s: %s", m.send.req_id,
                         reg.engine, reg.decode_req, type(e).__name__, e)
            self.w.stats.record("num_failed_transfers")
            _tell(self.w, reg, _targets(self.w, reg.engine), f"{type(e).__name__}: {e}")
            self._end(m.send)

    def _post(self, m: Match, now: float) -> None:
        w, reg = self.w, m.reg
        plan, msg, start, end = _plan(self.w, m)
        if len(plan) == 0:  # this rank writes nothing of it (its decode does not wait on it)
            self._end(m.send)
            return
        targets = plan.peers
        msg = push_digests.sign(w.digester, plan, m.send, msg)
        t0 = time.perf_counter()
        # the deadline ends the write inside the registration's window: never a late write
        left = m.valid_until - time.monotonic()
        if left <= 0:
            raise DeadlinePassed("the decode's window closed before the write was posted")
        t = w.ep.write(plan, reg.engine, notify=msg, timeout=left)
        wr = Write(m, t, targets, time.perf_counter() - t0)
        self.inflight[m.send.req_id] = wr
        logger.info("kvplan: push req=%s rank=%d to %s req=%s ranks=%s tokens=[%d,%d) "
                    "bytes=%d runs=%d", m.send.req_id, w.rank, reg.engine, reg.decode_req,
                    list(targets), start, end, plan.nbytes, len(plan))

    def _finished(self, wr: Write) -> None:
        m = wr.match
        if wr.t.ok:
            self.w.stats.record_transfer(wr.t.seconds or 0.0, wr.post_s, wr.t.plan.nbytes,
                                         len(wr.t.plan), sum(wr.t.runs().values()))
            logger.info("kvplan: push req=%s to %s req=%s done in %.4f s", m.send.req_id,
                        m.reg.engine, m.reg.decode_req, wr.t.seconds or 0.0)
        else:
            why = str(wr.t.error())
            logger.error("kvplan: push req=%s to %s req=%s failed: %s", m.send.req_id,
                         m.reg.engine, m.reg.decode_req, why)
            self.w.stats.record("num_failed_transfers")
            self.hs.forget(m.reg.engine)  # the decode may have restarted: connect afresh
            _tell(self.w, m.reg, wr.targets, why)
        self._end(m.send)

    def _refuse(self, now: float) -> None:
        """Answer what the table refused (a key used by two requests at once)."""
        for item, why in self.table.refused:
            if isinstance(item, PushSend):  # its hold ends: vLLM frees its blocks
                logger.error("kvplan: prefill req=%s key=%s not pushed: %s", item.req_id,
                             item.key, why)
                self._end(item)
            else:
                self.owed.add(item, why, now)
        self.table.refused.clear()
        self.owed.progress(now)

    def _end(self, s: PushSend) -> None:
        """The push is over (written, failed or never registered): end the hold."""
        self.w.sends.release(s.req_id, s.generation)

    def close(self) -> None:
        self.hs.close()


class Owed:
    """PUSHFAILs a prefill rank owes decode requests it will not write (their key was used by
    two requests at once): each sent once its decode engine is connected, or dropped when
    its registration's window ends (the decode's deadline then fails the request)."""

    def __init__(self, worker: Rank, hs: Handshakes) -> None:
        self.w, self.hs = worker, hs
        self.owed: list[tuple[Registration, str, float]] = []

    def add(self, reg: Registration, why: str, now: float) -> None:
        logger.error("kvplan: push registration of %s req=%s refused: %s", reg.engine,
                     reg.decode_req, why)
        self.owed.append((reg, why, now + reg.ttl))

    def progress(self, now: float) -> None:
        for owed in list(self.owed):
            reg, why, until = owed
            st = self.hs.state(reg.engine, reg.host, reg.port) \
                or self.hs.start(reg.engine, reg.host, reg.port)
            if st.pending and now < until:
                continue
            self.owed.remove(owed)
            if st.ready:
                _tell(self.w, reg, _targets(self.w, reg.engine), why)


def _plan(w: Rank, m: Match) -> tuple[Any, bytes, int, int]:
    """The push plan of ``m`` (this rank's writes), its ``PUSHED`` message and span."""
    reg = m.reg
    tmap = w.ep.map(reg.engine, "push")
    src = w.groups.remote([list(g) for g in m.send.ids], list(m.send.first))
    dst = w.groups.local([list(g) for g in reg.lists])
    start, end = span(w.groups, w.whole, reg.start, reg.end, src, dst)
    plan = tmap.plan(src, dst, tokens=(start, end))
    rows = plan.copies()
    nbytes = {r: int(rows["length"][rows["dst_rank"] == r].sum()) for r in plan.peers}
    runs = {r: int((rows["dst_rank"] == r).sum()) for r in plan.peers}
    return plan, push_done(PUSHED, reg.decode_req, nbytes, runs), start, end


def _targets(w: Rank, engine: str) -> tuple[int, ...]:
    """The decode ranks of ``engine`` this rank's push map writes (none: never connected)."""
    try:
        return tuple(w.ep.map(engine, "push").peers)
    except Exception:  # never connected: nobody to tell (its deadline fails it)
        return ()


def _tell(w: Rank, reg: Registration, targets: tuple[int, ...], why: str) -> None:
    """PUSHFAIL to ``reg``'s decode ranks ``targets``, so they fail now instead of at their
    deadline."""
    if not targets:
        return
    try:
        w.ep.notify(reg.engine, targets, push_done(PUSHFAIL, reg.decode_req, why=why))
    except Exception as e:  # gone or never connected: their deadline fails them
        logger.warning("kvplan: could not tell %s req=%s its push failed: %s", reg.engine,
                       reg.decode_req, e)

