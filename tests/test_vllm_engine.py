"""KvplanConnector inside real vLLM engines (vLLM's CPU build, 0.32.0): prefill and decode are
separate engine processes that move KV over NIXL/UCX on loopback.

Every engine is a child process of the vLLM venv's python running tests/vllm_engine.py (the
venv is built once by tests/vllm_env.py; the tests skip, saying why, where it cannot be
installed). A tiny Llama with random float32 weights (fixed seed, written locally) makes the
greedy tokens depend on the KV they decode from. The plain run of a prompt is the prefill
engine generating it alone; decode's tokens after a pull must equal it, and a decode given
another prompt's KV must not.

Engines come from tests/vllm_pool.py: shared across tests (started on first use, stopped when
a test needs the cores or memory), pinned to cores, one log per start kept under the test's
temporary directory; a failing assertion shows the tail and the first error of every live
engine's log. Every process is killed on teardown (each engine runs in its own session,
killed as a group).
"""

from __future__ import annotations

import re
import signal
import sys
import time

import pytest

from tests.vllm_pool import (
    PULL,
    check_equal,
    free_base_port,
    pd,
    pd_equals_plain,
    pd_push,
    prompt,
    push_equals_plain,
    push_params,
    tails,
    wait_lines,
)

pytestmark = pytest.mark.engines("llama")


def test_tp1_to_tp1_equals_plain_run(pool):
    p1, d1 = pool.only("llama-p1", "llama-d1")
    pulls = pd_equals_plain(p1, d1, prompt(1), "P TP1 -> D TP1")
    # the decode worker really pulled: its connector logged the plan it posted
    # CPU_ATTN pages move whole: 2 blocks of 32 for the 45 positions
    assert pulls and "blocks=2 tokens=[0,64)" in pulls[-1] and "prompt=45" in pulls[-1], pulls
    assert d1.log_lines(r"kvplan: rank 0 registered 2 regions \(attention; backend CPU_ATTN, "
                        r"layouts LBHSND, groups full, 1 buffers")


def test_negative_control_other_prompts_kv_differs(pool):
    p1, d1 = pool.only("llama-p1", "llama-d1")
    ids, other = prompt(2), prompt(3)
    plain = p1.generate(ids, 16)
    got = pd(p1, d1, ids, prefill_ids=other)  # decode reads the KV of another prompt
    assert got["tokens"] != plain["tokens"], f"decode ignored the pulled KV{tails()}"


def test_prefix_cache_hit_on_decode_pulls_only_missing_blocks(pool):
    p1, d1 = pool.only("llama-p1", "llama-d1")
    shared = prompt(4, 64)  # two whole blocks of 32
    a, b = shared + prompt(5, 20), shared + prompt(6, 25)
    plain_b = p1.generate(b, 16)
    check_equal(pd(p1, d1, a), p1.generate(a, 16), "first request")
    before = len(d1.log_lines(PULL))
    check_equal(pd(p1, d1, b), plain_b, "second request, sharing 64 positions")
    pulls = d1.log_lines(PULL)
    assert len(pulls) == before + 1, pulls
    first, second = pulls[-2], pulls[-1]
    assert "blocks=3 tokens=[0,96)" in first, first
    assert "blocks=1 tokens=[64,96)" in second, second  # decode held 64 positions already
    nbytes = [int(re.search(r"bytes=(\d+)", x).group(1)) for x in (first, second)]
    assert nbytes[0] == 3 * nbytes[1]  # one block of three


def test_unreachable_prefill_is_recomputed(pool):
    p1, d1 = pool.only("llama-p1", "llama-d1")
    ids = prompt(7)
    plain = p1.generate(ids, 16)
    pre = p1.generate(ids, 1, {"do_remote_decode": True})
    params = dict(pre["params"], remote_engine_id="gone", remote_port=free_base_port(1))
    t0 = time.monotonic()
    got = d1.generate(ids, 16, params)
    assert got["error"] is None, got
    check_equal(got, plain, "decode after a failed handshake (policy recompute)")
    assert time.monotonic() - t0 < 60
    assert d1.log_lines(r"kvplan: pull req=\S+ from gone failed \(handshake failed: rank 0: "
                        r"SideChannelError: .*Connection refused")


def test_tp1_to_tp2_equals_plain_run(pool):
    p1, _, d2 = pool.only("llama-p1", "llama-d1", "llama-t2")
    pulls = pd_equals_plain(p1, d2, prompt(8, 70), "P TP1 -> D TP2")
    assert {re.search(r"rank=(\d)", x).group(1) for x in pulls} == {"0", "1"}, pulls


def test_push_equals_plain_run_at_tp1_and_tp2(pool):
    # the decode registers first, the prefill writes its blocks (push mode, chosen per request)
    p1, d1, t2 = pool.only("llama-p1", "llama-d1", "llama-t2")
    released = len(p1.log_lines(r"kvplan: prefill req=\S+ released$"))
    done = push_equals_plain(p1, d1, prompt(20), "push P TP1 -> D TP1", "push-a")
    assert "written by prefill rank(s) [0]" in done[0], done
    # the bytes a pull of a prompt as long moves: 2 blocks of 32 (the pages move whole)
    pull = pd_equals_plain(p1, d1, prompt(19), "pull of a prompt as long")[-1]
    assert re.search(r"bytes=(\d+)", done[0]).group(1) == re.search(r"bytes=(\d+)",
                                                                     pull).group(1)
    push_equals_plain(p1, t2, prompt(21, 70), "push P TP1 -> D TP2", "push-b")
    done = push_equals_plain(t2, d1, prompt(22, 70), "push P TP2 -> D TP1", "push-c")
    assert "written by prefill rank(s) [0, 1]" in done[0], done  # both halves
    # a decode written with another prompt's KV generates other tokens
    ids = prompt(23)
    got = pd_push(p1, d1, ids, "push-d", prefill_ids=prompt(24))
    assert got["tokens"] != p1.generate(ids, 16)["tokens"], f"push ignored{tails()}"
    # layer-wise: each layer written from the prefill's forward as soon as it is computed
    for i, (p, d) in enumerate(((p1, d1), (p1, t2), (t2, d1))):
        push_equals_plain(p, d, prompt(26 + i, 70), f"layer-wise {p.name} -> {d.name}",
                          f"layers-{i}", mode="layerwise")
    ids = prompt(29)
    got = pd_push(p1, d1, ids, "layers-neg", prefill_ids=prompt(30), mode="layerwise")
    assert got["tokens"] != p1.generate(ids, 16)["tokens"], f"layer-wise push ignored{tails()}"
    # the prefill's holds ended with their writes (and the pull's CONFIRM): blocks freed
    deadline = time.monotonic() + 30
    while len(p1.log_lines(r"kvplan: prefill req=\S+ released$")) < released + 7:
        assert time.monotonic() < deadline, f"prefill never released pushed blocks{tails()}"
        time.sleep(0.5)


def test_tp2_to_tp1_equals_plain_run_then_prefill_killed(pool):
    _, d1, p2 = pool.only("llama-p1", "llama-d1", "llama-t2")
    pulls = pd_equals_plain(p2, d1, prompt(9, 70), "P TP2 -> D TP1")
    assert "peers=[0, 1]" in pulls[-1], pulls  # one decode rank gathers both halves
    # both prefill ranks released the request when decode's CONFIRM arrived
    deadline = time.monotonic() + 30
    while len(p2.log_lines(r"kvplan: prefill req=\S+ released$")) < 2:
        assert time.monotonic() < deadline, f"prefill never released its blocks{tails()}"
        time.sleep(0.5)
    # prefill dies after handing out its params: decode recovers by recomputing, no hang
    ids2 = prompt(10, 70)
    plain2 = p2.generate(ids2, 16)
    pre = p2.generate(ids2, 1, {"do_remote_decode": True})
    p2.kill()
    t0 = time.monotonic()
    got = d1.generate(ids2, 16, dict(pre["params"]))
    assert got["error"] is None, got
    check_equal(got, plain2, "decode after its prefill was killed (policy recompute)")
    assert time.monotonic() - t0 < 90
    assert d1.log_lines(r"kvplan: pull req=\S+ from \S+ failed")
    assert d1.generate(prompt(11), 4)["error"] is None  # decode still serves


def _push_cut_off(p1, d1, ids: list[int], key: str, cut) -> None:
    """A push decode of ``ids`` whose prefill ``cut()`` hits right after the registration
    reached it: the decode recomputes at its deadline (push_timeout_s 20 + handshake_timeout_s
    8), equal to the plain run, never generating from blocks nobody wrote."""
    plain = p1.generate(ids, 16)
    seen = len(p1.log_lines(rf"push registration of \S+ req=\S+ key={key} at"))
    rid = d1.submit(ids, 16, push_params(p1, key))
    wait_lines(p1, rf"push registration of \S+ req=\S+ key={key} at", seen + 1)
    cut()
    got = d1.collect(rid)
    assert got["error"] is None, got
    check_equal(got, plain, f"push decode after its prefill was cut off ({key}, recompute)")
    assert d1.log_lines(r"kvplan: push req=\S+ from \S+ failed \(prefill rank\(s\) \[0\] did "
                        r"not write within")
    assert d1.generate(prompt(11), 4)["error"] is None  # decode still serves


def test_push_prefill_stalled_past_the_window_never_writes_late(pool):
    # the prefill freezes (SIGSTOP) after the decode registered: the decode gives up at its
    # deadline and recomputes; the prefill, resumed later, finds the registration's window
    # closed and never writes into blocks the decode has given up (and reused)
    p1, d1 = pool.only("llama-p1", "llama-d1")
    ids = prompt(31)
    try:
        _push_cut_off(p1, d1, ids, "push-stalled", lambda: p1.signal(signal.SIGSTOP))
    finally:
        p1.signal(signal.SIGCONT)
    pre = p1.generate(ids, 1, {"do_remote_decode": True, "transfer_mode": "layerwise",
                               "transfer_id": "push-stalled"})
    assert pre["error"] is None, pre
    assert d1.generate(prompt(32), 16)["tokens"] == p1.generate(prompt(32), 16)["tokens"]
    # the registration expired unused, and nothing was written to the decode's request
    reg = p1.log_lines(r"push registration of \S+ req=\S+ key=push-stalled at")[-1]
    dreq = re.search(r"req=(\S+) key=", reg).group(1)
    assert p1.log_lines(r"key=push-stalled expired"), f"registration never expired{tails()}"
    assert not p1.log_lines(rf"kvplan: push req=\S+ .*to \S+ req={re.escape(dreq)} "), \
        f"the prefill wrote after the decode gave up{tails()}"


def test_push_prefill_killed_after_registration_is_recomputed(pool):
    # the decode registered its blocks, then the prefill died: it never writes
    p1, d1 = pool.only("llama-p1", "llama-d1")
    _push_cut_off(p1, d1, prompt(25), "push-killed", p1.kill)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
