"""Reference oracle for kvplan tests.

This module is an *independent* re-derivation of sections 2-4 of ``docs/domain.md`` (TP
placement of heads, request semantics, and the physical byte layouts), written without looking
at the planner. It works on plain JSON-like spec dicts and numpy ``uint8`` buffers and answers
one question: after a correct transfer, what must every byte of a destination rank hold, and
which bytes must have been written?

It is deliberately simple rather than fast or clever: every copied element is located by its
logical coordinates (token position, stream, global head, feature, byte) on both sides, and the
byte offsets come straight from the table in domain.md section 4.

Spec dict (one engine)::

    {"tp_size": 4,
     "regions": [
       {"name": "layers.0.attn", "kind": "attention", "group": 0, "num_blocks": 1024,
        "block_size": 16, "dtype": "bfloat16", "num_kv_heads": 8, "head_dim": 128,
        "layout": "HND", "kv": "split", "window": None},
       {"name": "draft.0.mla", "kind": "mla", "num_blocks": 1024, "block_size": 16,
        "dtype": "bfloat16", "dim": 576}]}

Defaults: ``group`` 0, ``window`` None, ``layout`` "HND", ``kv`` "split".

Buffers are dicts keyed ``(rank, region_index)`` holding one flat ``uint8`` array per region
per rank, of ``rank_region_nbytes`` bytes.
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

_DEFAULTS = {"group": 0, "window": None, "layout": "HND", "kv": "split"}

# ---------------------------------------------------------------------------------------------
# Region helpers
# ---------------------------------------------------------------------------------------------


def normalize_region(region: Mapping) -> dict:
    """Return a copy of ``region`` with the defaults applied and basic sanity checks done."""
    r = dict(_DEFAULTS)
    r.update(region)
    kind = r["kind"]
    if kind not in SPLIT_KINDS + REPLICATE_KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    if r["dtype"] not in ELEMENT_SIZE:
        raise ValueError(f"unknown dtype {r['dtype']!r}")
    if kind in SPLIT_KINDS:
        if r["layout"] not in ("NHD", "HND") or r["kv"] not in ("split", "joint"):
            raise ValueError(f"bad layout/kv {r['layout']!r}/{r['kv']!r}")
    return r


def is_split(region: Mapping) -> bool:
    return region["kind"] in SPLIT_KINDS


def heads_on_rank(num_kv_heads: int, tp_size: int, rank: int) -> list[int]:
    """Global KV-head indices held by ``rank``, in local order (domain.md section 2)."""
    k, tp = num_kv_heads, tp_size
    if not (k % tp == 0 or tp % k == 0):
        raise ValueError(f"num_kv_heads {k} and tp_size {tp} do not divide")
    if k >= tp:
        per = k // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * k // tp]


def _local_heads(region: Mapping, tp_size: int) -> int:
    """H: number of heads held by one rank (1 for replicated kinds: one pseudo-head)."""
    if is_split(region):
        return max(1, region["num_kv_heads"] // tp_size)
    return 1


def _num_streams(region: Mapping) -> int:
    return 2 if is_split(region) else 1


def _features(region: Mapping) -> int:
    return region["head_dim"] if is_split(region) else region["dim"]


def rank_region_nbytes(region: Mapping, tp_size: int) -> int:
    """Bytes of ``region`` held by one rank of an engine with ``tp_size`` ranks."""
    r = normalize_region(region)
    e = ELEMENT_SIZE[r["dtype"]]
    nb, bs = r["num_blocks"], r["block_size"]
    if is_split(r):
        h = max(1, r["num_kv_heads"] // tp_size)
        return 2 * nb * bs * h * r["head_dim"] * e
    return nb * bs * r["dim"] * e


def element_offset(region: Mapping, tp_size: int, s, b, h, t, f):
    """Byte offset of element (stream s, block b, LOCAL head h, token t, feature f).

    Literal transcription of the table in domain.md section 4. Arguments may be numpy arrays
    (broadcast together); ``h`` and ``s`` are ignored for MLA / indexer regions.
    """
    r = normalize_region(region)
    e = ELEMENT_SIZE[r["dtype"]]
    nb, bs = r["num_blocks"], r["block_size"]
    if not is_split(r):
        ff = r["dim"]
        return ((b * bs + t) * ff + f) * e
    hh = _local_heads(r, tp_size)
    d = r["head_dim"]
    if r["kv"] == "split" and r["layout"] == "NHD":
        return ((((s * nb + b) * bs + t) * hh + h) * d + f) * e
    if r["kv"] == "split" and r["layout"] == "HND":
        return ((((s * nb + b) * hh + h) * bs + t) * d + f) * e
    if r["kv"] == "joint" and r["layout"] == "NHD":
        return ((((b * 2 + s) * bs + t) * hh + h) * d + f) * e
    if r["kv"] == "joint" and r["layout"] == "HND":
        return ((((b * 2 + s) * hh + h) * bs + t) * d + f) * e
    raise AssertionError("unreachable")


def logical_view(region: Mapping, tp_size: int, buf: np.ndarray) -> np.ndarray:
    """View of one rank's flat buffer as ``[stream, block, local head, token, feature, byte]``.

    Built from the tensor shapes of domain.md section 4 with reshape/transpose only (no
    offset arithmetic), so it is an independent check of ``element_offset``. MLA / indexer
    regions get a stream axis and a head axis of length 1. The result is a view of ``buf``.
    """
    r = normalize_region(region)
    e = ELEMENT_SIZE[r["dtype"]]
    nb, bs, ff = r["num_blocks"], r["block_size"], _features(r)
    if not is_split(r):
        return buf.reshape(nb, bs, ff, e)[None, :, None]
    hh = _local_heads(r, tp_size)
    kv, layout = r["kv"], r["layout"]
    if (kv, layout) == ("split", "NHD"):
        return buf.reshape(2, nb, bs, hh, ff, e).transpose(0, 1, 3, 2, 4, 5)
    if (kv, layout) == ("split", "HND"):
        return buf.reshape(2, nb, hh, bs, ff, e)
    if (kv, layout) == ("joint", "NHD"):
        return buf.reshape(nb, 2, bs, hh, ff, e).transpose(1, 0, 3, 2, 4, 5)
    return buf.reshape(nb, 2, hh, bs, ff, e).transpose(1, 0, 2, 3, 4, 5)


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


# ---------------------------------------------------------------------------------------------
# Buffers
# ---------------------------------------------------------------------------------------------

# Axis order of each layout's tensor shape (domain.md section 4), plus the byte axis "k".
_AXES = {
    ("split", "NHD"): ("s", "b", "t", "h", "f"),
    ("split", "HND"): ("s", "b", "h", "t", "f"),
    ("joint", "NHD"): ("b", "s", "t", "h", "f"),
    ("joint", "HND"): ("b", "s", "h", "t", "f"),
}


def _region_buffer(region: Mapping, tp_size: int, rank: int, seed: int) -> np.ndarray:
    r = normalize_region(region)
    e = ELEMENT_SIZE[r["dtype"]]
    sizes = {
        "s": _num_streams(r),
        "b": r["num_blocks"],
        "t": r["block_size"],
        "h": _local_heads(r, tp_size),
        "f": _features(r),
        "k": e,
    }
    if is_split(r):
        axes = (*_AXES[(r["kv"], r["layout"])], "k")
        global_heads = np.array(heads_on_rank(r["num_kv_heads"], tp_size, rank), dtype=np.int64)
    else:
        axes = ("b", "t", "f", "k")
        global_heads = np.zeros(1, dtype=np.int64)
    shape = tuple(sizes[a] for a in axes)
    grids = {}
    for i, a in enumerate(axes):
        view = [1] * len(axes)
        view[i] = sizes[a]
        grids[a] = np.arange(sizes[a], dtype=np.int64).reshape(view)
    zero = np.zeros([1] * len(axes), dtype=np.int64)
    s = grids.get("s", zero)
    gh = global_heads[grids["h"]] if "h" in grids else zero
    vals = content_hash(r["name"], seed, s, grids["b"], grids["t"], gh, grids["f"], grids["k"])
    out = np.broadcast_to(vals, shape).reshape(-1).copy()
    assert out.size == rank_region_nbytes(r, tp_size)
    return out


def source_buffers(spec: Mapping, seed: int = 0) -> dict[tuple[int, int], np.ndarray]:
    """Buffers of every (rank, region index) of an engine, filled with content hashes.

    Each byte is a hash of (region name, stream, block id, token-in-block, global head,
    feature, byte-within-element, seed), so replicas of a head on different ranks are
    byte-identical and any misplaced byte is almost surely detected.
    """
    tp = spec["tp_size"]
    return {
        (rank, i): _region_buffer(region, tp, rank, seed)
        for rank in range(tp)
        for i, region in enumerate(spec["regions"])
    }


def destination_buffers(spec: Mapping, seed: int = 1) -> dict[tuple[int, int], np.ndarray]:
    """Buffers of every (rank, region index), filled with a pseudo-random sentinel pattern."""
    tp = spec["tp_size"]
    out = {}
    for rank in range(tp):
        for i, region in enumerate(spec["regions"]):
            n = rank_region_nbytes(region, tp)
            key = int(_name_key(f"dst/{rank}/{i}/{region['name']}", seed))
            rng = np.random.default_rng(key)
            out[(rank, i)] = rng.integers(0, 256, size=n, dtype=np.uint8)
    return out


# ---------------------------------------------------------------------------------------------
# Request semantics
# ---------------------------------------------------------------------------------------------


def copied_positions(
    n_src_blocks: int, bs_src: int, n_dst_blocks: int, bs_dst: int, window: int | None
) -> range:
    """Token positions of one region copied for a request (see module-level semantics)."""
    n = min(n_src_blocks * bs_src, n_dst_blocks * bs_dst)
    start = 0
    if window is not None:
        start = max(0, n - (window // bs_dst + 1) * bs_dst)
    return range(start, n)


def _group_list(blocks, group: int) -> list[int]:
    if isinstance(blocks, Mapping):
        return list(blocks.get(group, blocks.get(str(group), [])))
    if group < len(blocks):
        return list(blocks[group])
    return []


def _holder(num_kv_heads: int, tp_size: int, global_head: int) -> tuple[int, int]:
    """(source rank, local head index) of the first source rank holding ``global_head``."""
    for rank in range(tp_size):
        heads = heads_on_rank(num_kv_heads, tp_size, rank)
        if global_head in heads:
            return rank, heads.index(global_head)
    raise AssertionError(f"no rank holds head {global_head}")


def expected_destination(
    src_spec: Mapping,
    dst_spec: Mapping,
    src_blocks: Sequence[Sequence[int]] | Mapping,
    dst_blocks: Sequence[Sequence[int]] | Mapping,
    dst_rank: int,
    src_buffers: Mapping[tuple[int, int], np.ndarray],
    dst_before: Mapping,
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Ground truth for destination rank ``dst_rank`` after transferring one request.

    Returns ``(expected, must_write)``, both keyed by destination region index: ``expected``
    is a copy of the rank's buffer in ``dst_before`` (keyed ``(dst_rank, j)``, or ``j``) with
    every required byte replaced by the source's byte for the same (position, stream, global
    head, feature, byte); ``must_write`` is a bool array of the bytes that a plan must write
    (and no others). ``src_blocks[g]`` / ``dst_blocks[g]`` are the block ids of group ``g``;
    each side uses its own region's group id.
    """
    src_tp, dst_tp = src_spec["tp_size"], dst_spec["tp_size"]
    src_regions = [normalize_region(r) for r in src_spec["regions"]]
    dst_regions = [normalize_region(r) for r in dst_spec["regions"]]
    src_index = {r["name"]: i for i, r in enumerate(src_regions)}
    if len(src_index) != len(src_regions) or sorted(src_index) != sorted(
        r["name"] for r in dst_regions
    ):
        raise ValueError("region names differ between source and destination")

    expected: dict[int, np.ndarray] = {}
    must_write: dict[int, np.ndarray] = {}
    for j, dreg in enumerate(dst_regions):
        before = dst_before[(dst_rank, j)] if (dst_rank, j) in dst_before else dst_before[j]
        exp = np.array(before, dtype=np.uint8, copy=True)
        mask = np.zeros(exp.shape, dtype=bool)
        assert exp.size == rank_region_nbytes(dreg, dst_tp)
        i = src_index[dreg["name"]]
        sreg = src_regions[i]
        for key in ("kind", "dtype", "window", "num_kv_heads", "head_dim", "dim"):
            if sreg.get(key) != dreg.get(key):
                raise ValueError(f"region {dreg['name']}: {key} differs")

        slist = _group_list(src_blocks, sreg["group"])
        dlist = _group_list(dst_blocks, dreg["group"])
        bs_s, bs_d = sreg["block_size"], dreg["block_size"]
        span = copied_positions(len(slist), bs_s, len(dlist), bs_d, dreg["window"])
        pos = np.arange(span.start, span.stop, dtype=np.int64)
        if pos.size:
            used_d = np.array(dlist, dtype=np.int64)[np.unique(pos // bs_d)]
            assert len(set(used_d.tolist())) == used_d.size, "duplicate destination block ids"
            assert 0 <= min(dlist) and max(dlist) < dreg["num_blocks"]
            assert 0 <= min(slist) and max(slist) < sreg["num_blocks"]
        e = ELEMENT_SIZE[dreg["dtype"]]
        n_streams = _num_streams(dreg)
        nfeat = _features(dreg)

        # Broadcast grids: position x stream x feature x byte.
        p = pos.reshape(-1, 1, 1, 1)
        s = np.arange(n_streams, dtype=np.int64).reshape(1, -1, 1, 1)
        f = np.arange(nfeat, dtype=np.int64).reshape(1, 1, -1, 1)
        k = np.arange(e, dtype=np.int64).reshape(1, 1, 1, -1)
        d_b = np.array(dlist, dtype=np.int64)[p // bs_d] if pos.size else p
        d_t = p % bs_d
        s_b = np.array(slist, dtype=np.int64)[p // bs_s] if pos.size else p
        s_t = p % bs_s

        if is_split(dreg):
            dst_heads = heads_on_rank(dreg["num_kv_heads"], dst_tp, dst_rank)
            pairs = []
            for hd, gh in enumerate(dst_heads):
                src_rank, hs = _holder(sreg["num_kv_heads"], src_tp, gh)
                pairs.append((hd, src_rank, hs))
        else:
            # Replicated: every source rank holds it all; read from any (here the same rank
            # the anchors would pick, clamped into range).
            pairs = [(0, dst_rank * src_tp // dst_tp, 0)]

        for hd, src_rank, hs in pairs:
            d_off = element_offset(dreg, dst_tp, s, d_b, hd, d_t, f) + k
            s_off = element_offset(sreg, src_tp, s, s_b, hs, s_t, f) + k
            d_off, s_off = np.broadcast_arrays(d_off, s_off)
            d_off, s_off = d_off.reshape(-1), s_off.reshape(-1)
            assert not mask[d_off].any(), "oracle bug: a destination byte written twice"
            assert np.unique(d_off).size == d_off.size, "oracle bug: overlapping writes"
            exp[d_off] = src_buffers[(src_rank, i)][s_off]
            mask[d_off] = True
        expected[j] = exp
        must_write[j] = mask
    return expected, must_write
