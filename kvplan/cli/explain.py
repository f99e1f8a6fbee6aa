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
rich is not installed). This module holds the commands and their options; what they compute,
print and read lives beside it: :mod:`kvplan.cli.models` (MODEL -> engine spec),
:mod:`kvplan.cli.counting` (the request, runs counted, the JSON document) and
:mod:`kvplan.cli.tables` (the text output). Their public names are re-exported here, where
they were first defined.

Layer: the CLI (top of the core); imports kvplan's public names, views and the CLI's helpers,
never nixl, torch or the executor.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import kvplan
from kvplan import EngineSpec, presets
from kvplan.cli.cliargs import (
    LEGEND,  # noqa: F401  # re-exported: the legend explain prints at 96 columns
    MAX_BLOCK_SIZE,
    MAX_TOKENS,
    MAX_TP,
    UsageError,
    columns,
    int_in,
    wrap,
)
from kvplan.cli.counting import (  # noqa: F401  # re-exported: defined here before
    COMPARE_LAYOUTS_TOKENS,
    COMPARED_LAYOUTS,
    MANY_RUNS,
    Counted,
    count,
    explain,
    layouts,
    request,
    runs_by_layout,
)
from kvplan.cli.counting import blocks_needed as _blocks_needed
from kvplan.cli.models import (  # noqa: F401  # re-exported: defined here before
    context_options,
    context_sizes,
    layout_arg,
)
from kvplan.cli.models import engine as _engine
from kvplan.cli.models import load_json as _load_json
from kvplan.cli.models import model_options as _model_options
from kvplan.cli.models import opt as _opt
from kvplan.cli.tables import OFFSETS, print_text, title  # noqa: F401  # re-exported
from kvplan.compat import region_pairs
from kvplan.cp import parallel_fields, parallel_label

_Usage = UsageError  # the name this module used before


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
    print_text(doc, title(args, src, dst))
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
