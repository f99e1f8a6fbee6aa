"""The reference executor: apply a plan to numpy byte buffers, for tests and notebooks.

Layer 4 (built on plans): imports plan and staging; nothing in the core imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import numpy as np

from kvplan.plan import TransferPlan
from kvplan.staging import STAGING, Leg


def _byte_index(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every byte position covered by runs ``(offset, length)``, run after run."""
    total = int(lengths.sum())
    starts = np.repeat(offsets - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return starts + np.arange(total, dtype=np.int64)


def simulate(
    plan: TransferPlan | Leg,
    src_buffers: Mapping[tuple[int, int], np.ndarray],
    dst_buffers: MutableMapping[tuple[int, int], np.ndarray],
) -> None:
    """Copy every run of ``plan`` from ``src_buffers`` into ``dst_buffers``, in place.

    ``plan`` may also be one leg of a staged plan (``kvplan.staging``); a staging area is keyed
    ``(rank, STAGING)``.

    Buffers are 1-D ``uint8`` arrays keyed ``(rank, buffer name)`` (a name of the engine's
    ``EngineSpec.buffers``) or ``(rank, region_index)`` (the regions of one pool or allocation
    sharing one array; a region with separate K and V buffers needs the names). A run outside
    its buffer raises ``IndexError`` (a plan never produces one). Vectorised per pair of
    buffers, so it is fast enough for plans of millions of runs.
    """
    rows = plan.copies()
    if len(rows) == 0:
        return
    key = np.stack(
        [rows["src_rank"], rows["src_buffer"], rows["dst_rank"], rows["dst_buffer"]], axis=1
    )
    pairs, first, which = np.unique(key, axis=0, return_index=True, return_inverse=True)
    m = plan.map
    for k, (sr, sb, dr, db) in enumerate(pairs.tolist()):
        sel = rows[which.ravel() == k]
        row = rows[first[k]]
        src = _lookup(src_buffers, sr, _name(m.src, sb), int(row["src_region"]))
        dst = _lookup(dst_buffers, dr, _name(m.dst, db), int(row["dst_region"]))
        for off, name, buf in (("src_offset", "source", src), ("dst_offset", "destination", dst)):
            end = int((sel[off] + sel["length"]).max())
            if int(sel[off].min()) < 0 or end > buf.size:
                raise IndexError(f"a run ends at {end} outside the {buf.size}-byte {name} buffer")
        dst[_byte_index(sel["dst_offset"], sel["length"])] = src[
            _byte_index(sel["src_offset"], sel["length"])
        ]


def _name(spec, buffer: int):
    """A buffer's name, or :data:`~kvplan.staging.STAGING` for a staging area (a staged leg)."""
    return STAGING if buffer == STAGING else spec.buffers[buffer]


def _lookup(buffers: Mapping, rank: int, name: str, region: int) -> np.ndarray:
    """The array of buffer ``name`` of ``rank``: by name, else by a region living in it."""
    return buffers[(rank, name)] if (rank, name) in buffers else buffers[(rank, region)]
