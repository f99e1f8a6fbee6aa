"""Views for people: HTML tables for notebooks, pandas frames, and the rank map as a picture.

No module below imports this one at import time: the presentation methods of ``EngineSpec``,
``TransferMap`` and ``TransferPlan`` (``_repr_html_``, ``to_pandas``, ``summary``, ``plot``)
import the function they show themselves with from here inside the method; pandas and
matplotlib are imported only by the functions that need them (the ``view`` extra:
``pip install 'kvplan[view]'``).

Layers of identical geometry are shown as one row (``layers.[0-79].attn x80``), so an 80-layer
model is a few rows per peer rank, not a wall of numbers. The *rank map* (:func:`rank_map`) is
the set of edges ``source rank -> destination rank`` of one or more plans (or maps), each with
its bytes, runs and *flows*: what crosses the edge per kind of region (K+V head ranges of SPLIT
attention, REPLICATE latents, state parts).

Layer 5 (views on top): may import every layer below; pandas and matplotlib stay optional.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvplan.names import name_set

if TYPE_CHECKING:
    from kvplan.lanes import Lane
    from kvplan.plan import TransferPlan
    from kvplan.planner import TransferMap
    from kvplan.spec import EngineSpec, RegionSpec

#: Colours of the three kinds of flow in :func:`plot_rank_map` (matplotlib's tab10).
KIND_COLORS = {"kv": "#1f77b4", "latent": "#ff7f0e", "state": "#2ca02c"}
KIND_LABELS = {
    "kv": "K+V heads (SPLIT)",
    "latent": "MLA / indexer latent (REPLICATE)",
    "state": "state parts (SPLIT per part)",
}


def _require(module: str, what: str):
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(
            f"{what} needs {module}, which is not installed: pip install 'kvplan[view]' "
            f"(or pip install {module})"
        ) from None


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``; bytes below 1 KiB stay exact (``'576 B'``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def kind_class(region: RegionSpec) -> str:
    """``'kv'`` (attention heads), ``'latent'`` (MLA, indexer) or ``'state'``."""
    if region.is_state:
        return "state"
    return "latent" if region.is_replicated else "kv"


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
    return f"{k} heads x {region.head_dim}", f"{local} head{'s' * (local > 1)}{rep}"


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
    pd = _require("pandas", "EngineSpec.to_pandas()")
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
    if region.is_state:
        return "+".join(c.name for c in region.components)
    return "K+V" if region.streams == 2 else "K"


def _spec_placement(spec: EngineSpec, r: RegionSpec) -> str:
    """``R``/``S``, with DCP (``R DCP/2``) where the ranks shard the tokens, PCP replicas."""
    out = "R" if r.is_replicated else "S"
    if spec.dcp_size > 1 and not r.is_state:
        out += f" {'PCP' if spec.pcp_sharded else 'DCP'}/{spec.dcp_size}"
    if spec.pcp_size > 1 and not (spec.pcp_sharded and not r.is_state):
        out += f" x{spec.pcp_size} PCP replicas"
    return out


@attrs.frozen
class Flow:
    """What crosses one rank-map edge for one kind of region and one placement."""

    kind: str  # kv | latent | state
    placement: str  # the lane notation: S(heads 0:4), R, S(x 0:2048, ...)
    regions: tuple[str, ...]
    region_kinds: tuple[str, ...]  # Kind values: attention, mla, indexer, state
    nbytes: int
    runs: int
    share: str = ""  # for state flows: the slice of every part, e.g. "0-1/4"

    @property
    def label(self) -> str:
        """The placement as the text outputs write it: ``S(heads 0:4)``, ``MLA R``,
        ``S(x 0:2048, B 0:4)``, with the rank's context-parallel share where there is one
        (``S(heads 0:4) PCP replica 1/2``, ``MLA DCP 1/2``); a picture wraps it between parts."""
        if self.kind == "latent":
            names = {"mla": "MLA", "indexer": "indexer"}
            kinds = "+".join(names[k] for k in names if k in self.region_kinds)
            return f"{kinds} {self.placement}"
        return self.placement


@attrs.frozen
class Edge:
    """One ``source rank -> destination rank`` edge of a rank map (flat ranks)."""

    src_rank: int
    dst_rank: int
    nbytes: int
    runs: int
    flows: tuple[Flow, ...]


def _lane_stats(item) -> list[tuple[Lane, int, int]]:
    """(lane, bytes, runs) per lane: of the request for a plan, per block for a map; an object
    with ``map`` and ``lane_stats()`` (kvplan explain's counts) gives its own."""
    from kvplan.plan import TransferPlan

    if hasattr(item, "lane_stats"):
        return item.lane_stats()
    if isinstance(item, TransferPlan):
        b = item.lane_bounds
        lengths = item.rows["length"]
        return [
            (lane, int(lengths[b[k]:b[k + 1]].sum()), int(b[k + 1] - b[k]))
            for k, lane in enumerate(item.map.lanes)
        ]
    return [(lane, int(lane.templates[0].length.sum()), len(lane.templates[0].length))
            for lane in item.lanes]


def _map_of(item) -> TransferMap:
    return getattr(item, "map", item)


def _share(region: RegionSpec, lane: Lane) -> str:
    """For a state lane, the slice ``a-b`` (fractions) every part's units have in common."""
    if not region.is_state:
        return ""
    comps = region.components
    spans = {
        (Fraction(u.start, comps[u.component].units), Fraction(u.stop, comps[u.component].units))
        for u in lane.units
    }
    if len(spans) != 1 or len(lane.units) != len(comps):
        return ""
    a, b = spans.pop()
    return f"{a}-{b}"


def rank_map(items: Any) -> tuple[Edge, ...]:
    """The edges of one or more plans or maps, sorted by (source, destination) rank.

    Post-conditions: for plans, an edge's ``nbytes`` and ``runs`` are the sums of the plans'
    copies between its two ranks, and there is an edge exactly where some copy is; for maps,
    they are per destination block of each region (edges where a lane is).
    """
    items = [items] if not isinstance(items, (list, tuple)) else list(items)
    acc: dict[tuple[int, int], dict[tuple[str, str], list]] = {}
    for item in items:
        m = _map_of(item)
        for lane, nbytes, runs in _lane_stats(item):
            if runs == 0:
                continue
            region = m.dst.regions[lane.dst_region]
            key = (kind_class(region), lane.describe(m.dst), _share(region, lane))
            flows = acc.setdefault((lane.src_rank, lane.dst_rank), {})
            f = flows.setdefault(key, [[], set(), 0, 0])
            f[0].append(region.name)
            f[1].add(region.kind.value)
            f[2] += nbytes
            f[3] += runs
    edges = []
    for (s, d), flows in sorted(acc.items()):
        fl = tuple(Flow(k, p, tuple(v[0]), tuple(sorted(v[1])), v[2], v[3], sh)
                   for (k, p, sh), v in sorted(flows.items()))
        edges.append(Edge(s, d, sum(f.nbytes for f in fl), sum(f.runs for f in fl), fl))
    return tuple(edges)


def peer_rows(item) -> dict[int, list[dict[str, Any]]]:
    """Per peer rank of a plan (or map), one row per set of lanes alike but for their region.

    A row holds ``regions`` (a compact label), ``region_names``, ``placement``, ``streams``,
    the first run's offsets inside the two blocks (as text, and as ``first_run``: a pair of ints
    or None), and ``bytes``/``runs`` (of the request for a plan, per destination block for a
    map). Peers ascending, rows in lane order.
    """
    m = _map_of(item)
    pull = m.mode.value == "pull"
    per_peer: dict[int, dict[tuple, dict[str, Any]]] = {}
    for lane, nbytes, runs in _lane_stats(item):
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
    from kvplan.request import _span

    m = plan.map
    keep = None if plan.regions is None else set(plan.regions)
    spans: dict[int, tuple[int, int]] = {}
    for lane in m.lanes:
        if keep is not None and lane.dst_region not in keep:
            continue
        g = lane.group
        n_src, n_dst = len(plan.src_blocks[g]), len(plan.dst_blocks[g])
        state = m.dst.regions[lane.dst_region].is_state
        lo, hi, first = _span(m, lane, n_src, n_dst, None if state else plan.tokens,
                              plan.dst_from)
        if hi <= lo:
            continue
        vd = lane.templates[0].dst_bs
        a, b = lo // vd - first, (hi - 1) // vd - first + 1
        old = spans.get(g)
        spans[g] = (a, b) if old is None else (min(a, old[0]), max(b, old[1]))
    written = sum(b - a for a, b in spans.values())
    return written, sum(len(b) for b in plan.dst_blocks)


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
             f"{len(plan.dst_blocks)} group(s){html.escape(plan._scope())}</p>"]
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
    from kvplan.planner import _streams

    m = plan.map
    me, other = ("d", "p") if m.mode.value == "pull" else ("p", "d")
    share = rank_share(m.dst if m.mode.value == "pull" else m.src, m.rank)
    lines = [
        f"TransferPlan {m.mode.value} {me}{m.rank}{f' ({share})' if share else ''}: "
        f"{human_bytes(plan.nbytes)} in {len(plan)} "
        f"runs, {_blocks_text(plan)} in {len(plan.dst_blocks)} group(s){plan._scope()}"
    ]
    for peer, rows in peer_rows(plan).items():
        nbytes, runs = sum(r["bytes"] for r in rows), sum(r["runs"] for r in rows)
        lines.append(f"  {other}{peer}: {human_bytes(nbytes)}, {runs} runs")
        for r in rows:
            region = m.dst.regions[m.dst.region_index(r["region_names"][0])]
            lines.append(f"    {r['regions']}: {r['placement']} {_streams(region)}, "
                         f"{human_bytes(r['bytes'])} in {r['runs']} runs")
    return "\n".join(lines)


def map_frame(m: TransferMap):
    """One row per lane: ranks, region, placement, streams, bytes and runs per block."""
    pd = _require("pandas", "TransferMap.to_pandas()")
    rows = []
    for lane, nbytes, runs in _lane_stats(m):
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
    pd = _require("pandas", "TransferPlan.to_pandas()")
    rows = plan.copies()
    df = pd.DataFrame({FRAME_COLUMNS.get(name, name): rows[name] for name in rows.dtype.names})
    m = plan.map
    src_names = np.array([r.name for r in m.src.regions], dtype=object)
    dst_names = np.array([r.name for r in m.dst.regions], dtype=object)
    df.insert(2, "src_region_name", src_names[rows["src_region"]] if len(rows) else [])
    df.insert(6, "dst_region_name", dst_names[rows["dst_region"]] if len(rows) else [])
    return df


# -- the picture ------------------------------------------------------------------------------


def _xs(n: int, width: float) -> list[float]:
    step = width / max(n, 1)
    return [step * (i + 0.5) for i in range(n)]


def rank_share(spec: EngineSpec, rank: int, sep: str = ", ") -> str:
    """How a rank's share of a sharded engine is cut: the KV heads it holds of the first
    attention region (``heads 0:4``), which replica of them (``replica 2/4`` when fewer heads
    than TP ranks) and, under decode context parallelism, its token slice (``DCP slice 1/2``).
    Empty for an engine with no attention region and no DCP (every rank holds everything)."""
    from kvplan.placement import held_heads

    t, dcp = rank % spec.tp_size, spec.dcp_size
    lines = []
    for i in spec.regions_on(rank):
        r = spec.regions[i]
        if r.kind.value == "attention":
            h = held_heads(r.num_kv_heads, spec.tp_size, t)
            lines.append(f"heads {h.start}:{h.stop}")
            share = spec.tp_size // r.num_kv_heads  # ranks holding each head (>= 1)
            if share // dcp > 1:
                lines.append(f"replica {(t % share) // dcp + 1}/{share // dcp}")
            break
    if dcp > 1:
        lines.append(f"DCP slice {t % dcp + 1}/{dcp}")
    return sep.join(lines)


#: Under a rank map picture: what its abbreviations mean (the text outputs' legend says the same).
PLOT_NOTES = (
    "under a rank: the KV heads it holds (heads a:b = heads a..b-1), which replica when heads "
    "are fewer than ranks, its DCP token slice.  On an edge: S(heads a:b) = those heads copied "
    "(SPLIT); R = whole block (REPLICATE); S(x a:b, ...) = units a..b-1 of each state part x; "
    "bytes in KiB/MiB/GiB (2^10/2^20/2^30)."
)


def _total_scope(item) -> str:
    """What a picture's byte total covers: a request's token range, or a map's block."""
    if not hasattr(item, "rows"):
        return "per destination block"
    if item.tokens is None:
        return "for this request (every listed block)"
    return f"for tokens {item.tokens[0]}:{item.tokens[1]} of this request"


def plot_rank_map(items: Any, ax: Any = None, title: str | None = None):
    """Draw the rank map of one or more plans (or maps) with matplotlib; returns the Figure.

    Source ranks on top, destination ranks below, one line per edge and kind of region
    (blue K+V heads, orange replicated latents, green state parts), width growing with the
    bytes, each edge labelled with its head ranges / replicas and bytes. Ranks without an edge
    are drawn faded.
    """
    _require("matplotlib", "plot()")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    items = [items] if not isinstance(items, (list, tuple)) else list(items)
    if not items:
        raise ValueError("plot_rank_map: nothing to draw (no plans or maps given)")
    m = _map_of(items[0])
    src, dst = m.src, m.dst
    edges = rank_map(items)
    n_src, n_dst = src.num_ranks, dst.num_ranks
    import textwrap

    def wrapped(f: Flow) -> str:  # a long state placement: one part per line
        size = human_bytes(f.nbytes).replace(" ", "\u00a0")  # never "9.4" and "MiB" apart
        return "\n".join(textwrap.wrap(f"{f.label}  {size}", 30,
                                        break_long_words=False, break_on_hyphens=False))

    labels = {(e.src_rank, e.dst_rank): [wrapped(f) for f in e.flows] for e in edges}
    chars = max((len(ln) for ls in labels.values() for t in ls for ln in t.splitlines()),
                default=10)
    width = max(n_src, n_dst) * max(1.6, 0.07 * chars + 0.35)
    if ax is None:
        fig, ax = plt.subplots(figsize=(min(24.0, max(7.0, width + 2.4)), 4.8))
    else:
        fig = ax.figure
    xs_src, xs_dst = _xs(n_src, width), _xs(n_dst, width)
    y_src, y_dst = 1.0, 0.0
    used_src = {e.src_rank for e in edges}
    used_dst = {e.dst_rank for e in edges}
    top = max((e.nbytes for e in edges), default=1) or 1
    kinds_seen = []
    # labels go near the row with more ranks, where the edges are spread out
    t_label = 0.5 if n_src == n_dst else (0.22 if n_src > n_dst else 0.78)
    for e in edges:
        x0, x1 = xs_src[e.src_rank], xs_dst[e.dst_rank]
        n = len(e.flows)
        kinds = {}
        for f in e.flows:
            kinds.setdefault(f.kind, 0)
            kinds[f.kind] += f.nbytes
        order = [k for k in KIND_COLORS if k in kinds]
        for k, kind in enumerate(order):
            off = (k - (len(order) - 1) / 2) * 0.11
            lw = 1.0 + 6.0 * math.sqrt(kinds[kind] / top)
            ax.plot([x0 + off, x1 + off], [y_src - 0.07, y_dst + 0.07], color=KIND_COLORS[kind],
                    lw=lw, alpha=0.8, solid_capstyle="round", zorder=1 + k)
            if kind not in kinds_seen:
                kinds_seen.append(kind)
        lx = x0 + (x1 - x0) * t_label
        ly = y_src - 0.07 + (y_dst - y_src + 0.14) * t_label
        lines = labels[(e.src_rank, e.dst_rank)]
        text = "\n".join(lines[:3] + ([f"… {n - 3} more"] if n > 3 else []))
        ax.text(lx, ly, text, ha="center", va="center", fontsize=7, zorder=3,
                bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "#999", "alpha": 0.92})
    for row, xs, y, used, spec, name in (
        ("p", xs_src, y_src, used_src, src, "prefill"),
        ("d", xs_dst, y_dst, used_dst, dst, "decode"),
    ):
        for r, x in enumerate(xs):
            holds = rank_share(spec, r, "\n")
            label = f"{row}{r}" + (f"\n{holds}" if holds else "")
            faded = r not in used
            ax.text(x, y, label, ha="center", va="center", fontsize=9, zorder=4,
                    color="#999" if faded else "black",
                    bbox={"boxstyle": "round,pad=0.35", "fc": "#f4f4f4" if faded else "#e8eef7",
                          "ec": "#bbb" if faded else "#345"})
        pp = f" PP{spec.pp_size}" if spec.pp_size > 1 else ""
        ax.text(-0.2, y, f"{name}\nTP{spec.tp_size}{pp}", ha="right", va="center",
                fontsize=10, fontweight="bold")
    total = sum(e.nbytes for e in edges)
    per = _total_scope(items[0])
    if title is None:
        title = (f"{m.mode.value}: prefill TP{src.tp_size} -> decode TP{dst.tp_size}, "
                 f"{len(edges)} edges, {human_bytes(total)} {per}")
    ax.set_title(title, fontsize=11)
    handles = [Line2D([0], [0], color=KIND_COLORS[k], lw=4, label=KIND_LABELS[k])
               for k in ("kv", "latent", "state") if k in kinds_seen]
    if handles:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02),
                  ncol=len(handles), fontsize=8, frameon=False)
    ax.text(0.5, -0.12, "\n".join(textwrap.wrap(PLOT_NOTES, 150)), transform=ax.transAxes,
            ha="center", va="top", fontsize=7, color="#444")
    ax.set_xlim(-1.6, width + 0.2)
    ax.set_ylim(-0.28, 1.22)
    ax.axis("off")
    fig.tight_layout()
    return fig
