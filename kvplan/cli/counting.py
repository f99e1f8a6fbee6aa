"""What ``kvplan explain`` computes: the request it shows, bytes and runs per lane counted
without materialising a rank's plan (:func:`count`), runs per layout (:func:`runs_by_layout`),
and the explanation as a JSON-able document with its warnings (:func:`explain`).

Where to look for the numbers; how they are printed is :mod:`kvplan.cli.tables`. Requests use
non-adjacent block ids (0, 2, 4, ...), the worst case for merging: real allocators rarely hand
out neighbours. Runs are counted one set of alike lanes at a time, so memory does not grow with
the layer count or the number of ranks.

Layer: the CLI (layer 7, top of the core); imports kvplan's public names, views and the CLI's
helpers, never nixl, torch or the executor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

import kvplan
from kvplan import EngineSpec, TransferMap
from kvplan.cli.cliargs import UsageError
from kvplan.lanes import Lane, Mode
from kvplan.views import human_bytes, peer_rows, rank_share

_Usage = UsageError


#: Above this many runs per request on one rank, explain warns that descriptors dominate.
MANY_RUNS = 10_000


#: The layouts ``explain`` compares: today's per-layer HND split and vLLM's six orders.
COMPARED_LAYOUTS = ("HND", *kvplan.spec.VLLM_ORDERS)


def blocks_needed(tokens: int, block_size: int) -> int:
    """Blocks a region needs for ``tokens`` tokens with non-adjacent ids (every other id)."""
    return 2 * -(-tokens // block_size) + 1  # room for non-adjacent ids


def request(spec: EngineSpec, tokens: int) -> list[list[int]]:
    """Block ids of one request of ``tokens`` tokens: per token group non-adjacent ids
    ``0, 2, 4, ...`` (consecutive when the regions are too small); per state group one slot,
    the highest free id. Groups viewing a shared pool get distinct pages (a page belongs to one
    group's view at a time)."""
    groups = [[r for r in spec.regions if r.group == g] for g in range(spec.num_groups)]
    taken: dict[str, set[int]] = {}  # pool -> pages earlier groups use
    out: list[list[int]] = [[] for _ in groups]
    # token groups first (they need the most pages), then one slot per state group
    for g in sorted(range(len(groups)), key=lambda g: groups[g][0].is_state):
        regions = groups[g]
        limit = min(r.num_blocks for r in regions)
        pools = {r.pool for r in regions if r.pool is not None}
        used = set().union(*(taken.get(p, set()) for p in pools))
        if regions[0].is_state:
            need, ids = 1, (b for b in range(limit - 1, -1, -1) if b not in used)
        else:
            need = -(-tokens // max(r.block_size for r in regions))
            step = 2 if 2 * need - 1 <= limit - len(used) else 1
            ids = (b for b in range(0, limit, step) if b not in used)
        out[g] = [b for _, b in zip(range(need), ids)]
        if len(out[g]) < need:
            what = "a state slot" if regions[0].is_state else f"{tokens} tokens"
            raise _Usage(f"{what} need(s) {need} blocks in group {g}, but its regions hold "
                         f"{limit} ({len(used)} used by groups sharing a pool); lower --tokens "
                         "or raise --num-blocks")
        for p in pools:
            taken.setdefault(p, set()).update(out[g])
    return out


def _with_layout(spec: EngineSpec, layout: str) -> EngineSpec:
    if any(r.allocation is not None for r in spec.regions):
        return spec.with_layout(layout)  # one allocation per layer again
    regions = tuple(
        attrs.evolve(r, layout=kvplan.Layout(layout)) if r.kind is kvplan.Kind.ATTENTION else r
        for r in spec.regions
    )
    return attrs.evolve(spec, regions=regions)


def _has_nhd(spec: EngineSpec) -> bool:
    return any(r.kind is kvplan.Kind.ATTENTION and r.layout is kvplan.Layout.NHD
               for r in spec.regions)


@attrs.frozen
class Counted:
    """One rank's bytes and runs per lane for one request, without the plan's rows.

    What :func:`kvplan.views.peer_rows` reads (``map`` and ``lane_stats()``), so that explain
    prints the same rows as for a :class:`~kvplan.TransferPlan` of the same request.
    """

    map: TransferMap
    stats: tuple[tuple[Lane, int, int], ...]  # (lane, bytes, runs), in lane order

    def lane_stats(self) -> list[tuple[Lane, int, int]]:
        """``(lane, bytes, runs)`` of every lane of :attr:`map`, in lane order."""
        return list(self.stats)

    @property
    def nbytes(self) -> int:
        """Bytes of the request on this rank."""
        return sum(b for _, b, _ in self.stats)

    @property
    def runs(self) -> int:
        """Runs (NIXL descriptors) of the request on this rank."""
        return sum(n for _, _, n in self.stats)

    @property
    def peers(self) -> tuple[int, ...]:
        """The other engine's ranks the request copies with (lanes with at least one run)."""
        attr = "src_rank" if self.map.mode is Mode.PULL else "dst_rank"
        return tuple(sorted({getattr(lane, attr) for lane, _, n in self.stats if n}))


def count(tmap: TransferMap, src_blocks: Sequence, dst_blocks: Sequence, *,
          tokens: tuple[int, int] | None = None, part: Sequence[str] | None = None) -> Counted:
    """Bytes and runs per lane of ``tmap.plan(src_blocks, dst_blocks)``, in memory independent
    of the request's run count across layers and peers.

    Lanes alike but for their region and ranks (every layer of one geometry shares its block
    templates) have equal runs; each such set is planned once, one lane at a time, so memory
    is one lane's runs for this request, never every rank's (or layer's) full array. Lanes
    whose regions are layer slots of one allocation on both sides can share runs (a ``BL...``
    order merges every layer of a block), so they are planned together, one (source rank,
    allocation pair) at a time. The counts equal the full plan's (tested). ``tokens`` is the
    plan's token range; ``part`` keeps only those regions' lanes, counted as a layer-wise
    request posts them (``merge_slots=False``: runs never span two layers).
    """
    src, dst = tmap.src, tmap.dst
    if part:
        keep = {tmap.region_ids[name] for name in part if name in tmap.region_ids}
        missing = [name for name in part if name not in tmap.region_ids]
        if missing:
            raise kvplan.RequestError(f"--part: no region named {missing[0]!r}")
        tmap = attrs.evolve(tmap, lanes=tuple(x for x in tmap.lanes if x.dst_region in keep))
    plan_kw = {"tokens": tokens, "merge_slots": not part}
    done: dict[tuple, tuple[int, int]] = {}
    packed: dict[tuple, list[int]] = {}
    stats: list = [None] * len(tmap.lanes)
    for k, lane in enumerate(tmap.lanes):
        if src.slot_of(lane.src_region)[1] > 1 and dst.slot_of(lane.dst_region)[1] > 1:
            key = (lane.src_rank, lane.dst_rank, src.buffer_of(lane.src_region),
                   dst.buffer_of(lane.dst_region))
            packed.setdefault(key, []).append(k)
            continue
        key = (id(lane.templates),
               attrs.evolve(lane, src_rank=0, dst_rank=0, src_region=0, dst_region=0))
        hit = done.get(key)
        if hit is None:
            one = attrs.evolve(tmap, lanes=(lane,)).plan(src_blocks, dst_blocks, **plan_kw)
            hit = done[key] = (one.nbytes, len(one))
        stats[k] = (lane, *hit)
    for members in packed.values():
        lanes = tuple(tmap.lanes[k] for k in members)
        some = attrs.evolve(tmap, lanes=lanes).plan(src_blocks, dst_blocks, **plan_kw)
        b, lengths = some.lane_bounds, some.rows["length"]
        for j, k in enumerate(members):
            stats[k] = (lanes[j], int(lengths[b[j]:b[j + 1]].sum()), int(b[j + 1] - b[j]))
    return Counted(tmap, tuple(stats))


def runs_by_layout(src: EngineSpec, dst: EngineSpec, tokens: int,
                   ranks: Sequence[int] | None = None, *, cached: int | None = None,
                   part: Sequence[str] | None = None,
                   progress: Callable[[str], Any] | None = None) -> dict[str, int]:
    """Runs (NIXL descriptors) per request on ``ranks`` with each of :data:`COMPARED_LAYOUTS`
    on both sides (``EngineSpec.with_layout``: an order packs a group's layers in one buffer),
    counted as :func:`count` does, for the request :func:`explain` shows (``cached`` and
    ``part`` as there). ``progress(text)`` is called before each layout is counted."""
    ranks = list(range(dst.num_ranks)) if ranks is None else list(ranks)
    src_blocks, dst_blocks = request(src, tokens), request(dst, tokens)
    rng = None if cached is None else (cached, tokens)
    out = {}
    for k, name in enumerate(COMPARED_LAYOUTS):
        if progress is not None:
            progress(f"{name} ({k + 1} of {len(COMPARED_LAYOUTS)} layouts)")
        s, d = src.with_layout(name), dst.with_layout(name)
        out[name] = sum(count(kvplan.pull_map(s, d, r), src_blocks, dst_blocks, tokens=rng,
                              part=part).runs for r in ranks)
    return out


#: ``explain`` compares layouts (:func:`runs_by_layout`) up to this many tokens unless asked:
#: a packed layout's runs are counted per (peer, allocation), which at 128k tokens of a 70B
#: model means millions of rows per count.
COMPARE_LAYOUTS_TOKENS = 32768


def explain(src: EngineSpec, dst: EngineSpec, tokens: int,
            ranks: Sequence[int] | None = None,
            progress: Callable[[str], Any] | None = None, *, cached: int | None = None,
            part: Sequence[str] | None = None) -> dict[str, Any]:
    """The explanation as a JSON-able dict: per destination rank its rows, and warnings.

    ``cached``: positions the destination already holds (a prefix-cache hit), so the request
    copies exactly positions ``[cached, tokens)``; ``part``: region names, to show only that
    part of each plan (the layers a layer-wise connector posts together).

    Runs are counted per lane (:func:`count`), never materialised for a whole rank: a 128k-token
    NHD request of a 70B model answers in seconds in a few hundred MiB. ``progress`` (e.g.
    :func:`kvplan.cli.progress.step`) wraps each rank's work. Raises
    :class:`kvplan.IncompatibleLayoutError` when the two engines cannot talk.
    """
    ranks = list(range(dst.num_ranks)) if ranks is None else list(ranks)
    src_blocks, dst_blocks = request(src, tokens), request(dst, tokens)
    rng = None if cached is None else (cached, tokens)
    out_ranks = []
    counted = []
    for d in ranks:
        with _maybe(progress, f"planning decode rank {d} of {dst.num_ranks}"):
            c = count(kvplan.pull_map(src, dst, d), src_blocks, dst_blocks, tokens=rng,
                      part=part)
        counted.append(c)
        rows = []
        for peer, peer_list in peer_rows(c).items():
            for row in peer_list:
                first = row["first_run"] or (None, None)
                rows.append({
                    "from": peer, "regions": row["regions"], "region_names": row["region_names"],
                    "placement": row["placement"], "streams": row["streams"],
                    "src_offset": first[0], "dst_offset": first[1],
                    "bytes": row["bytes"], "runs": row["runs"],
                })
        out_ranks.append({"rank": d, "holds": rank_share(dst, d), "peers": list(c.peers),
                          "nbytes": c.nbytes, "runs": c.runs, "rows": rows})
    with _maybe(progress, "comparing with HND layouts"):
        warnings = _warnings(src, dst, src_blocks, dst_blocks, ranks, counted, rng, part)
    return {
        "source": _engine_doc(src),
        "destination": _engine_doc(dst),
        "tokens": tokens,
        **({"range": list(rng)} if rng is not None else {}),
        **({"part": list(part)} if part else {}),
        "blocks": {"source": [len(b) for b in src_blocks],
                   "destination": [len(b) for b in dst_blocks]},
        "ranks": out_ranks,
        "warnings": warnings,
    }


def layouts(spec: EngineSpec) -> str:
    """The layouts of an engine's regions as written in its spec (``BLHNC``; ``HND, NHD`` when
    they differ), for titles and JSON."""
    return ", ".join(dict.fromkeys(r.layout_name for r in spec.regions))


def _engine_doc(spec: EngineSpec) -> dict[str, Any]:
    """An engine's shape in explain's JSON: TP, PP, PCP and DCP sizes, layouts and region
    count."""
    kv = dict.fromkeys(r.kv.value for r in spec.regions if r.kind is kvplan.Kind.ATTENTION)
    sizes = {f: getattr(spec, f) for f in ("tp_size", "pp_size", "pcp_size", "dcp_size",
                                           "dcp_interleave")}  # every one, 1 where unset
    return {**sizes, "layout": layouts(spec),
            "kv": ", ".join(kv), "regions": len(spec.regions)}


def _maybe(progress, text: str):
    from contextlib import nullcontext

    return nullcontext() if progress is None else progress(text)


def _warnings(src, dst, src_blocks, dst_blocks, ranks, counted: list[Counted],
              rng: tuple[int, int] | None = None, part: Sequence[str] | None = None) -> list[str]:
    out = []
    runs = sum(c.runs for c in counted)
    if _has_nhd(src) or _has_nhd(dst):
        s2, d2 = _with_layout(src, "HND"), _with_layout(dst, "HND")
        hnd = sum(count(kvplan.pull_map(s2, d2, d), src_blocks, dst_blocks, tokens=rng,
                        part=part).runs for d in ranks)
        if runs > hnd:
            sides = " and ".join(n for n, s in (("prefill", src), ("decode", dst)) if _has_nhd(s))
            hetero = (f"under heterogeneous TP (TP{src.tp_size} -> TP{dst.tp_size})"
                      if src.tp_size != dst.tp_size else "with these blocks")
            out.append(
                f"NHD layout on {sides} {hetero}: {runs} runs per request on the ranks shown, "
                f"{hnd} with HND on both sides ({runs / hnd:.1f}x more): NHD cuts a head slice "
                "of a block into one run per token; HND keeps it contiguous"
            )
    sizes: dict[tuple[int, int], list[str]] = {}
    for d in dst.regions:
        s = src.regions[src.region_index(d.name)]
        if s.block_size != d.block_size:
            sizes.setdefault((s.block_size, d.block_size), []).append(d.name)
    for (bs, bd), names in sorted(sizes.items()):
        from kvplan.views import name_set

        if bd > bs:
            what = f"each destination block gathers {bd // bs} source blocks"
        else:
            what = f"each source block feeds {bs // bd} destination blocks"
        out.append(f"block sizes differ on {name_set(names)}: source {bs}, destination {bd} "
                   f"tokens; {what}, and runs do not merge across blocks")
    for d, c in zip(ranks, counted):
        if c.runs > MANY_RUNS:
            out.append(f"d{d}: {c.runs} runs per request ({human_bytes(c.nbytes / c.runs)} on "
                       "average): descriptor count dominates the transfer's cost")
    return out


