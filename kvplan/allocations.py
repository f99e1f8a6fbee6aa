"""Rows across layer slots and buffers: the last step of a request, after the lanes' runs.

Regions naming one ``allocation`` are layer slots of one buffer, so the runs of different
lanes (regions) can be contiguous on both sides: with a ``BL...`` order one block of every
layer is one piece of memory. Templates and the per-lane merge (``plan.py``) work per region;
:func:`finish` then merges runs across the lanes of one (source rank, destination rank) whose
regions share an allocation on both sides, so a request costs one run per (peer, block run)
instead of one per layer. A merged run is reported under the lane (regions) of its first byte.
Last, the planner's offsets become (buffer, offset in that buffer) columns: a region with
separate K and V buffers is planned as one space, V after a one-block gap (see
:func:`kvplan.layout.kv_split`).

Numpy only: one lexsort and one linear pass over the rows; loops run over regions and lanes.
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
    src: EngineSpec, dst: EngineSpec, lanes: Sequence, rows: np.ndarray, bounds: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Merge runs across layer slots and fill the ``src_buffer``/``dst_buffer`` columns.

    ``rows`` (of ``kvplan.plan.COPY_DTYPE``) are grouped by lane, lane ``k`` being rows
    ``[bounds[k], bounds[k+1])``, sorted by destination offset within a lane. Returns new rows
    and bounds with the same grouping. Post-conditions: the bytes copied are unchanged; no two
    rows of one (source rank, destination rank) are contiguous on both sides within the same
    two buffers.
    """
    if any(_multi_slot(src, x.src_region) and _multi_slot(dst, x.dst_region)
           for x in lanes):
        rows, bounds = _merge_across_lanes(src, dst, len(lanes), rows, bounds)
    for side, spec in (("src", src), ("dst", dst)):
        buf, off = buffer_offsets(spec, rows[f"{side}_region"], rows[f"{side}_offset"])
        rows[f"{side}_buffer"] = buf
        rows[f"{side}_offset"] = off
    return rows, bounds


def _merge_across_lanes(
    src: EngineSpec, dst: EngineSpec, n_lanes: int, rows: np.ndarray, bounds: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    lane = np.repeat(np.arange(n_lanes, dtype=np.int64), np.diff(bounds))
    s_alloc = np.array([src.buffer_of(i) for i in range(len(src.regions))], dtype=np.int64)
    d_alloc = np.array([dst.buffer_of(i) for i in range(len(dst.regions))], dtype=np.int64)
    sa, da = s_alloc[rows["src_region"]], d_alloc[rows["dst_region"]]
    o = np.lexsort((rows["dst_offset"], da, sa, rows["dst_rank"], rows["src_rank"]))
    r, lane, sa, da = rows[o], lane[o], sa[o], da[o]
    ln = r["length"]
    joins = (
        (r["src_offset"][1:] == r["src_offset"][:-1] + ln[:-1])
        & (r["dst_offset"][1:] == r["dst_offset"][:-1] + ln[:-1])
        & (sa[1:] == sa[:-1]) & (da[1:] == da[:-1])
        & (r["src_rank"][1:] == r["src_rank"][:-1]) & (r["dst_rank"][1:] == r["dst_rank"][:-1])
    )
    if not joins.any():
        return rows, bounds
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = r[starts]
    merged["length"] = np.add.reduceat(ln, starts)
    lane = lane[starts]
    back = np.argsort(lane, kind="stable")  # lane order again, destination offset within
    return merged[back], np.searchsorted(lane[back], np.arange(n_lanes + 1)).astype(np.int64)
