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
merging: real allocators rarely hand out neighbours.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

import kvplan
from kvplan import EngineSpec, presets
from kvplan.compat import region_pairs
from kvplan.views import human_bytes, peer_rows

#: Above this many runs per request on one rank, explain warns that descriptors dominate.
MANY_RUNS = 10_000


class _Usage(Exception):
    """A command-line mistake: printed as ``kvplan: ...``, exit status 2."""


def layout_arg(value: str) -> str:
    """An argparse type: ``HND``, ``NHD``, vLLM's ``BLHNC``..., or any order of ``LBSHND``."""
    try:
        kvplan.spec.layout_order(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


#: The layouts ``explain`` compares: today's per-layer HND split and vLLM's six orders.
COMPARED_LAYOUTS = ("HND", *kvplan.spec.VLLM_ORDERS)


def runs_by_layout(src: EngineSpec, dst: EngineSpec, tokens: int,
                   ranks: Sequence[int] | None = None) -> dict[str, int]:
    """Runs (NIXL descriptors) per request on ``ranks`` with each of :data:`COMPARED_LAYOUTS`
    on both sides (``EngineSpec.with_layout``: an order packs a group's layers in one buffer)."""
    ranks = list(range(dst.num_ranks)) if ranks is None else list(ranks)
    src_blocks, dst_blocks = request(src, tokens), request(dst, tokens)
    out = {}
    for name in COMPARED_LAYOUTS:
        s, d = src.with_layout(name), dst.with_layout(name)
        out[name] = sum(len(kvplan.pull_map(s, d, r).plan(src_blocks, dst_blocks))
                        for r in ranks)
    return out


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise _Usage(f"cannot read {str(path)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise _Usage(f"{str(path)!r} is not JSON: {exc}") from None


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
    if kind == "spec":
        spec = EngineSpec.from_dict(data)
        if tp is not None and tp != spec.tp_size:
            raise _Usage(f"--{side}-tp {tp} but {arg!r} is a spec of tp_size {spec.tp_size}")
        return spec
    if tp is None:
        raise _Usage(f"--{side}-tp is needed for the model {arg!r}")
    own = getattr(args, f"{side}_layout", None)
    return EngineSpec.from_hf_config(
        data,
        tp_size=tp,
        pp_size=getattr(args, f"{side}_pp", 1) or 1,
        block_size=getattr(args, f"{side}_block_size", None) or args.block_size,
        num_blocks=args.num_blocks or max(1024, min_blocks),
        dtype=args.dtype,
        layout=own or args.layout,
        kv=args.kv,
        draft=_draft(args.draft),
    )


def _blocks_needed(tokens: int, block_size: int) -> int:
    return 2 * -(-tokens // block_size) + 1  # room for non-adjacent ids


def request(spec: EngineSpec, tokens: int) -> list[list[int]]:
    """Block ids of one request of ``tokens`` tokens: per token group non-adjacent ids
    ``0, 2, 4, ...`` (consecutive when the regions are too small); per state group one slot,
    counted down from the last block so that views of a shared pool use distinct pages."""
    out = []
    states = 0
    for g in range(spec.num_groups):
        regions = [r for r in spec.regions if r.group == g]
        if regions[0].is_state:
            states += 1
            out.append([max(0, min(r.num_blocks for r in regions) - states)])
            continue
        need = -(-tokens // max(r.block_size for r in regions))
        limit = min(r.num_blocks for r in regions)
        if need > limit:
            raise _Usage(f"{tokens} tokens need {need} blocks in group {g}, but its regions hold "
                         f"{limit}; lower --tokens or raise --num-blocks")
        step = 2 if 2 * need - 1 <= limit else 1
        out.append(list(range(0, step * need, step)))
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


def explain(src: EngineSpec, dst: EngineSpec, tokens: int,
            ranks: Sequence[int] | None = None) -> dict[str, Any]:
    """The explanation as a JSON-able dict: per destination rank its rows, and warnings.

    Raises :class:`kvplan.IncompatibleLayoutError` when the two engines cannot talk.
    """
    ranks = list(range(dst.num_ranks)) if ranks is None else list(ranks)
    src_blocks, dst_blocks = request(src, tokens), request(dst, tokens)
    out_ranks = []
    plans = []
    for d in ranks:
        plan = kvplan.pull_map(src, dst, d).plan(src_blocks, dst_blocks)
        plans.append(plan)
        rows = []
        for peer, peer_list in peer_rows(plan).items():
            for row in peer_list:
                first = row["first_run"] or (None, None)
                rows.append({
                    "from": peer, "regions": row["regions"], "region_names": row["region_names"],
                    "placement": row["placement"], "streams": row["streams"],
                    "src_offset": first[0], "dst_offset": first[1],
                    "bytes": row["bytes"], "runs": row["runs"],
                })
        out_ranks.append({"rank": d, "peers": list(plan.peers), "nbytes": plan.nbytes,
                          "runs": len(plan), "rows": rows})
    warnings = _warnings(src, dst, src_blocks, dst_blocks, ranks, plans)
    return {
        "source": {"tp_size": src.tp_size, "pp_size": src.pp_size, "regions": len(src.regions)},
        "destination": {"tp_size": dst.tp_size, "pp_size": dst.pp_size,
                        "regions": len(dst.regions)},
        "tokens": tokens,
        "blocks": {"source": [len(b) for b in src_blocks],
                   "destination": [len(b) for b in dst_blocks]},
        "ranks": out_ranks,
        "warnings": warnings,
    }


def _warnings(src, dst, src_blocks, dst_blocks, ranks, plans) -> list[str]:
    out = []
    runs = sum(len(p) for p in plans)
    if _has_nhd(src) or _has_nhd(dst):
        s2, d2 = _with_layout(src, "HND"), _with_layout(dst, "HND")
        hnd = sum(len(kvplan.pull_map(s2, d2, d).plan(src_blocks, dst_blocks)) for d in ranks)
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
    for d, p in zip(ranks, plans):
        if len(p) > MANY_RUNS:
            out.append(f"d{d}: {len(p)} runs per request ({human_bytes(p.nbytes / len(p))} on "
                       "average): descriptor count dominates the transfer's cost")
    return out


# -- printing ----------------------------------------------------------------------------------


def _console():
    try:
        from rich.console import Console
    except ImportError:
        return None
    # a terminal decides its width; a pipe or file gets lines long enough for the tables
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _title(args, src: EngineSpec, dst: EngineSpec) -> str:
    return (f"prefill {args.prefill} TP{src.tp_size} -> decode {args.decode} TP{dst.tp_size}: "
            f"one request of {args.tokens} tokens (non-adjacent block ids), pull")


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


def _print_text(doc: dict[str, Any], title: str) -> None:
    console = _console()
    if console is None:
        print(title)
        for r in doc["ranks"]:
            print(f"\nd{r['rank']}: {human_bytes(r['nbytes'])} in {r['runs']} runs from "
                  f"{', '.join(f'p{p}' for p in r['peers'])}")
            table = [list(_COLUMNS)] + [[_cell(row, c) for c in _COLUMNS] for row in _rows(r)]
            widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
            for line in table:
                print("  " + "  ".join(c.ljust(w) for c, w in zip(line, widths)))
        for w in doc["warnings"]:
            print(f"warning: {w}")
        return
    from rich.table import Table

    console.print(f"[bold]{title}[/bold]")
    console.print("offsets: the first run's byte offset inside the source block and inside the "
                  "destination block")
    for r in doc["ranks"]:
        table = Table(
            title=f"d{r['rank']}: {human_bytes(r['nbytes'])} in {r['runs']} runs from "
                  f"{', '.join(f'p{p}' for p in r['peers'])}",
            title_justify="left",
        )
        for c in _COLUMNS:
            table.add_column(c, justify="right" if c in ("bytes", "runs") else "left",
                             no_wrap=c in ("from", "regions", "bytes", "runs"),
                             overflow="fold")
        for row in _rows(r):
            table.add_row(*(_cell(row, c) for c in _COLUMNS))
        console.print(table)
    for w in doc["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w}")


def cmd_explain(args: argparse.Namespace) -> int:
    """``kvplan explain``: per destination rank, what it reads from which source rank."""
    try:
        need = max(_blocks_needed(args.tokens, args.block_size),
                   _blocks_needed(args.tokens, args.prefill_block_size or args.block_size),
                   _blocks_needed(args.tokens, args.decode_block_size or args.block_size))
        src = _engine(args.prefill, args.prefill_tp, args, "prefill", need)
        dst = _engine(args.decode, args.decode_tp, args, "decode", need)
        if args.rank is not None and not 0 <= args.rank < dst.num_ranks:
            raise _Usage(f"--rank {args.rank} is not a decode rank (0..{dst.num_ranks - 1})")
        doc = explain(src, dst, args.tokens, None if args.rank is None else [args.rank])
    except _Usage as exc:
        print(f"kvplan: {exc}", file=sys.stderr)
        return 2
    except kvplan.IncompatibleLayoutError as exc:
        return _refused(args, exc)
    doc["source"]["model"], doc["destination"]["model"] = args.prefill, args.decode
    doc["runs_by_layout"] = runs_by_layout(src, dst, args.tokens,
                                           None if args.rank is None else [args.rank])
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_text(doc, _title(args, src, dst))
        print("\nruns per request with one layout on both sides (decode ranks shown): "
              + ", ".join(f"{k} {v:,}" for k, v in doc["runs_by_layout"].items()))
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
        "source": {"tp_size": src.tp_size, "pp_size": src.pp_size, "regions": len(src.regions),
                   "groups": src.num_groups},
        "destination": {"tp_size": dst.tp_size, "pp_size": dst.pp_size,
                        "regions": len(dst.regions), "groups": dst.num_groups},
        "region_pairs": len(pairs),
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"compatible: source TP{src.tp_size} ({len(src.regions)} regions) -> destination "
              f"TP{dst.tp_size} ({len(dst.regions)} regions), {len(pairs)} region pairs")
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
        layers = ", ".join(f"{n} {k}" for k, n in r["regions"].items())
        print(f"{r['name']:<22} {r['family']:<12} {r['layers']:>3} layers: {layers}  "
              f"({r['checkpoint']})")
    return 0


# -- argparse ----------------------------------------------------------------------------------


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="blocks per region (default: enough for the request)")
    p.add_argument("--dtype", default=None, help="KV dtype (default: the config's torch_dtype)")
    p.add_argument("--layout", type=layout_arg, default="HND",
                   help="layout on both sides: HND, NHD (with --kv), vLLM's LBHNC, BLHNC... "
                        "or any order of LBSHND (default HND)")
    p.add_argument("--kv", choices=["split", "joint"], default="split")
    p.add_argument("--draft", default=None, help="an Eagle-3 draft: preset or config.json")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``explain``, ``check``, ``spec`` and ``presets`` to the ``kvplan`` command."""
    text = "per destination rank, what it reads from which source rank, and what it costs"
    p = sub.add_parser("explain", help=text, description=text)
    p.set_defaults(fn=cmd_explain)
    p.add_argument("--prefill", required=True, metavar="MODEL",
                   help="preset, HF config.json (or its directory), or engine-spec JSON")
    p.add_argument("--decode", required=True, metavar="MODEL")
    p.add_argument("--prefill-tp", type=int, default=None)
    p.add_argument("--decode-tp", type=int, default=None)
    p.add_argument("--prefill-pp", type=int, default=1)
    p.add_argument("--decode-pp", type=int, default=1)
    p.add_argument("--prefill-block-size", type=int, default=None)
    p.add_argument("--decode-block-size", type=int, default=None)
    p.add_argument("--prefill-layout", type=layout_arg, default=None)
    p.add_argument("--decode-layout", type=layout_arg, default=None)
    p.add_argument("--rank", type=int, default=None, help="only this decode rank")
    p.add_argument("--tokens", type=int, default=2048, help="request length (default 2048)")
    p.add_argument("--json", action="store_true", help="one JSON document")
    _model_options(p)

    text = "validate two engine-spec JSON files; exit 1 with the refusal if they cannot talk"
    p = sub.add_parser("check", help=text, description=text)
    p.set_defaults(fn=cmd_check)
    p.add_argument("source", metavar="A.json", help="prefill (source) engine spec")
    p.add_argument("destination", metavar="B.json", help="decode (destination) engine spec")
    p.add_argument("--json", action="store_true")

    text = "print the engine-spec JSON of a model on one engine"
    p = sub.add_parser("spec", help=text, description=text)
    p.set_defaults(fn=cmd_spec)
    p.add_argument("model", metavar="MODEL", help="preset or HF config.json")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", dest="model_pp", type=int, default=1)
    p.add_argument("--indent", action="store_true", help="pretty-print")
    _model_options(p)

    text = "list the packaged model presets"
    p = sub.add_parser("presets", help=text, description=text)
    p.set_defaults(fn=cmd_presets)
    p.add_argument("--json", action="store_true")
