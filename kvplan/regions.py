"""Region specs: one region of an engine's KV cache (its kind, geometry, dtype and layout),
validated and immutable, with the enums and axis orders every spec shares.

Layer 1 (values), with :mod:`kvplan.spec` (the engine) and :mod:`kvplan.engine_derive` (what
an engine's regions add up to). It imports only :mod:`kvplan.errors` and
:mod:`kvplan.constants` (dtype sizes, limits): nothing here knows about ranks, plans or views. A
region enters through :meth:`RegionSpec.from_dict` (the JSON-able form), is checked on
construction, and leaves through ``to_dict``. :mod:`kvplan.spec` re-exports every public name
here, so ``from kvplan.spec import RegionSpec`` keeps working.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from kvplan.constants import (
    DTYPE_SIZES,
    MAX_BLOCK_SIZE,
    MAX_REGIONS,
    MAX_SPEC_DEPTH,
    MAX_SPEC_ITEMS,
)
from kvplan.errors import SpecError


def check_spec_json(d: Any, what: str) -> None:
    """Refuse a spec (or region) ``d`` nested deeper than :data:`MAX_SPEC_DEPTH` or with a key
    that is not a string, or holding more than :data:`MAX_SPEC_ITEMS` values, naming where
    (iterative: never recurses)."""
    stack = [(d, 0, what)]
    seen = 0
    while stack:
        v, depth, path = stack.pop()
        seen += 1
        if seen > MAX_SPEC_ITEMS:
            raise SpecError(f"{what}: more than {MAX_SPEC_ITEMS} values; a spec has at most "
                            f"{MAX_REGIONS} regions of a few fields each")
        if depth > MAX_SPEC_DEPTH:
            raise SpecError(f"{path}: nested deeper than {MAX_SPEC_DEPTH} levels of lists and "
                            "mappings; a spec is flat JSON")
        if isinstance(v, Mapping):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise SpecError(f"{path}: keys must be strings, got {type(k).__name__} "
                                    f"{str(k)[:40]}")
                stack.append((x, depth + 1, f"{path}.{k[:40]}"))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, depth + 1, f"{path}[{i}]") for i, x in enumerate(v))


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
    Kind.ATTENTION: ("num_kv_heads", "head_dim", "kv", "window", "stream",
                     *_TOKEN_KINDS_ONLY),
    Kind.MLA: ("dim", *_TOKEN_KINDS_ONLY),
    Kind.INDEXER: ("dim", *_TOKEN_KINDS_ONLY),
    Kind.STATE: ("parts",),
}
_COMMON = ("name", "kind", "group", "num_blocks", "dtype", "pool", "page_bytes", "stage",
           "layout", "allocation")
_OPTIONAL = ("kernel_block_size", "pool", "page_bytes", "stage", "stream")  # written when set
#: What an attention region's ``stream`` may say: it holds K alone or V alone (None: both).
STREAMS = ("k", "v")
#: Axes whose size is 1 for a kind whatever the rank (so their place in an order is moot);
#: engine_derive compares two layer slots' orders without them.
UNIT_AXES = {Kind.ATTENTION: "", Kind.MLA: "SH", Kind.INDEXER: "SH", Kind.STATE: "SHN"}


@attrs.frozen(kw_only=True)
class RegionSpec:
    """One region of a rank's KV cache: ``num_blocks`` equal blocks, usually one layer.

    Attention regions carry ``num_kv_heads``, ``head_dim``, ``layout``, ``kv`` and ``window``,
    and ``stream`` (``"k"`` or ``"v"``) when the region holds one of the two streams alone (K
    and V of different head sizes, e.g. 192 and 128, are then two regions of one stream each);
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
    stream: str | None = None
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
            f for f in ("num_kv_heads", "head_dim", "window", "stream", "dim", "parts",
                        "kernel_block_size")
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
            if self.stream is not None and self.stream not in STREAMS:
                raise SpecError(f"region {name!r}: stream {self.stream!r} is not one of "
                                f"{', '.join(map(repr, STREAMS))} (leave it out for K and V)")
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
                and not isinstance(a, tuple) and not isinstance(self.layout, Layout)
                and self.stream is None):
            raise SpecError(
                f"region {name!r}: layout {self.layout_name!r} has no S axis, which only a "
                "region keeping K and V in separate buffers (allocation [k, v]) or holding "
                "one stream (stream 'k' or 'v') may omit"
            )
        if a is not None:
            _check_allocation(self)
        if self.pool is not None:  # a block must be contiguous in its page: L, B outermost
            outer = [x for x in order if x not in UNIT_AXES[self.kind]][:2]
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
            return (Component("kv", self.num_kv_heads, self.head_dim * e,  # type: ignore[operator]
                              self.streams),)
        if self.kind is Kind.STATE:
            return tuple(Component(p.name, p.units, p.unit_bytes, 1) for p in self.parts or ())
        return (Component(self.kind.value, 1, self.dim * e, 1),)  # type: ignore[operator]

    @property
    def streams(self) -> int:
        """Number of streams per block: 2 (K, V) for attention (1 with ``stream``: K or V
        alone), 1 otherwise (key only)."""
        return 2 if self.kind is Kind.ATTENTION and self.stream is None else 1

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
        check_spec_json(d, "region")
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
            win += f" {self.stream.upper()} only" if self.stream else ""
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


def stream_label(r: RegionSpec) -> str:
    """What a block's streams hold, as tables name them: ``K+V``, ``K`` (key only, or K
    alone) or ``V`` (V alone)."""
    if r.kind is Kind.ATTENTION and r.stream is not None:
        return r.stream.upper()
    return "K+V" if r.streams == 2 else "K"


def _check_allocation(r: RegionSpec) -> None:
    """Refuse an ``allocation`` that is neither a buffer name nor a pair ``[k, v]`` of two,
    or a pair where K and V cannot be apart (one stream, another kind, a pool)."""
    name, a = r.name, r.allocation
    pair = isinstance(a, tuple)
    names = a if pair else (a,)
    if (pair and len(a) != 2) or not all(isinstance(x, str) and x for x in names):
        raise SpecError(
            f"region {name!r}: allocation must be a buffer name or a pair [k, v] of "
            f"buffer names, got {a!r}"
        )
    if pair and a[0] == a[1]:
        raise SpecError(f"region {name!r}: allocation [k, v] names {a[0]!r} twice")
    if pair and r.stream is not None:
        raise SpecError(
            f"region {name!r}: allocation [k, v] names two buffers but the region "
            f"holds one stream ({r.stream!r})"
        )
    if pair and r.kind is not Kind.ATTENTION:
        raise SpecError(
            f"region {name!r}: separate K and V buffers need an attention region, "
            f"a {r.kind.value} region has one stream"
        )
    if pair and r.pool is not None:
        raise SpecError(
            f"region {name!r}: a pooled region cannot keep K and V in separate buffers "
            f"(its block must be contiguous in its page of pool {r.pool!r})"
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
