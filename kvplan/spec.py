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
#: Largest allocation (bytes on one rank) of a region or pool: offsets plus lengths stay < 2**63.
MAX_ALLOCATION_BYTES = 1 << 62
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
    """Where the K and V streams live relative to the block axis."""

    SPLIT = "split"  # (2, num_blocks, ...): all K blocks, then all V blocks
    JOINT = "joint"  # (num_blocks, 2, ...): K and V of one block side by side


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


_TOKEN_KINDS_ONLY = ("block_size", "kernel_block_size")
_OWN_FIELDS = {
    Kind.ATTENTION: ("num_kv_heads", "head_dim", "layout", "kv", "window", *_TOKEN_KINDS_ONLY),
    Kind.MLA: ("dim", *_TOKEN_KINDS_ONLY),
    Kind.INDEXER: ("dim", *_TOKEN_KINDS_ONLY),
    Kind.STATE: ("parts",),
}
_COMMON = ("name", "kind", "group", "num_blocks", "dtype", "pool", "page_bytes", "stage")
_OPTIONAL = ("kernel_block_size", "pool", "page_bytes", "stage")  # written only when set


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
    """

    name: str
    kind: Kind
    num_blocks: int
    block_size: int = 1
    dtype: str
    group: int = 0
    num_kv_heads: int | None = None
    head_dim: int | None = None
    layout: Layout = Layout.HND
    kv: KV = KV.SPLIT
    window: int | None = None
    dim: int | None = None
    parts: tuple[StatePart, ...] | None = attrs.field(default=None, converter=_parts)
    kernel_block_size: int | None = None
    pool: str | None = None
    page_bytes: int | None = None
    stage: int | None = None

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
            if self.kind is Kind.ATTENTION and self.kv is KV.SPLIT:
                raise SpecError(
                    f"region {name!r}: an attention region in pool {self.pool!r} needs kv "
                    "'joint' (a pooled block must be contiguous in its page)"
                )
        if self.page_bytes is not None:
            _positive(name, "page_bytes", self.page_bytes)
            if self.pool is None:
                raise SpecError(f"region {name!r}: page_bytes is only meaningful with a pool")

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
            kwargs["layout"] = _enum(Layout, name, "layout", d.get("layout", "HND"))
            kwargs["kv"] = _enum(KV, name, "kv", d.get("kv", "split"))
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
            d.update(
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                layout=self.layout.value,
                kv=self.kv.value,
                window=self.window,
            )
        elif self.kind is Kind.STATE:
            d["parts"] = [attrs.asdict(p) for p in self.parts or ()]
        else:
            d["dim"] = self.dim
        d.update({k: getattr(self, k) for k in _OPTIONAL if getattr(self, k) is not None})
        return d

    def __str__(self) -> str:
        if self.kind is Kind.ATTENTION:
            win = f" window {self.window}" if self.window else ""
            shape = f"{self.num_kv_heads}x{self.head_dim} {self.layout.value} {self.kv.value}{win}"
        elif self.kind is Kind.STATE:
            shape = " ".join(f"{p.name}:{p.units}x{p.unit_bytes}B" for p in self.parts or ())
        else:
            shape = f"dim {self.dim}"
        extra = "".join(
            f", {label} {getattr(self, k)}"
            for k, label in (("kernel_block_size", "kernel"), ("pool", "pool"), ("stage", "stage"))
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
    _stages: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)
    _pages: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        for field in ("tp_size", "pp_size"):
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
        object.__setattr__(self, "_stages", self._assign_stages())
        object.__setattr__(self, "_pages", self._assign_pages())
        self._check_sizes()

    def _check_sizes(self) -> None:
        """Refuse sizes whose byte offsets would not fit in int64 (see MAX_ALLOCATION_BYTES)."""
        most: dict[str, int] = {}  # per pool, its largest num_blocks (one pass: specs are big)
        for r in self.regions:
            if r.pool is not None:
                most[r.pool] = max(most.get(r.pool, 0), r.num_blocks)
        for i, r in enumerate(self.regions):
            nbytes = (r.num_blocks if r.pool is None else most[r.pool]) * self._pages[i]
            if nbytes > MAX_ALLOCATION_BYTES:
                raise SpecError(
                    f"region {r.name!r}: {nbytes} bytes on a rank ({r.num_blocks} blocks of "
                    f"{self._pages[i]} bytes) exceed the limit {MAX_ALLOCATION_BYTES} (2**62): "
                    "byte offsets must fit in int64"
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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineSpec:
        """Build from ``{"tp_size": int, "pp_size": int (optional), "regions": [...]}``."""
        if not isinstance(d, Mapping):
            raise SpecError(f"an engine spec must be a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - {"tp_size", "pp_size", "regions"})
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
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form; ``EngineSpec.from_dict(s.to_dict()) == s``."""
        d: dict[str, Any] = {"tp_size": self.tp_size}
        if self.pp_size != 1:
            d["pp_size"] = self.pp_size
        d["regions"] = [r.to_dict() for r in self.regions]
        return d

    @property
    def num_ranks(self) -> int:
        """``tp_size * pp_size``: flat ranks ``pp_rank * tp_size + tp_rank``."""
        return self.tp_size * self.pp_size

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
        """Index of the first region sharing region ``index``'s allocation (itself if unpooled).

        Regions of one pool share one registered buffer; copies carry offsets from its base.
        """
        pool = self.regions[index].pool
        if pool is None:
            return index
        return next(i for i, r in enumerate(self.regions) if r.pool == pool)

    def rank_region_nbytes(self, index: int) -> int:
        """Bytes of the allocation region ``index`` lives in on a rank that holds it: its own
        ``num_blocks`` pages, or for a pooled region the pool's (largest ``num_blocks`` of its
        regions, times the page)."""
        pool = self.regions[index].pool
        members = [i for i, r in enumerate(self.regions) if pool is not None and r.pool == pool]
        blocks = max(self.regions[i].num_blocks for i in members or [index])
        return blocks * self._pages[index]

    def __str__(self) -> str:
        pp = f", pp={self.pp_size}" if self.pp_size != 1 else ""
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

    def _repr_html_(self) -> str:
        """The regions as an HTML table for notebooks (layers alike on one row)."""
        from kvplan.views import spec_html

        return spec_html(self)

    def to_pandas(self):
        """One row per region as a pandas DataFrame (needs pandas: ``kvplan[view]``)."""
        from kvplan.views import spec_frame

        return spec_frame(self)
