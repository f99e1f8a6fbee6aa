"""What an engine's regions add up to: the checks across regions and the derived layout of
stages, pages and buffers that :class:`~kvplan.spec.EngineSpec` computes once on construction.

Layer 1 (values), below :mod:`kvplan.spec`: every function takes plain fields (the regions, the
sizes ``tp_size`` / ``pp_size`` / DCP / PCP, the stages and pages derived before) and returns
plain tuples, or raises :class:`~kvplan.SpecError` naming the region and the numbers;
``EngineSpec.__attrs_post_init__`` calls them in order and keeps the results. It imports
:mod:`kvplan.regions`, :mod:`kvplan.cp`, :mod:`kvplan.constants` and :mod:`kvplan.errors`, and
never the spec, not even for a type hint: the value stays one class that imports this module,
and this module holds the derivations that made it long.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import attrs

from kvplan.constants import MAX_ALLOCATION_BYTES, MAX_BLOCK_ATOMS
from kvplan.cp import check_pcp, is_pcp_sharded
from kvplan.errors import SpecError
from kvplan.regions import UNIT_AXES, Kind, RegionSpec


@attrs.frozen
class Buffers:
    """Where an engine's regions live: buffer names; per region ``(K buffer, V buffer, slot,
    slots)`` (one buffer twice unless K and V are separate); per buffer its bytes on a rank."""

    names: tuple[str, ...]
    slots: tuple[tuple[int, int, int, int], ...]
    nbytes: tuple[int, ...]



def _size_fields(r: Any) -> str:
    """``' (num_kv_heads 8, head_dim 128)'``: the fields a region's page size comes from, for
    a message refusing a size derived from them."""
    got = [f"{f} {getattr(r, f)}" for f in ("num_kv_heads", "head_dim", "dim")
           if getattr(r, f, None) is not None]
    return f" ({', '.join(got)})" if got else ""


def check_sizes(regions: Sequence[RegionSpec], buffers: Buffers, pages: Sequence[int]) -> None:
    """Refuse buffers whose byte offsets would not fit in int64 (see MAX_ALLOCATION_BYTES)."""
    for b, nbytes in enumerate(buffers.nbytes):
        if nbytes > MAX_ALLOCATION_BYTES:
            i = next(k for k, sl in enumerate(buffers.slots) if b in sl[:2])
            r = regions[i]
            raise SpecError(
                f"region {r.name!r}: {nbytes} bytes on a rank in buffer "
                f"{buffers.names[b]!r} (num_blocks {r.num_blocks} of {pages[i]} "
                f"bytes) exceed the limit {MAX_ALLOCATION_BYTES} (2**61): byte offsets must "
                f"fit in int64{_size_fields(r)}"
            )

def check_components(r: RegionSpec, tp: int) -> None:
    """Refuse a region whose block is too large, or whose unit counts and ``tp`` do not divide
    one another."""
    atoms = r.block_size * sum(c.streams * c.units for c in r.components)
    if atoms > MAX_BLOCK_ATOMS:
        raise SpecError(
            f"region {r.name!r}: a block holds {atoms} (stream, unit, token) pieces, over the "
            f"limit {MAX_BLOCK_ATOMS}: block_size {r.block_size} or the unit counts are too "
            f"large{_size_fields(r)}"
        )
    for c in r.components:
        k = c.units
        if k % tp and tp % k:
            what = "num_kv_heads" if r.kind is Kind.ATTENTION else f"part {c.name!r} units"
            raise SpecError(
                f"region {r.name!r}: {what} {k} and tp_size {tp} must divide one another "
                f"({k} % {tp} = {k % tp}, {tp} % {k} = {tp % k})"
            )

def check_dcp(regions: Sequence[RegionSpec], tp: int, dcp: int, il: int, pcp: int) -> None:
    """Decode context parallelism as vLLM lays it out (docs/concepts.md): the DCP groups
    are ``dcp`` consecutive ranks of a TP group that hold the same heads, each rank
    holding every ``dcp``-th run of ``il`` (``dcp_interleave``) tokens of a block id."""
    check_pcp(tp, pcp, dcp)
    # sharded PCP is DCP over the PCP ranks (TP 1): each rank has every head
    sharded = is_pcp_sharded(tp, pcp, dcp)
    if tp % dcp and not sharded:
        raise SpecError(
            f"dcp_size {dcp} does not divide tp_size {tp} ({tp} % {dcp} = {tp % dcp}): "
            "a DCP group is carved out of a TP group"
        )
    if dcp == 1:
        return
    for r in regions:
        if r.is_state:  # a state slot is not a sequence of tokens: TP placement only
            continue
        if r.kernel_size % il:  # vLLM's slot mapping works per kernel block: refuse
            what = "block_size" if r.kernel_block_size is None else "kernel_block_size"
            k, span = r.kernel_size, r.kernel_size * dcp
            first = span // (dcp * il) * il + min(il, span % (dcp * il))  # DCP rank 0's
            raise SpecError(
                f"region {r.name!r}: dcp_interleave {il} does not divide {what} {k} "
                f"({k} % {il} = {k % il}): vLLM's slot mapping would give DCP rank 0 "
                f"{first} of a kernel block's {span} positions, {first - k} past its "
                f"{k}-token block (docs/concepts.md, 'DCP interleave')"
            )
        k = r.heads
        if not sharded and (k * dcp > tp or (tp // k) % dcp):
            raise SpecError(
                f"region {r.name!r}: dcp_size {dcp} needs every DCP group to hold the same "
                f"heads: {k} head(s) over tp_size {tp} give {max(1, tp // k)} rank(s) per "
                f"head, not a multiple of {dcp}"
            )


def check_groups(regions: Sequence[RegionSpec]) -> None:
    """Refuse group ids other than ``0..G-1`` and a group mixing state and token regions."""
    groups = sorted({r.group for r in regions})
    if groups != list(range(len(groups))):
        raise SpecError(
            f"group ids must be 0..{len(groups) - 1} with none missing, got {groups}"
        )
    kinds_of: dict[int, set[bool]] = {}  # one pass over the regions, not one per group
    for r in regions:
        kinds_of.setdefault(r.group, set()).add(r.is_state)
    for g in groups:
        kinds = kinds_of[g]
        if len(kinds) > 1:
            names = [r.name for r in regions if r.group == g]
            raise SpecError(
                f"group {g} mixes state regions and token regions ({names}): a state group's "
                "block ids are slots, a token group's are pages of tokens"
            )

def assign_stages(regions: Sequence[RegionSpec], pp: int) -> tuple[int, ...]:
    """The pipeline stage of every region: as given, or cut evenly in spec order."""
    n = len(regions)
    given = [r.stage for r in regions]
    if all(s is None for s in given):
        if n < pp:
            raise SpecError(f"pp_size {pp} needs at least {pp} regions, got {n}")
        per, extra = divmod(n, pp)
        sizes = [per + (1 if s < extra else 0) for s in range(pp)]
        return tuple(s for s, size in enumerate(sizes) for _ in range(size))
    if any(s is None for s in given):
        missing = [r.name for r in regions if r.stage is None]
        raise SpecError(f"either every region names its stage or none does; missing: {missing}")
    for r in regions:
        if r.stage >= pp:  # type: ignore[operator]
            raise SpecError(f"region {r.name!r}: stage {r.stage} is not in [0, {pp})")
    if any(b < a for a, b in itertools.pairwise(given)):
        raise SpecError(f"stages must hold contiguous ranges in spec order, got {given}")
    if set(given) != set(range(pp)):
        raise SpecError(f"every stage needs a region: stages {sorted(set(given))} of {pp}")
    return tuple(given)  # type: ignore[arg-type]

def block_nbytes(r: RegionSpec, tp: int) -> int:
    """Bytes of one block of region ``r`` on one of ``tp`` ranks (all streams, local units)."""
    per_token = sum(c.streams * c.local_units(tp) * c.unit_bytes for c in r.components)
    return r.block_size * per_token


def assign_pages(regions: Sequence[RegionSpec], tp: int,
                 stages: Sequence[int]) -> tuple[int, ...]:
    """Every region's page on a rank: its block's bytes, or its pool's page (checked)."""
    blocks = [block_nbytes(r, tp) for r in regions]
    pages = list(blocks)
    pools: dict[str, list[int]] = {}
    for i, r in enumerate(regions):
        if r.pool is not None:
            pools.setdefault(r.pool, []).append(i)
    for pool, members in pools.items():
        shared = [regions[i] for i in members]
        groups = [r.group for r in shared]
        if len(set(groups)) != len(groups):
            raise SpecError(
                f"pool {pool!r}: regions {[r.name for r in shared]} share group(s) "
                f"{groups}; each view of a pool must belong to its own group"
            )
        if len({stages[i] for i in members}) > 1:
            raise SpecError(f"pool {pool!r}: its regions lie on different pipeline stages")
        explicit = {r.page_bytes for r in shared}
        if None in explicit and len(explicit) > 1:
            raise SpecError(f"pool {pool!r}: give page_bytes on every region or on none")
        if len(explicit) > 1:  # one allocation has one page size
            raise SpecError(
                f"pool {pool!r}: its regions give different page_bytes "
                f"{sorted(r.page_bytes for r in shared)}; one pool has one page size"
            )
        page = max(blocks[i] for i in members) if None in explicit else explicit.pop()
        for i in members:
            if blocks[i] > page:  # type: ignore[operator]
                raise SpecError(
                    f"pool {pool!r}: region {regions[i].name!r} needs "
                    f"{blocks[i]} bytes per block on a rank but the page is {page} bytes"
                )
            pages[i] = page  # type: ignore[call-overload]
    return tuple(pages)

def slot_signature(regions: Sequence[RegionSpec], pages: Sequence[int],
                   i: int) -> tuple[tuple[str, Any], ...]:
    """What sizes one layer slot of region ``i`` (compared across an allocation's slots)."""
    r = regions[i]
    if r.pool is not None or any(regions[m].pool is not None
                                 for m in alloc_members(regions, i)):
        outer = "".join(x for x in r.order if x not in UNIT_AXES[r.kind])[:2]
        blocks = max(x.num_blocks for x in regions if x.pool == r.pool) if r.pool \
            else r.num_blocks
        return (("pages", blocks), ("page bytes", pages[i]), ("outer axes", outer))
    comps = tuple((c.units, c.unit_bytes, c.streams) for c in r.components)
    order = "".join(x for x in r.order if x not in UNIT_AXES[r.kind])
    return (("num_blocks", r.num_blocks), ("block_size", r.block_size),
            ("kernel block", r.kernel_size), ("units, unit bytes and streams", comps),
            ("axis order", order))

def alloc_members(regions: Sequence[RegionSpec], i: int) -> list[int]:
    """Indices of the regions sharing region ``i``'s allocation (``[i]`` without one)."""
    a = regions[i].allocation
    return [i] if a is None else [m for m, r in enumerate(regions) if r.allocation == a]

def assign_buffers(regions: Sequence[RegionSpec], stages: Sequence[int],
                   pages: Sequence[int]) -> Buffers:
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
    for i, r in enumerate(regions):
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
            first = next(m for m, x in enumerate(regions) if x.pool == r.pool)
            if regions[first].allocation != a:
                raise SpecError(
                    f"pool {r.pool!r}: regions {regions[first].name!r} and {r.name!r} "
                    f"name different allocations ({regions[first].allocation!r}, "
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
        regs = [m for m, r in enumerate(regions) if r.allocation == key]
        ref = regs[0]
        for m in regs[1:]:
            if stages[m] != stages[ref]:
                raise SpecError(
                    f"allocation {key!r}: regions {regions[ref].name!r} and "
                    f"{regions[m].name!r} lie on different pipeline stages"
                )
            mine, theirs = slot_signature(regions, pages, ref), slot_signature(regions, pages, m)
            for (field, x), (_, y) in zip(mine, theirs):
                if x != y:
                    raise SpecError(
                        f"allocation {key!r}: regions {regions[ref].name!r} and "
                        f"{regions[m].name!r} are layer slots of one buffer but differ "
                        f"in {field} ({x} vs {y})"
                    )
    count = {k: len(v) for k, v in slot_keys.items()}
    full = []
    for i, r in enumerate(regions):
        full.append((*slots[i][:3], count[key_of(r)]))
    sizes = [0] * len(names)
    for i, (bk, bv, _, n) in enumerate(full):
        r = regions[i]
        blocks = max(x.num_blocks for x in regions if x.pool == r.pool) if r.pool \
            else r.num_blocks
        per = pages[i] // (2 if r.separate_kv else 1)
        for b in {bk, bv}:
            sizes[b] = n * blocks * per
    return Buffers(names=tuple(names), slots=tuple(full), nbytes=tuple(sizes))
