"""Context parallelism on the command line: ``--dcp-size``, ``--dcp-interleave``, ``--pcp-size``
on every command that builds a spec, and outputs that name DCP/PCP shares."""

import json

import pytest

from kvplan import EngineSpec
from kvplan.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_spec_takes_dcp_and_pcp(capsys):
    code, out, err = run(capsys, "spec", "deepseek-v3", "--tp", "8", "--dcp-size", "4",
                         "--dcp-interleave", "8", "--num-blocks", "16")
    assert code == 0, err
    spec = EngineSpec.from_dict(json.loads(out))
    assert (spec.dcp_size, spec.dcp_interleave, spec.pcp_size) == (4, 8, 1)
    code, out, err = run(capsys, "spec", "deepseek-v3", "--tp", "1", "--dcp-size", "2",
                         "--pcp-size", "2", "--num-blocks", "16")
    assert code == 0 and json.loads(out)["pcp_size"] == 2
    assert EngineSpec.from_dict(json.loads(out)).pcp_sharded


@pytest.mark.parametrize(("argv", "message"), [
    (("--tp", "2", "--dcp-size", "2", "--pcp-size", "2"),
     "SpecError: pcp_size 2 with dcp_size 2 over tp_size 2"),
    (("--tp", "4", "--dcp-size", "2", "--dcp-interleave", "32"),
     "SpecError: region 'layers.0.mla': dcp_interleave 32 does not divide block_size 16"),
])
def test_spec_refusals_name_the_numbers(capsys, argv, message):
    code, _, err = run(capsys, "spec", "deepseek-v3", *argv, "--num-blocks", "16")
    assert code != 0 and message in err


def test_explain_names_dcp_shares_not_r(capsys):
    code, out, err = run(capsys, "explain", "--prefill", "deepseek-v3", "--prefill-tp", "1",
                         "--prefill-pcp-size", "2", "--prefill-dcp-size", "2",
                         "--decode", "deepseek-v3", "--decode-tp", "4", "--decode-dcp-size", "2",
                         "--rank", "1", "--tokens", "256", "--no-compare-layouts")
    assert code == 0, err
    assert "TP1 PCP2+DCP2 HND -> decode deepseek-v3 TP4 DCP2 HND" in out
    assert "DCP 1/2 (positions 1:2 of every 2)" in out
    code, out, err = run(capsys, "explain", "--prefill", "deepseek-v3", "--prefill-tp", "2",
                         "--prefill-pcp-size", "2", "--decode", "deepseek-v3", "--decode-tp",
                         "2", "--rank", "1", "--tokens", "64", "--json", "--no-compare-layouts")
    doc = json.loads(out)
    assert doc["source"]["pcp_size"] == 2 and doc["source"]["dcp_size"] == 1


def test_plan_and_check_carry_context_sizes(capsys, tmp_path):
    code, out, err = run(capsys, "plan", "--example", "gqa-mla-draft", "--prefill-tp", "2",
                         "--prefill-pcp-size", "2", "--decode-tp", "2", "--tokens", "64")
    assert code == 0, err
    a = tmp_path / "a.json"
    code, out, _ = run(capsys, "spec", "deepseek-v3", "--tp", "2", "--pcp-size", "2",
                       "--num-blocks", "8")
    a.write_text(out)
    code, out, err = run(capsys, "check", str(a), str(a))
    assert code == 0 and "source TP2 PCP2 (61 regions)" in out
