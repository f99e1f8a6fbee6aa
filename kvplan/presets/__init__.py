"""Named model presets: trimmed copies of published Hugging Face ``config.json`` files.

Each preset is a JSON file in this package holding the fields of the model's published
``config.json`` that decide its KV cache (plus architecture, model type and a few identifying
numbers), with ``_name_or_path`` naming the checkpoint it was copied from. Nothing is downloaded:
:func:`load` reads the packaged file, :func:`spec` turns it into an engine spec with
:func:`kvplan.hf.from_hf_config`.

Where the numbers come from (all ``config.json`` field names; ``text_config`` for the
multimodal wrappers, Gemma 3 27B and Qwen3.5):

- ``llama-3.1-8b`` / ``llama-3.1-70b``: meta-llama/Llama-3.1-{8B,70B}-Instruct:
  ``num_hidden_layers`` 32 / 80, ``num_key_value_heads`` 8, ``hidden_size`` 4096 / 8192 over
  ``num_attention_heads`` 32 / 64 gives head_dim 128 (the files name no ``head_dim``).
- ``qwen3-8b`` / ``qwen3-235b-a22b``: Qwen/Qwen3-8B and Qwen/Qwen3-235B-A22B:
  ``num_hidden_layers`` 36 / 94, ``num_key_value_heads`` 8 / 4, ``head_dim`` 128.
- ``deepseek-v3`` / ``kimi-k2``: deepseek-ai/DeepSeek-V3 and moonshotai/Kimi-K2-Instruct (both
  ``DeepseekV3ForCausalLM``): ``num_hidden_layers`` 61, ``kv_lora_rank`` 512 +
  ``qk_rope_head_dim`` 64 = a 576-value latent per token and layer.
- ``deepseek-v3.2``: deepseek-ai/DeepSeek-V3.2-Exp: the same MLA plus a sparse-attention indexer
  per layer, ``index_head_dim`` 128 (stored as fp8 keys with one float32 scale per 128 values:
  132 bytes per token).
- ``gemma-3-27b``: google/gemma-3-27b-it: ``num_hidden_layers`` 62, ``num_key_value_heads`` 16,
  ``head_dim`` 128, ``sliding_window`` 1024; the file names no ``sliding_window_pattern``, so
  Gemma 3's default 6 applies (five sliding-window layers, then one full-attention layer).
- ``gemma-3-1b``: google/gemma-3-1b-it: 26 layers, 1 KV head of 256, ``sliding_window`` 512,
  ``sliding_window_pattern`` 6.
- ``gpt-oss-120b`` / ``gpt-oss-20b``: openai/gpt-oss-{120b,20b}: 36 / 24 layers,
  ``num_key_value_heads`` 8, ``head_dim`` 64, ``sliding_window`` 128, ``layer_types``
  alternating ``sliding_attention`` and ``full_attention``.
- ``qwen3-next-80b-a3b``: Qwen/Qwen3-Next-80B-A3B-Instruct: 48 layers,
  ``full_attention_interval`` 4 (every fourth layer is full attention: 2 KV heads of 256), the
  others Gated DeltaNet (``linear_num_key_heads`` 16, ``linear_num_value_heads`` 32, key and
  value head dims 128, ``linear_conv_kernel_dim`` 4).
- ``qwen3.5-35b-a3b``: Qwen/Qwen3.5-35B-A3B: the same pattern over 40 layers, its
  ``layer_types`` written out, ``mamba_ssm_dtype`` float32 for the recurrent state.
- ``nemotron-h-8b``: nvidia/Nemotron-H-8B-Base-8K: ``hybrid_override_pattern`` of 52 layers
  (``M`` Mamba2: 24, ``*`` attention: 4, ``-`` MLP), ``mamba_num_heads`` 128 x
  ``mamba_head_dim`` 64 = 8192 conv channels, ``n_groups`` 8 x ``ssm_state_size`` 128,
  ``conv_kernel`` 4; attention 8 KV heads of ``attention_head_dim`` 128.
- ``kimi-linear-48b-a3b``: moonshotai/Kimi-Linear-48B-A3B-Instruct: 27 layers,
  ``linear_attn_config`` lists (1-based) 7 ``full_attn_layers`` (MLA, 512 + 64) and 20
  ``kda_layers`` (32 heads of 128, ``short_conv_kernel_size`` 4).
- Eagle-3 drafts: ``llama-3.1-8b-eagle3`` (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: one layer,
  8 KV heads, 4096 / 32 = 128) and ``kimi-k2.5-eagle3`` (the draft architecture TorchSpec trains
  for Kimi-K2.5: one layer, 64 KV heads of 128), for ``from_hf_config(..., draft=...)``.

Layer 4 (adapters on top): imports errors and, when building a spec, spec and hf.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from kvplan.errors import SpecError
from kvplan.hf import from_hf_config
from kvplan.spec import EngineSpec

_PACKAGE = "kvplan.presets"


def names() -> tuple[str, ...]:
    """The preset names, sorted (file names without ``.json``)."""
    files = resources.files(_PACKAGE).iterdir()
    return tuple(sorted(f.name[: -len(".json")] for f in files if f.name.endswith(".json")))


def load(name: str) -> dict[str, Any]:
    """The preset's config as a fresh dict (an HF ``config.json``, trimmed).

    Raises :class:`~kvplan.SpecError` naming the known presets when ``name`` is not one.
    """
    if name not in names():
        raise SpecError(f"no preset named {name!r}; presets: {', '.join(names())}")
    text = resources.files(_PACKAGE).joinpath(f"{name}.json").read_text(encoding="utf-8")
    return json.loads(text)


def spec(name: str, tp_size: int, **kwargs: Any) -> EngineSpec:
    """``kvplan.hf.from_hf_config(load(name), tp_size=tp_size, **kwargs)``.

    ``draft`` may name a preset too (``draft="llama-3.1-8b-eagle3"``).
    """
    draft = kwargs.pop("draft", None)
    if isinstance(draft, str) and draft in names():
        draft = load(draft)
    return from_hf_config(load(name), tp_size=tp_size, draft=draft, **kwargs)


__all__ = ["load", "names", "spec"]
