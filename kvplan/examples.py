"""Built-in example engines, for the demo, the benchmarks and notebooks (not model presets).

Each function returns an :class:`EngineSpec` for one engine; call it once per side with that
side's TP size (and block size, to try mixed block sizes).

Layer 4 (built on the core): imports spec and hf; nothing in the planning core imports it.
"""

from __future__ import annotations

import numpy as np

from kvplan.hf import kda_parts as hf_kda_parts
from kvplan.hf import mamba2_parts
from kvplan.spec import EngineSpec


def gqa_with_mla_draft(
    tp_size: int,
    *,
    layers: int = 4,
    num_blocks: int = 256,
    block_size: int = 16,
    draft_block_size: int | None = None,
    layout: str = "HND",
    kv: str = "split",
) -> EngineSpec:
    """A GQA model (8 KV heads of 128, bf16) with an MLA Eagle-3 draft layer (dim 576), one group.

    SPLIT and REPLICATE regions side by side, as in vLLM PR 44583; ``draft_block_size`` lets the
    draft use another block size than the main model.
    """
    regions = [
        {"name": f"layers.{i}.attn", "kind": "attention", "num_blocks": num_blocks,
         "block_size": block_size, "dtype": "bfloat16", "num_kv_heads": 8, "head_dim": 128,
         **_layout_fields(layout, kv)}
        for i in range(layers)
    ]
    regions.append(
        {"name": "draft.0.mla", "kind": "mla", "num_blocks": num_blocks,
         "block_size": block_size if draft_block_size is None else draft_block_size,
         "dtype": "bfloat16", "dim": 576}
    )
    return EngineSpec.from_dict({"tp_size": tp_size, "regions": regions})


def llama3_70b(
    tp_size: int, *, num_blocks: int = 1024, block_size: int = 16, layout: str = "HND",
    kv: str = "split",
) -> EngineSpec:
    """Llama-3-70B's KV cache: 80 layers, 8 KV heads of 128, bf16, one region per layer.

    ``layout`` HND/NHD (with ``kv``) gives one allocation per layer; any other order (vLLM's
    ``BLHNC``..., see ``RegionSpec.order``) puts the 80 layers in one allocation ``"kv"``.
    """
    return EngineSpec.from_dict({
        "tp_size": tp_size,
        "regions": [
            {"name": f"layers.{i}.attn", "kind": "attention", "num_blocks": num_blocks,
             "block_size": block_size, "dtype": "bfloat16", "num_kv_heads": 8, "head_dim": 128,
             **_layout_fields(layout, kv)}
            for i in range(80)
        ],
    })


def _layout_fields(layout: str, kv: str) -> dict:
    """Region fields for a layout name: legacy names per layer, orders in one allocation."""
    if layout in ("HND", "NHD"):
        return {"layout": layout, "kv": kv}
    return {"layout": layout, "allocation": "kv"}


def deepseek_v32(
    tp_size: int, *, layers: int = 4, num_blocks: int = 256, block_size: int = 64
) -> EngineSpec:
    """DeepSeek-V3.2-like: per layer an MLA latent (576, bf16) and an indexer key (132, uint8)."""
    regions = []
    for i in range(layers):
        regions.append({"name": f"layers.{i}.mla", "kind": "mla", "num_blocks": num_blocks,
                        "block_size": block_size, "dtype": "bfloat16", "dim": 576})
        regions.append({"name": f"layers.{i}.indexer", "kind": "indexer",
                        "num_blocks": num_blocks, "block_size": block_size, "dtype": "uint8",
                        "dim": 132})
    return EngineSpec.from_dict({"tp_size": tp_size, "regions": regions})


def sliding_window_mix(
    tp_size: int, *, layers: int = 4, num_blocks: int = 256, block_size: int = 16,
    window: int = 128,
) -> EngineSpec:
    """Gemma-3-like: sliding-window layers (group 1) interleaved with full attention (group 0)."""
    regions = [
        {"name": f"layers.{i}.attn", "kind": "attention", "group": 0 if i % 2 else 1,
         "num_blocks": num_blocks, "block_size": block_size, "dtype": "bfloat16",
         "num_kv_heads": 4, "head_dim": 128, "window": None if i % 2 else window}
        for i in range(layers)
    ]
    return EngineSpec.from_dict({"tp_size": tp_size, "regions": regions})




def mamba2_conv_parts(d_conv: int = 4, dtype_bytes: int = 2) -> list[dict]:
    """Nemotron-H-8B's Mamba2 state parts: conv x (8192 channels), B and C (8 groups of 128
    channels), and the temporal state (128 heads of 64 x 128 values), as state-region parts."""
    return list(mamba2_parts(128, 64, 8, 128, d_conv, dtype_bytes, dtype_bytes))


def nemotron_h_like(
    tp_size: int, *, pp_size: int = 1, mamba_layers: int = 3, num_blocks: int = 64,
    num_slots: int = 16, block_size: int = 16,
) -> EngineSpec:
    """A Nemotron-H-like hybrid: Mamba2 state layers (group 1) and GQA attention (group 0)."""
    regions: list[dict] = [
        {"name": f"layers.{i}.mamba", "kind": "state", "group": 1, "num_blocks": num_slots,
         "dtype": "bfloat16", "parts": mamba2_conv_parts()}
        for i in range(mamba_layers)
    ]
    regions.append(
        {"name": "layers.attn", "kind": "attention", "num_blocks": num_blocks,
         "block_size": block_size, "dtype": "bfloat16", "num_kv_heads": 8, "head_dim": 128}
    )
    return EngineSpec.from_dict({"tp_size": tp_size, "pp_size": pp_size, "regions": regions})


def kda_parts(heads: int = 8, head_dim: int = 64, d_conv: int = 4) -> list[dict]:
    """KimiLinear's KDA state, four parts: short-conv states of q, k, v (bf16, per channel) and
    the recurrent state (float32, head_dim x head_dim per head)."""
    return list(hf_kda_parts(heads, head_dim, d_conv, 2, 4))


def kimi_linear_like(
    tp_size: int, *, layers: int = 2, num_blocks: int = 32, block_size: int = 64,
    kernel_block_size: int | None = 16, heads: int = 8, head_dim: int = 64,
) -> EngineSpec:
    """A KimiLinear-like hybrid: per layer pair, an MLA layer (group 0) and a KDA layer
    (group 1) sharing one pool, as vLLM's hybrid allocator lays them out (PR 49762)."""
    regions: list[dict] = []
    for i in range(layers):
        mla = {"name": f"layers.{2 * i}.mla", "kind": "mla", "group": 0,
               "num_blocks": num_blocks, "block_size": block_size, "dtype": "bfloat16",
               "dim": 576, "pool": f"pool.{i}"}
        if kernel_block_size:
            mla["kernel_block_size"] = kernel_block_size
        regions.append(mla)
        regions.append({"name": f"layers.{2 * i + 1}.kda", "kind": "state", "group": 1,
                        "num_blocks": num_blocks, "dtype": "bfloat16",
                        "parts": kda_parts(heads, head_dim), "pool": f"pool.{i}"})
    return EngineSpec.from_dict({"tp_size": tp_size, "regions": regions})


def request_blocks(
    spec: EngineSpec, tokens: int, *, slots: int = 1, seed: int | np.random.Generator = 0
) -> list[list[int]]:
    """One side of an example request: distinct random block ids per group of ``spec``.

    A token group gets ``ceil(tokens / block_size)`` blocks (its largest block size), a state
    group ``slots`` slots, and groups sharing a pool get disjoint ids (a page belongs to one
    group's view at a time). Raises ``ValueError`` naming the group when it has too few blocks.
    """
    rng = np.random.default_rng(seed)
    used: dict[str, set[int]] = {}  # pool -> page ids taken by earlier groups
    out = []
    for g in range(spec.num_groups):
        regions = [r for r in spec.regions if r.group == g]
        pools = {r.pool for r in regions if r.pool is not None}
        limit = min(r.num_blocks for r in regions)
        taken = set().union(*(used.get(p, set()) for p in pools))
        free = [b for b in rng.permutation(limit).tolist() if b not in taken]
        if regions[0].is_state:
            need, what = slots, f"{slots} slot(s)"
        else:
            need = -(-tokens // max(r.block_size for r in regions))
            what = f"{tokens} tokens"
        if need > len(free):
            raise ValueError(
                f"group {g}: {what} need {need} blocks, but it has {len(free)} free of {limit}"
            )
        out.append(free[:need])
        for p in pools:
            used.setdefault(p, set()).update(free[:need])
    return out


#: Example name -> builder, for command lines.
EXAMPLES = {
    "gqa-mla-draft": gqa_with_mla_draft,
    "llama3-70b": llama3_70b,
    "deepseek-v32": deepseek_v32,
    "sliding-window": sliding_window_mix,
    "nemotron-h": nemotron_h_like,
    "kimi-linear": kimi_linear_like,
}
