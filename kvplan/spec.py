"""Engine and region specs: the validated, immutable description of one engine's KV cache.

A spec is what two engines exchange at handshake. It enters through ``from_dict`` (the JSON-able
form), is checked on construction, and leaves through ``to_dict``. Everything derived from it
(placements, byte layouts, plans) lives in other modules.
"""

from __future__ import annotations

import enum
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


class Kind(enum.Enum):
    """What a region's blocks hold; decides its streams and its placement over TP."""

    ATTENTION = "attention"  # K and V per token, heads SPLIT over ranks (sliding window included)
    MLA = "mla"  # one latent vector per token, REPLICATE on every rank
    INDEXER = "indexer"  # sparse-attention index keys per token, REPLICATE on every rank


class Layout(enum.Enum):
    """Order of heads and tokens inside one stream of one block (domain.md section 4)."""

    HND = "HND"  # heads outer, tokens inner: a head slice of a block is one run
    NHD = "NHD"  # tokens outer, heads inner: a head slice is block_size runs


class KV(enum.Enum):
    """Where the K and V streams live relative to the block axis."""

    SPLIT = "split"  # (2, num_blocks, ...): all K blocks, then all V blocks
    JOINT = "joint"  # (num_blocks, 2, ...): K and V of one block side by side


_ATTENTION_ONLY = ("num_kv_heads", "head_dim", "layout", "kv", "window")
_REPLICATED_ONLY = ("dim",)


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


@attrs.frozen(kw_only=True)
class RegionSpec:
    """One registered allocation of a rank's KV cache, cut into ``num_blocks`` equal blocks.

    Attention regions carry ``num_kv_heads``, ``head_dim``, ``layout``, ``kv`` and ``window``;
    MLA and indexer regions carry ``dim`` (values per token). ``group`` names the KV-cache group
    whose block table indexes this region. Construct from JSON with :meth:`from_dict`.
    """

    name: str
    kind: Kind
    num_blocks: int
    block_size: int
    dtype: str
    group: int = 0
    num_kv_heads: int | None = None
    head_dim: int | None = None
    layout: Layout = Layout.HND
    kv: KV = KV.SPLIT
    window: int | None = None
    dim: int | None = None

    def __attrs_post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not name:
            raise SpecError(f"region name must be a non-empty string, got {name!r}")
        if not isinstance(self.kind, Kind):
            raise SpecError(f"region {name!r}: kind must be a Kind, got {self.kind!r}")
        _positive(name, "num_blocks", self.num_blocks)
        _positive(name, "block_size", self.block_size)
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 0:
            raise SpecError(f"region {name!r}: group must be an integer >= 0, got {self.group!r}")
        if self.dtype not in DTYPE_SIZES:
            raise SpecError(
                f"region {name!r}: dtype {self.dtype!r} is not one of {', '.join(DTYPE_SIZES)}"
            )
        if self.kind is Kind.ATTENTION:
            _positive(name, "num_kv_heads", self.num_kv_heads)
            _positive(name, "head_dim", self.head_dim)
            if self.window is not None:
                _positive(name, "window", self.window)
            if self.dim is not None:
                raise SpecError(f"region {name!r}: an attention region has head_dim, not dim")
        else:
            _positive(name, "dim", self.dim)
            extra = [f for f in ("num_kv_heads", "head_dim", "window") if getattr(self, f)]
            if extra:
                raise SpecError(
                    f"region {name!r}: a {self.kind.value} region does not take {', '.join(extra)}"
                )

    @property
    def is_replicated(self) -> bool:
        """True when every rank holds the whole region (MLA, indexer): placement REPLICATE."""
        return self.kind is not Kind.ATTENTION

    @property
    def streams(self) -> int:
        """Number of streams per block: 2 (K, V) for attention, 1 (key only) otherwise."""
        return 2 if self.kind is Kind.ATTENTION else 1

    @property
    def heads(self) -> int:
        """Global count of shardable heads; a replicated region is one head every rank holds."""
        return self.num_kv_heads if self.kind is Kind.ATTENTION else 1  # type: ignore[return-value]

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token in one stream (the smallest unit ever copied)."""
        return self.features * DTYPE_SIZES[self.dtype]

    @property
    def features(self) -> int:
        """Values per head per token: ``head_dim`` for attention, ``dim`` otherwise."""
        return (self.head_dim if self.kind is Kind.ATTENTION else self.dim)  # type: ignore[return-value]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RegionSpec:
        """Build from the JSON-able form; unknown keys and keys of another kind are refused."""
        if not isinstance(d, Mapping):
            raise SpecError(f"a region must be a mapping, got {type(d).__name__}")
        name = d.get("name")
        for key in ("name", "kind", "num_blocks", "block_size", "dtype"):
            if key not in d:
                raise SpecError(f"region {name!r}: missing field {key!r}")
        kind = _enum(Kind, name, "kind", d["kind"])
        own = _ATTENTION_ONLY if kind is Kind.ATTENTION else _REPLICATED_ONLY
        known = {"name", "kind", "group", "num_blocks", "block_size", "dtype", *own}
        unknown = sorted(set(d) - known)
        if unknown:
            raise SpecError(f"region {name!r}: unknown field(s) {unknown} for kind {kind.value!r}")
        kwargs: dict[str, Any] = {
            "name": name,
            "kind": kind,
            "num_blocks": d["num_blocks"],
            "block_size": d["block_size"],
            "dtype": d["dtype"],
            "group": d.get("group", 0),
        }
        if kind is Kind.ATTENTION:
            for key in ("num_kv_heads", "head_dim"):
                if key not in d:
                    raise SpecError(f"region {name!r}: missing field {key!r}")
            kwargs.update(
                num_kv_heads=d["num_kv_heads"],
                head_dim=d["head_dim"],
                layout=_enum(Layout, name, "layout", d.get("layout", "HND")),
                kv=_enum(KV, name, "kv", d.get("kv", "split")),
                window=d.get("window"),
            )
        else:
            if "dim" not in d:
                raise SpecError(f"region {name!r}: missing field 'dim'")
            kwargs["dim"] = d["dim"]
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form, defaults written out; ``from_dict(r.to_dict()) == r``."""
        d: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind.value,
            "group": self.group,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "dtype": self.dtype,
        }
        if self.kind is Kind.ATTENTION:
            d.update(
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                layout=self.layout.value,
                kv=self.kv.value,
                window=self.window,
            )
        else:
            d["dim"] = self.dim
        return d

    def __str__(self) -> str:
        if self.kind is Kind.ATTENTION:
            win = f" window {self.window}" if self.window else ""
            shape = f"{self.num_kv_heads}x{self.head_dim} {self.layout.value} {self.kv.value}{win}"
        else:
            shape = f"dim {self.dim}"
        return (
            f"{self.name} [{self.kind.value} g{self.group}] {shape} {self.dtype}, "
            f"{self.num_blocks} blocks of {self.block_size}"
        )


def _regions(value: Any) -> tuple[RegionSpec, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class EngineSpec:
    """One engine's KV cache: its TP size and its regions, identical on every rank.

    Invariants checked on construction: region names are unique; group ids are ``0..G-1`` with
    none skipped; every attention region's ``num_kv_heads`` divides or is divided by ``tp_size``.
    """

    tp_size: int
    regions: tuple[RegionSpec, ...] = attrs.field(converter=_regions)

    def __attrs_post_init__(self) -> None:
        tp = self.tp_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
            raise SpecError(f"tp_size must be a positive integer, got {tp!r}")
        if not self.regions:
            raise SpecError("an engine spec needs at least one region")
        seen: set[str] = set()
        for r in self.regions:
            if not isinstance(r, RegionSpec):
                raise SpecError(f"regions must be RegionSpec values, got {type(r).__name__}")
            if r.name in seen:
                raise SpecError(f"region name {r.name!r} appears twice")
            seen.add(r.name)
            k = r.heads
            if not r.is_replicated and k % tp and tp % k:
                raise SpecError(
                    f"region {r.name!r}: num_kv_heads {k} and tp_size {tp} must divide one "
                    f"another ({k} % {tp} = {k % tp}, {tp} % {k} = {tp % k})"
                )
        groups = sorted({r.group for r in self.regions})
        if groups != list(range(len(groups))):
            raise SpecError(
                f"group ids must be 0..{len(groups) - 1} with none missing, got {groups}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineSpec:
        """Build from ``{"tp_size": int, "regions": [region dict, ...]}``."""
        if not isinstance(d, Mapping):
            raise SpecError(f"an engine spec must be a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - {"tp_size", "regions"})
        if unknown:
            raise SpecError(f"engine spec: unknown field(s) {unknown}")
        for key in ("tp_size", "regions"):
            if key not in d:
                raise SpecError(f"engine spec: missing field {key!r}")
        regions = d["regions"]
        if isinstance(regions, (str, bytes, Mapping)) or not hasattr(regions, "__iter__"):
            raise SpecError("engine spec: regions must be a list of region mappings")
        return cls(tp_size=d["tp_size"], regions=tuple(RegionSpec.from_dict(r) for r in regions))

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form; ``EngineSpec.from_dict(s.to_dict()) == s``."""
        return {"tp_size": self.tp_size, "regions": [r.to_dict() for r in self.regions]}

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

    def rank_block_nbytes(self, index: int) -> int:
        """Bytes of one block of region ``index`` on one rank (all its streams and local heads)."""
        r = self.regions[index]
        local_heads = max(1, r.heads // self.tp_size)  # a replicated region is one head
        return r.streams * r.block_size * local_heads * r.head_bytes

    def rank_region_nbytes(self, index: int) -> int:
        """Bytes of region ``index`` on one rank: the size of its registered allocation."""
        return self.regions[index].num_blocks * self.rank_block_nbytes(index)

    def __str__(self) -> str:
        lines = [f"EngineSpec tp={self.tp_size}, {len(self.regions)} regions"]
        lines += [f"  {i}: {r}" for i, r in enumerate(self.regions)]
        return "\n".join(lines)
