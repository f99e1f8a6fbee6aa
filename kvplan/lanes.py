"""The handshake's values: lanes and the per-block copy templates they carry.

A *lane* is what one destination rank copies of one region from one source rank; its
:class:`BlockTemplate` (one per phase) is the copy of one destination block, relative to block
bases, built once at handshake by :func:`build_template` from the two ``RankLayout``s
(docs/design.md, "the one rule"). These are values: the planner (``planner.py``) builds them
into a ``TransferMap``, the request stage (``request.py``) broadcasts their templates over block
ids, and a ``TransferPlan`` (``plan.py``) keeps the map they belong to. They sit in a module of
their own so that all three import them from below, and none of those imports another upward.

Layer 2 (the handshake's values): imports the values of layer 1 (layout, placement, cp, granules,
runs, spec) only. :class:`LaneMap` names what the layers above read of a ``TransferMap``, so
that the request stage and the plan never import the planner, not even for a type hint.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

import attrs
import numpy as np

from kvplan import cp
from kvplan.granules import phase_offset
from kvplan.layout import RankLayout
from kvplan.placement import Placement, TokenSharding
from kvplan.runs import merge_runs
from kvplan.spec import EngineSpec


class Mode(enum.Enum):
    """Who plans and posts: the destination reads (pull) or the source writes (push)."""

    PULL = "pull"
    PUSH = "push"


def frozen(a: np.ndarray) -> np.ndarray:
    """``a`` as a read-only contiguous int64 array (a value's arrays never change)."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.flags.writeable = False
    return a


class ReadOnlyArrays:
    """Mixin for frozen attrs classes holding numpy arrays: they stay read-only through pickle.

    (Unpickled arrays are fresh and writeable; a value must not become mutable by a round trip.)
    """

    __slots__ = ()

    def __getstate__(self) -> dict:
        return {f.name: getattr(self, f.name) for f in attrs.fields(type(self))}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            for a in value if isinstance(value, tuple) else (value,):
                if isinstance(a, np.ndarray):
                    a.flags.writeable = False
            object.__setattr__(self, name, value)


@attrs.frozen(eq=False, repr=False, getstate_setstate=False)
class BlockTemplate(ReadOnlyArrays):
    """The runs that copy one destination block of one lane, relative to block bases.

    ``js[k]`` is the source block position of run ``k`` relative to the first source block the
    destination block touches; ``src[k]``/``dst[k]`` are byte offsets from the base of that source
    block / of destination block 0 (so a split layout's V stream sits ``num_blocks`` blocks up);
    runs are sorted by ``dst``. The ``atom_*`` arrays are the same copy before merging across
    tokens, one row per (stream, token, unit run), for partially covered blocks.
    """

    src_bs: int
    dst_bs: int
    src_block: int  # byte stride of a block on each side
    dst_block: int
    js: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    slabs: tuple[tuple[int, int], ...]  # row ranges with one dst slab (a split layout's stream)
    atom_token: np.ndarray
    atom_js: np.ndarray
    atom_src: np.ndarray
    atom_dst: np.ndarray
    atom_length: np.ndarray

    @property
    def granule(self) -> int:
        """Largest byte count dividing every offset and length this template can produce."""
        parts = [self.src_block, self.dst_block, self.atom_length, self.atom_src, self.atom_dst]
        return int(np.gcd.reduce(np.concatenate([np.ravel(p) for p in parts])))


@attrs.frozen
class UnitRange:
    """Global units ``[start, stop)`` of component ``component`` (0 but for state parts)."""

    component: int
    start: int
    stop: int


def build_template(
    src: RankLayout,
    dst: RankLayout,
    units: Sequence[UnitRange],
    phase: int = 0,
    src_tokens: TokenSharding | None = None,
    dst_tokens: TokenSharding | None = None,
    src_dcp_rank: int = 0,
    dst_dcp_rank: int = 0,
) -> BlockTemplate:
    """Template for copying ``units`` of one destination block from the source layout.

    A block id covers ``span`` request positions on each side (``block_size``, times the DCP
    size: ``*_tokens``); the template covers the positions of one destination block id that
    ``dst_dcp_rank`` holds and ``src_dcp_rank`` holds on the source side (all of them without
    DCP). ``phase`` is the destination block's position modulo ``granules.phases`` (0 when
    source blocks divide destination blocks): its positions start at
    ``granules.phase_offset(phase, ...)`` of the first source block it touches.
    """
    s_tok = src_tokens or TokenSharding(src.block_size)
    d_tok = dst_tokens or TokenSharding(dst.block_size)
    src_bs, dst_bs = s_tok.span, d_tok.span
    t_all = np.arange(dst_bs)
    start = phase_offset(phase, src_bs, dst_bs)  # where the block starts in its source block
    p_all = start + t_all  # position counted from the first source block touched
    # need ∩ hold, on the token axis: positions this destination rank holds and this source
    # rank holds (every position when neither side shards tokens).
    mine = (d_tok.holder(t_all) == dst_dcp_rank) & (s_tok.holder(p_all % src_bs) == src_dcp_rank)
    t_kept = t_all[mine]
    cols: list[list[np.ndarray]] = [[], [], [], [], []]
    for ur in units:
        s, u, t = np.meshgrid(
            np.arange(dst.components[ur.component].streams),
            np.arange(ur.start, ur.stop),
            t_kept,
            indexing="ij",
        )
        s, u, t = s.ravel(), u.ravel(), t.ravel()
        p = start + t
        for col, v in zip(cols, (
            src.offset(ur.component, s, 0, u, s_tok.local(p % src_bs)),
            dst.offset(ur.component, s, 0, u, d_tok.local(t)),
            np.full(len(t), dst.components[ur.component].unit_bytes, dtype=np.int64),
            p // src_bs,
            t,
        )):
            col.append(np.asarray(v, dtype=np.int64))
    a_src, a_dst, a_len, js, t = (np.concatenate(c) for c in cols)
    order = np.argsort(a_dst, kind="stable")
    a_src, a_dst, a_len, js, t = a_src[order], a_dst[order], a_len[order], js[order], t[order]
    # Atoms: merge only within a token (heads side by side in NHD, parts of a state slot).
    a_src, a_dst, a_len, js, t = merge_runs(a_src, a_dst, a_len, js, t)
    # Template: merge everything contiguous on both sides within one source block.
    f_src, f_dst, f_len, f_js = merge_runs(a_src, a_dst, a_len, js)
    slab = f_dst // dst.block
    bounds = np.flatnonzero(np.concatenate(([True], slab[1:] != slab[:-1], [True])))
    slabs = tuple(zip(bounds[:-1].tolist(), bounds[1:].tolist())) if len(f_dst) else ()
    return BlockTemplate(
        src_bs=src_bs,
        dst_bs=dst_bs,
        src_block=src.block,
        dst_block=dst.block,
        js=frozen(f_js),
        src=frozen(f_src),
        dst=frozen(f_dst),
        length=frozen(f_len),
        slabs=slabs,
        atom_token=frozen(t),
        atom_js=frozen(js),
        atom_src=frozen(a_src),
        atom_dst=frozen(a_dst),
        atom_length=frozen(a_len),
    )


@attrs.frozen(repr=False)
class Lane:
    """What one destination rank copies of one region from one source rank (flat ranks).

    ``units`` are the heads (or state-part units) it reads; ``templates`` holds one block
    template per phase (several unless source blocks divide destination blocks), and
    is shared by every lane of identical geometry (e.g. all layers of a model).
    """

    src_rank: int
    dst_rank: int
    src_region: int
    dst_region: int
    units: tuple[UnitRange, ...]
    placement: Placement
    group: int
    window: int | None
    templates: tuple[BlockTemplate, ...] = attrs.field(eq=False)
    #: the source region's KV-cache group: its block ids come from that group's source list
    #: (``group`` is the destination's; they differ where the two sides group regions apart)
    src_group: int = 0

    def describe(self, dst: EngineSpec) -> str:
        """Placement in the compact notation: ``R``, ``S(heads 0:4)``, ``S(x 0:2048, B 0:2)``,
        followed by the destination rank's token slice under DCP or sharded PCP (``DCP 1/2
        (positions 1:2 of every 2)``: not ``R``, the rank holds only those positions) and its
        replica under replicated PCP (``R PCP replica 1/2``)."""
        region = dst.regions[self.dst_region]
        context = cp.cp_label(dst, self.dst_rank, region)
        if self.placement is Placement.REPLICATE:
            sharded = dst.dcp_size > 1 and not region.is_state
            return context if sharded else " ".join(x for x in ("R", context) if x)
        names = [c.name if region.is_state else "heads" for c in region.components]
        units = ", ".join(f"{names[u.component]} {u.start}:{u.stop}" for u in self.units)
        return " ".join(x for x in (f"S({units})", context) if x)

    def __repr__(self) -> str:
        units = ", ".join(f"c{u.component} {u.start}:{u.stop}" for u in self.units)
        return (
            f"Lane(p{self.src_rank} L{self.src_region} -> d{self.dst_rank} L{self.dst_region}, "
            f"{self.placement.value}, {units})"
        )


class LaneMap(Protocol):
    """What the request stage and a plan read of the map they come from: its two engines, its
    mode and rank, its lanes and their indexes. :class:`kvplan.TransferMap` (planner.py, a layer
    up) is the one kind there is, and ``TransferPlan.map`` is that map. Naming the fields here
    lets request.py and plan.py say what they read without importing the planner, which
    imports them (``TransferMap.plan`` calls :func:`kvplan.request.build_plan`)."""

    src: EngineSpec
    dst: EngineSpec
    mode: Mode
    rank: int
    lanes: tuple[Lane, ...]
    #: destination region index -> indices of its lanes (ascending)
    region_lanes: dict[int, tuple[int, ...]]
    #: region name -> destination region index
    region_ids: dict[str, int]
