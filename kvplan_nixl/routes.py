"""Routes: per (remote engine, mode), the map, the ladders and the prepared descriptor lists.

A route is what ``connect`` prepares once so that a request only does index arithmetic: the
TransferMap kvplan built for the two specs, this rank's ladder and local descriptor list, and
per peer rank its ladder and remote list. :class:`RouteTable` owns the routes of one Endpoint:
building one (the map, the local side), a peer's list, checking that a plan belongs to a
route, lowering a plan's rows into descriptor indices (:meth:`Route.lower`, numpy only), and
releasing lists when a peer or an engine goes. It makes no transfer, loads no agent and sends
nothing; it may not import the endpoint, the handshake or posting.

Memory kinds: NIXL prepares a descriptor list of one memory type, so a side whose buffers are
of two kinds (DRAM and VRAM) gets one list per kind (:class:`Lists`), each holding the rows of
its kind's ladder entries, and a request's runs are split per (local kind, remote kind)
(:meth:`Route.lower_by_kind`), one NIXL transfer each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvplan import EngineSpec, Mode, TransferMap, TransferPlan, check_plan, pull_map, push_map
from kvplan_nixl import metadata as md
from kvplan_nixl._nixl import NIXL_LOCAL
from kvplan_nixl.descriptors import Ladder, Lowered, kind_shifts, lower, run_text, split_kinds
from kvplan_nixl.errors import ArgumentError, NotConnectedError, PlanMismatchError
from kvplan_nixl.handles import Handles
from kvplan_nixl.peers import Peer

__all__ = ["Lists", "Route", "RouteTable"]


class Lists:
    """One side's prepared descriptor lists, one per memory kind its ladder entries live in
    (``dlists[kind]``), with each entry's kind (an index of ``md.MEM_TYPES``) and its shift
    into its kind's list (:func:`~kvplan_nixl.descriptors.kind_shifts`)."""

    __slots__ = ("dlists", "kinds", "shifts")

    def __init__(self, dlists: dict[int, Any], kinds: np.ndarray, shifts: np.ndarray) -> None:
        self.dlists, self.kinds, self.shifts = dlists, kinds, shifts

    @property
    def mixed(self) -> bool:
        """True when the side's lists are of more than one memory kind."""
        return len(self.dlists) > 1


class Route:
    """Per (remote engine, mode): the map, the local ladder and lists, and per peer rank its
    ladder and lists (peers of different pipeline stages hold different regions)."""

    __slots__ = ("dst_groups", "local", "local_lists", "map", "peer_dlists", "peer_ladders",
                 "remote_units")

    def __init__(self, tmap: TransferMap, local: Ladder, remote_units: list[int],
                 local_lists: Lists | None) -> None:
        self.map = tmap
        self.local = local
        self.remote_units = remote_units
        self.local_lists = local_lists  # None when this rank copies nothing with that engine
        self.peer_ladders: dict[int, Ladder] = {}
        # per peer rank its Lists, None for a peer holding nothing the map copies
        self.peer_dlists: dict[int, Lists | None] = {}
        self.dst_groups = np.array([r.group for r in tmap.dst.regions], dtype=np.int64)

    def mixed(self, peer: int) -> bool:
        """True when runs with ``peer`` may pair more than one (local, remote) memory kind."""
        theirs = self.peer_dlists.get(peer)
        return bool((self.local_lists is not None and self.local_lists.mixed)
                    or (theirs is not None and theirs.mixed))

    def kind_pair(self, peer: int) -> tuple[int, int]:
        """The one (local kind, remote kind) of a peer whose runs are not :meth:`mixed`."""
        assert self.local_lists is not None and not self.mixed(peer)
        theirs = self.peer_dlists[peer]
        assert theirs is not None
        return next(iter(self.local_lists.dlists)), next(iter(theirs.dlists))

    def lower_by_kind(self, peer: int, seg: np.ndarray) -> tuple[Lowered, list]:
        """:meth:`lower`, then its runs grouped by (local kind, remote kind): the whole
        peer's Lowered and ``[(local kind, remote kind, Lowered)]`` (see ``split_kinds``)."""
        lw = self.lower(peer, seg)
        if not self.mixed(peer):
            return lw, [(*self.kind_pair(peer), lw)]
        local, theirs = self.local_lists, self.peer_dlists[peer]
        assert local is not None and theirs is not None
        le, re_ = self._entries(seg)
        return lw, split_kinds(lw, seg["length"], local.kinds[le], theirs.kinds[re_],
                               local.shifts[le], theirs.shifts[re_])

    def _entries(self, seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The local and remote ladder entry of each run of ``seg``."""
        pull = self.map.mode is Mode.PULL
        lside, rside = ("dst", "src") if pull else ("src", "dst")
        local_spec, remote_spec = ((self.map.dst, self.map.src) if pull else
                                   (self.map.src, self.map.dst))
        return (_entry_index(local_spec, seg[f"{lside}_region"], seg[f"{lside}_buffer"]),
                _entry_index(remote_spec, seg[f"{rside}_region"], seg[f"{rside}_buffer"]))

    def lower(self, peer: int, seg: np.ndarray) -> Lowered:
        """Descriptor indices of ``seg``, plan rows of one peer rank (bounds checked)."""
        lside, rside = ("dst", "src") if self.map.mode is Mode.PULL else ("src", "dst")
        le, re_ = self._entries(seg)
        return lower(self.local, self.peer_ladders[peer], le, seg[f"{lside}_offset"], re_,
                     seg[f"{rside}_offset"], seg["length"], describe=_describer(seg))


class RouteTable:
    """The routes of one rank (``spec``, ``rank``) whose regions lie at ``bases`` (per region
    index; ``v_bases``: the V buffer of a region keeping K and V apart), its buffers in the
    NIXL memory types ``memory`` (per buffer of the spec, "" for those it does not hold).
    ``spread_pcp``: pull maps spread reads over a source's PCP replicas (else replica 0)."""

    def __init__(self, engine: str, spec: EngineSpec, rank: int, handles: Handles, *,
                 bases: Sequence[int], nbytes: Sequence[int], devices: Sequence[int],
                 v_bases: Sequence[int], memory: Sequence[str],
                 spread_pcp: bool = True) -> None:
        self.engine, self.spec, self.rank, self.handles = engine, spec, rank, handles
        self.label = f"{engine!r} rank {rank}"
        self.bases, self.nbytes, self.devices, self.v_bases = bases, nbytes, devices, v_bases
        self.memory = tuple(memory)
        self.spread_pcp = spread_pcp
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
        """Raise unless ``plan`` was made by ``route``'s map (or an equal one) and its runs fit
        the map's geometry: ``kvplan.check_plan``, the checks ``kvplan.simulate`` applies,
        with its :class:`~kvplan.PlanError` (a plan's arrays may have been edited)."""
        if not isinstance(plan, TransferPlan):
            raise ArgumentError(f"plan must be a kvplan.TransferPlan, got {type(plan).__name__}")
        if plan.map is not route.map:
            self._check_map(plan, route, remote, mode)
        check_plan(plan)

    def _check_map(self, plan: TransferPlan, route: Route, remote: str, mode: Mode) -> None:
        m = plan.map
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
            tmap = pull_map(info.spec, self.spec, self.rank, spread_pcp=self.spread_pcp)
        else:
            tmap = push_map(self.spec, info.spec, self.rank)
        mine = [tmap.granule(r.name) for r in self.spec.regions]
        theirs = [tmap.granule(r.name) for r in info.spec.regions]
        names, nbytes, units, bases, devices = _ladder_entries(
            self.spec, self.nbytes, mine, self.bases, self.devices, self.v_bases)
        local = Ladder.build(names, nbytes, units)
        lists = self._prep(agent, NIXL_LOCAL, local, bases, devices,
                           _entry_kinds(self.spec, self.memory.__getitem__))
        return Route(tmap, local, theirs, lists)

    def peer_list(self, agent: Any, info: md.PeerInfo, route: Route) -> tuple[Ladder, Any]:
        """The peer's ladder and prepared remote list for ``route`` (None when not needed)."""
        names, nbytes, units, bases, devices = _ladder_entries(
            info.spec, info.nbytes, route.remote_units, info.bases, info.devices, info.v_bases)
        ladder = Ladder.build(names, nbytes, units)
        # a peer the map never copies with (another stage, or a TP rank whose units and
        # replicas other ranks serve) gets no list: no plan of this map names it
        if info.rank not in route.map.peers:
            return ladder, None
        return ladder, self._prep(agent, info.agent, ladder, bases, devices,
                                  _entry_kinds(info.spec, info.buffer_mem))

    def _prep(self, agent: Any, name: str, ladder: Ladder, bases, devices,
              kinds: np.ndarray) -> Lists | None:
        """One prepared list per memory kind of ``ladder``'s rows for agent ``name`` (None when
        the ladder has no row); a failure releases the lists already prepared."""
        rows = ladder.rows(bases, devices)
        if not len(rows):
            return None
        row_kind = kinds[np.nonzero(ladder.count > 0)[0]]
        dlists: dict[int, Any] = {}
        try:
            for k in np.unique(row_kind).tolist():
                mine = rows[row_kind == k]
                dlists[k] = self.handles.prep(
                    agent, name, mine, md.MEM_TYPES[k],
                    f"{len(mine)} strided {md.MEM_TYPES[k]} rows for {name}")
        except BaseException:
            for h in dlists.values():
                self.handles.release_dlist(h, [])
            raise
        return Lists(dlists, kinds, kind_shifts(ladder, kinds))

    def _release(self, lists: Lists | None, errors: list[BaseException]) -> None:
        for h in () if lists is None else lists.dlists.values():
            self.handles.release_dlist(h, errors)

    def release(self, route: Route, errors: list[BaseException]) -> None:
        """Release every list of a route no longer in the table."""
        for h in route.peer_dlists.values():
            self._release(h, errors)
        self._release(route.local_lists, errors)

    def drop_peer(self, peer: Peer, _why: str, errors: list[BaseException]) -> None:
        """Release the lists of ``peer`` in every route (a drop listener of
        the peer table)."""
        for (e, _), route in self.routes.items():
            if e == peer.engine and peer.rank in route.peer_dlists:
                route.peer_ladders.pop(peer.rank, None)
                self._release(route.peer_dlists.pop(peer.rank), errors)

    def drop_engine(self, engine: str) -> None:
        """Release the routes of an engine none of whose ranks is connected any more."""
        for key in [k for k in self.routes if k[0] == engine]:
            self._release(self.routes.pop(key).local_lists, [])

    def close(self, errors: list[BaseException]) -> None:
        """Release every local list (the peers' went with the peers) and forget all routes."""
        for route in self.routes.values():
            self._release(route.local_lists, errors)
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


def _entry_kinds(spec: EngineSpec, buffer_mem) -> np.ndarray:
    """Each ladder entry's memory kind (an index of ``md.MEM_TYPES``), in the order of
    :func:`_ladder_entries`; ``buffer_mem(b)`` is buffer ``b``'s NIXL memory type (DRAM for
    regions the rank does not hold: they have no row)."""
    code = {m: k for k, m in enumerate(md.MEM_TYPES)}
    n = len(spec.regions)
    sep = [i for i, r in enumerate(spec.regions) if r.separate_kv]
    bufs = [spec.buffer_of(i) for i in range(n)] + [spec.buffer_of(i, 1) for i in sep]
    return np.array([code.get(buffer_mem(b), 0) for b in bufs], dtype=np.int64)


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
