"""The runs one source rank copies to one destination rank, in the order a digest reads them.

A transfer digest (``kvplan_nixl.digest``) checks that what a destination rank received from one
source rank is what that source rank holds. Both sides must read the same bytes in the same
order without exchanging their runs: :func:`pair_runs` orders a plan's runs of one rank pair by
their destination address (destination buffer, then offset). Since a plan writes each
destination byte at most once, that order concatenates the same byte stream however the runs
are cut or merged, so the source (its push plan, with its own run order) and the destination
(its pull plan) agree on it.

Layer 3 (the request), beside plan.py: reads a :class:`~kvplan.plan.TransferPlan`'s rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvplan.errors import RequestError

if TYPE_CHECKING:
    from kvplan.plan import TransferPlan


def pair_runs(plan: TransferPlan, src_rank: int, dst_rank: int) -> np.ndarray:
    """The rows of ``plan`` from ``src_rank`` to ``dst_rank``, sorted by destination address.

    A read-only structured array of :data:`kvplan.COPY_DTYPE` (empty when the pair copies
    nothing). Raises :class:`~kvplan.RequestError` for a rank that is not an int in range of
    its engine.
    """
    m = plan.map
    for name, r, n in (("src_rank", src_rank, m.src.num_ranks),
                       ("dst_rank", dst_rank, m.dst.num_ranks)):
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < n:
            raise RequestError(f"pair_runs: {name} must be an int in [0, {n}), got {r!r}")
    rows = plan.copies()
    sub = rows[(rows["src_rank"] == src_rank) & (rows["dst_rank"] == dst_rank)]
    # lexsort: the last key is the primary one
    out = sub[np.lexsort((sub["dst_offset"], sub["dst_buffer"]))]
    out.flags.writeable = False
    return out
