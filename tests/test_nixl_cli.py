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


def _rdma_providers() -> str | None:
    """Where the system's ``libefa`` (rdma-core's ``ibverbs-providers``) lives, or None.

    It is what NIXL's UCX EFA module links against and the wheel does not bundle: with it
    present the module loads and brings the system's libibverbs and libnl-route beside the
    wheel's own copies (kvplan_nixl/_nixl.py, UCX_MODULES_DEFAULT)."""
    import ctypes.util

    return ctypes.util.find_library("efa")


def _demo(env: dict) -> subprocess.CompletedProcess:
    # `kvplan demo` as a shell user runs it: a fresh interpreter, its own exit
    return subprocess.run([sys.executable, "-m", "kvplan.cli", "demo", "--tokens", "64",
                           "--num-blocks", "16"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_demo_exits_0_on_the_rdma_stack():
    """With rdma-core's providers installed (as on every RDMA GPU server) ``kvplan demo``
    exits 0: its status is its own, not the segfault at exit (139) that two libnl-route copies
    caused. The control shows the test runs where the crash lives: with every UCX module
    allowed (the user's own UCX_MODULES wins over ours) the same demo dies by SIGSEGV."""
    where = _rdma_providers()
    if where is None:
        msg = ("rdma-core's ibverbs-providers (libefa) is not installed: "
               "apt-get install -y ibverbs-providers, as .ci/run does")
        print(msg)
        pytest.skip(msg)
    env = {k: v for k, v in peer_env().items() if k != "UCX_MODULES"}
    ours = _demo(env)
    assert ours.returncode == 0, (where, ours.returncode, ours.stderr[-2000:])
    assert "verified: all" in ours.stdout
    control = _demo({**env, "UCX_MODULES": "all"})
    assert "verified: all" in control.stdout, control.stderr[-2000:]
    assert control.returncode == -11, (
        f"with UCX's EFA module loaded (libefa at {where}) the demo exited "
        f"{control.returncode}, not by SIGSEGV: if this NIXL build no longer crashes at exit, "
        "UCX_MODULES_DEFAULT in kvplan_nixl/_nixl.py may go")
