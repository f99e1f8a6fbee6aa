"""The numbers every layer shares: the bytes of each dtype a spec may name and the limits a
spec must respect (docs/design.md, "Limits of a spec").

Layer 0: imports nothing from kvplan. They sit at the bottom so that a module of any layer
(the region value, the config and engine adapters, the strategies) reads them without importing
the value modules: ``kvplan.hf_families`` once imported ``kvplan.spec`` for ``DTYPE_SIZES``
alone. :mod:`kvplan.regions` and :mod:`kvplan.spec` re-export them, where they were defined
before.
"""

from __future__ import annotations

from collections.abc import Mapping

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
#: Deepest nesting of lists and mappings a spec's JSON form may have (a real one has 5: engine,
#: regions, region, parts, shape); checked without recursion before anything else reads it, so
#: a forged spec nested 10^5 deep is refused instead of overflowing the stack in a repr.
MAX_SPEC_DEPTH = 16
#: Most values (lists, mappings and scalars) a spec's JSON form may hold: ample for
#: MAX_REGIONS regions, and it bounds the walk of the depth check.
MAX_SPEC_ITEMS = MAX_REGIONS * 256
