"""Which family a Hugging Face ``config.json`` is, and what each of its layers holds: the
architecture and model-type tables (:data:`FAMILIES`), the config reader that names every
missing field (:class:`Reader`), and one rule per family turning the config's fields into one
:class:`Layer` per cache layer (full attention, sliding window, MLA + indexer, recurrent state
parts: :func:`mamba2_parts`, :func:`kda_parts`).

Where to look for "what does kvplan read from this config"; :mod:`kvplan.hf` turns the layers
into an engine spec's regions, groups and pools (:func:`kvplan.hf.from_hf_config`) and holds the
theory of operation and the byte sizes.

Layer 5 (adapters on top): imports errors and constants only (the dtype sizes), no value module.
"""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kvplan.constants import DTYPE_SIZES
from kvplan.errors import SpecError

# Architecture names (``architectures[0]``) and model types -> family. Drafts: Eagle-3 heads.
_ARCHITECTURES = {
    "LlamaForCausalLM": "gqa",
    "MistralForCausalLM": "gqa",
    "Qwen2ForCausalLM": "gqa",
    "Qwen3ForCausalLM": "gqa",
    "Qwen3MoeForCausalLM": "gqa",
    "LlamaForCausalLMEagle3": "gqa",
    "Eagle3LlamaForCausalLM": "gqa",
    "DeepseekV2ForCausalLM": "mla",
    "DeepseekV3ForCausalLM": "mla",
    "KimiK25ForConditionalGeneration": "mla",
    "Eagle3DeepseekV3ForCausalLM": "mla",
    "DeepseekV32ForCausalLM": "mla_indexer",
    "Gemma3ForCausalLM": "sliding",
    "Gemma3ForConditionalGeneration": "sliding",
    "GptOssForCausalLM": "sliding",
    "Qwen3NextForCausalLM": "gdn",
    "Qwen3_5ForCausalLM": "gdn",
    "Qwen3_5MoeForCausalLM": "gdn",
    "Qwen3_5ForConditionalGeneration": "gdn",
    "Qwen3_5MoeForConditionalGeneration": "gdn",
    "NemotronHForCausalLM": "mamba2",
    "KimiLinearForCausalLM": "kda",
}
_MODEL_TYPES = {
    "llama": "gqa",
    "mistral": "gqa",
    "qwen2": "gqa",
    "qwen3": "gqa",
    "qwen3_moe": "gqa",
    "deepseek_v2": "mla",
    "deepseek_v3": "mla",
    "kimi_k2": "mla",
    "kimi_k25": "mla",
    "deepseek_v32": "mla_indexer",
    "gemma3": "sliding",
    "gemma3_text": "sliding",
    "gpt_oss": "sliding",
    "qwen3_next": "gdn",
    "qwen3_5": "gdn",
    "qwen3_5_moe": "gdn",
    "qwen3_5_text": "gdn",
    "qwen3_5_moe_text": "gdn",
    "nemotron_h": "mamba2",
    "kimi_linear": "kda",
}
#: The families :func:`from_hf_config` reads, with the fields each needs.
FAMILIES = {
    "gqa": "num_hidden_layers, num_key_value_heads, head_dim (or hidden_size and "
           "num_attention_heads); sliding windows: Mistral's sliding_window, Qwen2/Qwen3's "
           "use_sliding_window, sliding_window, max_window_layers (or layer_types)",
    "mla": "num_hidden_layers, kv_lora_rank, qk_rope_head_dim",
    "mla_indexer": "num_hidden_layers, kv_lora_rank, qk_rope_head_dim, index_head_dim",
    "sliding": "num_hidden_layers, num_key_value_heads, head_dim, sliding_window, layer_types "
               "(or sliding_window_pattern)",
    "gdn": "num_hidden_layers, num_key_value_heads, head_dim, layer_types (or "
           "full_attention_interval), linear_num_key_heads, linear_num_value_heads, "
           "linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim",
    "mamba2": "hybrid_override_pattern, num_key_value_heads, head_dim (or attention_head_dim), "
              "mamba_num_heads, mamba_head_dim, n_groups, ssm_state_size, conv_kernel",
    "kda": "num_hidden_layers, kv_lora_rank, qk_rope_head_dim, linear_attn_config "
           "(full_attn_layers, kda_layers, num_heads, head_dim, short_conv_kernel_size)",
}
DRAFT_FAMILIES = ("gqa", "mla")
_INDEXER_QUANT_BLOCK = 128  # fp8 index keys carry one float32 scale per 128 values
_GEMMA3_PATTERN = 6  # Gemma3TextConfig's default sliding_window_pattern
_KDA_STATE_DTYPE = "float32"  # vLLM keeps KDA's recurrent state in float32


@attrs.frozen
class Layer:
    """One layer's cache: its kind, group key (sorted, then numbered 0..G-1), and fields."""

    index: int
    kind: str  # attn | mla | indexer | gdn | mamba | kda
    group: int
    fields: tuple[tuple[str, Any], ...]
    pool: int | None = None


class Reader:
    """A config's fields (``text_config`` overlaid on the top level) and their checks."""

    def __init__(self, config: Mapping[str, Any], what: str):
        self.what = what
        fields = dict(config)
        text = config.get("text_config")
        if isinstance(text, Mapping):
            fields.update(text)
        self.fields = fields
        archs = config.get("architectures") or []
        self.arch = archs[0] if isinstance(archs, list) and archs else None
        self.model_type = config.get("model_type") or fields.get("model_type")

    @property
    def name(self) -> str:
        return f"{self.what} {self.arch or self.model_type or 'config'!s}"

    def need(self, *alternatives: tuple[str, ...] | str) -> None:
        """Refuse, naming every missing field, unless each alternative is present."""
        missing = []
        for alt in alternatives:
            options = (alt,) if isinstance(alt, str) else alt
            if not any(self.fields.get(f) is not None for f in options):
                missing.append(" or ".join(options))
        if missing:
            raise SpecError(f"{self.name}: config.json lacks {', '.join(missing)}")

    def positive(self, field: str, default: int | None = None) -> int:
        v = self.fields.get(field, default)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise SpecError(f"{self.name}: {field} must be a positive integer, got {v!r}")
        return v

    def head_dim(self, *fields: str) -> int:
        for f in (*fields, "head_dim"):
            if self.fields.get(f) is not None:
                return self.positive(f)
        heads, hidden = self.positive("num_attention_heads"), self.positive("hidden_size")
        if hidden % heads:
            raise SpecError(f"{self.name}: hidden_size {hidden} is not a multiple of "
                            f"num_attention_heads {heads}; give head_dim")
        return hidden // heads

    def kv_heads(self) -> int:
        if self.fields.get("num_key_value_heads") is None:
            # Hugging Face reads a missing value as multi-head attention; a trimmed or
            # hand-written config may simply have lost it, so we do not guess.
            heads = self.fields.get("num_attention_heads")
            hint = (f"; for multi-head attention add \"num_key_value_heads\": {heads} (Hugging "
                    "Face reads a missing value as num_attention_heads)" if heads else "")
            raise SpecError(f"{self.name}: config.json lacks num_key_value_heads{hint}")
        return self.positive("num_key_value_heads")

    def layer_types(self, count: int) -> list[str] | None:
        types = self.fields.get("layer_types")
        if types is None:
            return None
        if not isinstance(types, list) or len(types) != count:
            n = len(types) if isinstance(types, list) else types
            raise SpecError(f"{self.name}: layer_types has {n} entries for "
                            f"num_hidden_layers {count}")
        return types


def load(config: Any, what: str) -> Mapping[str, Any]:
    """The config as a mapping, from a mapping, a ``config.json`` path or its directory;
    ``what`` names it in errors (a :class:`SpecError` for a file that is not UTF-8 JSON)."""
    if isinstance(config, Mapping):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise SpecError(f"{what}: cannot read {str(path)!r}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise SpecError(f"{what}: {str(path)!r} is not UTF-8 text (byte {exc.start}), "
                            "not a config.json") from None
        except json.JSONDecodeError as exc:
            raise SpecError(f"{what}: {str(path)!r} is not JSON: {exc}") from None
        except RecursionError as exc:  # nested deeper than json can parse
            raise SpecError(f"{what}: {str(path)!r} is not readable JSON: {exc}") from None
        if not isinstance(data, Mapping):
            raise SpecError(f"{what}: {str(path)!r} holds a {type(data).__name__}, not an object")
        return data
    raise SpecError(
        f"{what}: expected a dict or a path to config.json, got {type(config).__name__}"
    )


def family_of(r: Reader, family: str | None, allowed=tuple(FAMILIES)) -> str:
    """The family of the config ``r`` reads: ``family`` when given (one of ``allowed``), else
    from its architecture or model type; an unknown one is refused, naming the choices."""
    if family is not None:
        if family not in allowed:
            raise SpecError(f"{r.name}: family {family!r} is not one of {', '.join(allowed)}")
        return family
    found = _ARCHITECTURES.get(r.arch) if r.arch else None
    found = found or _MODEL_TYPES.get(r.model_type)
    if found is None:
        # in lines: the first says what and what to do; the lists follow, wrapped and indented
        known = textwrap.fill(", ".join(sorted(_ARCHITECTURES)), 96,
                              initial_indent="    ", subsequent_indent="    ")
        fams = "\n".join(textwrap.fill(f"{k}: {v}", 96, initial_indent="    ",
                                       subsequent_indent="      ")
                         for k, v in FAMILIES.items() if k in allowed)
        raise SpecError(
            f"{r.what}: unknown architecture {r.arch!r} (model_type {r.model_type!r}); "
            "pass family=NAME (below) to read it\n"
            "  (nothing is guessed: a config that looks like GQA may hide state layers)\n"
            f"  architectures kvplan reads:\n{known}\n"
            f"  families, with the fields each reads:\n{fams}"
        )
    if found not in allowed:
        raise SpecError(f"{r.name}: a {found} model cannot be a draft; drafts are "
                        f"{' or '.join(allowed)} models")
    return found


def _attn(r: Reader, head_fields: tuple[str, ...] = ()) -> tuple[tuple[str, Any], ...]:
    return (("num_kv_heads", r.kv_heads()), ("head_dim", r.head_dim(*head_fields)))


def _mla(r: Reader) -> tuple[tuple[str, Any], ...]:
    return (("dim", r.positive("kv_lora_rank") + r.positive("qk_rope_head_dim")),)


#: How GQA families publish sliding windows, as transformers' configuration files read them:
#: ``mistral``: ``sliding_window`` (null: none) on every layer; ``qwen`` (Qwen2, Qwen3,
#: Qwen3-MoE): ``use_sliding_window`` turns ``sliding_window`` on for the layers
#: ``i >= max_window_layers`` (``layer_types``, where given, names them instead).
_WINDOW_STYLE = {"MistralForCausalLM": "mistral", "mistral": "mistral",
                 "Qwen2ForCausalLM": "qwen", "Qwen3ForCausalLM": "qwen",
                 "Qwen3MoeForCausalLM": "qwen", "qwen2": "qwen", "qwen3": "qwen",
                 "qwen3_moe": "qwen"}
_SLIDING = "sliding_attention"


def _gqa_windows(r: Reader, n: int) -> list[int | None]:
    """Each layer's sliding window (None: full attention) from the fields the family publishes;
    a window field of a family whose rule we do not know is refused by name, never dropped."""
    f = r.fields
    types = r.layer_types(n)
    marked = [t == _SLIDING for t in types] if types is not None else None
    style = _WINDOW_STYLE.get(r.arch or "") or _WINDOW_STYLE.get(r.model_type or "")
    if style == "qwen":
        use = f.get("use_sliding_window", False)
        if not isinstance(use, bool):
            raise SpecError(f"{r.name}: use_sliding_window must be true or false, got {use!r}")
        if not use:  # transformers then drops sliding_window: every layer attends fully
            if marked and any(marked):
                raise SpecError(f"{r.name}: layer_types marks {sum(marked)} layer(s) "
                                f"{_SLIDING} but use_sliding_window is false; fix one of them")
            return [None] * n
        window = r.positive("sliding_window")
        if marked is None:
            m = f.get("max_window_layers")
            if isinstance(m, bool) or not isinstance(m, int) or m < 0:
                raise SpecError(
                    f"{r.name}: use_sliding_window is true, so config.json needs "
                    f"max_window_layers (layers i >= it use the window of {window}) or "
                    f"layer_types; got max_window_layers {m!r}")
            marked = [i >= m for i in range(n)]
        return [window if s else None for s in marked]
    if style == "mistral":
        if f.get("sliding_window") is None:
            if marked and any(marked):
                raise SpecError(f"{r.name}: layer_types marks {sum(marked)} layer(s) "
                                f"{_SLIDING} but sliding_window is null")
            return [None] * n
        window = r.positive("sliding_window")
        return [window if s else None for s in (marked or [True] * n)]
    published = [k for k in ("sliding_window", "use_sliding_window") if f.get(k)]
    published += ["layer_types"] if marked and any(marked) else []
    if published:
        shown = ", ".join(f"{k} {f[k]!r}" for k in published if k != "layer_types")
        shown = ", ".join(x for x in (shown, "layer_types with sliding_attention"
                                      if "layer_types" in published else "") if x)
        raise SpecError(
            f"{r.name}: config.json sets {shown}, but kvplan does not know how this family "
            "applies a sliding window to its layers (it reads the windows of Mistral, Qwen2, "
            "Qwen3 and Qwen3-MoE configs, and of the sliding family: Gemma 3, gpt-oss); pass "
            "family='sliding' to read layer_types / sliding_window_pattern, or remove the "
            "field if every layer attends fully")
    return [None] * n


def _layers_gqa(r: Reader) -> list[Layer]:
    r.need("num_hidden_layers", ("head_dim", "hidden_size"))
    f = _attn(r)
    n = r.positive("num_hidden_layers")
    return [Layer(i, "attn", 1, (*f, ("window", w))) if w else Layer(i, "attn", 0, f)
            for i, w in enumerate(_gqa_windows(r, n))]


def _layers_mla(r: Reader, indexer: bool = False) -> list[Layer]:
    r.need("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim",
           *(["index_head_dim"] if indexer else []))
    out = []
    for i in range(r.positive("num_hidden_layers")):
        out.append(Layer(i, "mla", 0, _mla(r)))
        if indexer:
            d = r.positive("index_head_dim")
            scales = -(-d // _INDEXER_QUANT_BLOCK) * 4
            out.append(Layer(i, "indexer", 0, (("dim", d + scales), ("dtype", "uint8"))))
    return out


def _layers_sliding(r: Reader) -> list[Layer]:
    r.need("num_hidden_layers", ("head_dim", "hidden_size"))
    n = r.positive("num_hidden_layers")
    f = _attn(r)
    window = r.fields.get("sliding_window")
    types = r.layer_types(n)
    if window is None:
        sliding = [False] * n
    elif types is not None:
        sliding = [t == "sliding_attention" for t in types]
    elif r.model_type == "gpt_oss" or r.arch == "GptOssForCausalLM":
        sliding = [i % 2 == 0 for i in range(n)]  # gpt-oss alternates, sliding first
    else:
        pattern = r.positive("sliding_window_pattern", _GEMMA3_PATTERN)
        sliding = [(i + 1) % pattern != 0 for i in range(n)]
    if window is not None:
        window = r.positive("sliding_window")
    return [
        Layer(i, "attn", 1, (*f, ("window", window))) if s else Layer(i, "attn", 0, f)
        for i, s in enumerate(sliding)
    ]


def mamba2_parts(heads: int, head_dim: int, groups: int, state_size: int, conv_kernel: int,
                 dtype_bytes: int, state_bytes: int) -> tuple[dict, ...]:
    """A Mamba2 layer's state-slot parts: conv x (``heads * head_dim`` channels), B and C
    (``groups`` of ``state_size`` channels), each ``conv_kernel - 1`` values per channel, and the
    temporal state (``head_dim x state_size`` per head)."""
    conv = (conv_kernel - 1) * dtype_bytes
    return (
        {"name": "x", "units": heads * head_dim, "unit_bytes": conv},
        {"name": "B", "units": groups, "unit_bytes": state_size * conv},
        {"name": "C", "units": groups, "unit_bytes": state_size * conv},
        {"name": "ssm", "units": heads, "unit_bytes": head_dim * state_size * state_bytes},
    )


def kda_parts(heads: int, head_dim: int, conv_kernel: int, dtype_bytes: int,
              state_bytes: int) -> tuple[dict, ...]:
    """A KDA layer's four state parts: short-conv states of q, k, v (per channel) and the
    recurrent state (``head_dim x head_dim`` per head)."""
    conv = (conv_kernel - 1) * dtype_bytes
    return (
        {"name": "q_conv", "units": heads * head_dim, "unit_bytes": conv},
        {"name": "k_conv", "units": heads * head_dim, "unit_bytes": conv},
        {"name": "v_conv", "units": heads * head_dim, "unit_bytes": conv},
        {"name": "recurrent", "units": heads, "unit_bytes": head_dim * head_dim * state_bytes},
    )


def _state_dtype(r: Reader, state_dtype: str | None, default: str) -> str:
    return state_dtype or r.fields.get("mamba_ssm_dtype") or default


def _layers_gdn(r: Reader, dtype: str, state_dtype: str | None) -> list[Layer]:
    r.need("num_hidden_layers", ("head_dim", "hidden_size"), "linear_num_key_heads",
           "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
           "linear_conv_kernel_dim")
    n = r.positive("num_hidden_layers")
    types = r.layer_types(n)
    if types is not None:
        full = [t == "full_attention" for t in types]
    else:
        interval = r.positive("full_attention_interval", 4)
        full = [(i + 1) % interval == 0 for i in range(n)]
    e = DTYPE_SIZES[dtype]
    es = _dtype_size(r, _state_dtype(r, state_dtype, dtype))
    hk, hv = r.positive("linear_num_key_heads"), r.positive("linear_num_value_heads")
    dk, dv = r.positive("linear_key_head_dim"), r.positive("linear_value_head_dim")
    conv = (r.positive("linear_conv_kernel_dim") - 1) * e
    parts = (
        {"name": "q_conv", "units": hk * dk, "unit_bytes": conv},
        {"name": "k_conv", "units": hk * dk, "unit_bytes": conv},
        {"name": "v_conv", "units": hv * dv, "unit_bytes": conv},
        {"name": "ssm", "units": hv, "unit_bytes": dk * dv * es},
    )
    attn = _attn(r)
    return [
        Layer(i, "attn", 0, attn) if f else Layer(i, "gdn", 1, (("parts", parts),))
        for i, f in enumerate(full)
    ]


def _layers_mamba2(r: Reader, dtype: str, state_dtype: str | None) -> list[Layer]:
    r.need("hybrid_override_pattern", ("head_dim", "attention_head_dim", "hidden_size"),
           "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel")
    pattern = r.fields["hybrid_override_pattern"]
    n = r.fields.get("num_hidden_layers", len(pattern))
    if not isinstance(pattern, str) or len(pattern) != n or set(pattern) - set("M*-E"):
        raise SpecError(f"{r.name}: hybrid_override_pattern must be {n} characters of M, *, -, "
                        f"E (Mamba2, attention, MLP, MoE), got {pattern!r}")
    e = DTYPE_SIZES[dtype]
    es = _dtype_size(r, _state_dtype(r, state_dtype or r.fields.get("mamba_ssm_cache_dtype"),
                                     dtype))
    parts = mamba2_parts(r.positive("mamba_num_heads"), r.positive("mamba_head_dim"),
                         r.positive("n_groups"), r.positive("ssm_state_size"),
                         r.positive("conv_kernel"), e, es)
    out = []
    for i, c in enumerate(pattern):
        if c == "M":
            out.append(Layer(i, "mamba", 1, (("parts", parts),)))
        elif c == "*":
            out.append(Layer(i, "attn", 0, _attn(r, ("attention_head_dim",))))
    return out


def _layers_kda(r: Reader, dtype: str, state_dtype: str | None, pp_size: int) -> list[Layer]:
    r.need("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "linear_attn_config")
    lin = r.fields["linear_attn_config"]
    n = r.positive("num_hidden_layers")
    sub = Reader(lin, f"{r.name} linear_attn_config") if isinstance(lin, Mapping) else None
    if sub is None:
        raise SpecError(f"{r.name}: linear_attn_config must be an object")
    sub.need("full_attn_layers", "kda_layers", "num_heads", "head_dim", "short_conv_kernel_size")
    full, kda = lin["full_attn_layers"], lin["kda_layers"]  # 1-based, as published
    if sorted([*full, *kda]) != list(range(1, n + 1)):
        raise SpecError(f"{r.name}: linear_attn_config's full_attn_layers and kda_layers must "
                        f"split layers 1..{n} (1-based), got {full} and {kda}")
    e = DTYPE_SIZES[dtype]
    es = _dtype_size(r, _state_dtype(r, state_dtype, _KDA_STATE_DTYPE))
    parts = kda_parts(sub.positive("num_heads"), sub.positive("head_dim"),
                      sub.positive("short_conv_kernel_size"), e, es)
    mla_set = {i - 1 for i in full}
    out = []
    for stage in range(pp_size):  # pools never cross a pipeline stage
        layers = [i for i in range(n) if stage_of(i, n, pp_size) == stage]
        mla = [i for i in layers if i in mla_set]
        kda_l = [i for i in layers if i not in mla_set]
        size = len(mla) or len(kda_l)
        pool_base = stage * n  # pool ids unique across stages
        for p, i in enumerate(mla):
            out.append(Layer(i, "mla", 0, _mla(r), pool_base + p if kda_l else None))
        for k, i in enumerate(kda_l):
            g, p = divmod(k, size)
            out.append(Layer(i, "kda", 1 + g, (("parts", parts),),
                              pool_base + p if mla else None))
    return sorted(out, key=lambda x: x.index)


def _dtype_size(r: Reader, name: str) -> int:
    if name not in DTYPE_SIZES:
        raise SpecError(f"{r.name}: state dtype {name!r} is not one of {', '.join(DTYPE_SIZES)}")
    return DTYPE_SIZES[name]


def layer_count(r: Reader, layers: list[Layer]) -> int:
    """Layers of the model (those without a cache included)."""
    given = r.fields.get("num_hidden_layers")
    return given if isinstance(given, int) and given > 0 else 1 + max(x.index for x in layers)


def stage_of(layer: int, layers: int, pp_size: int) -> int:
    """The pipeline stage of layer ``layer`` of ``layers``: ``layer * pp_size // layers``."""
    return layer * pp_size // layers


def layers_of(r: Reader, family: str, dtype: str, state_dtype: str | None,
            pp_size: int) -> list[Layer]:
    """The cache layers of a config of ``family``, by that family's rule, in layer order."""
    if family == "gqa":
        return _layers_gqa(r)
    if family in ("mla", "mla_indexer"):
        return _layers_mla(r, indexer=family == "mla_indexer")
    if family == "sliding":
        return _layers_sliding(r)
    if family == "gdn":
        return _layers_gdn(r, dtype, state_dtype)
    if family == "mamba2":
        return _layers_mamba2(r, dtype, state_dtype)
    return _layers_kda(r, dtype, state_dtype, pp_size)


def dtype_of(r: Reader, dtype: str | None) -> str:
    """The KV cache's dtype: ``dtype`` when given, else the config's ``torch_dtype``; refused
    when neither names a dtype kvplan knows (a wrong guess would mis-size every block)."""
    if dtype is None:  # the config's, or a refusal: a wrong guess would mis-size every block
        found = r.fields.get("torch_dtype") or r.fields.get("dtype")
        if found is None:
            raise SpecError(f"{r.name}: config.json lacks torch_dtype (or dtype): pass the KV "
                            "cache's dtype, e.g. dtype='bfloat16' (kvplan: --dtype bfloat16)")
        if found not in DTYPE_SIZES:
            raise SpecError(f"{r.name}: config.json's torch_dtype {found!r} is not a KV-cache "
                            f"dtype kvplan knows ({', '.join(DTYPE_SIZES)}): pass dtype=")
        return found
    if dtype not in DTYPE_SIZES:
        raise SpecError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
    return dtype


