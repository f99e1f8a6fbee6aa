"""The request stage: block ids -> the read-only array of byte copies, by numpy index arithmetic.

For each lane's template (see ``planner.py``) the destination blocks a request fully covers are
taken in ascending block-id order and the template is broadcast over them: offsets are
``block_id * block_stride + template_offset``. Rows then come out sorted by destination offset
within a lane, so one pass of :func:`kvplan.runs.merge_runs` joins every pair of runs that is
contiguous on both sides -- across consecutive block ids too -- and the result is the smallest
list of maximal runs. There is no Python loop per block, token or copy: loops run over templates
and lanes (at most regions x peer ranks), and over the at most two partially covered blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

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


def _block_lists(spec: EngineSpec, lists: Sequence, side: str) -> tuple[np.ndarray, ...]:
    """Validate one side's block ids: one list per group, ids in range and unique."""
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
        bad = np.flatnonzero((a < 0) | (a >= limit))  # before the cast: uint64 must not wrap
        if bad.size:
            raise RequestError(
                f"{side} group {g}: block id {int(a[bad[0]])} at position {int(bad[0])} is out of "
                f"range [0, {limit}) (region {holder!r} has {limit} blocks)"
            )
        a = a.astype(np.int64)
        s = np.sort(a)
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
        s = np.sort(ids)
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
    rows: slice | np.ndarray,
    js: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    length: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of template pieces ``rows`` for destination block positions ``pos`` (block-major)."""
    s_pos = pos * tpl.dst_bs // tpl.src_bs  # first source block each destination block touches
    src_off = src_ids[s_pos[:, None] + js[rows]] * tpl.src_block + src[rows]
    dst_off = (dst_ids[pos] * tpl.dst_block)[:, None] + dst[rows]
    lens = np.broadcast_to(length[rows], dst_off.shape)
    return src_off.ravel(), dst_off.ravel(), lens.ravel()


def _lane_runs(
    lane: Lane, src_ids: np.ndarray, dst_ids: np.ndarray, order_cache: dict
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merged ``(src_offset, dst_offset, length)`` of one lane, sorted by destination offset."""
    tpls = lane.templates
    bs, phases = tpls[0].dst_bs, len(tpls)
    n = min(len(src_ids) * tpls[0].src_bs, len(dst_ids) * bs)  # positions both sides cover
    lo = 0 if lane.window is None else max(0, n - (lane.window // bs + 1) * bs)
    j0, j1 = -(-lo // bs), n // bs  # destination blocks covered in full
    key = (lane.group, j0, j1)
    pos = order_cache.get(key)
    if pos is None:  # ascending block id, so that rows come out in destination-offset order
        pos = j0 + np.argsort(dst_ids[j0:j1]) if j1 > j0 else np.zeros(0, np.int64)  # ids unique
        order_cache[key] = pos
    parts = []
    for ph, tpl in enumerate(tpls):  # one phase unless source blocks are larger
        pos_ph = pos if phases == 1 else pos[pos % phases == ph]
        parts += [
            _expand(tpl, pos_ph, src_ids, dst_ids, slice(a, b), tpl.js, tpl.src, tpl.dst,
                    tpl.length)
            for a, b in tpl.slabs
        ]
    partial = {j for j in (lo // bs, n // bs) if j * bs < n and not j0 <= j < j1}
    for j in sorted(partial):  # at most two blocks: keep only the atoms of covered tokens
        tpl = tpls[j % phases]
        t_lo, t_hi = max(lo, j * bs) - j * bs, min(n, (j + 1) * bs) - j * bs
        keep = np.flatnonzero((tpl.atom_token >= t_lo) & (tpl.atom_token < t_hi))
        parts.append(
            _expand(tpl, np.array([j]), src_ids, dst_ids, keep, tpl.atom_js, tpl.atom_src,
                    tpl.atom_dst, tpl.atom_length)
        )
    if not parts:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    src_off, dst_off, length = (np.concatenate(c) for c in zip(*parts))
    if partial or phases > 1:  # a few sorted sequences: a stable sort merges them fast
        o = np.argsort(dst_off, kind="stable")
        src_off, dst_off, length = src_off[o], dst_off[o], length[o]
    return merge_runs(src_off, dst_off, length)


def build_plan(tmap: TransferMap, src_blocks: Sequence, dst_blocks: Sequence) -> TransferPlan:
    """Expand ``tmap``'s lanes over one request's block ids (see :meth:`TransferMap.plan`)."""
    src_lists = _block_lists(tmap.src, src_blocks, "source")
    dst_lists = _block_lists(tmap.dst, dst_blocks, "destination")
    for g in sorted({r.group for r in tmap.dst.regions if r.is_state}):
        if len(src_lists[g]) != len(dst_lists[g]):
            raise RequestError(
                f"group {g} holds state slots: {len(src_lists[g])} source slot(s) but "
                f"{len(dst_lists[g])} destination slot(s); the j-th source slot goes to the "
                "j-th destination slot, so the lists must be equally long"
            )
    order_cache: dict = {}
    by_template: dict = {}
    lane_rows = []
    for lane in tmap.lanes:
        g = lane.group
        key = (id(lane.templates), g, lane.window)  # identical lanes (layers) share their runs
        runs = by_template.get(key)
        if runs is None:
            runs = _lane_runs(lane, src_lists[g], dst_lists[g], order_cache)
            by_template[key] = runs
        lane_rows.append(runs)
    bounds = np.cumsum([0] + [len(r[2]) for r in lane_rows])
    out = np.empty(int(bounds[-1]), dtype=COPY_DTYPE)
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
    out, bounds = finish(tmap.src, tmap.dst, tmap.lanes, out, bounds)  # layer slots, buffers
    out.flags.writeable = False
    return TransferPlan(
        map=tmap, src_blocks=src_lists, dst_blocks=dst_lists, rows=out, lane_bounds=_frozen(bounds)
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
        )

    __hash__ = None  # type: ignore[assignment]  # holds arrays: a value, but not hashable

    def summary(self) -> str:
        """Per peer rank: bytes, runs, and per set of alike regions (layers of one geometry on
        one line, ``layers.[0-79].attn x80``) its placement, streams, bytes and runs."""
        from kvplan.views import plan_summary

        return plan_summary(self)

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
        from kvplan.views import plan_html

        return plan_html(self)

    def to_pandas(self):
        """The copies as a pandas DataFrame with region names (needs pandas: ``kvplan[view]``)."""
        from kvplan.views import plan_frame

        return plan_frame(self)

    def plot(self, ax=None):
        """Draw this plan's rank map with matplotlib (``kvplan[view]``); returns the Figure.

        For the whole picture of an engine pair, pass every rank's plan to
        :func:`kvplan.plot_rank_map`.
        """
        from kvplan.views import plot_rank_map

        return plot_rank_map(self, ax=ax)
