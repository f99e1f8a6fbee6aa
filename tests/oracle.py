"""Reference oracle for kvplan tests.

This module is an *independent* re-derivation of ``docs/domain.md`` sections 2-4 and 7 (TP
placement of heads and state units, request semantics, physical byte layouts, shared pools,
kernel blocks, pipeline stages), written without looking at the planner. It works on plain
JSON-like spec dicts and numpy ``uint8`` buffers and answers one question: after a correct
transfer, what must every byte of a destination rank hold, and which bytes must have been
written?

It is deliberately simple rather than fast or clever: every copied element is located by its
logical coordinates (token position, stream, global head, feature, byte; or slot, part, global
unit, byte) on both sides, and the byte offsets come straight from the formulas below. The
source buffers are filled through numpy views built with reshape/transpose only (no offset
arithmetic), so the two paths check each other.

Spec dict (one engine)::

    {"tp_size": 4, "pp_size": 1,
     "regions": [
       {"name": "layers.0.attn", "kind": "attention", "group": 0, "num_blocks": 1024,
        "block_size": 16, "dtype": "bfloat16", "num_kv_heads": 8, "head_dim": 128,
        "layout": "HND", "kv": "split", "window": None, "kernel_block_size": 16},
       {"name": "draft.0.mla", "kind": "mla", "num_blocks": 1024, "block_size": 16,
        "dtype": "bfloat16", "dim": 576, "pool": "p0"},
       {"name": "layers.1.kda", "kind": "state", "group": 1, "num_blocks": 64,
        "dtype": "bfloat16", "pool": "p0",
        "parts": [{"name": "x", "units": 8, "unit_bytes": 6}, ...]}]}

Defaults: ``pp_size`` 1; ``group`` 0, ``pool`` None, ``page_bytes`` None, ``stage`` None (by
position); token kinds also ``window`` None, ``layout`` "HND", ``kv`` "split",
``kernel_block_size`` = ``block_size``.

Semantics (the contract the planner follows too):

- TP placement: a rank holds ``max(1, K // tp)`` of ``K`` heads (of ``U`` units for each state
  part); with ``K >= tp`` rank ``r`` holds ``[r*K/tp, (r+1)*K/tp)``, else head ``r*K//tp``.
- Token regions (attention / mla / indexer): logical block ``L`` with ``n = block_size //
  kernel_block_size`` is laid out as kernel blocks ``L*n .. L*n+n-1`` of a region with
  ``block_size = kernel_block_size`` and ``num_blocks * n`` blocks (domain.md section 4 table).
- State regions: a block is a slot; on a rank slot ``b`` starts at ``b * slot_bytes``, part
  ``p`` at the sum of the earlier parts' local sizes, local unit ``u`` at ``+ u * unit_bytes``.
- Pools: regions naming the same ``pool`` share one buffer per rank; block ``b`` of each starts
  at ``b * page_bytes`` (the largest per-rank block size of the pool's regions, or the explicit
  ``page_bytes``); inside a page the region's block has its normal (joint / kernel) layout.
  The pool's buffer holds ``max(num_blocks) * page_bytes`` bytes.
- Pipeline stages: regions are cut in spec order into ``pp_size`` contiguous ranges (earlier
  stages take one more) unless every region names its ``stage``; flat rank = ``pp_rank * tp +
  tp_rank`` and a rank holds only its stage's regions. With ``pcp_size`` (prefill context
  parallelism, vLLM's order PP x PCP x TP) flat rank = ``(pp_rank * pcp + pcp_rank) * tp +
  tp_rank``; every PCP rank holds a replica of its stage, except under sharded PCP (TP 1,
  ``pcp_size == dcp_size``) where PCP rank ``q`` is DCP rank ``q``.
- Requests: ``blocks[g]`` lists group ``g``'s block ids. Token regions copy token positions
  ``copied_positions(...)`` (all positions both lists cover, or exactly ``tokens=(start,
  end)``, a window keeping the last ``(window // bs_dst + 1) * bs_dst`` of them); state
  regions copy slot ``src[g][j]`` to slot ``dst[g][j]`` for
  every ``j`` (equal lengths), all parts.

Buffers are dicts keyed ``(flat rank, region_index)`` holding one flat ``uint8`` array per
region per rank (of ``rank_region_nbytes`` bytes), only for the regions of the rank's stage;
every region of a pool maps to the same array object.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

ELEMENT_SIZE: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "uint8": 1,
}

SPLIT_KINDS = ("attention",)
REPLICATE_KINDS = ("mla", "indexer")
TOKEN_KINDS = SPLIT_KINDS + REPLICATE_KINDS
STATE_KINDS = ("state",)

_COMMON_DEFAULTS = {"group": 0, "pool": None, "page_bytes": None, "stage": None,
                    "allocation": None, "layout": "HND"}
_DEFAULTS = {"window": None, "layout": "HND", "kv": "split", "kernel_block_size": None,
             "stream": None}
_TOKEN_ONLY = ("block_size", "kv", "window", "num_kv_heads", "head_dim", "dim",
               "kernel_block_size", "stream")

#: The legacy names as axis orders (L layer slot, B block, S stream, H head, N token, D bytes).
LEGACY_ORDERS = {("HND", "split"): "LSBHND", ("HND", "joint"): "LBSHND",
                 ("NHD", "split"): "LSBNHD", ("NHD", "joint"): "LBSNHD"}
#: Axes that have size 1 whatever the rank, per kind (their place in an order is moot).
UNIT_AXES = {"attention": "", "mla": "SH", "indexer": "SH", "state": "SHN"}


def axis_order(region: Mapping) -> str:
    """The six-letter order of ``region``'s layout: legacy HND/NHD with kv, ``C`` = ``SD``."""
    lay, kv = region.get("layout", "HND"), region.get("kv", "split")
    if lay in ("HND", "NHD"):
        return LEGACY_ORDERS[(lay, kv)]
    if "kv" in region and region["kv"] != "split":
        raise ValueError(f"region {region['name']!r}: kv with an axis order")
    order = lay[:-1] + "SD" if lay.endswith("C") else lay
    if len(order) == 5 and "S" not in order:
        order = "S" + order  # one stream per buffer
    if sorted(order) != sorted("LBSHND") or order[-1] != "D":
        raise ValueError(f"region {region['name']!r}: bad layout {lay!r}")
    return order

# ---------------------------------------------------------------------------------------------
# Region helpers
# ---------------------------------------------------------------------------------------------


def normalize_region(region: Mapping) -> dict:
    """Return a copy of ``region`` with the defaults applied and basic sanity checks done."""
    kind = region["kind"]
    r = dict(_COMMON_DEFAULTS)
    if kind in STATE_KINDS:
        extra = [k for k in _TOKEN_ONLY if k in region]
        if extra:
            raise ValueError(f"state region {region['name']!r} has token keys {extra}")
        r.update(region)
        parts = [dict(p) for p in r["parts"]]
        if not parts or len({p["name"] for p in parts}) != len(parts):
            raise ValueError(f"state region {r['name']!r}: parts empty or names repeated")
        for p in parts:
            for key in ("units", "unit_bytes"):
                if not isinstance(p[key], int) or p[key] <= 0:
                    raise ValueError(f"state region {r['name']!r}: bad {key} in {p}")
        r["parts"] = parts
    elif kind in TOKEN_KINDS:
        r.update(_DEFAULTS)
        r.update(region)
        if r["kernel_block_size"] is None:
            r["kernel_block_size"] = r["block_size"]
        if r["block_size"] % r["kernel_block_size"]:
            raise ValueError(f"region {r['name']!r}: kernel_block_size does not divide block_size")
        if kind in SPLIT_KINDS and r["kv"] not in ("split", "joint"):
            raise ValueError(f"bad kv {r['kv']!r}")
        if r["stream"] not in (None, "k", "v") or (r["stream"] and kind not in SPLIT_KINDS):
            raise ValueError(f"region {r['name']!r}: bad stream {r['stream']!r}")
    else:
        raise ValueError(f"unknown kind {kind!r}")
    order = [a for a in axis_order(r) if a not in UNIT_AXES[kind]]
    if r["pool"] is not None and sorted(order[:2]) != ["B", "L"]:
        raise ValueError(f"region {r['name']!r}: a pooled region needs L and B outermost "
                         "(a pooled attention region must be joint)")
    if isinstance(r["allocation"], (list, tuple)) and kind not in SPLIT_KINDS:
        raise ValueError(f"region {r['name']!r}: separate K/V buffers need attention")
    if r["dtype"] not in ELEMENT_SIZE:
        raise ValueError(f"unknown dtype {r['dtype']!r}")
    return r


def is_split(region: Mapping) -> bool:
    return region["kind"] in SPLIT_KINDS


def is_state(region: Mapping) -> bool:
    return region["kind"] in STATE_KINDS


def heads_on_rank(num_kv_heads: int, tp_size: int, rank: int) -> list[int]:
    """Global KV-head (or state-unit) indices held by TP ``rank``, in local order (section 2)."""
    k, tp = num_kv_heads, tp_size
    if not (k % tp == 0 or tp % k == 0):
        raise ValueError(f"num_kv_heads {k} and tp_size {tp} do not divide")
    if k >= tp:
        per = k // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * k // tp]


units_on_rank = heads_on_rank


def _local_heads(region: Mapping, tp_size: int) -> int:
    """H: number of heads held by one rank (1 for replicated kinds: one pseudo-head)."""
    if is_split(region):
        heads_on_rank(region["num_kv_heads"], tp_size, 0)  # divisibility check
        return max(1, region["num_kv_heads"] // tp_size)
    return 1


def _num_streams(region: Mapping) -> int:
    """2 (K and V) for attention, 1 for an attention region holding one ("stream": "k" or
    "v", e.g. K and V of different head sizes as two regions) and for the other kinds."""
    return 2 if is_split(region) and not region.get("stream") else 1


def _features(region: Mapping) -> int:
    return region["head_dim"] if is_split(region) else region["dim"]


def part_layout(region: Mapping, tp_size: int) -> list[tuple[int, int, int]]:
    """``(start, local_units, unit_bytes)`` of each part of a state slot on one rank."""
    r = normalize_region(region)
    out, start = [], 0
    for p in r["parts"]:
        heads_on_rank(p["units"], tp_size, 0)  # divisibility check
        lu = max(1, p["units"] // tp_size)
        out.append((start, lu, p["unit_bytes"]))
        start += lu * p["unit_bytes"]
    return out


def rank_block_nbytes(region: Mapping, tp_size: int) -> int:
    """Bytes of ONE logical block (state: one slot) of ``region`` on one rank."""
    r = normalize_region(region)
    if is_state(r):
        return sum(lu * ub for _, lu, ub in part_layout(r, tp_size))
    e = ELEMENT_SIZE[r["dtype"]]
    return _num_streams(r) * r["block_size"] * _local_heads(r, tp_size) * _features(r) * e


def _spec_regions(spec: Mapping) -> list[dict]:
    return [normalize_region(r) for r in spec["regions"]]


def pool_members(spec: Mapping, index: int) -> list[int]:
    """Indices (spec order) of the regions sharing region ``index``'s pool (itself if none)."""
    regions = _spec_regions(spec)
    pool = regions[index]["pool"]
    if pool is None:
        return [index]
    return [i for i, r in enumerate(regions) if r["pool"] == pool]


def page_nbytes(spec: Mapping, index: int) -> int:
    """Bytes from one block of region ``index`` to the next on a rank: the pool's page size
    for a pooled region, the region's own block size otherwise."""
    regions = _spec_regions(spec)
    tp = spec["tp_size"]
    members = [regions[i] for i in pool_members(spec, index)]
    sizes = [rank_block_nbytes(m, tp) for m in members]
    if regions[index]["pool"] is None:
        return sizes[0]
    given = [m["page_bytes"] for m in members]
    if all(g is None for g in given):
        return max(sizes)
    if any(g is None for g in given) or len(set(given)) != 1:
        raise ValueError(f"pool {regions[index]['pool']!r}: page_bytes given on some regions "
                         f"or with different values: {given}")
    if given[0] < max(sizes):
        raise ValueError(f"pool {regions[index]['pool']!r}: page_bytes {given[0]} is smaller "
                         f"than a block of {max(sizes)} bytes")
    return given[0]


def rank_region_nbytes(region: Mapping, tp_size: int, spec: Mapping | None = None) -> int:
    """Bytes of ``region``'s buffer on one rank of an engine with ``tp_size`` ranks per stage.

    For a pooled region this is the pool's allocation, ``max(num_blocks) * page_bytes`` over
    the pool's regions, and ``spec`` (the engine holding it) is required.
    """
    r = normalize_region(region)
    if r["allocation"] is not None:
        if spec is None or spec["tp_size"] != tp_size:
            raise ValueError(f"region {r['name']!r} names an allocation: pass its spec")
        return buffer_nbytes(spec, region_buffers(r)[0])
    if r["pool"] is None:
        return r["num_blocks"] * rank_block_nbytes(r, tp_size)
    if spec is None:
        raise ValueError(f"region {r['name']!r} is pooled: pass the spec")
    if spec["tp_size"] != tp_size:
        raise ValueError("tp_size differs from the spec's")
    index = [x["name"] for x in _spec_regions(spec)].index(r["name"])
    members = pool_members(spec, index)
    return max(normalize_region(spec["regions"][i])["num_blocks"] for i in members) * (
        page_nbytes(spec, index)
    )


# ---------------------------------------------------------------------------------------------
# Engine helpers: groups, pools, stages
# ---------------------------------------------------------------------------------------------


def world_size(spec: Mapping) -> int:
    """Number of flat ranks: ``pp_size * pcp_size * tp_size`` (vLLM orders them PP x PCP x
    TP: flat rank ``(pp_rank * pcp + pcp_rank) * tp + tp_rank``)."""
    return spec.get("pp_size", 1) * spec.get("pcp_size", 1) * spec["tp_size"]


def pcp_sharded(spec: Mapping) -> bool:
    """vLLM 0.33's sharded prefill context parallelism: TP 1 and ``pcp_size == dcp_size`` > 1,
    PCP rank ``q`` holding DCP shard ``q``. Any other ``pcp_size`` > 1: each PCP rank holds a
    full replica (``v1/attention/ops/pcp.py`` all-gathers the KV before writing the cache)."""
    pcp = spec.get("pcp_size", 1)
    return pcp > 1 and spec["tp_size"] == 1 and spec.get("dcp_size", 1) == pcp


def dcp_rank_of(spec: Mapping, rank: int) -> int:
    """The DCP rank of flat ``rank``: its PCP rank under sharded PCP, else TP rank mod DCP."""
    tp, pcp, dcp = spec["tp_size"], spec.get("pcp_size", 1), spec.get("dcp_size", 1)
    return (rank // tp) % pcp if pcp_sharded(spec) else (rank % tp) % dcp


def region_stages(spec: Mapping) -> list[int]:
    """Pipeline stage of each region (spec order)."""
    pp = spec.get("pp_size", 1)
    regions = _spec_regions(spec)
    given = [r["stage"] for r in regions]
    if all(s is None for s in given):
        n = len(regions)
        base, extra = divmod(n, pp)
        stages = []
        for s in range(pp):
            stages += [s] * (base + (1 if s < extra else 0))
    elif any(s is None for s in given):
        raise ValueError("stage given on some regions but not all")
    else:
        if any(not (0 <= s < pp) for s in given):
            raise ValueError(f"stage out of range 0..{pp - 1}: {given}")
        stages = list(given)
    for i, r in enumerate(regions):
        if r["pool"] is not None:
            if len({stages[m] for m in pool_members(spec, i)}) != 1:
                raise ValueError(f"pool {r['pool']!r} spans several stages")
    return stages


def rank_regions(spec: Mapping, rank: int) -> list[int]:
    """Region indices held by flat ``rank``."""
    if not 0 <= rank < world_size(spec):
        raise ValueError(f"rank {rank} out of range")
    stage = rank // (spec["tp_size"] * spec.get("pcp_size", 1))
    return [i for i, s in enumerate(region_stages(spec)) if s == stage]


def check_spec(spec: Mapping) -> list[dict]:
    """Validate the engine-level rules; return the normalised regions."""
    regions = _spec_regions(spec)
    if len({r["name"] for r in regions}) != len(regions):
        raise ValueError("region names repeat")
    kinds_by_group: dict[int, set[bool]] = {}
    for r in regions:
        kinds_by_group.setdefault(r["group"], set()).add(is_state(r))
    for g, ks in kinds_by_group.items():
        if len(ks) > 1:
            raise ValueError(f"group {g} mixes state and token regions")
    for i, r in enumerate(regions):
        if r["pool"] is not None:
            groups = [regions[m]["group"] for m in pool_members(spec, i)]
            if len(set(groups)) != len(groups):
                raise ValueError(f"pool {r['pool']!r}: two regions in one group")
            page_nbytes(spec, i)
    region_stages(spec)
    return regions


# ---------------------------------------------------------------------------------------------
# Offsets (the formulas) and views (reshape / transpose only)
# ---------------------------------------------------------------------------------------------


def element_offset(region: Mapping, tp_size: int, s, b, h, t, f, page_bytes: int | None = None):
    """Byte offset of element (stream s, LOGICAL block b, LOCAL head h, token t of the logical
    block, feature f) of a token region, from the region's (or its pool's) base.

    The table of domain.md section 4 applied to the kernel-block region (``block_size =
    kernel_block_size``, ``num_blocks * n`` blocks, token ``t`` in kernel block ``b*n + t //
    kbs``). With ``page_bytes`` (pooled) the block starts at ``b * page_bytes`` and the
    formula is applied with kernel block ``t // kbs`` relative to the page start. Arguments
    may be numpy arrays (broadcast together); ``h`` and ``s`` are ignored for MLA / indexer.
    """
    r = normalize_region(region)
    e = ELEMENT_SIZE[r["dtype"]]
    kbs = r["kernel_block_size"]
    n = r["block_size"] // kbs
    if page_bytes is None:
        base, kb, nb = 0, b * n + t // kbs, r["num_blocks"] * n
    else:
        base, kb, nb = b * page_bytes, t // kbs, None
    tk = t % kbs
    if not is_split(r):
        ff = r["dim"]
        return base + ((kb * kbs + tk) * ff + f) * e
    hh = _local_heads(r, tp_size)
    d, ns = r["head_dim"], _num_streams(r)
    if r["kv"] == "split" and page_bytes is None:
        if r["layout"] == "NHD":
            return ((((s * nb + kb) * kbs + tk) * hh + h) * d + f) * e
        return ((((s * nb + kb) * hh + h) * kbs + tk) * d + f) * e
    if r["kv"] == "joint" and r["layout"] == "NHD":
        return base + ((((kb * ns + s) * kbs + tk) * hh + h) * d + f) * e
    if r["kv"] == "joint" and r["layout"] == "HND":
        return base + ((((kb * ns + s) * hh + h) * kbs + tk) * d + f) * e
    raise ValueError("a pooled attention region must be joint")


def state_offset(region: Mapping, tp_size: int, b, p: int, u, k, page_bytes: int | None = None):
    """Byte offset of byte ``k`` of LOCAL unit ``u`` of part ``p`` (index) in slot ``b``."""
    layout = part_layout(region, tp_size)
    slot = page_bytes if page_bytes is not None else sum(lu * ub for _, lu, ub in layout)
    start, _, ub = layout[p]
    return b * slot + start + u * ub + k


def _paged(buf: np.ndarray, page: int, num_blocks: int, block: int) -> np.ndarray:
    """``[num_blocks, block]`` view of the first ``block`` bytes of each page of ``buf``."""
    if buf.size % page:
        raise ValueError(f"buffer of {buf.size} bytes is not a whole number of {page}-byte pages")
    return buf.reshape(-1, page)[:num_blocks, :block]


def _check_view(v: np.ndarray, buf: np.ndarray) -> np.ndarray:
    assert np.may_share_memory(v, buf), "oracle bug: reshape copied"
    return v


def token_view(
    region: Mapping, tp_size: int, buf: np.ndarray, page_bytes: int | None = None
) -> np.ndarray:
    """View of one rank's buffer as ``[stream, block, local head, kernel block j, token in
    kernel block, feature, byte]`` (logical token = ``j * kbs + token``).

    Built from the tensor shapes of domain.md section 4 with reshape/transpose only (no offset
    arithmetic), so it is an independent check of :func:`element_offset`. MLA / indexer
    regions get a stream axis and a head axis of length 1. The result is a view of ``buf``.
    """
    r = normalize_region(region)
    e = ELEMENT_SIZE[r["dtype"]]
    nb, kbs, ff = r["num_blocks"], r["kernel_block_size"], _features(r)
    n = r["block_size"] // kbs
    hh, ns = _local_heads(r, tp_size), _num_streams(r)
    if is_split(r) and r["kv"] == "split":
        if page_bytes is not None:
            raise ValueError("a pooled attention region must be joint")
        if r["layout"] == "NHD":
            v = buf.reshape(ns, nb, n, kbs, hh, ff, e).transpose(0, 1, 4, 2, 3, 5, 6)
        else:
            v = buf.reshape(ns, nb, n, hh, kbs, ff, e).transpose(0, 1, 3, 2, 4, 5, 6)
        return _check_view(v, buf)
    block = rank_block_nbytes(r, tp_size)
    m = _paged(buf, page_bytes if page_bytes is not None else block, nb, block)
    if not is_split(r):
        v = m.reshape(nb, n, kbs, ff, e)[None, :, None]
    elif r["layout"] == "NHD":
        v = m.reshape(nb, n, ns, kbs, hh, ff, e).transpose(2, 0, 4, 1, 3, 5, 6)
    else:
        v = m.reshape(nb, n, ns, hh, kbs, ff, e).transpose(2, 0, 3, 1, 4, 5, 6)
    return _check_view(v, buf)


def logical_view(
    region: Mapping, tp_size: int, buf: np.ndarray, page_bytes: int | None = None
) -> np.ndarray:
    """``[stream, block, local head, token, feature, byte]`` view of a token region whose
    kernel block is its logical block (n = 1)."""
    v = token_view(region, tp_size, buf, page_bytes)
    if v.shape[3] != 1:
        raise ValueError("region has kernel blocks: use token_view")
    return v[:, :, :, 0]


def state_views(
    region: Mapping, tp_size: int, buf: np.ndarray, page_bytes: int | None = None
) -> list[np.ndarray]:
    """One ``[slot, local unit, byte]`` view of ``buf`` per part of a state region."""
    r = normalize_region(region)
    slot = rank_block_nbytes(r, tp_size)
    m = _paged(buf, page_bytes if page_bytes is not None else slot, r["num_blocks"], slot)
    out, start = [], 0
    for p in r["parts"]:
        lu = max(1, p["units"] // tp_size)
        size = lu * p["unit_bytes"]
        out.append(_check_view(m[:, start : start + size].reshape(-1, lu, p["unit_bytes"]), buf))
        start += size
    return out


# ---------------------------------------------------------------------------------------------
# Hashing
# ---------------------------------------------------------------------------------------------

_U64 = np.uint64


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = np.asarray(x, dtype=_U64)
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    x = x ^ (x >> _U64(31))
    return x


def _name_key(name: str, seed: int) -> np.ndarray:
    digest = hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=8).digest()
    return np.array(int.from_bytes(digest, "little"), dtype=_U64)


def content_hash(name: str, seed: int, s, b, t, gh, f, k) -> np.ndarray:
    """Source byte value for (region name, stream, block id, token, GLOBAL head, feature,
    byte-within-element, seed). Arguments broadcast together; returns uint8."""
    h = _name_key(name, seed)
    with np.errstate(over="ignore"):
        for coord in (s, b, t, gh, f, k):
            h = _mix(h ^ np.asarray(coord, dtype=np.int64).astype(_U64))
    return ((h >> _U64(40)) & _U64(0xFF)).astype(np.uint8)


def state_hash(name: str, seed: int, p, b, gu, k) -> np.ndarray:
    """Source byte value for (region name, part index, slot id, GLOBAL unit, byte within the
    unit, seed)."""
    return content_hash(f"state/{name}", seed, p, b, 0, gu, 0, k)


def _pool_fill(pool: str, seed: int, nbytes: int) -> np.ndarray:
    """Background of a source pool (bytes no view writes): a hash of the byte's offset only,
    the same on every rank."""
    return content_hash(f"pool/{pool}", seed, 0, 0, 0, 0, 0, np.arange(nbytes))


# ---------------------------------------------------------------------------------------------
# Buffers
# ---------------------------------------------------------------------------------------------


def _grid(*sizes: int) -> list[np.ndarray]:
    """Broadcastable aranges, one per axis."""
    out = []
    for i, size in enumerate(sizes):
        shape = [1] * len(sizes)
        shape[i] = size
        out.append(np.arange(size, dtype=np.int64).reshape(shape))
    return out


# ---------------------------------------------------------------------------------------------
# Allocations: buffers, layer slots, and addresses from the axis order
# ---------------------------------------------------------------------------------------------
#
# A region's layout is an order of the axes L (layer slot), B (kernel block), S (stream), H
# (local head), N (token of a kernel block), D (bytes of one head of one token), outermost
# first, over a dense tensor: its buffer. Regions naming one "allocation" are its L slots in
# spec order (the regions of one pool are one slot); a pair [k, v] puts each stream in its
# own buffer, laid out by the order without S. A pooled slot is pages (L and B outermost),
# the rest of the order inside a page after the kernel blocks. The addresses below are
# Horner's rule over the order (no strides); the views are reshape/transpose of the buffer.


def region_buffers(region: Mapping) -> list[str]:
    """Names of the buffers holding ``region``: [K, V] when separate, else one."""
    a = region.get("allocation")
    if isinstance(a, (list, tuple)):
        return list(a)
    if a is not None:
        return [a]
    return [region["pool"] if region.get("pool") is not None else region["name"]]


def buffer_list(spec: Mapping) -> list[str]:
    """All buffer names of an engine, in order of first use by the regions."""
    out: list[str] = []
    for r in _spec_regions(spec):
        out += [b for b in region_buffers(r) if b not in out]
    return out


def slot_of(spec: Mapping, index: int) -> tuple[int, int]:
    """(slot, slots) of region ``index`` in its allocation."""
    regions = _spec_regions(spec)
    r = regions[index]
    if r["allocation"] is None:
        return 0, 1
    keys: list = []
    for m in regions:
        if m["allocation"] is not None and list(np.atleast_1d(m["allocation"])) == list(
                np.atleast_1d(r["allocation"])):
            k = ("pool", m["pool"]) if m["pool"] is not None else ("region", m["name"])
            keys += [k] if k not in keys else []
    me = ("pool", r["pool"]) if r["pool"] is not None else ("region", r["name"])
    return keys.index(me), len(keys)


def _num_pages(spec: Mapping, index: int) -> int:
    regions = _spec_regions(spec)
    return max(regions[m]["num_blocks"] for m in pool_members(spec, index))


def buffer_nbytes(spec: Mapping, name: str) -> int:
    """Bytes of buffer ``name`` on one rank: slots x pages x (page, or half a block per stream
    buffer)."""
    regions = _spec_regions(spec)
    i = next(i for i, r in enumerate(regions) if name in region_buffers(r))
    per = page_nbytes(spec, i) // len(region_buffers(regions[i]))
    return slot_of(spec, i)[1] * _num_pages(spec, i) * per


def _sizes(spec: Mapping, index: int) -> dict[str, int]:
    r = normalize_region(spec["regions"][index])
    tp = spec["tp_size"]
    slots = slot_of(spec, index)[1]
    if is_state(r):
        return dict(L=slots, B=r["num_blocks"], S=1, H=1, N=1, D=rank_block_nbytes(r, tp))
    n = r["block_size"] // r["kernel_block_size"]
    return dict(L=slots, B=r["num_blocks"] * n, S=_num_streams(r), H=_local_heads(r, tp),
                N=r["kernel_block_size"], D=_features(r) * ELEMENT_SIZE[r["dtype"]])


def _own_order(r: Mapping) -> str:
    order = axis_order(r)
    return order.replace("S", "") if len(region_buffers(r)) == 2 else order


def _horner(order, sizes: Mapping, coords: Mapping):
    off = 0
    for a in order:
        off = off * sizes[a] + coords[a]
    return off


def token_offset(spec: Mapping, index: int, s, b, h, t, byte):
    """Offset in its buffer (see :func:`stream_buffer`) of byte ``byte`` of (stream s, logical
    block b, LOCAL head h, token t) of token region ``index``."""
    r = normalize_region(spec["regions"][index])
    sz = _sizes(spec, index)
    kbs = r["kernel_block_size"]
    n = r["block_size"] // kbs
    order = _own_order(r)
    slot = slot_of(spec, index)[0]
    coords = dict(L=slot, B=b * n + t // kbs, S=s, H=h, N=t % kbs, D=byte)
    if r["pool"] is None:
        return _horner(order, sz, coords)
    outer = [a for a in order if a in "LB"]
    page_no = _horner(outer, dict(L=sz["L"], B=_num_pages(spec, index)), dict(L=slot, B=b))
    inner = ["J", *(a for a in order if a not in "LB")]
    within = _horner(inner, {**sz, "J": n}, {**coords, "J": t // kbs})
    return page_no * page_nbytes(spec, index) + within


def slot_offset(spec: Mapping, index: int, b, byte):
    """Offset of byte ``byte`` of the state slot (block) ``b`` of state region ``index``."""
    r = normalize_region(spec["regions"][index])
    outer = [a for a in axis_order(r) if a in "LB"]
    slot, slots = slot_of(spec, index)
    page = page_nbytes(spec, index)
    return _horner(outer, dict(L=slots, B=_num_pages(spec, index)), dict(L=slot, B=b)) * page + byte


def stream_buffer(spec: Mapping, index: int, s: int) -> str:
    """Name of the buffer holding stream ``s`` of region ``index``."""
    bufs = region_buffers(normalize_region(spec["regions"][index]))
    return bufs[s] if len(bufs) == 2 else bufs[0]


def _select(v: np.ndarray, axes: list, axis: str, index: int) -> tuple[np.ndarray, list]:
    k = axes.index(axis)
    return v[(slice(None),) * k + (index,)], axes[:k] + axes[k + 1:]


def region_views(spec: Mapping, index: int, bufs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Views of one rank's buffers (by name) for region ``index``: per stream a
    ``[block, local head, kernel block j, token in kernel block, feature, byte]`` view (token
    regions), or per part a ``[slot, local unit, byte]`` view (state regions). Reshape and
    transpose only."""
    r = normalize_region(spec["regions"][index])
    tp = spec["tp_size"]
    sz = _sizes(spec, index)
    slot = slot_of(spec, index)[0]
    nb = r["num_blocks"]
    if is_state(r):
        buf = bufs[region_buffers(r)[0]]
        outer = [a for a in axis_order(r) if a in "LB"]
        page = page_nbytes(spec, index)
        v = buf.reshape(*(sz["L"] if a == "L" else _num_pages(spec, index) for a in outer), page)
        v, _ = _select(v, [*outer, "P"], "L", slot)
        m = v[:nb, : sz["D"]]
        out = []
        for start, lu, ub in part_layout(r, tp):
            out.append(_check_view(m[:, start: start + lu * ub].reshape(nb, lu, ub), buf))
        return out
    e = ELEMENT_SIZE[r["dtype"]]
    ff, kbs = _features(r), r["kernel_block_size"]
    n = r["block_size"] // kbs
    order = _own_order(r)
    views = []
    for name in region_buffers(r):
        buf = bufs[name]
        if r["pool"] is None:
            axes = [a for a in order if a != "D"] + ["F", "E"]
            v = buf.reshape(*(sz[a] for a in order if a != "D"), ff, e)
        else:
            outer = [a for a in order if a in "LB"]
            page = page_nbytes(spec, index)
            v = buf.reshape(*(sz["L"] if a == "L" else _num_pages(spec, index) for a in outer),
                            page)
            v, _ = _select(v, [*outer, "P"], "L", slot)
            inner = [a for a in order if a not in "LB" and a != "D"]
            size = n * sz["S"] * sz["H"] * kbs * sz["D"]
            v = v[:nb, :size].reshape(nb, n, *(sz[a] for a in inner), ff, e)
            axes = ["B", "J", *inner, "F", "E"]
            slot = None
        if slot is not None:
            v, axes = _select(v, axes, "L", slot)
            # B counts kernel blocks here: split it into (logical block, j)
            k = axes.index("B")
            v = v.reshape(*v.shape[:k], nb, n, *v.shape[k + 1:])
            axes = [*axes[:k], "B", "J", *axes[k + 1:]]
        slot = slot_of(spec, index)[0]
        if "S" not in axes:
            v, axes = v[None], ["S", *axes]
        v = v.transpose([axes.index(a) for a in ("S", "B", "H", "J", "N", "F", "E")])
        views += [_check_view(v[x], buf) for x in range(v.shape[0])]
    return views


def _virtual_token(t, dcp: int, interleave: int, dcp_rank: int):
    """Offset, in its block id's positions, of token ``t`` of a block on DCP rank
    ``dcp_rank`` (vLLM's interleaved slot mapping, inverted); ``t`` itself without DCP."""
    return (t // interleave) * (dcp * interleave) + dcp_rank * interleave + t % interleave


def _cp(spec: Mapping) -> tuple[int, int]:
    """``(dcp_size, dcp_interleave)`` of an engine (1, 1 without decode context parallelism)."""
    dcp = spec.get("dcp_size", 1)
    return dcp, spec.get("dcp_interleave", 1) if dcp > 1 else 1


def _fill(spec: Mapping, index: int, rank: int, seed: int, bufs, blocks) -> None:
    """Write region ``index``'s content hashes for logical ``blocks`` through its views.

    Under decode context parallelism a token's hash names its position in the block id, so
    DCP ranks holding different positions hold different bytes."""
    region = normalize_region(spec["regions"][index])
    tp = spec["tp_size"]
    tp_rank = rank % tp
    blocks = np.asarray(blocks, dtype=np.int64)
    views = region_views(spec, index, bufs)
    if is_state(region):
        for p, (part, view) in enumerate(zip(region["parts"], views, strict=True)):
            gu = np.array(units_on_rank(part["units"], tp, tp_rank), dtype=np.int64)
            _, u, k = _grid(1, gu.size, part["unit_bytes"])
            view[blocks] = state_hash(region["name"], seed, p, blocks[:, None, None], gu[u], k)
        return
    for s, view in enumerate(views):
        _, hh, n, kbs, ff, e = view.shape
        _, h, j, tk, f, k = _grid(1, hh, n, kbs, ff, e)
        if is_split(region):
            gh = np.array(heads_on_rank(region["num_kv_heads"], tp, tp_rank), dtype=np.int64)[h]
        else:
            gh = np.zeros_like(h)
        b = blocks.reshape(-1, 1, 1, 1, 1, 1)
        dcp, il = _cp(spec)
        t = _virtual_token(j * kbs + tk, dcp, il, dcp_rank_of(spec, rank))
        view[blocks] = content_hash(region["name"], seed, s, b, t, gh, f, k)


def _group_list(blocks, group: int) -> list[int]:
    if blocks is None:
        return []
    if isinstance(blocks, Mapping):
        return list(blocks.get(group, blocks.get(str(group), [])))
    if group < len(blocks):
        return list(blocks[group])
    return []


def _rank_buffer_names(spec: Mapping, rank: int) -> list[str]:
    regions = _spec_regions(spec)
    out: list[str] = []
    for i in rank_regions(spec, rank):
        out += [b for b in region_buffers(regions[i]) if b not in out]
    return out


def _keyed(spec: Mapping, rank: int, bufs: Mapping[str, np.ndarray]) -> dict:
    """``(rank, region)`` keys for regions living in one buffer, ``(rank, name)`` for the
    buffers no such region names (separate K and V buffers)."""
    regions = _spec_regions(spec)
    out: dict = {}
    for i in rank_regions(spec, rank):
        names = region_buffers(regions[i])
        if len(names) == 1:
            out[(rank, i)] = bufs[names[0]]
    named = {id(b) for b in out.values()}
    out.update({(rank, name): b for name, b in bufs.items() if id(b) not in named})
    return out


def source_buffers(
    spec: Mapping,
    seed: int = 0,
    request_blocks: Sequence[Sequence[int]] | Mapping | None = None,
) -> dict[tuple, np.ndarray]:
    """Buffers of every flat rank of an engine, filled with content hashes.

    Keys: ``(flat rank, region index)`` for a region living in one buffer (the regions of one
    pool or allocation map to the same array object), and ``(flat rank, buffer name)`` for a
    K or V buffer of regions with separate K/V buffers.

    Each byte of a token region is a hash of (region name, stream, block id, token-in-block,
    global head, feature, byte-within-element, seed); each byte of a state region a hash of
    (region name, part, slot, global unit, byte-within-unit, seed). So replicas of a head or
    unit on different ranks are byte-identical and any misplaced byte is almost surely
    detected.

    A page of a shared pool holds ONE view's content: with ``request_blocks`` (this side's
    per-group block lists), page ``b`` is filled by the pool region whose group lists ``b``;
    every other page by the first pool region (spec order) that has the page. Bytes of a page
    beyond that view's block (padding) hold a hash of their offset. Pass the request's blocks
    when a replicated view (MLA) may read pages that another view (state) would fill with
    rank-dependent bytes: :func:`expected_destination` refuses such ambiguous sources.
    """
    regions = check_spec(spec)
    out: dict = {}
    for rank in range(world_size(spec)):
        held = rank_regions(spec, rank)
        bufs = {}
        for name in _rank_buffer_names(spec, rank):
            pooled = any(regions[i]["pool"] is not None and name in region_buffers(regions[i])
                         for i in held)
            n = buffer_nbytes(spec, name)
            bufs[name] = _pool_fill(name, seed, n) if pooled else np.zeros(n, dtype=np.uint8)
        done: set[str] = set()
        for i in held:
            r = regions[i]
            if r["pool"] is None:
                _fill(spec, i, rank, seed, bufs, np.arange(r["num_blocks"]))
            elif r["pool"] not in done:
                done.add(r["pool"])
                _fill_pool(spec, regions, i, rank, seed, bufs, request_blocks)
        out.update(_keyed(spec, rank, bufs))
    return out


def _fill_pool(spec, regions, index, rank, seed, bufs, request_blocks) -> None:
    members = pool_members(spec, index)
    owner = np.full(_num_pages(spec, index), -1, dtype=np.int64)
    for m in members:
        for b in _group_list(request_blocks, regions[m]["group"]):
            if not 0 <= b < regions[m]["num_blocks"]:
                raise ValueError(f"block {b} out of range for region {regions[m]['name']!r}")
            if owner[b] not in (-1, m):
                raise ValueError(f"pool {regions[index]['pool']!r}: page {b} is listed by two "
                                 "groups")
            owner[b] = m
    for b in np.flatnonzero(owner == -1):
        owner[b] = next(m for m in members if regions[m]["num_blocks"] > b)
    for m in members:
        _fill(spec, m, rank, seed, bufs, np.flatnonzero(owner == m))


def destination_buffers(spec: Mapping, seed: int = 1) -> dict[tuple, np.ndarray]:
    """Buffers of every flat rank, keyed as in :func:`source_buffers`, filled with a
    pseudo-random sentinel pattern."""
    check_spec(spec)
    regions = _spec_regions(spec)
    out: dict = {}
    for rank in range(world_size(spec)):
        bufs = {}
        for name in _rank_buffer_names(spec, rank):
            i = next(i for i in rank_regions(spec, rank) if name in region_buffers(regions[i]))
            r = regions[i]
            tag = (f"buf/{name}" if r["allocation"] is not None else
                   r["name"] if r["pool"] is None else f"pool/{r['pool']}")
            rng = np.random.default_rng(int(_name_key(f"dst/{rank}/{i}/{tag}", seed)))
            bufs[name] = rng.integers(0, 256, size=buffer_nbytes(spec, name), dtype=np.uint8)
        out.update(_keyed(spec, rank, bufs))
    return out


def clone_buffers(
    buffers: Mapping[tuple[int, int], np.ndarray], rank: int | None = None
) -> dict[tuple[int, int], np.ndarray]:
    """Copies of ``buffers`` (only flat ``rank``'s when given) in which keys that shared one
    array (a pool's regions) still share one copy."""
    copies: dict[int, np.ndarray] = {}
    out = {}
    for key, arr in buffers.items():
        if rank is None or key[0] == rank:
            if id(arr) not in copies:
                copies[id(arr)] = arr.copy()
            out[key] = copies[id(arr)]
    return out


# ---------------------------------------------------------------------------------------------
# Request semantics
# ---------------------------------------------------------------------------------------------


def copied_positions(
    n_src_blocks: int, bs_src: int, n_dst_blocks: int, bs_dst: int, window: int | None,
    tokens: tuple[int, int] | None = None,
) -> range:
    """Token positions of one token region copied for a request (see module docstring).

    ``bs_*`` are the positions one block id covers. Without ``tokens``: what both lists cover.
    With ``tokens=(start, end)``: exactly ``[start, end)``. A window keeps the last
    ``(window // bs_dst + 1) * bs_dst`` positions before the end.
    """
    if tokens is None:
        start, end = 0, min(n_src_blocks * bs_src, n_dst_blocks * bs_dst)
    else:
        start, end = tokens
    if window is not None:
        start = max(start, end - (window // bs_dst + 1) * bs_dst)
    return range(start, max(start, end))


def _holders(count: int, tp_size: int) -> dict[int, list[tuple[int, int]]]:
    """For each global head / unit: every (TP rank, local index) holding it, in rank order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for rank in range(tp_size):
        for local, g in enumerate(heads_on_rank(count, tp_size, rank)):
            out.setdefault(g, []).append((rank, local))
    assert sorted(out) == list(range(count)), "oracle bug: a head no rank holds"
    return out


def _candidates(count: int, src_tp: int, wanted: list[int], dcp: int = 1,
                dcp_rank: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """For each wanted global index: all source (TP rank, local index) holders, as two
    ``[len(wanted), m]`` arrays (every index has the same number m of holders). With DCP,
    only the holders of DCP rank ``dcp_rank`` (``tp rank % dcp``): the tokens are theirs."""
    holders = _holders(count, src_tp)
    rows = [[x for x in holders[g] if x[0] % dcp == dcp_rank] for g in wanted]
    assert len({len(x) for x in rows}) == 1
    arr = np.array(rows, dtype=np.int64)
    return arr[..., 0], arr[..., 1]


def _part_shapes(region: Mapping) -> list[tuple]:
    return [(p["name"], p["units"], p["unit_bytes"]) for p in region["parts"]]


def _check_blocks(ids: list[int], num_blocks: int, name: str) -> None:
    if ids and not (0 <= min(ids) and max(ids) < num_blocks):
        raise ValueError(f"region {name!r}: block id out of range 0..{num_blocks - 1}")


def _pieces(sreg, dreg, src_spec, dst_spec, i, j, slist, dlist, d_rank, s_base, d_base,
            tokens=None, dst_from="zero"):
    """Yield ``(d_addr, candidates)`` for one region pair: ``d_addr`` a grid of destination
    addresses (in the rank's concatenated buffers, ``d_base[name]`` + offset) whose first axis
    is the destination's local head / unit, and ``candidates`` a list (one per replica choice
    c) of lists of ``(src tp rank, rows, s_addr)``: source addresses (``s_base``) for the
    ``rows`` of ``d_addr``'s first axis read from that rank."""
    src_tp, dst_tp = src_spec["tp_size"], dst_spec["tp_size"]
    d_tp_rank = d_rank % dst_tp
    # Source ranks are offsets from the stage's first rank: TP rank r of PCP replica 0, or
    # under sharded PCP TP rank r of PCP rank e (DCP shard e); every replica holds equal bytes.
    s_sharded = pcp_sharded(src_spec)

    def split_candidates(count, wanted, s_off_fn, dcp=1, dcp_rank=0):
        shift = dcp_rank * src_tp if s_sharded else 0
        if s_sharded:
            dcp, dcp_rank = 1, 0
        ranks, local = _candidates(count, src_tp, wanted, dcp, dcp_rank)
        out = []
        for c in range(ranks.shape[1]):
            lst = []
            for r in np.unique(ranks[:, c]).tolist():
                rows = np.flatnonzero(ranks[:, c] == r)
                lst.append((shift + r, rows, s_off_fn(local[rows, c])))
            out.append(lst)
        return out

    if is_state(dreg):
        if len(slist) != len(dlist):
            raise ValueError(f"state region {dreg['name']!r}: block lists differ in length")
        sl = np.array(slist, dtype=np.int64).reshape(1, -1, 1)
        dl = np.array(dlist, dtype=np.int64).reshape(1, -1, 1)
        s_parts, d_parts = part_layout(sreg, src_tp), part_layout(dreg, dst_tp)
        sb, db = s_base[stream_buffer(src_spec, i, 0)], d_base[stream_buffer(dst_spec, j, 0)]
        for p, part in enumerate(dreg["parts"]):
            wanted = units_on_rank(part["units"], dst_tp, d_tp_rank)
            ub = part["unit_bytes"]
            k = np.arange(ub, dtype=np.int64).reshape(1, 1, -1)
            u = np.arange(len(wanted), dtype=np.int64).reshape(-1, 1, 1)
            d_off = db + slot_offset(dst_spec, j, dl, d_parts[p][0] + u * ub + k)

            def s_fn(lu, p=p, k=k, ub=ub):
                lu = lu.reshape(-1, 1, 1)
                return sb + slot_offset(src_spec, i, sl, s_parts[p][0] + lu * ub + k)

            yield d_off, split_candidates(part["units"], wanted, s_fn)
        return

    # vLLM's decode context parallelism (block_table.py's slot mapping): a block id covers
    # block_size * dcp positions; offset o in it lives on DCP rank (o // I) % dcp (rank of the
    # TP group mod dcp), at token (o // (dcp * I)) * I + o % I of that rank's block.
    dcp_s, il_s = _cp(src_spec)
    dcp_d, il_d = _cp(dst_spec)
    bs_s, bs_d = sreg["block_size"] * dcp_s, dreg["block_size"] * dcp_d  # positions per id
    span = copied_positions(len(slist), bs_s, len(dlist), bs_d, dreg["window"], tokens)
    pos = np.arange(span.start, span.stop, dtype=np.int64)
    if not pos.size:
        return
    # The destination list's first element: block 0, or (vLLM) the block holding ``start``.
    d_first = tokens[0] // bs_d if (tokens is not None and dst_from == "start") else 0
    if pos[-1] // bs_s >= len(slist) or pos[-1] // bs_d - d_first >= len(dlist):
        raise ValueError(f"region {dreg['name']!r}: positions up to {span.stop} are not in the "
                         "block lists")
    pos = pos[(pos % bs_d) // il_d % dcp_d == dcp_rank_of(dst_spec, d_rank) % dcp_d]  # its own
    e = ELEMENT_SIZE[dreg["dtype"]]
    for src_dcp_rank in range(dcp_s):
        mine = pos[(pos % bs_s) // il_s % dcp_s == src_dcp_rank]
        if not mine.size:
            continue
        # Broadcast grids: head x position x stream x feature x byte.
        p = mine.reshape(1, -1, 1, 1, 1)
        s = np.arange(_num_streams(dreg), dtype=np.int64).reshape(1, 1, -1, 1, 1)
        byte = (np.arange(_features(dreg), dtype=np.int64).reshape(1, 1, 1, -1, 1) * e
                + np.arange(e, dtype=np.int64).reshape(1, 1, 1, 1, -1))
        o_d, o_s = p % bs_d, p % bs_s
        d_b = np.array(dlist, dtype=np.int64)[p // bs_d - d_first]
        d_t = o_d // (dcp_d * il_d) * il_d + o_d % il_d
        s_b = np.array(slist, dtype=np.int64)[p // bs_s]
        s_t = o_s // (dcp_s * il_s) * il_s + o_s % il_s
        # each stream's buffer: its start in the rank's concatenated buffers
        sb = np.array([s_base[stream_buffer(src_spec, i, x)] for x in range(s.size)])[s]
        db = np.array([d_base[stream_buffer(dst_spec, j, x)] for x in range(s.size)])[s]
        s_s = 0 * s if len(region_buffers(sreg)) == 2 else s  # a stream buffer has no S axis
        d_s = 0 * s if len(region_buffers(dreg)) == 2 else s

        def s_fn(hs, sb=sb, s_s=s_s, s_b=s_b, s_t=s_t, byte=byte):
            return sb + token_offset(src_spec, i, s_s, s_b, hs.reshape(-1, 1, 1, 1, 1), s_t,
                                     byte)

        if is_split(dreg):
            wanted = heads_on_rank(dreg["num_kv_heads"], dst_tp, d_tp_rank)
            h = np.arange(len(wanted), dtype=np.int64).reshape(-1, 1, 1, 1, 1)
            d_off = db + token_offset(dst_spec, j, d_s, d_b, h, d_t, byte)
            yield d_off, split_candidates(dreg["num_kv_heads"], wanted, s_fn, dcp_s,
                                          src_dcp_rank)
        else:
            # Replicated: every source rank of the stage (of that DCP rank) holds it all.
            d_off = db + token_offset(dst_spec, j, s, d_b, 0, d_t, byte)
            zero = np.zeros(1, dtype=np.int64)
            yield d_off, [[(src_dcp_rank * src_tp + r if s_sharded else r, zero, s_fn(zero))]
                          for r in range(src_tp) if s_sharded or r % dcp_s == src_dcp_rank]


def _concat(spec: Mapping, rank: int, buffers: Mapping) -> tuple[np.ndarray, dict[str, int]]:
    """One rank's buffers concatenated (a copy), and each buffer's start in it."""
    regions = _spec_regions(spec)
    names = _rank_buffer_names(spec, rank)
    arrays = []
    for name in names:
        if (rank, name) in buffers:
            arrays.append(buffers[(rank, name)])
            continue
        i = next(i for i in rank_regions(spec, rank) if region_buffers(regions[i]) == [name])
        arrays.append(buffers[(rank, i)] if (rank, i) in buffers else buffers[i])
    starts = np.cumsum([0] + [a.size for a in arrays])
    return np.concatenate(arrays).astype(np.uint8), dict(zip(names, starts.tolist()))


def expected_buffers(
    src_spec: Mapping,
    dst_spec: Mapping,
    src_blocks: Sequence[Sequence[int]] | Mapping,
    dst_blocks: Sequence[Sequence[int]] | Mapping,
    dst_rank: int,
    src_buffers: Mapping,
    dst_before: Mapping,
    tokens: tuple[int, int] | None = None,
    dst_from: str = "zero",
) -> tuple[dict[str, np.ndarray], dict[tuple[int, str], np.ndarray]]:
    """Ground truth for flat destination rank ``dst_rank`` after one request, per buffer.

    Returns ``(expected, must_write)``: ``expected[name]`` is buffer ``name`` of the rank
    (from ``dst_before``, keyed ``(rank, name)``, ``(rank, region)`` or ``region``) with every
    required byte replaced by the source's byte for the same logical element;
    ``must_write[(j, name)]`` marks the bytes of buffer ``name`` that region ``j``'s copies
    must write (and no others). ``tokens`` and ``dst_from`` as :func:`expected_destination`.
    Raises ValueError as :func:`expected_destination`.
    """
    src_regions, dst_regions = check_spec(src_spec), check_spec(dst_spec)
    src_tp = src_spec["tp_size"]
    src_index = {r["name"]: i for i, r in enumerate(src_regions)}
    if sorted(src_index) != sorted(r["name"] for r in dst_regions):
        raise ValueError("region names differ between source and destination")
    src_stages = region_stages(src_spec)
    s_ranks = src_tp * src_spec.get("pcp_size", 1)  # flat ranks of one stage
    exp, d_base = _concat(dst_spec, dst_rank, dst_before)
    written = np.zeros(exp.shape, dtype=bool)
    src_cat: dict[int, tuple[np.ndarray, dict[str, int]]] = {}
    masks: dict[int, np.ndarray] = {}
    for j in rank_regions(dst_spec, dst_rank):
        dreg = dst_regions[j]
        mask = np.zeros(exp.shape, dtype=bool)
        i = src_index[dreg["name"]]
        sreg = src_regions[i]
        for field in ("kind", "dtype", "window", "num_kv_heads", "head_dim", "dim"):
            if sreg.get(field) != dreg.get(field):
                raise ValueError(f"region {dreg['name']}: {field} differs")
        if is_state(dreg) and _part_shapes(sreg) != _part_shapes(dreg):
            raise ValueError(f"region {dreg['name']}: parts differ")
        slist = _group_list(src_blocks, sreg["group"])
        dlist = _group_list(dst_blocks, dreg["group"])
        _check_blocks(slist, sreg["num_blocks"], sreg["name"])
        _check_blocks(dlist, dreg["num_blocks"], dreg["name"])
        base = src_stages[i] * s_ranks  # flat rank of the source stage's first rank
        for r in range(base, base + s_ranks):
            if r not in src_cat:
                src_cat[r] = _concat(src_spec, r, src_buffers)
        s_base = src_cat[base][1]
        for d_off, choices in _pieces(
            sreg, dreg, src_spec, dst_spec, i, j, slist, dlist, dst_rank, s_base, d_base,
            tokens, dst_from,
        ):
            if d_off.size == 0:
                continue
            values = []
            for lst in choices:
                vals = np.empty(d_off.shape, dtype=np.uint8)
                for r, rows, s_off in lst:
                    src, _ = src_cat[base + r]
                    s_off = np.broadcast_to(s_off, (len(rows), *d_off.shape[1:]))
                    assert s_off.min() >= 0 and s_off.max() < src.size, "oracle bug: source"
                    vals[rows] = src[s_off]
                values.append(vals)
            for other in values[1:]:
                if not np.array_equal(other, values[0]):
                    raise ValueError(
                        f"region {dreg['name']!r}: source replicas differ; fill pooled "
                        "sources with source_buffers(..., request_blocks=src_blocks)"
                    )
            d_flat = d_off.reshape(-1)
            assert d_flat.min() >= 0 and d_flat.max() < exp.size, "oracle bug: destination"
            if np.unique(d_flat).size != d_flat.size:
                raise ValueError(f"region {dreg['name']!r}: a destination byte is written twice "
                                 "(duplicate block ids?)")
            if written[d_flat].any():
                raise ValueError(f"region {dreg['name']!r}: writes overlap another region of "
                                 f"pool {dreg['pool']!r} (groups list the same page)")
            exp[d_flat] = values[0].reshape(-1)
            mask[d_flat] = True
            written[d_flat] = True
        masks[j] = mask
    bounds = sorted(d_base.items(), key=lambda x: x[1])
    ends = [b for _, b in bounds[1:]] + [exp.size]
    expected = {name: exp[a:z] for (name, a), z in zip(bounds, ends)}
    must = {(j, name): m[a:z] for j, m in masks.items() for (name, a), z in zip(bounds, ends)
            if name in region_buffers(dst_regions[j])}
    return expected, must


def expected_destination(
    src_spec: Mapping,
    dst_spec: Mapping,
    src_blocks: Sequence[Sequence[int]] | Mapping,
    dst_blocks: Sequence[Sequence[int]] | Mapping,
    dst_rank: int,
    src_buffers: Mapping,
    dst_before: Mapping,
    tokens: tuple[int, int] | None = None,
    dst_from: str = "zero",
) -> tuple[dict, dict]:
    """Ground truth for flat destination rank ``dst_rank`` after transferring one request.

    Returns ``(expected, must_write)``, both keyed by the indices of the destination regions
    that ``dst_rank`` holds (its stage's): ``expected[j]`` is a copy of the rank's buffer in
    ``dst_before`` (keyed ``(dst_rank, j)``, or ``j``) with every required byte replaced by
    the source's byte for the same logical element; ``must_write[j]`` is a bool array of the
    bytes that region ``j``'s copies must write (and no others). For a region sharing a
    buffer (pool, allocation), ``expected[j]`` is the whole buffer after ALL its regions were
    copied (the same array object for each of them) while ``must_write[j]`` marks only region
    ``j``'s bytes. A region with separate K/V buffers is keyed ``(j, 0)`` and ``(j, 1)``.
    ``src_blocks[g]`` / ``dst_blocks[g]`` are the block ids of group ``g``; each side uses
    its own region's group id. Each source region is read from the stage that holds it.
    ``tokens=(start, end)`` copies exactly those positions of token regions (state slots move
    whole); ``dst_from="start"`` makes each destination list start at the block holding
    ``start`` instead of at position 0.

    Raises ValueError for requests or specs outside the contract, and when source replicas of
    a needed byte differ (e.g. a pooled source filled without ``request_blocks``).
    """
    expected, must = expected_buffers(src_spec, dst_spec, src_blocks, dst_blocks, dst_rank,
                                      src_buffers, dst_before, tokens, dst_from)
    regions = _spec_regions(dst_spec)
    out_e, out_m = {}, {}
    for j in rank_regions(dst_spec, dst_rank):
        names = region_buffers(regions[j])
        for s, name in enumerate(names):
            key = j if len(names) == 1 else (j, s)
            out_e[key], out_m[key] = expected[name], must[(j, name)]
    return out_e, out_m
