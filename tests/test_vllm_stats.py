"""kvplan_nixl/vllm/stats.py through vLLM 0.32's own stats code (tests/vllm_stats_check.py,
run by the vLLM venv's python): the log line and the Prometheus series appear and add up."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stats(vllm_python):
    py = vllm_python
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="WARNING")
    proc = subprocess.run([str(py), str(ROOT / "tests" / "vllm_stats_check.py")], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@stats ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("@@stats "))


def test_empty_and_failure_only_intervals(stats):
    assert stats["empty_new"] and not stats["failures_only_empty"]
    assert stats["reset_after_clone"]


def test_the_log_line_adds_up(stats):
    (line,) = stats["log"]
    assert line.startswith("KV Transfer metrics: Num successful transfers=3, ")
    r = stats["reduce"]
    assert r["Num successful transfers"] == 3
    assert r["Avg xfer time (ms)"] == 20.0 and r["Avg post time (ms)"] == 2.0
    assert r["Avg MB per transfer"] == 2.0 and r["Throughput (MB/s)"] == 100.0  # 6 MB / 60 ms
    assert r["Avg runs"] == 6.0 and r["Avg number of descriptors"] == 12.0
    assert r["Num failed transfers"] == 1 and r["Num confirmations refused"] == 2
    assert "Num KV expired reqs=1" in line  # the prefill's expiry, aggregated in the interval


def test_prometheus_series_add_up(stats):
    prom = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in stats["prom"]}
    assert prom["vllm:kvplan_xfer_time_seconds_count"] == 3
    assert abs(prom["vllm:kvplan_xfer_time_seconds_sum"] - 0.06) < 1e-9
    assert prom["vllm:kvplan_bytes_transferred_sum"] == 6 << 20
    assert prom["vllm:kvplan_num_runs_sum"] == 18 and prom["vllm:kvplan_num_descriptors_sum"] == 36
    assert prom["vllm:kvplan_num_failed_transfers_total"] == 1
    assert prom["vllm:kvplan_num_confirmations_refused_total"] == 2
    assert prom["vllm:kvplan_num_kv_expired_reqs_total"] == 1


def test_the_timeline_adds_up(stats):
    # handshake, post, read, confirm, report, then the handover (their sum), in seconds
    got = stats["phases"]
    want = [0.001, 0.002, 0.010, 0.030, 0.002, 0.045]
    assert all(abs(a - b) < 1e-9 for a, b in zip(got, want)) and len(got) == 6, got
    assert stats["short_timeline_refused"]
    r = stats["reduce"]  # the second pull's read counts 0, never negative: 0.013 s in all
    assert r["Avg handover (ms)"] == 29.0 and r["Avg confirm (ms)"] == 20.0
    prom = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in stats["prom"]}
    for k in ("handshake", "post", "read", "confirm", "report", "handover"):
        assert prom[f"vllm:kvplan_phase_{k}_seconds_count"] == 2, k
    assert abs(prom["vllm:kvplan_phase_handover_seconds_sum"] - 0.058) < 1e-9
    assert abs(prom["vllm:kvplan_phase_read_seconds_sum"] - 0.010) < 1e-9
