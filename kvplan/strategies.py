"""Hypothesis strategies for engine specs and requests, at the level of JSON-able dicts.

Connector authors can reuse these to test their own code against kvplan. The generators work on
plain data (the JSON engine spec form); :func:`engine_pairs` wraps :func:`spec_pairs` into
:class:`~kvplan.EngineSpec` values, and :func:`requests` takes either form. Importing this module
needs hypothesis (the ``test`` extra); the rest of kvplan does not.

An engine spec is ``{"tp_size": int, "regions": [region, ...]}``; a region is one of::

    {"name", "kind": "attention", "group", "num_blocks", "block_size", "dtype",
     "num_kv_heads", "head_dim", "layout": "HND"|"NHD", "kv": "split"|"joint", "window"}
    {"name", "kind": "mla"|"indexer", "group", "num_blocks", "block_size", "dtype", "dim"}

Keys whose value equals the default (``group`` 0, ``window`` None, ``layout`` "HND",
``kv`` "split") are sometimes left out, to exercise default handling.

A request is ``(src_blocks, dst_blocks)``: two lists indexed by group id, each a list of
unique block ids of that group on that side.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
from hypothesis import strategies as st

from kvplan.spec import DTYPE_SIZES, EngineSpec

__all__ = [
    "DTYPES",
    "ELEMENT_SIZE",
    "block_lists",
    "block_size_pairs",
    "engine_pairs",
    "head_counts",
    "region_pairs",
    "requests",
    "spec_pairs",
    "tp_pairs",
]

#: The dtypes the generators use, with their element sizes.
ELEMENT_SIZE: dict[str, int] = {
    k: DTYPE_SIZES[k] for k in ("float32", "bfloat16", "float16", "float8_e4m3fn", "uint8")
}
DTYPES: tuple[str, ...] = tuple(ELEMENT_SIZE)

_TP_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_HEAD_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
_BLOCK_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32)
_DEFAULTS = {"group": 0, "window": None, "layout": "HND", "kv": "split"}
_NAME = {"attention": "layers.{}.attn", "mla": "draft.{}.mla", "indexer": "layers.{}.indexer"}


def _divides_either(a: int, b: int) -> bool:
    return a % b == 0 or b % a == 0


def tp_pairs(max_tp: int = 16) -> st.SearchStrategy[tuple[int, int]]:
    """(src_tp, dst_tp) with each <= ``max_tp`` and one dividing the other.

    Draws from powers of two and 3/6/12-like sizes; equal sizes are included.
    """
    sizes = [t for t in _TP_SIZES if t <= max_tp]
    pairs = [(a, b) for a in sizes for b in sizes if _divides_either(a, b)]
    return st.sampled_from(pairs)


def head_counts(src_tp: int, dst_tp: int) -> st.SearchStrategy[int]:
    """num_kv_heads K with ``K % tp == 0 or tp % K == 0`` for both TP sizes."""
    ks = [k for k in _HEAD_COUNTS if _divides_either(k, src_tp) and _divides_either(k, dst_tp)]
    return st.sampled_from(ks)


def block_size_pairs(sizes: Sequence[int] = _BLOCK_SIZES) -> st.SearchStrategy[tuple[int, int]]:
    """(src_block_size, dst_block_size) with one dividing the other; equal sizes favoured."""
    pairs = [(a, b) for a in sizes for b in sizes if _divides_either(a, b)]
    return st.one_of(st.sampled_from(sizes).map(lambda a: (a, a)), st.sampled_from(pairs))


def _block_bytes_all_ranks(region: dict, tp: int) -> int:
    """Bytes of ONE block of ``region`` summed over all ``tp`` ranks."""
    e = ELEMENT_SIZE[region["dtype"]]
    bs = region["block_size"]
    if region["kind"] == "attention":
        return 2 * bs * max(region["num_kv_heads"], tp) * region["head_dim"] * e
    return tp * bs * region["dim"] * e


@st.composite
def _maybe_omit_defaults(draw, region: dict, omit: bool) -> dict:
    if not omit:
        return region
    out = {}
    for key, value in region.items():
        if key in _DEFAULTS and value == _DEFAULTS[key] and draw(st.booleans()):
            continue
        out[key] = value
    return out


@st.composite
def region_pairs(
    draw,
    index: int,
    src_tp: int,
    dst_tp: int,
    kinds: Sequence[str] = ("attention", "mla", "indexer"),
    group: int = 0,
    max_blocks: int = 64,
    max_region_bytes: int = 1 << 18,
    windows: bool = True,
    omit_defaults: bool = True,
) -> tuple[dict, dict]:
    """One region as seen by both engines: (src_region, dst_region).

    Shared across the pair: name, kind, group, dtype, num_kv_heads/head_dim or dim, window.
    Per side: layout, kv, block_size (one divides the other), num_blocks (sized so that the
    region's bytes summed over all ranks of that side stay under ``max_region_bytes``, but at
    least 1 and at most ``max_blocks``).
    """
    kind = draw(st.sampled_from(tuple(kinds)))
    common: dict = {
        "name": _NAME[kind].format(index),
        "kind": kind,
        "group": group,
        "dtype": draw(st.sampled_from(DTYPES)),
    }
    if kind == "attention":
        common["num_kv_heads"] = draw(head_counts(src_tp, dst_tp))
        common["head_dim"] = draw(st.integers(2, 16))
        common["window"] = draw(st.none() | st.integers(1, 64)) if windows else None
    else:
        common["dim"] = draw(st.integers(3, 40))
    bs_pair = draw(block_size_pairs())
    sides = []
    for tp, bs in zip((src_tp, dst_tp), bs_pair, strict=True):
        region = dict(common)
        region["block_size"] = bs
        if kind == "attention":
            region["layout"] = draw(st.sampled_from(("HND", "NHD")))
            region["kv"] = draw(st.sampled_from(("split", "joint")))
        per_block = _block_bytes_all_ranks(region, tp)
        cap = max(1, min(max_blocks, max_region_bytes // per_block))
        region["num_blocks"] = draw(st.integers(1, cap))
        sides.append(draw(_maybe_omit_defaults(region, omit_defaults)))
    return sides[0], sides[1]


@st.composite
def spec_pairs(
    draw,
    max_tp: int = 16,
    max_regions: int = 4,
    kinds: Sequence[str] = ("attention", "mla", "indexer"),
    max_blocks: int = 64,
    max_groups: int = 3,
    max_bytes: int = 1 << 20,
    windows: bool = True,
    omit_defaults: bool = True,
) -> tuple[dict, dict]:
    """Two compatible engine specs (src_dict, dst_dict), e.g. prefill and decode.

    - TP sizes come from :func:`tp_pairs` (one divides the other, up to ``max_tp``).
    - 1..``max_regions`` regions of the given ``kinds``, paired by name; each attention
      region's num_kv_heads divides or is a multiple of both TP sizes.
    - layout / kv / block_size / num_blocks chosen independently per side (block sizes divide
      one another); an optional sliding window on attention regions (``windows=True``).
    - regions spread over up to ``max_groups`` groups, numbered 0..G-1 with none empty; the
      same group on both sides.
    - the destination's region order is a shuffle of the source's.
    - total bytes of each engine (all ranks, all regions) stay under about ``max_bytes``
      (one block per region is always allowed, so tiny budgets may be exceeded).
    """
    src_tp, dst_tp = draw(tp_pairs(max_tp))
    n = draw(st.integers(1, max_regions))
    raw_groups = [draw(st.integers(0, max_groups - 1)) for _ in range(n)]
    relabel = {g: i for i, g in enumerate(dict.fromkeys(raw_groups))}
    per_region = max(1, max_bytes // n)
    src_regions, dst_regions = [], []
    for i in range(n):
        s, d = draw(
            region_pairs(
                i,
                src_tp,
                dst_tp,
                kinds=kinds,
                group=relabel[raw_groups[i]],
                max_blocks=max_blocks,
                max_region_bytes=per_region,
                windows=windows,
                omit_defaults=omit_defaults,
            )
        )
        src_regions.append(s)
        dst_regions.append(d)
    order = draw(st.permutations(range(n)))
    dst_regions = [dst_regions[k] for k in order]
    return {"tp_size": src_tp, "regions": src_regions}, {"tp_size": dst_tp, "regions": dst_regions}


def _num_groups(*specs: dict) -> int:
    return 1 + max((r.get("group", 0) for sp in specs for r in sp["regions"]), default=-1)


def _block_range(spec: dict, group: int) -> int:
    nbs = [r["num_blocks"] for r in spec["regions"] if r.get("group", 0) == group]
    return min(nbs) if nbs else 0


@st.composite
def block_lists(draw, num_blocks: int, length: int | None = None) -> list[int]:
    """A list of unique block ids in ``[0, num_blocks)``.

    Mixes scattered ids, one consecutive run, and several shuffled consecutive runs (so that
    run merging is exercised). ``length`` fixes the length (clipped to ``num_blocks``).
    """
    if num_blocks <= 0:
        return []
    if length is None:
        length = draw(st.integers(0, num_blocks))
    length = max(0, min(length, num_blocks))
    mode = draw(st.sampled_from(("scattered", "consecutive", "runs")))
    if mode == "scattered":
        perm = draw(st.permutations(range(num_blocks)))
        return list(perm[:length])
    if mode == "consecutive":
        start = draw(st.integers(0, num_blocks - length))
        return list(range(start, start + length))
    # runs: cut [0, num_blocks) into chunks, shuffle the chunks, take a prefix of ids
    cuts = sorted(draw(st.sets(st.integers(1, max(1, num_blocks - 1)), max_size=6)))
    bounds = [0, *[c for c in cuts if 0 < c < num_blocks], num_blocks]
    chunks = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
    chunks = list(draw(st.permutations(chunks)))
    ids = [i for chunk in chunks for i in chunk]
    return ids[:length]


def _first_block_size(spec: dict, group: int) -> int | None:
    for r in spec["regions"]:
        if r.get("group", 0) == group:
            return r["block_size"]
    return None


def engine_pairs(**kwargs) -> st.SearchStrategy[tuple[EngineSpec, EngineSpec]]:
    """Like :func:`spec_pairs` (same keyword arguments), as ``(src, dst)`` EngineSpec values."""
    return spec_pairs(**kwargs).map(lambda p: (EngineSpec.from_dict(p[0]),
                                               EngineSpec.from_dict(p[1])))


@st.composite
def requests(
    draw, src_dict: dict | EngineSpec, dst_dict: dict | EngineSpec
) -> tuple[list[list[int]], list[list[int]]]:
    """A request for a spec pair: (src_blocks, dst_blocks), lists indexed by group id.

    The specs may be dicts or :class:`~kvplan.EngineSpec` values.

    Block ids are unique within each list and lie below the smallest ``num_blocks`` of the
    group's regions on that side. Lengths on the two sides are either independent (any,
    including empty) or matched: enough destination blocks for the source tokens, measured
    with the block sizes of the group's first region on each side.
    """
    if isinstance(src_dict, EngineSpec):
        src_dict = src_dict.to_dict()
    if isinstance(dst_dict, EngineSpec):
        dst_dict = dst_dict.to_dict()
    g_count = _num_groups(src_dict, dst_dict)
    src_blocks, dst_blocks = [], []
    for g in range(g_count):
        n_src, n_dst = _block_range(src_dict, g), _block_range(dst_dict, g)
        slist = draw(block_lists(n_src))
        dst_len = None
        bs_s, bs_d = _first_block_size(src_dict, g), _first_block_size(dst_dict, g)
        if bs_s and bs_d and draw(st.booleans()):
            dst_len = int(np.ceil(len(slist) * bs_s / bs_d))
        dlist = draw(block_lists(n_dst, dst_len))
        src_blocks.append(slist)
        dst_blocks.append(dlist)
    return src_blocks, dst_blocks
