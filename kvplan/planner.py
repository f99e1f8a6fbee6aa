"""The one planning rule, at handshake: need ∩ hold -> per-block copy templates.

Theory of operation. A destination rank needs, for each region, every (stream, head, token,
feature) of the blocks a request names, for the heads it holds. ``placement.head_sources`` says
which source rank serves each of those heads (each head exactly once, replicas spread evenly).
For one (source rank, destination rank, region) -- a *lane* -- the copy of one destination block
is then the same every time up to the block ids: an atom per (stream, head, token) of
``head_bytes``, its source and destination offsets given by the two ``RankLayout``s. We build
those atoms once, relative to block bases, and merge the ones contiguous on both sides into a
*template* of runs. Blocks of different sizes on the two sides are handled by token arithmetic:
destination token ``t`` of block position ``j`` is request position ``j*bs_dst + t``, which lives
in source block position ``(j*bs_dst + t) // bs_src``. Nothing here depends on ``num_blocks``.

At request time (``plan.py``) a template is only broadcast over the block ids with numpy; the
per-token atoms are kept for the at most two destination blocks a request covers partially
(a sliding window's first block, or a last block the other side does not fill).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np

from kvplan.compat import region_pairs
from kvplan.errors import SpecError
from kvplan.layout import RankLayout, rank_layout
from kvplan.placement import HeadSource, Placement, head_sources
from kvplan.runs import merge_runs
from kvplan.spec import EngineSpec

if TYPE_CHECKING:
    from kvplan.plan import TransferPlan


class Mode(enum.Enum):
    """Who plans and posts: the destination reads (pull) or the source writes (push)."""

    PULL = "pull"
    PUSH = "push"


def _frozen(a: np.ndarray) -> np.ndarray:
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
    tokens, one row per (stream, token, head run), for partially covered blocks.
    """

    src_bs: int
    dst_bs: int
    src_block: int  # byte stride of a block on each side
    dst_block: int
    src_token: int  # byte stride of a source token (the shift when bs_dst < bs_src)
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
        parts = [self.src_block, self.dst_block, self.src_token, self.atom_length, self.atom_src,
                 self.atom_dst]
        return int(np.gcd.reduce(np.concatenate([np.ravel(p) for p in parts])))


def build_template(
    src: RankLayout, dst: RankLayout, heads: range, src_bs: int, dst_bs: int
) -> BlockTemplate:
    """Template for copying ``heads`` of one destination block from the source layout."""
    s, h, t = np.meshgrid(
        np.arange(dst.streams), np.arange(heads.start, heads.stop), np.arange(dst_bs),
        indexing="ij",
    )
    s, h, t = s.ravel(), h.ravel(), t.ravel()
    js = t // src_bs
    a_src = src.offset(s, 0, h, t % src_bs)
    a_dst = dst.offset(s, 0, h, t)
    order = np.argsort(a_dst, kind="stable")
    a_src, a_dst, js, t = a_src[order], a_dst[order], js[order], t[order]
    a_len = np.full(len(order), dst.head_bytes, dtype=np.int64)
    # Atoms: merge only within a token (heads side by side in NHD), keeping token granularity.
    a_src, a_dst, a_len, js, t = merge_runs(a_src, a_dst, a_len, js, t)
    # Template: merge everything contiguous on both sides within one source block.
    f_src, f_dst, f_len, f_js = merge_runs(a_src, a_dst, a_len, js)
    slab = f_dst // dst.block
    bounds = np.flatnonzero(np.concatenate(([True], slab[1:] != slab[:-1], [True])))
    return BlockTemplate(
        src_bs=src_bs,
        dst_bs=dst_bs,
        src_block=src.block,
        dst_block=dst.block,
        src_token=src.token,
        js=_frozen(f_js),
        src=_frozen(f_src),
        dst=_frozen(f_dst),
        length=_frozen(f_len),
        slabs=tuple(zip(bounds[:-1].tolist(), bounds[1:].tolist())),
        atom_token=_frozen(t),
        atom_js=_frozen(js),
        atom_src=_frozen(a_src),
        atom_dst=_frozen(a_dst),
        atom_length=_frozen(a_len),
    )


@attrs.frozen(repr=False)
class Lane:
    """What one destination rank copies of one region from one source rank.

    ``template`` is shared by every lane of identical geometry (e.g. all layers of a model);
    ``window`` and ``group`` say which block ids and token positions a request covers.
    """

    src_rank: int
    dst_rank: int
    src_region: int
    dst_region: int
    heads: HeadSource
    placement: Placement
    group: int
    window: int | None
    template: BlockTemplate = attrs.field(eq=False)

    def __repr__(self) -> str:
        return (
            f"Lane(p{self.src_rank} L{self.src_region} -> d{self.dst_rank} L{self.dst_region}, "
            f"{self.placement.value}, heads {self.heads.start}:{self.heads.stop})"
        )


def _lanes_for_dst_rank(
    src: EngineSpec,
    dst: EngineSpec,
    dst_rank: int,
    pairs: Sequence[tuple[int, int]],
    cache: dict,
    only_src: int | None = None,
) -> list[Lane]:
    lanes = []
    for i, j in pairs:
        sr, dr = src.regions[i], dst.regions[j]
        placement = Placement.REPLICATE if dr.is_replicated else Placement.SPLIT
        d_lay = rank_layout(dr, dst.tp_size, dst_rank)
        for hs in head_sources(dr.heads, src.tp_size, dst.tp_size, dst_rank):
            if only_src is not None and hs.src_rank != only_src:
                continue
            s_lay = rank_layout(sr, src.tp_size, hs.src_rank)
            # Geometry relative to the first held head: identical layers share one template.
            key = (
                attrs.evolve(s_lay, first_head=0),
                attrs.evolve(d_lay, first_head=0),
                hs.start - s_lay.first_head,
                hs.start - d_lay.first_head,
                hs.stop - hs.start,
            )
            tpl = cache.get(key)
            if tpl is None:
                tpl = build_template(
                    s_lay, d_lay, range(hs.start, hs.stop), sr.block_size, dr.block_size
                )
                cache[key] = tpl
            lanes.append(
                Lane(hs.src_rank, dst_rank, i, j, hs, placement, dr.group, dr.window, tpl)
            )
    return lanes


def _check_rank(spec: EngineSpec, rank: int, side: str) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < spec.tp_size:
        raise SpecError(f"{side} rank {rank!r} is not in [0, {spec.tp_size})")


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
        j = self.dst.region_index(name)
        return math.gcd(*(lane.template.granule for lane in self.lanes if lane.dst_region == j))

    def plan(self, src_blocks: Sequence, dst_blocks: Sequence) -> TransferPlan:
        """The byte copies for one request: one block-id sequence per KV-cache group per side.

        Element ``j`` of a group's list holds that side's tokens ``[j*bs, (j+1)*bs)``; the copied
        positions are those both lists cover (the last ``(window // bs_dst + 1) * bs_dst`` of them
        for a sliding-window region). Raises :class:`~kvplan.RequestError` (a ``ValueError``) for
        a wrong group count, an id out of range or a repeated id, naming the group and the id.
        """
        from kvplan.plan import build_plan

        return build_plan(self, src_blocks, dst_blocks)

    def summary(self) -> str:
        """Per peer rank: each region's placement, head interval, streams and runs per block."""
        me = "d" if self.mode is Mode.PULL else "p"
        lines = [
            f"TransferMap {self.mode.value} {me}{self.rank}: source tp {self.src.tp_size} -> "
            f"destination tp {self.dst.tp_size}, {len(self.dst.regions)} regions, "
            f"peers {list(self.peers)}"
        ]
        for lane in self.lanes:
            r = self.dst.regions[lane.dst_region]
            tpl = lane.template
            place = "R" if lane.placement is Placement.REPLICATE else (
                f"S(heads {lane.heads.start}:{lane.heads.stop})"
            )
            per_block = int(tpl.length.sum())
            lines.append(
                f"  p{lane.src_rank} -> d{lane.dst_rank}  {r.name}: {place}, "
                f"{'K+V' if r.streams == 2 else 'K'}, {per_block} B and {len(tpl.length)} runs "
                f"per block of {r.block_size}"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"TransferMap(mode={self.mode.value}, rank={self.rank}, src=tp{self.src.tp_size}, "
            f"dst=tp{self.dst.tp_size}, regions={len(self.dst.regions)}, lanes={len(self.lanes)}, "
            f"peers={list(self.peers)})"
        )


def _sorted_lanes(lanes: list[Lane]) -> tuple[Lane, ...]:
    return tuple(sorted(lanes, key=lambda x: (x.src_rank, x.dst_rank, x.dst_region, x.heads.start)))


def pull_map(src: EngineSpec, dst: EngineSpec, dst_rank: int) -> TransferMap:
    """Handshake for destination rank ``dst_rank`` reading from the source engine.

    Raises :class:`~kvplan.IncompatibleLayoutError` when the specs cannot exchange KV.
    """
    pairs = region_pairs(src, dst)
    _check_rank(dst, dst_rank, "destination")
    lanes = _lanes_for_dst_rank(src, dst, dst_rank, pairs, {})
    return TransferMap(src, dst, Mode.PULL, dst_rank, _sorted_lanes(lanes))


def push_map(src: EngineSpec, dst: EngineSpec, src_rank: int) -> TransferMap:
    """Handshake for source rank ``src_rank`` writing to the destination engine.

    Its lanes are exactly the lanes of every destination rank's :func:`pull_map` whose source is
    ``src_rank``, so the union of all push plans equals the union of all pull plans.
    """
    pairs = region_pairs(src, dst)
    _check_rank(src, src_rank, "source")
    cache: dict = {}
    lanes = [
        lane
        for d in range(dst.tp_size)
        for lane in _lanes_for_dst_rank(src, dst, d, pairs, cache, only_src=src_rank)
    ]
    return TransferMap(src, dst, Mode.PUSH, src_rank, _sorted_lanes(lanes))
