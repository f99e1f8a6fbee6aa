"""The one planning rule, at handshake: need ∩ hold -> per-block copy templates.

Theory of operation. A destination rank needs, for each region its pipeline stage holds, every
(component, stream, unit, token) of the blocks a request names, for the units it holds: a unit
is a KV head, the single latent of an MLA or indexer layer, or a channel group / head of one part
of a state slot. ``placement.head_sources`` says which source rank (of the source stage holding
the region) serves each unit, each exactly once, replicas spread evenly. For one (source rank,
destination rank, region) -- a *lane* -- the copy of one destination block is the same every time
up to the block ids: an atom per (component, stream, unit, token) of ``unit_bytes``, its offsets
on both sides given by the two ``RankLayout``s. We build those atoms once, relative to block
bases, and merge the ones contiguous on both sides into a *template* of runs. Blocks of
different sizes are handled by token arithmetic: destination token ``t`` of block position ``j``
is request position ``j*bs_dst + t``, at source block position ``(j*bs_dst + t) // bs_src``. A
destination block starts at one of ``bs_src // gcd(bs_src, bs_dst)`` *phases* inside its first
source block (``granules.py``: one when source blocks divide destination blocks, sizes need not
divide at all), each with its own template (kernel blocks make phases differ by more than a
shift). Nothing here depends on ``num_blocks``.

At request time (``request.py``) a template is only broadcast over the block ids with numpy; the
per-token atoms are kept for the at most two destination blocks a request covers partially
(a sliding window's first block, or a last block the other side does not fill).

Layer 4 (the handshake): imports the values (spec, layout, placement, compat), the lanes and
templates (lanes.py) and the request stage (request.py): ``TransferMap.plan`` calls
:func:`kvplan.request.build_plan`. Its presentation methods (``_repr_html_``, ``to_pandas``,
``plot``) import :mod:`kvplan.views` inside the method, as numpy and pandas do for optional
presentation code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kvplan import cp
from kvplan.compat import region_pairs
from kvplan.errors import SpecError
from kvplan.granules import phases
from kvplan.lanes import Lane, Mode, UnitRange, build_template
from kvplan.layout import rank_layout
from kvplan.placement import Placement, TokenSharding, head_sources
from kvplan.regions import stream_label
from kvplan.request import build_plan
from kvplan.spec import EngineSpec, RegionSpec

if TYPE_CHECKING:
    from kvplan.plan import TransferPlan


def _lanes_for_dst_rank(
    src: EngineSpec,
    dst: EngineSpec,
    dst_rank: int,
    pairs: Sequence[tuple[int, int]],
    cache: dict,
    only_src: int | None = None,
    spread: bool = True,
) -> list[Lane]:
    lanes = []
    t_rank = cp.tp_rank(dst, dst_rank)
    held = set(dst.regions_on(dst_rank))
    for i, j in pairs:
        if j not in held:
            continue
        sr, dr = src.regions[i], dst.regions[j]
        # Who holds which tokens: decode context parallelism shards token regions only.
        s_dcp, d_dcp = (1, 1) if dr.is_state else (src.dcp_size, dst.dcp_size)
        s_tok = TokenSharding(sr.block_size, s_dcp, src.dcp_interleave if s_dcp > 1 else 1)
        d_tok = TokenSharding(dr.block_size, d_dcp, dst.dcp_interleave if d_dcp > 1 else 1)
        # A side's DCP group is inside its TP group, or is its PCP ranks (sharded PCP); else
        # its PCP ranks are replicas: the source's spread the readers (``spread``), every
        # destination replica reads all it holds.
        s_sh, d_sh = src.pcp_sharded and s_dcp > 1, dst.pcp_sharded and d_dcp > 1
        s_rep = 1 if s_sh or not spread else src.pcp_size
        d_rep, d_q = (1, 0) if d_sh else (dst.pcp_size, cp.pcp_rank(dst, dst_rank))
        by_src: dict[int, list[UnitRange]] = {}
        for c, comp in enumerate(dr.components):
            for e in range(s_dcp):  # the tokens source DCP rank e holds
                for hs in head_sources(comp.units, src.tp_size, dst.tp_size, t_rank,
                                       src_dcp=1 if s_sh else s_dcp, dst_dcp=1 if d_sh else d_dcp,
                                       src_dcp_rank=0 if s_sh else e, src_pcp=s_rep,
                                       dst_pcp=d_rep, dst_pcp_rank=d_q):
                    base = cp.stage_base(src, src.stage_of(i), e if s_sh else hs.replica)
                    by_src.setdefault(base + hs.src_rank, []).append(
                        UnitRange(c, hs.start, hs.stop)
                    )
        placement = Placement.REPLICATE if dr.is_replicated else Placement.SPLIT
        d_lay = rank_layout(dst, j, dst_rank)
        n_phases = phases(s_tok.span, d_tok.span)
        for s_rank, units in sorted(by_src.items()):
            if only_src is not None and s_rank != only_src:
                continue
            s_lay = rank_layout(src, i, s_rank)
            ranks = (cp.dcp_rank(src, s_rank) if s_dcp > 1 else 0,  # DCP ranks of the lane
                     cp.dcp_rank(dst, dst_rank) if d_dcp > 1 else 0)
            key = (s_lay, d_lay, tuple(units), s_tok, d_tok, ranks)
            templates = cache.get(key)
            if templates is None:
                templates = tuple(build_template(s_lay, d_lay, units, ph, s_tok, d_tok, *ranks)
                                  for ph in range(n_phases))
                cache[key] = templates
            if not any(len(t.atom_length) for t in templates):
                continue  # DCP: this source rank holds none of the tokens this rank holds
            lanes.append(Lane(s_rank, dst_rank, i, j, tuple(units), placement, dr.group,
                              dr.window, templates, sr.group))
    return lanes


def _check_specs(src: object, dst: object) -> None:
    for side, spec in (("src", src), ("dst", dst)):
        if not isinstance(spec, EngineSpec):
            raise SpecError(f"{side} must be an EngineSpec (EngineSpec.from_dict), got "
                            f"{type(spec).__name__}")


def _check_rank(spec: EngineSpec, rank: int, side: str) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < spec.num_ranks:
        raise SpecError(f"{side} rank {rank!r} is not in [0, {spec.num_ranks})")


@attrs.frozen(repr=False)
class TransferMap:
    """The handshake stage: every lane one rank takes part in, for a pair of engines.

    Build with :func:`pull_map` (this rank is the destination and reads) or :func:`push_map`
    (this rank is the source and writes); then call :meth:`plan` per request. Two maps are equal
    when they were built from equal specs, mode and rank.
    """

    src: EngineSpec
    dst: EngineSpec
    mode: Mode
    rank: int
    lanes: tuple[Lane, ...] = attrs.field(eq=False)
    #: destination region index -> indices of its lanes (ascending): what a plan's part slices
    region_lanes: dict[int, tuple[int, ...]] = attrs.field(init=False, eq=False, repr=False)
    #: region name -> destination region index (names pair the two engines' regions)
    region_ids: dict[str, int] = attrs.field(init=False, eq=False, repr=False)
    #: destination region index -> :meth:`granule` (computed once: the request path reads it)
    region_granules: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        by_region: dict[int, list[int]] = {}
        for k, lane in enumerate(self.lanes):
            by_region.setdefault(lane.dst_region, []).append(k)
        object.__setattr__(self, "region_lanes", {j: tuple(v) for j, v in by_region.items()})
        object.__setattr__(self, "region_ids", {r.name: j for j, r in enumerate(self.dst.regions)})
        lanes = self.lanes
        object.__setattr__(self, "region_granules", tuple(
            math.gcd(*(t.granule for k in self.region_lanes.get(j, ()) for t in lanes[k].templates))
            for j in range(len(self.dst.regions))))

    @property
    def peers(self) -> tuple[int, ...]:
        """Ranks of the other engine this map copies from (pull) or to (push), ascending."""
        attr = "src_rank" if self.mode is Mode.PULL else "dst_rank"
        return tuple(sorted({getattr(lane, attr) for lane in self.lanes}))

    def granule(self, name: str) -> int:
        """Bytes dividing every offset and length of any plan's runs for region ``name``.

        Lets an executor describe a region once as equal granules (NIXL's strided descriptors)
        and address every run by granule indices. 0 when this map copies nothing of the region.
        """
        return self.region_granules[self.dst.region_index(name)]

    def plan(
        self,
        src_blocks: Sequence,
        dst_blocks: Sequence,
        *,
        tokens: tuple[int, int] | None = None,
        dst_from: str = "zero",
        merge_slots: bool = True,
    ) -> TransferPlan:
        """The byte copies for one request: one block-id sequence per KV-cache group per side.

        Element ``j`` of a group's list holds that side's request positions ``[j*V, (j+1)*V)``,
        ``V`` being the positions one block id covers (``block_size``, times ``dcp_size`` under
        decode context parallelism).

        - Without ``tokens`` the copied positions are those both lists cover,
          ``[0, min(len(src)*V_src, len(dst)*V_dst))``: lists of unequal length copy the shorter
          side's positions, as whole blocks of it.
        - ``tokens=(start, end)`` copies exactly positions ``[start, end)``, wherever ``start``
          and ``end`` fall inside blocks (a prefix-cache hit on the destination, a partly filled
          last block). Both lists start at position 0 unless ``dst_from="start"``: then each
          destination list starts at the block holding ``start`` -- the first block the
          destination lacks, as vLLM's connectors list it (they keep the last ``len(local)``
          remote blocks). The lists must cover the copied positions; longer lists are fine.

        A block id of ``-1`` (``kvplan.ABSENT``) marks a block position its side does not hold,
        such as vLLM's null blocks outside a sliding window: no run reads or writes it, and the
        positions it stands for are not copied (the other side's block there is untouched).

        A sliding-window region copies only the last ``(window // V_dst + 1) * V_dst`` of those
        positions, counted back from the end (``end``, or the covered length). State groups
        ignore ``tokens``: the ``j``-th source slot moves whole to the ``j``-th destination
        slot. Raises :class:`~kvplan.RequestError` (a ``ValueError``) for a wrong group count,
        an id out of range, a repeated id, or a range the lists do not cover, naming the group.

        ``merge_slots=False`` keeps every run inside one region even where the layer slots of
        one allocation are contiguous on both sides (``BL...`` orders). That costs more runs,
        and is what layer-wise posting needs: :meth:`TransferPlan.part` refuses a plan whose
        runs span several regions, since such a run would carry layers not computed yet.
        """
        return build_plan(self, src_blocks, dst_blocks, tokens, dst_from, merge_slots)

    def summary(self) -> str:
        """Per peer rank: each region's placement, head interval, streams and runs per block."""
        me = "d" if self.mode is Mode.PULL else "p"
        lines = [
            f"TransferMap {self.mode.value} {me}{self.rank}: source tp {self.src.tp_size} -> "
            f"destination tp {self.dst.tp_size}, {len(self.dst.regions)} regions, "
            f"peers {list(self.peers)}"
        ]
        dcp = (self.src.dcp_size, self.dst.dcp_size)
        for side, spec in (("source", self.src), ("destination", self.dst)):
            if spec.pcp_size > 1:
                how = "sharded (DCP over PCP)" if spec.pcp_sharded else "replicas"
                lines[0] += f"; PCP {side} {spec.pcp_size} {how}"
        if dcp != (1, 1):
            lines[0] += (f"; DCP source {dcp[0]} (interleave {self.src.dcp_interleave}), "
                         f"destination {dcp[1]} (interleave {self.dst.dcp_interleave})")
        for lane in self.lanes:
            r = self.dst.regions[lane.dst_region]
            tpls = lane.templates
            unit = "slot" if r.is_state else f"block of {r.block_size}"
            share = ""
            if dcp != (1, 1) and not r.is_state:  # phases differ: the mean per block id
                unit = f"block id ({tpls[0].dst_bs} positions)"
                share = (f", tokens of p-DCP rank {cp.dcp_rank(self.src, lane.src_rank)}"
                         f" held by d-DCP rank {cp.dcp_rank(self.dst, lane.dst_rank)}")
            if self.src.pcp_size > 1:  # which PCP rank of the source serves it
                share += f", from {cp.cp_label(self.src, lane.src_rank, r).split(', ')[-1]}"
            nbytes = sum(int(t.length.sum()) for t in tpls) / len(tpls)
            runs = sum(len(t.length) for t in tpls) / len(tpls)
            lines.append(
                f"  p{lane.src_rank} -> d{lane.dst_rank}  {r.name}: {lane.describe(self.dst)}, "
                f"{stream_notation(r)}, {nbytes:g} B and {runs:g} runs per {unit}{share}"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"TransferMap(mode={self.mode.value}, rank={self.rank}, src=tp{self.src.tp_size}, "
            f"dst=tp{self.dst.tp_size}, regions={len(self.dst.regions)}, lanes={len(self.lanes)}, "
            f"peers={list(self.peers)})"
        )

    def _repr_html_(self) -> str:
        """Per peer rank, an HTML table of what one destination block costs (notebooks)."""
        from kvplan.views import map_html  # presentation: imported when shown

        return map_html(self)

    def to_pandas(self):
        """One row per lane as a pandas DataFrame (needs pandas: ``kvplan[view]``)."""
        from kvplan.views import map_frame

        return map_frame(self)

    def plot(self, ax=None):
        """Draw this map's rank map with matplotlib (``kvplan[view]``); returns the Figure."""
        from kvplan.views import plot_rank_map

        return plot_rank_map(self, ax=ax)


def stream_notation(region: RegionSpec) -> str:
    """Stream notation for summaries: ``K+V``, ``K`` (key only; or K alone), ``V`` (V
    alone), or the parts of a state slot
    (``parts conv+ssm``); :meth:`TransferMap.summary` and ``TransferPlan.summary`` write it."""
    if region.is_state:
        return "parts " + "+".join(c.name for c in region.components)
    return stream_label(region)


def _sorted_lanes(lanes: list[Lane]) -> tuple[Lane, ...]:
    return tuple(sorted(lanes, key=lambda x: (x.src_rank, x.dst_rank, x.dst_region)))


def pull_map(
    src: EngineSpec, dst: EngineSpec, dst_rank: int, *, spread_pcp: bool = True
) -> TransferMap:
    """Handshake for destination rank ``dst_rank`` reading from the source engine.

    Where the source's PCP ranks are replicas, the destination ranks spread their reads over
    them (``spread_pcp``), or all read replica 0 (``spread_pcp=False``: vLLM's choice, and
    what :func:`push_map` sends). Raises :class:`~kvplan.IncompatibleLayoutError` when the
    specs cannot exchange KV.
    """
    _check_specs(src, dst)
    pairs = region_pairs(src, dst)
    _check_rank(dst, dst_rank, "destination")
    lanes = _lanes_for_dst_rank(src, dst, dst_rank, pairs, {}, spread=spread_pcp)
    return TransferMap(src, dst, Mode.PULL, dst_rank, _sorted_lanes(lanes))


def push_map(src: EngineSpec, dst: EngineSpec, src_rank: int) -> TransferMap:
    """Handshake for source rank ``src_rank`` writing to the destination engine.

    Its lanes are exactly the lanes of every destination rank's :func:`pull_map` (with
    ``spread_pcp=False``) whose source is ``src_rank``, so the union of all push plans equals
    the union of those pull plans. Where the source's PCP ranks are replicas only PCP rank 0
    sends (as vLLM 0.33 does): the maps of the other replicas are empty.
    """
    _check_specs(src, dst)
    pairs = region_pairs(src, dst)
    _check_rank(src, src_rank, "source")
    cache: dict = {}
    lanes = [
        lane
        for d in range(dst.num_ranks)
        for lane in _lanes_for_dst_rank(src, dst, d, pairs, cache, only_src=src_rank,
                                        spread=False)
    ]
    return TransferMap(src, dst, Mode.PUSH, src_rank, _sorted_lanes(lanes))
