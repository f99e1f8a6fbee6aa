"""A rolling upgrade across vLLM versions: KvplanConnector engines of vLLM 0.31.0 (the venv of
tests/vllm_env.py ``PREVIOUS``) beside engines of 0.32.0, each pair in both directions, with
the same harness (tests/vllm_engine.py) and this checkout's connector in both.

Each mixed pair must equal the plain run (and the plain runs of the two versions must equal
each other: the same float32 model), its KV read over NIXL and confirmed, never recomputed
(no failed pull or push, no ``kvplan_load_failed`` in the decode's params), and the decode's
log must say the pair is mixed (kvplan_nixl/vllm/versions.py checked it at handshake). The
negative control of tests/test_vllm_engine.py holds across versions too: the decode given
another prompt's KV answers other tokens.

Engines: the group ``upgrade`` runs right after ``llama`` (tests/conftest.py GROUPS), so its
0.32 engines (``llama-p1``, ``llama-d1``) are the ones the dense Llama's tests started,
parked; the 0.31 ones (``-v31``: tests/vllm_pool.py VARIANTS, SETS ``upgrade``) start here.
"""

from __future__ import annotations

import pytest

from tests.vllm_pool import (
    FAILED,
    PULL,
    Engine,
    check_equal,
    failures,
    pd,
    pd_push,
    prompt,
    push_equals_plain,
    tails,
)

pytestmark = pytest.mark.engines("upgrade")

#: a decode rank's line for a pull the prefill confirmed, or reported inside its LEASE (the
#: prefill vouched before the read ended; tests/test_vllm_restart.py's)
DONE = r"kvplan: pull req=\S+ done in \S+ s, (confirmed by|inside its lease on) prefill"


def mixed(e: Engine, local: str, remote: str) -> int:
    """How many times ``e`` logged a peer of vLLM ``remote`` checked at handshake."""
    return len(e.log_lines(rf"kvplan: engine \S+ rank \d+ runs vLLM {remote}, this engine "
                           rf"{local}: a mixed pair, read exactly"))


def pulled(p: Engine, d: Engine, ids: list[int], plain: dict, what: str) -> None:
    """P -> D in pull mode equals ``plain``: read and confirmed on every decode rank, no pull
    failed, nothing recomputed."""
    failed, done, posted = (len(d.log_lines(x)) for x in (FAILED, DONE, PULL))
    out = pd(p, d, ids)
    check_equal(out, plain, what)
    assert "kvplan_load_failed" not in (out["params"] or {}), f"{what}: recomputed: {out}"
    assert len(d.log_lines(FAILED)) == failed, f"{what}: a pull failed{failures(d, failed)}"
    assert len(d.log_lines(PULL)) > posted, f"{what}: the decode posted no pull{tails()}"
    assert len(d.log_lines(DONE)) == done + d.tp, f"{what}: not confirmed{tails()}"


def test_pull_across_versions_both_ways_equals_the_plain_run(pool, vllm_previous):
    old_p, new_d = pool.only("llama-p1-v31", "llama-d1")
    ids = prompt(4401)
    plain = old_p.generate(ids, 16)
    check_equal(new_d.generate(ids, 16), plain, "plain runs of vLLM 0.31 and 0.32")
    seen = mixed(new_d, "0.32.0", "0.31.0")
    pulled(old_p, new_d, ids, plain, "pull P 0.31 -> D 0.32")
    assert mixed(new_d, "0.32.0", "0.31.0") > seen, f"no mixed pair checked{tails()}"
    ids2 = prompt(4402)
    got = pd(old_p, new_d, ids2, prefill_ids=prompt(4403))  # another prompt's KV read
    assert got["tokens"] != old_p.generate(ids2, 16)["tokens"], f"KV ignored{tails()}"

    new_p, old_d = pool.only("llama-p1", "llama-d1-v31")
    ids = prompt(4404)
    plain = new_p.generate(ids, 16)
    check_equal(old_d.generate(ids, 16), plain, "plain runs of vLLM 0.32 and 0.31")
    seen = mixed(old_d, "0.31.0", "0.32.0")
    pulled(new_p, old_d, ids, plain, "pull P 0.32 -> D 0.31")
    assert mixed(old_d, "0.31.0", "0.32.0") > seen, f"no mixed pair checked{tails()}"
    got = pd(new_p, old_d, ids2, prefill_ids=prompt(4403))
    assert got["tokens"] != new_p.generate(ids2, 16)["tokens"], f"KV ignored{tails()}"


def test_pull_across_versions_at_hetero_tp_both_ways(pool, vllm_previous):
    """A TP 2 prefill of one version read by a TP 1 decode of the other, one plan reading both
    of its ranks (heterogeneous TP across an upgrade), both directions: equal to the plain
    run, read and confirmed, never recomputed, the pair checked as mixed; and the negative
    control (another prompt's KV gives other tokens)."""
    for p_name, d_name, p_ver, d_ver, seed in (("llama-t2-v31", "llama-d1", "0.31.0", "0.32.0",
                                                4430),
                                               ("llama-t2", "llama-d1-v31", "0.32.0", "0.31.0",
                                                4433)):
        p, d = pool.only(p_name, d_name)
        ids = prompt(seed)
        plain = p.generate(ids, 16)
        check_equal(d.generate(ids, 16), plain, f"plain runs of vLLM {p_ver} TP 2 and {d_ver}")
        seen = mixed(d, d_ver, p_ver)
        pulled(p, d, ids, plain, f"pull P {p_ver} TP 2 -> D {d_ver} TP 1")
        assert mixed(d, d_ver, p_ver) > seen, f"no mixed pair checked{tails()}"
        ids2 = prompt(seed + 1)
        got = pd(p, d, ids2, prefill_ids=prompt(seed + 2))
        assert got["tokens"] != p.generate(ids2, 16)["tokens"], f"KV ignored{tails()}"


def test_push_and_layerwise_across_versions_both_ways(pool, vllm_previous):
    """The decode registers first, the prefill writes (whole after its forward, or layer by
    layer from it): both directions, each equal to the plain run and written on the decode."""
    old_p, new_d = pool.only("llama-p1-v31", "llama-d1")
    done = push_equals_plain(old_p, new_d, prompt(4410), "push P 0.31 -> D 0.32", "up-push-a")
    assert "written by prefill rank(s) [0]" in done[0], done
    push_equals_plain(old_p, new_d, prompt(4411, 70), "layer-wise P 0.31 -> D 0.32",
                      "up-layers-a", mode="layerwise")
    ids = prompt(4412)
    got = pd_push(old_p, new_d, ids, "up-push-neg", prefill_ids=prompt(4413))
    assert got["tokens"] != old_p.generate(ids, 16)["tokens"], f"push ignored{tails()}"
    new_p, old_d = pool.only("llama-p1", "llama-d1-v31")
    push_equals_plain(new_p, old_d, prompt(4414), "push P 0.32 -> D 0.31", "up-push-b")
    push_equals_plain(new_p, old_d, prompt(4415, 70), "layer-wise P 0.32 -> D 0.31",
                      "up-layers-b", mode="layerwise")
    # the prefill checked the decode it writes to: a push connects the other way round
    assert mixed(new_p, "0.32.0", "0.31.0") and mixed(old_p, "0.31.0", "0.32.0"), tails()


def test_a_stock_nixlconnector_prefill_of_the_previous_vllm_read_by_a_kvplan_decode(
        pool, vllm_previous):
    """A migration and an upgrade at once: vLLM 0.31's own NixlConnector prefill, read by a
    KvplanConnector decode of 0.32. vLLM's own 0.32 decode refuses it (its compatibility hash
    names vLLM 0.31.0 and connector version 13, tests/test_vllm_versions.py); the kvplan decode
    accepts the hash of each version versions.py lists and reads 0.31's ``NixlAgentMetadata``
    (no ``ple_block_len``) with 0.32's class: equal to the plain run, every rank read, the
    prefill troubled by nothing (its blocks freed at the decode's notification)."""
    from tests.test_vllm_mixed import first_read

    p, d = pool.only("llama-p1-nixl-v31", "llama-d1")
    for seed in (4420, 4421):
        ids = prompt(seed)
        out = first_read(p, d, ids)
        check_equal(out, p.generate(ids, 16), f"stock P 0.31 -> kvplan D 0.32 ({seed})")
        assert "kvplan_load_failed" not in (out["params"] or {}), f"recomputed: {out}"
    ids = prompt(4422)
    got = pd(p, d, ids, prefill_ids=prompt(4423), mode="pull")  # the negative control
    assert got["tokens"] != p.generate(ids, 16)["tokens"], f"KV ignored{tails()}"
