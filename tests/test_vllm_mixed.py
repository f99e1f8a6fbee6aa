"""Mixed fleets (issue 38): a KvplanConnector decode reading from a prefill that runs vLLM
0.32's own NixlConnector, unmodified, through the stock prefill's handshake and notifications
(kvplan_nixl/vllm/nixl_peer.py, kvplan_nixl/serving/pulls.py). Real engines
(tests/vllm_pool.py): the stock prefill is ``llama-p1-nixl`` (NixlConnector, ``kv_both``),
the decode ``llama-d1``.
"""

from __future__ import annotations

import re
import time
import warnings

import pytest

from tests.vllm_pool import FAILED, PULL, check_equal, failures, pd, prompt, tails

#: NixlConnector's own decode's line when its read failed (it then recomputes the request)
NIXL_FAILED = r"NIXL transfer failure"
#: a decode worker's line per pull it read from a NixlConnector prefill and reported
STOCK_DONE = r"kvplan: pull req=\S+ done in \S+ s from NixlConnector prefill"
#: a stock prefill's log lines when a lease ran out, or an error
STOCK_TROUBLE = r"Releasing expired KV blocks| ERROR "
#: a decode's line when a pull missed its transfer deadline
DEADLINE = r"kvplan: pull req=\S+ from \S+ failed .*deadline passed before completion"


def first_read(p, d, ids: list[int]) -> dict:
    """The first pull of ``d`` from a stock prefill ``p`` it did not know: ``pd``, then no
    pull failed, every decode rank read, and nothing expired or went wrong on the prefill
    meanwhile. Tried once more when that read missed its deadline: the first read from a stock
    TP 2 prefill, which makes the UCX connections to two new ranks, hung on one of them in 3 of
    6 runs on two cores (0.017 s in the runs that passed; docs/vllm.md, "A first read that
    hangs"); the decode then recomputed, as it must, and the request is tried again on the
    connections made. The abandoned request's own lines on the prefill (its hung rank, never
    told, frees it when its lease ends) are not held against the second. A second miss fails
    the test; a retry is reported as a warning."""
    abandoned = None
    for attempt in range(2):
        failed, done = len(d.log_lines(FAILED)), len(d.log_lines(STOCK_DONE))
        troubles, missed = len(p.log_lines(STOCK_TROUBLE)), len(d.log_lines(DEADLINE))
        out = pd(p, d, ids, mode="pull")
        if attempt or len(d.log_lines(DEADLINE)) == missed:
            break
        abandoned = re.search(r"remote=(\S+)", d.log_lines(PULL)[-1])[1]
        warnings.warn(f"{d.name}: the first read from {p.name} missed its deadline, tried "
                      f"again: {d.log_lines(DEADLINE)[-1]}", stacklevel=2)
    assert len(d.log_lines(FAILED)) == failed, f"a pull failed{failures(d, failed)}"
    assert len(d.log_lines(STOCK_DONE)) == done + d.tp, f"not every rank read{tails()}"
    trouble = [line for line in p.log_lines(STOCK_TROUBLE)[troubles:]
               if abandoned is None or not re.search(rf"\b{re.escape(abandoned)}\b", line)]
    assert not trouble, f"the stock prefill: {trouble}{p.tail()}"
    return out


@pytest.mark.engines("llama")
def test_a_stock_nixlconnector_prefill_is_read_exactly_by_a_kvplan_decode(pool):
    """Dense Llama, TP 1 -> TP 1: tokens equal the plain run, and the prefill frees each
    request's blocks at the decode's notification, as after its own decode's read. It has 40
    blocks, 3 per request: 16 requests could not be prefilled if it kept them until its
    lease ran out (30 s; vLLM logs "Releasing expired KV blocks" then)."""
    p, d = pool.only("llama-p1-nixl-few", "llama-d1")
    # the session's engines served other tests before: count from here
    failed0, done0 = len(d.log_lines(FAILED)), len(d.log_lines(STOCK_DONE))
    trouble0 = len(p.log_lines(STOCK_TROUBLE))
    for k in range(2):  # the second request reuses the handshake
        ids = prompt(3800 + k, 70)
        plain = p.generate(ids, 16)
        failed, done = len(d.log_lines(FAILED)), len(d.log_lines(STOCK_DONE))
        out = pd(p, d, ids, mode="pull")
        check_equal(out, plain, f"stock prefill -> kvplan decode, request {k}")
        assert len(d.log_lines(FAILED)) == failed, f"a pull failed{failures(d, failed)}"
        assert len(d.log_lines(STOCK_DONE)) == done + 1, f"no pull read{tails()}"
    assert d.log_lines(r"prefill engine \S+ runs vLLM's NixlConnector \(tp 1, backend "
                       r"CPU_ATTN, layout \S+\): rank 0 reads its rank\(s\) \[0\]"), tails()
    t0 = time.monotonic()
    for k in range(14):
        assert pd(p, d, prompt(3810 + k, 70), mode="pull")["error"] is None
    took = time.monotonic() - t0
    assert len(d.log_lines(STOCK_DONE)) == done0 + 16, tails()
    assert len(d.log_lines(FAILED)) == failed0, failures(d, failed0)
    # it took every notification as its own decode's: nothing expired, no request unknown
    # to it ("unrecognized request"), no error at all
    assert not p.log_lines(STOCK_TROUBLE)[trouble0:], p.tail()
    assert took < 30, f"14 requests took {took:.0f} s: the prefill waited for its lease{tails()}"
    # negative control: the prefill computed another prompt; the decode uses what it read
    ids = prompt(3830, 70)
    assert pd(p, d, ids, prefill_ids=prompt(3831, 70), mode="pull")["tokens"] != \
        p.generate(ids, 16)["tokens"], f"the decode did not use the KV it read{tails()}"


@pytest.mark.engines("llama")
@pytest.mark.parametrize(("prefill", "decode"), [("llama-t2-nixl", "llama-d1"),
                                                  ("llama-t2-nixl", "llama-t2"),
                                                  ("llama-p1-nixl-few", "llama-t2")],
                         ids=["tp2-to-tp1", "tp2-to-tp2", "tp1-to-tp2"])
def test_dense_heterogeneous_tp_from_a_stock_prefill(pool, prefill, decode):
    """Dense Llama (2 KV heads): a stock TP 2 prefill read by a TP 1 decode (two ranks read,
    one head each), by a TP 2 decode (rank to rank), and a stock TP 1 prefill by a TP 2 decode
    (both ranks read its one rank, a head each): equal to the plain run. The order shares
    engines: each pair keeps one engine of the one before."""
    p, d = pool.only(prefill, decode)
    ids = prompt(3840 + 2 * p.tp + d.tp, 70)
    plain = p.generate(ids, 16)
    check_equal(first_read(p, d, ids), plain, f"{prefill} -> {decode}")


@pytest.mark.engines("nemo1")
def test_nemotron_n_groups_1_from_a_stock_prefill(pool):
    """Mamba2 with one B/C group, stock prefill TP 1 -> decode TP 2: the B/C group is
    replicated on the decode's ranks, which vLLM's own decode reads as if it were sharded.

    A kvplan decode with its conv state in SD order (vLLM's default here) is refused at the
    handshake, naming the parts, and recomputes; one in DS order (as the stock prefill's)
    equals the plain run; NixlConnector's own decode, reading the same prefill, does not.
    Then the stock TP 2 prefill -> a kvplan TP 1 decode (DS): equal to the plain run."""
    ids = prompt(3700, 70)
    p, d = pool.only("nemo1-p1-nixl", "nemo1-t2")
    refused = r"handshake failed: rank 0: IncompatibleLayoutError: region " \
              r"'model.layers.0.mixer': state parts differs"
    refused0 = len(d.log_lines(refused))
    plain = p.generate(ids, 16)
    out = pd(p, d, ids, mode="pull")
    check_equal(out, plain, "NemotronH stock P TP1 -> kvplan D TP2 (SD), recomputed")
    assert "kvplan_load_failed" in (out["params"] or {}), out
    assert len(d.log_lines(refused)) == refused0 + 2, tails()
    p, d = pool.only("nemo1-p1-nixl", "nemo1-t2-ds")
    failed, done = len(d.log_lines(FAILED)), len(d.log_lines(STOCK_DONE))
    check_equal(pd(p, d, ids, mode="pull"), plain, "NemotronH stock P TP1 -> kvplan D TP2")
    assert len(d.log_lines(FAILED)) == failed, f"a pull failed{failures(d, failed)}"
    assert len(d.log_lines(STOCK_DONE)) == done + 2, f"both decode ranks read{tails()}"
    p, d = pool.only("nemo1-p1-nixl", "nemo1-t2-nixl")
    for _ in range(3):  # a read it failed (its 5 s handshake, on loaded cores) recomputed
        failed = len(d.log_lines(NIXL_FAILED))
        stock = pd(p, d, ids, mode="pull")
        if len(d.log_lines(NIXL_FAILED)) == failed:
            break
    else:
        raise AssertionError(f"NixlConnector's own decode never read the prefill{tails()}")
    print(f"NixlConnector's own decode: {stock['tokens']}, the plain run: {plain['tokens']}")
    assert stock["tokens"] != plain["tokens"], (
        "vLLM's own decode read this pair right: the contrast this test shows is gone "
        f"({stock['tokens']}){tails()}")
    p, d = pool.only("nemo1-t2-nixl", "nemo1-d1-ds")
    ids = prompt(3701, 70)
    plain = p.generate(ids, 16)
    check_equal(first_read(p, d, ids), plain, "NemotronH stock P TP2 -> kvplan D TP1")




#: a stock prefill's log line when a request's lease ran out before it was told the request
#: was read (its ``kv_lease_duration``)
EXPIRED = r"Releasing expired KV blocks"


@pytest.mark.engines("gemma3")
def test_sliding_window_from_a_stock_prefill(pool):
    """Gemma 3 (a sliding window of 32 beside full attention), stock TP 1 -> kvplan TP 2: the
    window's list offsets, which NixlConnector does not hand, are derived from
    ``remote_num_tokens``; 70 tokens, so the window's first block is clipped."""
    p, d = pool.only("gemma3-p1-nixl", "gemma3-t2")
    ids = prompt(3901, 70)
    plain = p.generate(ids, 16)
    failed, done = len(d.log_lines(FAILED)), len(d.log_lines(STOCK_DONE))
    trouble = len(p.log_lines(STOCK_TROUBLE))
    check_equal(pd(p, d, ids, mode="pull"), plain, "gemma3 stock P TP1 -> kvplan D TP2")
    assert len(d.log_lines(FAILED)) == failed, f"a pull failed{failures(d, failed)}"
    assert len(d.log_lines(STOCK_DONE)) == done + 2, f"not every rank read{tails()}"
    assert not p.log_lines(STOCK_TROUBLE)[trouble:], p.tail()


@pytest.mark.parametrize(("prefill", "decode"), [
    pytest.param("eagle-p1-nixl", "eagle-t2-few", marks=pytest.mark.engines("eagle")),
    pytest.param("nemo2-p1-nixl", "nemo2-t2-ds", marks=pytest.mark.engines("nemo2")),
], ids=["eagle3-draft", "nemotron-n-groups-2"])
def test_other_models_from_a_stock_prefill(pool, prefill, decode):
    """Stock TP 1 -> kvplan TP 2, equal to the plain run: a Llama of 4 KV heads with an
    EAGLE-3 draft of 2 (the draft's regions are in the stock metadata beside the main
    model's, and the decode speculates 2 tokens), and NemotronH with two B/C groups (one per
    decode rank: sharded, not replicated as with one group)."""
    p, d = pool.only(prefill, decode)
    ids = prompt(3950, 70)
    plain = p.generate(ids, 16)
    failed, done = len(d.log_lines(FAILED)), len(d.log_lines(STOCK_DONE))
    check_equal(pd(p, d, ids, mode="pull"), plain, f"{prefill} -> {decode}")
    assert len(d.log_lines(FAILED)) == failed, failures(d, failed)
    assert len(d.log_lines(STOCK_DONE)) == done + 2, tails()


@pytest.mark.engines("mla")
def test_mla_from_a_stock_prefill_equals_its_own_decode(pool):
    """MLA, stock TP 2 -> kvplan TP 1: the latent is replicated, so the decode reads rank 0
    alone and tells rank 1 ``<id>:1`` right after posting. The prefill's lease is 12 s: had
    rank 1 not been told, it would log that it released the request's blocks unread once the
    lease ran out. The second request is the one checked (the first one's handshake, before
    which no decode can send heartbeats, is no part of what is checked).

    vLLM's CPU MLA decodes other tokens after a handover than in a plain run, with its own
    connector too (test_vllm_hybrid), so the reference is NixlConnector's own decode on the
    same prefill, run after.

    The decode lists the prefill in ``stock_prefills`` as ``/tp2``: rank 0's latent is the
    same at TP 1 and 2, so a claim of 2 from an unlisted prefill is refused unverified
    (``NixlTpSizeUnverified``: asking a TP 1 prefill for rank 1 kills vLLM's listener)."""
    p, d = pool.only("mla-t2-nixl-lease12", "mla-d1-stockt2")
    failed, done = len(d.log_lines(FAILED)), len(d.log_lines(STOCK_DONE))
    pd(p, d, prompt(3904, 70), mode="pull")  # the handshake
    ids = prompt(3902, 70)
    ours = pd(p, d, ids, mode="pull")
    assert len(d.log_lines(FAILED)) == failed, failures(d, failed)
    assert len(d.log_lines(STOCK_DONE)) == done + 2, tails()
    assert d.log_lines(r"rank 0 reads its rank\(s\) \[0\]"), tails()
    remote = re.search(r"remote=(\S+)", d.log_lines(r"kvplan: pull req=\S+ remote=")[-1])[1]
    time.sleep(13)  # past the lease
    assert not p.log_lines(rf"({EXPIRED} for|unrecognized) request {re.escape(remote)}\b"), \
        f"the prefill did not take our notifications for {remote}{tails()}"
    p, s = pool.only("mla-t2-nixl-lease12", "mla-d1-nixl")
    stock = pd(p, s, ids, mode="pull")
    check_equal(ours, stock, "MLA stock P TP2 -> kvplan D TP1, against vLLM's own decode")
    assert pd(p, s, ids, prefill_ids=prompt(3903, 70), mode="pull")["tokens"] != \
        stock["tokens"], f"the reference decode did not use the KV it read{tails()}"
