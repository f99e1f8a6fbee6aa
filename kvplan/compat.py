"""What a handshake refuses: two valid specs that cannot exchange KV, named with their numbers.

Every layout pair (HND/NHD, split/joint, kernel blocks, pools, either way) and every pair of
pipeline sizes is supported by the one planning rule, so none is refused for its layout alone.
What is refused is what would make the bytes meaningless (different heads, dims, dtypes, kinds,
windows, state parts) or what the placement rule does not define (TP sizes that do not
divide). Block sizes need not divide: two sizes plan by their gcd (``granules.py``).

Layer 1 (values): imports spec, granules, names and errors; the planner calls it at handshake.
"""

from __future__ import annotations

from kvplan.errors import IncompatibleLayoutError
from kvplan.granules import check_phase_budget
from kvplan.names import compact_names
from kvplan.spec import EngineSpec, RegionSpec

# Fields that must be equal on both sides of a region pair, with how to name them in a message.
_MUST_MATCH = (
    ("kind", "kind"),
    ("dtype", "dtype"),
    ("num_kv_heads", "num_kv_heads"),
    ("head_dim", "head_dim"),
    ("dim", "dim"),
    ("window", "window"),
    ("stream", "stream (K or V alone)"),
    ("parts", "state parts"),
)


def _plain(v):
    """A field value as it reads in JSON (enum values, parts as name:units x bytes)."""
    if isinstance(v, tuple):
        return [f"{p.name}:{p.units}x{p.unit_bytes}B" for p in v]
    return getattr(v, "value", v)


def _divides_either_way(a: int, b: int) -> bool:
    return a % b == 0 or b % a == 0


def region_pairs(src: EngineSpec, dst: EngineSpec) -> tuple[tuple[int, int], ...]:
    """Pair regions by name, in destination order; refuse any mismatch between the two specs.

    Returns ``(src_index, dst_index)`` per destination region. Raises
    :class:`IncompatibleLayoutError` naming the region and the numbers that disagree.
    """
    if not _divides_either_way(src.tp_size, dst.tp_size):
        raise IncompatibleLayoutError(
            f"TP sizes do not divide: source tp {src.tp_size}, destination tp {dst.tp_size} "
            f"({max(src.tp_size, dst.tp_size)} % {min(src.tp_size, dst.tp_size)} = "
            f"{max(src.tp_size, dst.tp_size) % min(src.tp_size, dst.tp_size)})"
        )
    src_names = [r.name for r in src.regions]
    dst_names = [r.name for r in dst.regions]
    if set(src_names) != set(dst_names):
        # in the compact notation (layers.[0-60].mla x61): a list of 141 names is unreadable
        only_src = [n for n in src_names if n not in set(dst_names)]
        only_dst = [n for n in dst_names if n not in set(src_names)]
        raise IncompatibleLayoutError(
            f"region names differ: source has {len(src_names)} regions, destination "
            f"{len(dst_names)}; only on source: {compact_names(only_src) or 'none'}; only on "
            f"destination: {compact_names(only_dst) or 'none'}"
        )
    pairs = []
    for j, d in enumerate(dst.regions):
        i = src.region_index(d.name)
        check_region_pair(src.regions[i], d)
        if not d.is_state:  # any two block sizes plan by their gcd, within a size budget
            check_phase_budget(d.name, src.positions_per_block(i), dst.positions_per_block(j),
                               sum(c.streams * c.units for c in d.components))
        pairs.append((i, j))
    return tuple(pairs)


def check_region_pair(s: RegionSpec, d: RegionSpec) -> None:
    """Refuse a source/destination region pair whose bytes cannot correspond."""
    for attr, label in _MUST_MATCH:
        a, b = getattr(s, attr), getattr(d, attr)
        if a != b:
            a, b = (_plain(v) for v in (a, b))
            raise IncompatibleLayoutError(
                f"region {d.name!r}: {label} differs: source {a!r}, destination {b!r}"
            )
