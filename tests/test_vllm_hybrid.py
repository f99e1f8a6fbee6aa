"""KvplanConnector with vLLM's hybrid KV cache manager, in real vLLM CPU engines (0.32.0):
several KV-cache groups sharing one page pool, Mamba2 state at heterogeneous TP, sliding
windows, and MLA judged against vLLM's own NixlConnector.

Tiny models with seeded random float32 weights (tests/vllm_engine.py ``model --kind``):

- ``nemo1`` / ``nemo2``: NemotronH, layers mamba, attention, mamba; Mamba2 of 8 heads x 32 with
  ``n_groups`` 1 (one B/C group: a TP 2 engine holds it on both ranks) or 2 (one per rank);
- ``gemma3``: Gemma 3, a sliding-window layer (window 32) and a full-attention layer, two
  KV-cache groups, blocks of 32 (prompts of 45-70 tokens: the prefill drops its first block);
- ``mla``: DeepSeek-V2-shaped MLA on CPU_MLA.

Decode's greedy tokens must equal the plain run (each token's logprob within 1e-4), a pull
must have been posted and none may have failed (a recompute would also give equal tokens),
and a decode given another prompt's KV must differ. Engines are shared through
tests/vllm_pool.py: three per model (TP 1 prefill and decode, and a TP 2 engine that is the
decode of TP1 -> TP2 and the prefill of TP2 -> TP1), started once per model.
"""

from __future__ import annotations

import re

import pytest

from tests.vllm_pool import (
    check_equal,
    free_base_port,
    pd,
    pd_equals_plain,
    prompt,
    push_equals_plain,
    tails,
)


def _hetero_pairs(pool, key: str, seed: int) -> None:
    """TP1 -> TP1 (with a negative control), TP1 -> TP2 and TP2 -> TP1 on model ``key``."""
    p1, d1, t2 = pool.only(f"{key}-p1", f"{key}-d1", f"{key}-t2")
    for n in (45, 65):  # mid-block, and a state handed over right at a block boundary
        pulls = pd_equals_plain(p1, d1, prompt(seed + n, n), f"{key} P TP1 -> D TP1, {n}")
    assert "groups=" in pulls[-1], pulls
    ids, other = prompt(seed + 1), prompt(seed + 2)
    plain = p1.generate(ids, 16)
    got = pd(p1, d1, ids, prefill_ids=other)
    assert got["tokens"] != plain["tokens"], f"{key}: decode ignored the pulled KV"
    pulls = pd_equals_plain(p1, t2, prompt(seed + 3, 70), f"{key} P TP1 -> D TP2")
    assert {re.search(r"rank=(\d)", x).group(1) for x in pulls[-2:]} == {"0", "1"}, pulls
    pulls = pd_equals_plain(t2, d1, prompt(seed + 4, 70), f"{key} P TP2 -> D TP1")
    assert "peers=[0, 1]" in pulls[-1], pulls  # one decode rank gathers both halves
    # push mode: the prefill writes into the blocks (and state slots) the decode registered,
    # once finished, then layer-wise from its forward (the attention layer when computed, the
    # state regions after the forward's last update)
    for mode, first in (("push", 5), ("layerwise", 8)):
        for i, (p, d) in enumerate(((p1, d1), (p1, t2), (t2, d1))):
            push_equals_plain(p, d, prompt(seed + first + i, 70),
                              f"{key} {mode} {p.name} -> {d.name}", f"{key}-{seed}-{mode}-{i}",
                              mode=mode)


@pytest.mark.engines("nemo1")
def test_mamba2_one_group_replicated_at_tp2(pool):
    # n_groups = 1 < TP 2: both ranks of the TP 2 engine hold the one B/C group
    _hetero_pairs(pool, "nemo1", 100)


@pytest.mark.engines("nemo1")
def test_hybrid_pull_that_fails_is_recomputed_per_request(pool):
    # block ids are per group, so a failed pull reports the request (failed_recving): vLLM
    # recomputes it from position 0 under the recompute policy, and the decode keeps serving
    p1, d1 = pool.only("nemo1-p1", "nemo1-d1")
    ids = prompt(150, 50)
    plain = p1.generate(ids, 16)
    pre = p1.generate(ids, 1, {"do_remote_decode": True})
    params = dict(pre["params"], remote_engine_id="gone", remote_port=free_base_port(1))
    got = d1.generate(ids, 16, params)
    assert got["error"] is None, got
    check_equal(got, plain, "hybrid decode after a failed handshake (policy recompute)")
    assert d1.log_lines(r"kvplan: pull req=\S+ from gone failed")


@pytest.mark.engines("nemo2")
def test_mamba2_two_groups_sharded_at_tp2(pool):
    _hetero_pairs(pool, "nemo2", 200)


@pytest.mark.engines("gemma3")
def test_sliding_window_and_full_attention_groups(pool):
    p1, d1, t2 = pool.only("gemma3-p1", "gemma3-d1", "gemma3-t2")
    for n in (45, 70):  # 70 positions: the window's first block is null on the prefill
        pulls = pd_equals_plain(p1, d1, prompt(300 + n, n), f"gemma3 P TP1 -> D TP1, {n}")
    assert "groups=window+full" in pulls[-1], pulls
    ids = prompt(301)
    plain = p1.generate(ids, 16)
    assert pd(p1, d1, ids, prefill_ids=prompt(302))["tokens"] != plain["tokens"]
    pd_equals_plain(p1, t2, prompt(303, 70), "gemma3 P TP1 -> D TP2")
    push_equals_plain(p1, t2, prompt(307, 70), "gemma3 push P TP1 -> D TP2", "gemma3-push")
    push_equals_plain(p1, t2, prompt(308, 70), "gemma3 layer-wise push P TP1 -> D TP2",
                      "gemma3-layers", mode="layerwise")
    # a prefix-cache hit on decode, in both groups: the second request pulls only its third
    # block of 32 (positions [64, 96)), and still equals its plain run
    shared = prompt(304, 64)
    a, b = shared + prompt(305, 20), shared + prompt(306, 25)
    pd_equals_plain(p1, d1, a, "gemma3 first request")
    pulls = pd_equals_plain(p1, d1, b, "gemma3 second request, sharing 64 positions")
    assert "tokens=[64,96)" in pulls[-1], pulls


#: What NixlConnector logs when its transfer failed (the decode then recomputes: no reference)
NIXL_FAILED = r"NIXL transfer failure"
#: What vllm_pool.Engine raises when an engine gave no answer in REQUEST_TIMEOUT
NO_ANSWER = "no answer to request"


def _nixl_reference(pool, prefill: str, decode: str, ids: list[int], attempts: int = 3) -> dict:
    """NixlConnector's P/D decode of ``ids`` on the engines named ``prefill`` and ``decode``,
    started alone (a third engine beside them slowed the pair on two cores).

    It is tried ``attempts`` times in all: a run whose transfer failed (its handshake has a
    fixed 5 s timeout, which a loaded machine can miss) recomputed locally and is no
    reference; an engine that gave no answer in 240 s (a NixlConnector prefill did once, CI
    of stop 30) is restarted with its peer."""
    why = []
    for _ in range(attempts):
        p, d = pool.only(prefill, decode)
        before = len(d.log_lines(NIXL_FAILED))
        try:
            out = pd(p, d, ids, mode="pull")
        except AssertionError as e:
            if NO_ANSWER not in str(e):
                raise
            why.append(str(e))
            pool.stop(prefill, decode)
            continue
        if len(d.log_lines(NIXL_FAILED)) == before:
            return out
        why.append("NixlConnector's transfer failed")
    raise AssertionError(f"no NixlConnector reference in {attempts} attempts:\n"
                         + "\n".join(why) + tails())


@pytest.mark.engines("mla")
def test_mla_decode_equals_nixl_connectors(pool):
    # vLLM's CPU MLA path gives other tokens after a P/D handover than a plain run, with its
    # own connector too (docs/vllm.md): the reference is NixlConnector on the same engines
    ids = prompt(400, 45)
    ids2 = prompt(401, 70)
    ref = [_nixl_reference(pool, "mla-p1-nixl", "mla-d1-nixl", ids),
           _nixl_reference(pool, "mla-t2-nixl-lease12", "mla-d1-nixl", ids2)]
    p1, d1, t2 = pool.only("mla-p1", "mla-d1", "mla-t2")
    check_equal(pd(p1, d1, ids), ref[0], "MLA P TP1 -> D TP1 against NixlConnector")
    check_equal(pd(t2, d1, ids2), ref[1], "MLA P TP2 -> D TP1 against NixlConnector")
    assert pd(p1, d1, ids, prefill_ids=prompt(402, 45))["tokens"] != ref[0]["tokens"]
