"""Views for people: HTML tables for notebooks, pandas frames and text summaries.

No module below imports this one at import time: the presentation methods of ``EngineSpec``,
``TransferMap`` and ``TransferPlan`` (``_repr_html_``, ``to_pandas``, ``summary``, ``plot``)
import the function they show themselves with from here inside the method; pandas and
matplotlib are imported only by the functions that need them (the ``view`` extra:
``pip install 'kvplan[view]'``).

Layers of identical geometry are shown as one row (``layers.[0-79].attn x80``), so an 80-layer
model is a few rows per peer rank, not a wall of numbers. The rank map (edges ``source rank ->
destination rank`` with their flows) and its picture live in :mod:`kvplan.rank_picture`, re-exported
here (``rank_map``, ``plot_rank_map``, ``Flow``, ``Edge``, ``PLOT_NOTES``, ...); that module also
holds the helpers both need (``human_bytes``, ``rank_share``, ``lane_stats``), imported from it.

Layer 5 (views on top): may import every layer below and :mod:`kvplan.rank_picture` beside it
(which never imports this one), by their public names only (``request.lane_span``,
``planner.stream_notation``); pandas and matplotlib stay optional.
"""
from __future__ import annotations

import html
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvplan.names import name_set
from kvplan.planner import stream_notation
from kvplan.rank_picture import (
    KIND_COLORS,
    KIND_LABELS,
    PLOT_NOTES,
    Edge,
    Flow,
    human_bytes,
    kind_class,
    lane_stats,
    map_of,
    plot_rank_map,
    rank_map,
    rank_share,
    require_extra,
)
from kvplan.regions import stream_label
from kvplan.request import lane_span

if TYPE_CHECKING:
    from kvplan.plan import TransferPlan
    from kvplan.planner import TransferMap
    from kvplan.spec import EngineSpec, RegionSpec

#: The names of this module: its own views and, re-exported, the rank map's and the helpers
#: it shares with kvplan.rank_picture (``kvplan.views.rank_map`` is the function).
__all__ = [
    "FRAME_COLUMNS",
    "KIND_COLORS",
    "KIND_LABELS",
    "PLOT_NOTES",
    "Edge",
    "Flow",
    "blocks_written",
    "human_bytes",
    "kind_class",
    "map_frame",
    "map_html",
    "name_set",
    "peer_rows",
    "plan_frame",
    "plan_html",
    "plan_summary",
    "plot_rank_map",
    "rank_map",
    "rank_share",
    "spec_frame",
    "spec_html",
]


def _shape(region: RegionSpec, tp_size: int) -> tuple[str, str]:
    """(global shape, what one rank holds) in words."""
    if region.is_state:
        glob = ", ".join(f"{c.name} {c.units}x{c.unit_bytes} B" for c in region.components)
        local = ", ".join(f"{c.name} {c.local_units(tp_size)}" for c in region.components)
        return glob, local
    if region.is_replicated:
        return f"dim {region.dim}", f"all {region.dim}"
    k = region.num_kv_heads
    local = max(1, k // tp_size)  # type: ignore[operator]
    rep = f" (replicated x{tp_size // k})" if k < tp_size else ""  # type: ignore[operator]
    alone = f" ({stream_label(region)} alone)" if region.stream else ""
    return f"{k} heads x {region.head_dim}{alone}", f"{local} head{'s' * (local > 1)}{rep}"


def _layout(region: RegionSpec) -> str:
    alloc = region.allocation
    where = "" if alloc is None else (
        f", K/V in {alloc[0]}/{alloc[1]}" if isinstance(alloc, tuple) else f", in {alloc}")
    if region.kind.value == "attention":
        win = f", window {region.window}" if region.window else ""
        kv = f" {region.kv.value}" if region.layout_name in ("HND", "NHD") else ""
        return f"{region.layout_name}{kv}{win}{where}"
    if region.layout_name not in ("HND", "NHD"):
        return f"{region.layout_name}{where}"
    return ("slot" if region.is_state else "(NB, bs, F)") + where


def _spec_rows(spec: EngineSpec) -> list[dict[str, Any]]:
    """One row per set of regions of identical geometry (names aside), in spec order."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(spec.regions):
        key = tuple(sorted((k, str(v)) for k, v in r.to_dict().items()
                           if k not in ("name", "pool", "stage")))
        key += (spec.stage_of(i), spec.rank_page_nbytes(i))
        groups.setdefault(key, []).append(i)
    rows = []
    for members in groups.values():
        i = members[0]
        r = spec.regions[i]
        glob, local = _shape(r, spec.tp_size)
        rows.append({
            "regions": name_set([spec.regions[k].name for k in members]),
            "kind": r.kind.value,
            "group": r.group,
            "placement": _spec_placement(spec, r),
            "shape": glob,
            "per rank": local,
            "dtype": r.dtype,
            "layout": _layout(r),
            "block": "1 slot" if r.is_state else f"{r.block_size} tokens",
            "bytes/block/rank": spec.rank_block_nbytes(i),
            "blocks": r.num_blocks,
            "pool": ", ".join(sorted({spec.regions[k].pool or "" for k in members})) or "",
            "stage": spec.stage_of(i),
        })
    return rows


_CSS = (
    "<style>table.kvplan{border-collapse:collapse;margin:2px 0 8px 0;font-size:12px}"
    "table.kvplan th,table.kvplan td{border:1px solid #ccc;padding:2px 6px;text-align:left;"
    "white-space:normal;max-width:30em}"  # long placements wrap: bytes and runs stay in view
    "table.kvplan caption{text-align:left;font-weight:bold;padding:2px 0}"
    "table.kvplan td.num{text-align:right;font-family:monospace}</style>"
)


#: Columns an HTML table shows first when it has them: a narrow notebook then keeps the
#: numbers in view, and the long placements wrap at the end.
_FIRST = ("regions", "bytes", "runs", "bytes/block", "runs/block")


def _table(rows: list[dict[str, Any]], caption: str = "", drop: Iterable[str] = ()) -> str:
    if not rows:
        return f"<p>{html.escape(caption)}: nothing</p>"
    cols = [c for c in rows[0] if c not in set(drop)]
    if "placement" in cols and "kind" not in cols:  # a map's or plan's rows (not a spec's)
        cols = [c for c in _FIRST if c in cols] + [c for c in cols if c not in _FIRST]
    out = ["<table class='kvplan'>"]
    if caption:
        out.append(f"<caption>{html.escape(caption)}</caption>")
    out.append("<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>")
    for row in rows:
        cells = []
        for c in cols:
            v = row[c]
            if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
                text = human_bytes(int(v)) if "bytes" in c else str(v)
                cells.append(f"<td class='num'>{html.escape(text)}</td>")
            else:  # a break may fall after '+' or ', ' (q_conv+k_conv+..., state parts)
                text = html.escape(str(v)).replace("+", "+<wbr>").replace(", ", ", <wbr>")
                cells.append(f"<td>{text}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "".join(out)


def spec_html(spec: EngineSpec) -> str:
    """The spec as one HTML table, layers of identical geometry on one row."""
    rows = _spec_rows(spec)
    drop = [c for c in ("pool", "stage") if all(not r[c] for r in rows)]
    pp = f", PP {spec.pp_size}" if spec.pp_size > 1 else ""
    title = (f"EngineSpec: TP {spec.tp_size}{pp}, {len(spec.regions)} regions in "
             f"{spec.num_groups} KV-cache group(s)")
    return _CSS + _table(rows, title, drop)


def spec_frame(spec: EngineSpec):
    """One row per region: its JSON fields, stage and bytes per block on one rank."""
    pd = require_extra("pandas", "EngineSpec.to_pandas()")
    rows = []
    for i, r in enumerate(spec.regions):
        d = r.to_dict()
        if "parts" in d:
            d["parts"] = " ".join(f"{p['name']}:{p['units']}x{p['unit_bytes']}B"
                                  for p in d["parts"])
        d.update(stage=spec.stage_of(i), rank_block_nbytes=spec.rank_block_nbytes(i),
                 rank_page_nbytes=spec.rank_page_nbytes(i))
        rows.append(d)
    return pd.DataFrame(rows)


# -- maps and plans ----------------------------------------------------------------------------


def _streams(region: RegionSpec) -> str:
    """The streams column of a table: ``K+V``, ``K``, ``V``, or a state slot's parts
    (``conv+ssm``; summaries write :func:`kvplan.planner.stream_notation`, ``parts conv+ssm``)."""
    if region.is_state:
        return "+".join(c.name for c in region.components)
    return stream_label(region)


def _spec_placement(spec: EngineSpec, r: RegionSpec) -> str:
    """``R``/``S``, with DCP (``R DCP/2``) where the ranks shard the tokens, PCP replicas."""
    out = "R" if r.is_replicated else "S"
    if spec.dcp_size > 1 and not r.is_state:
        out += f" {'PCP' if spec.pcp_sharded else 'DCP'}/{spec.dcp_size}"
    if spec.pcp_size > 1 and not (spec.pcp_sharded and not r.is_state):
        out += f" x{spec.pcp_size} PCP replicas"
    return out


def peer_rows(item) -> dict[int, list[dict[str, Any]]]:
    """Per peer rank of a plan (or map), one row per set of lanes alike but for their region.

    A row holds ``regions`` (a compact label), ``region_names``, ``placement``, ``streams``,
    the first run's offsets inside the two blocks (as text, and as ``first_run``: a pair of ints
    or None), and ``bytes``/``runs`` (of the request for a plan, per destination block for a
    map). Peers ascending, rows in lane order.
    """
    m = map_of(item)
    pull = m.mode.value == "pull"
    per_peer: dict[int, dict[tuple, dict[str, Any]]] = {}
    for lane, nbytes, runs in lane_stats(item):
        region = m.dst.regions[lane.dst_region]
        peer = lane.src_rank if pull else lane.dst_rank
        tpl = lane.templates[0]
        first = f"+{int(tpl.src[0])} -> +{int(tpl.dst[0])}" if len(tpl.src) else ""
        # Layer slots of one allocation start at different offsets in a block (the L axis), so
        # their first runs differ by layer alone: they fold, showing the first layer's offsets.
        packed = m.dst.slot_of(lane.dst_region)[1] > 1 or m.src.slot_of(lane.src_region)[1] > 1
        key = (lane.dst_rank, lane.describe(m.dst), _streams(region), region.block_size,
               nbytes, runs, None if packed else first)
        row = per_peer.setdefault(peer, {}).setdefault(key, {
            "regions": [], "placement": lane.describe(m.dst), "streams": _streams(region),
            "first run (src -> dst in block)": first, "bytes": 0, "runs": 0,
            "first_run": (int(tpl.src[0]), int(tpl.dst[0])) if len(tpl.src) else None,
        })
        row["regions"].append(region.name)
        row["bytes"] += nbytes
        row["runs"] += runs
    return {
        peer: [{**r, "regions": name_set(r["regions"]), "region_names": r["regions"]}
               for r in rows.values()]
        for peer, rows in sorted(per_peer.items())
    }


_MACHINE = ("region_names", "first_run")  # peer_rows keys for programs, not tables


def _map_header(m: TransferMap) -> str:
    me = "d" if m.mode.value == "pull" else "p"
    return (f"{m.mode.value} {me}{m.rank}: source TP {m.src.tp_size} -> destination TP "
            f"{m.dst.tp_size}, {len(m.dst.regions)} regions, peers {list(m.peers)}")


def map_html(m: TransferMap) -> str:
    """Per peer rank, a table of what this rank copies per destination block, layers merged."""
    other = "p" if m.mode.value == "pull" else "d"
    parts = [_CSS, f"<p><b>TransferMap {html.escape(_map_header(m))}</b> (bytes and runs per "
             "destination block, summed over each row's regions)</p>"]
    for peer, rows in peer_rows(m).items():
        rows = [
            {**{k: v for k, v in r.items() if k not in (*_MACHINE, "bytes", "runs")},
             "bytes/block": r["bytes"], "runs/block": r["runs"]}
            for r in rows
        ]
        parts.append(_table(rows, f"{other}{peer}"))
    return "".join(parts)


def blocks_written(plan: TransferPlan) -> tuple[int, int]:
    """``(written, listed)``: destination block ids that receive bytes, and those listed.

    A prefix hit (``tokens=(1024, 3000)``) lists the request's every block but writes only the
    ones holding positions ``1024..3000``; a sliding window writes its last blocks only. Per
    group, the blocks from the lowest first position any of its lanes copies to the end.
    """
    m = plan.map
    keep = None if plan.regions is None else set(plan.regions)
    spans: dict[int, tuple[int, int]] = {}
    for lane in m.lanes:
        if keep is not None and lane.dst_region not in keep:
            continue
        g = lane.group
        n_src, n_dst = len(plan.src_blocks[g]), len(plan.dst_blocks[g])
        state = m.dst.regions[lane.dst_region].is_state
        lo, hi, first = lane_span(m, lane, n_src, n_dst, None if state else plan.tokens,
                              plan.dst_from)
        if hi <= lo:
            continue
        vd = lane.templates[0].dst_bs
        a, b = lo // vd - first, (hi - 1) // vd - first + 1
        old = spans.get(g)
        spans[g] = (a, b) if old is None else (min(a, old[0]), max(b, old[1]))
    written = sum(b - a for a, b in spans.values())
    return written, sum(len(b) for b in plan.dst_blocks)


def _scope(plan: TransferPlan) -> str:
    """The request's token range (and list anchoring) and a part's regions, for summaries."""
    out = ""
    if plan.tokens is not None:
        anchor = ", destination lists from start" if plan.dst_from == "start" else ""
        out += f", tokens {plan.tokens[0]}:{plan.tokens[1]}{anchor}"
    if plan.regions is not None:
        names = [plan.map.dst.regions[j].name for j in plan.regions]
        shown = ", ".join(names[:3]) + (f", ... ({len(names)})" if len(names) > 3 else "")
        out += f"; part of {len(plan.map.dst.regions)} regions: {shown}"
    return out


def _blocks_text(plan: TransferPlan) -> str:
    """``124 of 188 listed destination blocks written`` (or ``188 destination blocks``)."""
    written, listed = blocks_written(plan)
    if written == listed:
        return f"{listed} destination blocks"
    return f"{written} of {listed} listed destination blocks written"


def plan_html(plan: TransferPlan) -> str:
    """Per peer rank, a table of bytes and runs of this request, layers merged."""
    m = plan.map
    other = "p" if m.mode.value == "pull" else "d"
    parts = [_CSS, f"<p><b>TransferPlan {html.escape(_map_header(m))}</b>: "
             f"{human_bytes(plan.nbytes)} in {len(plan)} runs, {_blocks_text(plan)} in "
             f"{len(plan.dst_blocks)} group(s){html.escape(_scope(plan))}</p>"]
    for peer, rows in peer_rows(plan).items():
        nbytes = sum(r["bytes"] for r in rows)
        runs = sum(r["runs"] for r in rows)
        rows = [{k: v for k, v in r.items() if k not in _MACHINE} for r in rows]
        parts.append(_table(rows, f"{other}{peer}: {human_bytes(nbytes)} in {runs} runs",
                            drop=("first run (src -> dst in block)",)))
    return "".join(parts)


def plan_summary(plan: TransferPlan) -> str:
    """:meth:`TransferPlan.summary`: per peer rank its bytes and runs, then one line per set of
    alike lanes (``layers.[0-79].attn x80: S(heads 0:4) K+V, 40.0 MiB in 10240 runs``)."""
    m = plan.map
    me, other = ("d", "p") if m.mode.value == "pull" else ("p", "d")
    share = rank_share(m.dst if m.mode.value == "pull" else m.src, m.rank)
    lines = [
        f"TransferPlan {m.mode.value} {me}{m.rank}{f' ({share})' if share else ''}: "
        f"{human_bytes(plan.nbytes)} in {len(plan)} "
        f"runs, {_blocks_text(plan)} in {len(plan.dst_blocks)} group(s){_scope(plan)}"
    ]
    for peer, rows in peer_rows(plan).items():
        nbytes, runs = sum(r["bytes"] for r in rows), sum(r["runs"] for r in rows)
        lines.append(f"  {other}{peer}: {human_bytes(nbytes)}, {runs} runs")
        for r in rows:
            region = m.dst.regions[m.dst.region_index(r["region_names"][0])]
            lines.append(f"    {r['regions']}: {r['placement']} {stream_notation(region)}, "
                         f"{human_bytes(r['bytes'])} in {r['runs']} runs")
    return "\n".join(lines)


def map_frame(m: TransferMap):
    """One row per lane: ranks, region, placement, streams, bytes and runs per block."""
    pd = require_extra("pandas", "TransferMap.to_pandas()")
    rows = []
    for lane, nbytes, runs in lane_stats(m):
        region = m.dst.regions[lane.dst_region]
        rows.append({
            "src_rank": lane.src_rank, "dst_rank": lane.dst_rank,
            "src_region": lane.src_region, "dst_region": lane.dst_region,
            "region": region.name, "kind": region.kind.value, "group": lane.group,
            "placement": lane.describe(m.dst), "streams": _streams(region),
            "bytes_per_block": nbytes, "runs_per_block": runs,
        })
    return pd.DataFrame(rows)


#: ``plan.to_pandas()`` names the byte columns of ``copies()`` with their unit.
FRAME_COLUMNS = {"src_offset": "src_offset_bytes", "dst_offset": "dst_offset_bytes",
                 "length": "length_bytes"}


def plan_frame(plan: TransferPlan):
    """The plan's copies as a DataFrame (the columns of ``copies()``, the byte ones named with
    their unit: :data:`FRAME_COLUMNS`) plus region names."""
    pd = require_extra("pandas", "TransferPlan.to_pandas()")
    rows = plan.copies()
    df = pd.DataFrame({FRAME_COLUMNS.get(name, name): rows[name] for name in rows.dtype.names})
    m = plan.map
    src_names = np.array([r.name for r in m.src.regions], dtype=object)
    dst_names = np.array([r.name for r in m.dst.regions], dtype=object)
    df.insert(2, "src_region_name", src_names[rows["src_region"]] if len(rows) else [])
    df.insert(6, "dst_region_name", dst_names[rows["dst_region"]] if len(rows) else [])
    return df
