"""The request stage: block ids -> the read-only array of byte copies, by numpy index arithmetic.

For each lane's template (see ``planner.py``) the destination blocks a request fully covers are
taken in ascending block-id order and the template is broadcast over them: offsets are
``block_id * block_stride + template_offset``. Rows then come out sorted by destination offset
within a lane, so one pass of :func:`kvplan.runs.merge_runs` joins every pair of runs that is
contiguous on both sides -- across consecutive block ids too -- and the result is the smallest
list of maximal runs. There is no Python loop per block, token or copy: loops run over templates
and lanes (at most regions x peer ranks), and over the at most two partially covered blocks.

Layer 3 (the request): imports the planner, allocations, runs and the values below; it
serves ``TransferMap.plan`` (hook ``build_plan``) and calls views only through
:mod:`kvplan.hooks`, so nothing below imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from kvplan import hooks
from kvplan.allocations import finish
from kvplan.errors import RequestError
from kvplan.planner import (
    BlockTemplate,
    Lane,
    Mode,
    ReadOnlyArrays,
    TransferMap,
    _frozen,
)
from kvplan.regroup import check_state_slots
from kvplan.runs import merge_runs
from kvplan.spec import EngineSpec

#: dtype of :meth:`TransferPlan.copies`: one row per run, offsets in bytes from the base of the
#: buffer the run lies in (``src_buffer``/``dst_buffer``: indices in each spec's ``buffers``).
COPY_DTYPE = np.dtype(
    [
        ("src_rank", np.int64),
        ("src_region", np.int64),
        ("src_offset", np.int64),
        ("dst_rank", np.int64),
        ("dst_region", np.int64),
        ("dst_offset", np.int64),
        ("length", np.int64),
        ("src_buffer", np.int64),  # index in src.buffers of the buffer src_offset is from
        ("dst_buffer", np.int64),  # index in dst.buffers
    ]
)


def _id_array(ids: object, side: str, g: int) -> np.ndarray:
    """One group's ids as an array; ragged, deeply nested or odd objects are a RequestError."""
    if isinstance(ids, (str, bytes, dict, set, frozenset)):
        raise RequestError(
            f"{side} group {g}: block ids must be a flat sequence of integers, got "
            f"{type(ids).__name__}"
        )
    try:
        return np.asarray(ids)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise RequestError(
            f"{side} group {g}: block ids must be a flat sequence of integers ({exc})"
        ) from None


#: A block id meaning "this side does not hold that block position" (an engine's null block:
#: vLLM's blocks outside a sliding window, the placeholders before a state slot). No run reads
#: or writes it; the positions it stands for are not moved.
ABSENT = -1


def _block_lists(spec: EngineSpec, lists: Sequence, side: str) -> tuple[np.ndarray, ...]:
    """Validate one side's block ids: one list per group, ids in range (or :data:`ABSENT`)
    and unique."""
    if isinstance(lists, (str, bytes)) or not hasattr(lists, "__len__"):
        raise RequestError(f"{side} block ids: expected one sequence per group, got {lists!r}")
    if len(lists) != spec.num_groups:
        raise RequestError(
            f"{side} block ids: {len(lists)} lists for {spec.num_groups} KV-cache group(s); "
            "pass one sequence of block ids per group, e.g. [[3, 7, 9]] for one group"
        )
    out = []
    for g, ids in enumerate(lists):
        a = _id_array(ids, side, g)
        if a.size == 0:
            a = np.zeros(0, dtype=np.int64)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise RequestError(
                f"{side} group {g}: block ids must be a flat sequence of integers, got "
                f"shape {a.shape} dtype {a.dtype}"
            )
        limit, holder = min((r.num_blocks, r.name) for r in spec.regions if r.group == g)
        bad = np.flatnonzero((a < ABSENT) | (a >= limit))  # before the cast: no uint64 wrap
        if bad.size:
            raise RequestError(
                f"{side} group {g}: block id {int(a[bad[0]])} at position {int(bad[0])} is out of "
                f"range [0, {limit}) (region {holder!r} has {limit} blocks; {ABSENT} marks a "
                "block position this side does not hold)"
            )
        a = a.astype(np.int64)
        s = np.sort(a[a != ABSENT])
        dup = np.flatnonzero(s[1:] == s[:-1])
        if dup.size:
            raise RequestError(f"{side} group {g}: block id {int(s[dup[0]])} appears twice")
        a.flags.writeable = False
        out.append(a)
    pools: dict[str, set[int]] = {}
    for r in spec.regions:
        if r.pool is not None:
            pools.setdefault(r.pool, set()).add(r.group)
    shared: dict[tuple[int, ...], str] = {}  # each set of groups sharing pools, checked once
    for p, g in pools.items():
        if len(g) > 1:
            shared.setdefault(tuple(sorted(g)), p)
    for groups, pool in shared.items():  # a page belongs to one group's view at a time
        ids = np.concatenate([out[g] for g in groups])
        s = np.sort(ids[ids != ABSENT])
        dup = np.flatnonzero(s[1:] == s[:-1])
        if dup.size:
            page = int(s[dup[0]])
            owners = [g for g in groups if page in out[g]]
            raise RequestError(
                f"{side} block id {page} is listed by groups {owners}, which share pool "
                f"{pool!r}: a page belongs to one group's view at a time"
            )
    return tuple(out)


def _expand(
    tpl: BlockTemplate,
    pos: np.ndarray,
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    dst_first: int,
    rows: slice | np.ndarray,
    js: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    length: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of template pieces ``rows`` for destination block positions ``pos`` (block-major).

    Positions are counted from request position 0 on both sides; the destination list's element
    0 is block position ``dst_first`` (the source list always starts at position 0).
    """
    s_pos = pos * tpl.dst_bs // tpl.src_bs  # first source block each destination block touches
    s_blk = src_ids[s_pos[:, None] + js[rows]]
    d_blk = dst_ids[pos - dst_first]
    src_off = s_blk * tpl.src_block + src[rows]
    dst_off = (d_blk * tpl.dst_block)[:, None] + dst[rows]
    lens = np.broadcast_to(length[rows], dst_off.shape)
    if s_blk.size and (s_blk.min() == ABSENT or d_blk.min() == ABSENT):
        keep = (s_blk != ABSENT) & (d_blk != ABSENT)[:, None]  # pieces of held blocks only
        return src_off[keep], dst_off[keep], lens[keep]
    return src_off.ravel(), dst_off.ravel(), lens.ravel()


def _lane_runs(
    lane: Lane,
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    span: tuple[int, int, int],
    order_cache: dict,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merged ``(src_offset, dst_offset, length)`` of one lane, sorted by destination offset.

    ``span`` is ``(lo, hi, dst_first)``: copy request positions ``[lo, hi)``; the destination
    list starts at block position ``dst_first``.
    """
    tpls = lane.templates
    bs, phases = tpls[0].dst_bs, len(tpls)
    lo, n, dst_first = span
    j0, j1 = -(-lo // bs), n // bs  # destination blocks covered in full
    key = (lane.group, j0, j1, dst_first)
    pos = order_cache.get(key)
    if pos is None:  # ascending block id, so that rows come out in destination-offset order
        if j1 > j0:  # ids are unique
            pos = j0 + np.argsort(dst_ids[j0 - dst_first:j1 - dst_first])
        else:
            pos = np.zeros(0, np.int64)
        order_cache[key] = pos
    parts = []
    for ph, tpl in enumerate(tpls):  # one phase unless source blocks are larger
        pos_ph = pos if phases == 1 else pos[pos % phases == ph]
        parts += [
            _expand(tpl, pos_ph, src_ids, dst_ids, dst_first, slice(a, b), tpl.js, tpl.src,
                    tpl.dst, tpl.length)
            for a, b in tpl.slabs
        ]
    partial = {j for j in (lo // bs, n // bs) if j * bs < n and not j0 <= j < j1}
    for j in sorted(partial):  # at most two blocks: keep only the atoms of covered tokens
        tpl = tpls[j % phases]
        t_lo, t_hi = max(lo, j * bs) - j * bs, min(n, (j + 1) * bs) - j * bs
        keep = np.flatnonzero((tpl.atom_token >= t_lo) & (tpl.atom_token < t_hi))
        parts.append(
            _expand(tpl, np.array([j]), src_ids, dst_ids, dst_first, keep, tpl.atom_js,
                    tpl.atom_src, tpl.atom_dst, tpl.atom_length)
        )
    if not parts:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    src_off, dst_off, length = (np.concatenate(c) for c in zip(*parts))
    if partial or phases > 1:  # a few sorted sequences: a stable sort merges them fast
        o = np.argsort(dst_off, kind="stable")
        src_off, dst_off, length = src_off[o], dst_off[o], length[o]
    return merge_runs(src_off, dst_off, length)


#: How the destination lists of a request with ``tokens=`` are anchored (see TransferMap.plan).
DST_FROM = ("zero", "start")


def _token_range(tokens) -> tuple[int, int] | None:
    """Validate ``tokens=(start, end)``: integers with ``0 <= start <= end``."""
    if tokens is None:
        return None
    try:
        start, end = tokens
    except (TypeError, ValueError):
        raise RequestError(f"tokens must be a pair (start, end), got {tokens!r}") from None
    for name, v in (("start", start), ("end", end)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise RequestError(f"tokens: {name} must be an integer, got {v!r}")
    start, end = int(start), int(end)
    if not 0 <= start <= end:
        raise RequestError(f"tokens ({start}, {end}): need 0 <= start <= end")
    return start, end


def _span(
    tmap: TransferMap, lane: Lane, n_src: int, n_dst: int, tokens: tuple[int, int] | None,
    dst_from: str,
) -> tuple[int, int, int]:
    """``(lo, hi, dst_first)`` of one lane for a request (see :meth:`TransferMap.plan`)."""
    tpl = lane.templates[0]
    vs, vd = tpl.src_bs, tpl.dst_bs  # request positions per block of each list
    if tokens is None:
        lo, hi, first = 0, min(n_src * vs, n_dst * vd), 0
    else:
        lo, hi = tokens
        first = lo // vd if dst_from == "start" else 0
    if lane.window is not None:  # the window's blocks, counted back from the end
        lo = max(lo, hi - (lane.window // vd + 1) * vd)
    if tokens is not None:  # an empty range too: its start must not lie past the lists
        name = tmap.dst.regions[lane.dst_region].name
        if n_src * vs < hi:
            raise RequestError(
                f"group {lane.group} (region {name!r}): tokens {tokens[0]}:{tokens[1]} need "
                f"source positions up to {hi}, but {n_src} source block(s) of {vs} positions "
                f"cover [0, {n_src * vs}); the source list always starts at position 0: pass "
                "every source block of the request, not only the last len(destination list)"
            )
        if (first + n_dst) * vd < hi:
            where = f"[{first * vd}, {(first + n_dst) * vd})"
            raise RequestError(
                f"group {lane.group} (region {name!r}): tokens {tokens[0]}:{tokens[1]} need "
                f"destination positions up to {hi}, but {n_dst} destination block(s) of {vd} "
                f"positions (dst_from={dst_from!r}) cover {where}"
            )
    return lo, max(lo, hi), first


@hooks.provide("build_plan")
def build_plan(
    tmap: TransferMap,
    src_blocks: Sequence,
    dst_blocks: Sequence,
    tokens: tuple[int, int] | None = None,
    dst_from: str = "zero",
    merge_slots: bool = True,
) -> TransferPlan:
    """Expand ``tmap``'s lanes over one request's block ids (see :meth:`TransferMap.plan`)."""
    rng = _token_range(tokens)
    if dst_from not in DST_FROM:
        raise RequestError(f"dst_from must be one of {DST_FROM}, got {dst_from!r}")
    if dst_from != "zero" and rng is None:
        raise RequestError(
            f"dst_from={dst_from!r} anchors the destination lists at tokens' start: pass tokens"
        )
    src_lists = _block_lists(tmap.src, src_blocks, "source")
    dst_lists = _block_lists(tmap.dst, dst_blocks, "destination")
    check_state_slots(tmap, src_lists, dst_lists)
    order_cache: dict = {}
    by_template: dict = {}
    lane_rows = []
    for lane in tmap.lanes:
        g = lane.group
        key = (id(lane.templates), lane.src_group, g, lane.window)  # identical lanes (layers)
        runs = by_template.get(key)  # share their runs
        if runs is None:
            s_ids, d_ids = src_lists[lane.src_group], dst_lists[g]
            state = tmap.dst.regions[lane.dst_region].is_state  # slots move whole, by position
            span = _span(tmap, lane, len(s_ids), len(d_ids), None if state else rng, dst_from)
            runs = _lane_runs(lane, s_ids, d_ids, span, order_cache)
            by_template[key] = runs
        lane_rows.append(runs)
    bounds = np.cumsum([0] + [len(r[2]) for r in lane_rows])
    out = np.empty(int(bounds[-1]), dtype=COPY_DTYPE)
    src_buffers, dst_buffers = tmap.src.region_buffers, tmap.dst.region_buffers
    for lane, (src_off, dst_off, length), at, end in zip(
        tmap.lanes, lane_rows, bounds[:-1], bounds[1:]
    ):
        out["src_rank"][at:end] = lane.src_rank
        out["src_region"][at:end] = lane.src_region
        out["src_offset"][at:end] = src_off
        out["dst_rank"][at:end] = lane.dst_rank
        out["dst_region"][at:end] = lane.dst_region
        out["dst_offset"][at:end] = dst_off
        out["length"][at:end] = length
        out["src_buffer"][at:end] = src_buffers[lane.src_region]  # K's where K/V are separate:
        out["dst_buffer"][at:end] = dst_buffers[lane.dst_region]  # finish() moves V runs
    runs = len(out)
    out, bounds = finish(tmap.src, tmap.dst, tmap.lanes, out, bounds, merge_slots)
    out.flags.writeable = False
    return TransferPlan(
        map=tmap, src_blocks=src_lists, dst_blocks=dst_lists, rows=out, lane_bounds=_frozen(bounds),
        tokens=rng, dst_from=dst_from, spans_regions=len(out) < runs,
    )


@attrs.frozen(eq=False, repr=False, getstate_setstate=False)
class TransferPlan(ReadOnlyArrays):
    """One request's byte copies: an immutable value over a read-only structured array.

    Post-conditions (tested against an independent oracle): every destination byte of the
    covered positions of the requested blocks is written exactly once with the source's value;
    no other destination byte is touched; every run lies inside its two buffers; rows are
    grouped by (source rank, destination rank, destination region) in the map's lane order, and
    within that sorted by destination offset, with no two rows mergeable (across the layer
    slots of an allocation too: such a run is listed under the lane of its first byte).
    """

    map: TransferMap
    src_blocks: tuple[np.ndarray, ...]
    dst_blocks: tuple[np.ndarray, ...]
    rows: np.ndarray
    lane_bounds: np.ndarray = attrs.field(eq=False)  # rows of lane k: [bounds[k], bounds[k+1])
    tokens: tuple[int, int] | None = None  # the request's token range, None for whole lists
    dst_from: str = "zero"  # how the destination lists are anchored (TransferMap.plan)
    regions: tuple[int, ...] | None = None  # a part's destination regions; None: the whole plan
    # True when some runs were merged across the layer slots of an allocation (a run then
    # copies several regions, listed under the first): such a plan cannot be cut into parts
    spans_regions: bool = attrs.field(default=False, eq=False)

    def part(self, regions: Iterable[str]) -> TransferPlan:
        """The slice of this plan that copies only the named regions (e.g. one layer's).

        No re-planning: the rows of those regions' lanes are taken as they are, so the parts
        of a partition of the regions together hold exactly this plan's rows, and a part's
        rows keep this plan's order. ``regions`` are region names (they pair the two engines);
        the part's :attr:`regions` lists their destination indices. Raises
        :class:`~kvplan.RequestError` for a name neither spec has, or (for a part of a part)
        a region outside this part.
        """
        if isinstance(regions, str):
            regions = (regions,)
        try:
            regions = tuple(regions)
        except TypeError:
            raise RequestError(f"part: regions must be a region name or an iterable of names, "
                               f"got {type(regions).__name__} {regions!r}") from None
        odd = [n for n in regions if not isinstance(n, str)]
        if odd:
            raise RequestError(f"part: regions must be region names (str), got {odd[0]!r}")
        if self.spans_regions:
            raise RequestError(
                "part: this plan merges runs across the layer slots of an allocation (a run "
                "copies several layers), so it cannot be cut by region; plan the request with "
                "TransferMap.plan(..., merge_slots=False) to post it layer by layer"
            )
        dst, ids = self.map.dst, self.map.region_ids
        idx = set()
        for name in regions:
            j = ids.get(name)
            if j is None:
                raise RequestError(
                    f"part: no region named {name!r} (the engines have "
                    f"{len(dst.regions)} regions, e.g. {dst.regions[0].name!r})"
                )
            if self.regions is not None and j not in self.regions:
                raise RequestError(f"part: region {name!r} is not in this part")
            idx.add(j)
        lanes = self.map.region_lanes
        ks = sorted(k for j in idx for k in lanes.get(j, ()))
        b = self.lane_bounds
        if len(ks) == 1:  # one lane: a view of the plan's rows, no copy
            rows = self.rows[b[ks[0]]:b[ks[0] + 1]]
        else:  # take() of an int index: cheaper than concatenating structured slices
            take = [np.arange(b[k], b[k + 1]) for k in ks]
            rows = self.rows.take(np.concatenate(take) if take else np.zeros(0, np.int64))
            rows.flags.writeable = False
        sizes = np.zeros(len(b) - 1, dtype=np.int64)
        sizes[ks] = b[1:][ks] - b[:-1][ks]
        bounds = np.concatenate(([0], np.cumsum(sizes)))
        return TransferPlan(
            map=self.map, src_blocks=self.src_blocks, dst_blocks=self.dst_blocks, rows=rows,
            lane_bounds=_frozen(bounds), tokens=self.tokens, dst_from=self.dst_from,
            regions=tuple(sorted(idx)), spans_regions=False,
        )

    def copies(self) -> np.ndarray:
        """The runs as a read-only structured array of :data:`COPY_DTYPE`."""
        return self.rows

    @property
    def peers(self) -> tuple[int, ...]:
        """The other engine's ranks this plan touches, ascending."""
        col = "src_rank" if self.map.mode is Mode.PULL else "dst_rank"
        return tuple(int(x) for x in np.unique(self.rows[col]))

    @property
    def nbytes(self) -> int:
        """Total bytes copied."""
        return int(self.rows["length"].sum())

    def __len__(self) -> int:
        return len(self.rows)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransferPlan):
            return NotImplemented
        return (
            self.map == other.map
            and len(self.src_blocks) == len(other.src_blocks)
            and all(map(np.array_equal, self.src_blocks, other.src_blocks))
            and all(map(np.array_equal, self.dst_blocks, other.dst_blocks))
            and np.array_equal(self.rows, other.rows)
            and self.tokens == other.tokens
            and self.dst_from == other.dst_from
            and self.regions == other.regions
        )

    __hash__ = None  # type: ignore[assignment]  # holds arrays: a value, but not hashable

    def summary(self) -> str:
        """Per peer rank: bytes, runs, and per set of alike regions (layers of one geometry on
        one line, ``layers.[0-79].attn x80``) its placement, streams, bytes and runs."""
        return hooks.call("plan_summary", self)

    def _scope(self) -> str:
        """The request's token range (and list anchoring) and a part's regions, for summary."""
        out = ""
        if self.tokens is not None:
            anchor = ", destination lists from start" if self.dst_from == "start" else ""
            out += f", tokens {self.tokens[0]}:{self.tokens[1]}{anchor}"
        if self.regions is not None:
            names = [self.map.dst.regions[j].name for j in self.regions]
            shown = ", ".join(names[:3]) + (f", ... ({len(names)})" if len(names) > 3 else "")
            out += f"; part of {len(self.map.dst.regions)} regions: {shown}"
        return out

    def __repr__(self) -> str:
        m = self.map
        return (
            f"TransferPlan(mode={m.mode.value}, rank={m.rank}, peers={list(self.peers)}, "
            f"runs={len(self)}, nbytes={self.nbytes})"
        )

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        """Per peer rank, an HTML table of this request's bytes and runs (notebooks)."""
        return hooks.call("plan_html", self)

    def to_pandas(self):
        """The copies as a pandas DataFrame with region names (needs pandas: ``kvplan[view]``)."""
        return hooks.call("plan_frame", self)

    def plot(self, ax=None):
        """Draw this plan's rank map with matplotlib (``kvplan[view]``); returns the Figure.

        For the whole picture of an engine pair, pass every rank's plan to
        :func:`kvplan.plot_rank_map`.
        """
        return hooks.call("plot_rank_map", self, ax=ax)
