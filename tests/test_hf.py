"""kvplan.hf.from_hf_config on each family: small configs, files, drafts, stages and refusals."""

import json
import re

import pytest

import kvplan
from kvplan import EngineSpec, Kind, SpecError, presets
from kvplan.hf import describe, from_hf_config

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 4,
         "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
         "torch_dtype": "bfloat16"}
MLA = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 3,
       "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}
EAGLE_GQA = {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
             "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
EAGLE_MLA = {"architectures": ["Eagle3DeepseekV3ForCausalLM"], "num_hidden_layers": 1,
             "kv_lora_rank": 512, "qk_rope_head_dim": 64}


def test_gqa_one_attention_region_per_layer():
    spec = from_hf_config(LLAMA, tp_size=4, block_size=32, num_blocks=100)
    assert [r.name for r in spec.regions] == [f"layers.{i}.attn" for i in range(4)]
    r = spec.regions[0]
    assert (r.kind, r.num_kv_heads, r.head_dim, r.block_size, r.num_blocks, r.dtype) == (
        Kind.ATTENTION, 8, 128, 32, 100, "bfloat16")
    assert spec.rank_block_nbytes(0) == 2 * 32 * 2 * 128 * 2  # K+V, 2 heads/rank, bf16


def test_package_name_is_the_adapter_function_and_options_apply():
    # the spec value knows no builder (tests/test_structure.py): kvplan.from_hf_config is the
    # adapter's function itself, re-exported, not a wrapper that could drift from it
    assert kvplan.from_hf_config is from_hf_config
    assert not hasattr(EngineSpec, "from_hf_config") and not hasattr(EngineSpec, "from_vllm")
    a = kvplan.from_hf_config(LLAMA, tp_size=2, dtype="float16", layout="NHD", kv="joint")
    assert {(r.dtype, r.layout.value, r.kv.value) for r in a.regions} == {
        ("float16", "NHD", "joint")}


def test_config_without_kv_heads_is_refused_naming_the_field_and_the_mha_reading():
    cfg = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    with pytest.raises(SpecError, match=r"config\.json lacks num_key_value_heads; for "
                                        r"multi-head attention add \"num_key_value_heads\": 32"):
        from_hf_config(cfg, tp_size=1)
    assert from_hf_config({**cfg, "num_key_value_heads": 32}, tp_size=1).regions[0]\
        .num_kv_heads == 32


def test_dtype_is_the_configs_or_the_callers_never_a_guess():
    assert from_hf_config({**LLAMA, "torch_dtype": "float16"}, tp_size=1).regions[0].dtype == (
        "float16")
    no_dtype = {k: v for k, v in LLAMA.items() if k != "torch_dtype"}
    assert from_hf_config({**no_dtype, "dtype": "float16"}, tp_size=1).regions[0].dtype == (
        "float16")  # the field's newer name
    with pytest.raises(SpecError, match=r"config\.json lacks torch_dtype \(or dtype\): "
                                        r"pass .*dtype='bfloat16'.*--dtype"):
        from_hf_config(no_dtype, tp_size=1)
    with pytest.raises(SpecError, match=r"torch_dtype 'float64' is not a KV-cache dtype"):
        from_hf_config({**LLAMA, "torch_dtype": "float64"}, tp_size=1)
    assert from_hf_config(no_dtype, tp_size=1, dtype="float16").regions[0].dtype == "float16"
    with pytest.raises(SpecError, match=r"dtype 'int4'"):
        from_hf_config(LLAMA, tp_size=1, dtype="int4")


def test_mla_latent_is_kv_lora_rank_plus_rope_dim():
    spec = from_hf_config(MLA, tp_size=8)
    assert {(r.kind, r.dim) for r in spec.regions} == {(Kind.MLA, 576)}
    assert spec.rank_block_nbytes(0) == 16 * 576 * 2  # replicated: the whole latent per rank


def test_deepseek_v32_indexer_bytes_follow_index_head_dim():
    cfg = {**MLA, "architectures": ["DeepseekV32ForCausalLM"], "index_head_dim": 256}
    spec = from_hf_config(cfg, tp_size=2, block_size=64)
    idx = [r for r in spec.regions if r.kind is Kind.INDEXER]
    assert len(idx) == 3 and {(r.dim, r.dtype, r.block_size) for r in idx} == {
        (256 + 2 * 4, "uint8", 64)}
    assert [r.name for r in spec.regions[:2]] == ["layers.0.mla", "layers.0.indexer"]


def test_sliding_window_from_layer_types_pattern_or_gpt_oss_alternation():
    base = {"num_hidden_layers": 6, "num_key_value_heads": 4, "head_dim": 64,
            "sliding_window": 256, "torch_dtype": "bfloat16"}
    by_types = from_hf_config({**base, "architectures": ["GptOssForCausalLM"],
                               "layer_types": ["full_attention"] * 5 + ["sliding_attention"]},
                              tp_size=1)
    assert [r.window for r in by_types.regions] == [None] * 5 + [256]
    assert [r.group for r in by_types.regions] == [0] * 5 + [1]
    gpt = from_hf_config({**base, "model_type": "gpt_oss"}, tp_size=1)
    assert [r.window for r in gpt.regions] == [256, None] * 3
    gemma = from_hf_config({**base, "model_type": "gemma3_text", "sliding_window_pattern": 3},
                           tp_size=1)
    assert [r.window for r in gemma.regions] == [256, 256, None] * 2
    no_window = from_hf_config({**base, "model_type": "gemma3_text", "sliding_window": None},
                               tp_size=1)
    assert no_window.num_groups == 1 and not any(r.window for r in no_window.regions)


def test_multimodal_wrappers_read_text_config():
    spec = presets.spec("gemma-3-27b", 2)
    assert len(spec.regions) == 62 and spec.regions[0].num_kv_heads == 16


def test_gdn_state_parts_and_state_dtype_override():
    cfg = presets.load("qwen3-next-80b-a3b")
    spec = from_hf_config(cfg, tp_size=2, state_dtype="float32")
    gdn = next(r for r in spec.regions if r.kind is Kind.STATE)
    assert {p.name: p.unit_bytes for p in gdn.parts}["ssm"] == 128 * 128 * 4
    assert gdn.block_size == 1 and gdn.group == 1


def test_interval_is_used_when_layer_types_are_absent():
    cfg = dict(presets.load("qwen3.5-35b-a3b")["text_config"])
    del cfg["layer_types"]
    cfg["full_attention_interval"] = 2
    spec = from_hf_config(cfg, tp_size=1)
    assert [r.kind.value for r in spec.regions[:4]] == ["state", "attention"] * 2


def test_gqa_main_model_with_mla_draft_shares_group_zero():
    spec = from_hf_config(LLAMA, tp_size=4, draft=EAGLE_MLA)
    assert [r.name for r in spec.regions][-1] == "draft.0.mla"
    assert {r.group for r in spec.regions} == {0}
    assert [r.is_replicated for r in spec.regions] == [False] * 4 + [True]


def test_mla_main_model_with_gqa_draft_as_in_vllm_pr_44583():
    spec = presets.spec("kimi-k2", 8, draft="kimi-k2.5-eagle3")
    draft = spec.regions[-1]
    assert draft.name == "draft.0.attn" and draft.num_kv_heads == 64 and draft.group == 0
    src, dst = presets.spec("kimi-k2", 8, draft="kimi-k2.5-eagle3"), presets.spec(
        "kimi-k2", 4, draft="kimi-k2.5-eagle3")
    m = kvplan.pull_map(src, dst, 1)
    assert {lane.placement.value for lane in m.lanes} == {"R", "S"}


def test_draft_from_a_path_and_refused_when_not_gqa_or_mla(tmp_path):
    path = tmp_path / "draft.json"
    path.write_text(json.dumps(EAGLE_GQA))
    spec = from_hf_config(LLAMA, tp_size=2, draft=str(path))
    assert spec.regions[-1].name == "draft.0.attn"
    with pytest.raises(SpecError, match="cannot be a draft"):
        from_hf_config(LLAMA, tp_size=2, draft=presets.load("nemotron-h-8b"))


def test_config_from_file_or_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    a = from_hf_config(tmp_path / "config.json", tp_size=2)
    b = from_hf_config(str(tmp_path), tp_size=2)
    assert a == b == from_hf_config(LLAMA, tp_size=2)
    with pytest.raises(SpecError, match="cannot read"):
        from_hf_config(tmp_path / "missing.json", tp_size=2)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SpecError, match="is not JSON"):
        from_hf_config(tmp_path / "bad.json", tp_size=2)
    with pytest.raises(SpecError, match="expected a dict or a path"):
        from_hf_config(42, tp_size=2)


def test_pipeline_stages_cut_layers_evenly_and_put_the_draft_last():
    spec = from_hf_config({**LLAMA, "num_hidden_layers": 6}, tp_size=2, pp_size=3,
                          draft=EAGLE_GQA)
    assert [spec.stage_of(i) for i in range(7)] == [0, 0, 1, 1, 2, 2, 2]
    assert spec.num_ranks == 6 and spec.regions_on(5) == (4, 5, 6)


def test_kimi_linear_pools_stay_within_a_stage():
    spec = presets.spec("kimi-linear-48b-a3b", 2, pp_size=3, num_blocks=4)
    for r in spec.regions:
        if r.pool is not None:
            i = spec.region_index(r.name)
            members = [j for j, x in enumerate(spec.regions) if x.pool == r.pool]
            assert {spec.stage_of(j) for j in members} == {spec.stage_of(i)}


def test_unknown_architecture_is_named():
    cfg = {"architectures": ["FalconForCausalLM"], "model_type": "falcon",
           "num_hidden_layers": 2}
    with pytest.raises(SpecError, match=r"unknown architecture 'FalconForCausalLM' "
                                        r"\(model_type 'falcon'\).*family=NAME"):
        from_hf_config(cfg, tp_size=1)


def test_family_override_reads_an_unknown_architecture_and_names_missing_fields():
    cfg = {"architectures": ["FalconForCausalLM"], "num_hidden_layers": 2,
           "torch_dtype": "bfloat16"}
    with pytest.raises(SpecError, match=r"FalconForCausalLM: config\.json lacks head_dim or "
                                        r"hidden_size"):
        from_hf_config(cfg, tp_size=1, family="gqa")
    spec = from_hf_config({**cfg, "num_key_value_heads": 2, "head_dim": 64}, tp_size=1,
                          family="gqa")
    assert len(spec.regions) == 2
    with pytest.raises(SpecError, match="family 'rwkv' is not one of"):
        from_hf_config(cfg, tp_size=1, family="rwkv")


@pytest.mark.parametrize("name,drop,missing", [
    ("deepseek-v3", ["kv_lora_rank", "qk_rope_head_dim"], "kv_lora_rank, qk_rope_head_dim"),
    ("deepseek-v3.2", ["index_head_dim"], "index_head_dim"),
    ("qwen3-next-80b-a3b", ["linear_num_value_heads"], "linear_num_value_heads"),
    ("nemotron-h-8b", ["n_groups", "conv_kernel"], "n_groups, conv_kernel"),
    ("kimi-linear-48b-a3b", ["linear_attn_config"], "linear_attn_config"),
])
def test_known_architecture_missing_fields_are_all_named(name, drop, missing):
    cfg = {k: v for k, v in presets.load(name).items() if k not in drop}
    with pytest.raises(SpecError, match=f"lacks {missing}$"):
        from_hf_config(cfg, tp_size=1)


def test_inconsistent_layer_lists_are_refused():
    cfg = presets.load("gpt-oss-20b")
    cfg["layer_types"] = cfg["layer_types"][:-1]
    with pytest.raises(SpecError, match="layer_types has 23 entries for num_hidden_layers 24"):
        from_hf_config(cfg, tp_size=1)
    cfg = presets.load("kimi-linear-48b-a3b")
    cfg["linear_attn_config"]["kda_layers"] = [1, 2]
    with pytest.raises(SpecError, match=r"must split layers 1\.\.27"):
        from_hf_config(cfg, tp_size=1)
    cfg = presets.load("nemotron-h-8b")
    cfg["hybrid_override_pattern"] = "M*X"
    with pytest.raises(SpecError, match="hybrid_override_pattern must be 52 characters"):
        from_hf_config(cfg, tp_size=1)


def test_tp_that_does_not_divide_the_heads_is_refused_by_the_spec():
    with pytest.raises(SpecError, match=r"num_kv_heads 8 and tp_size 3"):
        from_hf_config(LLAMA, tp_size=3)


def test_describe_counts_cache_layers():
    d = describe(presets.load("gemma-3-1b"))
    assert d == {"architecture": "Gemma3ForCausalLM", "model_type": "gemma3_text",
                 "family": "sliding", "layers": 26, "regions": {"swa": 22, "attn": 4},
                 "uncached_layers": 0}


# -- sliding windows of GQA families (issue 26): read as transformers reads them, or refused --

GQA = {"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 8,
       "torch_dtype": "bfloat16"}


def _windows(**cfg) -> list:
    return [r.window for r in from_hf_config({**GQA, **cfg}, tp_size=1).regions]


def test_mistral_sliding_window_applies_to_every_layer():
    assert _windows(architectures=["MistralForCausalLM"], sliding_window=4096) == [4096] * 4
    assert _windows(architectures=["MistralForCausalLM"], sliding_window=None) == [None] * 4
    spec = from_hf_config({**GQA, "architectures": ["MistralForCausalLM"],
                           "sliding_window": 4096}, tp_size=1)
    assert spec.num_groups == 1  # one group of windowed layers


def test_qwen_windows_follow_use_sliding_window_and_max_window_layers():
    on = {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert _windows(architectures=[arch], **on) == [None, None, 64, 64], arch
    # Qwen2.5's published configs: sliding_window set but switched off
    assert _windows(architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
                    sliding_window=131072, max_window_layers=2) == [None] * 4
    types = ["sliding_attention", "full_attention"] * 2
    assert _windows(model_type="qwen2", use_sliding_window=True, sliding_window=32,
                    layer_types=types) == [32, None, 32, None]
    spec = from_hf_config({**GQA, "architectures": ["Qwen2ForCausalLM"], **on}, tp_size=1)
    assert spec.num_groups == 2  # full and windowed layers in groups of their own


@pytest.mark.parametrize(("cfg", "says"), [
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 64},
     "needs max_window_layers"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
      "max_window_layers": 1}, "sliding_window must be a positive integer, got None"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": "yes"},
     "use_sliding_window must be true or false"),
    ({"architectures": ["LlamaForCausalLM"], "sliding_window": 4096},
     "sets sliding_window 4096, but kvplan does not know how"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": None,
      "layer_types": ["sliding_attention"] * 4}, "but sliding_window is null"),
])
def test_a_window_field_is_read_or_refused_by_name(cfg, says):
    with pytest.raises(SpecError, match=re.escape(says)):
        from_hf_config({**GQA, **cfg}, tp_size=1)


def test_unknown_architecture_error_is_in_short_lines():
    cfg = {"architectures": ["FalconForCausalLM"], "model_type": "falcon",
           "num_hidden_layers": 2}
    with pytest.raises(SpecError) as err:
        from_hf_config(cfg, tp_size=1)
    lines = str(err.value).splitlines()
    assert "family=NAME" in lines[0] and len(lines) > 5
    assert max(map(len, lines)) <= 120
    assert any(line.strip().startswith("gqa: ") for line in lines)


def test_describe_counts_the_layers_without_a_cache():
    d = describe(presets.load("nemotron-h-8b"))
    assert d["layers"] == 52 and d["regions"] == {"mamba": 24, "attn": 4}
    assert d["uncached_layers"] == 24
    assert describe(presets.load("deepseek-v3.2"))["uncached_layers"] == 0
