"""Hypothesis strategies for requests on a spec pair: unique block ids per KV-cache group
(:func:`block_lists`, :func:`requests`) and token ranges anywhere inside the blocks
(:func:`token_requests`), for specs in the JSON form or as :class:`~kvplan.EngineSpec` values.

Where to look for what requests the properties run on; the engine specs they run on are drawn
by :mod:`kvplan.strategies`, which re-exports these names (import them from there).

Layer 5 (test tooling on top): imports spec (and hypothesis); nothing in the core imports it.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import strategies as st

from kvplan.spec import EngineSpec

__all__ = ["block_lists", "requests", "token_requests"]


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
            return r.get("block_size")
    return None


def _is_state_group(spec: dict, group: int) -> bool:
    return any(r["kind"] == "state" for r in spec["regions"] if r.get("group", 0) == group)


def _group_pools(spec: dict, group: int) -> set[str]:
    return {r["pool"] for r in spec["regions"]
            if r.get("group", 0) == group and r.get("pool") is not None}



@st.composite
def requests(
    draw, src_dict: dict | EngineSpec, dst_dict: dict | EngineSpec
) -> tuple[list[list[int]], list[list[int]]]:
    """A request for a spec pair: (src_blocks, dst_blocks), lists indexed by group id.

    The specs may be dicts or :class:`~kvplan.EngineSpec` values.

    Block ids are unique within each list and lie below the smallest ``num_blocks`` of the
    group's regions on that side; on each side, groups whose regions share a pool get
    disjoint ids. A group of state regions gets equally long lists on both sides (slot j goes
    to slot j). Other groups' lengths are either independent (any, including empty) or
    matched: enough destination blocks for the source tokens, measured with the block sizes of
    the group's first region on each side.
    """
    if isinstance(src_dict, EngineSpec):
        src_dict = src_dict.to_dict()
    if isinstance(dst_dict, EngineSpec):
        dst_dict = dst_dict.to_dict()
    sides = (src_dict, dst_dict)
    used: tuple[dict[str, set[int]], dict[str, set[int]]] = ({}, {})
    g_count = _num_groups(src_dict, dst_dict)
    src_blocks, dst_blocks = [], []
    for g in range(g_count):
        avail = []
        for spec, taken in zip(sides, used, strict=True):
            banned = set().union(*(taken.get(p, set()) for p in _group_pools(spec, g)))
            avail.append([b for b in range(_block_range(spec, g)) if b not in banned])

        def pick(ids: list[int], length: int | None) -> list[int]:
            return [ids[k] for k in draw(block_lists(len(ids), length))]

        if _is_state_group(src_dict, g) or _is_state_group(dst_dict, g):
            length = draw(st.integers(0, min(len(avail[0]), len(avail[1]))))
            slist, dlist = pick(avail[0], length), pick(avail[1], length)
        else:
            slist = pick(avail[0], None)
            dst_len = None
            bs_s, bs_d = _first_block_size(src_dict, g), _first_block_size(dst_dict, g)
            if bs_s and bs_d and draw(st.booleans()):
                dst_len = int(np.ceil(len(slist) * bs_s / bs_d))
            dlist = pick(avail[1], dst_len)
        for spec, taken, ids in zip(sides, used, (slist, dlist), strict=True):
            for p in _group_pools(spec, g):
                taken.setdefault(p, set()).update(ids)
        src_blocks.append(slist)
        dst_blocks.append(dlist)
    return src_blocks, dst_blocks


def _positions_per_block(spec: dict, region: dict) -> int:
    """Request positions one block id covers: ``block_size``, times ``dcp_size`` if any."""
    return region.get("block_size", 1) * spec.get("dcp_size", 1)


@st.composite
def token_requests(
    draw, src_dict: dict | EngineSpec, dst_dict: dict | EngineSpec
) -> tuple[list[list[int]], list[list[int]], tuple[int, int], str]:
    """A token-exact request: ``(src_blocks, dst_blocks, (start, end), dst_from)``.

    Lists as :func:`requests` draws them; ``0 <= start <= end <= `` the positions every token
    group's lists cover (so ``start`` and ``end`` fall anywhere inside blocks of either side).
    With ``dst_from == "start"`` (drawn only when each destination group has one block size)
    every destination token group's list is cut to begin at the block holding ``start``, as
    vLLM lists the blocks a destination lacks after a prefix-cache hit.
    """
    if isinstance(src_dict, EngineSpec):
        src_dict = src_dict.to_dict()
    if isinstance(dst_dict, EngineSpec):
        dst_dict = dst_dict.to_dict()
    src_blocks, dst_blocks = draw(requests(src_dict, dst_dict))
    by_name = {r["name"]: r for r in src_dict["regions"]}
    cover: list[int] = []
    per_group: dict[int, set[int]] = {}
    for d in dst_dict["regions"]:
        if d["kind"] == "state":
            continue
        s, g = by_name[d["name"]], d.get("group", 0)
        vs, vd = _positions_per_block(src_dict, s), _positions_per_block(dst_dict, d)
        cover.append(min(len(src_blocks[g]) * vs, len(dst_blocks[g]) * vd))
        per_group.setdefault(g, set()).add(vd)
    limit = min(cover, default=0)
    end = draw(st.just(limit) | st.integers(0, limit))  # often the whole lists
    start = draw(st.just(0) | st.integers(0, end))  # often no prefix hit
    dst_from = "zero"
    if all(len(v) == 1 for v in per_group.values()) and draw(st.booleans()):
        dst_from = "start"
        for g, (vd,) in per_group.items():
            dst_blocks[g] = dst_blocks[g][start // vd:]
    return src_blocks, dst_blocks, (start, end), dst_from
