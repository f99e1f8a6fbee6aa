"""Kimi-Linear's MLA + KDA KV cache as vLLM 0.32 builds it, through kvplan's adapter (run by
the vLLM venv's python: tests/test_vllm_adapter_kda.py).

Everything vLLM decides comes from vLLM's own code, without kernels: the KDA layer's state
shapes and dtypes (``MambaStateShapeCalculator.kda_state_shape``,
``MambaStateDtypeCalculator.kda_state_dtype``, what ``KimiGatedDeltaNetAttention`` asks for;
its ``mamba_type`` is ``GDN_ATTN``), the attention block size that makes an MLA page hold a
KDA state (the rule of ``Platform._align_hybrid_block_size`` in ``platforms/interface.py``:
MLA aligns to 128 tokens, the state page padded to the MLA page), the KV-cache groups
(``get_kv_cache_groups``: three KDA groups and one MLA group of two layers each, for 3 KDA : 1
MLA layers), the ``KVCacheConfig`` (``get_kv_cache_config_from_groups``: every group aliases
the same allocation from byte 0, each group's layers slots of one ``KVCacheTensor``), the
tensors (``allocate_kv_cache``) and each KDA layer's conv / recurrent views
(``MambaBase.bind_kv_cache``), read as the layer reads them (``conv_state.split(
local_projection_size, dim=-2)`` after the SD transpose: q, k, v).

For P TP ``a`` -> D TP ``b`` (every pair of 1 and 2): every P rank's views are filled from
one global model state (each conv channel, recurrent head and MLA token its own random
value), the request is planned from the adapter's specs and applied with
``kvplan.simulate`` to the allocations' bytes, and each D rank's views must hold exactly its
shard of the global state (q, k and v channels, recurrent heads) and the whole MLA latent.
The adapter's spec is also checked against an independently written spec (the oracle's,
tests/oracle.py) and the oracle's expected bytes. Prints one line per pair; exits non-zero
on the first mismatch.
"""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import numpy as np
import torch

HEADS, HEAD_DIM, KERNEL = 4, 16, 4  # KDA: linear_attn_config num_heads, head_dim, conv size
LATENT = 48  # MLA: kv_lora_rank 32 + qk_rope_head_dim 16
LAYERS = 8  # Kimi-Linear's pattern: layers 3 and 7 MLA, the others KDA
NUM_BLOCKS = 6
PROJ = HEADS * HEAD_DIM


def is_mla(i: int) -> bool:
    return i % 4 == 3


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn" + (".mla_attn" if is_mla(i) else "")


def engine(tp: int):
    """(kv_caches, KVCacheConfig, backing bytes as numpy, {KDA layer: (conv, recurrent)})."""
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_interface import KVCacheLayout, MambaSpec, MLAAttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    cfg = VllmConfig()
    cfg.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves on CPU
    cfg.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    shapes = MambaStateShapeCalculator.kda_state_shape(tp, HEADS, HEAD_DIM,
                                                       conv_kernel_size=KERNEL)
    dtypes = MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto")
    state_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    per_token = MLAAttentionSpec(block_size=1, num_kv_heads=1, head_size=LATENT,
                                 dtype=torch.bfloat16).page_size_bytes
    block = 128 * math.ceil(state_page / (128 * per_token))  # MLA hybrids align to 128
    specs = {}
    for i in range(LAYERS):
        if is_mla(i):
            specs[layer_name(i)] = MLAAttentionSpec(block_size=block, num_kv_heads=1,
                                                    head_size=LATENT, dtype=torch.bfloat16)
        else:
            specs[layer_name(i)] = MambaSpec(
                shapes=shapes, dtypes=dtypes, block_size=block,
                page_size_padded=block * per_token,
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN)
    groups = get_kv_cache_groups(cfg, specs)
    kcfg = get_kv_cache_config_from_groups(cfg, groups, 1 << 30)
    kv = allocate_kv_cache(kcfg, torch.device("cpu"), KVCacheLayout.LBHNC)
    base = min(t.data_ptr() for t in kv.values())
    size = kcfg.kv_cache_tensors[0].size
    first = next(t for t in kv.values() if t.data_ptr() == base)
    raw = torch.as_strided(first, (size // first.element_size(),), (1,)).view(torch.uint8)
    states = {}
    for i in range(LAYERS):
        if not is_mla(i):
            layer = SimpleNamespace(get_state_shape=lambda: shapes,
                                    get_state_dtype=lambda: dtypes)
            MambaBase.bind_kv_cache(layer, kv[layer_name(i)])
            states[layer_name(i)] = layer.kv_cache
    return kv, kcfg, raw.numpy(), states


def kda_read(states, name):
    """q, k, v conv states ``[slots, local channels, taps]`` and the recurrent state
    ``[slots, local heads, D, D]``, as ``KimiGatedDeltaNetAttention.forward`` reads them."""
    conv, recurrent = states[name]
    conv = conv.transpose(-1, -2)  # SD layout: stored (taps, channels)
    q, k, v = conv.split(conv.shape[-2] // 3, dim=-2)
    return q, k, v, recurrent


def global_state(seed: int):
    """The model's state every P rank holds its shard of: per layer, per slot."""
    g = torch.Generator().manual_seed(seed)
    conv = {i: torch.randn(NUM_BLOCKS, 3, PROJ, KERNEL - 1, generator=g).bfloat16()
            for i in range(LAYERS) if not is_mla(i)}  # [slot, q|k|v, channel, tap]
    rec = {i: torch.randn(NUM_BLOCKS, HEADS, HEAD_DIM, HEAD_DIM, generator=g)
           for i in range(LAYERS) if not is_mla(i)}
    return conv, rec


def shard(tp: int, rank: int):
    lp, lh = PROJ // tp, HEADS // tp
    return slice(rank * lp, (rank + 1) * lp), slice(rank * lh, (rank + 1) * lh)


def fill(kv, states, tp, rank, pages, seed=7):
    """Rank ``rank``'s views from the global state, only on the pages its groups own in the
    request (a page holds one group's view at a time)."""
    conv, rec = global_state(seed)
    ch, hd = shard(tp, rank)
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(LAYERS):
        name = layer_name(i)
        if is_mla(i):
            lat = torch.randn(NUM_BLOCKS, kv[name].shape[2], LATENT, generator=g).bfloat16()
            for b in pages["mla"]:
                kv[name][b, 0] = lat[b]
            continue
        q, k, v, r = kda_read(states, name)
        for b in pages[i % 4]:
            q[b], k[b], v[b] = conv[i][b, 0, ch], conv[i][b, 1, ch], conv[i][b, 2, ch]
            r[b] = rec[i][b, hd]


def buffers(eng, spec, rank: int) -> dict[str, np.ndarray]:
    """The spec's buffers on ``rank`` as numpy views of the allocation (what the connector
    registers: ``vllm_buffers``)."""
    from kvplan.adapters.vllm import vllm_buffers

    kv, _, raw, _ = eng
    base = raw.__array_interface__["data"][0]
    return {b: raw[a - base:a - base + n] for b, (a, n) in vllm_buffers(kv, spec, rank).items()}


def oracle_spec(tp: int, block: int) -> dict:
    """Kimi-Linear's layers as the oracle reads them, from the model's dimensions alone: a
    KDA slot is q, k, v conv channels per tap (bf16, sharded on channels) then the recurrent
    state per head (float32); an MLA layer one latent per token; layer slot ``s`` of every
    group one pool of pages of the MLA page's size."""
    regions, page = [], block * LATENT * 2
    order = [i for g in range(4) for i in range(LAYERS) if (3 if is_mla(i) else i % 4) == g]
    for i in order:
        slot = i // 4
        r = {"name": layer_name(i), "group": 3 if is_mla(i) else i % 4,
             "num_blocks": NUM_BLOCKS, "dtype": "bfloat16", "pool": f"pool.0.{slot}",
             "page_bytes": page}
        if is_mla(i):
            # vLLM's LBHNC with C one latent: L and B outside each token's values
            r.update(kind="mla", block_size=block, dim=LATENT, layout="LBHNSD")
        else:
            parts = [{"name": f"{p}_conv.{t}", "units": PROJ, "unit_bytes": 2}
                     for t in range(KERNEL - 1) for p in "qkv"]
            parts.append({"name": "ssm", "units": HEADS, "unit_bytes": HEAD_DIM * HEAD_DIM * 4})
            r.update(kind="state", parts=parts)
        regions.append(r)
    return {"tp_size": tp, "regions": regions}


def merged(d: dict) -> dict:
    """``d`` with each state region's q, k and v conv parts of a tap described as one run of
    channels ``qkv_conv.<tap>`` sharded as a whole: what an adapter that missed vLLM's
    per-projection sharding would describe (rank 0 of 2 would hold q and half of k)."""
    for r in d["regions"]:
        if r["kind"] == "state":
            p = r["parts"]
            r["parts"] = [{"name": f"qkv_conv.{j // 3}", "units": 3 * p[j]["units"],
                           "unit_bytes": p[j]["unit_bytes"]}
                          for j in range(0, len(p) - 1, 3)] + [p[-1]]
    return d


def check_pair(stp: int, dtp: int, merge_qkv: bool = False) -> str:
    from kvplan import EngineSpec, pull_map, simulate
    from kvplan.adapters.vllm import TransferGroups, spec_from_vllm
    from tests import oracle

    src = [engine(stp) for _ in range(stp)]
    dst = [engine(dtp) for _ in range(dtp)]
    backends = {layer_name(i): "CPU_MLA" if is_mla(i) else None for i in range(LAYERS)}
    sspec = spec_from_vllm(src[0][0], src[0][1], tp_size=stp, backend=backends)
    dspec = spec_from_vllm(dst[0][0], dst[0][1], tp_size=dtp, backend=backends)
    if merge_qkv:
        sspec = EngineSpec.from_dict(merged(sspec.to_dict()))
        dspec = EngineSpec.from_dict(merged(dspec.to_dict()))
    block = int(src[0][0][layer_name(3)].shape[2])
    for spec, tp in ((sspec, stp), (dspec, dtp))[:0 if merge_qkv else 2]:
        want = EngineSpec.from_dict(oracle_spec(tp, block))
        assert spec == want, f"TP {tp}: adapter spec differs from the oracle's:\n" \
            f"{spec.to_dict()}\n{want.to_dict()}"
    groups = TransferGroups.from_config(src[0][1])
    assert groups.kinds == ("state", "state", "state", "full"), groups.kinds
    # P: slots 1, 2, 3 (KDA groups 0..2) and blocks [4, 5] (MLA); D: 5, 4, 1 and [2, 3]
    sp = {0: [1], 1: [2], 2: [3], "mla": [4, 5]}
    dp = {0: [5], 1: [4], 2: [1], "mla": [2, 3]}
    for r, (kv, _, _, states) in enumerate(src):
        fill(kv, states, stp, r, sp)
    src_lists = [sp[0], sp[1], sp[2], sp["mla"]]
    dst_lists = [dp[0], dp[1], dp[2], dp["mla"]]
    tokens = 200  # the second MLA block in part
    moved = 0
    for d, (kv, _, _, states) in enumerate(dst):
        plan = pull_map(sspec, dspec, d).plan(src_lists, dst_lists, tokens=(0, tokens))
        sbufs = {(r, b): v for r in range(stp) for b, v in buffers(src[r], sspec, r).items()}
        dbufs = {(d, b): v for b, v in buffers(dst[d], dspec, d).items()}
        simulate(plan, sbufs, dbufs)
        moved += plan.nbytes
        conv, rec = global_state(7)
        ch, hd = shard(dtp, d)
        for i in range(LAYERS):
            name = layer_name(i)
            if is_mla(i):
                for sb, db in zip(sp["mla"], dp["mla"], strict=True):
                    n = min(block, tokens - sp["mla"].index(sb) * block)
                    got, want = kv[name][db, 0, :n], src[0][0][name][sb, 0, :n]
                    assert torch.equal(got, want), f"{name} block {db} rank {d}"
                continue
            q, k, v, r = kda_read(states, name)
            sb, db = sp[i % 4][0], dp[i % 4][0]
            for j, part in enumerate((q, k, v)):
                assert torch.equal(part[db], conv[i][sb, j, ch]), \
                    f"{name} {'qkv'[j]} conv, slot {db}, rank {d} of {dtp}"
            assert torch.equal(r[db], rec[i][sb, hd]), f"{name} recurrent, rank {d} of {dtp}"
        # the oracle's bytes: the same plan on buffers the oracle fills, against its answer
        ospec_s, ospec_d = oracle_spec(stp, block), oracle_spec(dtp, block)
        obufs = oracle.source_buffers(ospec_s, request_blocks=src_lists)
        before = oracle.destination_buffers(ospec_d)
        exp, _ = oracle.expected_destination(ospec_s, ospec_d, src_lists, dst_lists, d, obufs,
                                             before, tokens=(0, tokens))
        copies: dict[int, np.ndarray] = {}  # the regions of a pool share one array
        out = {k: copies.setdefault(id(v), v.copy()) for k, v in before.items() if k[0] == d}
        simulate(plan, obufs, out)
        for j, e in exp.items():
            assert np.array_equal(out[(d, j)], e), f"oracle: region {j}, rank {d}"
    return f"KDA+MLA P TP{stp} -> D TP{dtp}: ok, {moved} bytes, block {block}"


def main() -> None:
    pairs = [(1, 1), (1, 2), (2, 1), (2, 2)]
    for a, b in pairs:
        print(check_pair(a, b), flush=True)
    # negative control: q | k | v sharded as one run of channels on both sides; at TP 1 -> 2
    # the checks above must see the channels land in the wrong places
    try:
        check_pair(1, 2, merge_qkv=True)
    except AssertionError as e:
        print(f"negative control (q, k, v sharded as one part): caught: {e}", flush=True)
    else:
        sys.exit("negative control: a wrong conv layout passed the checks")
    sys.exit(0)


if __name__ == "__main__":
    main()
