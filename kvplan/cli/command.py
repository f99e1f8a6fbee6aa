"""The ``kvplan`` command: the offline commands, and the door through which other packages add
theirs.

Layer 7: the top of the core (``kvplan.cli``). It may import any ``kvplan`` module and rich
(optional); it never imports nixl, torch or the executor. ``plan`` prints
the plans of one request of a built-in example or a preset; ``explain``, ``check``, ``spec`` and
``presets`` live in :mod:`kvplan.cli.explain`. Commands of other packages (the commands that
move bytes: ``demo`` of the NIXL executor; a third-party transport's) come in through the
packaging entry-point group :data:`COMMANDS_GROUP` (``kvplan.commands``, read with
``importlib.metadata.entry_points``): the core names no such package. Without one, ``kvplan
demo`` still prints one line naming the extra to install (:data:`EXTRA_COMMANDS`).

Errors: :func:`main` prints one ``kvplan: ...`` line and returns the exit status (EPILOG);
options are typed with bounds (:mod:`kvplan.cli.cliargs`), so a user's value is used or
refused, never replaced by a default.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

import kvplan
from kvplan.cli.cliargs import (
    HelpFormatter,
    Parser,
    UsageError,
    fitted,
    print_legend,
    recorded,
)
from kvplan.cli.engines import engine_options, engines, plans
from kvplan.cli.progress import step

#: The entry-point group through which other packages add ``kvplan`` commands. An entry
#: point's name is the command it adds and its object a ``register(sub)`` function that adds
#: that command to the subparsers ``sub`` (argparse's ``add_subparsers()`` result), e.g.
#: ``[project.entry-points."kvplan.commands"] NAME = "your_package.cli:register"``
#: (pyproject.toml adds ``demo`` so).
COMMANDS_GROUP = "kvplan.commands"
#: Commands that kvplan's own extras add through :data:`COMMANDS_GROUP`, and the extra each
#: needs: named here (a command name and an extra, not a package) so that ``kvplan demo``
#: without the extra says what to install instead of argparse's "invalid choice".
EXTRA_COMMANDS = {"demo": "nixl"}
EXTRA_HINT = ('moves bytes over NIXL, which is not installed: pip install "kvplan[{extra}]" '
              '(in a checkout: pip install -e ".[{extra}]", which also installs the entry point '
              'that adds the command; README.md: install torch first)')


def cmd_plan(args: argparse.Namespace) -> int:
    """``kvplan plan``: print every initiating rank's plan of one request (no NIXL)."""
    src, dst = engines(args)
    with step("planning"):
        made = plans(args, src, dst)
    with recorded() as shown:
        for plan in made:
            print(fitted(plan.summary()))
    print_legend(shown.text)
    return 0


DESCRIPTION = """\
kvplan: plan KV-cache transfers between prefill and decode engines, and move them over NIXL.
Only demo needs NIXL (the nixl extra); the other commands are pure: no NIXL, no GPU, nothing
downloaded."""

EPILOG = """\
Run 'kvplan COMMAND --help' for a command's options and their defaults.
Exit status: 0 done; 1 refused (the engines cannot talk) or a demo byte mismatch;
2 bad input (one 'kvplan: ...' line on stderr, followed by indented lines
where the error lists choices); 3 internal error (a bug)."""


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


def _plugins(sub: argparse._SubParsersAction) -> None:
    """The commands other packages add through :data:`COMMANDS_GROUP`, or a one-line hint in
    their place.

    A plug-in's ``register`` must not import heavy modules (nixl, torch) until its command
    runs: every ``kvplan`` call registers every plug-in. One that cannot be loaded (its package
    or a dependency is missing, or it raises) becomes a command that says so, so that a broken
    plug-in never breaks the offline commands; a command of :data:`EXTRA_COMMANDS` that nothing
    added says which extra to install (exit 2 either way).
    """
    added = set(sub.choices)
    for ep in entry_points(group=COMMANDS_GROUP):
        if ep.name in added:  # the same distribution seen twice on the path, or a clash
            continue
        try:
            register = ep.load()
            register(sub)
        except Exception as exc:
            extra = EXTRA_COMMANDS.get(ep.name)
            why = EXTRA_HINT.format(extra=extra) if extra else "is not available"
            _placeholder(sub, ep.name, f"{ep.name} {why} (its entry point {ep.value!r} "
                                       f"failed: {type(exc).__name__}: {exc})")
        added.add(ep.name)
    for name, extra in EXTRA_COMMANDS.items():
        if name not in added:
            _placeholder(sub, name, f"{name} {EXTRA_HINT.format(extra=extra)}")


def _placeholder(sub: argparse._SubParsersAction, name: str, message: str) -> None:
    """A command ``name`` that accepts any arguments and fails with ``message`` (exit 2)."""
    if name in sub.choices:  # a plug-in that failed halfway through registering
        return
    # no option is parsed (prefix_chars matches none): any argument reaches the message
    s = sub.add_parser(name, help="(not installed: kvplan NAME says what to install)",
                       add_help=False, prefix_chars="\0")
    s.add_argument("rest", nargs="*")

    def refuse(args: argparse.Namespace) -> int:
        raise UsageError(message)

    s.set_defaults(fn=refuse)


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
