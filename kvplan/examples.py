"""Built-in example engines, for the demo, the benchmarks and notebooks (not model presets).

Each function returns an :class:`EngineSpec` for one engine; call it once per side with that
side's TP size (and block size, to try mixed block sizes).
"""

from __future__ import annotations

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
         "layout": layout, "kv": kv}
        for i in range(layers)
    ]
    regions.append(
        {"name": "draft.0.mla", "kind": "mla", "num_blocks": num_blocks,
         "block_size": draft_block_size or block_size, "dtype": "bfloat16", "dim": 576}
    )
    return EngineSpec.from_dict({"tp_size": tp_size, "regions": regions})


def llama3_70b(
    tp_size: int, *, num_blocks: int = 1024, block_size: int = 16, layout: str = "HND",
    kv: str = "split",
) -> EngineSpec:
    """Llama-3-70B's KV cache: 80 layers, 8 KV heads of 128, bf16, one region per layer."""
    return EngineSpec.from_dict({
        "tp_size": tp_size,
        "regions": [
            {"name": f"layers.{i}.attn", "kind": "attention", "num_blocks": num_blocks,
             "block_size": block_size, "dtype": "bfloat16", "num_kv_heads": 8, "head_dim": 128,
             "layout": layout, "kv": kv}
            for i in range(80)
        ],
    })


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


#: Example name -> builder, for command lines.
EXAMPLES = {
    "gqa-mla-draft": gqa_with_mla_draft,
    "llama3-70b": llama3_70b,
    "deepseek-v32": deepseek_v32,
    "sliding-window": sliding_window_mix,
}
