"""KvplanConnector with speculative decoding: a main model and an EAGLE-3 draft whose KV-cache
layer has another KV head count, in one KV-cache group (vLLM's ``UniformTypeKVCacheSpecs``),
through real vLLM CPU engines (issue 35, vLLM PR 44583's case).

What runs here (float32, CPU_ATTN for every layer): a tiny Llama of 4 layers x 4 KV heads and
its EAGLE-3 draft of 2 KV heads (tests/vllm_engine.py ``llama-eagle3``), speculative decoding
(2 draft tokens) on both engines, P TP1 -> D TP2 and P TP2 -> D TP1. Judged by bytes: after
the decode, every engine's KV cache is dumped and each block of the prompt the decode did not
compute itself must hold, in every layer, the draft's included, exactly the prefill's pages
(the heads of all ranks of a side side by side: the placement); the pull's byte count must be
the main layers' plus the draft's own 2 heads (with the main model's 4, the count the
connector used to give every layer, it is larger), and the draft layer must be registered.
A negative control: a decode given another prompt's KV holds other draft pages.

The issue's own case, an MLA main (4 layers of DeepSeek-V2 shape) with the same GQA draft
(``mlaeagle``: MLA replicated, the draft's heads split), is the same test in bfloat16 with
blocks of 128, P TP1 -> D TP1 as well: vLLM's CPU build runs it only with AMX (AMX_MLA beside
CPU_ATTN; in float32 CPU_MLA takes blocks of 16 and CPU_ATTN multiples of 32: "No common block
size", docs/vllm.md), so it skips, saying why, on a CPU without ``amx_bf16``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.vllm_pool import PULL, engine_pool, prompt, tails

#: per model: tokens per block, bytes per value, the main layers MLA (one latent of 576 values,
#: replicated on every rank) or attention (4 KV heads of 64, split); the draft: 2 KV heads of 64
CASES = {"eagle": {"block": 32, "value": 4, "mla": False},
         "mlaeagle": {"block": 128, "value": 2, "mla": True}}
DRAFT_INDEX, DRAFT_HEADS, MAIN_HEADS, HEAD_DIM, LATENT = 4, 2, 4, 64, 576


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with engine_pool(tmp_path_factory, "vllm-draft") as p:
        yield p


def has_amx() -> bool:
    """Whether this CPU has AMX for bfloat16 (what vLLM's CPU MLA path in bfloat16 needs)."""
    try:
        return bool(re.search(r"\bamx_bf16\b", Path("/proc/cpuinfo").read_text()))
    except OSError:
        return False


def needs(model: str) -> None:
    if CASES[model]["mla"] and not has_amx():
        reason = ("this CPU has no amx_bf16: vLLM's CPU build runs an MLA main model beside a "
                  "GQA EAGLE-3 draft only in bfloat16 with AMX (AMX_MLA, blocks of 128); in "
                  "float32 it finds no common block size (CPU_MLA 16, CPU_ATTN multiples of 32)")
        print(f"SKIP: {reason}")
        pytest.skip(reason)


def is_draft(name: str) -> bool:
    """vLLM numbers the draft's layer after the main model's 4 (``start_layer_id``)."""
    return f"layers.{DRAFT_INDEX}." in name


def global_pages(dump: dict, tp: int, name: str, block: int) -> np.ndarray:
    """Block ``block`` of layer ``name`` as the model holds it: the TP ranks' heads side by side
    (rank ``r`` holds the ``r``-th slice: vLLM's placement, kvplan's); a replicated MLA latent
    once, after checking every rank holds the same."""
    pages = [dump[(r, name)][block] for r in range(tp)]
    if pages[0].shape[0] == 1 and pages[0].shape[-1] == LATENT:  # MLA: [1, N, latent]
        for r, pg in enumerate(pages[1:], 1):
            np.testing.assert_array_equal(pg, pages[0], err_msg=f"{name} rank {r} replica")
        return pages[0]
    return np.concatenate(pages, axis=0)


def decode_blocks(pdump: dict, ddump: dict, ptp: int, dtp: int, pblocks: list[int]) -> list:
    """The decode's block holding each prefill block, found by the first main layer's pages
    (vLLM's block ids differ between the engines; the main layers' bytes are unique)."""
    name = min(k[1] for k in ddump if not is_draft(k[1]))
    nblocks = ddump[(0, name)].shape[0]
    dall = np.stack([global_pages(ddump, dtp, name, b) for b in range(nblocks)])
    out = []
    for b in pblocks:
        hit = np.flatnonzero((dall == global_pages(pdump, ptp, name, b)).all(axis=(1, 2, 3)))
        assert len(hit) == 1, f"prefill block {b}: {len(hit)} decode blocks hold its pages"
        out.append(int(hit[0]))
    return out


def run_pair(pool, prefill: str, decode: str, ids: list[int], tmp: Path, block: int,
             prefill_ids: list[int] | None = None):
    """P/D of ``ids`` (the prefill run on ``prefill_ids``, default ``ids``), then both
    engines' KV dumped: (prefill dump, decode dump, the prefill's blocks the decode takes
    whole, the decode's pull lines, the decode engine)."""
    p, d = pool.only(prefill, decode)
    before = len(d.log_lines(PULL))
    pre = p.generate(prefill_ids or ids, 1, {"do_remote_decode": True})
    assert pre["error"] is None and pre["params"], f"{pre}{tails()}"
    out = d.generate(ids, 16, dict(pre["params"]))
    assert out["error"] is None and len(out["tokens"]) == 16, f"{out}{tails()}"
    pulls = d.log_lines(PULL)[before:]
    assert pulls, f"{decode}: no pull{tails()}"
    # the blocks before the prompt's last token, which the decode computes itself (its
    # draft too): those must hold the prefill's bytes
    full = (len(ids) - 1) // block
    pblocks = [int(x) for x in pre["params"]["remote_block_ids"][0][:full]]
    assert pblocks, f"{len(ids)} tokens: no whole block to compare"
    return p.dump(tmp / f"{prefill}-kv"), d.dump(tmp / f"{decode}-kv"), pblocks, pulls, d


def pair_names(model: str, ptp: int, dtp: int) -> tuple[str, str]:
    """Engine names of P TP ``ptp`` -> D TP ``dtp``: 40 KV blocks each (``few``), so that a
    dump of the whole cache stays small (a few MB)."""
    p = f"{model}-p1-few" if ptp == 1 else f"{model}-t2-few"
    d = f"{model}-d1-few" if dtp == 1 else f"{model}-t2-few"
    return p, d


@pytest.mark.parametrize("model", ["eagle", "mlaeagle"])
def test_negative_control_other_prompts_draft_pages(pool, model, tmp_path):
    # the decode of prompt A given prompt B's KV holds B's draft pages, not A's (A's pages:
    # a prefill of A alone; the decode never saw A, so nothing of it is cached there). First
    # in the file: the next test starts with the same engine pair
    needs(model)
    block = CASES[model]["block"]
    prefill, decode = pair_names(model, 1, 2)
    ids, other = prompt(3600, 3 * block + 5), prompt(3601, 3 * block + 5)
    p, _ = pool.only(prefill, decode)
    own = p.generate(ids, 1, {"do_remote_decode": True})
    assert own["error"] is None, f"{own}{tails()}"
    pa = p.dump(tmp_path / "a-kv")
    pblock_a = int(own["params"]["remote_block_ids"][0][0])
    pb, db, pblocks_b, _, _ = run_pair(pool, prefill, decode, ids, tmp_path / "b", block,
                                       prefill_ids=other)
    draft = next(k[1] for k in db if is_draft(k[1]))
    dblock = decode_blocks(pb, db, 1, 2, pblocks_b)[0]
    got = global_pages(db, 2, draft, dblock)
    assert not np.array_equal(got, global_pages(pa, 1, draft, pblock_a))
    np.testing.assert_array_equal(got, global_pages(pb, 1, draft, pblocks_b[0]))


@pytest.mark.parametrize("model,ptp,dtp", [("eagle", 1, 2), ("eagle", 2, 1),
                                           ("mlaeagle", 1, 1), ("mlaeagle", 1, 2),
                                           ("mlaeagle", 2, 1)])
def test_draft_pages_arrive_through_the_placement(pool, model, ptp, dtp, tmp_path):
    needs(model)
    case = CASES[model]
    block = case["block"]
    prefill, decode = pair_names(model, ptp, dtp)
    ids = prompt(3500 + 10 * ptp + dtp, 3 * block + 5)  # 3 whole blocks before the last token
    pdump, ddump, pblocks, pulls, d = run_pair(pool, prefill, decode, ids, tmp_path, block)
    names = sorted({k[1] for k in ddump})
    draft = [n for n in names if is_draft(n)]
    assert len(names) == 5 and len(draft) == 1, names
    assert d.log_lines(r"kvplan: rank 0 registered 5 regions"), tails()
    for r in range(dtp):  # each rank's tensor: its share of each layer's own heads
        for name in names:
            want = DRAFT_HEADS // dtp if is_draft(name) else 1 if case["mla"] else \
                MAIN_HEADS // dtp
            assert ddump[(r, name)].shape[1] == want, (r, name, ddump[(r, name)].shape)
    dblocks = decode_blocks(pdump, ddump, ptp, dtp, pblocks)
    for name in names:  # every layer, the draft's included
        for pb, db in zip(pblocks, dblocks, strict=True):
            want = global_pages(pdump, ptp, name, pb)
            assert want.any(), f"{prefill}: {name} block {pb} is empty: nothing to compare"
            np.testing.assert_array_equal(global_pages(ddump, dtp, name, db), want,
                                          err_msg=f"{name}: decode block {db} != prefill {pb}")
    # the pull moved every region with its own heads: per decode rank and block, the main
    # layers' share plus the draft's 2 heads' share (4 heads, the count the connector used to
    # give every layer, would be twice the draft's bytes)
    per_token = 4 * (LATENT if case["mla"] else MAIN_HEADS // dtp * 2 * HEAD_DIM)
    draft_per_token = DRAFT_HEADS // dtp * 2 * HEAD_DIM
    for line in pulls:
        m = re.search(r"blocks=(\d+) tokens=\[\d+,\d+\) bytes=(\d+)", line)
        blocks, nbytes = int(m.group(1)), int(m.group(2))
        main = blocks * block * per_token * case["value"]
        assert nbytes == main + blocks * block * draft_per_token * case["value"], \
            (line, main)
