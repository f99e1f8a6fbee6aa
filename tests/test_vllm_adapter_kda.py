"""Kimi-Linear (MLA + KDA, vLLM PR 49762's hybrid) through kvplan's vLLM adapter, with the
KV-cache config, tensors and state views vLLM 0.32 itself builds (no kernels needed):
tests/vllm_kda_check.py, run by the vLLM venv's python. Skipped where that venv is not built
(``python tests/vllm_env.py`` builds it)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.vllm_env import MARKER, python_of, venv_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kimi_linear_state_and_mla_pages_arrive_at_every_tp_pair():
    root = venv_dir()
    if not (root / MARKER).exists():
        pytest.skip(f"vLLM venv not built at {root} (python tests/vllm_env.py)")
    r = subprocess.run([str(python_of(root)), "tests/vllm_kda_check.py"], cwd=REPO,
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": REPO})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("KDA", "negative"))]
    print("\n".join(lines))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len([ln for ln in lines if ln.endswith("block 128")]) == 4
    assert any(ln.startswith("negative control") for ln in lines)
