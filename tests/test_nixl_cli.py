"""The ``kvplan`` command: ``plan`` stays pure, ``demo`` moves and verifies real bytes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvplan_nixl.cli import main
from tests.nixl_util import REPO, peer_env


def test_plan_prints_without_importing_nixl_or_torch():
    code = (
        "import sys; from kvplan_nixl.cli import main; rc = main(['plan', '--tokens', '64']); "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('nixl', 'nixl_cu12', 'nixl_cu13', "
        "'torch')]; print('IMPORTED', bad); sys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=peer_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "IMPORTED []" in out.stdout
    assert "TransferPlan pull d0" in out.stdout and "TransferPlan pull d1" in out.stdout


@pytest.mark.parametrize("extra", [[], ["--push", "--prefill-tp", "2", "--decode-tp", "4"]])
def test_demo_verifies(capsys, extra):
    rc = main(["demo", "--tokens", "512", "--num-blocks", "64", *extra])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "verified: all" in out and "GB/s" in out
    assert "descriptors" in out


def test_incompatible_example_exits_with_a_message(capsys):
    rc = main(["plan", "--prefill-block-size", "16", "--decode-block-size", "24"])
    assert rc == 2
    assert "IncompatibleLayoutError" in capsys.readouterr().err
