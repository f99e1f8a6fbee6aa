"""What the ``kvplan`` command's parts share: argument types with bounds, the help format,
one-line usage errors, and the legend printed under plans.

Other modules add options to the command with these (``type=int_in(1, MAX_TP)``), so that a
user's value is either used or refused in one ``kvplan: ...`` line, never replaced by a default.

Layer: the CLI (top of the core); imports kvplan.spec's limits only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import kvplan.spec as spec_limits

__all__ = [
    "LEGEND",
    "LEGEND_ENTRIES",
    "MAX_BLOCKS",
    "MAX_BLOCK_SIZE",
    "MAX_TOKENS",
    "MAX_TP",
    "HelpFormatter",
    "LegendEntry",
    "Parser",
    "UsageError",
    "columns",
    "fitted",
    "int_in",
    "legend",
    "print_legend",
    "recorded",
    "terminal_columns",
    "wrap",
]

#: Bounds of the command line's integers (a larger value is a usage error, exit 2). 2**21 tokens
#: is longer than any preset's context; explain's memory grows with one layer's runs of one
#: request, so the bound also bounds its memory.
MAX_TOKENS = 1 << 21
MAX_TP = spec_limits.MAX_TP_SIZE  # TP and PP sizes: the spec's own limits (both 256)
MAX_BLOCKS = 1 << 31  # blocks or slots per region
MAX_BLOCK_SIZE = spec_limits.MAX_BLOCK_SIZE  # tokens per block

class LegendEntry(NamedTuple):
    """One ``term = meaning`` line of the legend, and how to tell that an output uses it."""

    term: str
    meaning: str
    #: A regular expression matching the notation where an output uses it (``S\(heads `` for
    #: ``S(heads a:b)``): the legend under an output lists only the entries it matches.
    pattern: str

    def used_in(self, text: str) -> bool:
        """Whether ``text`` (an output, plain: no terminal escapes) uses this notation; runs of
        whitespace count as one space (a table cell wrapped ``S(heads`` / ``0:1)`` still
        uses ``S(heads a:b)``)."""
        return re.search(self.pattern, " ".join(text.split())) is not None


#: What the outputs' notation means, printed under ``explain``, ``plan`` and ``demo`` output by
#: :func:`legend`: only the entries the output above uses (a plain GQA model's plan gets no
#: DCP or state notation), each wrapped to the terminal.
LEGEND_ENTRIES = (
    LegendEntry("p0, d1", "prefill rank 0, decode rank 1 (flat ranks: PP stage x TP size + TP "
                "rank)", r"\b[pd]\d+\b"),
    LegendEntry("S(heads a:b)", "SPLIT placement: the pair copies KV heads a..b-1",
                r"\bS\(heads "),
    LegendEntry("R", "REPLICATE: the whole block (every rank holds it: MLA, indexer)",
                r"(?<![\w(])R(?![\w)])"),
    LegendEntry("S(x a:b, B c:d, ...)", "slices of a recurrent state's parts x, B, ... (units "
                "a..b-1)", r"\bS\((?!heads\b)[A-Za-z_]\w* "),
    LegendEntry("TP8 PP2", "tensor- and pipeline-parallel sizes", r"\b(TP|PP)\d+\b"),
    LegendEntry("DCP2, DCP 1/2", "decode context parallelism: under DCP n, each rank of a DCP "
                "group holds every n-th token slice of a block's positions; DCP 1/2 (or DCP "
                "slice 1/2) is the first of 2 slices", r"\bDCP( ?[\d/]| slice)"),
    LegendEntry("PCP2, PCP replica 1/2", "prefill context parallelism: every PCP rank holds a "
                "replica of its stage's cache (PCP shard 1/2: with TP 1 and as many DCP ranks, "
                "PCP rank q holds DCP slice q)", r"\bPCP ?[\d/a-z]"),
    LegendEntry("HND, NHD, BLHNC", "a cache layout: the order of the axes of a region's (or an "
                "allocation's) buffer, outermost first (docs/concepts.md)",
                r"\b(HND|NHD|[LBSHNDC]{5,6})\b"),
    LegendEntry("K+V", "key and value streams; K = one stream (a latent, or K alone); V = V "
                "alone",
                r"(?<![\w+])K(\+V)?(?![\w+])"),
    LegendEntry("run", "one contiguous byte copy (one NIXL descriptor)", r"\bruns?\b"),
    LegendEntry("group", "KV-cache group (layers sharing one block table)", r"\bgroups?\b"),
    LegendEntry("layers.[0-79].attn x80", "80 alike layers on one line", r"\[\d+[-,]\d"),
    LegendEntry("B, KiB, MiB, GiB", "bytes, and 2^10, 2^20, 2^30 bytes; GB/s = 10^9 bytes per "
                "second", r"\d (B|KiB|MiB|GiB|TiB)\b|\bGB/s\b"),
    LegendEntry("d0 (heads 0:4)", "what a rank holds of a sharded engine: KV heads 0..3",
                r"\b[pd]\d+ \(heads\b"),
    LegendEntry("replica 2/4", "the second of 4 ranks holding the same KV heads (fewer heads "
                "than TP ranks)", r"(?<!PCP )\breplica \d+/\d+"),
)


def columns() -> int:
    """Columns the output should fit: ``COLUMNS`` if set, else the terminal's; a pipe or a file
    gets 160 (long enough for the tables, short enough to read)."""
    return terminal_columns() or 160


def terminal_columns() -> int | None:
    """``COLUMNS`` if set, else the terminal's width; None on a pipe or a file, where prose (the
    legend) is printed unwrapped: a reader's pager or editor wraps it, at its own width."""
    import os
    import shutil
    import sys

    cols = os.environ.get("COLUMNS", "")
    if cols.isdigit() and int(cols) > 0:
        return int(cols)
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def wrap(text: str, width: int | None, first: str = "", rest: str = "  ") -> str:
    """``text`` wrapped at ``width`` between words only (a word longer than a line stays whole),
    the first line indented by ``first``, the others by ``rest``; ``width`` None: one line."""
    import textwrap

    if width is None:
        return first + " ".join(text.split())
    return textwrap.fill(text, max(width, 30), initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False)


def fitted(text: str) -> str:
    """``text`` with each line wrapped to the terminal (:func:`columns`) between words,
    continuation lines indented under their line (a summary's long state placements)."""
    width = columns()
    return "\n".join(wrap(line, width, "", " " * (len(line) - len(line.lstrip()) + 4))
                     if len(line) > width else line for line in text.splitlines())


def legend(width: int | None = 96, extra: tuple[LegendEntry, ...] = (),
           used_in: str | None = None) -> str:
    """The legend, one ``term = meaning`` per line, each wrapped between words at ``width``
    with a hanging indent (so a narrow terminal never cuts a word or mixes entries); ``width``
    None prints each entry on one line. ``used_in``: an output; only the entries it uses
    (:meth:`LegendEntry.used_in`), or every entry when None."""
    lines = ["legend:"]
    for e in (*extra, *LEGEND_ENTRIES):
        if used_in is None or e.used_in(used_in):
            lines.append(wrap(f"{e.term} = {e.meaning}", width, "  ", "      "))
    return "\n".join(lines)


#: The whole legend at 96 columns (as docs/concepts.md shows it).
LEGEND = legend()

_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class _Tee(io.TextIOBase):
    """A text stream writing to ``out`` and keeping a copy (what :func:`recorded` yields)."""

    def __init__(self, out: Any) -> None:
        self.out, self.parts = out, []

    def write(self, s: str) -> int:
        self.parts.append(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:  # columns() and rich ask the real stream
        return self.out.isatty()

    def fileno(self) -> int:
        return self.out.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.out, "encoding", "utf-8")

    @property
    def text(self) -> str:
        """What was written so far, terminal escapes (rich's styles) removed."""
        return _ESCAPES.sub("", "".join(self.parts))


@contextlib.contextmanager
def recorded() -> Iterator[_Tee]:
    """``sys.stdout`` kept while printing, so that :func:`print_legend` can list only the
    notation the output used: ``with recorded() as out: ...; print_legend(out.text)``."""
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        yield tee
    finally:
        sys.stdout = tee.out


def print_legend(output: str, extra: tuple[LegendEntry, ...] = ()) -> None:
    """Print, after a blank line, the legend entries ``output`` uses, wrapped to the terminal
    (:func:`terminal_columns`; unwrapped on a pipe)."""
    print(f"\n{legend(terminal_columns(), extra, output)}")


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
