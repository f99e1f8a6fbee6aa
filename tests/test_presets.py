"""Each packaged preset against its model's published numbers: layers, heads, dims, windows."""

from pathlib import Path

import pytest

import kvplan
from kvplan import presets

ROOT = Path(__file__).resolve().parents[1]


def _spec(name, tp=1, **kw):
    return presets.spec(name, tp, num_blocks=8, **kw)


def _by_kind(spec):
    out = {}
    for r in spec.regions:
        key = "swa" if r.window else r.name.rsplit(".", 1)[-1]
        out.setdefault(key, []).append(r)
    return out


def _layers(regions):
    return [int(r.name.split(".")[1]) for r in regions]


# name -> (layers with a cache, attention: (kv heads, head_dim) or None, MLA dim or None)
ATTENTION = {
    "llama-3.1-8b": (32, (8, 128), None),
    "llama-3.1-70b": (80, (8, 128), None),
    "qwen3-8b": (36, (8, 128), None),
    "qwen3-235b-a22b": (94, (4, 128), None),
    "deepseek-v3": (61, None, 576),
    "kimi-k2": (61, None, 576),
    "llama-3.1-8b-eagle3": (1, (8, 128), None),
    "kimi-k2.5-eagle3": (1, (64, 128), None),
}


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_dense_attention_and_mla_presets(name):
    layers, attn, mla = ATTENTION[name]
    spec = _spec(name)
    assert len(spec.regions) == layers and spec.num_groups == 1
    for r in spec.regions:
        if attn:
            assert (r.kind, r.num_kv_heads, r.head_dim, r.window) == (
                kvplan.Kind.ATTENTION, *attn, None)
        else:
            assert (r.kind, r.dim, r.dtype) == (kvplan.Kind.MLA, mla, "bfloat16")
            assert r.is_replicated


def test_deepseek_v32_has_an_mla_latent_and_an_indexer_key_per_layer():
    kinds = _by_kind(_spec("deepseek-v3.2"))
    assert len(kinds["mla"]) == len(kinds["indexer"]) == 61
    assert {(r.dim, r.dtype) for r in kinds["mla"]} == {(576, "bfloat16")}
    # index_head_dim 128 as fp8 plus one float32 scale per 128: 132 bytes (domain.md)
    assert {(r.dim, r.dtype, r.group) for r in kinds["indexer"]} == {(132, "uint8", 0)}


@pytest.mark.parametrize("name,layers,heads,dim,window,full", [
    # Gemma 3: five sliding-window layers, then one global (sliding_window_pattern 6)
    ("gemma-3-27b", 62, 16, 128, 1024, list(range(5, 62, 6))),
    ("gemma-3-1b", 26, 1, 256, 512, [5, 11, 17, 23]),
    # gpt-oss: layer_types alternate sliding / full, sliding first
    ("gpt-oss-120b", 36, 8, 64, 128, list(range(1, 36, 2))),
    ("gpt-oss-20b", 24, 8, 64, 128, list(range(1, 24, 2))),
])
def test_sliding_window_presets(name, layers, heads, dim, window, full):
    spec = _spec(name)
    kinds = _by_kind(spec)
    assert len(spec.regions) == layers
    assert _layers(kinds["attn"]) == full
    assert {(r.num_kv_heads, r.head_dim, r.group) for r in kinds["attn"]} == {(heads, dim, 0)}
    assert {(r.num_kv_heads, r.head_dim, r.window, r.group) for r in kinds["swa"]} == {
        (heads, dim, window, 1)}


@pytest.mark.parametrize("name,layers,ssm_bytes", [
    ("qwen3-next-80b-a3b", 48, 2),  # model dtype
    ("qwen3.5-35b-a3b", 40, 4),  # mamba_ssm_dtype float32
])
def test_gated_deltanet_presets(name, layers, ssm_bytes):
    spec = _spec(name)
    kinds = _by_kind(spec)
    assert len(spec.regions) == layers
    assert _layers(kinds["attn"]) == list(range(3, layers, 4))  # full_attention_interval 4
    assert {(r.num_kv_heads, r.head_dim, r.group) for r in kinds["attn"]} == {(2, 256, 0)}
    assert len(kinds["gdn"]) == layers * 3 // 4
    conv = 3 * 2  # (linear_conv_kernel_dim - 1) bf16 values per channel
    parts = {(p.name, p.units, p.unit_bytes) for p in kinds["gdn"][0].parts}
    assert parts == {
        ("q_conv", 16 * 128, conv), ("k_conv", 16 * 128, conv), ("v_conv", 32 * 128, conv),
        ("ssm", 32, 128 * 128 * ssm_bytes),
    }
    assert {r.group for r in kinds["gdn"]} == {1}


def test_nemotron_h_8b_matches_vllms_conv_numbers():
    spec = _spec("nemotron-h-8b")
    kinds = _by_kind(spec)
    assert _layers(kinds["attn"]) == [7, 18, 29, 40]
    assert {(r.num_kv_heads, r.head_dim) for r in kinds["attn"]} == {(8, 128)}
    assert len(kinds["mamba"]) == 24
    comps = {c.name: c for c in kinds["mamba"][0].components}
    # domain.md: conv_dim 10240 = x 8192 + B 1024 + C 1024 at TP1, 2048 + 256 + 256 at TP4
    channels = {"x": 1, "B": 128, "C": 128}
    assert sum(comps[n].units * channels[n] for n in channels) == 10240
    assert sum(comps[n].local_units(4) * channels[n] for n in channels) == 2560
    assert comps["ssm"].units == 128 and comps["ssm"].unit_bytes == 64 * 128 * 2


def test_kimi_linear_shares_pools_between_mla_and_kda():
    spec = _spec("kimi-linear-48b-a3b")
    kinds = _by_kind(spec)
    assert _layers(kinds["mla"]) == [3, 7, 11, 15, 19, 23, 26]  # full_attn_layers, 1-based
    assert {r.dim for r in kinds["mla"]} == {576}
    assert len(kinds["kda"]) == 20
    parts = {(p.name, p.units, p.unit_bytes) for p in kinds["kda"][0].parts}
    assert parts == {("q_conv", 4096, 6), ("k_conv", 4096, 6), ("v_conv", 4096, 6),
                     ("recurrent", 32, 128 * 128 * 4)}
    # KDA layers in groups as large as the MLA group (7, 7, 6); pool p holds the p-th of each
    assert spec.num_groups == 4
    assert [sum(r.group == g for r in kinds["kda"]) for g in (1, 2, 3)] == [7, 7, 6]
    pools = {}
    for r in spec.regions:
        pools.setdefault(r.pool, []).append(r)
    assert len(pools) == 7 and None not in pools
    for members in pools.values():
        assert sorted(r.group for r in members)[0] == 0
        assert len({r.group for r in members}) == len(members)


def test_every_preset_names_its_checkpoint_and_reads():
    assert len(presets.names()) >= 17
    for name in presets.names():
        cfg = presets.load(name)
        assert cfg["_name_or_path"], name
        spec = _spec(name, tp=2)
        assert spec.tp_size == 2 and spec.regions


def test_presets_load_fresh_copies_and_refuse_unknown_names():
    a = presets.load("llama-3.1-8b")
    a["num_hidden_layers"] = 1
    assert presets.load("llama-3.1-8b")["num_hidden_layers"] == 32
    with pytest.raises(kvplan.SpecError, match=r"no preset named 'llama-4'.*llama-3\.1-8b"):
        presets.load("llama-4")


def test_presets_are_package_data():
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["kvplan"]
    assert "presets/*.json" in globs


@pytest.mark.parametrize("name", ["llama-3.1-70b", "deepseek-v3.2", "gemma-3-27b",
                                  "qwen3-next-80b-a3b", "nemotron-h-8b", "kimi-linear-48b-a3b"])
@pytest.mark.parametrize("tps", [(2, 4), (4, 2)])
def test_presets_plan_under_hetero_tp(name, tps):
    src, dst = (_spec(name, tp=t, block_size=16) for t in tps)
    # A slot per state group, two pages per token group; disjoint ids, as groups may share a pool.
    ids = [[4 + g] if g_state else [1, 3] for g, g_state in enumerate(
           src.regions[[r.group for r in src.regions].index(g)].is_state
           for g in range(src.num_groups))]
    for d in sorted({0, dst.num_ranks - 1}):
        plan = kvplan.pull_map(src, dst, d).plan(ids, ids)
        assert len(plan) and plan.nbytes > 0
