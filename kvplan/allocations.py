"""Rows across layer slots and buffers: the last step of a request, after the lanes' runs.

Regions naming one ``allocation`` are layer slots of one buffer, so the runs of different
lanes (regions) can be contiguous on both sides: with a ``BL...`` order one block of every
layer is one piece of memory. Templates and the per-lane merge (``plan.py``) work per region;
:func:`finish` then merges runs across the lanes of one (source rank, destination rank) whose
regions share an allocation on both sides, so a request costs one run per (peer, block run)
instead of one per layer. A merged run is reported under the lane (regions) of its first byte.
Last, a region with separate K and V buffers, planned as one space with V after a one-block
gap (see :func:`kvplan.layout.kv_split`), has its V runs moved to the V buffer's column and
offsets (``build_plan`` writes every lane's buffer, its K buffer for such a region).

Numpy only: one lexsort and one linear pass over the rows; loops run over regions and lanes.

Layer 2 (the handshake), beside the planner: imports the values (spec, layout) only; the
request stage (plan.py) calls it, never the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvplan.layout import buffer_offsets
from kvplan.spec import EngineSpec


def _multi_slot(spec: EngineSpec, index: int) -> bool:
    """True when region ``index`` is one of several layer slots of its allocation. (The views
    of one pool are one slot: their runs stay per region, as each belongs to its group.)"""
    return spec.slot_of(index)[1] > 1


def finish(
    src: EngineSpec, dst: EngineSpec, lanes: Sequence, rows: np.ndarray, bounds: np.ndarray,
    merge_slots: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Merge runs across layer slots; move V runs of separate K/V buffers to the V buffer.

    ``rows`` (of ``kvplan.plan.COPY_DTYPE``) are grouped by lane, lane ``k`` being rows
    ``[bounds[k], bounds[k+1])``, sorted by destination offset within a lane. Returns new rows
    and bounds with the same grouping. Post-conditions: the bytes copied are unchanged; no two
    rows of one (source rank, destination rank) are contiguous on both sides within the same
    two buffers (unless ``merge_slots`` is false: then runs stay within their lane).
    """
    if merge_slots and any(_multi_slot(src, x.src_region) and _multi_slot(dst, x.dst_region)
                           for x in lanes):
        rows, bounds = _merge_across_lanes(src, dst, lanes, rows, bounds)
    for side, spec in (("src", src), ("dst", dst)):  # build_plan wrote each lane's buffer
        regions = [getattr(x, f"{side}_region") for x in lanes]
        for lane in np.flatnonzero([spec.regions[i].separate_kv for i in regions]).tolist():
            at, end = int(bounds[lane]), int(bounds[lane + 1])  # K/V pairs: V past the split
            buf, off = buffer_offsets(spec, rows[f"{side}_region"][at:end],
                                      rows[f"{side}_offset"][at:end])
            rows[f"{side}_buffer"][at:end] = buf
            rows[f"{side}_offset"][at:end] = off
    return rows, bounds


def _merge_across_lanes(
    src: EngineSpec, dst: EngineSpec, lanes: Sequence, rows: np.ndarray, bounds: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    n_lanes = len(lanes)
    counts = np.diff(bounds)
    lane = np.repeat(np.arange(n_lanes, dtype=np.int64), counts)
    # lanes come sorted by (source rank, destination rank): number those pairs
    pair = np.array([(x.src_rank, x.dst_rank) for x in lanes], dtype=np.int64).reshape(-1, 2)
    peer = np.cumsum(np.concatenate(([0], (pair[1:] != pair[:-1]).any(axis=1)))).astype(np.int64)
    s_alloc = np.array(src.region_buffers, dtype=np.int64)
    d_alloc = np.array(dst.region_buffers, dtype=np.int64)
    lane_sa = s_alloc[[x.src_region for x in lanes]]
    lane_da = d_alloc[[x.dst_region for x in lanes]]
    so, do, ln = rows["src_offset"], rows["dst_offset"], rows["length"]
    # One int64 key: (peer pair, destination buffer) above the offset bits. Within one key
    # destination ranges are disjoint, so a run's successor on both sides is the next row.
    shift = max(1, int(do.max()).bit_length()) if len(do) else 1
    group = peer * len(dst.buffers) + lane_da
    if int(group.max()).bit_length() + shift > 62:  # would not fit one int64: sort by columns
        o = np.lexsort((do, np.repeat(group, counts)))
    else:
        group = group << shift
        o = np.argsort(np.repeat(group, counts) + do, kind="stable")
    so, do, ln, lane = so[o], do[o], ln[o], lane[o]
    sa = lane_sa[lane]
    key = np.repeat(group, counts)[o]
    joins = (
        (so[1:] == so[:-1] + ln[:-1]) & (do[1:] == do[:-1] + ln[:-1])
        & (sa[1:] == sa[:-1]) & (key[1:] == key[:-1])
    )
    if not joins.any():
        return rows, bounds
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(ln, starts)
    lane = lane[starts]
    back = np.argsort(lane, kind="stable")  # lane order again, destination offset within
    merged = rows[o[starts[back]]]
    merged["length"] = lengths[back]
    return merged, np.searchsorted(lane[back], np.arange(n_lanes + 1)).astype(np.int64)
