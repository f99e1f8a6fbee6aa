"""The ``kvplan`` command: the offline commands, and the door through which NIXL adds its own.

Layer: the top of the core (``kvplan.cli``). It may import any ``kvplan`` module and rich
(optional); it never imports nixl, torch or ``kvplan_nixl`` at module level. ``plan`` prints
the plans of one request of a built-in example or a preset; ``explain``, ``check``, ``spec`` and
``presets`` live in :mod:`kvplan.cli.explain`. Commands that move bytes belong to the NIXL
package: :func:`_plugins` is the one place the core reaches for it (``kvplan_nixl.cli``, inside
``try/except ImportError``), and without it ``kvplan demo`` prints one line naming the extra to
install (tests/test_structure.py checks this is the only such import).

Errors: :func:`main` prints one ``kvplan: ...`` line and returns the exit status (EPILOG);
options are typed with bounds (:mod:`kvplan.cli.cliargs`), so a user's value is used or
refused, never replaced by a default.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import numpy as np

import kvplan
from kvplan import EngineSpec, TransferPlan, presets
from kvplan.cli.cliargs import (
    LEGEND,
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_TOKENS,
    MAX_TP,
    HelpFormatter,
    Parser,
    UsageError,
    int_in,
)
from kvplan.cli.explain import layout_arg as explain_layout
from kvplan.cli.progress import step
from kvplan.examples import EXAMPLES, request_blocks

#: The commands the NIXL package adds (``kvplan_nixl.cli.register``), named here so that
#: ``kvplan demo`` without it says what to install instead of "invalid choice".
NIXL_COMMANDS = ("demo",)
NIXL_HINT = ('moves bytes over NIXL, which is not installed: pip install "kvplan[nixl]" '
             '(in a checkout: pip install -e ".[nixl]"; README.md: install torch first)')


def _preset_spec(args: argparse.Namespace, tp: int, pp: int, block_size: int | None) -> EngineSpec:
    """A packaged model preset (``--example llama-3.1-70b``): the real model's cache."""
    if args.num_slots is not None:
        raise UsageError(f"--num-slots applies to the small examples, not to the preset "
                         f"{args.example!r} (its state regions have --num-blocks slots)")
    kwargs: dict = {"num_blocks": args.num_blocks, "pp_size": pp}
    for opt, value in (("block_size", block_size), ("layout", args.layout), ("kv", args.kv)):
        if value is not None:
            kwargs[opt] = value
    return presets.spec(args.example, tp, **kwargs)


def _spec(args: argparse.Namespace, tp: int, pp: int, block_size: int | None,
          side: str | None = None) -> EngineSpec:
    """The engine of ``--example`` on one side, re-laid out by ``--{side}-layout`` if given."""
    spec = _base_spec(args, tp, pp, block_size)
    own = getattr(args, f"{side}_layout", None) if side else None
    return spec if own is None else spec.with_layout(own, args.kv or "split")


def _base_spec(args: argparse.Namespace, tp: int, pp: int, block_size: int | None) -> EngineSpec:
    if args.example not in EXAMPLES:
        return _preset_spec(args, tp, pp, block_size)
    kwargs: dict = {"num_blocks": args.num_blocks}
    if block_size is not None:
        kwargs["block_size"] = block_size
    for opt in ("layout", "kv", "num_slots"):
        if getattr(args, opt) is not None:
            kwargs[opt] = getattr(args, opt)
    try:
        spec = EXAMPLES[args.example](tp, **kwargs)
    except TypeError as exc:
        raise UsageError(f"example {args.example!r} does not take that option: {exc}") from None
    if pp != 1:  # any example: its regions cut into pp contiguous stages
        spec = EngineSpec.from_dict({**spec.to_dict(), "pp_size": pp})
    return spec


def _request(args, src: EngineSpec, dst: EngineSpec) -> tuple[list, list]:
    """Random block ids on each side: ``--tokens`` positions per token group, ``--slots`` per
    state group, disjoint between the groups sharing a pool (kvplan.examples.request_blocks)."""
    rng = np.random.default_rng(args.seed)
    try:
        return tuple(request_blocks(s, args.tokens, slots=args.slots, seed=rng)
                     for s in (src, dst))
    except ValueError as exc:
        raise UsageError(f"{exc}; raise --num-blocks or lower --tokens / --slots") from None


def plans(args, src: EngineSpec, dst: EngineSpec) -> list[TransferPlan]:
    """One plan per initiating rank (each destination rank's pull, or each source's push)."""
    src_blocks, dst_blocks = _request(args, src, dst)
    if args.push:
        maps = [kvplan.push_map(src, dst, r) for r in range(src.num_ranks)]
    else:
        maps = [kvplan.pull_map(src, dst, r) for r in range(dst.num_ranks)]
    return [m.plan(src_blocks, dst_blocks) for m in maps]


def engines(args) -> tuple[EngineSpec, EngineSpec]:
    """The prefill and decode engines :func:`engine_options` describe."""
    return (
        _spec(args, args.prefill_tp, args.prefill_pp, args.prefill_block_size, "prefill"),
        _spec(args, args.decode_tp, args.decode_pp, args.decode_block_size, "decode"),
    )


def cmd_plan(args) -> int:
    src, dst = engines(args)
    with step("planning"):
        made = plans(args, src, dst)
    for plan in made:
        print(plan.summary())
    print(f"\n{LEGEND}")
    return 0


DESCRIPTION = """\
kvplan: plan KV-cache transfers between prefill and decode engines, and move them over NIXL.
Only demo needs NIXL (the nixl extra); the other commands are pure: no NIXL, no GPU, nothing
downloaded."""

EPILOG = """\
Run 'kvplan COMMAND --help' for a command's options and their defaults.
Exit status: 0 done; 1 refused (the engines cannot talk) or a demo byte mismatch;
2 bad input (one 'kvplan: ...' line on stderr); 3 internal error (a bug)."""

#: Choices of ``--example``: the small built-in examples, then every packaged preset.
EXAMPLE_CHOICES = (*sorted(EXAMPLES), *presets.names())


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvplan")
    except Exception:  # not installed (a plain checkout on PYTHONPATH)
        return kvplan.__version__


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvplan", description=DESCRIPTION, epilog=EPILOG,
               formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"kvplan {_version()}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", title="commands")
    text = "print the plans of one request of an example or preset (no NIXL)"
    s = sub.add_parser("plan", help=text, description=text, formatter_class=HelpFormatter)
    s.set_defaults(fn=cmd_plan)
    engine_options(s)
    from kvplan.cli import explain  # explain, check, spec, presets

    explain.register(sub)
    _plugins(sub)
    return p


def engine_options(s: argparse.ArgumentParser) -> None:
    """The options of ``plan`` (and of the NIXL package's ``demo``): which engines, which
    request; :func:`engines` and :func:`plans` read them."""
    tp, pp = int_in(1, MAX_TP), int_in(1, MAX_TP)
    s.add_argument("--example", choices=EXAMPLE_CHOICES, default="gqa-mla-draft",
                   metavar="NAME", help="a small built-in example (" + ", ".join(
                       sorted(EXAMPLES)) + ") or a model preset (kvplan presets)")
    s.add_argument("--prefill-tp", type=tp, default=4, help="tensor-parallel ranks of prefill")
    s.add_argument("--decode-tp", type=tp, default=2, help="tensor-parallel ranks of decode")
    s.add_argument("--prefill-pp", type=pp, default=1, help="pipeline stages of prefill")
    s.add_argument("--decode-pp", type=pp, default=1, help="pipeline stages of decode")
    s.add_argument("--push", action="store_true", help="prefill writes instead of decode reads")
    s.add_argument("--tokens", type=int_in(1, MAX_TOKENS), default=2048,
                   help="request length in tokens")
    s.add_argument("--slots", type=int_in(1, MAX_BLOCKS), default=1,
                   help="state slots per state group of the request (hybrids)")
    s.add_argument("--num-blocks", type=int_in(1, MAX_BLOCKS), default=256,
                   help="blocks per region")
    s.add_argument("--num-slots", type=int_in(1, MAX_BLOCKS), default=None,
                   help="state slots per state region (nemotron-h; default: the example's)")
    s.add_argument("--prefill-block-size", type=int_in(1, MAX_BLOCK_SIZE), default=None,
                   help="tokens per block on prefill (default: the example's)")
    s.add_argument("--decode-block-size", type=int_in(1, MAX_BLOCK_SIZE), default=None,
                   help="tokens per block on decode (default: the example's)")
    s.add_argument("--layout", choices=["HND", "NHD"], default=None,
                   help="attention layout on both sides (default: the example's, HND)")
    s.add_argument("--prefill-layout", type=explain_layout, default=None,
                   help="prefill's layout: HND, NHD, vLLM's BLHNC... or an order of LBSHND "
                        "(default: --layout)")
    s.add_argument("--decode-layout", type=explain_layout, default=None,
                   help="decode's layout (as --prefill-layout)")
    s.add_argument("--kv", choices=["split", "joint"], default=None,
                   help="K and V in two tensors or one (default: the example's, split)")
    s.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0,
                   help="seed of the random block ids and buffer bytes")


def _plugins(sub: argparse._SubParsersAction) -> None:
    """The plug-in hook: the NIXL package's commands, or a one-line hint in their place.

    ``kvplan_nixl.cli`` imports neither nixl nor torch until one of its commands runs, so
    registering costs nothing; where the package is absent, each command it would add says
    which extra to install (exit 2) instead of argparse's "invalid choice".
    """
    try:
        from kvplan_nixl.cli import register
    except ImportError:
        for name in NIXL_COMMANDS:
            s = sub.add_parser(name, help=f"(needs the nixl extra) {name}", add_help=False)
            s.add_argument("rest", nargs=argparse.REMAINDER)
            s.set_defaults(fn=_missing(name))
        return
    register(sub)


def _missing(name: str):
    def refuse(args: argparse.Namespace) -> int:
        raise UsageError(f"kvplan {name} {NIXL_HINT}")

    return refuse


def _broken_pipe() -> int:
    """The reader of stdout went away (``kvplan plan | head``): stop quietly, as Unix tools do."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail too
    except (OSError, ValueError):
        pass
    return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the broken pipe


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvplan`` command; returns the exit status (see EPILOG). Never raises, and
    prints at most one ``kvplan: ...`` line on stderr on failure, never a traceback."""
    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if not argv:  # bare `kvplan`: the help, not "required: COMMAND"
            parser.print_help()
            return 0
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version, or a usage error already printed
            return exc.code if isinstance(exc.code, int) else 2
        if getattr(args, "fn", None) is None:
            parser.print_help()
            return 0
        rc = args.fn(args)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        return _broken_pipe()
    except KeyboardInterrupt:
        print("kvplan: interrupted", file=sys.stderr)
        return 130
    except UsageError as exc:
        print(f"kvplan: {exc}", file=sys.stderr)
        return 2
    except kvplan.KVPlanError as exc:
        print(f"kvplan: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug: still one line; KVPLAN_TRACEBACK=1 shows where
        if os.environ.get("KVPLAN_TRACEBACK"):
            raise
        print(f"kvplan: internal error: {type(exc).__name__}: {exc} (please report it; "
              "KVPLAN_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
