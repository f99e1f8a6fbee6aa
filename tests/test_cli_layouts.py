"""``--prefill-layout`` / ``--decode-layout`` / ``--layout`` on explain, plan and spec, and the
runs-per-layout comparison explain prints (issue 8). No NIXL."""

import json

from kvplan import EngineSpec, presets, pull_map
from kvplan.cli import main
from kvplan.cli.explain import request


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_takes_any_layout_and_compares_runs_per_layout(capsys):
    code, out, err = run(capsys, "explain", "--prefill", "llama-3.1-8b", "--prefill-tp", "4",
                         "--decode", "llama-3.1-8b", "--decode-tp", "2", "--rank", "0",
                         "--prefill-layout", "BLHNC", "--decode-layout", "LBNHD",
                         "--tokens", "256", "--json")
    assert code == 0, err
    doc = json.loads(out)
    # the runs shown are those of the layouts asked for: BLHNC -> SGLang-style K/V buffers
    src = presets.spec("llama-3.1-8b", 4, layout="BLHNC", num_blocks=1024)
    dst = presets.spec("llama-3.1-8b", 2, layout="LBNHD", num_blocks=1024)
    plan = pull_map(src, dst, 0).plan(request(src, 256), request(dst, 256))
    assert doc["ranks"][0]["runs"] == len(plan)
    by = doc["runs_by_layout"]
    assert list(by) == ["HND", "LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
    blocks = 256 // 16
    assert by["BHLNC"] == 2 * blocks  # one run per (peer, block): two P ranks per D rank
    assert by["HND"] == 32 * 2 * 2 * blocks  # per layer, stream, peer and block
    code, out, _ = run(capsys, "explain", "--prefill", "llama-3.1-8b", "--prefill-tp", "4",
                       "--decode", "llama-3.1-8b", "--decode-tp", "2", "--rank", "0",
                       "--layout", "BHLNC", "--tokens", "256")
    assert code == 0
    assert "with one layout on both sides: " in out and "BHLNC 32" in out


def test_bad_layout_is_a_usage_error(capsys):
    code = main(["explain", "--prefill", "llama-3.1-8b", "--prefill-tp", "2", "--decode",
                 "llama-3.1-8b", "--decode-tp", "2", "--prefill-layout", "XYZ"])
    assert code == 2  # a usage error: one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("kvplan: ") and "is not HND/NHD" in err and "Traceback" not in err


def test_spec_and_plan_take_layouts(capsys):
    code, out, _ = run(capsys, "spec", "llama-3.1-8b", "--tp", "2", "--layout", "LBNHD")
    assert code == 0
    spec = EngineSpec.from_dict(json.loads(out))
    assert spec.buffers == ("kv.0.k", "kv.0.v")
    assert {r.layout_name for r in spec.regions} == {"LBNHD"}
    code, out, _ = run(capsys, "plan", "--example", "llama3-70b", "--prefill-tp", "8",
                       "--decode-tp", "4", "--prefill-layout", "BHLNC", "--decode-layout",
                       "BHLNC", "--tokens", "512", "--num-blocks", "64")
    assert code == 0
    assert "TransferPlan pull d0 (heads 0:2): 40.0 MiB in 64 runs" in out  # 32 blocks x 2 peers
