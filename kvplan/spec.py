"""Engine and region specs: the validated, immutable description of one engine's KV cache.

A spec is what two engines exchange at handshake. It enters through ``from_dict`` (the JSON-able
form), is checked on construction, and leaves through ``to_dict``. Per-rank facts (which regions
a pipeline stage holds, block and page sizes, allocation sizes) are answered here; byte layouts,
placements and plans live in other modules.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping
from typing import Any

import attrs

from kvplan.errors import SpecError

#: Bytes per element of each dtype name a spec may use (torch's spelling).
DTYPE_SIZES: Mapping[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


#: Bounds a spec must respect (see docs/design.md, "Limits"): they keep every byte offset a plan
#: computes inside int64 and make a forged or mistyped spec cheap to refuse.
MAX_TP_SIZE = 256
MAX_PP_SIZE = 256
MAX_REGIONS = 1024
MAX_BLOCK_SIZE = 1 << 16
#: Largest buffer (bytes on one rank) of a region, pool or allocation: offsets plus lengths
#: stay < 2**63 even where the planner lays a V buffer one block above its K buffer.
MAX_ALLOCATION_BYTES = 1 << 61
#: Largest number of (stream, unit, token) atoms in one block on one rank; the handshake builds
#: a template of that many rows per lane, so this bounds its time and memory.
MAX_BLOCK_ATOMS = 1 << 20


class Kind(enum.Enum):
    """What a region's blocks hold; decides its components and their placement over TP."""

    ATTENTION = "attention"  # K and V per token, heads SPLIT over ranks (sliding window included)
    MLA = "mla"  # one latent vector per token, REPLICATE on every rank
    INDEXER = "indexer"  # sparse-attention index keys per token, REPLICATE on every rank
    STATE = "state"  # one recurrent-state slot per block, each part SPLIT on its own units


class Layout(enum.Enum):
    """Order of heads and tokens inside one stream of one block (domain.md section 4)."""

    HND = "HND"  # heads outer, tokens inner: a head slice of a block is one run
    NHD = "NHD"  # tokens outer, heads inner: a head slice is block_size runs


class KV(enum.Enum):
    """Where the K and V streams live relative to the block axis (with ``HND``/``NHD`` only)."""

    SPLIT = "split"  # (2, num_blocks, ...): all K blocks, then all V blocks
    JOINT = "joint"  # (num_blocks, 2, ...): K and V of one block side by side


#: The axes of an allocation, outermost first in the canonical spelling: layer slot, block
#: (kernel block), stream (K, V), head, token in a block, and the bytes of one head of one token.
AXES = "LBSHND"
#: vLLM's six physical orders of its logical shape [L, B, H, N, C], C being the content
#: [2, head_dim] of one head and token (K then V side by side), so ``C`` reads ``SD``.
VLLM_ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
#: The orders the legacy names stand for, by (layout, kv).
LEGACY_ORDERS: Mapping[tuple[str, str], str] = {
    ("HND", "split"): "LSBHND",
    ("HND", "joint"): "LBSHND",
    ("NHD", "split"): "LSBNHD",
    ("NHD", "joint"): "LBSNHD",
}


def layout_order(layout: str, kv: str = "split") -> str:
    """The six-letter axis order (a permutation of :data:`AXES`, ``D`` last) a layout names.

    ``layout`` is ``"HND"``/``"NHD"`` (with ``kv``: ``"split"`` puts S outermost, ``"joint"``
    right after B), a permutation of ``LBSHN`` followed by ``D``, one of ``LBHN`` followed by
    ``D`` (no S: a buffer of one stream, read as S outermost), or one of ``LBHN`` followed by
    ``C`` (= ``SD``; vLLM's six names are such). Raises ``ValueError`` naming the letters
    otherwise.
    """
    if (layout, kv) in LEGACY_ORDERS:
        return LEGACY_ORDERS[(layout, kv)]
    if not isinstance(layout, str):
        raise ValueError(f"a layout is a string, got {layout!r}")
    order = layout.replace("C", "SD") if layout.endswith("C") else layout
    if sorted(order) == sorted("LBHND") and order.endswith("D"):
        order = "S" + order  # no S: one stream per buffer (separate K/V, or MLA / state)
    if sorted(order) != sorted(AXES) or not order.endswith("D"):
        raise ValueError(
            f"layout {layout!r} is not HND/NHD, a permutation of {AXES[:-1]!r} (or of 'LBHN' "
            f"without S) followed by 'D', nor of 'LBHN' followed by 'C' "
            f"(e.g. {', '.join(VLLM_ORDERS)})"
        )
    return order


def _positive(name: str, field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"region {name!r}: {field} must be a positive integer, got {value!r}")
    return value


def _enum(cls: type[enum.Enum], name: str, field: str, value: Any) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise SpecError(f"region {name!r}: {field} {value!r} is not one of {allowed}") from None


@attrs.frozen
class StatePart:
    """One named part of a state slot: ``units`` shardable units of ``unit_bytes`` each."""

    name: str
    units: int
    unit_bytes: int


@attrs.frozen
class Component:
    """A shardable piece of a region's block: ``units`` global units (heads, channel groups)
    of ``unit_bytes`` bytes per token and stream. Attention has one (the KV heads, 2 streams),
    MLA and indexer one with a single unit every rank holds, a state region one per part."""

    name: str
    units: int
    unit_bytes: int
    streams: int

    def local_units(self, tp_size: int) -> int:
        """Units one rank holds: ``max(1, units // tp_size)``."""
        return max(1, self.units // tp_size)


def _parts(value: Any) -> tuple[StatePart, ...] | None:
    return None if value is None else tuple(value)


def _layout(value: Any) -> Any:
    """Keep the legacy names as :class:`Layout` members (as before); other orders as strings."""
    if isinstance(value, str) and value in ("HND", "NHD"):
        return Layout(value)
    return value


def _allocation(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


_TOKEN_KINDS_ONLY = ("block_size", "kernel_block_size")
_OWN_FIELDS = {
    Kind.ATTENTION: ("num_kv_heads", "head_dim", "kv", "window", *_TOKEN_KINDS_ONLY),
    Kind.MLA: ("dim", *_TOKEN_KINDS_ONLY),
    Kind.INDEXER: ("dim", *_TOKEN_KINDS_ONLY),
    Kind.STATE: ("parts",),
}
_COMMON = ("name", "kind", "group", "num_blocks", "dtype", "pool", "page_bytes", "stage",
           "layout", "allocation")
_OPTIONAL = ("kernel_block_size", "pool", "page_bytes", "stage")  # written only when set
#: Axes whose size is 1 for a kind whatever the rank (so their place in an order is moot).
_UNIT_AXES = {Kind.ATTENTION: "", Kind.MLA: "SH", Kind.INDEXER: "SH", Kind.STATE: "SHN"}


@attrs.frozen(kw_only=True)
class RegionSpec:
    """One region of a rank's KV cache: ``num_blocks`` equal blocks, usually one layer.

    Attention regions carry ``num_kv_heads``, ``head_dim``, ``layout``, ``kv`` and ``window``;
    MLA and indexer regions carry ``dim`` (values per token); state regions carry ``parts`` and
    hold one slot per block (``block_size`` 1). ``group`` names the KV-cache group whose block
    table indexes the region. Optional: ``kernel_block_size`` (bytes laid out as blocks of that
    many tokens, a logical block being consecutive kernel blocks), ``pool`` (regions naming the
    same pool share one allocation, block ``b`` at ``b * page_bytes``), ``page_bytes`` and
    ``stage`` (pipeline stage). Construct from JSON with :meth:`from_dict`.

    ``layout`` is the order of the axes of the region's allocation (see :func:`layout_order`
    and :attr:`order`): ``HND``/``NHD`` with ``kv`` as before, any order of ``LBSHND`` (``D``
    last) or vLLM's names (``BLHNC`` ...). ``allocation`` names the buffer the region is a layer
    slot of (regions naming one allocation are its slots in spec order), or is a pair
    ``(k, v)`` of buffer names holding K and V separately. Both apply to every kind.
    """

    name: str
    kind: Kind
    num_blocks: int
    block_size: int = 1
    dtype: str
    group: int = 0
    num_kv_heads: int | None = None
    head_dim: int | None = None
    layout: Layout | str = attrs.field(default=Layout.HND, converter=_layout)
    kv: KV = KV.SPLIT
    window: int | None = None
    dim: int | None = None
    parts: tuple[StatePart, ...] | None = attrs.field(default=None, converter=_parts)
    kernel_block_size: int | None = None
    pool: str | None = None
    page_bytes: int | None = None
    stage: int | None = None
    allocation: str | tuple[str, str] | None = attrs.field(default=None, converter=_allocation)

    def __attrs_post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not name:
            raise SpecError(f"region name must be a non-empty string, got {name!r}")
        if not isinstance(self.kind, Kind):
            raise SpecError(f"region {name!r}: kind must be a Kind, got {self.kind!r}")
        _positive(name, "num_blocks", self.num_blocks)
        _positive(name, "block_size", self.block_size)
        if self.block_size > MAX_BLOCK_SIZE:
            raise SpecError(f"region {name!r}: block_size {self.block_size} exceeds the limit "
                            f"{MAX_BLOCK_SIZE}")
        for field in ("group", "stage"):
            v = getattr(self, field)
            if v is None and field == "group":  # only stage is optional
                raise SpecError(f"region {name!r}: group must be an integer >= 0, got None")
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise SpecError(f"region {name!r}: {field} must be an integer >= 0, got {v!r}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            raise SpecError(
                f"region {name!r}: dtype {self.dtype!r} is not one of {', '.join(DTYPE_SIZES)}"
            )
        own = _OWN_FIELDS[self.kind]
        foreign = [
            f for f in ("num_kv_heads", "head_dim", "window", "dim", "parts", "kernel_block_size")
            if f not in own and getattr(self, f) is not None
        ]
        if foreign:
            raise SpecError(f"region {name!r}: a {self.kind.value} region does not take "
                            f"{', '.join(foreign)}")
        if self.kind is Kind.ATTENTION:
            _positive(name, "num_kv_heads", self.num_kv_heads)
            _positive(name, "head_dim", self.head_dim)
            if self.window is not None:
                _positive(name, "window", self.window)
        elif self.kind is Kind.STATE:
            self._check_parts()
        else:
            _positive(name, "dim", self.dim)
        if self.kernel_block_size is not None:
            _positive(name, "kernel_block_size", self.kernel_block_size)
            if self.block_size % self.kernel_block_size:
                raise SpecError(
                    f"region {name!r}: kernel_block_size {self.kernel_block_size} does not "
                    f"divide block_size {self.block_size} "
                    f"({self.block_size} % {self.kernel_block_size} = "
                    f"{self.block_size % self.kernel_block_size})"
                )
        if self.pool is not None:
            if not isinstance(self.pool, str) or not self.pool:
                raise SpecError(f"region {name!r}: pool must be a non-empty string")
        if self.page_bytes is not None:
            _positive(name, "page_bytes", self.page_bytes)
            if self.pool is None:
                raise SpecError(f"region {name!r}: page_bytes is only meaningful with a pool")
        self._check_layout()

    def _check_layout(self) -> None:
        name = self.name
        if not isinstance(self.layout, (Layout, str)):
            raise SpecError(f"region {name!r}: layout must be a string, got {self.layout!r}")
        if not isinstance(self.kv, KV):
            raise SpecError(f"region {name!r}: kv must be a KV, got {self.kv!r}")
        if not isinstance(self.layout, Layout) and self.kv is not KV.SPLIT:
            raise SpecError(
                f"region {name!r}: kv {self.kv.value!r} applies only to layout HND or NHD; "
                f"layout {self.layout!r} already places S"
            )
        try:
            order = self.order
        except ValueError as e:
            raise SpecError(f"region {name!r}: {e}") from None
        a = self.allocation
        if (self.kind is Kind.ATTENTION and "S" not in self.layout_name.replace("C", "SD")
                and not isinstance(a, tuple) and not isinstance(self.layout, Layout)):
            raise SpecError(
                f"region {name!r}: layout {self.layout_name!r} has no S axis, which only a "
                "region keeping K and V in separate buffers (allocation [k, v]) may omit"
            )
        if a is not None:
            pair = isinstance(a, tuple)
            names = a if pair else (a,)
            if (pair and len(a) != 2) or not all(isinstance(x, str) and x for x in names):
                raise SpecError(
                    f"region {name!r}: allocation must be a buffer name or a pair [k, v] of "
                    f"buffer names, got {a!r}"
                )
            if pair and a[0] == a[1]:
                raise SpecError(f"region {name!r}: allocation [k, v] names {a[0]!r} twice")
            if pair and self.kind is not Kind.ATTENTION:
                raise SpecError(
                    f"region {name!r}: separate K and V buffers need an attention region, "
                    f"a {self.kind.value} region has one stream"
                )
            if pair and self.pool is not None:
                raise SpecError(
                    f"region {name!r}: a pooled region cannot keep K and V in separate buffers "
                    f"(its block must be contiguous in its page of pool {self.pool!r})"
                )
        if self.pool is not None:  # a block must be contiguous in its page: L, B outermost
            outer = [x for x in order if x not in _UNIT_AXES[self.kind]][:2]
            if sorted(outer) != ["B", "L"]:
                raise SpecError(
                    f"region {name!r}: a region in pool {self.pool!r} needs its block "
                    f"contiguous in its page, so axes L and B outermost; layout "
                    f"{self.layout_name!r} is {order}"
                    + (" (use kv 'joint')" if isinstance(self.layout, Layout) else "")
                )

    @property
    def layout_name(self) -> str:
        """The layout as written in the spec: ``HND``, ``NHD``, ``BLHNC``, ``LBSHND``..."""
        return self.layout.value if isinstance(self.layout, Layout) else self.layout

    @property
    def order(self) -> str:
        """The allocation's axis order, six letters of :data:`AXES`, outermost first."""
        return layout_order(self.layout_name, self.kv.value)

    @property
    def separate_kv(self) -> bool:
        """True when K and V live in two buffers (``allocation`` is a pair)."""
        return isinstance(self.allocation, tuple)

    def _check_parts(self) -> None:
        name = self.name
        if self.block_size != 1:
            raise SpecError(f"region {name!r}: a state region's block is one slot, block_size 1")
        if not self.parts:
            raise SpecError(f"region {name!r}: a state region needs at least one part")
        seen = set()
        for p in self.parts:
            if not isinstance(p, StatePart) or not isinstance(p.name, str) or not p.name:
                raise SpecError(f"region {name!r}: parts must be named StatePart values, got {p!r}")
            if p.name in seen:
                raise SpecError(f"region {name!r}: part {p.name!r} appears twice")
            seen.add(p.name)
            _positive(name, f"part {p.name!r} units", p.units)
            _positive(name, f"part {p.name!r} unit_bytes", p.unit_bytes)

    @property
    def is_replicated(self) -> bool:
        """True when every rank holds the whole region (MLA, indexer): placement REPLICATE."""
        return self.kind in (Kind.MLA, Kind.INDEXER)

    @property
    def is_state(self) -> bool:
        """True for a recurrent-state region: blocks are slots, paired by list position."""
        return self.kind is Kind.STATE

    @property
    def components(self) -> tuple[Component, ...]:
        """The shardable pieces of a block, in their order within a slot (see Component)."""
        e = DTYPE_SIZES[self.dtype]
        if self.kind is Kind.ATTENTION:
            return (Component("kv", self.num_kv_heads, self.head_dim * e, 2),)  # type: ignore[operator]
        if self.kind is Kind.STATE:
            return tuple(Component(p.name, p.units, p.unit_bytes, 1) for p in self.parts or ())
        return (Component(self.kind.value, 1, self.dim * e, 1),)  # type: ignore[operator]

    @property
    def streams(self) -> int:
        """Number of streams per block: 2 (K, V) for attention, 1 otherwise (key only)."""
        return 2 if self.kind is Kind.ATTENTION else 1

    @property
    def heads(self) -> int:
        """Global KV heads (attention); a replicated region is one head every rank holds."""
        return self.num_kv_heads if self.kind is Kind.ATTENTION else 1  # type: ignore[return-value]

    @property
    def kernel_size(self) -> int:
        """Tokens per kernel block: ``kernel_block_size``, or ``block_size`` when not given."""
        return self.kernel_block_size or self.block_size

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RegionSpec:
        """Build from the JSON-able form; unknown keys and keys of another kind are refused."""
        if not isinstance(d, Mapping):
            raise SpecError(f"a region must be a mapping, got {type(d).__name__}")
        name = d.get("name")
        for key in ("name", "kind", "num_blocks", "dtype"):
            if key not in d:
                raise SpecError(f"region {name!r}: missing field {key!r}")
        kind = _enum(Kind, name, "kind", d["kind"])
        own = _OWN_FIELDS[kind]
        unknown = sorted(set(d) - {*_COMMON, *own})
        if unknown:
            raise SpecError(f"region {name!r}: unknown field(s) {unknown} for kind {kind.value!r}")
        required = {
            Kind.ATTENTION: ("block_size", "num_kv_heads", "head_dim"),
            Kind.STATE: ("parts",),
        }.get(kind, ("block_size", "dim"))
        for key in required:
            if key not in d:
                raise SpecError(f"region {name!r}: missing field {key!r}")
        kwargs: dict[str, Any] = {k: d[k] for k in (*_COMMON, *own) if k in d}
        kwargs["kind"] = kind
        if kind is Kind.ATTENTION:
            kwargs["kv"] = _enum(KV, name, "kv", d.get("kv", "split"))
        if "layout" in d and not isinstance(d["layout"], str):
            raise SpecError(f"region {name!r}: layout must be a string, got {d['layout']!r}")
        if kind is Kind.STATE:
            kwargs["parts"] = _parts_from_json(name, d["parts"])
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form, defaults written out; ``from_dict(r.to_dict()) == r``."""
        d: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind.value,
            "group": self.group,
            "num_blocks": self.num_blocks,
        }
        if self.kind is not Kind.STATE:
            d["block_size"] = self.block_size
        d["dtype"] = self.dtype
        if self.kind is Kind.ATTENTION:
            d.update(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                     layout=self.layout_name)
            if isinstance(self.layout, Layout):
                d["kv"] = self.kv.value
            d["window"] = self.window
        elif self.kind is Kind.STATE:
            d["parts"] = [attrs.asdict(p) for p in self.parts or ()]
        else:
            d["dim"] = self.dim
        if self.kind is not Kind.ATTENTION and self.layout is not Layout.HND:
            d["layout"] = self.layout_name
        d.update({k: getattr(self, k) for k in _OPTIONAL if getattr(self, k) is not None})
        if self.allocation is not None:
            a = self.allocation
            d["allocation"] = list(a) if isinstance(a, tuple) else a
        return d

    def __str__(self) -> str:
        if self.kind is Kind.ATTENTION:
            win = f" window {self.window}" if self.window else ""
            kv = f" {self.kv.value}" if isinstance(self.layout, Layout) else ""
            shape = f"{self.num_kv_heads}x{self.head_dim} {self.layout_name}{kv}{win}"
        elif self.kind is Kind.STATE:
            shape = " ".join(f"{p.name}:{p.units}x{p.unit_bytes}B" for p in self.parts or ())
        else:
            shape = f"dim {self.dim}"
        extra = "".join(
            f", {label} {getattr(self, k)}"
            for k, label in (("kernel_block_size", "kernel"), ("pool", "pool"), ("stage", "stage"),
                             ("allocation", "allocation"))
            if getattr(self, k) is not None
        )
        blocks = "slots" if self.kind is Kind.STATE else f"blocks of {self.block_size}"
        return (
            f"{self.name} [{self.kind.value} g{self.group}] {shape} {self.dtype}, "
            f"{self.num_blocks} {blocks}{extra}"
        )


def _parts_from_json(name: str, parts: Any) -> tuple[StatePart, ...]:
    if isinstance(parts, (str, bytes, Mapping)) or not hasattr(parts, "__iter__"):
        raise SpecError(f"region {name!r}: parts must be a list of part mappings")
    out = []
    for p in parts:
        if not isinstance(p, Mapping) or set(p) != {"name", "units", "unit_bytes"}:
            raise SpecError(
                f"region {name!r}: a part needs exactly name, units and unit_bytes, got {p!r}"
            )
        out.append(StatePart(p["name"], p["units"], p["unit_bytes"]))
    return tuple(out)


def _regions(value: Any) -> tuple[RegionSpec, ...]:
    return tuple(value)


@attrs.frozen
class Buffers:
    """Where an engine's regions live: buffer names; per region ``(K buffer, V buffer, slot,
    slots)`` (one buffer twice unless K and V are separate); per buffer its bytes on a rank."""

    names: tuple[str, ...]
    slots: tuple[tuple[int, int, int, int], ...]
    nbytes: tuple[int, ...]


@attrs.frozen(kw_only=True)
class EngineSpec:
    """One engine's KV cache: TP and PP sizes and its regions.

    Ranks are flat: ``rank = pp_rank * tp_size + tp_rank``. A pipeline stage holds a contiguous
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
    _stages: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)
    _pages: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)
    _buffers: Buffers = attrs.field(init=False, eq=False, repr=False)
    _region_buffers: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        for field in ("tp_size", "pp_size", "dcp_size", "dcp_interleave"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SpecError(f"{field} must be a positive integer, got {v!r}")
        for field, top in (("tp_size", MAX_TP_SIZE), ("pp_size", MAX_PP_SIZE)):
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
            self._check_components(r)
        self._check_groups()
        self._check_dcp()
        object.__setattr__(self, "_stages", self._assign_stages())
        object.__setattr__(self, "_pages", self._assign_pages())
        object.__setattr__(self, "_buffers", self._assign_buffers())
        # per request, allocations.finish needs every region's buffer: derive it once here
        object.__setattr__(self, "_region_buffers", tuple(s[0] for s in self._buffers.slots))
        self._check_sizes()

    def _check_sizes(self) -> None:
        """Refuse buffers whose byte offsets would not fit in int64 (see MAX_ALLOCATION_BYTES)."""
        for b, nbytes in enumerate(self._buffers.nbytes):
            if nbytes > MAX_ALLOCATION_BYTES:
                i = next(k for k, sl in enumerate(self._buffers.slots) if b in sl[:2])
                r = self.regions[i]
                raise SpecError(
                    f"region {r.name!r}: {nbytes} bytes on a rank in buffer "
                    f"{self._buffers.names[b]!r} ({r.num_blocks} blocks of {self._pages[i]} "
                    f"bytes) exceed the limit {MAX_ALLOCATION_BYTES} (2**61): byte offsets must "
                    "fit in int64"
                )

    def _check_components(self, r: RegionSpec) -> None:
        tp = self.tp_size
        atoms = r.block_size * sum(c.streams * c.units for c in r.components)
        if atoms > MAX_BLOCK_ATOMS:
            raise SpecError(
                f"region {r.name!r}: a block holds {atoms} (stream, unit, token) pieces, over the "
                f"limit {MAX_BLOCK_ATOMS}: block_size {r.block_size} or the unit counts are too "
                "large"
            )
        for c in r.components:
            k = c.units
            if k % tp and tp % k:
                what = "num_kv_heads" if r.kind is Kind.ATTENTION else f"part {c.name!r} units"
                raise SpecError(
                    f"region {r.name!r}: {what} {k} and tp_size {tp} must divide one another "
                    f"({k} % {tp} = {k % tp}, {tp} % {k} = {tp % k})"
                )

    def _check_dcp(self) -> None:
        """Decode context parallelism as vLLM lays it out (docs/concepts.md): the DCP groups
        are ``dcp_size`` consecutive ranks of a TP group that hold the same heads, each rank
        holding every ``dcp_size``-th run of ``dcp_interleave`` tokens of a block id."""
        dcp, il, tp = self.dcp_size, self.dcp_interleave, self.tp_size
        if tp % dcp:
            raise SpecError(
                f"dcp_size {dcp} does not divide tp_size {tp} ({tp} % {dcp} = {tp % dcp}): "
                "a DCP group is carved out of a TP group"
            )
        if dcp == 1:
            return
        for r in self.regions:
            if r.is_state:  # a state slot is not a sequence of tokens: TP placement only
                continue
            if r.block_size % il:
                raise SpecError(
                    f"region {r.name!r}: dcp_interleave {il} does not divide block_size "
                    f"{r.block_size} ({r.block_size} % {il} = {r.block_size % il})"
                )
            k = r.heads
            if k * dcp > tp or (tp // k) % dcp:
                raise SpecError(
                    f"region {r.name!r}: dcp_size {dcp} needs every DCP group to hold the same "
                    f"heads: {k} head(s) over tp_size {tp} give {max(1, tp // k)} rank(s) per "
                    f"head, not a multiple of {dcp}"
                )

    def _check_groups(self) -> None:
        groups = sorted({r.group for r in self.regions})
        if groups != list(range(len(groups))):
            raise SpecError(
                f"group ids must be 0..{len(groups) - 1} with none missing, got {groups}"
            )
        kinds_of: dict[int, set[bool]] = {}  # one pass over the regions, not one per group
        for r in self.regions:
            kinds_of.setdefault(r.group, set()).add(r.is_state)
        for g in groups:
            kinds = kinds_of[g]
            if len(kinds) > 1:
                names = [r.name for r in self.regions if r.group == g]
                raise SpecError(
                    f"group {g} mixes state regions and token regions ({names}): a state group's "
                    "block ids are slots, a token group's are pages of tokens"
                )

    def _assign_stages(self) -> tuple[int, ...]:
        n, pp = len(self.regions), self.pp_size
        given = [r.stage for r in self.regions]
        if all(s is None for s in given):
            if n < pp:
                raise SpecError(f"pp_size {pp} needs at least {pp} regions, got {n}")
            per, extra = divmod(n, pp)
            sizes = [per + (1 if s < extra else 0) for s in range(pp)]
            return tuple(s for s, size in enumerate(sizes) for _ in range(size))
        if any(s is None for s in given):
            missing = [r.name for r in self.regions if r.stage is None]
            raise SpecError(f"either every region names its stage or none does; missing: {missing}")
        for r in self.regions:
            if r.stage >= pp:  # type: ignore[operator]
                raise SpecError(f"region {r.name!r}: stage {r.stage} is not in [0, {pp})")
        if any(b < a for a, b in itertools.pairwise(given)):
            raise SpecError(f"stages must hold contiguous ranges in spec order, got {given}")
        if set(given) != set(range(pp)):
            raise SpecError(f"every stage needs a region: stages {sorted(set(given))} of {pp}")
        return tuple(given)  # type: ignore[arg-type]

    def _assign_pages(self) -> tuple[int, ...]:
        blocks = [self.rank_block_nbytes(i) for i in range(len(self.regions))]
        pages = list(blocks)
        pools: dict[str, list[int]] = {}
        for i, r in enumerate(self.regions):
            if r.pool is not None:
                pools.setdefault(r.pool, []).append(i)
        for pool, members in pools.items():
            regions = [self.regions[i] for i in members]
            groups = [r.group for r in regions]
            if len(set(groups)) != len(groups):
                raise SpecError(
                    f"pool {pool!r}: regions {[r.name for r in regions]} share group(s) "
                    f"{groups}; each view of a pool must belong to its own group"
                )
            if len({self._stages[i] for i in members}) > 1:
                raise SpecError(f"pool {pool!r}: its regions lie on different pipeline stages")
            explicit = {r.page_bytes for r in regions}
            if None in explicit and len(explicit) > 1:
                raise SpecError(f"pool {pool!r}: give page_bytes on every region or on none")
            if len(explicit) > 1:  # one allocation has one page size
                raise SpecError(
                    f"pool {pool!r}: its regions give different page_bytes "
                    f"{sorted(r.page_bytes for r in regions)}; one pool has one page size"
                )
            page = max(blocks[i] for i in members) if None in explicit else explicit.pop()
            for i in members:
                if blocks[i] > page:  # type: ignore[operator]
                    raise SpecError(
                        f"pool {pool!r}: region {self.regions[i].name!r} needs "
                        f"{blocks[i]} bytes per block on a rank but the page is {page} bytes"
                    )
                pages[i] = page  # type: ignore[call-overload]
        return tuple(pages)

    def _slot_signature(self, i: int) -> tuple[tuple[str, Any], ...]:
        """What sizes one layer slot of region ``i`` (compared across an allocation's slots)."""
        r = self.regions[i]
        if r.pool is not None or any(self.regions[m].pool is not None
                                     for m in self._alloc_members(i)):
            outer = "".join(x for x in r.order if x not in _UNIT_AXES[r.kind])[:2]
            blocks = max(x.num_blocks for x in self.regions if x.pool == r.pool) if r.pool \
                else r.num_blocks
            return (("pages", blocks), ("page bytes", self._pages[i]), ("outer axes", outer))
        comps = tuple((c.units, c.unit_bytes, c.streams) for c in r.components)
        order = "".join(x for x in r.order if x not in _UNIT_AXES[r.kind])
        return (("num_blocks", r.num_blocks), ("block_size", r.block_size),
                ("kernel block", r.kernel_size), ("units, unit bytes and streams", comps),
                ("axis order", order))

    def _alloc_members(self, i: int) -> list[int]:
        a = self.regions[i].allocation
        return [i] if a is None else [m for m, r in enumerate(self.regions) if r.allocation == a]

    def _assign_buffers(self) -> Buffers:
        """Name every buffer, give each region its buffer(s), slot and slot count, and check
        that an allocation's slots agree on everything sizing a slot."""
        def key_of(r: RegionSpec) -> tuple:  # what a region's buffer is: allocation, pool, own
            if r.allocation is not None:
                return ("alloc", r.allocation)
            return ("pool", r.pool) if r.pool else ("region", r.name)

        names: list[str] = []
        owner: dict[str, str] = {}  # buffer name -> what names it, for clash messages
        slots: list[tuple[int, int, int, int]] = []
        slot_keys: dict[Any, list[Any]] = {}  # buffer key -> its slots in order of appearance
        for i, r in enumerate(self.regions):
            a = r.allocation
            key = key_of(r)
            bufs = a if isinstance(a, tuple) else (a,) if a is not None else (r.pool or r.name,)
            what = (f"allocation {a!r}" if a is not None else
                    f"pool {r.pool!r}" if r.pool else f"region {r.name!r}")
            for b in bufs:
                if b in owner and owner[b] != what:
                    raise SpecError(
                        f"buffer name {b!r} is used by {owner[b]} and by {what} (region "
                        f"{r.name!r}); buffer names must be distinct"
                    )
                if b not in owner:
                    owner[b] = what
                    names.append(b)
            if r.pool is not None:
                first = next(m for m, x in enumerate(self.regions) if x.pool == r.pool)
                if self.regions[first].allocation != a:
                    raise SpecError(
                        f"pool {r.pool!r}: regions {self.regions[first].name!r} and {r.name!r} "
                        f"name different allocations ({self.regions[first].allocation!r}, "
                        f"{a!r}); a pool is one layer slot of one allocation"
                    )
            slot = ("pool", r.pool) if r.pool else ("region", i)
            members = slot_keys.setdefault(key, [])
            if slot not in members:
                members.append(slot)
            slots.append((names.index(bufs[0]), names.index(bufs[-1]), members.index(slot), 0))
        for key in slot_keys:
            if key[0] != "alloc":
                continue
            key = key[1]
            regs = [m for m, r in enumerate(self.regions) if r.allocation == key]
            ref = regs[0]
            for m in regs[1:]:
                if self._stages[m] != self._stages[ref]:
                    raise SpecError(
                        f"allocation {key!r}: regions {self.regions[ref].name!r} and "
                        f"{self.regions[m].name!r} lie on different pipeline stages"
                    )
                mine, theirs = self._slot_signature(ref), self._slot_signature(m)
                for (field, x), (_, y) in zip(mine, theirs):
                    if x != y:
                        raise SpecError(
                            f"allocation {key!r}: regions {self.regions[ref].name!r} and "
                            f"{self.regions[m].name!r} are layer slots of one buffer but differ "
                            f"in {field} ({x} vs {y})"
                        )
        count = {k: len(v) for k, v in slot_keys.items()}
        full = []
        for i, r in enumerate(self.regions):
            full.append((*slots[i][:3], count[key_of(r)]))
        sizes = [0] * len(names)
        for i, (bk, bv, _, n) in enumerate(full):
            r = self.regions[i]
            blocks = max(x.num_blocks for x in self.regions if x.pool == r.pool) if r.pool \
                else r.num_blocks
            per = self._pages[i] // (2 if r.separate_kv else 1)
            for b in {bk, bv}:
                sizes[b] = n * blocks * per
        return Buffers(names=tuple(names), slots=tuple(full), nbytes=tuple(sizes))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineSpec:
        """Build from ``{"tp_size": int, "pp_size": int (optional), "regions": [...]}``."""
        if not isinstance(d, Mapping):
            raise SpecError(f"an engine spec must be a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - {"tp_size", "pp_size", "regions", "dcp_size", "dcp_interleave"})
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
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form; ``EngineSpec.from_dict(s.to_dict()) == s``."""
        d: dict[str, Any] = {"tp_size": self.tp_size}
        if self.pp_size != 1:
            d["pp_size"] = self.pp_size
        for field in ("dcp_size", "dcp_interleave"):  # written only when set
            if getattr(self, field) != 1:
                d[field] = getattr(self, field)
        d["regions"] = [r.to_dict() for r in self.regions]
        return d

    @property
    def num_ranks(self) -> int:
        """``tp_size * pp_size``: flat ranks ``pp_rank * tp_size + tp_rank``."""
        return self.tp_size * self.pp_size

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
        stage = rank // self.tp_size
        return tuple(i for i, s in enumerate(self._stages) if s == stage)

    def rank_block_nbytes(self, index: int) -> int:
        """Bytes of one block of region ``index`` on one rank (all streams, local units)."""
        r = self.regions[index]
        per_token = sum(c.streams * c.local_units(self.tp_size) * c.unit_bytes
                        for c in r.components)
        return r.block_size * per_token

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

    def rank_buffer_nbytes(self, buffer: int) -> int:
        """Bytes of buffer ``buffer`` (an index in :attr:`buffers`) on a rank that holds it."""
        return self._buffers.nbytes[buffer]

    def buffer_regions(self, buffer: int) -> tuple[int, ...]:
        """Indices of the regions living (wholly or one stream) in buffer ``buffer``."""
        return tuple(i for i, s in enumerate(self._buffers.slots) if buffer in s[:2])

    def __str__(self) -> str:
        pp = f", pp={self.pp_size}" if self.pp_size != 1 else ""
        if self.dcp_size != 1:
            pp += f", dcp={self.dcp_size} interleave {self.dcp_interleave}"
        lines = [f"EngineSpec tp={self.tp_size}{pp}, {len(self.regions)} regions"]
        lines += [f"  {i}: {r}" for i, r in enumerate(self.regions)]
        return "\n".join(lines)

    @classmethod
    def from_hf_config(
        cls, config: Any, *, tp_size: int, block_size: int = 16, num_blocks: int = 1024,
        dtype: str | None = None, pp_size: int = 1, draft: Any = None, **kwargs: Any,
    ) -> EngineSpec:
        """A spec from a Hugging Face ``config.json`` (a dict, or a path; nothing downloaded).

        Families, fields read, ``draft`` and the other options (``layout``, ``kv``,
        ``state_dtype``, ``family``): :func:`kvplan.hf.from_hf_config`.
        """
        from kvplan.hf import from_hf_config

        return from_hf_config(config, tp_size=tp_size, block_size=block_size,
                              num_blocks=num_blocks, dtype=dtype, pp_size=pp_size, draft=draft,
                              **kwargs)

    @classmethod
    def from_vllm(cls, kv_caches: Any, kv_cache_config: Any, **kwargs: Any) -> EngineSpec:
        """A spec from vLLM's own KV cache: the tensors ``register_kv_caches`` receives and
        the ``KVCacheConfig``; options and refusals: :func:`kvplan.adapters.vllm.spec_from_vllm`.
        """
        from kvplan.adapters.vllm import spec_from_vllm

        return spec_from_vllm(kv_caches, kv_cache_config, **kwargs)

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
        from kvplan.views import spec_html

        return spec_html(self)

    def to_pandas(self):
        """One row per region as a pandas DataFrame (needs pandas: ``kvplan[view]``)."""
        from kvplan.views import spec_frame

        return spec_frame(self)
