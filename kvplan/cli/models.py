"""MODEL arguments of ``kvplan explain`` and ``kvplan spec``: a preset name, a Hugging Face
``config.json`` (or its directory) or an engine-spec JSON, turned into an :class:`EngineSpec`
with the options that build one (TP, PP, DCP/PCP, block size, layout, dtype, draft).

Where to look for how a command line becomes an engine; ``kvplan plan`` and ``demo`` use
:mod:`kvplan.cli.engines` (built-in examples), which takes the shared options from here.

Layer: the CLI (layer 7, top of the core); imports kvplan's public names and the CLI's argument
helpers (:mod:`kvplan.cli.cliargs`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import kvplan
from kvplan import EngineSpec, from_hf_config, presets
from kvplan.cli.cliargs import MAX_BLOCK_SIZE, MAX_BLOCKS, MAX_TP, UsageError, int_in

_Usage = UsageError


def layout_arg(value: str) -> str:
    """An argparse type: ``HND``, ``NHD``, vLLM's ``BLHNC``..., or any order of ``LBSHND``."""
    try:
        kvplan.spec.layout_order(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value



def load_json(path: Path) -> Any:
    """The JSON document in ``path``, or a one-line usage error saying why not."""
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


def opt(args: argparse.Namespace, name: str, default: Any) -> Any:
    """``args.name`` unless the user left it unset (None): a user's 0 is kept (and refused
    where it is invalid), never replaced by the default."""
    value = getattr(args, name, None)
    return default if value is None else value


def model(arg: str) -> tuple[str, Any]:
    """``("preset" | "hf" | "spec", config)`` for a preset name or a file."""
    if arg in presets.names():
        return "preset", presets.load(arg)
    path = Path(arg)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise _Usage(f"{arg!r} is neither a preset nor a file; presets: "
                     f"{', '.join(presets.names())}")
    data = load_json(path)
    if isinstance(data, dict) and "regions" in data:
        return "spec", data
    return "hf", data


def draft(arg: str | None) -> Any:
    """The config of ``--draft`` (a preset or a model config; not an engine spec), or None."""
    if arg is None:
        return None
    kind, data = model(arg)
    if kind == "spec":
        raise _Usage(f"--draft {arg!r} is an engine spec; give a model config or preset")
    return data


def engine(arg: str, tp: int | None, args: argparse.Namespace, side: str,
            min_blocks: int = 0) -> EngineSpec:
    """The engine spec ``arg`` names on one ``side`` (``prefill``, ``decode``, or ``model`` for
    ``kvplan spec``), built with that side's options; an engine-spec JSON is taken as is and
    must agree with the options given. ``min_blocks``: blocks the request needs."""
    kind, data = model(arg)
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
    return from_hf_config(
        data,
        tp_size=tp,
        pp_size=opt(args, f"{side}_pp", 1),
        block_size=opt(args, f"{side}_block_size", args.block_size),
        num_blocks=opt(args, "num_blocks", max(1024, min_blocks)),
        dtype=args.dtype,
        layout=opt(args, f"{side}_layout", args.layout),
        kv=args.kv,
        draft=draft(args.draft),
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



def model_options(p: argparse.ArgumentParser, where: str = "on both sides") -> None:
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


