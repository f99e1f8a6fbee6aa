"""Posting: a plan's runs lowered per peer rank and posted as one :class:`Transfer`.

Owns the transfers in flight of one Endpoint and the posting of a plan: check it against its
route, split its rows by peer rank, lower each peer's rows to descriptor indices (numpy only,
:meth:`~kvplan_nixl.routes.Route.lower_by_kind`), post one NIXL transfer per peer and
(local, remote) memory kind pair, and keep the
Transfer until it leaves PENDING. It is the :class:`~kvplan_nixl.transfer.Owner` of its
Transfers (agent, handle ledger, telemetry). It never connects, loads or drops a peer (it
cancels a dropped peer's transfers when told) and may not import the endpoint or parts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvplan import Mode, TransferPlan
from kvplan_nixl.arguments import check_request
from kvplan_nixl.descriptors import Lowered
from kvplan_nixl.errors import (
    ClosedError,
    NotConnectedError,
    PlanMismatchError,
    is_nixl_error,
    nixl_call,
)
from kvplan_nixl.handles import Handles
from kvplan_nixl.peers import Peer, PeerTable
from kvplan_nixl.routes import Route, RouteTable
from kvplan_nixl.transfer import Transfer, _Part

__all__ = ["Poster"]


class Poster:
    """Posts plans for one rank and tracks its transfers until done (a transfer ``Owner``)."""

    def __init__(self, label: str, rank: int, routes: RouteTable, peers: PeerTable,
                 handles: Handles, agent: Callable[[], Any], progress: Callable[[], int],
                 telemetry: bool, seal: Callable[[str, bytes], bytes]) -> None:
        self.label, self.rank, self.routes, self.handles = label, rank, routes, handles
        self.peers = peers
        self._agent = agent
        self._progress = progress
        self.telemetry = telemetry
        self._seal = seal  # every notification leaves sealed for its receiver
        self.transfers: set[Transfer] = set()

    # -- the Owner of its Transfers ------------------------------------------------------------

    def agent_or_none(self) -> Any | None:
        """The NIXL agent, or None once the endpoint closed."""
        return self._agent()

    def require(self) -> Any:
        """The NIXL agent, or :class:`ClosedError`."""
        agent = self._agent()
        if agent is None:
            raise ClosedError(f"endpoint {self.label} is closed")
        return agent

    def progress(self) -> int:
        """Progress the endpoint (its notifications and control notices)."""
        return self._progress()

    def count_xfer(self) -> None:
        """A transfer handle was made."""
        self.handles.count_xfer()

    def release_xfer(self, h: Any) -> None:
        """Release a transfer handle."""
        self.handles.release(h)

    def desc_count(self, h: Any) -> int | None:
        """NIXL's descriptor count of ``h`` after merging (telemetry), or None."""
        try:
            return int(self._agent().get_xfer_telemetry(h).descCount)
        except Exception as exc:
            if not is_nixl_error(exc):
                raise
            return None

    def forget(self, t: Transfer) -> None:
        """``t`` is done: no longer in flight."""
        self.transfers.discard(t)

    # -- posting -----------------------------------------------------------------------------

    def post(self, plan: TransferPlan, remote: str, mode: Mode, notify: bytes | None,
             timeout: float | None) -> Transfer:
        """Post every run of ``plan`` (see ``Endpoint.read``); the arguments are checked
        first (``kvplan_nixl.arguments``)."""
        notify, timeout = check_request(remote, notify, timeout)
        agent = self.require()
        self.progress()  # a peer's close notice drops its route before we post to it
        route = self.routes.get(remote, mode)
        self.routes.check_plan(plan, route, remote, mode)
        rows = plan.copies()
        lside, rside = ("dst", "src") if mode is Mode.PULL else ("src", "dst")
        peer = rows[f"{rside}_rank"]
        if len(rows) and not (rows[f"{lside}_rank"] == self.rank).all():
            bad = int(rows[f"{lside}_rank"][rows[f"{lside}_rank"] != self.rank][0])
            raise PlanMismatchError(
                f"plan has runs of local rank {bad}; this endpoint is rank {self.rank}"
            )
        starts = np.flatnonzero(np.concatenate(([len(peer) > 0], peer[1:] != peer[:-1])))
        if len(np.unique(peer[starts])) != len(starts):  # a peer's rows are not contiguous
            rows = rows[np.argsort(peer, kind="stable")]
            peer = rows[f"{rside}_rank"]
            starts = np.flatnonzero(np.concatenate(([True], peer[1:] != peer[:-1])))
        ends = np.append(starts[1:], len(peer)) if len(starts) else starts
        ranks = [int(r) for r in peer[starts]]
        missing = [r for r in ranks if r not in route.peer_dlists]
        if missing:
            raise NotConnectedError(
                f"plan reads/writes ranks {missing} of engine {remote!r}, never connected in "
                f"{mode.value} mode by {self.label}; connected: {sorted(route.peer_dlists)}"
            )
        spans = list(zip(ranks, starts, ends, strict=True))
        lowered = [route.lower_by_kind(r, rows[a:b]) for r, a, b in spans]
        groups = {r: frozenset(np.unique(route.dst_groups[rows["dst_region"][a:b]]).tolist())
                  for r, a, b in spans}
        parts = [_Part(r, lw.runs, lw.nbytes) for r, (lw, _) in zip(ranks, lowered, strict=True)]
        return self.start(agent, route, plan, remote, parts, [k for _, k in lowered], groups,
                          notify, timeout)

    def start(self, agent: Any, route: Route, plan: TransferPlan, remote: str,
              parts: list[_Part], lowered: list[list[tuple[int, int, Lowered]]],
              groups: dict[int, frozenset[int]], notify: bytes | None,
              timeout: float | None) -> Transfer:
        """Make the Transfer of ``parts`` (lowered already, per part its runs grouped by
        (local kind, remote kind): one NIXL transfer each) and post it."""
        # a plan touching a rank or side with no list would have failed the bounds check
        assert all(route.peer_dlists[p.peer] is not None for p in parts)
        assert not parts or route.local_lists is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        t = Transfer(self, plan, remote, parts, groups, deadline)
        if not parts:
            t._settle()
            return t
        local = route.local_lists
        posts = [[(local.dlists[lk], route.peer_dlists[p.peer].dlists[rk], lw)  # type: ignore
                  for lk, rk, lw in kinds] for p, kinds in zip(parts, lowered, strict=True)]
        note = b"" if notify is None else bytes(notify)
        for p, mine in zip(parts, posts, strict=True):
            if len(mine) > 1:  # several transfers: sent once all are DONE, sealed by notify()
                p.note = note
        # a part of one transfer carries its notification, sealed now for its receiver
        msgs = [b"" if len(mine) > 1 else self._seal(self.peers.peers[(remote, p.peer)].agent,
                                                     note)
                for p, mine in zip(parts, posts, strict=True)]
        t._start(agent, "READ" if route.map.mode is Mode.PULL else "WRITE", posts, msgs)
        if not t.done:
            self.transfers.add(t)
        return t

    def notify(self, remote: str, ranks: tuple[int, ...], message: bytes) -> None:
        """Send ``message`` to each rank ``ranks`` of ``remote`` still connected (a request's
        one completion message; a rank that went has nothing to be told)."""
        agent = self.require()
        for rank in ranks:
            peer = self.peers.peers.get((remote, rank))
            if peer is None:
                continue
            with nixl_call("send_notif", f"{remote} rank {rank}"):
                agent.send_notif(peer.agent, self._seal(peer.agent, message))

    def drop_peer(self, peer: Peer, why: str, _errors: list[BaseException]) -> None:
        """Fail the transfers in flight with ``peer`` (a drop listener of the peer table)."""
        for t in list(self.transfers):
            if t.remote == peer.engine and peer.rank in t.peers:
                t.cancel(f"peer {peer.engine!r} rank {peer.rank} {why}", [peer.rank])

    def cancel_all(self, reason: str) -> None:
        """Fail every transfer in flight."""
        for t in list(self.transfers):
            t.cancel(reason)
