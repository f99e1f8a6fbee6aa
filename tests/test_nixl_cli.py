"""The ``kvplan`` command: ``plan`` stays pure, ``demo`` moves and verifies real bytes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvplan.cli import main
from tests.nixl_util import REPO, peer_env


def test_plan_prints_without_importing_nixl_or_torch():
    code = (
        "import sys; from kvplan.cli import main; rc = main(['plan', '--tokens', '64']); "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('nixl', 'nixl_cu12', 'nixl_cu13', "
        "'torch')]; print('IMPORTED', bad); sys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=peer_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "IMPORTED []" in out.stdout
    assert "TransferPlan pull d0" in out.stdout and "TransferPlan pull d1" in out.stdout


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--push", "--prefill-tp", "2", "--decode-tp", "4"],
        ["--example", "kimi-linear", "--push", "--prefill-tp", "4", "--decode-tp", "1",
         "--num-blocks", "16", "--slots", "2"],
        ["--example", "nemotron-h", "--prefill-tp", "2", "--prefill-pp", "2", "--decode-tp",
         "1", "--num-blocks", "40", "--num-slots", "2"],
        ["--example", "nemotron-h", "--push", "--prefill-tp", "2", "--decode-tp", "1",
         "--decode-pp", "2", "--num-blocks", "40", "--num-slots", "2"],
    ],
    ids=["default", "push", "kimi-p4-d1-push", "nemotron-pp2-d1",
         "nemotron-d-pp2-push"],
)
def test_demo_verifies(capsys, extra):
    rc = main(["demo", "--tokens", "512", "--num-blocks", "64", *extra])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "verified: all" in out and "GB/s" in out
    assert "descriptors" in out
    if "--prefill-pp" in extra:
        assert "prefill TP2 PP2 -> decode TP1" in out
        assert "d0    p3" in out  # the decode rank read from both stages


def test_hybrid_plan_with_stages_is_pure(capsys):
    rc = main(["plan", "--example", "kimi-linear", "--prefill-tp", "2", "--prefill-pp", "2",
               "--decode-tp", "1", "--tokens", "128", "--num-blocks", "8", "--slots", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "TransferPlan pull d0" in out and "p3:" in out
    assert "parts q_conv+k_conv+v_conv+recurrent" in out


def test_incompatible_example_exits_with_a_message(capsys):
    rc = main(["plan", "--prefill-block-size", "4099", "--decode-block-size", "4096"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "IncompatibleLayoutError" in err and "lcm = 16789504" in err
    assert main(["plan", "--prefill-block-size", "16", "--decode-block-size", "24"]) == 0
