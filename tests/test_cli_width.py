"""``kvplan explain`` as a person reads it: at 80 and 200 columns no header or cell is cut
inside a word, the layouts planned are named (text and JSON), the layout comparison counts the
request shown (``--cached``), and a long comparison reports progress on a pipe."""

from __future__ import annotations

import json
import re

import pytest

from kvplan.cli import main

LLAMA = ["explain", "--prefill", "llama-3.1-70b", "--prefill-tp", "8", "--decode",
         "llama-3.1-70b", "--decode-tp", "4", "--prefill-layout", "LBHNC", "--decode-layout",
         "BLHNC", "--rank", "0", "--tokens", "3000", "--cached", "1024"]
HYBRID = ["explain", "--prefill", "qwen3-next-80b-a3b", "--prefill-tp", "2", "--decode",
          "qwen3-next-80b-a3b", "--decode-tp", "4", "--rank", "1", "--tokens", "1024",
          "--no-compare-layouts"]
PLAIN = ["explain", "--prefill", "llama-3.1-70b", "--prefill-tp", "8", "--decode",
         "llama-3.1-70b", "--decode-tp", "4", "--rank", "0", "--no-compare-layouts"]
HEADERS = ("from", "regions", "placement", "streams", "offsets", "bytes", "runs")


def run(capsys, monkeypatch, argv, columns=None, env=None):
    if columns is not None:
        monkeypatch.setenv("COLUMNS", str(columns))
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def _words(text: str) -> list[str]:
    return text.split()


@pytest.mark.parametrize("columns", [80, 200])
@pytest.mark.parametrize("argv", [LLAMA, PLAIN, HYBRID],
                         ids=["llama-70b-packed", "llama-70b", "qwen3-next"])
def test_no_header_or_cell_is_cut_inside_a_word(capsys, monkeypatch, argv, columns):
    doc = json.loads(run(capsys, monkeypatch, [*argv, "--json", "--no-compare-layouts"])[0])
    out, _ = run(capsys, monkeypatch, argv, columns)
    assert max(len(line.rstrip()) for line in out.splitlines()) <= columns
    assert "…" not in out.replace("…,", "")  # nothing cut short (name_set's own … aside)
    flat = " ".join(out.split())  # a word cut across lines would be two words here
    body = flat[flat.index(" d") : flat.index("legend:")]
    for r in doc["ranks"]:
        for row in r["rows"]:
            cells = [f"p{row['from']}", row["regions"], row["placement"], row["streams"],
                     f"+{row['src_offset']}", f"+{row['dst_offset']}", str(row["runs"])]
            for cell in cells:
                for word in _words(cell):
                    assert re.search(rf"(^|\s){re.escape(word)}(\s|$|[:;,)])", body), (
                        word, columns)
    if "placement S(" in body and "; streams" in body:  # the one-block-per-row form
        assert columns < 200
    else:  # the table: every header whole
        for h in HEADERS:
            assert re.search(rf"(^|\s){h}(\s|$)", body), h
    for line in out[out.index("legend:"):].splitlines()[1:]:
        if not line.strip() or line.startswith("("):
            break
        assert line.startswith("  "), line  # each entry, and its wrapped lines, indented
    # every legend term is whole on its line
    assert "  layers.[0-79].attn x80 = 80 alike layers" in out
    assert "  S(heads a:b) = SPLIT placement" in out


def test_explain_names_the_layouts_it_planned(capsys, monkeypatch):
    out, _ = run(capsys, monkeypatch, [*LLAMA, "--no-compare-layouts"], 200)
    assert out.startswith("prefill llama-3.1-70b TP8 LBHNC -> decode llama-3.1-70b TP4 BLHNC:")
    doc = json.loads(run(capsys, monkeypatch, [*LLAMA, "--json", "--no-compare-layouts"])[0])
    assert doc["source"]["layout"] == "LBHNC" and doc["destination"]["layout"] == "BLHNC"
    assert doc["source"]["tp_size"] == 8 and doc["destination"]["dcp_size"] == 1


def test_layout_comparison_counts_the_request_shown(capsys, monkeypatch):
    """With --cached the table, runs_by_layout and the printed comparison agree: one count."""
    doc = json.loads(run(capsys, monkeypatch, [*LLAMA, "--json", "--compare-layouts"])[0])
    shown = doc["ranks"][0]["runs"]
    assert doc["range"] == [1024, 3000]
    assert doc["runs_by_layout"]["BLHNC"] == shown == 19840  # both sides BLHNC: merge 2 slots
    for name in ("HND", "LBHNC"):
        argv = [a if a not in ("LBHNC", "BLHNC") else name for a in LLAMA]
        one = json.loads(run(capsys, monkeypatch, [*argv, "--json", "--no-compare-layouts"])[0])
        assert doc["runs_by_layout"][name] == one["ranks"][0]["runs"], name
    whole = json.loads(run(capsys, monkeypatch, [*(a for a in LLAMA if a not in (
        "--cached", "1024")), "--json", "--compare-layouts"])[0])
    assert whole["runs_by_layout"]["HND"] > doc["runs_by_layout"]["HND"]
    out, _ = run(capsys, monkeypatch, [*LLAMA, "--compare-layouts"], 200)
    assert f"HND {doc['runs_by_layout']['HND']:,}" in out


def test_a_long_layout_comparison_prints_no_progress_on_a_pipe(capsys, monkeypatch):
    monkeypatch.delenv("KVPLAN_PROGRESS", raising=False)
    _, err = run(capsys, monkeypatch, [*LLAMA, "--compare-layouts"], 80)
    assert err == ""


def test_plan_summaries_wrap_to_the_terminal_between_words(capsys, monkeypatch):
    argv = ["plan", "--example", "kimi-linear", "--prefill-tp", "2", "--decode-tp", "1",
            "--tokens", "128", "--num-blocks", "8"]
    wide, _ = run(capsys, monkeypatch, argv, 200)
    narrow, _ = run(capsys, monkeypatch, argv, 80)
    assert max(map(len, narrow.splitlines())) <= 80 < max(map(len, wide.splitlines()))
    summary = wide[:wide.index("legend:")]
    # the same words, whole: only the line breaks differ
    assert " ".join(narrow[:narrow.index("legend:")].split()) == " ".join(summary.split())


#: Every decode rank of a hybrid whose ranks read different cells (offsets, heads, peers).
ALL_RANKS = ["explain", "--prefill", "qwen3-next-80b-a3b", "--prefill-tp", "2", "--decode",
             "qwen3-next-80b-a3b", "--decode-tp", "4", "--tokens", "1024",
             "--no-compare-layouts"]


@pytest.mark.parametrize("columns", [None, 120, 200], ids=["pipe", "120", "200"])
@pytest.mark.parametrize("argv", [PLAIN, ALL_RANKS,
                                  [*PLAIN[:-1], "--compare-layouts", "--tokens", "512"],
                                  ["plan", "--example", "kimi-linear", "--tokens", "128",
                                   "--num-blocks", "8"]],
                         ids=["llama-70b", "qwen3-next-all-ranks", "compared", "plan"])
def test_no_line_ends_in_spaces(capsys, monkeypatch, argv, columns):
    """rich pads every line of a table (and its title) to the table's width: stripped."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)  # capsys: not a terminal, a pipe
    out, _ = run(capsys, monkeypatch, argv, columns)
    assert [line for line in out.splitlines() if line != line.rstrip()] == []


@pytest.mark.parametrize("columns", [None, 120, 200], ids=["pipe", "120", "200"])
def test_every_rank_table_of_one_output_is_one_width(capsys, monkeypatch, columns):
    """Column widths are those of every rank's cells together: each table's rule under its
    header is as long as every other's, and its cells start in the same columns."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    out, _ = run(capsys, monkeypatch, ALL_RANKS, columns)
    lines = out.splitlines()
    rules = [len(line) for line in lines if line and set(line) <= {"─", " "}]
    headers = [line for line in lines if line.startswith("from ")]
    assert len(rules) == len(headers) == 4
    assert len(set(rules)) == 1 and len(set(headers)) == 1, (rules, headers)


def test_a_pipe_gets_the_legend_unwrapped(capsys, monkeypatch):
    """No terminal and no COLUMNS: each legend entry on one line, however long (a pager or an
    editor wraps at its own width); the tables still fit the 160 columns of a pipe."""
    from kvplan.cli.cliargs import LegendEntry, print_legend

    monkeypatch.delenv("COLUMNS", raising=False)
    out, _ = run(capsys, monkeypatch, ALL_RANKS)
    notes = out[out.index("legend:\n"):].split("\n\n")[0].splitlines()[1:]
    assert len(notes) > 5 and all(line.startswith("  ") and not line.startswith("   ")
                                  for line in notes), notes  # no continuation line
    assert max(map(len, out[:out.index("legend:")].splitlines())) <= 160
    long = LegendEntry("zz", "word " * 60, "zz")  # 300 columns: wrapped at 160 before
    print_legend("a zz b", (long,))
    assert capsys.readouterr().out == f"\nlegend:\n  zz = {('word ' * 60).strip()}\n"
    monkeypatch.setenv("COLUMNS", "100")
    print_legend("a zz b", (long,))
    lines = capsys.readouterr().out.splitlines()[2:]
    assert len(lines) == 4 and max(map(len, lines)) <= 100 and lines[1].startswith("      w")
