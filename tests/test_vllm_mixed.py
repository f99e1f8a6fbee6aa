"""Mixed fleets (issue 38): a KvplanConnector decode reading from a prefill that runs vLLM
0.32's own NixlConnector, unmodified, through the stock prefill's handshake and notifications
(kvplan_nixl/vllm/nixl_peer.py, pulling.py). Real engines (tests/vllm_pool.py): the stock
prefill is ``llama-p1-nixl`` (NixlConnector, ``kv_both``), the decode ``llama-d1``.
"""

from __future__ import annotations

import time

import pytest

from tests.vllm_pool import FAILED, check_equal, engine_pool, pd, prompt, tails

#: a decode worker's line per pull it read from a NixlConnector prefill and reported
STOCK_DONE = r"kvplan: pull req=\S+ done in \S+ s from NixlConnector prefill"


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with engine_pool(tmp_path_factory, "mixed") as p:
        yield p


def test_a_stock_nixlconnector_prefill_is_read_exactly_by_a_kvplan_decode(pool):
    """Dense Llama, TP 1 -> TP 1: tokens equal the plain run, and the prefill frees each
    request's blocks at the decode's notification, as after its own decode's read. It has 40
    blocks, 3 per request: 16 requests could not be prefilled if it kept them until its
    lease ran out (30 s; vLLM logs "Releasing expired KV blocks" then)."""
    p, d = pool.only("llama-p1-nixl-few", "llama-d1")
    for k in range(2):  # the second request reuses the handshake
        ids = prompt(3800 + k, 70)
        plain = p.generate(ids, 16)
        failed, done = len(d.log_lines(FAILED)), len(d.log_lines(STOCK_DONE))
        out = pd(p, d, ids, mode="pull")
        check_equal(out, plain, f"stock prefill -> kvplan decode, request {k}")
        assert len(d.log_lines(FAILED)) == failed, f"a pull failed{tails()}"
        assert len(d.log_lines(STOCK_DONE)) == done + 1, f"no pull read{tails()}"
    assert d.log_lines(r"prefill engine \S+ runs vLLM's NixlConnector \(tp 1, backend "
                       r"CPU_ATTN, layout \S+\): rank 0 reads its rank\(s\) \[0\]"), tails()
    t0 = time.monotonic()
    for k in range(14):
        assert pd(p, d, prompt(3810 + k, 70), mode="pull")["error"] is None
    took = time.monotonic() - t0
    assert len(d.log_lines(STOCK_DONE)) == 16 and not d.log_lines(FAILED), tails()
    # it took every notification as its own decode's: nothing expired, no request unknown
    # to it ("unrecognized request"), no error at all
    assert not p.log_lines(r"Releasing expired KV blocks| ERROR "), p.tail()
    assert took < 30, f"14 requests took {took:.0f} s: the prefill waited for its lease{tails()}"


def test_nemotron_n_groups_1_from_a_stock_prefill_at_tp1_to_tp2(pool):
    """Mamba2 with one B/C group, stock prefill TP 1 -> decode TP 2: the B/C group is
    replicated on the decode's ranks, which vLLM's own decode reads as if it were sharded.
    The kvplan decode (conv state in DS order, as the stock prefill's) equals the plain run;
    NixlConnector's own decode, reading the same prefill, does not."""
    ids = prompt(3700, 70)
    p, d = pool.only("nemo1-p1-nixl", "nemo1-t2-ds")
    plain = p.generate(ids, 16)
    failed = len(d.log_lines(FAILED))
    check_equal(pd(p, d, ids, mode="pull"), plain, "NemotronH stock P TP1 -> kvplan D TP2")
    assert len(d.log_lines(FAILED)) == failed, f"a pull failed{tails()}"
    assert len(d.log_lines(STOCK_DONE)) == 2, f"both decode ranks read{tails()}"
    p, d = pool.only("nemo1-p1-nixl", "nemo1-t2-nixl")
    stock = pd(p, d, ids, mode="pull")
    assert stock["tokens"] != plain["tokens"], (
        "vLLM's own decode read this pair right: the contrast this test shows is gone "
        f"({stock['tokens']}){tails()}")
