"""The transfer digest inside real vLLM engines (vLLM's CPU build): a push checked by it equals
the plain run, a layer-wise one is written whole and checked too, and so is a pull (the
prefill's digest of what the decode read, asked before its CONFIRM). A corrupted byte is shown
failing by tests/test_digest.py and tests/test_pull_digest.py (the connector's own checks over
real NIXL agents; no engine can be made to flip one).

Engines from tests/vllm_pool.py (see tests/test_vllm_engine.py); run under
``flock /tmp/vllm-engines.lock nice``.
"""

from __future__ import annotations

import pytest

from tests.vllm_pool import (
    FAILED,
    LAYERED,
    PULL,
    check_equal,
    failures,
    pd,
    pd_push,
    prompt,
    push_equals_plain,
    tails,
)

pytestmark = pytest.mark.engines("llama")

SIGNED = r"kvplan: push req=\S+ digest of \d+ bytes to decode rank\(s\) \[0\] in"
VERIFIED = r"kvplan: push req=\S+ rank=0 digest verified: \d+ bytes from prefill rank\(s\) \[0\]"
PULL_SIGNED = r"kvplan: pull req=\S+ digest of \d+ bytes for \S+ req=\S+ rank 0 in"
PULL_VERIFIED = (r"kvplan: pull req=\S+ rank=0 digest verified: \d+ bytes from prefill "
                 r"rank\(s\) \[0\]")


def test_digest_push_and_pull_equal_plain(pool):
    p1, d1 = pool.only("llama-p1-digest", "llama-d1-digest")
    signed, verified = len(p1.log_lines(SIGNED)), len(d1.log_lines(VERIFIED))
    push_equals_plain(p1, d1, prompt(40), "push P TP1 -> D TP1 with the digest", "digest-a")
    assert len(p1.log_lines(SIGNED)) == signed + 1, f"the prefill signed no PUSHED{tails()}"
    assert len(d1.log_lines(VERIFIED)) == verified + 1, f"the decode verified nothing{tails()}"
    # layer-wise: written whole after the forward (the digest is of the finished KV), checked
    ids, layered = prompt(42, 70), len(p1.log_lines(LAYERED))
    plain = p1.generate(ids, 16)
    check_equal(pd_push(p1, d1, ids, "digest-lw", mode="layerwise"), plain,
                "layer-wise push with the digest (written whole)")
    assert len(p1.log_lines(LAYERED)) == layered, f"written layer-wise, unchecked{tails()}"
    assert len(d1.log_lines(VERIFIED)) == verified + 2, f"not verified{tails()}"
    # a pull: the prefill digests what the decode read, the decode checks it before CONFIRM
    ids = prompt(41)
    plain = p1.generate(ids, 16)
    failed, pulls = len(d1.log_lines(FAILED)), len(d1.log_lines(PULL))
    signed, verified = len(p1.log_lines(PULL_SIGNED)), len(d1.log_lines(PULL_VERIFIED))
    check_equal(pd(p1, d1, ids), plain, "pull P TP1 -> D TP1 with the digest")
    assert len(d1.log_lines(PULL)) == pulls + 1, f"no pull posted{tails()}"
    assert len(p1.log_lines(PULL_SIGNED)) == signed + 1, f"the prefill digested nothing{tails()}"
    assert len(d1.log_lines(PULL_VERIFIED)) == verified + 1, f"pull not verified{tails()}"
    assert len(d1.log_lines(FAILED)) == failed, f"the pull failed{failures(d1, failed)}"
