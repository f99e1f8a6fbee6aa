"""Engine specs: the validated, immutable description of one engine's KV cache.

Layer 1 (values): imports :mod:`kvplan.regions` (one region), :mod:`kvplan.engine_derive` (the
checks across regions and the derived stages, pages and buffers, from plain fields),
:mod:`kvplan.cp` (the sharded-PCP rule), :mod:`kvplan.constants` and :mod:`kvplan.errors`; none
of them imports it back. A spec is what two engines exchange at handshake. It enters through
``from_dict`` (the JSON-able form), is checked on construction, and leaves through ``to_dict``.
Per-rank facts (which regions a pipeline stage holds, block and page sizes, allocation sizes)
are answered here; byte layouts, placements and plans live in other modules.

The value knows no builder: a spec from a Hugging Face ``config.json`` is
:func:`kvplan.hf.from_hf_config` (also ``kvplan.from_hf_config``), from vLLM's own KV cache
:func:`kvplan.adapters.vllm.spec_from_vllm`; both sit above and import this module, never the
other way. The only imports of a module above are the two presentation methods', ``_repr_html_``
and ``to_pandas``, which import :mod:`kvplan.views` inside the method (a reader follows it;
importing this module does not import it).

The public names of :mod:`kvplan.regions` and :mod:`kvplan.constants` that were defined here
before are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvplan import engine_derive as derive
from kvplan.constants import (
    DTYPE_SIZES,
    MAX_ALLOCATION_BYTES,
    MAX_BLOCK_ATOMS,
    MAX_BLOCK_SIZE,
    MAX_PP_SIZE,
    MAX_REGIONS,
    MAX_TP_SIZE,
)
from kvplan.cp import is_pcp_sharded
from kvplan.engine_derive import Buffers
from kvplan.errors import SpecError
from kvplan.regions import (
    AXES,
    KV,
    LEGACY_ORDERS,
    VLLM_ORDERS,
    Component,
    Kind,
    Layout,
    RegionSpec,
    StatePart,
    check_spec_json,
    layout_order,
)

__all__ = [
    "AXES",
    "DTYPE_SIZES",
    "KV",
    "LEGACY_ORDERS",
    "MAX_ALLOCATION_BYTES",
    "MAX_BLOCK_ATOMS",
    "MAX_BLOCK_SIZE",
    "MAX_PP_SIZE",
    "MAX_REGIONS",
    "MAX_TP_SIZE",
    "VLLM_ORDERS",
    "Buffers",
    "Component",
    "EngineSpec",
    "Kind",
    "Layout",
    "RegionSpec",
    "StatePart",
    "layout_order",
]


def _regions(value: Any) -> tuple[RegionSpec, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class EngineSpec:
    """One engine's KV cache: TP and PP sizes and its regions.

    Ranks are flat: ``rank = (pp_rank * pcp_size + pcp_rank) * tp_size + tp_rank`` (``pcp_size``
    1 unless prefill context parallelism, kvplan/cp.py). A pipeline stage holds a contiguous
    range of the regions (given by their ``stage`` or cut evenly in spec order); every TP rank of
    a stage holds each of those regions, sharded per its components. Invariants checked on
    construction: unique names; group ids ``0..G-1``, none skipped, a group all state regions or
    none; every component's units divide or are divided by ``tp_size``; pools consistent.
    """

    tp_size: int
    regions: tuple[RegionSpec, ...] = attrs.field(converter=_regions)
    pp_size: int = 1
    dcp_size: int = 1  # decode context parallelism: token regions shard tokens over dcp ranks
    dcp_interleave: int = 1  # tokens a DCP rank takes at a time, round-robin (vLLM's
    # cp_kv_cache_interleave_size)
    pcp_size: int = 1  # prefill context parallelism: ranks between PP and TP (kvplan/cp.py)
    _stages: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)
    _pages: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)
    _buffers: Buffers = attrs.field(init=False, eq=False, repr=False)
    _region_buffers: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        for field in ("tp_size", "pp_size", "dcp_size", "dcp_interleave", "pcp_size"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SpecError(f"{field} must be a positive integer, got {v!r}")
        for field, top in (("tp_size", MAX_TP_SIZE), ("pp_size", MAX_PP_SIZE),
                           ("pcp_size", MAX_TP_SIZE)):
            if getattr(self, field) > top:
                raise SpecError(f"{field} {getattr(self, field)} exceeds the limit {top}")
        if not self.regions:
            raise SpecError("an engine spec needs at least one region")
        if len(self.regions) > MAX_REGIONS:
            raise SpecError(f"{len(self.regions)} regions exceed the limit {MAX_REGIONS}")
        seen: set[str] = set()
        for r in self.regions:
            if not isinstance(r, RegionSpec):
                raise SpecError(f"regions must be RegionSpec values, got {type(r).__name__}")
            if r.name in seen:
                raise SpecError(f"region name {r.name!r} appears twice")
            seen.add(r.name)
            derive.check_components(r, self.tp_size)
        regions = self.regions
        derive.check_groups(regions)
        derive.check_dcp(regions, self.tp_size, self.dcp_size, self.dcp_interleave,
                         self.pcp_size)
        stages = derive.assign_stages(regions, self.pp_size)
        pages = derive.assign_pages(regions, self.tp_size, stages)
        buffers = derive.assign_buffers(regions, stages, pages)
        derive.check_sizes(regions, buffers, pages)
        object.__setattr__(self, "_stages", stages)
        object.__setattr__(self, "_pages", pages)
        object.__setattr__(self, "_buffers", buffers)
        # per request, allocations.finish needs every region's buffer: derive it once here
        object.__setattr__(self, "_region_buffers", tuple(s[0] for s in buffers.slots))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineSpec:
        """Build from ``{"tp_size": int, "pp_size": int (optional), "regions": [...]}``."""
        if not isinstance(d, Mapping):
            raise SpecError(f"an engine spec must be a mapping, got {type(d).__name__}")
        check_spec_json(d, "engine spec")
        unknown = sorted(set(d) - {"tp_size", "pp_size", "regions", "dcp_size", "dcp_interleave",
                                   "pcp_size"})
        if unknown:
            raise SpecError(f"engine spec: unknown field(s) {unknown}")
        for key in ("tp_size", "regions"):
            if key not in d:
                raise SpecError(f"engine spec: missing field {key!r}")
        regions = d["regions"]
        if isinstance(regions, (str, bytes, Mapping)) or not hasattr(regions, "__iter__"):
            raise SpecError("engine spec: regions must be a list of region mappings")
        if hasattr(regions, "__len__") and len(regions) > MAX_REGIONS:  # before building any
            raise SpecError(f"{len(regions)} regions exceed the limit {MAX_REGIONS}")
        return cls(
            tp_size=d["tp_size"],
            pp_size=d.get("pp_size", 1),
            regions=tuple(RegionSpec.from_dict(r) for r in regions),
            dcp_size=d.get("dcp_size", 1),
            dcp_interleave=d.get("dcp_interleave", 1),
            pcp_size=d.get("pcp_size", 1),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form; ``EngineSpec.from_dict(s.to_dict()) == s``."""
        d: dict[str, Any] = {"tp_size": self.tp_size}
        if self.pp_size != 1:
            d["pp_size"] = self.pp_size
        for field in ("dcp_size", "dcp_interleave", "pcp_size"):  # written only when set
            if getattr(self, field) != 1:
                d[field] = getattr(self, field)
        d["regions"] = [r.to_dict() for r in self.regions]
        return d

    @property
    def num_ranks(self) -> int:
        """``tp_size * pcp_size * pp_size``: flat ranks ``(pp_rank * pcp_size + pcp_rank) *
        tp_size + tp_rank`` (vLLM's order, PP x PCP x TP; see kvplan/cp.py)."""
        return self.tp_size * self.pcp_size * self.pp_size

    @property
    def pcp_sharded(self) -> bool:
        """True when the PCP ranks hold distinct DCP shards (vLLM 0.33's sharded PCP: TP 1,
        ``pcp_size == dcp_size``); otherwise every PCP rank holds a full replica."""
        return is_pcp_sharded(self.tp_size, self.pcp_size, self.dcp_size)

    def positions_per_block(self, index: int) -> int:
        """Request positions one block id of region ``index`` covers: ``block_size``, times
        ``dcp_size`` for a token region (vLLM's scheduler block under DCP)."""
        r = self.regions[index]
        return r.block_size if r.is_state else r.block_size * self.dcp_size

    @property
    def num_groups(self) -> int:
        """Number of KV-cache groups (each with its own block ids in a request)."""
        return 1 + max(r.group for r in self.regions)

    def region_index(self, name: str) -> int:
        """Index of the region called ``name`` in this spec's order."""
        for i, r in enumerate(self.regions):
            if r.name == name:
                return i
        raise KeyError(f"no region named {name!r}")

    def stage_of(self, index: int) -> int:
        """Pipeline stage holding region ``index``."""
        return self._stages[index]

    def regions_on(self, rank: int) -> tuple[int, ...]:
        """Indices of the regions rank ``rank`` holds (those of its pipeline stage)."""
        if not 0 <= rank < self.num_ranks:
            raise SpecError(f"rank {rank} is not in [0, {self.num_ranks})")
        stage = rank // (self.tp_size * self.pcp_size)
        return tuple(i for i, s in enumerate(self._stages) if s == stage)

    def rank_block_nbytes(self, index: int) -> int:
        """Bytes of one block of region ``index`` on one rank (all streams, local units)."""
        return derive.block_nbytes(self.regions[index], self.tp_size)

    def rank_page_nbytes(self, index: int) -> int:
        """Byte stride between consecutive blocks of region ``index``: its pool's page, or its
        own block size when it is not pooled."""
        return self._pages[index]

    def allocation_of(self, index: int) -> int:
        """Index of the first region sharing region ``index``'s allocation (itself if it has
        its own).

        Regions of one pool, or naming one ``allocation``, share one registered buffer (two
        for a K/V pair); copies carry offsets from its base.
        """
        k = self._buffers.slots[index][0]
        return next(i for i, s in enumerate(self._buffers.slots) if s[0] == k)

    def rank_region_nbytes(self, index: int) -> int:
        """Bytes of the buffer region ``index`` lives in on a rank that holds it (of each of
        its two buffers when K and V are separate): slots x pages x the page."""
        return self._buffers.nbytes[self._buffers.slots[index][0]]

    @property
    def buffers(self) -> tuple[str, ...]:
        """Names of the engine's buffers, in order of first use by the regions: an allocation's
        name, a pool's, a K or V buffer's, or a region's own name when it has its own buffer.
        ``copies()``' ``src_buffer``/``dst_buffer`` columns index this tuple."""
        return self._buffers.names

    @property
    def region_buffers(self) -> tuple[int, ...]:
        """``buffer_of(i)`` for every region ``i``, in region order: the buffer holding each
        region (its K buffer where K and V are separate). Computed once per spec."""
        return self._region_buffers

    def buffer_of(self, index: int, stream: int = 0) -> int:
        """Index in :attr:`buffers` of the buffer holding ``stream`` of region ``index``."""
        bk, bv, _, _ = self._buffers.slots[index]
        return bv if stream else bk

    def slot_of(self, index: int) -> tuple[int, int]:
        """``(slot, slots)``: region ``index`` is layer slot ``slot`` of an allocation of
        ``slots`` slots (``(0, 1)`` for a region with its own buffer)."""
        _, _, slot, n = self._buffers.slots[index]
        return slot, n

    def rank_buffer_nbytes(self, buffer: int | str) -> int:
        """Bytes of buffer ``buffer`` on a rank that holds it: a name of :attr:`buffers` or its
        index there. Raises :class:`~kvplan.SpecError` naming the valid names otherwise."""
        names = self.buffers
        if isinstance(buffer, str):
            index = names.index(buffer) if buffer in names else -1
        else:  # an int, numpy's too (a copies() column), never a bool
            index = -1 if isinstance(buffer, bool) or not hasattr(buffer, "__index__") else (
                buffer.__index__())
        if not 0 <= index < len(names):
            shown = ", ".join(map(repr, names[:8])) + (
                f", ... ({len(names)} in all)" if len(names) > 8 else "")
            raise SpecError(f"rank_buffer_nbytes: no buffer {buffer!r}; the engine's buffers "
                            f"are {shown} (or their indices 0..{len(names) - 1})")
        return self._buffers.nbytes[index]

    def buffer_regions(self, buffer: int) -> tuple[int, ...]:
        """Indices of the regions living (wholly or one stream) in buffer ``buffer``."""
        return tuple(i for i, s in enumerate(self._buffers.slots) if buffer in s[:2])

    def __str__(self) -> str:
        pp = f", pp={self.pp_size}" if self.pp_size != 1 else ""
        if self.pcp_size != 1:
            pp += f", pcp={self.pcp_size} {'sharded' if self.pcp_sharded else 'replicated'}"
        if self.dcp_size != 1:
            pp += f", dcp={self.dcp_size} interleave {self.dcp_interleave}"
        lines = [f"EngineSpec tp={self.tp_size}{pp}, {len(self.regions)} regions"]
        lines += [f"  {i}: {r}" for i, r in enumerate(self.regions)]
        return "\n".join(lines)

    def with_layout(self, layout: str, kv: str = "split") -> EngineSpec:
        """This engine with every region laid out by ``layout``.

        ``HND``/``NHD`` (with ``kv``) set attention regions' layout with one allocation per
        region, as before. An axis order (``BLHNC``, ``LBSHND``...) applies to every region
        and packs the regions of a group that size a slot alike (same kind, shape, blocks and
        stage) into one allocation ``kv.{k}`` in spec order, as vLLM allocates each KV-cache
        group's layers in one buffer; an order without ``S`` (``LBNHD``) keeps attention's K
        and V in two buffers ``kv.{k}.k`` / ``kv.{k}.v``, as SGLang does; pooled regions keep
        their pool.
        """
        legacy = layout in ("HND", "NHD")
        if not legacy:
            layout_order(layout)  # refuse a bad name before touching the regions
        regions = []
        keys: dict[tuple, str] = {}
        for i, r in enumerate(self.regions):
            d = {k: v for k, v in r.to_dict().items() if k not in ("layout", "kv", "allocation")}
            if legacy:
                if r.kind is Kind.ATTENTION:
                    d.update(layout=layout, kv=kv)
                regions.append(d)
                continue
            d["layout"] = layout
            if r.pool is None:
                shape = (self.stage_of(i), *sorted((k, str(v)) for k, v in d.items()
                                                   if k != "name"))
                name = keys.setdefault(shape, f"kv.{len(keys)}")
                apart = r.kind is Kind.ATTENTION and "S" not in layout.replace("C", "SD")
                d["allocation"] = [f"{name}.k", f"{name}.v"] if apart else name
            regions.append(d)
        return EngineSpec.from_dict({**self.to_dict(), "regions": regions})

    def _repr_html_(self) -> str:
        """The regions as an HTML table for notebooks (layers alike on one row)."""
        from kvplan.views import spec_html  # presentation: imported when shown

        return spec_html(self)

    def to_pandas(self):
        """One row per region as a pandas DataFrame (needs pandas: ``kvplan[view]``)."""
        from kvplan.views import spec_frame

        return spec_frame(self)
