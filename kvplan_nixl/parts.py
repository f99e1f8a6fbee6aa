"""RequestTransfer: one request posted in parts (layer-wise streaming), completed once.

A prefill engine finishes its layers one after another; a connector that sends a layer as soon
as it is computed posts the request in parts. ``Endpoint.request(plan, remote)`` opens a
RequestTransfer over the whole plan; ``post(part)`` posts one part (``plan.part(names)``, or the
names themselves) as one :class:`~kvplan_nixl.Transfer`, optionally with a notification of its
own; ``end()`` says no part is left. The request completes once: when every part is DONE,
``poll``/``wait`` report it and the request's notification is sent, once, to every peer rank the
whole plan touches. It is sent only after every part completed locally, so a peer that frees its
blocks on that message never frees blocks a part still reads or writes.

Owns the parts of one request and its single completion; posting itself goes through the
endpoint's :class:`~kvplan_nixl.posting.Poster` (this module may not import the endpoint).
Not thread-safe: drive it from the thread that owns its Endpoint.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvplan import Mode, TransferPlan
from kvplan_nixl.arguments import check_notify, check_progress, check_timeout
from kvplan_nixl.descriptors import Lowered
from kvplan_nixl.errors import (
    ArgumentError,
    DeadlinePassed,
    NotConnectedError,
    PlanMismatchError,
)
from kvplan_nixl.posting import Poster
from kvplan_nixl.transfer import State, Transfer, _Part


class RequestTransfer:
    """The parts of one request posted as they become ready, with one completion.

    Build with :meth:`Endpoint.request` (``poster``: the endpoint's). ``transfers`` are the
    parts posted so far, in order.
    """

    def __init__(
        self,
        poster: Poster,
        plan: TransferPlan,
        remote: str,
        notify: bytes | None,
        deadline: float | None,
    ) -> None:
        if not isinstance(plan, TransferPlan):
            raise TypeError(f"expected a kvplan.TransferPlan, got {type(plan).__name__}")
        if plan.regions is not None:
            raise PlanMismatchError("open a request with the whole plan, then post its parts")
        self._poster = poster
        self.plan = plan
        self.remote = remote
        self.mode = plan.map.mode
        self._notify = None if notify is None else bytes(notify)
        self._deadline = deadline
        self._posted: dict[int, int] = {}  # destination region -> index of the part posting it
        self.transfers: list[Transfer] = []
        self._ended = False
        self._notified = False
        self.finished: float | None = None
        self._prepare()

    def _prepare(self) -> None:
        """Lower the whole plan once, per peer rank, so that posting a part only slices it.

        A map's lanes are sorted by peer rank, so each peer's rows are one contiguous segment
        of the plan, and a part's rows are sub-ranges of it: its descriptors are the matching
        ranges of the peer's index arrays (a run lowers to ``pieces`` consecutive descriptors).
        Should a peer's rows not be one segment (``self._pre`` None), each part is lowered on
        its own when posted.
        """
        plan, pull = self.plan, self.mode is Mode.PULL
        routes = self._poster.routes
        route = routes.get(self.remote, self.mode)
        routes.check_plan(plan, route, self.remote, self.mode)
        lanes = plan.map.lanes
        self._peer_of = [lane.src_rank if pull else lane.dst_rank for lane in lanes]
        b = plan.lane_bounds
        self._cum = np.concatenate(([0], np.cumsum(plan.rows["length"])))
        self._pre: dict[int, Lowered] | None = {}
        self._lane: dict[int, tuple[int, int, int, int, int, int]] = {}
        for peer in sorted(set(self._peer_of)):
            ks = [k for k, p in enumerate(self._peer_of) if p == peer]
            a, e = int(b[ks[0]]), int(b[ks[-1] + 1])
            # not one segment, not connected, or two memory kinds (a part's runs then split
            # per kind pair, which posting does): lower per part
            if ks != list(range(ks[0], ks[-1] + 1)) or peer not in route.peer_dlists \
                    or route.mixed(peer):
                self._pre = None
                return
            if e == a:
                continue
            lw = route.lower(peer, plan.rows[a:e])
            first = np.concatenate(([0], np.cumsum(lw.pieces)))  # first descriptor of a row
            self._pre[peer] = lw
            for k in ks:  # per lane, as Python ints: its descriptors, runs, bytes, group
                ka, ke = int(b[k]), int(b[k + 1])
                if ke > ka:
                    self._lane[k] = (peer, int(first[ka - a]), int(first[ke - a]), ke - ka,
                                     int(self._cum[ke] - self._cum[ka]), lanes[k].group)

    # -- posting -----------------------------------------------------------------------------

    def post(self, part: TransferPlan | str | Iterable[str], *,
             notify: bytes | None = None) -> Transfer:
        """Post one part now: a ``plan.part(...)`` of this request's plan, or region names.

        ``notify`` is delivered to each peer rank of this part when its share completes.
        Given names, no part plan is built (the descriptors are sliced from those lowered at
        open) and the returned Transfer's ``plan`` is the request's plan. Raises
        :class:`PlanMismatchError` for a part of another plan, a region already posted, or a
        post after :meth:`end`, and :class:`DeadlinePassed` once the request's deadline
        passed (never a part posted with no time left); nothing is posted then.
        """
        notify = check_notify(notify)
        if self._ended:
            raise PlanMismatchError("request already ended: no part can be posted after end()")
        whole = self.plan
        if isinstance(part, TransferPlan):
            if part.map is not whole.map or part.src_blocks is not whole.src_blocks or (
                part.dst_blocks is not whole.dst_blocks or part.tokens != whole.tokens
            ):
                raise PlanMismatchError(
                    "part is not a slice of this request's plan: make it with plan.part(names) "
                    "of the plan the request was opened with"
                )
            regions = part.regions if part.regions is not None else tuple(
                range(len(whole.map.dst.regions)))
        elif self._pre is None:
            part = whole.part(part)
            regions = part.regions
        else:  # names: descriptors are sliced from the whole plan's, no part plan is built
            ids = whole.map.region_ids
            if not isinstance(part, (str, list, tuple)):
                raise ArgumentError(f"part must be a plan.part(...) of this request, a region "
                                    f"name or a list of names, got {type(part).__name__}")
            names = (part,) if isinstance(part, str) else tuple(part)
            unknown = [n for n in names if n not in ids]
            if unknown:
                whole.part(unknown)  # raises RequestError naming the region
            regions = tuple(sorted({ids[n] for n in names}))
            part = whole  # what the Transfer reports as its plan: the request's
        again = [j for j in regions if j in self._posted]
        if again:
            names = [whole.map.dst.regions[j].name for j in again]
            raise PlanMismatchError(
                f"region(s) {names} already posted in part {self._posted[again[0]]} of this "
                "request; each region is posted once"
            )
        timeout = None if self._deadline is None else self._deadline - time.monotonic()
        if timeout is not None and timeout <= 0:  # never post what could only land late
            raise DeadlinePassed(f"the request's deadline passed {-timeout:.3f} s ago: region(s) "
                                 f"{[whole.map.dst.regions[j].name for j in regions]} not posted")
        if self._pre is None:
            t = self._poster.post(part, self.remote, self.mode, notify, timeout)
        else:
            t = self._post_slice(part, regions, notify, timeout)
        for j in regions:
            self._posted[j] = len(self.transfers)
        self.transfers.append(t)
        return t

    def _post_slice(self, part: TransferPlan, regions, notify, timeout) -> Transfer:
        """Post a part from the descriptors lowered at open: one NIXL transfer per peer."""
        poster, whole = self._poster, self.plan
        agent = poster.require()
        route = poster.routes.get(self.remote, self.mode)
        # the peer may have restarted with another spec since open: its route was replaced and
        # the descriptors lowered at open describe the old layout
        poster.routes.check_plan(whole, route, self.remote, self.mode)
        lanes_of, info = whole.map.region_lanes, self._lane
        by_peer: dict[int, list[tuple[int, int, int, int, int, int]]] = {}
        for k in sorted(k for j in regions for k in lanes_of.get(j, ()) if k in info):
            by_peer.setdefault(info[k][0], []).append(info[k])
        missing = [r for r in by_peer if r not in route.peer_dlists]
        if missing:
            raise NotConnectedError(
                f"part reads/writes ranks {missing} of engine {self.remote!r}, no longer "
                f"connected in {self.mode.value} mode"
            )
        parts, lowered, groups = [], [], {}
        for peer in sorted(by_peer):
            lw, spans = self._pre[peer], by_peer[peer]  # type: ignore[index]
            if len(spans) == 1:  # one lane (one region, this peer): views, no copy
                d0, d1 = spans[0][1], spans[0][2]
                li, ri = lw.local[d0:d1], lw.remote[d0:d1]
            else:
                idx = np.concatenate([np.arange(x[1], x[2]) for x in spans])
                li, ri = lw.local[idx], lw.remote[idx]
            runs, nbytes = sum(x[3] for x in spans), sum(x[4] for x in spans)
            lowered.append([(*route.kind_pair(peer), Lowered(li, ri, runs, nbytes))])
            parts.append(_Part(peer, runs, nbytes))
            groups[peer] = frozenset(x[5] for x in spans)
        return poster.start(agent, route, part, self.remote, parts, lowered, groups, notify,
                            timeout)

    def end(self) -> None:
        """No part is left. Raises :class:`PlanMismatchError` naming regions never posted (of
        those the plan copies something for); the request then stays open."""
        missing = [
            self.plan.map.dst.regions[j].name
            for j in sorted(self.plan.map.region_lanes) if j not in self._posted
        ]
        if missing:
            shown = ", ".join(missing[:4]) + (f", ... ({len(missing)})" if len(missing) > 4 else "")
            raise PlanMismatchError(f"end(): region(s) never posted: {shown}")
        self._ended = True
        self.poll()

    # -- completion --------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once ended and no part is pending (each DONE or FAILED)."""
        return self._ended and all(t.done for t in self.transfers)

    @property
    def ok(self) -> bool:
        """True once ended and every part is DONE (the request's notification is then sent)."""
        return self._ended and all(t.ok for t in self.transfers)

    @property
    def peers(self) -> tuple[int, ...]:
        """Peer ranks the whole plan touches: those the request's notification goes to."""
        return self.plan.peers

    def poll(self) -> bool:
        """Advance every part once (never blocks); True once the request is done."""
        for t in self.transfers:
            t.poll()
        self._complete()
        return self.done

    def wait(self, timeout: float | None = None, *, progress: Iterable[Any] = ()) -> None:
        """Block until every part is DONE, then send the request's notification (once).

        Raises the first failed part's :class:`TransferFailed` / :class:`TransferTimeout`;
        ``progress`` as for :meth:`Transfer.wait`. Needs :meth:`end` first.
        """
        timeout = check_timeout("timeout", timeout)
        if not self._ended:
            raise PlanMismatchError("wait(): call end() once every part is posted")
        limit = None if timeout is None else time.monotonic() + timeout
        others = check_progress(progress)
        for t in self.transfers:
            left = None if limit is None else max(0.0, limit - time.monotonic())
            t.wait(left, progress=others)
        self._complete()

    def states(self) -> list[dict[int, State]]:
        """Per posted part, ``{peer_rank: State}`` as of the last poll."""
        return [t.states() for t in self.transfers]

    def _complete(self) -> None:
        if self._notified or not self.ok:
            return
        self._notified = True
        self.finished = time.perf_counter()
        if self._notify is not None:
            self._poster.notify(self.remote, self.peers, self._notify)

    def __repr__(self) -> str:
        state = "ok" if self.ok else ("done" if self.done else "open" if not self._ended
                                      else "pending")
        way = "from" if self.mode is Mode.PULL else "to"
        return (f"RequestTransfer({self.mode.value} {way} {self.remote!r}, "
                f"{len(self.transfers)} parts, {state})")
