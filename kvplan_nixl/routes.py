"""Routes: per (remote engine, mode), the map, the ladders and the prepared descriptor lists.

A route is what ``connect`` prepares once so that a request only does index arithmetic: the
TransferMap kvplan built for the two specs, this rank's ladder and local descriptor list, and
per peer rank its ladder and remote list. :class:`RouteTable` owns the routes of one Endpoint:
building one (the map, the local side), a peer's list, checking that a plan belongs to a
route, lowering a plan's rows into descriptor indices (:meth:`Route.lower`, numpy only), and
releasing lists when a peer or an engine goes. It makes no transfer, loads no agent and sends
nothing; it may not import the endpoint, the handshake or posting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvplan import EngineSpec, Mode, TransferMap, TransferPlan, pull_map, push_map
from kvplan_nixl import metadata as md
from kvplan_nixl._nixl import NIXL_LOCAL
from kvplan_nixl.descriptors import Ladder, Lowered, lower, run_text
from kvplan_nixl.errors import ArgumentError, NotConnectedError, PlanMismatchError
from kvplan_nixl.handles import Handles
from kvplan_nixl.peers import Peer

__all__ = ["Route", "RouteTable"]


class Route:
    """Per (remote engine, mode): the map, the local ladder and list, and per peer rank its
    ladder and list (peers of different pipeline stages hold different regions)."""

    __slots__ = ("dst_groups", "local", "local_dlist", "map", "peer_dlists", "peer_ladders",
                 "remote_units")

    def __init__(self, tmap: TransferMap, local: Ladder, remote_units: list[int],
                 local_dlist: Any) -> None:
        self.map = tmap
        self.local = local
        self.remote_units = remote_units
        self.local_dlist = local_dlist  # None when this rank copies nothing with that engine
        self.peer_ladders: dict[int, Ladder] = {}
        self.peer_dlists: dict[int, Any] = {}  # None for a peer holding nothing the map copies
        self.dst_groups = np.array([r.group for r in tmap.dst.regions], dtype=np.int64)

    def lower(self, peer: int, seg: np.ndarray) -> Lowered:
        """Descriptor indices of ``seg``, plan rows of one peer rank (bounds checked)."""
        pull = self.map.mode is Mode.PULL
        lside, rside = ("dst", "src") if pull else ("src", "dst")
        local_spec, remote_spec = ((self.map.dst, self.map.src) if pull else
                                   (self.map.src, self.map.dst))
        return lower(self.local, self.peer_ladders[peer],
                     _entry_index(local_spec, seg[f"{lside}_region"], seg[f"{lside}_buffer"]),
                     seg[f"{lside}_offset"],
                     _entry_index(remote_spec, seg[f"{rside}_region"], seg[f"{rside}_buffer"]),
                     seg[f"{rside}_offset"], seg["length"], describe=_describer(seg))


class RouteTable:
    """The routes of one rank (``spec``, ``rank``) whose regions lie at ``bases`` (per region
    index; ``v_bases``: the V buffer of a region keeping K and V apart) in memory ``mem``."""

    def __init__(self, engine: str, spec: EngineSpec, rank: int, handles: Handles, *,
                 bases: Sequence[int], nbytes: Sequence[int], devices: Sequence[int],
                 v_bases: Sequence[int], mem: str) -> None:
        self.engine, self.spec, self.rank, self.handles = engine, spec, rank, handles
        self.label = f"{engine!r} rank {rank}"
        self.bases, self.nbytes, self.devices, self.v_bases = bases, nbytes, devices, v_bases
        self.mem = mem
        self.routes: dict[tuple[str, Mode], Route] = {}

    def get(self, remote: str, mode: Mode) -> Route:
        """The route to ``remote`` in ``mode``, or :class:`NotConnectedError`."""
        route = self.routes.get((remote, mode))
        if route is None:
            known = sorted(f"{e} ({m.value})" for e, m in self.routes)
            raise NotConnectedError(
                f"{self.label} has no {mode.value} connection to engine "
                f"{remote!r}; connect(metadata, mode={mode.value!r}) first (connected: {known})"
            )
        return route

    def check_plan(self, plan: TransferPlan, route: Route, remote: str, mode: Mode) -> None:
        """Raise unless ``plan`` was made by ``route``'s map (or an equal one)."""
        if not isinstance(plan, TransferPlan):
            raise ArgumentError(f"plan must be a kvplan.TransferPlan, got {type(plan).__name__}")
        m = plan.map
        if m is route.map:
            return
        verb = "read" if mode is Mode.PULL else "write"
        if m.mode is not mode:
            raise PlanMismatchError(
                f"{verb} needs a {mode.value} plan (from kvplan.{mode.value}_map), got a "
                f"{m.mode.value} plan"
            )
        if m.rank != self.rank:
            raise PlanMismatchError(
                f"plan was made for rank {m.rank}; this endpoint is {self.label}"
            )
        if (m.src, m.dst) != (route.map.src, route.map.dst):
            raise PlanMismatchError(
                f"plan was made for other engine specs than {self.engine!r} and {remote!r} "
                f"exchanged at connect"
            )

    def new_route(self, agent: Any, info: md.PeerInfo, mode: Mode) -> Route:
        """A route to ``info``'s engine: its map and this rank's local list (not added)."""
        if mode is Mode.PULL:
            tmap = pull_map(info.spec, self.spec, self.rank)
        else:
            tmap = push_map(self.spec, info.spec, self.rank)
        mine = [tmap.granule(r.name) for r in self.spec.regions]
        theirs = [tmap.granule(r.name) for r in info.spec.regions]
        names, nbytes, units, bases, devices = _ladder_entries(
            self.spec, self.nbytes, mine, self.bases, self.devices, self.v_bases)
        local = Ladder.build(names, nbytes, units)
        rows = local.rows(bases, devices)
        dlist = (self.handles.prep(agent, NIXL_LOCAL, rows, self.mem,
                                   f"{len(rows)} strided rows for {NIXL_LOCAL}")
                 if len(rows) else None)
        return Route(tmap, local, theirs, dlist)

    def peer_list(self, agent: Any, info: md.PeerInfo, route: Route) -> tuple[Ladder, Any]:
        """The peer's ladder and prepared remote list for ``route`` (None when not needed)."""
        names, nbytes, units, bases, devices = _ladder_entries(
            info.spec, info.nbytes, route.remote_units, info.bases, info.devices, info.v_bases)
        ladder = Ladder.build(names, nbytes, units)
        rows = ladder.rows(bases, devices)
        # a peer the map never copies with (another stage, or a TP rank whose units and
        # replicas other ranks serve) gets no list: no plan of this map names it
        needed = info.rank in route.map.peers and len(rows) > 0
        return ladder, (self.handles.prep(agent, info.agent, rows, info.mem_type,
                                          f"{len(rows)} strided rows for {info.agent}")
                        if needed else None)

    def release(self, route: Route, errors: list[BaseException]) -> None:
        """Release every list of a route no longer in the table."""
        for h in route.peer_dlists.values():
            self.handles.release_dlist(h, errors)
        self.handles.release_dlist(route.local_dlist, errors)

    def drop_peer(self, peer: Peer, _why: str, errors: list[BaseException]) -> None:
        """Release the lists of ``peer`` in every route (a drop listener of
        the peer table)."""
        for (e, _), route in self.routes.items():
            if e == peer.engine and peer.rank in route.peer_dlists:
                route.peer_ladders.pop(peer.rank, None)
                self.handles.release_dlist(route.peer_dlists.pop(peer.rank), errors)

    def drop_engine(self, engine: str) -> None:
        """Release the routes of an engine none of whose ranks is connected any more."""
        for key in [k for k in self.routes if k[0] == engine]:
            self.handles.release_dlist(self.routes.pop(key).local_dlist, [])

    def close(self, errors: list[BaseException]) -> None:
        """Release every local list (the peers' went with the peers) and forget all routes."""
        for route in self.routes.values():
            self.handles.release_dlist(route.local_dlist, errors)
        self.routes.clear()


def _describer(seg: np.ndarray):
    """Error text for run ``i`` of ``seg`` (rows of one peer), in the project's run notation."""

    def describe(i: int, reason: str) -> str:
        row = seg[i]
        s = ("p", int(row["src_rank"]), int(row["src_region"]), int(row["src_offset"]))
        d = ("d", int(row["dst_rank"]), int(row["dst_region"]), int(row["dst_offset"]))
        return f"run {run_text(s, d, int(row['length']))}: {reason}"

    return describe


def _ladder_entries(spec: EngineSpec, nbytes, units, bases, devices, v_bases):
    """A ladder's entries: one per region (its K buffer when K and V are apart, else the
    buffer it lives in), then one per V buffer of a region keeping K and V apart, in region
    order. Returns (names, nbytes, units, bases, devices)."""
    sep = [i for i, r in enumerate(spec.regions) if r.separate_kv]
    if not sep:
        return [r.name for r in spec.regions], nbytes, units, bases, devices
    return (
        [r.name for r in spec.regions] + [f"{spec.regions[i].name} (V)" for i in sep],
        [*nbytes, *(nbytes[i] for i in sep)],
        [*units, *(units[i] for i in sep)],
        [*bases, *((v_bases[i] if v_bases else 0) for i in sep)],
        [*devices, *(devices[i] for i in sep)],
    )


def _entry_index(spec: EngineSpec, regions: np.ndarray, buffers: np.ndarray) -> np.ndarray:
    """The ladder entry of each run (see :func:`_ladder_entries`): its region, or that
    region's V entry when the run lies in the region's separate V buffer."""
    n = len(spec.regions)
    sep = [i for i, r in enumerate(spec.regions) if r.separate_kv]
    if not sep:
        return regions
    v_buf = np.full(n, -1, dtype=np.int64)
    v_entry = np.zeros(n, dtype=np.int64)
    for k, i in enumerate(sep):
        v_buf[i], v_entry[i] = spec.buffer_of(i, 1), n + k
    return np.where(buffers == v_buf[regions], v_entry[regions], regions)
