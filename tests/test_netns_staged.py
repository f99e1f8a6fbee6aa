"""Staged and auto transfers between two hosts (two network namespaces, UCX over TCP only):
the bytes of every mode against the byte-level oracle, and auto's choice over the link against
the cost model evaluated on the costs calibrated over that link.

Runs ``benchmarks/bench_two_hosts.py --check`` (root; the namespaces of tests/netns.py): decode
rank 0 pulls from two prefill ranks in their own processes on the other host, and two prefill
ranks push to decode rank 0 there, through 64 KiB slots (several chunks per peer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import netns

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checked() -> dict:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"two hosts need network namespaces: {why}")
    env = dict(os.environ, KVPLAN_BENCH_SLOT=str(64 << 10), KVPLAN_BENCH_POOL=str(256 << 10),
               PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "benchmarks/bench_two_hosts.py", "--case", "tiny",
                        "--check", "--dead", "0"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return {x["mode"]: x for x in json.loads(r.stdout.strip().splitlines()[-1])}


def test_staged_direct_and_auto_pull_are_exact_over_tcp(checked):
    c = checked["pull"]["check"]
    assert c["exact"] == {"direct": True, "staged": True, "auto": True}, c


def test_staged_push_is_exact_over_tcp(checked):
    c = checked["push"]["check"]
    assert c["exact"] == {"staged": True}, c


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_auto_follows_the_costs_calibrated_and_measured_over_the_link(checked, mode):
    c = checked[mode]["check"]
    assert c["auto_choice"] == c["model_choice"], c
    for per_descriptor, per_byte, local_per_byte, per_chunk in c["costs"]:
        assert per_descriptor > 0 and per_byte > 0 and local_per_byte > 0 and per_chunk > 0
    if mode == "pull":  # once both modes were timed, auto posts the one measured faster
        assert "measured fastest" in c["auto_why"], c
        assert c["auto_follows_measured"], c
