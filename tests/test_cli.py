"""The ``kvplan`` command as a shell user meets it: help, version, exit codes, one ``kvplan:``
line and never a traceback for bad input, pipes, progress, and ``explain`` in bounded memory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvplan
from kvplan import presets
from kvplan.cli import command as cli
from kvplan.cli import engines, explain

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("demo", "plan", "explain", "check", "spec", "presets")


def kvplan_cmd(*argv: str, env: dict | None = None, timeout: float = 120, **kw):
    """``kvplan ARGV`` in a fresh interpreter, with this worktree first on the path."""
    e = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    e.pop("KVPLAN_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", "kvplan.cli", *argv], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout, **kw)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvplan: "), err
    assert "Traceback" not in err
    return lines[0]


# -- help and version ----------------------------------------------------------------------


def test_bare_kvplan_prints_the_help_naming_every_command():
    r = kvplan_cmd()
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.startswith("usage: kvplan")
    for name in COMMANDS:
        assert re.search(rf"^\s+{name}\s+\S", r.stdout, re.M), name
    assert "`" not in r.stdout  # no reST markup in a terminal


def test_version():
    r = kvplan_cmd("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvplan {kvplan.__version__}"


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_help_states_defaults_without_markup(capsys, monkeypatch, name):
    monkeypatch.setenv("COLUMNS", "300")  # one line per option: no wrapping inside a default
    assert cli.main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert "`" not in out
    if name in ("demo", "plan"):
        assert "(default: 2048)" in out and "(default: gqa-mla-draft)" in out
        assert "(default: 4)" in out  # --prefill-tp
    if name in ("explain", "spec"):
        assert "(default: 16)" in out and "(default: HND)" in out


# -- bad input: one line, exit 2, never a default in place of the user's value ---------------


@pytest.mark.parametrize("argv, says", [
    (["explain", "--prefill", "llama-3.1-8b", "--prefill-tp", "2", "--decode", "llama-3.1-8b",
      "--decode-tp", "2", "--block-size", "0"], "--block-size: must be in [1, 65536], got 0"),
    (["explain", "--prefill", "llama-3.1-8b", "--prefill-tp", "2", "--decode", "llama-3.1-8b",
      "--decode-tp", "2", "--tokens", "9" * 30], "--tokens: must be in [1, 2097152]"),
    (["explain", "--prefill", "llama-3.1-8b", "--prefill-tp", "0", "--decode", "llama-3.1-8b",
      "--decode-tp", "2"], "--prefill-tp: must be in [1, 256], got 0"),
    (["explain", "--prefill", "llama-3.1-8b", "--prefill-tp", "2", "--decode", "llama-3.1-8b",
      "--decode-tp", "2", "--prefill-pp", "0"], "--prefill-pp: must be in [1, 256], got 0"),
    (["explain", "--prefill", "llama-3.1-8b", "--prefill-tp", "2", "--decode", "llama-3.1-8b",
      "--decode-tp", "2", "--num-blocks", "-4"], "--num-blocks: must be in [1, "),
    (["spec", "llama-3.1-8b", "--tp", "2", "--pp", "0"], "--pp: must be in [1, 256], got 0"),
    (["plan", "--tokens", "0"], "--tokens: must be in [1, 2097152], got 0"),
    (["plan", "--num-blocks", "0"], "--num-blocks: must be in [1, "),
    (["plan", "--prefill-block-size", "0"], "--prefill-block-size: must be in [1, 65536], got 0"),
    (["plan", "--seed", "-1"], "--seed: must be in [0, "),
    (["plan", "--tokens", "twelve"], "--tokens: expected an integer, got 'twelve'"),
    (["plan", "--tokens", "2000000"], "2000000 tokens need 125000 blocks"),
    (["plan", "--example", "nope"], "--example: invalid choice: 'nope'"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["demo", "--example", "llama-3.1-70b", "--num-blocks", "100000"], "would allocate"),
])
def test_bad_input_is_one_kvplan_line_and_exit_2(capsys, argv, says):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert says in one_error_line(err) and out == ""


def test_bad_input_in_a_real_process_has_no_traceback():
    r = kvplan_cmd("explain", "--prefill", "llama-3.1-8b", "--prefill-tp", "2", "--decode",
                   "llama-3.1-8b", "--decode-tp", "2", "--block-size", "0")
    assert r.returncode == 2 and "--block-size" in one_error_line(r.stderr)


def test_files_that_are_not_utf8_json(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe{\x00")
    for argv in (["explain", "--prefill", str(bad), "--prefill-tp", "2", "--decode",
                  "llama-3.1-8b", "--decode-tp", "2"],
                 ["check", str(bad), str(bad)], ["spec", str(bad), "--tp", "2"]):
        assert cli.main(argv) == 2, argv
        assert "is not UTF-8 text" in one_error_line(capsys.readouterr().err)
    with pytest.raises(kvplan.SpecError, match="not UTF-8"):
        kvplan.from_hf_config(str(bad), tp_size=2)


def test_a_users_value_is_used_not_replaced_by_a_default(capsys):
    assert cli.main(["explain", "--prefill", "llama-3.1-8b", "--prefill-tp", "2", "--decode",
                     "llama-3.1-8b", "--decode-tp", "2", "--num-blocks", "300", "--tokens",
                     "64", "--prefill-block-size", "32", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["blocks"] == {"source": [2], "destination": [4]}  # 64 tokens in blocks of 32, 16


def test_library_errors_are_one_line_with_the_error_type(capsys):
    assert cli.main(["spec", "llama-3.1-8b", "--tp", "3"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("kvplan: SpecError: ")


# -- examples and presets -----------------------------------------------------------------


def test_example_accepts_preset_names(capsys):
    assert cli.main(["plan", "--example", "llama-3.1-8b", "--tokens", "64", "--num-blocks",
                     "8", "--prefill-tp", "4", "--decode-tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "layers.[0-31].attn x32: S(heads 0:2) K+V" in out
    for name in presets.names():
        assert name in engines.EXAMPLE_CHOICES


def test_plan_output_folds_alike_layers_and_explains_its_notation(capsys):
    assert cli.main(["plan", "--example", "llama3-70b", "--tokens", "256",
                     "--num-blocks", "32"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) < 40, out  # was one line per layer per peer: 326 lines
    assert sum("layers.[0-79].attn x80: S(heads" in ln for ln in lines) == 4
    assert "legend:\n" in out and "  S(heads a:b) = SPLIT" in out
    assert "run = one contiguous byte copy" in out and "GB/s = 10^9" in out
    # a plain GQA model: no MLA, no state, no DCP or PCP, no layout named above the legend
    notes = out[out.index("legend:"):]
    for absent in ("R = REPLICATE", "S(x a:b", "DCP2", "PCP2", "HND, NHD", "replica 2/4"):
        assert absent not in notes, absent


def test_the_legend_lists_the_notation_a_hybrid_plan_uses(capsys):
    """MLA (R, K) and KDA state parts appear above, so their entries appear below; a legend
    entry no output line uses (SPLIT heads: the example has no GQA layer) does not."""
    assert cli.main(["plan", "--example", "kimi-linear", "--prefill-tp", "2", "--decode-tp",
                     "1", "--tokens", "128", "--num-blocks", "8"]) == 0
    out = capsys.readouterr().out
    body, notes = out.split("legend:\n")
    assert "R K" in body and "S(q_conv 0:256" in body and "S(heads" not in body
    assert "  R = REPLICATE" in notes and "  S(x a:b, B c:d, ...) = slices" in notes
    assert "  K+V = key and value" in notes and "group = KV-cache group" in notes
    assert "S(heads a:b)" not in notes and "DCP" not in notes


def test_every_legend_entry_is_recognised_where_an_output_uses_it():
    """Each entry's pattern matches the notation it explains, as the outputs write it, and
    not the rest of a plain plan's lines."""
    from kvplan.cli.cliargs import LEGEND_ENTRIES

    used = {"p0, d1": "  p3: 20.0 MiB", "S(heads a:b)": "S(heads 0:2) K+V", "R": ": R K, 72",
            "S(x a:b, B c:d, ...)": "S(x 0:128, B 0:8)", "TP8 PP2": "TP4 PP2 HND",
            "DCP2, DCP 1/2": "d1 (heads 0:4, DCP slice 2/2)",
            "PCP2, PCP replica 1/2": "S(heads 0:1) PCP replica 1/2",
            "HND, NHD, BLHNC": "TP8 BLHNC ->", "K+V": "S(heads 0:1) K+V,",
            "run": "in 4 runs", "group": "in 1 group(s)", "layers.[0-79].attn x80":
            "layers.[0-3].attn x4", "B, KiB, MiB, GiB": "576 B", "d0 (heads 0:4)":
            "d0 (heads 0:2): 1.0 MiB", "replica 2/4": "d3 (heads 1:2, replica 2/2)"}
    assert sorted(used) == sorted(e.term for e in LEGEND_ENTRIES)
    plain = "TransferPlan pull: something of nothing"
    for e in LEGEND_ENTRIES:
        assert e.used_in(used[e.term]), e.term
        assert not e.used_in(plain), e.term
    assert not next(e for e in LEGEND_ENTRIES if e.term == "R").used_in("RDMA KiB REPLICATE")


# -- pipes, interrupts, missing NIXL --------------------------------------------------------


def test_a_closed_pipe_stops_quietly():
    e = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "kvplan.cli", "presets", "--json"],
                         cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the first write: `kvplan ... | head -0`
    err = p.stderr.read().decode()
    assert p.wait(60) == 141 and err == ""


_NO_NIXL = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('nixl', 'nixl_cu12', 'nixl_cu13'):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from kvplan.cli import main
sys.exit(main(['demo', '--tokens', '64', '--num-blocks', '16']))
"""


def test_demo_without_nixl_names_the_install_command():
    r = subprocess.run([sys.executable, "-c", _NO_NIXL], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2
    assert 'pip install -e ".[nixl]"' in one_error_line(r.stderr)


def test_demo_shows_progress_and_no_nixl_info_lines():
    r = kvplan_cmd("demo", "--tokens", "64", "--num-blocks", "16",
                   env={"KVPLAN_PROGRESS": "1"})
    assert r.returncode == 0, r.stderr
    assert "importing NIXL" in r.stderr and "timed transfer" in r.stderr
    assert "NIXL INFO" not in r.stderr and "INFO" not in r.stdout
    assert "verified: all" in r.stdout and "of the decode ranks' buffers" in r.stdout


def test_no_progress_on_a_pipe_by_default():
    r = kvplan_cmd("plan", "--tokens", "64", env={"KVPLAN_PROGRESS": ""})
    assert r.returncode == 0 and r.stderr == ""


# -- explain: counts without the full plan, in bounded memory -----------------------------


@pytest.mark.parametrize("build", [
    lambda tp: presets.spec("gemma-3-1b", tp, num_blocks=64, layout="NHD"),
    lambda tp: presets.spec("kimi-linear-48b-a3b", tp, num_blocks=64),
    lambda tp: presets.spec("nemotron-h-8b", tp, num_blocks=64, pp_size=2),
    lambda tp: presets.spec("kimi-k2", tp, num_blocks=64, draft="kimi-k2.5-eagle3"),
    lambda tp: presets.spec("llama-3.1-8b", tp, num_blocks=64, layout="BLHNC"),
    lambda tp: presets.spec("llama-3.1-8b", tp, num_blocks=64, layout="BHLNC"),
    lambda tp: presets.spec("gemma-3-1b", tp, num_blocks=64, layout="LBNHD"),
    lambda tp: presets.spec("kimi-linear-48b-a3b", tp, num_blocks=64, layout="BLHNC"),
], ids=["sliding-nhd", "kda-pools", "mamba-pp2", "mla-draft", "blhnc", "bhlnc", "sglang-kv",
        "kda-pools-blhnc"])
def test_explain_counts_equal_the_full_plans(build):
    src, dst = build(4), build(2)
    sb, db = explain.request(src, 300), explain.request(dst, 300)
    for d in range(dst.num_ranks):
        tmap = kvplan.pull_map(src, dst, d)
        plan = tmap.plan(sb, db)
        c = explain.count(tmap, sb, db)
        assert (c.nbytes, c.runs, c.peers) == (plan.nbytes, len(plan), plan.peers)
        bounds = plan.lane_bounds
        lengths = [int(plan.rows["length"][a:b].sum()) for a, b in pairwise(bounds)]
        assert [(n, r) for _, n, r in c.stats] == list(zip(lengths, np.diff(bounds).tolist()))


_BOUNDED = """
import resource, sys
limit = {mib} << 20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from kvplan.cli import main
sys.exit(main(["explain", "--prefill", "llama-3.1-70b", "--prefill-tp", "8", "--decode",
               "llama-3.1-70b", "--decode-tp", "2", "--layout", "NHD", "--tokens", "131072",
               "--json"]))
"""


def test_explain_of_a_128k_nhd_request_fits_in_1_gib():
    # the plans of this request hold 168M runs (9 GiB as arrays); explain must not build them
    r = subprocess.run([sys.executable, "-c", _BOUNDED.format(mib=1024)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert [x["runs"] for x in doc["ranks"]] == [83886080, 83886080]
    assert any("167772160 runs per request" in w and "(16.0x more)" in w
               for w in doc["warnings"])


def test_the_legend_is_documented_as_printed():
    assert explain.LEGEND in (ROOT / "docs" / "concepts.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", [n for n in presets.names() if "eagle3" not in n])
def test_explain_answers_for_every_preset_at_128k_tokens(capsys, name):
    # NHD under TP8 -> TP2: the most runs; pooled hybrids need distinct pages per group
    assert cli.main(["explain", "--prefill", name, "--prefill-tp", "8", "--decode", name,
                     "--decode-tp", "2", "--rank", "1", "--layout", "NHD", "--tokens",
                     "131072", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ranks"][0]["runs"] > 0 and doc["ranks"][0]["nbytes"] > 0


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)
_spec_keys = st.fixed_dictionaries({"tp_size": _json_values, "regions": st.lists(
    st.dictionaries(st.sampled_from(["name", "kind", "num_blocks", "block_size", "dtype",
                                     "num_kv_heads", "head_dim", "dim", "group", "layout"]),
                    _json_values, max_size=8), max_size=3)})


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.binary(max_size=64) | _json_values.map(json.dumps).map(str.encode)
       | _spec_keys.map(json.dumps).map(str.encode))
def test_any_file_gives_an_answer_or_one_line_never_a_traceback(capsys, tmp_path, content):
    f = tmp_path / "x.json"
    f.write_bytes(content)
    for argv in (["check", str(f), str(f)],
                 ["explain", "--prefill", str(f), "--prefill-tp", "2", "--decode", str(f),
                  "--decode-tp", "2", "--tokens", "16"]):
        rc = cli.main(argv)
        out, err = capsys.readouterr()
        assert rc in (0, 1, 2, 3), (argv, rc)
        if rc:  # one error: a "kvplan: " line, then only indented detail lines (lists)
            first, *more = err.strip().splitlines()
            assert first.startswith("kvplan: ") and err.startswith("kvplan: "), err
            assert all(line.startswith("  ") for line in more), err
            assert "Traceback" not in err + out


def test_plan_summary_folds_alike_layers():
    src, dst = presets.spec("llama-3.1-70b", 4), presets.spec("llama-3.1-70b", 2)
    plan = kvplan.pull_map(src, dst, 1).plan([[0, 2, 4]], [[1, 3, 5]])
    lines = plan.summary().splitlines()
    assert lines[0] == ("TransferPlan pull d1 (heads 4:8): 7.5 MiB in 960 runs, 3 destination "
                        "blocks in 1 group(s)")
    assert lines[1:] == [
        "  p2: 3.8 MiB, 480 runs",
        "    layers.[0-79].attn x80: S(heads 4:6) K+V, 3.8 MiB in 480 runs",
        "  p3: 3.8 MiB, 480 runs",
        "    layers.[0-79].attn x80: S(heads 6:8) K+V, 3.8 MiB in 480 runs",
    ]
