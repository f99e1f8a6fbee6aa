"""The rank map: which source rank sends what to which destination rank, as values and a picture.

The *rank map* (:func:`rank_map`) is the set of edges ``source rank -> destination rank`` of one
or more plans (or maps), each with its bytes, runs and *flows* (:class:`Edge`, :class:`Flow`):
what crosses the edge per kind of region (K+V head ranges of SPLIT attention, REPLICATE
latents, state parts). :func:`plot_rank_map` draws it with matplotlib (imported only when
drawing: the ``view`` extra), :data:`PLOT_NOTES` says what its abbreviations mean.

It also holds the helpers the notebook views need too (:func:`human_bytes`, :func:`rank_share`,
:func:`lane_stats`, :func:`map_of`, :func:`require_extra`): this module is the lower of the two,
:mod:`kvplan.views` imports them from here and re-exports the rank map's public names
(``kvplan.views.rank_map`` and ``kvplan.rank_map`` are the function; the module is named
``rank_picture`` so that no module and function share a name).

Layer 5 (views on top, beside :mod:`kvplan.views`, which imports it; it never imports views):
may import every layer below; matplotlib stays optional.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from kvplan.lanes import Lane
    from kvplan.planner import TransferMap
    from kvplan.spec import EngineSpec, RegionSpec


# -- shared with kvplan.views ------------------------------------------------------------------


def require_extra(module: str, what: str) -> Any:
    """The optional module ``module`` (pandas, matplotlib) imported, or an ImportError saying
    that ``what`` needs it and how to install it (the ``view`` extra)."""
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


def map_of(item: Any) -> TransferMap:
    """The map of a plan (``plan.map``), or ``item`` itself when it is a map."""
    return getattr(item, "map", item)


def lane_stats(item: Any) -> list[tuple[Lane, int, int]]:
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


# -- the rank map ------------------------------------------------------------------------------

#: Colours of the three kinds of flow in :func:`plot_rank_map` (matplotlib's tab10).
KIND_COLORS = {"kv": "#1f77b4", "latent": "#ff7f0e", "state": "#2ca02c"}
KIND_LABELS = {
    "kv": "K+V heads (SPLIT)",
    "latent": "MLA / indexer latent (REPLICATE)",
    "state": "state parts (SPLIT per part)",
}


def kind_class(region: RegionSpec) -> str:
    """``'kv'`` (attention heads), ``'latent'`` (MLA, indexer) or ``'state'``."""
    if region.is_state:
        return "state"
    return "latent" if region.is_replicated else "kv"


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
        m = map_of(item)
        for lane, nbytes, runs in lane_stats(item):
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


# -- the picture ------------------------------------------------------------------------------


def _xs(n: int, width: float) -> list[float]:
    step = width / max(n, 1)
    return [step * (i + 0.5) for i in range(n)]


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
    require_extra("matplotlib", "plot()")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    items = [items] if not isinstance(items, (list, tuple)) else list(items)
    if not items:
        raise ValueError("plot_rank_map: nothing to draw (no plans or maps given)")
    m = map_of(items[0])
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
