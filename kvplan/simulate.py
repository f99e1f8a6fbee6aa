"""The reference executor: apply a plan to numpy byte buffers, for tests and notebooks."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import numpy as np

from kvplan.plan import TransferPlan
from kvplan.staging import Leg


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

    Buffers are 1-D ``uint8`` arrays keyed ``(rank, region_index)`` of each side's engine. A run
    outside its buffer raises ``IndexError`` (a plan never produces one). Vectorised per pair of
    buffers, so it is fast enough for plans of millions of runs.
    """
    rows = plan.copies()
    if len(rows) == 0:
        return
    key = np.stack(
        [rows["src_rank"], rows["src_region"], rows["dst_rank"], rows["dst_region"]], axis=1
    )
    pairs, which = np.unique(key, axis=0, return_inverse=True)
    for k, (sr, sg, dr, dg) in enumerate(pairs.tolist()):
        sel = rows[which.ravel() == k]
        src = src_buffers[(sr, sg)]
        dst = dst_buffers[(dr, dg)]
        for off, name, buf in (("src_offset", "source", src), ("dst_offset", "destination", dst)):
            end = int((sel[off] + sel["length"]).max())
            if int(sel[off].min()) < 0 or end > buf.size:
                raise IndexError(f"a run ends at {end} outside the {buf.size}-byte {name} buffer")
        dst[_byte_index(sel["dst_offset"], sel["length"])] = src[
            _byte_index(sel["src_offset"], sel["length"])
        ]
