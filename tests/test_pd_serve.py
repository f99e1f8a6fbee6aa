"""examples/pd_serve.py's choices, without engines: the binding and niceness of each engine
(a TP 2 engine never gets vLLM's ``auto``, which stops a one-NUMA-node host), the block size
printed, the stock NixlConnector prefill a migration starts from, and the tiny model maker's
command line. docs/vllm.md's blocks of its output are checked in tests/test_docs.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples import pd_serve

ROOT = Path(__file__).resolve().parents[1]
ONE_HOST = ["--prefill-ip", "127.0.0.1", "--decode-ip", "127.0.0.1", "--iface", "lo"]


def engine_lines(argv: list[str]) -> dict[str, str]:
    """The prefill's and the decode's printed line, by role."""
    out = pd_serve.printed(argv).splitlines()
    return {role: out[out.index(next(x for x in out if x.startswith(f"# {role}"))) + 1]
            for role in ("prefill", "decode")}


def test_a_tp2_engine_is_unpinned_and_niced_on_a_shared_host():
    lines = engine_lines([*ONE_HOST, "--prefill-tp", "2"])
    assert "VLLM_CPU_OMP_THREADS_BIND=nobind PYTHONPATH=$PWD nice -n 10 python " \
        in lines["prefill"]
    assert "--tensor-parallel-size 2" in lines["prefill"]
    assert "VLLM_CPU_OMP_THREADS_BIND=1 " in lines["decode"] and "nice" not in lines["decode"]


def test_a_tp2_engine_on_a_host_of_its_own_is_unpinned_not_niced():
    lines = engine_lines(["--decode-tp", "2"])
    assert "VLLM_CPU_OMP_THREADS_BIND=nobind " in lines["decode"]
    assert "nice" not in lines["decode"]
    assert "VLLM_CPU_OMP_THREADS_BIND=auto " in lines["prefill"]  # TP 1: vLLM's default


def test_cores_given_are_printed_as_given():
    lines = engine_lines([*ONE_HOST, "--prefill-tp", "2", "--prefill-cores", "0-3|4-7",
                          "--decode-cores", "8-11"])
    assert "VLLM_CPU_OMP_THREADS_BIND='0-3|4-7' " in lines["prefill"]
    assert "nice" not in lines["prefill"]  # pinned: cores of its own
    assert "VLLM_CPU_OMP_THREADS_BIND=8-11 " in lines["decode"]


def test_the_block_size_is_printed_on_both_engines():
    for line in engine_lines([]).values():
        assert " --block-size 128 " in line
    for line in engine_lines(["--block-size", "32"]).values():
        assert " --block-size 32 " in line


def test_a_stock_prefill_line_for_a_migration():
    s = pd_serve.Setup("M", pd_serve.Host("10.0.0.1", "eth0"), pd_serve.Host("10.0.0.2", "eth0"),
                       stock_prefill=True, lease_duration=12)
    env, argv = pd_serve.engine_command(s, "prefill")
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700" and env["UCX_MODULES"] == "^efa"
    assert "PYTHONPATH" not in env  # vLLM's own connector: nothing of the checkout
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert cfg == {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                   "kv_buffer_device": "cpu",
                   "kv_connector_extra_config": {"kv_lease_duration": 12}}
    env, argv = pd_serve.engine_command(s, "decode")
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector"] == "KvplanConnector" and "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env
    assert cfg["kv_connector_extra_config"]["kv_lease_duration"] == 12  # its heartbeats
    with pytest.raises(ValueError, match="pull mode only"):
        pd_serve.proxy_command(s, "push")
    plain = pd_serve.Setup("M", s.prefill, s.decode)
    assert "kv_lease_duration" not in pd_serve.kv_config(plain, "decode")[
        "kv_connector_extra_config"]


def test_the_model_maker_says_its_options_without_torch():
    r = subprocess.run([sys.executable, "examples/pd_serve.py", "model", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr
    assert "nemotron-h" in r.stdout and "DIR" in r.stdout.upper()
