"""A KvplanConnector prefill restarted in place under real vLLM engines (issue 44 item 1, its
blocker B1): stopped, or SIGKILLed, and started again with the same ``engine_id`` and side
channel ports between requests, while the decode runs on. Every later request must load its
KV from the new prefill (a confirmed pull, no load failure: not recomputed) and decode the
plain run's tokens. docs/vllm.md, "Restarts in place".

Before the fix, a prefill stopped gracefully sent its close notice, the decode dropped the
peer but kept the engine's handshake READY, and every later request failed its load with
``NotConnectedError`` (recomputed) until the decode itself restarted.
"""

from __future__ import annotations

import time

import pytest

from tests.vllm_pool import check_equal, failures, pd, prompt

DONE = r"kvplan: pull req=\S+ done in \S+ s, (confirmed by|inside its lease on) prefill"
POLICY = r"its blocks go to vLLM's kv_load_failure_policy"
AGAIN = r"connecting the prefill afresh and posting once more"
GONE = r"went \(peer closed its endpoint\): the next request naming it connects afresh"


def loaded(p, d, seed: int, what: str) -> float:
    """The plain run of a new prompt on ``p``, then P -> D: equal tokens, one confirmed pull
    more on the decode and no load failure. The seconds P -> D took."""
    ids = prompt(seed)
    plain = p.generate(ids, 16)
    done, failed = len(d.log_lines(DONE)), len(d.log_lines(POLICY))
    t0 = time.monotonic()
    out = pd(p, d, ids)
    took = time.monotonic() - t0
    check_equal(out, plain, what)
    assert len(d.log_lines(POLICY)) == failed, f"{what}: recomputed{failures(d, failed)}"
    assert len(d.log_lines(DONE)) == done + 1, f"{what}: no confirmed pull{failures(d, 0)}"
    return took


@pytest.mark.engines("llama")
def test_a_prefill_restarted_in_place_is_read_by_every_later_request(pool):
    p, d = pool.only("llama-p1-fixed", "llama-d1")
    port = p.port
    assert p.engine_id == "prefill-fixed"
    times = {"before": loaded(p, d, 4401, "before any restart")}
    for n, kill in enumerate((False, True)):
        how = "SIGKILL" if kill else "stop"
        p = pool.restart("llama-p1-fixed", kill=kill)
        assert (p.engine_id, p.port) == ("prefill-fixed", port)
        for i in range(2):
            times[f"{how} {i}"] = loaded(p, d, 4410 + 10 * n + i, f"request {i} after a {how}")
    print(f"\nP -> D seconds: { {k: round(v, 2) for k, v in times.items()} }; decode: "
          f"{len(d.log_lines(GONE))} close notice(s) seen, {len(d.log_lines(AGAIN))} "
          "request(s) posted again after a fresh handshake")
