"""Token granules: how two block sizes that need not divide each other line up.

One block id covers ``span`` request positions on each side (``block_size``, times the DCP
size of a token region). Two spans ``a`` (source) and ``b`` (destination) meet every
``lcm(a, b)`` positions; between, both are cut at multiples of their *granule*
``g = gcd(a, b)``: every source and every destination block boundary is a granule boundary, so
a granule of ``g`` positions lies inside one source block and one destination block.

A destination block at position ``j`` starts ``(j * b) % a`` positions into source block
``(j * b) // a``; that offset repeats with period ``a // g`` in ``j``, so there are ``a // g``
*phases*, each with its own block template (the planner builds one per phase, the request
stage picks a phase per destination block by ``j % phases``). When one size divides the other
this is the old rule exactly: ``b | a`` gives ``a // b`` phases at offsets ``phase * b``, and
``a | b`` gives one phase at offset 0, so no plan changes where sizes divide (vLLM moves hybrid
caches of non-dividing block sizes in units of the gcd the same way, docs/concepts.md).

Layer 1 (values): imports errors only; compat and the planner call it.
"""

from __future__ import annotations

import math

from kvplan.errors import IncompatibleLayoutError

#: Largest ``lcm(spans) x (stream, unit)`` count a region pair may need: the templates of all
#: phases of one lane hold at most that many atoms, so this bounds handshake time and memory.
#: Every pair of dividing sizes stays under it (their lcm is a block the spec already bounds).
MAX_PHASE_ATOMS = 1 << 22


def granule(src_span: int, dst_span: int) -> int:
    """Positions of one granule: ``gcd(src_span, dst_span)``."""
    return math.gcd(src_span, dst_span)


def phases(src_span: int, dst_span: int) -> int:
    """Number of distinct offsets of a destination block inside its first source block."""
    return src_span // granule(src_span, dst_span)


def phase_offset(phase: int, src_span: int, dst_span: int) -> int:
    """Position, in its first source block, where a destination block of ``phase`` starts."""
    return (phase * dst_span) % src_span


def check_phase_budget(name: str, src_span: int, dst_span: int, atoms_per_position: int) -> None:
    """Refuse a region pair whose phase templates would exceed :data:`MAX_PHASE_ATOMS`.

    ``atoms_per_position`` counts (stream, unit) pieces of one position (global units: an upper
    bound of any one rank's). Raises :class:`IncompatibleLayoutError` naming the spans."""
    lcm = math.lcm(src_span, dst_span)
    if lcm * atoms_per_position > MAX_PHASE_ATOMS:
        raise IncompatibleLayoutError(
            f"region {name!r}: block ids of {src_span} (source) and {dst_span} (destination) "
            f"positions meet every lcm = {lcm} positions (granule gcd = "
            f"{granule(src_span, dst_span)}); {lcm} x {atoms_per_position} pieces per position "
            f"exceeds the planning limit {MAX_PHASE_ATOMS}: choose block sizes with a larger "
            "common divisor"
        )
