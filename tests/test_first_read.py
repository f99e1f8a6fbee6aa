"""First reads from stock NixlConnector ranks (issue 46 item 3; docs/vllm.md, "A first read that
hangs"), with bare NIXL agents: no vLLM engine.

The fast test shows why only a *first* read can wait on the prefill: UCX connects a new
endpoint lazily (its wireup messages go over the TCP lane here, which the target's worker must
answer), so a reader's first read from an agent completes only once that agent's worker was
progressed; a later read over the same endpoint (a CMA get on one host) needs nothing of it.
A stock vLLM agent is progressed by NIXL's progress thread, so its first read completes; a
kvplan peer's endpoint is already connected by then, by the hello its connect sends.

The engine-tier test (it needs the vLLM venv's NIXL) is the loop the issue asks for, with
fresh stock ranks every time: twenty pairs of agents configured as vLLM 0.32's NixlConnector
configures its own, each in its own process, read at once by a kvplan-configured reader
(``benchmarks/repro_first_read.py``); none may miss a 15 s deadline (the engine tests' reads
have 20 s; a stock rank starved on a loaded machine took up to 4.75 s here). Twenty fresh
stock TP 2 engines would take half an hour on two cores.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "repro_first_read.py"


def _read(reader, local, remote, poll=lambda: None, limit: float = 1.0) -> tuple[str, float]:
    """One READ of the whole remote region; its state after ``limit`` s of polling (``poll``
    between polls) and the seconds it took."""
    h = reader.make_prepped_xfer("READ", local, [0], remote, [0], b"")
    t0 = time.monotonic()
    state = reader.transfer(h)
    while state == "PROC" and time.monotonic() - t0 < limit:
        poll()
        state = reader.check_xfer_state(h)
    took = time.monotonic() - t0
    reader.release_xfer_handle(h)
    return state, took


def test_a_first_read_waits_for_the_target_to_progress_a_later_one_does_not(monkeypatch):
    """A target agent with no progress thread, never progressed: the reader's first read from
    it stays PROC (1 s); it completes once the target is progressed; the next read completes
    with the target left alone. UCX on loopback as the engine tests run it (TCP for messages,
    CMA for reads on one host)."""
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_TLS", "tcp,cma")
    from kvplan_nixl._nixl import make_agent, nixl_agent, nixl_agent_config

    target = nixl_agent(f"target-{os.getpid()}",
                        nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    src = (np.arange(1 << 16) % 251).astype(np.uint8)
    target.register_memory(target.get_reg_descs([(src.ctypes.data, src.nbytes, 0, "")], "DRAM"))
    reader = make_agent(f"reader-{os.getpid()}", ("UCX",), False)
    dst = np.zeros_like(src)
    reader.register_memory(reader.get_reg_descs([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"))
    name = reader.add_remote_agent(target.get_agent_metadata())
    local = reader.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
    remote = reader.prep_xfer_dlist(name, [(src.ctypes.data, src.nbytes, 0)], "DRAM")

    state, _ = _read(reader, local, remote)
    # (its bytes may have arrived already: what waits is the completion, NIXL's flush of the
    # endpoint, which its wireup holds)
    assert state == "PROC", f"the first read completed ({state}) with the target never progressed"
    state, took = _read(reader, local, remote, poll=target.get_new_notifs, limit=10.0)
    assert state == "DONE", f"the first read, target progressed: {state} after {took:.1f} s"
    assert np.array_equal(dst, src)
    dst[:] = 0
    state, took = _read(reader, local, remote, limit=10.0)
    assert state == "DONE", f"a second read, target left alone: {state} after {took:.1f} s"
    assert np.array_equal(dst, src)


def test_vllm_still_configures_its_agent_as_the_loop_does(vllm_python):
    """The loop's stock agents copy vLLM's call: ``nixl_agent_config(num_threads=<4 by
    default>, capture_telemetry=True)``, NIXL's defaults otherwise (a progress thread)."""
    root = subprocess.run(  # found, not imported (importing vLLM takes most of a minute)
        [str(vllm_python), "-c", "import importlib.util as u; print(u.find_spec('vllm').origin)"],
        capture_output=True, text=True, check=True).stdout.strip()
    path = Path(root).parent / "distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py"
    src = path.read_text(encoding="utf-8")
    assert "nixl_agent_config(num_threads=num_threads, capture_telemetry=True)" in src
    assert re.search(r'get_from_extra_config\(\s*"num_threads", 4\s*\)', src)


def test_twenty_fresh_stock_tp2_pairs_each_first_read_at_once(vllm_python, tmp_path):
    """Twenty fresh pairs of stock-configured agents (the vLLM venv's NIXL, a process each),
    each read at once by one kvplan-configured reader, with kvplan's heartbeat right after the
    post: no read misses its 15 s deadline, every byte as the stock rank wrote it."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--runs", "20", "--hb", "--deadline", "15",
         "--stock-python", str(vllm_python)],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = re.search(r"summary: runs (\d+) stuck (\d+) bad_bytes (\d+)", out.stdout)
    assert summary, out.stdout[-3000:] + out.stderr[-3000:]
    runs, stuck, bad = map(int, summary.groups())
    assert (runs, stuck, bad) == (20, 0, 0), out.stdout
