"""``kvplan explain``, ``check``, ``spec`` and ``presets``: look at plans without moving a byte.

- ``kvplan explain --prefill MODEL --prefill-tp 8 --decode MODEL --decode-tp 4 [--rank N]``
  prints, per destination rank, which source ranks it reads and, per set of alike regions, the
  placement (``S(heads 0:4)`` SPLIT, ``R`` REPLICATE, state parts), streams, the first run's
  offsets inside the two blocks, and bytes and runs for one request of ``--tokens`` tokens; then
  warnings where the layouts make the transfer expensive (NHD under heterogeneous TP, measured by
  planning the same request with HND on both sides). MODEL is a preset name
  (``kvplan presets``), a Hugging Face ``config.json`` (or its directory), or an engine-spec
  JSON (``kvplan spec``).
- ``kvplan check A.json B.json``: validates two engine specs (A the prefill / source, B the
  decode / destination); exit status 1 with the refusal message when they cannot talk.
- ``kvplan spec MODEL --tp N``: the engine-spec JSON an engine would send at handshake.
- ``kvplan presets``: the packaged model presets.

``--json`` prints one JSON document for machines; otherwise ``rich`` tables (plain text when
rich is not installed). Requests use non-adjacent block ids (0, 2, 4, ...), the worst case for
merging: real allocators rarely hand out neighbours. Runs are counted (:func:`count`) one set of
alike lanes at a time, never materialised as a rank's whole plan, so memory does not grow with
the layer count or the number of ranks.

Layer: the CLI (top of the core); imports kvplan's public names, views and the CLI's helpers,
never nixl, torch or the executor.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

import kvplan
from kvplan import EngineSpec, TransferMap, presets
from kvplan.cli.cliargs import (
    LEGEND,  # noqa: F401  # re-exported: the legend explain prints at 96 columns
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_TOKENS,
    MAX_TP,
    LegendEntry,
    UsageError,
    columns,
    int_in,
    print_legend,
    recorded,
    wrap,
)
from kvplan.compat import region_pairs
from kvplan.cp import parallel_fields, parallel_label
from kvplan.lanes import Lane, Mode
from kvplan.views import human_bytes, peer_rows, rank_share

_Usage = UsageError  # the name this module used before

#: Above this many runs per request on one rank, explain warns that descriptors dominate.
MANY_RUNS = 10_000


def layout_arg(value: str) -> str:
    """An argparse type: ``HND``, ``NHD``, vLLM's ``BLHNC``..., or any order of ``LBSHND``."""
    try:
        kvplan.spec.layout_order(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


#: The layouts ``explain`` compares: today's per-layer HND split and vLLM's six orders.
COMPARED_LAYOUTS = ("HND", *kvplan.spec.VLLM_ORDERS)


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise _Usage(f"cannot read {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise _Usage(f"{str(path)!r} is not UTF-8 text (byte {exc.start}): expected JSON") from None
    except json.JSONDecodeError as exc:
        raise _Usage(f"{str(path)!r} is not JSON: {exc}") from None
    except RecursionError:
        raise _Usage(f"{str(path)!r} nests JSON too deeply") from None


def _opt(args: argparse.Namespace, name: str, default: Any) -> Any:
    """``args.name`` unless the user left it unset (None): a user's 0 is kept (and refused
    where it is invalid), never replaced by the default."""
    value = getattr(args, name, None)
    return default if value is None else value


def _model(arg: str) -> tuple[str, Any]:
    """``("preset" | "hf" | "spec", config)`` for a preset name or a file."""
    if arg in presets.names():
        return "preset", presets.load(arg)
    path = Path(arg)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise _Usage(f"{arg!r} is neither a preset nor a file; presets: "
                     f"{', '.join(presets.names())}")
    data = _load_json(path)
    if isinstance(data, dict) and "regions" in data:
        return "spec", data
    return "hf", data


def _draft(arg: str | None) -> Any:
    if arg is None:
        return None
    kind, data = _model(arg)
    if kind == "spec":
        raise _Usage(f"--draft {arg!r} is an engine spec; give a model config or preset")
    return data


def _engine(arg: str, tp: int | None, args: argparse.Namespace, side: str,
            min_blocks: int = 0) -> EngineSpec:
    kind, data = _model(arg)
    cp = context_sizes(args, side)
    if kind == "spec":
        spec = EngineSpec.from_dict(data)
        if tp is not None and tp != spec.tp_size:
            raise _Usage(f"--{side}-tp {tp} but {arg!r} is a spec of tp_size {spec.tp_size}")
        for field, value in cp.items():
            if value != getattr(spec, field):
                flag = f"--{side}-" if side != "model" else "--"
                raise _Usage(f"{flag}{field.replace('_', '-')} {value} but {arg!r} is a spec "
                             f"of {field} {getattr(spec, field)}")
        return spec
    if tp is None:
        raise _Usage(f"--{side}-tp is needed for the model {arg!r}")
    return EngineSpec.from_hf_config(
        data,
        tp_size=tp,
        pp_size=_opt(args, f"{side}_pp", 1),
        block_size=_opt(args, f"{side}_block_size", args.block_size),
        num_blocks=_opt(args, "num_blocks", max(1024, min_blocks)),
        dtype=args.dtype,
        layout=_opt(args, f"{side}_layout", args.layout),
        kv=args.kv,
        draft=_draft(args.draft),
        **cp,
    )


def context_sizes(args: argparse.Namespace, side: str) -> dict[str, int]:
    """``dcp_size``, ``dcp_interleave`` and ``pcp_size`` a user gave for one side (those left
    unset are absent), from ``--{side}-dcp-size``... (``--dcp-size``... for ``kvplan spec``)."""
    return {f: getattr(args, f"{side}_{f}") for f in ("dcp_size", "dcp_interleave", "pcp_size")
            if getattr(args, f"{side}_{f}", None) is not None}


def context_options(p: argparse.ArgumentParser, side: str | None) -> None:
    """Add the context-parallel options of one side (``None``: ``kvplan spec``'s only model)."""
    flag, dest = (f"--{side}-", f"{side}_") if side else ("--", "model_")
    who = f" of {side}" if side else ""
    size = int_in(1, MAX_TP)
    p.add_argument(f"{flag}dcp-size", dest=f"{dest}dcp_size", type=size, default=None,
                   help=f"decode-context-parallel ranks{who} (a divisor of the TP size; "
                        "default 1)")
    p.add_argument(f"{flag}dcp-interleave", dest=f"{dest}dcp_interleave",
                   type=int_in(1, MAX_BLOCK_SIZE), default=None,
                   help=f"tokens a DCP rank{who} takes at a time (vLLM's "
                        "cp_kv_cache_interleave_size; must divide the kernel block size; "
                        "default 1)")
    p.add_argument(f"{flag}pcp-size", dest=f"{dest}pcp_size", type=size, default=None,
                   help=f"prefill-context-parallel ranks{who}: full replicas, or with TP 1 and "
                        "the same --dcp-size DCP shards (vLLM 0.33; default 1)")


def _blocks_needed(tokens: int, block_size: int) -> int:
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


# -- printing ----------------------------------------------------------------------------------


def _console():
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(highlight=False, width=columns())


def _title(args, src: EngineSpec, dst: EngineSpec) -> str:
    scope = "" if args.cached is None else f", positions {args.cached}:{args.tokens} copied"
    scope += f"; part: {', '.join(args.part)}" if args.part else ""
    return (f"prefill {args.prefill} {_shape(src)} -> decode {args.decode} {_shape(dst)}: "
            f"one request of {args.tokens} tokens (non-adjacent block ids), pull{scope}")


def _shape(spec: EngineSpec) -> str:
    """``TP8 PP2 DCP2 BLHNC``: how an engine is sharded (``kvplan.cp.parallel_label``) and laid
    out (the title's words)."""
    return f"{parallel_label(spec)} {layouts(spec)}"


#: The legend's entry for explain's offsets column.
OFFSETS = LegendEntry("offsets +a -> +b", "where the first run starts, in bytes from the block's "
                      "start, in the source block (+a) and in the destination block (+b)",
                      r"\+\d+ -> \+\d+")
_COLUMNS = ("from", "regions", "placement", "streams", "offsets", "bytes", "runs")


def _cell(row: dict[str, Any], col: str) -> str:
    v = row[col]
    if col == "from":
        return f"p{v}"
    if col == "bytes":
        return human_bytes(v)
    return str(v)


def _rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**row, "offsets": "" if row["src_offset"] is None else
             f"+{row['src_offset']} -> +{row['dst_offset']}"} for row in r["rows"]]


def _records(r: dict[str, Any], width: int) -> list[str]:
    """A rank's rows one block each, wrapped between words at ``width``: what a terminal too
    narrow for the table gets (no cell is ever cut inside a word)."""
    out = []
    for row in _rows(r):
        text = (f"{_cell(row, 'from')}  {row['regions']}: {_cell(row, 'bytes')} in "
                f"{row['runs']} runs; placement {row['placement']}; streams {row['streams']}"
                + (f"; offsets {row['offsets']}" if row["offsets"] else ""))
        out.append(wrap(text, width, "  ", "      "))
    return out


def _rank_title(r: dict[str, Any]) -> str:
    holds = f" ({r['holds']})" if r.get("holds") else ""
    return (f"d{r['rank']}{holds}: {human_bytes(r['nbytes'])} in {r['runs']} runs from "
            f"{', '.join(f'p{p}' for p in r['peers'])}")


def _widths(console, table, cells: list[list[str]], width: int) -> list[int] | None:
    """Column widths for ``table`` (whose columns are those of ``cells``, a header line and the
    rows of every rank) that fit ``width`` with cells wrapped between words only; None when even
    the longest words do not fit (the caller prints one block per row). Every rank's table
    gets these widths, so the tables of one output are one width."""
    from rich.measure import Measurement

    n = len(cells[0])
    longest = [max(len(line[i]) for line in cells) for i in range(n)]
    words = [longest[i] if col.no_wrap else  # a no_wrap cell is one word
             max(len(w) for line in cells for w in (line[i].split() or [""]))
             for i, col in enumerate(table.columns)]
    wide = console.options.update_width(1 << 16)  # measured unclamped: borders and padding
    extra = Measurement.get(console, wide, table).maximum - sum(longest)
    if sum(longest) + extra <= width:
        return longest
    if sum(words) + extra > width:
        return None
    sizes, spare = list(words), width - extra - sum(words)
    for i in sorted(range(n), key=lambda i: longest[i] - words[i]):  # narrowest needs first
        grow = min(spare, longest[i] - words[i])
        sizes[i] += grow
        spare -= grow
    return sizes


#: Trailing blanks of a line, with any terminal escapes among them (rich pads every line of a
#: table to its width, and styles the padding).
_TRAILING = re.compile(r"(?:[ \t]|\x1b\[[0-9;]*m)+$", re.M)
_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _emit(console, *objects: Any, **kw: Any) -> None:
    """``console.print(*objects, **kw)`` with no trailing spaces on any line (the escapes that
    end a style are kept)."""
    with console.capture() as cap:
        console.print(*objects, **kw)
    sys.stdout.write(_TRAILING.sub(lambda m: "".join(_ESCAPE.findall(m.group())), cap.get()))


def _print_text(doc: dict[str, Any], title: str) -> None:
    with recorded() as shown:
        _print_tables(doc, title)
    print_legend(shown.text, (OFFSETS,))


def _print_tables(doc: dict[str, Any], title: str) -> None:
    width = columns()
    console = _console()
    cells = [list(_COLUMNS)] + [[_cell(row, c) for c in _COLUMNS]
                                for r in doc["ranks"] for row in _rows(r)]
    if console is None:
        print(wrap(title, width))
        widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]
        fits = 2 + sum(widths) + 2 * (len(widths) - 1) <= width
        for r in doc["ranks"]:
            print(f"\n{_rank_title(r)}")
            if not fits:  # one layout for every rank: blocks everywhere
                print("\n".join(_records(r, width)))
                continue
            mine = [list(_COLUMNS)] + [[_cell(row, c) for c in _COLUMNS] for row in _rows(r)]
            for line in mine:
                print("  " + "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        for w in doc["warnings"]:
            print(wrap(f"warning: {w}", width))
        return
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    def table() -> Table:
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        for c in _COLUMNS:
            t.add_column(c, justify="right" if c in ("bytes", "runs") else "left",
                         no_wrap=c in ("from", "bytes", "runs"))
        return t

    probe = table()  # every rank's rows in one table, measured
    for line in cells[1:]:
        probe.add_row(*map(escape, line))
    sizes = _widths(console, probe, cells, width)
    _emit(console, escape(wrap(title, width)), style="bold", soft_wrap=True)
    for r in doc["ranks"]:
        _emit(console, f"\n{escape(_rank_title(r))}", soft_wrap=True)
        if sizes is None:  # too narrow for the table: one block per row
            _emit(console, escape("\n".join(_records(r, width))), soft_wrap=True)
            continue
        t = table()
        for col, size in zip(t.columns, sizes):
            col.width = size
        for row in _rows(r):
            t.add_row(*(escape(_cell(row, c)) for c in _COLUMNS))
        _emit(console, t)
    for w in doc["warnings"]:
        _emit(console, escape(wrap(f"warning: {w}", width)), style="yellow", soft_wrap=True)


def cmd_explain(args: argparse.Namespace) -> int:
    """``kvplan explain``: per destination rank, what it reads from which source rank."""
    try:
        need = max(_blocks_needed(args.tokens, args.block_size),
                   _blocks_needed(args.tokens, _opt(args, "prefill_block_size", args.block_size)),
                   _blocks_needed(args.tokens, _opt(args, "decode_block_size", args.block_size)))
        src = _engine(args.prefill, args.prefill_tp, args, "prefill", need)
        dst = _engine(args.decode, args.decode_tp, args, "decode", need)
        if args.rank is not None and not 0 <= args.rank < dst.num_ranks:
            raise _Usage(f"--rank {args.rank} is not a decode rank (0..{dst.num_ranks - 1})")
        from kvplan.cli.progress import step

        doc = explain(src, dst, args.tokens, None if args.rank is None else [args.rank],
                      progress=step, cached=args.cached, part=args.part)
    except (_Usage, kvplan.RequestError) as exc:
        print(f"kvplan: {exc}", file=sys.stderr)
        return 2
    except kvplan.IncompatibleLayoutError as exc:
        return _refused(args, exc)
    doc["source"]["model"], doc["destination"]["model"] = args.prefill, args.decode
    compare = args.compare_layouts
    if compare is None:
        compare = args.tokens <= COMPARE_LAYOUTS_TOKENS
    shown = 0 if args.rank is None else args.rank  # one decode rank: ranks are alike
    if compare:
        with step(f"counting runs per layout on decode rank {shown}") as update:
            doc["runs_by_layout"] = runs_by_layout(src, dst, args.tokens, [shown],
                                                   cached=args.cached, part=args.part,
                                                   progress=update)
            doc["runs_by_layout_rank"] = shown
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    _print_text(doc, _title(args, src, dst))
    if compare:
        text = (f"runs per request on decode rank {shown} with one layout on both sides: "
                + ", ".join(f"{k} {v:,}" for k, v in doc["runs_by_layout"].items()))
    else:
        text = (f"(runs per layout are compared up to {COMPARE_LAYOUTS_TOKENS} tokens; "
                "pass --compare-layouts to count them for this request)")
    print("\n" + wrap(text, columns()))
    return 0


def _refused(args, exc: Exception) -> int:
    if getattr(args, "json", False):
        print(json.dumps({"compatible": False, "error": type(exc).__name__, "message": str(exc)},
                         indent=2))
    else:
        print(f"kvplan: refused: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1


def cmd_check(args: argparse.Namespace) -> int:
    """``kvplan check A.json B.json``: 0 when the two specs can talk, 1 with the refusal."""
    specs = []
    try:
        for path in (args.source, args.destination):
            data = _load_json(Path(path))
            if not isinstance(data, dict) or "regions" not in data:
                raise _Usage(f"{path!r} is not an engine spec (no 'regions'); make one with "
                             "`kvplan spec MODEL --tp N`")
            try:
                specs.append(EngineSpec.from_dict(data))
            except kvplan.SpecError as exc:
                return _refused(args, kvplan.SpecError(f"{path}: {exc}"))
        src, dst = specs
        pairs = region_pairs(src, dst)
    except _Usage as exc:
        print(f"kvplan: {exc}", file=sys.stderr)
        return 2
    except kvplan.IncompatibleLayoutError as exc:
        return _refused(args, exc)
    doc = {
        "compatible": True,
        "source": {**parallel_fields(src), "regions": len(src.regions),
                   "groups": src.num_groups},
        "destination": {**parallel_fields(dst), "regions": len(dst.regions),
                        "groups": dst.num_groups},
        "region_pairs": len(pairs),
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"compatible: source {parallel_label(src)} ({len(src.regions)} regions) -> "
              f"destination {parallel_label(dst)} ({len(dst.regions)} regions), {len(pairs)} "
              "region pairs")
    return 0


def cmd_spec(args: argparse.Namespace) -> int:
    """``kvplan spec MODEL --tp N``: print the engine-spec JSON."""
    try:
        spec = _engine(args.model, args.tp, args, "model")
    except _Usage as exc:
        print(f"kvplan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(spec.to_dict(), indent=2 if args.indent else None))
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    """``kvplan presets``: each preset with its checkpoint, family and cache layers."""
    from kvplan.hf import describe

    rows = []
    for name in presets.names():
        cfg = presets.load(name)
        d = describe(cfg)
        rows.append({"name": name, "checkpoint": cfg.get("_name_or_path", ""), **d})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        kinds = [f"{n} {k}" for k, n in r["regions"].items()]
        if r["uncached_layers"]:  # e.g. Nemotron-H's MLP layers: the counts add up
            kinds.append(f"{r['uncached_layers']} without a cache")
        layers = ", ".join(kinds)
        print(f"{r['name']:<22} {r['family']:<12} {r['layers']:>3} layers: {layers}  "
              f"({r['checkpoint']})")
    return 0


# -- argparse ----------------------------------------------------------------------------------


def _model_options(p: argparse.ArgumentParser, where: str = "on both sides") -> None:
    """The options that build an engine from a model; ``where`` says which engines they set
    (explain: both sides; spec: its one engine)."""
    p.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), default=16,
                   help="tokens per block")
    p.add_argument("--num-blocks", type=int_in(1, MAX_BLOCKS), default=None,
                   help="blocks per region (default: enough for the request, at least 1024)")
    p.add_argument("--dtype", default=None, choices=sorted(kvplan.DTYPE_SIZES), metavar="DTYPE",
                   help="KV-cache dtype (default: the config's torch_dtype; needed when the "
                        "config has none)")
    p.add_argument("--layout", type=layout_arg, default="HND",
                   help=f"layout {where}: HND, NHD (with --kv), vLLM's LBHNC, BLHNC... "
                        "or any order of LBSHND")
    p.add_argument("--kv", choices=["split", "joint"], default="split",
                   help="K and V in two tensors (split) or one (joint)")
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help="add an Eagle-3 draft's layers: preset or config.json")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``explain``, ``check``, ``spec`` and ``presets`` to the ``kvplan`` command."""
    tp, pp = int_in(1, MAX_TP), int_in(1, MAX_TP)
    text = "per destination rank, what it reads from which source rank, and what it costs"
    p = sub.add_parser("explain", help=text, description=text)
    p.set_defaults(fn=cmd_explain)
    p.add_argument("--prefill", required=True, metavar="MODEL",
                   help="preset, HF config.json (or its directory), or engine-spec JSON")
    p.add_argument("--decode", required=True, metavar="MODEL", help="as --prefill")
    p.add_argument("--prefill-tp", type=tp, default=None,
                   help="tensor-parallel ranks of prefill (needed unless MODEL is a spec)")
    p.add_argument("--decode-tp", type=tp, default=None,
                   help="tensor-parallel ranks of decode (needed unless MODEL is a spec)")
    p.add_argument("--prefill-pp", type=pp, default=1, help="pipeline stages of prefill")
    p.add_argument("--decode-pp", type=pp, default=1, help="pipeline stages of decode")
    context_options(p, "prefill")
    context_options(p, "decode")
    p.add_argument("--prefill-block-size", type=int_in(1, MAX_BLOCK_SIZE), default=None,
                   help="tokens per block on prefill (default: --block-size)")
    p.add_argument("--decode-block-size", type=int_in(1, MAX_BLOCK_SIZE), default=None,
                   help="tokens per block on decode (default: --block-size)")
    p.add_argument("--prefill-layout", type=layout_arg, default=None,
                   help="layout on prefill (default: --layout)")
    p.add_argument("--decode-layout", type=layout_arg, default=None,
                   help="layout on decode (default: --layout)")
    p.add_argument("--rank", type=int_in(0, MAX_TP * MAX_TP), default=None,
                   help="only this decode rank (default: every decode rank)")
    p.add_argument("--tokens", type=int_in(1, MAX_TOKENS), default=2048,
                   help="request length in tokens")
    p.add_argument("--cached", type=int_in(0, MAX_TOKENS), default=None, metavar="N",
                   help="positions the decode engine already holds (prefix-cache hit): copy "
                        "exactly positions N..tokens (default: none)")
    p.add_argument("--part", action="append", default=None, metavar="REGION",
                   help="show only this region's part of each plan (repeat for several)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--compare-layouts", action=argparse.BooleanOptionalAction, default=None,
                   help="count runs per request for HND and each of vLLM's six orders (default: "
                        f"on up to {COMPARE_LAYOUTS_TOKENS} tokens)")
    _model_options(p)

    text = "validate two engine-spec JSON files; exit 1 with the refusal if they cannot talk"
    p = sub.add_parser("check", help=text, description=text)
    p.set_defaults(fn=cmd_check)
    p.add_argument("source", metavar="A.json", help="prefill (source) engine spec")
    p.add_argument("destination", metavar="B.json", help="decode (destination) engine spec")
    p.add_argument("--json", action="store_true", help="print one JSON document")

    text = "print the engine-spec JSON of a model on one engine"
    p = sub.add_parser("spec", help=text, description=text)
    p.set_defaults(fn=cmd_spec)
    p.add_argument("model", metavar="MODEL", help="preset or HF config.json (or its directory)")
    p.add_argument("--tp", type=tp, required=True, help="tensor-parallel ranks")
    p.add_argument("--pp", dest="model_pp", type=pp, default=1, help="pipeline stages")
    context_options(p, None)
    p.add_argument("--indent", action="store_true", help="pretty-print")
    _model_options(p, "of the engine")

    text = "list the packaged model presets"
    p = sub.add_parser("presets", help=text, description=text)
    p.set_defaults(fn=cmd_presets)
    p.add_argument("--json", action="store_true", help="print one JSON document")
