"""The request stage: block ids -> the read-only array of byte copies, by numpy index arithmetic.

For each lane's template (see ``lanes.py``) the destination blocks a request fully covers are
taken in ascending block-id order and the template is broadcast over them: offsets are
``block_id * block_stride + template_offset``. Rows then come out sorted by destination offset
within a lane, so one pass of :func:`kvplan.runs.merge_runs` joins every pair of runs that is
contiguous on both sides -- across consecutive block ids too -- and the result is the smallest
list of maximal runs. There is no Python loop per block, token or copy: loops run over templates
and lanes (at most regions x peer ranks), and over the at most two partially covered blocks.

Layer 3 (the request): imports the lanes (lanes.py), allocations, runs, regroup and the values
below, and builds the :class:`~kvplan.plan.TransferPlan` value beside it; ``TransferMap.plan``
(planner.py, above) calls :func:`build_plan`. The map is named by what this stage reads of it
(:class:`kvplan.lanes.LaneMap`): this module never imports the planner.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvplan.allocations import finish
from kvplan.errors import RequestError
from kvplan.lanes import BlockTemplate, Lane, LaneMap, Mode, frozen
from kvplan.plan import COPY_DTYPE, TransferPlan
from kvplan.regroup import check_state_slots
from kvplan.runs import merge_runs
from kvplan.spec import EngineSpec


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


def lane_span(
    tmap: LaneMap, lane: Lane, n_src: int, n_dst: int, tokens: tuple[int, int] | None,
    dst_from: str,
) -> tuple[int, int, int]:
    """``(lo, hi, dst_first)`` of one lane for a request (see :meth:`TransferMap.plan`): the
    request positions ``[lo, hi)`` the lane copies (a sliding window's last blocks only) and the
    position, in destination blocks, where the destination list starts (``dst_from``).

    ``n_src`` / ``n_dst`` are the lengths of the lane's two block lists, ``tokens`` the
    request's range (``None``: what both lists cover). Raises :class:`~kvplan.RequestError`
    naming the group and region when the lists do not cover ``tokens``. The plan's rows are
    built from it, and ``kvplan.views.blocks_written`` counts the blocks a plan writes by it.
    """
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


def _lane_nbytes(lane: Lane, src_ids: np.ndarray, dst_ids: np.ndarray,
                 span: tuple[int, int, int]) -> int:
    """The bytes :func:`_lane_runs` would copy for this lane, counted, not expanded: each
    template's bytes per source block offset (``js``) over the block positions both sides
    hold (O(positions x distinct offsets), no row per piece)."""
    tpls = lane.templates
    bs, phases = tpls[0].dst_bs, len(tpls)
    lo, n, dst_first = span
    j0, j1 = -(-lo // bs), n // bs
    pos = np.arange(j0, max(j0, j1), dtype=np.int64)
    total = 0
    for ph, tpl in enumerate(tpls):
        p = pos if phases == 1 else pos[pos % phases == ph]
        if not p.size or not len(tpl.length):
            continue
        js, inv = np.unique(tpl.js, return_inverse=True)
        per_j = np.zeros(len(js), np.int64)
        np.add.at(per_j, inv.ravel(), tpl.length)
        held = src_ids[(p * tpl.dst_bs // tpl.src_bs)[:, None] + js] != ABSENT
        held &= (dst_ids[p - dst_first] != ABSENT)[:, None]
        total += int((held * per_j).sum())
    for j in {j for j in (lo // bs, n // bs) if j * bs < n and not j0 <= j < j1}:
        tpl = tpls[j % phases]  # a partly covered block: the atoms of its covered tokens
        t_lo, t_hi = max(lo, j * bs) - j * bs, min(n, (j + 1) * bs) - j * bs
        keep = (tpl.atom_token >= t_lo) & (tpl.atom_token < t_hi)
        if dst_ids[j - dst_first] == ABSENT or not keep.any():
            continue
        s_held = src_ids[j * tpl.dst_bs // tpl.src_bs + tpl.atom_js[keep]] != ABSENT
        total += int(tpl.atom_length[keep][s_held].sum())
    return total


def _checked_request(tmap: LaneMap, src_blocks: Sequence, dst_blocks: Sequence,
                     tokens: tuple[int, int] | None, dst_from: str) -> tuple:
    """One request's arguments checked as planning checks them: its token range, and its
    source and destination block lists per group (``plan_nbytes`` and ``build_plan`` refuse
    the same inputs with the same errors)."""
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
    return rng, src_lists, dst_lists


def plan_nbytes(
    tmap: LaneMap,
    src_blocks: Sequence,
    dst_blocks: Sequence,
    tokens: tuple[int, int] | None = None,
    dst_from: str = "zero",
) -> dict[int, int]:
    """The bytes ``tmap.plan(src_blocks, dst_blocks, tokens=..., dst_from=...)`` would copy, per
    peer rank of the map (``tmap.peers``: source ranks of a pull map, destination ranks of a
    push map), without building the plan: the same checks first (a
    :class:`~kvplan.RequestError` where planning would raise one), then each lane's bytes
    counted over the block positions both sides hold. It costs a small part of planning (no
    row per run is made, sorted or merged), so a server can refute a peer's claim of a plan's
    size before it plans (the staged server's OPEN: docs/executor.md)."""
    rng, src_lists, dst_lists = _checked_request(tmap, src_blocks, dst_blocks, tokens, dst_from)
    peer = "src_rank" if tmap.mode is Mode.PULL else "dst_rank"
    by_template: dict = {}
    out: dict[int, int] = {}
    for lane in tmap.lanes:
        g = lane.group
        key = (id(lane.templates), lane.src_group, g, lane.window)  # as build_plan shares runs
        n = by_template.get(key)
        if n is None:
            s_ids, d_ids = src_lists[lane.src_group], dst_lists[g]
            state = tmap.dst.regions[lane.dst_region].is_state
            span = lane_span(tmap, lane, len(s_ids), len(d_ids), None if state else rng, dst_from)
            n = by_template[key] = _lane_nbytes(lane, s_ids, d_ids, span)
        r = getattr(lane, peer)
        out[r] = out.get(r, 0) + n
    return out


def build_plan(
    tmap: LaneMap,
    src_blocks: Sequence,
    dst_blocks: Sequence,
    tokens: tuple[int, int] | None = None,
    dst_from: str = "zero",
    merge_slots: bool = True,
) -> TransferPlan:
    """Expand ``tmap``'s lanes over one request's block ids (see :meth:`TransferMap.plan`)."""
    rng, src_lists, dst_lists = _checked_request(tmap, src_blocks, dst_blocks, tokens, dst_from)
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
            span = lane_span(tmap, lane, len(s_ids), len(d_ids), None if state else rng, dst_from)
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
        map=tmap, src_blocks=src_lists, dst_blocks=dst_lists, rows=out, lane_bounds=frozen(bounds),
        tokens=rng, dst_from=dst_from, spans_regions=len(out) < runs,
    )
