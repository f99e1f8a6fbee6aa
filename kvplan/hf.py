"""Engine specs from Hugging Face ``config.json`` files: the families people serve, read exactly.

Theory of operation. A config is read in three steps. (1) *Family*: the architecture name (or
the model type when it names none) picks one of a few families, each a rule for which layers hold
what: ``gqa`` (Llama 3, Qwen3), ``mla`` (DeepSeek-V3, Kimi-K2), ``mla_indexer`` (DeepSeek-V3.2),
``sliding`` (Gemma 3, gpt-oss), ``gdn`` (Qwen3-Next, Qwen3.5), ``mamba2`` (Nemotron-H) and
``kda`` (KimiLinear). An unknown architecture is refused by name: a config that looks like a
plain GQA model may hide state layers we would silently drop; pass ``family=`` to insist.
(2) *Layers*: the family turns the config's fields into one entry per layer -- full attention,
sliding window, MLA (+ indexer), or a recurrent state -- refusing a config that lacks a field
and naming every missing one. (3) *Regions*: one region per layer (two for an MLA layer with an
indexer), named ``layers.{i}.{attn,mla,indexer,gdn,mamba,kda}``, with a draft model's layers
appended as ``draft.{i}.{attn,mla}``.

KV-cache groups, as the serving engines lay them out: full attention, MLA, indexer and draft
layers share group 0; sliding-window layers have their own group; state layers theirs. KimiLinear
shares one pool between an MLA layer and KDA layers, as vLLM's hybrid allocator does: the KDA
layers are cut into groups as large as the MLA group, and pool ``p`` holds the ``p``-th layer
of every group (each view of a pool in its own group).

Bytes per token or slot follow the engines' cache shapes (domain.md sections 2 and 7):

- attention: ``num_key_value_heads`` heads of ``head_dim`` (or ``hidden_size //
  num_attention_heads``), K and V;
- MLA: ``kv_lora_rank + qk_rope_head_dim`` values; the DeepSeek-V3.2 indexer key is
  ``index_head_dim`` fp8 bytes plus one float32 scale per 128 of them (``uint8``, 132 for 128);
- state parts (one slot per request): a conv state is ``conv_kernel - 1`` values per channel
  (``x`` of Mamba2, ``q_conv``/``k_conv``/``v_conv`` of GDN and KDA); Mamba2's ``B`` and ``C``
  are ``n_groups`` units of ``ssm_state_size`` channels; the temporal state is per head:
  ``mamba_head_dim x ssm_state_size`` (Mamba2), ``linear_key_head_dim x linear_value_head_dim``
  (GDN), ``head_dim x head_dim`` float32 (KDA). The temporal state's dtype is ``state_dtype``,
  else the config's ``mamba_ssm_dtype``, else float32 for KDA and the model dtype otherwise.

Not modelled: multi-token-prediction layers (DeepSeek ``num_nextn_predict_layers``, Qwen3.5
``mtp_num_hidden_layers``) unless passed as a draft; quantized KV-cache formats other than a
dtype (e.g. vLLM's ``fp8_ds_mla``).

What each family reads (the tables, the config reader, one rule per family) is
:mod:`kvplan.hf_families`; this module turns its layers into regions, groups, pools and stages.

Layer 5 (adapters on top): imports spec, errors and hf_families; the spec it builds never
imports it (``kvplan.from_hf_config`` is this function, re-exported by the package).
"""

from __future__ import annotations

from typing import Any

from kvplan.errors import SpecError
from kvplan.hf_families import (  # noqa: F401  # FAMILIES, the parts: re-exported, were here
    DRAFT_FAMILIES,
    FAMILIES,
    Layer,
    Reader,
    dtype_of,
    family_of,
    kda_parts,
    layer_count,
    layers_of,
    load,
    mamba2_parts,
    stage_of,
)
from kvplan.spec import EngineSpec

_KINDS = {"attn": "attention", "mla": "mla", "indexer": "indexer", "gdn": "state",
          "mamba": "state", "kda": "state"}


def from_hf_config(
    config: Any,
    *,
    tp_size: int,
    block_size: int = 16,
    num_blocks: int = 1024,
    dtype: str | None = None,
    pp_size: int = 1,
    draft: Any = None,
    layout: str = "HND",
    kv: str = "split",
    state_dtype: str | None = None,
    family: str | None = None,
    dcp_size: int = 1,
    dcp_interleave: int = 1,
    pcp_size: int = 1,
) -> EngineSpec:
    """An :class:`~kvplan.EngineSpec` for one engine serving the model of a HF ``config.json``.

    ``config`` is a dict, a path to ``config.json`` or a directory holding one (nothing is
    downloaded). ``dtype`` defaults to the config's ``torch_dtype`` (or ``dtype``); a config
    without one (or with one that is no KV-cache dtype) is refused unless ``dtype`` is given,
    and one without ``num_key_value_heads`` is refused for attention layers (no guessing);
    ``layout`` and ``kv`` apply to attention regions (``HND``/``NHD``, one allocation per
    layer); an axis order (``BLHNC``, ``LBSHND``..., see ``RegionSpec.order``) applies to every
    region and packs the layers of a group that size a slot alike into one allocation
    ``kv.{k}``, as vLLM does; ``num_blocks`` is the blocks (or state
    slots) of every region. ``draft`` (an Eagle-3 config, same forms) adds its layers as
    regions ``draft.{i}.attn`` / ``draft.{i}.mla`` of group 0. With ``pp_size`` > 1 layer ``i``
    of ``L`` lies on stage ``i * pp_size // L`` and the draft on the last. ``dcp_size`` /
    ``dcp_interleave`` (decode context parallelism) and ``pcp_size`` (prefill context
    parallelism, see kvplan/cp.py) are the engine's; the spec refuses what no engine stores.

    Post-conditions: one region per layer that keeps a cache (two for a DeepSeek-V3.2 layer),
    in layer order; bytes per token or slot as the module docstring states. Raises
    :class:`~kvplan.SpecError` naming the architecture for an unknown one, and every missing
    field for a known one that lacks some.
    """
    r = Reader(load(config, "model config"), "model")
    fam = family_of(r, family)
    dtype = dtype_of(r, dtype)
    if isinstance(pp_size, bool) or not isinstance(pp_size, int) or pp_size <= 0:
        raise SpecError(f"pp_size must be a positive integer, got {pp_size!r}")
    layers = layers_of(r, fam, dtype, state_dtype, pp_size)
    n = layer_count(r, layers)
    drafts: list[Layer] = []
    if draft is not None:
        d = Reader(load(draft, "draft config"), "draft")
        dfam = family_of(d, None, DRAFT_FAMILIES)
        drafts = layers_of(d, dfam, dtype, None, 1)
    groups = {g: k for k, g in enumerate(sorted({x.group for x in [*layers, *drafts]}))}
    regions = []
    for prefix, items in (("layers", layers), ("draft", drafts)):
        for x in items:
            reg: dict[str, Any] = {
                "name": f"{prefix}.{x.index}.{x.kind}",
                "kind": _KINDS[x.kind],
                "group": groups[x.group],
                "num_blocks": num_blocks,
                "dtype": dtype,
            }
            if x.kind != "attn" and _KINDS[x.kind] != "state":
                reg["block_size"] = block_size
            if x.kind == "attn":
                reg.update(block_size=block_size, layout=layout if layout in ("HND", "NHD")
                           else "HND", kv=kv)
            reg.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in x.fields
                        if v is not None})
            if x.pool is not None:
                reg["pool"] = f"pool.{x.pool}"
            if pp_size > 1:
                reg["stage"] = stage_of(x.index, n, pp_size) if prefix == "layers" else pp_size - 1
            regions.append(reg)
    spec = EngineSpec.from_dict({"tp_size": tp_size, "pp_size": pp_size, "regions": regions,
                                 **_context(dcp_size, dcp_interleave, pcp_size)})
    return spec if layout in ("HND", "NHD") else spec.with_layout(layout)


def _context(dcp_size: int, dcp_interleave: int, pcp_size: int) -> dict[str, int]:
    """The context-parallel fields of a spec dict, written only where set (so a spec without
    them reads as before); the spec checks the values."""
    fields = {"dcp_size": dcp_size, "dcp_interleave": dcp_interleave, "pcp_size": pcp_size}
    return {k: v for k, v in fields.items() if v != 1}


def describe(config: Any) -> dict[str, Any]:
    """What :func:`from_hf_config` reads from a config: architecture, family, layer count, the
    count of each kind of cache layer (attn, swa, mla, indexer, gdn, mamba, kda; a layer may
    hold two: mla and indexer) and of the layers that hold no cache (``uncached_layers``)."""
    r = Reader(load(config, "model config"), "model")
    fam = family_of(r, None)
    layers = layers_of(r, fam, "bfloat16", None, 1)
    counts: dict[str, int] = {}
    for x in layers:
        kind = "swa" if dict(x.fields).get("window") else x.kind
        counts[kind] = counts.get(kind, 0) + 1
    total = layer_count(r, layers)
    return {"architecture": r.arch, "model_type": r.model_type, "family": fam,
            "layers": total, "regions": counts,
            # layers that keep nothing between steps (Nemotron-H's MLP layers): named, so the
            # counts add up to the layer count
            "uncached_layers": total - len({x.index for x in layers})}
