"""Hypothesis strategies for engine specs and requests, at the level of JSON-able dicts.

Connector authors can reuse these to test their own code against kvplan. The generators work on
plain data (the JSON engine spec form); :func:`engine_pairs` wraps :func:`spec_pairs` into
:class:`~kvplan.EngineSpec` values, and :func:`requests` takes either form. Importing this module
needs hypothesis (the ``test`` extra); the rest of kvplan does not.

An engine spec is ``{"tp_size": int, "pp_size": int (optional, default 1), "regions": [...]}``;
a region is one of::

    {"name", "kind": "attention", "group", "num_blocks", "block_size", "dtype",
     "num_kv_heads", "head_dim", "layout": "HND"|"NHD", "kv": "split"|"joint", "window"}
    {"name", "kind": "mla"|"indexer", "group", "num_blocks", "block_size", "dtype", "dim"}
    {"name", "kind": "state", "group", "num_blocks", "dtype",
     "parts": [{"name", "units", "unit_bytes"}, ...]}

plus, on any kind, the optional ``"pool"`` / ``"page_bytes"`` (shared pools), ``"stage"``
(pipeline stage), on token kinds ``"kernel_block_size"`` and, on attention, ``"stream"``
(``"k"`` or ``"v"``: the region holds that stream alone). Keys whose value equals the
default (``group`` 0, ``window`` None, ``layout`` "HND", ``kv`` "split") are sometimes left out,
to exercise default handling.

A request is ``(src_blocks, dst_blocks)``: two lists indexed by group id, each a list of
unique block ids of that group on that side.

:func:`layout_spec_pairs` (and :func:`layouts_and_allocations` on one spec) adds axis-order
layouts (:data:`LAYOUTS`: vLLM's six, TensorRT-LLM's ``BLSHND``, others), the legacy names,
``"allocation"`` (regions of one shape as layer slots of one buffer) and separate K/V buffers
(``"allocation": [k, v]``) on each side independently.

Requests on a spec pair (:func:`block_lists`, :func:`requests`, :func:`token_requests`) are
drawn by :mod:`kvplan.strategies_requests` and re-exported here.

Layer 5 (test tooling on top): imports spec, strategies_requests (and hypothesis); nothing in
the core imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from hypothesis import strategies as st

from kvplan.constants import DTYPE_SIZES
from kvplan.spec import EngineSpec
from kvplan.strategies_requests import block_lists, requests, token_requests

__all__ = [
    "DTYPES",
    "ELEMENT_SIZE",
    "LAYOUTS",
    "block_lists",
    "block_size_pairs",
    "dcp_spec_pairs",
    "engine_pairs",
    "head_counts",
    "layout_spec_pairs",
    "layouts_and_allocations",
    "pcp_spec_pairs",
    "region_pairs",
    "requests",
    "spec_pairs",
    "state_parts",
    "state_region_pairs",
    "token_requests",
    "tp_pairs",
    "unit_counts",
]

#: The dtypes the generators use, with their element sizes.
ELEMENT_SIZE: dict[str, int] = {
    k: DTYPE_SIZES[k] for k in ("float32", "bfloat16", "float16", "float8_e4m3fn", "uint8")
}
DTYPES: tuple[str, ...] = tuple(ELEMENT_SIZE)

_TP_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_HEAD_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
_UNIT_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_BLOCK_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32)
_DEFAULTS = {"group": 0, "window": None, "layout": "HND", "kv": "split"}
_NAME = {
    "attention": "layers.{}.attn",
    "mla": "draft.{}.mla",
    "indexer": "layers.{}.indexer",
    "state": "layers.{}.state",
}
#: Part names of the state regions generated, after the models that have them.
_PART_NAMES = (
    ("x", "B", "C", "ssm"),  # Mamba2 / Nemotron-H: conv parts, then the temporal state
    ("q_conv", "k_conv", "v_conv", "recurrent"),  # KDA (KimiLinear): four states
    ("conv", "ssm"),  # GDN (Qwen3-Next)
)
#: Extra bytes over the largest block that an explicit ``page_bytes`` may add.
_PAGE_PADDING = (0, 8, 64, 100)


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


def unit_counts(src_tp: int, dst_tp: int) -> st.SearchStrategy[int]:
    """State-part units U with ``U % tp == 0 or tp % U == 0`` for both TP sizes (fewer units
    than ranks included: replicated, as conv B and C groups are)."""
    us = [u for u in _UNIT_COUNTS if _divides_either(u, src_tp) and _divides_either(u, dst_tp)]
    return st.sampled_from(us)


def block_size_pairs(
    sizes: Sequence[int] = _BLOCK_SIZES, divide: bool = False
) -> st.SearchStrategy[tuple[int, int]]:
    """(src_block_size, dst_block_size), any two sizes (they plan by their gcd), or with one
    dividing the other when ``divide``; equal sizes favoured."""
    pairs = [(a, b) for a in sizes for b in sizes if not divide or _divides_either(a, b)]
    return st.one_of(st.sampled_from(sizes).map(lambda a: (a, a)), st.sampled_from(pairs))


def _rank_block_bytes(region: dict, tp: int) -> int:
    """Bytes of ONE block (state: one slot) of ``region`` on one rank of a ``tp``-rank stage."""
    e = ELEMENT_SIZE[region["dtype"]]
    if region["kind"] == "state":
        return sum(max(1, p["units"] // tp) * p["unit_bytes"] for p in region["parts"])
    bs = region["block_size"]
    if region["kind"] == "attention":
        streams = 1 if region.get("stream") else 2  # K or V alone: one stream
        return streams * bs * max(1, region["num_kv_heads"] // tp) * region["head_dim"] * e
    return bs * region["dim"] * e


def _block_bytes_all_ranks(region: dict, tp: int) -> int:
    """Bytes of ONE block of ``region`` summed over all ``tp`` ranks of its stage."""
    return tp * _rank_block_bytes(region, tp)


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
def _token_shapes(
    draw,
    index: int,
    src_tp: int,
    dst_tp: int,
    kinds: Sequence[str],
    group,
    windows: bool,
    kernel_blocks: bool,
    joint: tuple[bool, bool] = (False, False),
) -> list[dict]:
    """A token region (attention / mla / indexer) on both sides, without ``num_blocks``.
    ``joint[side]`` forces kv "joint" there (an attention region in a pool)."""
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
        stream = draw(st.sampled_from((None, None, None, "k", "v")))  # K or V alone, at times
        if stream:
            common["stream"] = stream
    else:
        common["dim"] = draw(st.integers(3, 40))
    bs_pair = draw(block_size_pairs())
    sides = []
    for bs, force_joint in zip(bs_pair, joint, strict=True):
        region = dict(common)
        region["block_size"] = bs
        if kind == "attention":
            region["layout"] = draw(st.sampled_from(("HND", "NHD")))
            region["kv"] = "joint" if force_joint else draw(st.sampled_from(("split", "joint")))
        if kernel_blocks and draw(st.booleans()):
            region["kernel_block_size"] = draw(
                st.sampled_from([d for d in range(1, bs + 1) if bs % d == 0])
            )
        sides.append(region)
    return sides


@st.composite
def state_parts(draw, src_tp: int, dst_tp: int, dtype: str = "bfloat16") -> list[dict]:
    """1..4 parts of a state slot: names after Mamba2 / KDA / GDN, units from
    :func:`unit_counts`, ``unit_bytes`` a small multiple of the element size."""
    names = draw(st.sampled_from(_PART_NAMES))
    n = draw(st.integers(1, len(names)))
    e = ELEMENT_SIZE[dtype]
    return [
        {
            "name": name,
            "units": draw(unit_counts(src_tp, dst_tp)),
            "unit_bytes": e * draw(st.integers(1, 4)),
        }
        for name in names[:n]
    ]


@st.composite
def _state_shapes(draw, index: int, src_tp: int, dst_tp: int, group) -> list[dict]:
    dtype = draw(st.sampled_from(DTYPES))
    region = {
        "name": _NAME["state"].format(index),
        "kind": "state",
        "group": group,
        "dtype": dtype,
        "parts": draw(state_parts(src_tp, dst_tp, dtype)),
    }
    return [dict(region), {**region, "parts": [dict(p) for p in region["parts"]]}]


def _blocks_cap(max_blocks: int, budget: int, per_block: int) -> int:
    return max(1, min(max_blocks, budget // max(1, per_block)))


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
    kernel_blocks: bool = False,
) -> tuple[dict, dict]:
    """One token region as seen by both engines: (src_region, dst_region).

    Shared across the pair: name, kind, group, dtype, num_kv_heads/head_dim or dim, window.
    Per side: layout, kv, block_size (any two sizes), num_blocks (sized so that the
    region's bytes summed over all ranks of that side stay under ``max_region_bytes``, but at
    least 1 and at most ``max_blocks``) and, with ``kernel_blocks``, sometimes a
    ``kernel_block_size`` dividing the block size.
    """
    shapes = draw(_token_shapes(index, src_tp, dst_tp, kinds, group, windows, kernel_blocks))
    sides = []
    for region, tp in zip(shapes, (src_tp, dst_tp), strict=True):
        cap = _blocks_cap(max_blocks, max_region_bytes, _block_bytes_all_ranks(region, tp))
        region["num_blocks"] = draw(st.integers(1, cap))
        sides.append(draw(_maybe_omit_defaults(region, omit_defaults)))
    return sides[0], sides[1]


@st.composite
def state_region_pairs(
    draw,
    index: int,
    src_tp: int,
    dst_tp: int,
    group: int = 0,
    max_blocks: int = 64,
    max_region_bytes: int = 1 << 18,
) -> tuple[dict, dict]:
    """One state region as seen by both engines: same name, group, dtype and parts; slots
    (``num_blocks``) per side, sized like :func:`region_pairs`."""
    shapes = draw(_state_shapes(index, src_tp, dst_tp, group))
    for region, tp in zip(shapes, (src_tp, dst_tp), strict=True):
        cap = _blocks_cap(max_blocks, max_region_bytes, _block_bytes_all_ranks(region, tp))
        region["num_blocks"] = draw(st.integers(1, cap))
    return shapes[0], shapes[1]


def _default_stages(n: int, pp: int) -> list[int]:
    base, extra = divmod(n, pp)
    return [s for s in range(pp) for _ in range(base + (1 if s < extra else 0))]


@st.composite
def _assign_stages(draw, items: list[list[dict]], pp: int, max_pp: int) -> dict:
    """Engine-level keys for one side and stage keys on its regions (``items`` in that side's
    order; the regions of an item, a pool's, stay in one stage)."""
    if max_pp == 1:
        return {}
    extra: dict = {}
    if pp > 1 or draw(st.booleans()):
        extra["pp_size"] = pp
    if pp == 1 and draw(st.integers(0, 4)) > 0:
        return extra
    regions = [r for item in items for r in item]
    default = _default_stages(len(regions), pp)
    item_of = [k for k, item in enumerate(items) for _ in item]
    pool_ok = all(
        len({default[x] for x in range(len(regions)) if item_of[x] == k}) == 1
        for k, item in enumerate(items)
        if item[0].get("pool") is not None
    )
    if pool_ok and draw(st.booleans()):
        return extra
    # Explicit stages: cut the items into pp non-empty contiguous runs.
    cuts = sorted(draw(st.lists(st.integers(1, len(items) - 1), min_size=pp - 1,
                                max_size=pp - 1, unique=True))) if pp > 1 else []
    stage_of_item = [sum(k >= c for c in cuts) for k in range(len(items))]
    for k, item in enumerate(items):
        for r in item:
            r["stage"] = stage_of_item[k]
    return extra


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
    state: bool = True,
    pools: bool = True,
    kernel_blocks: bool = True,
    max_pp: int = 2,
) -> tuple[dict, dict]:
    """Two compatible engine specs (src_dict, dst_dict), e.g. prefill and decode.

    - TP sizes come from :func:`tp_pairs` (one divides the other, up to ``max_tp``); PP sizes
      1..``max_pp``, independently per side.
    - 1..``max_regions`` items (at least the larger PP size), each a token region of the given
      ``kinds`` (attention heads divide or are a multiple of both TP sizes), with ``state`` a
      state region (parts from :func:`state_parts`), or with ``pools`` a shared pool of two
      regions in different groups (a token region with a state region, or two token regions),
      pooled on both sides or on one. A pooled attention region is kv "joint"; sometimes the
      pool gives an explicit ``page_bytes``.
    - layout / kv / block_size / kernel_block_size (with ``kernel_blocks``) / num_blocks chosen
      independently per side (block sizes need not divide); an optional sliding window on
      attention regions (``windows=True``).
    - token regions spread over up to ``max_groups`` groups, state regions over up to 2 other
      groups (a group holds state regions only or none), numbered 0..G-1 in source order with
      none empty; the same group on both sides.
    - the destination's region order is a shuffle of the source's (a pool's regions stay
      adjacent); each side's regions are cut into its PP stages by position or, sometimes (and
      always where the positional cut would split a pool), by explicit ``stage`` keys.
    - total bytes of each engine (all ranks, all regions) stay under about ``max_bytes``
      (one block per region is always allowed, so tiny budgets may be exceeded).

    ``spec_pairs(state=False, pools=False, kernel_blocks=False, max_pp=1)`` gives TP-only,
    non-hybrid pairs with no ``pp_size``, ``stage``, ``pool`` or ``kernel_block_size`` keys.
    """
    src_tp, dst_tp = draw(tp_pairs(max_tp))
    src_pp = draw(st.integers(1, max_pp))
    dst_pp = draw(st.integers(1, max_pp))
    n_items = draw(st.integers(max(src_pp, dst_pp), max(max_regions, src_pp, dst_pp)))
    poolable = [k for k in kinds if k in ("attention", "mla", "indexer")]
    item_kinds = ["token"]
    if state:
        item_kinds += ["state"]
    if pools and poolable and (state or max_groups >= 2):
        item_kinds += ["pool"]
    plans = [draw(st.sampled_from(item_kinds)) for _ in range(n_items)]
    n_regions = sum(2 if p == "pool" else 1 for p in plans)
    budget = max(1, max_bytes // n_regions)

    def token_label():
        return ("t", draw(st.integers(0, max_groups - 1)))

    def state_label():
        return ("s", draw(st.integers(0, 1)))

    items: list[list[list[dict]]] = []  # item -> member -> [src, dst]
    index = 0
    for plan in plans:
        if plan == "token":
            items.append([draw(_token_shapes(index, src_tp, dst_tp, kinds, token_label(),
                                             windows, kernel_blocks))])
            index += 1
            continue
        if plan == "state":
            items.append([draw(_state_shapes(index, src_tp, dst_tp, state_label()))])
            index += 1
            continue
        pooled = draw(st.sampled_from(((True, True), (True, True), (True, False), (False, True))))
        first_label = token_label()
        first = draw(_token_shapes(index, src_tp, dst_tp, poolable, first_label, windows,
                                   kernel_blocks, joint=pooled))
        if state and (not (max_groups >= 2) or draw(st.booleans())):
            second = draw(_state_shapes(index + 1, src_tp, dst_tp, state_label()))
        else:
            others = [g for g in range(max_groups) if g != first_label[1]]
            label = ("t", draw(st.sampled_from(others)))
            second = draw(_token_shapes(index + 1, src_tp, dst_tp, poolable, label, windows,
                                        kernel_blocks, joint=pooled))
        members = [first, second]
        for side in (0, 1):
            if pooled[side]:
                for m in members:
                    m[side]["pool"] = f"pool.{index}"
        items.append(members)
        index += 2

    # num_blocks per side: a pool's allocation is max(num_blocks) * page over its members.
    for item in items:
        for side, tp in ((0, src_tp), (1, dst_tp)):
            regions = [m[side] for m in item]
            if regions[0].get("pool") is None:
                for r in regions:
                    cap = _blocks_cap(max_blocks, budget, _block_bytes_all_ranks(r, tp))
                    r["num_blocks"] = draw(st.integers(1, cap))
                continue
            page = max(_rank_block_bytes(r, tp) for r in regions)
            if draw(st.booleans()):
                page += draw(st.sampled_from(_PAGE_PADDING))
                for r in regions:
                    r["page_bytes"] = page
            cap = _blocks_cap(max_blocks, budget * len(regions), page * tp)
            for r in regions:
                r["num_blocks"] = draw(st.integers(1, cap))

    # Groups: relabel to 0..G-1 by first appearance in source order.
    labels = [m[0]["group"] for item in items for m in item]
    relabel = {g: i for i, g in enumerate(dict.fromkeys(labels))}
    for item in items:
        for m in item:
            for r in m:
                r["group"] = relabel[r["group"]]

    src_items = [[m[0] for m in item] for item in items]
    order = draw(st.permutations(range(len(items))))
    dst_items = []
    for k in order:
        members = [m[1] for m in items[k]]
        dst_items.append(list(draw(st.permutations(members))) if len(members) > 1 else members)

    out = []
    for side_items, tp, pp in ((src_items, src_tp, src_pp), (dst_items, dst_tp, dst_pp)):
        extra = draw(_assign_stages(side_items, pp, max_pp))
        regions = [
            draw(_maybe_omit_defaults(r, omit_defaults)) for item in side_items for r in item
        ]
        out.append({"tp_size": tp, **extra, "regions": regions})
    return out[0], out[1]


def engine_pairs(**kwargs) -> st.SearchStrategy[tuple[EngineSpec, EngineSpec]]:
    """Like :func:`spec_pairs` (same keyword arguments), as ``(src, dst)`` EngineSpec values."""
    return spec_pairs(**kwargs).map(lambda p: (EngineSpec.from_dict(p[0]),
                                               EngineSpec.from_dict(p[1])))



def _dcp_choices(spec: dict) -> list[int]:
    """DCP sizes a spec's token regions allow: divisors ``d`` of ``tp_size`` with every token
    region's heads ``K`` giving each head a multiple of ``d`` ranks (``K * d <= tp``)."""
    tp = spec["tp_size"]
    heads = [r.get("num_kv_heads", 1) if r["kind"] == "attention" else 1
             for r in spec["regions"] if r["kind"] != "state"]
    return [d for d in range(1, tp + 1) if tp % d == 0
            and (d == 1 or all(k * d <= tp and (tp // k) % d == 0 for k in heads))]


@st.composite
def dcp_spec_pairs(draw, **kwargs) -> tuple[dict, dict]:
    """Like :func:`spec_pairs` (same keyword arguments), with decode context parallelism.

    Each side gets a ``dcp_size`` its heads allow (often > 1, 1 on one side too) and a
    ``dcp_interleave`` dividing its token regions' (kernel) block sizes; the positions one
    block id covers (``block_size * dcp_size``) need not divide one another across the pair.
    """
    src, dst = draw(spec_pairs(**kwargs))
    combos = [(a, b) for a in _dcp_choices(src) for b in _dcp_choices(dst)]
    sharded = [c for c in combos if c != (1, 1)]  # (1, 1) always qualifies; prefer others
    s_dcp, d_dcp = draw(st.sampled_from(sharded if sharded and draw(st.booleans()) else combos))
    for spec, dcp in ((src, s_dcp), (dst, d_dcp)):
        if dcp == 1:
            continue
        spec["dcp_size"] = dcp
        sizes = [r.get("kernel_block_size") or r["block_size"] for r in spec["regions"]
                 if r["kind"] != "state"]  # vLLM shards each kernel block (block_table.py)
        g = int(np.gcd.reduce(sizes)) if sizes else 1
        spec["dcp_interleave"] = draw(st.sampled_from([i for i in range(1, g + 1) if g % i == 0]))
    return src, dst
@st.composite
def pcp_spec_pairs(draw, max_pcp: int = 4, **kwargs) -> tuple[dict, dict]:
    """Like :func:`dcp_spec_pairs` (same keyword arguments), with prefill context parallelism.

    Each side may get a ``pcp_size`` of replicas (2..``max_pcp``), or, where its TP size is 1
    and it has no DCP, become sharded PCP: ``pcp_size == dcp_size`` (PCP rank q holds DCP
    shard q, as vLLM 0.33 does), with an interleave dividing its kernel block sizes. A side
    with DCP inside its TP group keeps ``pcp_size`` 1 (no engine stores both).
    """
    src, dst = draw(dcp_spec_pairs(**kwargs))
    for spec in (src, dst):
        how = draw(st.sampled_from(("none", "replicas", "sharded")))
        pcp = draw(st.integers(2, max_pcp))
        if how == "replicas" and spec.get("dcp_size", 1) == 1:
            spec["pcp_size"] = pcp
        elif how == "sharded" and spec["tp_size"] == 1:
            sizes = [r.get("kernel_block_size") or r["block_size"] for r in spec["regions"]
                     if r["kind"] != "state"]
            g = int(np.gcd.reduce(sizes)) if sizes else 1
            spec.update(pcp_size=pcp, dcp_size=pcp, dcp_interleave=draw(
                st.sampled_from([i for i in range(1, g + 1) if g % i == 0])))
    return src, dst


#: vLLM's six orders, TensorRT-LLM's pool order, and a few other permutations (``D`` last).
LAYOUTS: tuple[str, ...] = (
    "LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "BLSHND", "SLBNHD", "HSBLND",
)
_LEGACY = (("HND", "split"), ("HND", "joint"), ("NHD", "split"), ("NHD", "joint"))


def _slot_shape(r: dict, stage: int) -> tuple:
    keys = ("kind", "num_blocks", "block_size", "kernel_block_size", "num_kv_heads", "head_dim",
            "dim", "dtype", "stream")
    parts = tuple((p["units"], p["unit_bytes"]) for p in r.get("parts", ()))
    return (*(r.get(k) for k in keys), parts, stage)


@st.composite
def layouts_and_allocations(draw, spec: dict) -> dict:
    """A copy of ``spec`` whose regions get axis orders (:data:`LAYOUTS`, the legacy names)
    and, sometimes, allocations: regions of one shape and stage become layer slots of one
    buffer, and attention ones sometimes keep K and V in two buffers. A pooled region gets an
    order with L and B outermost. An allocation's slots share one drawn order."""
    spec = {**spec, "regions": [dict(r) for r in spec["regions"]]}
    stages = EngineSpec.from_dict(spec)
    by_shape: dict[tuple, list[dict]] = {}
    for i, r in enumerate(spec["regions"]):
        if r.get("pool") is not None:
            r.pop("kv", None)
            r["layout"] = draw(st.sampled_from(("LBHNC", "BLHNC", "BLNHC", "LBNHC", "BLSHND")))
            continue
        by_shape.setdefault(_slot_shape(r, stages.stage_of(i)), []).append(r)
    for k, members in enumerate(by_shape.values()):
        how = draw(st.sampled_from(("own", "own", "alloc", "alloc", "kv")))
        if how == "kv" and (members[0]["kind"] != "attention" or members[0].get("stream")):
            how = "alloc"  # K and V in two buffers: only a region holding both
        legacy = draw(st.booleans())
        layout, kv = draw(st.sampled_from(_LEGACY)) if legacy else (
            draw(st.sampled_from(LAYOUTS)), None)
        if how != "own":
            cut = draw(st.integers(1, len(members)))  # the slots, the rest keep their own
            for r in members[:cut]:
                r["allocation"] = [f"k.{k}", f"v.{k}"] if how == "kv" else f"alloc.{k}"
        for r in members:
            if how == "own" and draw(st.booleans()):
                layout, kv = draw(st.sampled_from(_LEGACY)) if legacy else (
                    draw(st.sampled_from(LAYOUTS)), None)
            r.pop("kv", None)
            r["layout"] = layout
            if kv is not None and r["kind"] == "attention":
                r["kv"] = kv
    return spec


@st.composite
def layout_spec_pairs(draw, **kwargs) -> tuple[dict, dict]:
    """:func:`spec_pairs` with :func:`layouts_and_allocations` drawn on each side."""
    src, dst = draw(spec_pairs(**kwargs))
    return draw(layouts_and_allocations(src)), draw(layouts_and_allocations(dst))
