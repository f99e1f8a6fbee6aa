"""Byte runs: merging adjacent copies into maximal runs, vectorised with numpy.

Layer 1 (values): imports nothing from kvplan.
"""

from __future__ import annotations

import numpy as np


def merge_runs(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray, *keys: np.ndarray
) -> tuple[np.ndarray, ...]:
    """Merge each run into its predecessor when both sides continue it and all ``keys`` agree.

    Rows must be ordered so that a run's successor on the destination side, if any, is the next
    row (ordering by destination offset guarantees it). Returns ``(src, dst, length, *keys)`` of
    the merged rows. Post-conditions: total length unchanged; no two consecutive result rows are
    contiguous on both sides with equal keys.
    """
    n = len(length)
    if n <= 1:
        return (src, dst, length, *keys)
    joins = (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
    for k in keys:
        joins &= k[1:] == k[:-1]
    if not joins.any():
        return (src, dst, length, *keys)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return (
        src[starts],
        dst[starts],
        np.add.reduceat(length, starts),
        *(k[starts] for k in keys),
    )
