"""What the ``kvplan`` command's parts share: argument types with bounds, the help format,
one-line usage errors, and the legend printed under plans.

Other modules add options to the command with these (``type=int_in(1, MAX_TP)``), so that a
user's value is either used or refused in one ``kvplan: ...`` line, never replaced by a default.

Layer: the CLI (top of the core); imports kvplan.spec's limits only.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import kvplan.spec as spec_limits

__all__ = [
    "LEGEND",
    "LEGEND_ENTRIES",
    "MAX_BLOCKS",
    "MAX_BLOCK_SIZE",
    "MAX_TOKENS",
    "MAX_TP",
    "HelpFormatter",
    "Parser",
    "UsageError",
    "columns",
    "fitted",
    "int_in",
    "legend",
    "wrap",
]

#: Bounds of the command line's integers (a larger value is a usage error, exit 2). 2**21 tokens
#: is longer than any preset's context; explain's memory grows with one layer's runs of one
#: request, so the bound also bounds its memory.
MAX_TOKENS = 1 << 21
MAX_TP = spec_limits.MAX_TP_SIZE  # TP and PP sizes: the spec's own limits (both 256)
MAX_BLOCKS = 1 << 31  # blocks or slots per region
MAX_BLOCK_SIZE = spec_limits.MAX_BLOCK_SIZE  # tokens per block

#: What the outputs' notation means: (term, meaning), printed under ``explain``, ``plan`` and
#: ``demo`` output by :func:`legend`, wrapped to the terminal.
LEGEND_ENTRIES = (
    ("p0, d1", "prefill rank 0, decode rank 1 (flat ranks: PP stage x TP size + TP rank)"),
    ("S(heads a:b)", "SPLIT placement: the pair copies KV heads a..b-1"),
    ("R", "REPLICATE: the whole block (every rank holds it: MLA, indexer)"),
    ("S(x a:b, B c:d, ...)", "slices of a recurrent state's parts x, B, ... (units a..b-1)"),
    ("TP8 PP2 DCP2", "tensor-, pipeline- and decode-context-parallel sizes: under DCP n, each "
                     "rank of a DCP group holds every n-th token slice of a block's positions"),
    ("HND, NHD, BLHNC", "a cache layout: the order of the axes of a region's (or an "
                        "allocation's) buffer, outermost first (docs/concepts.md)"),
    ("K+V", "key and value streams; K = one stream (a latent)"),
    ("run", "one contiguous byte copy (one NIXL descriptor)"),
    ("group", "KV-cache group (layers sharing one block table)"),
    ("layers.[0-79].attn x80", "80 alike layers on one line"),
    ("B, KiB, MiB, GiB", "bytes, and 2^10, 2^20, 2^30 bytes; GB/s = 10^9 bytes per second"),
    ("d0 (heads 0:4, replica 2/4, DCP slice 1/2)", "what a rank holds of a sharded engine: KV "
     "heads 0..3, the second of 4 ranks holding them, the first of 2 DCP token slices"),
)


def columns() -> int:
    """Columns the output should fit: ``COLUMNS`` if set, else the terminal's; a pipe or a file
    gets 160 (long enough for the tables, short enough to read)."""
    import os
    import shutil
    import sys

    cols = os.environ.get("COLUMNS", "")
    if cols.isdigit() and int(cols) > 0:
        return int(cols)
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else 160


def wrap(text: str, width: int, first: str = "", rest: str = "  ") -> str:
    """``text`` wrapped at ``width`` between words only (a word longer than a line stays whole),
    the first line indented by ``first``, the others by ``rest``."""
    import textwrap

    return textwrap.fill(text, max(width, 30), initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False)


def fitted(text: str) -> str:
    """``text`` with each line wrapped to the terminal (:func:`columns`) between words,
    continuation lines indented under their line (a summary's long state placements)."""
    width = columns()
    return "\n".join(wrap(line, width, "", " " * (len(line) - len(line.lstrip()) + 4))
                     if len(line) > width else line for line in text.splitlines())


def legend(width: int = 96, extra: tuple[tuple[str, str], ...] = ()) -> str:
    """The legend, one ``term = meaning`` per line, each wrapped between words at ``width``
    with a hanging indent (so a narrow terminal never cuts a word or mixes entries)."""
    lines = ["legend:"]
    for term, meaning in (*extra, *LEGEND_ENTRIES):
        lines.append(wrap(f"{term} = {meaning}", width, "  ", "      "))
    return "\n".join(lines)


#: The legend at 96 columns (as docs/concepts.md shows it).
LEGEND = legend()


class UsageError(Exception):
    """A command-line mistake: printed as one ``kvplan: ...`` line, exit status 2."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse help that states every option's default (unless it is None or a flag's False);
    descriptions keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.help is argparse.SUPPRESS or "%(default)" in text or not action.option_strings
                or action.default in (None, False, argparse.SUPPRESS)):
            return action.help
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        return getattr(action.type, "metavar", None) or super()._get_default_metavar_for_optional(
            action)


class Parser(argparse.ArgumentParser):
    """argparse with one ``kvplan: ...`` line for a usage mistake (exit 2), not usage + error;
    subcommand parsers inherit it (argparse makes them of the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"kvplan: {message} (see '{self.prog} --help')\n")


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[lo, hi]``, else a usage error naming the range
    (a user's 0 is refused, never replaced by a default)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {value}")
        return value

    parse.__name__ = f"integer in [{lo}, {hi}]"
    parse.metavar = "N"  # type: ignore[attr-defined]  # read by HelpFormatter
    return parse
