"""A request's plan as a value: the read-only array of byte runs, and the parts of it.

:class:`TransferPlan` is what ``TransferMap.plan`` returns (built by :mod:`kvplan.request`):
the runs of one request as a structured array of :data:`COPY_DTYPE`, grouped by lane, with the
map, the block ids and the token range it was planned for. :meth:`TransferPlan.part` slices it
by region without re-planning (layer-wise posting).

Layer 3 (the request), beside request.py: imports the lanes' values (lanes.py) and errors. The
map a plan keeps is a ``TransferMap``, built a layer up; this module names it by what a plan
reads of it (:class:`kvplan.lanes.LaneMap`) and never imports the planner.
Its presentation methods (``summary``, ``_repr_html_``, ``to_pandas``, ``plot``) import
:mod:`kvplan.views` inside the method, as numpy and pandas do for optional presentation code.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import numpy as np

from kvplan.errors import RequestError
from kvplan.lanes import LaneMap, Mode, ReadOnlyArrays, frozen

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

    map: LaneMap  # the TransferMap it was planned from
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
            lane_bounds=frozen(bounds), tokens=self.tokens, dst_from=self.dst_from,
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
        from kvplan.views import plan_summary  # presentation: imported when shown

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
