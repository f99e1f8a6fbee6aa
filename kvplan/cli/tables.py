"""How ``kvplan explain`` prints its document for people: per decode rank a title and a table
(rich when installed, plain text otherwise) whose columns have one width for every rank and
whose lines end in no spaces, one block per row where a terminal is too narrow, the warnings,
and the legend of the notation printed (:func:`print_text`).

Where to look for the text output; the numbers come from :mod:`kvplan.cli.counting`.

Layer: the CLI (layer 7, top of the core); imports kvplan's public names, views and the CLI's
helpers; rich stays optional.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from kvplan import EngineSpec
from kvplan.cli.cliargs import LegendEntry, columns, print_legend, recorded, wrap
from kvplan.cli.counting import layouts
from kvplan.cp import parallel_label
from kvplan.views import human_bytes


def _console():
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(highlight=False, width=columns())


def title(args, src: EngineSpec, dst: EngineSpec) -> str:
    """The first line of explain's text: both engines' shapes and the request shown."""
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


def print_text(doc: dict[str, Any], title: str) -> None:
    """Print explain's document ``doc`` (:func:`kvplan.cli.counting.explain`) under ``title``
    for people, then the legend of the notation it used."""
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


