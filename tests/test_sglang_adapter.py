"""kvplan.adapters.sglang: specs from SGLang's pools as plain values, planned between
heterogeneous attention-TP sizes and judged byte by byte by the oracle (no SGLang import)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import attrs
import pytest

from kvplan import SpecError, pull_map
from kvplan.adapters.sglang import (
    SGLangKV,
    SGLangMamba2,
    sglang_attention_rank,
    sglang_buffers,
    spec_from_sglang,
    spec_from_sglang_hybrid,
    spec_from_sglang_mamba2,
    spec_from_sglang_swa,
)
from tests.sglang_judge import judge, kvplan_rows

SRC_PAGES, DST_PAGES = [[3, 1, 4]], [[2, 5, 1]]


def mha(tp, heads, page_size, head_dim=8, layers=2):
    kv = SGLangKV.mha(layer_num=layers, size=6 * page_size, page_size=page_size,
                      dtype="bfloat16", head_num=max(1, heads // tp), head_dim=head_dim)
    return spec_from_sglang(kv, attn_tp_size=tp, total_kv_heads=heads)


def mla(tp, page_size):
    kv = SGLangKV.mla(layer_num=2, size=6 * page_size, page_size=page_size, dtype="bfloat16",
                      kv_lora_rank=8, qk_rope_head_dim=4)
    return spec_from_sglang(kv, attn_tp_size=tp)


TPS = [1, 2, 4, 8]


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_mha_every_tp_pair_is_exact(heads, page_size):
    for p, d in itertools.product(TPS, TPS):
        if (heads % p and p % heads) or (heads % d and d % heads):
            continue
        src, dst = mha(p, heads, page_size), mha(d, heads, page_size)
        got = judge(src, dst, SRC_PAGES, DST_PAGES, kvplan_rows(src, dst, SRC_PAGES, DST_PAGES))
        assert got["verdict"] == "exact", (p, d, got)
        assert got["writes"] == 1, (p, d, got)  # every destination byte once


@pytest.mark.parametrize("page_size", [1, 64])
def test_mla_every_tp_pair_is_exact_and_read_once(page_size):
    for p, d in itertools.product(TPS, TPS):
        src, dst = mla(p, page_size), mla(d, page_size)
        got = judge(src, dst, SRC_PAGES, DST_PAGES, kvplan_rows(src, dst, SRC_PAGES, DST_PAGES))
        assert got["verdict"] == "exact" and got["writes"] == 1, (p, d, got)


def test_spec_matches_sglangs_sizes():
    kv = SGLangKV.mha(layer_num=3, size=128, page_size=16, dtype="bfloat16", head_num=2,
                      head_dim=128, start_layer=4)
    spec = spec_from_sglang(kv, attn_tp_size=4)
    assert [r.name for r in spec.regions] == ["layers.4", "layers.5", "layers.6"]
    assert spec.buffers[:2] == ("layers.4.k", "layers.4.v")
    # SGLang's kv_item_len (k_buffer[i][0].nbytes * page_size) and kv_data_len
    assert kv.item_len == 16 * 2 * 128 * 2
    assert spec.rank_buffer_nbytes("layers.4.k") == (128 + 16) * 2 * 128 * 2
    assert spec.regions[0].num_kv_heads == 8  # 2 per rank x 4
    fp8 = SGLangKV.mla(layer_num=1, size=0, page_size=64, dtype="uint8", kv_lora_rank=512,
                       qk_rope_head_dim=64)
    assert spec_from_sglang(fp8, attn_tp_size=8).regions[0].dim == 576


class _T:
    """A tensor's face as the adapter reads it."""

    def __init__(self, shape, dtype="torch.bfloat16", ptr=0):
        self.shape, self.dtype, self._ptr = shape, dtype, ptr

    def data_ptr(self):
        return self._ptr


def _pool(cls, **kw):
    return type(cls, (SimpleNamespace,), {})(**kw)


def test_from_pool_reads_buffers_and_addresses():
    rows = 64 + 16
    pool = _pool("MHATokenToKVPool", layer_num=2, size=64, page_size=16, head_num=1,
                 head_dim=8, v_head_dim=8, start_layer=0, kv_cache_layout=None,
                 k_buffer=[_T((rows, 1, 8), ptr=1000 * (i + 1)) for i in range(2)],
                 v_buffer=[_T((rows, 1, 8), ptr=5000 * (i + 1)) for i in range(2)])
    kv = SGLangKV.from_pool(pool)
    spec = spec_from_sglang(kv, attn_tp_size=8, total_kv_heads=2)  # replicated heads
    assert spec.regions[0].num_kv_heads == 2
    assert sglang_buffers(pool, spec)["layers.1.v"] == (10000, rows * 8 * 2)
    assert pull_map(spec_from_sglang(kv, attn_tp_size=8, total_kv_heads=2),
                    mha(2, 2, 16), 1).peers == (4,)  # decode rank 1 holds head 1: p4..p7


@pytest.mark.parametrize("obj, words", [
    (_pool("MHATokenToKVPoolFP4"), "FP4"),
    (_pool("SWAKVPool"), "sliding-window pool .* SGLangKV.from_swa_pool"),
    (_pool("HybridLinearKVPool", full_kv_pool=_pool("DSATokenToKVPool")),
     "its full-attention pool is a DSATokenToKVPool"),
    (_pool("MHATokenToKVPool", kv_cache_layout="vectorized_5d"), "vectorized_5d"),
    (_pool("MHATokenToKVPool", layer_num=1, size=16, page_size=16, head_num=1, head_dim=192,
           v_head_dim=128, k_buffer=[_T((32, 1, 192))], v_buffer=[_T((32, 1, 192))]),
     "v_buffer of layer 0 has shape (32, 1, 192), the pool's sizes say (32, 1, 128)"),
    (_pool("MHATokenToKVPool", layer_num=2, size=16, page_size=16, head_num=1, head_dim=8,
           v_head_dim=8, k_buffer=[_T((32, 1, 8))] * 3, v_buffer=[_T((32, 1, 8))] * 3),
     "3 k_buffer tensors for layer_num 2"),
    (_pool("MHATokenToKVPool", layer_num=1, size=16, page_size=16, head_num=2, head_dim=8,
           v_head_dim=8, k_buffer=[_T((32, 1, 8))], v_buffer=[_T((32, 1, 8))]),
     "has shape (32, 1, 8)"),
])
def test_refusals_name_the_pool(obj, words):
    with pytest.raises(SpecError, match=words.replace("(", r"\(").replace(")", r"\)")):
        SGLangKV.from_pool(obj)


def mimo(tp, heads, page_size, k_dim=12, v_dim=8):
    """An SGLang engine whose V heads are narrower than its K heads (MiMo-V2: 192 / 128)."""
    rows = 6 * page_size
    pool = _pool("MHATokenToKVPool", layer_num=2, size=rows - page_size, page_size=page_size,
                 head_num=max(1, heads // tp), head_dim=k_dim, v_head_dim=v_dim,
                 start_layer=0, kv_cache_layout=None,
                 k_buffer=[_T((rows, max(1, heads // tp), k_dim), ptr=100 + i)
                           for i in range(2)],
                 v_buffer=[_T((rows, max(1, heads // tp), v_dim), ptr=200 + i)
                           for i in range(2)])
    return pool, spec_from_sglang(SGLangKV.from_pool(pool), attn_tp_size=tp,
                                  total_kv_heads=heads)


def test_v_heads_narrower_than_k_heads_are_two_streams_of_their_own_sizes():
    pool, spec = mimo(2, 4, 16)
    assert [(r.name, r.stream, r.head_dim) for r in spec.regions[:2]] == [
        ("layers.0.k", "k", 12), ("layers.0.v", "v", 8)]
    # the buffers are SGLang's entries: K pages of 2 heads x 12, V pages of 2 heads x 8
    assert sglang_buffers(pool, spec) == {
        "layers.0.k": (100, 96 * 2 * 12 * 2), "layers.1.k": (101, 96 * 2 * 12 * 2),
        "layers.0.v": (200, 96 * 2 * 8 * 2), "layers.1.v": (201, 96 * 2 * 8 * 2)}
    kv = SGLangKV.from_pool(pool)
    assert (kv.item_len, kv.v_item_len) == (16 * 2 * 12 * 2, 16 * 2 * 8 * 2)


@pytest.mark.parametrize("heads", [1, 2, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_v_heads_narrower_than_k_heads_every_tp_pair_is_exact(heads, page_size):
    for p, d in itertools.product(TPS, TPS):
        if (heads % p and p % heads) or (heads % d and d % heads):
            continue
        src, dst = mimo(p, heads, page_size)[1], mimo(d, heads, page_size)[1]
        got = judge(src, dst, SRC_PAGES, DST_PAGES, kvplan_rows(src, dst, SRC_PAGES, DST_PAGES))
        assert got["verdict"] == "exact" and got["writes"] == 1, (p, d, got)


def test_head_counts_that_do_not_fit_are_refused():
    kv = SGLangKV.mha(layer_num=1, size=16, page_size=16, dtype="bfloat16", head_num=1,
                      head_dim=8)
    with pytest.raises(SpecError, match="neither divides"):
        spec_from_sglang(kv, attn_tp_size=4, total_kv_heads=3)
    with pytest.raises(SpecError, match="head_num 1 is not this rank's share of 8"):
        spec_from_sglang(kv, attn_tp_size=4, total_kv_heads=8)


def test_the_judge_catches_a_moved_a_missing_and_an_outside_copy():
    src, dst = mha(4, 8, 16), mha(2, 8, 16)
    rows = kvplan_rows(src, dst, SRC_PAGES, DST_PAGES)
    assert judge(src, dst, SRC_PAGES, DST_PAGES, rows)["verdict"] == "exact"
    moved = [(*rows[0][:5], rows[0][5] + 2, rows[0][6]), *rows[1:]]
    assert judge(src, dst, SRC_PAGES, DST_PAGES, moved)["verdict"] == "wrong"
    assert judge(src, dst, SRC_PAGES, DST_PAGES, rows[1:])["verdict"] == "wrong"
    outside = [(*rows[0][:5], 10**9, rows[0][6]), *rows[1:]]
    assert "outside" in judge(src, dst, SRC_PAGES, DST_PAGES, outside)["detail"]


def mamba2(tp, groups, kind="mamba2"):
    m = SGLangMamba2(layers=(0, 1), slots=6, num_heads=8, head_dim=4, state_size=4,
                     n_groups=groups, conv_kernel=4, conv_dtype="bfloat16",
                     ssm_dtype="float32", kind=kind)
    return spec_from_sglang_mamba2(m, attn_tp_size=tp)


@pytest.mark.parametrize("kind", ["mamba2", "gdn", "kda"])
@pytest.mark.parametrize("groups", [1, 2, 8])
def test_mamba2_and_gdn_state_every_tp_pair_is_exact(groups, kind):
    for p, d in itertools.product(TPS, TPS):
        if any(groups % t and t % groups for t in (p, d)):
            continue
        src, dst = mamba2(p, groups, kind), mamba2(d, groups, kind)
        got = judge(src, dst, [[2]], [[3]], kvplan_rows(src, dst, [[2]], [[3]]))
        assert got["verdict"] == "exact" and got["writes"] == 1, (p, d, got)


def test_mamba2_sizes_are_sglangs():
    # MambaPool at attention TP 2 with one B/C group (padded to one per rank): conv state
    # (8 * 4 + 2 * 2 * 4) / 2 = 24 channels x 3 taps x bf16, temporal 4 heads x 4 x 4 x fp32
    m = SGLangMamba2(layers=(5,), slots=6, num_heads=8, head_dim=4, state_size=4,
                     n_groups=1, conv_kernel=4, conv_dtype="bfloat16", ssm_dtype="float32")
    assert m.item_lens(2) == (144, 256)
    spec = spec_from_sglang_mamba2(m, attn_tp_size=2)
    assert spec.buffers == ("layers.5.conv", "layers.5.ssm")
    assert [spec.rank_buffer_nbytes(b) for b in spec.buffers] == [6 * 144, 6 * 256]
    with pytest.raises(SpecError, match="n_groups 3 and attention TP 2"):
        spec_from_sglang_mamba2(attrs.evolve(m, n_groups=3), attn_tp_size=2)
    with pytest.raises(SpecError, match="8 Mamba heads do not divide over attention TP 16"):
        spec_from_sglang_mamba2(m, attn_tp_size=16)
    gdn = spec_from_sglang_mamba2(attrs.evolve(m, kind="gdn", n_groups=2), attn_tp_size=4)
    assert [p.name for p in gdn.regions[0].parts] == ["q", "k", "v"]
    assert gdn.rank_buffer_nbytes(0) == 6 * 96  # (8 * 4 + 2 * 4 * 4) / 4 channels x 3 x bf16
    with pytest.raises(SpecError, match="state kind 'mamba1'"):
        spec_from_sglang_mamba2(attrs.evolve(m, kind="mamba1"), attn_tp_size=1)


def mha_pp(tp, pp, heads=8, layers=4, page_size=16):
    per = layers // pp
    kvs = [SGLangKV.mha(layer_num=per, size=5 * page_size, page_size=page_size,
                        dtype="bfloat16", head_num=max(1, heads // tp), head_dim=8,
                        start_layer=s * per) for s in range(pp)]
    return spec_from_sglang(kvs if pp > 1 else kvs[0], attn_tp_size=tp, total_kv_heads=heads)


@pytest.mark.parametrize("p, p_pp, d, d_pp", [(2, 2, 4, 1), (4, 2, 1, 1), (1, 4, 2, 2),
                                              (8, 2, 2, 2)])
def test_pipeline_stages_are_exact(p, p_pp, d, d_pp):
    src, dst = mha_pp(p, p_pp), mha_pp(d, d_pp)
    assert src.pp_size == p_pp and src.num_ranks == p * p_pp
    got = judge(src, dst, SRC_PAGES, DST_PAGES, kvplan_rows(src, dst, SRC_PAGES, DST_PAGES))
    assert got["verdict"] == "exact" and got["writes"] == 1, got


def test_pipeline_stages_must_be_consecutive_and_alike():
    a = SGLangKV.mha(layer_num=2, size=16, page_size=16, dtype="bfloat16", head_num=1,
                     head_dim=8)
    with pytest.raises(SpecError, match="PP stage 1 starts at layer 3, stage 0 ends at layer 1"):
        spec_from_sglang([a, attrs.evolve(a, layers=(3, 4))], attn_tp_size=1)
    with pytest.raises(SpecError, match="PP stage 1's pool has page_size 32"):
        spec_from_sglang([a, attrs.evolve(a, layers=(2, 3), page_size=32)], attn_tp_size=1)


def hybrid(tp):
    kv = SGLangKV.mha(layer_num=2, size=5 * 16, page_size=16, dtype="bfloat16",
                      head_num=max(1, 2 // tp), head_dim=8, start_layer=0)
    state = SGLangMamba2(layers=(2, 3), slots=6, num_heads=8, head_dim=4, state_size=4,
                         n_groups=1, conv_kernel=4, conv_dtype="bfloat16", ssm_dtype="float32")
    return spec_from_sglang_hybrid(kv, state, attn_tp_size=tp, total_kv_heads=2)


def test_hybrid_attention_and_state_in_one_spec_every_tp_pair():
    spec = hybrid(2)
    assert [r.group for r in spec.regions] == [0, 0, 1, 1, 1, 1]
    assert spec.buffers[-1] == "layers.3.ssm"
    src_blocks, dst_blocks = [*SRC_PAGES, [2]], [*DST_PAGES, [3]]
    for p, d in itertools.product(TPS, TPS):
        src, dst = hybrid(p), hybrid(d)
        got = judge(src, dst, src_blocks, dst_blocks,
                    kvplan_rows(src, dst, src_blocks, dst_blocks))
        assert got["verdict"] == "exact" and got["writes"] == 1, (p, d, got)


def mamba_pool(tp, *, kind="mamba2", groups=1, heads=8, head_dim=4, state=4, kernel=4,
               layers=(2, 3), slots=6, extra_entries=0):
    """A rank's MambaPool as SGLang builds it (configs/nemotron_h.py, qwen3_next.py and
    kimi_linear.py): conv [layers, slots, channels, taps] (KDA: [.., taps, channels]) in
    bfloat16, temporal [layers, slots, heads / tp, head_dim, state] in float32, and what it
    tells its connections: every layer's conv entry, then every layer's temporal entry."""
    padded = groups if groups % tp == 0 else tp
    if kind == "kda":
        dim = 3 * heads * head_dim // tp
        conv, state = (len(layers), slots, kernel - 1, dim), head_dim
    else:
        dim = (heads * head_dim + 2 * padded * state) // tp
        conv = (len(layers), slots, dim, kernel - 1)
    temporal = (len(layers), slots, heads // tp, head_dim, state)
    conv_item, ssm_item = dim * (kernel - 1) * 2, heads // tp * head_dim * state * 4
    items = [conv_item] * len(layers) + [ssm_item] * len(layers) + [8] * extra_entries
    ptrs = [1000 * (i + 1) for i in range(len(items))]
    shard = [groups * state, groups * state, heads * head_dim] if kind == "gdn" else None
    info = (ptrs, [slots * n for n in items], items)
    methods = {"get_contiguous_buf_infos": lambda self: info,
               "get_state_conv_shard_groups": lambda self: [shard] * len(layers)
               + [None] * len(layers)}
    return type("MambaPool", (SimpleNamespace,), methods)(
        mamba_layer_ids=list(layers), size=slots - 1, conv_slice_axis=1 if kind == "kda" else 0,
        mamba_cache=SimpleNamespace(conv=[_T(conv)],
                                    temporal=_T(temporal, dtype="torch.float32")))


@pytest.mark.parametrize("kind, groups", [("mamba2", 1), ("mamba2", 8), ("gdn", 2),
                                          ("kda", 1)])
def test_mamba_pool_read_from_the_pool_is_the_models_numbers(kind, groups):
    for tp in TPS:
        pool = mamba_pool(tp, kind=kind, groups=groups)
        got = SGLangMamba2.from_pool(pool, attn_tp_size=tp,
                                     n_groups=groups if kind == "mamba2" else None)
        assert got == SGLangMamba2(layers=(2, 3), slots=6, num_heads=8, head_dim=4,
                                   state_size=4, n_groups=groups, conv_kernel=4,
                                   conv_dtype="bfloat16", ssm_dtype="float32", kind=kind)
        spec = spec_from_sglang_mamba2(got, attn_tp_size=tp)
        bufs = sglang_buffers(pool, spec)
        assert bufs["layers.2.conv"][0] == 1000 and bufs["layers.3.ssm"][0] == 4000
        info = pool.get_contiguous_buf_infos()
        assert [bufs[b] for b in spec.buffers] == list(zip(info[0], info[1]))


def test_mamba_pools_sglang_cannot_describe_are_refused_by_name():
    with pytest.raises(SpecError, match="pass n_groups from the model config"):
        SGLangMamba2.from_pool(mamba_pool(2), attn_tp_size=2)
    with pytest.raises(SpecError, match="6 state entries for 2 layers"):
        SGLangMamba2.from_pool(mamba_pool(2, extra_entries=2), attn_tp_size=2, n_groups=1)
    with pytest.raises(SpecError, match="24 conv channels"):  # 8 groups would give 48
        SGLangMamba2.from_pool(mamba_pool(2), attn_tp_size=2, n_groups=8)
    with pytest.raises(SpecError, match="with 4 key heads"):
        SGLangMamba2.from_pool(mamba_pool(1, kind="gdn", groups=2), attn_tp_size=1,
                               n_groups=4)
    with pytest.raises(SpecError, match="not SGLang's MambaPool"):
        SGLangMamba2.from_pool(_pool("SWAKVPool"), attn_tp_size=1)


def test_dp_attention_ranks_and_a_plan_between_two_groups():
    # prefill TP 8 with 4 attention-DP groups of 2, decode TP 8 with 2 groups of 4
    p = [sglang_attention_rank(r, tp_size=8, dp_size=4) for r in range(8)]
    assert [(x.attn_dp_rank, x.attn_tp_rank) for x in p] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert {x.attn_tp_size for x in p} == {2}
    d = sglang_attention_rank(6, tp_size=8, dp_size=2)
    assert (d.attn_dp_rank, d.attn_tp_rank, d.attn_tp_size) == (1, 2, 4)
    # a request in prefill group 3 and decode group 1: one spec per group, at its size
    src, dst = mha(p[7].attn_tp_size, 8, 16), mha(d.attn_tp_size, 8, 16)
    plan = pull_map(src, dst, d.attn_tp_rank).plan(SRC_PAGES, DST_PAGES)
    assert plan.map.peers == (1,)  # decode rank 2 of 4 reads heads 4:6, held by rank 1 of 2
    rows = kvplan_rows(src, dst, SRC_PAGES, DST_PAGES)
    assert judge(src, dst, SRC_PAGES, DST_PAGES, rows)["verdict"] == "exact"
    with pytest.raises(SpecError, match="dp_size 3 does not divide tp_size 8"):
        sglang_attention_rank(0, tp_size=8, dp_size=3)
    with pytest.raises(SpecError, match=r"tp_rank must be an int in \[0, 8\)"):
        sglang_attention_rank(8, tp_size=8, dp_size=2)


def mha_pool(tp, heads, layer_ids, pages=6, page_size=16, base=0, k_dim=8, v_dim=8):
    """An ``MHATokenToKVPool`` as a hybrid pool builds it: dense over its own layers, at the
    global ids SGLang sets as ``model_layer_ids``, start_layer 0."""
    n, rows = max(1, heads // tp), pages * page_size
    return _pool("MHATokenToKVPool", layer_num=len(layer_ids), size=rows - page_size,
                 page_size=page_size, head_num=n, head_dim=k_dim, v_head_dim=v_dim,
                 start_layer=0, kv_cache_layout="nhd", model_layer_ids=tuple(layer_ids),
                 k_buffer=[_T((rows, n, k_dim), ptr=base + 10 * i) for i in range(len(layer_ids))],
                 v_buffer=[_T((rows, n, v_dim), ptr=base + 10 * i + 5)
                           for i in range(len(layer_ids))])


def hybrid_linear_pool(tp, heads=4):
    """A ``HybridLinearKVPool``: full attention on layers 1 and 3, GDN state on 0 and 2."""
    return _pool("HybridLinearKVPool", page_size=16, start_layer=0,
                 full_attention_layer_id_mapping={1: 0, 3: 1},
                 full_kv_pool=mha_pool(tp, heads, (1, 3), base=100),
                 mamba_pool=mamba_pool(tp, kind="gdn", groups=8, layers=(0, 2)))


def test_hybrid_linear_pool_is_its_attention_at_global_layers_and_its_state():
    pool = hybrid_linear_pool(2)
    kv = SGLangKV.from_pool(pool)
    assert kv.layers == (1, 3) and kv.head_num == 2
    state = SGLangMamba2.from_pool(pool, attn_tp_size=2)
    assert (state.layers, state.kind, state.n_groups) == ((0, 2), "gdn", 8)
    spec = spec_from_sglang_hybrid(kv, state, attn_tp_size=2, total_kv_heads=4)
    assert [r.name for r in spec.regions] == [
        "layers.1", "layers.3", "layers.0.conv", "layers.2.conv", "layers.0.ssm",
        "layers.2.ssm"]
    bufs = sglang_buffers(pool, spec)
    assert len(bufs) == len(spec.buffers)
    assert bufs["layers.3.v"][0] == 115 and bufs["layers.0.conv"][0] == 1000
    src_blocks, dst_blocks = [*SRC_PAGES, [2]], [*DST_PAGES, [3]]
    for p, d in itertools.product(TPS, TPS):
        specs = []
        for tp in (p, d):
            one = hybrid_linear_pool(tp)
            specs.append(spec_from_sglang_hybrid(
                SGLangKV.from_pool(one), SGLangMamba2.from_pool(one, attn_tp_size=tp),
                attn_tp_size=tp, total_kv_heads=4))
        got = judge(*specs, src_blocks, dst_blocks, kvplan_rows(*specs, src_blocks, dst_blocks))
        assert got["verdict"] == "exact" and got["writes"] == 1, (p, d, got)


def test_hybrid_linear_pool_whose_layers_disagree_is_refused():
    pool = hybrid_linear_pool(1)
    pool.full_attention_layer_id_mapping = {1: 0, 5: 1}
    with pytest.raises(SpecError, match=r"model_layer_ids \[1, 3\] are not the full-attention "
                                        r"layers \[1, 5\]"):
        SGLangKV.from_pool(pool)
    pool.full_attention_layer_id_mapping = {1: 1, 3: 0}
    with pytest.raises(SpecError, match="does not number its layers"):
        SGLangKV.from_pool(pool)
    bad = mha_pool(1, 4, (1, 3))
    bad.model_layer_ids = (3, 1)
    with pytest.raises(SpecError, match=r"model_layer_ids \[3, 1\] are not 2 increasing"):
        SGLangKV.from_pool(bad)


def swa_pool(tp, heads=8, swa_heads=4, swa_pages=5):
    """A ``SWAKVPool``: full attention on layers 1 and 3 (6 pages), sliding-window layers 0
    and 2 with ``swa_heads`` KV heads in a pool of ``swa_pages`` pages of their own."""
    return _pool("SWAKVPool", page_size=16, layer_num=4, start_layer=0,
                 full_kv_pool=mha_pool(tp, heads, (1, 3), base=100),
                 swa_kv_pool=mha_pool(tp, swa_heads, (0, 2), pages=swa_pages, base=900))


def test_swa_pool_is_two_groups_with_pages_of_their_own():
    full, swa = SGLangKV.from_swa_pool(swa_pool(2))
    assert (full.layers, full.pages, full.head_num) == ((1, 3), 6, 4)
    assert (swa.layers, swa.pages, swa.head_num) == ((0, 2), 5, 2)
    spec = spec_from_sglang_swa(full, swa, attn_tp_size=2, total_kv_heads=8,
                                swa_total_kv_heads=4)
    assert [(r.name, r.group, r.num_blocks) for r in spec.regions] == [
        ("layers.1", 0, 6), ("layers.3", 0, 6), ("layers.0", 1, 5), ("layers.2", 1, 5)]
    bufs = sglang_buffers(swa_pool(2), spec)
    assert len(bufs) == 8 and bufs["layers.2.v"][0] == 915
    src_blocks, dst_blocks = [*SRC_PAGES, [4, 1]], [*DST_PAGES, [2, 3]]
    for swa_heads in (8, 4, 2):
        for p, d in itertools.product(TPS, TPS):
            specs = [spec_from_sglang_swa(*SGLangKV.from_swa_pool(swa_pool(tp, 8, swa_heads)),
                                          attn_tp_size=tp, total_kv_heads=8,
                                          swa_total_kv_heads=swa_heads) for tp in (p, d)]
            got = judge(*specs, src_blocks, dst_blocks,
                        kvplan_rows(*specs, src_blocks, dst_blocks))
            assert got["verdict"] == "exact" and got["writes"] == 1, (swa_heads, p, d, got)


def test_swa_pools_kvplan_cannot_describe_are_refused_by_name():
    pool = swa_pool(1)
    pool.swa_kv_pool.model_layer_ids = (1, 2)
    with pytest.raises(SpecError, match=r"SWAKVPool: layers \[1\] are in both"):
        SGLangKV.from_swa_pool(pool)
    pool = swa_pool(1)
    pool.layer_num = 6
    with pytest.raises(SpecError, match="layer_num 6, its sub-pools hold 2 \\+ 2 layers"):
        SGLangKV.from_swa_pool(pool)
    pool = swa_pool(1)
    pool.swa_kv_pool = _pool("MHATokenToKVPoolFP4")
    with pytest.raises(SpecError, match="MHATokenToKVPoolFP4: FP4"):
        SGLangKV.from_swa_pool(pool)
    with pytest.raises(SpecError, match="HybridLinearKVPool: not SGLang's SWAKVPool"):
        SGLangKV.from_swa_pool(hybrid_linear_pool(1))


def test_hybrid_pipeline_stages_carry_their_own_state():
    """Under PP each stage's HybridLinearKVPool holds its attention and its state layers (at
    global ids); a plan between a prefill of two stages and a decode of one or two is exact."""
    def engine(tp, pp):
        full, state = [(1, 3, 5, 7)], [(0, 2, 4, 6)]
        if pp == 2:
            full, state = [(1, 3), (5, 7)], [(0, 2), (4, 6)]
        pools = [_pool("HybridLinearKVPool", page_size=16, start_layer=4 * s,
                       full_attention_layer_id_mapping={n: i for i, n in enumerate(f)},
                       full_kv_pool=mha_pool(tp, 4, f),
                       mamba_pool=mamba_pool(tp, kind="gdn", groups=8, layers=st))
                 for s, (f, st) in enumerate(zip(full, state))]
        return spec_from_sglang_hybrid([SGLangKV.from_pool(p) for p in pools],
                                       [SGLangMamba2.from_pool(p, attn_tp_size=tp)
                                        for p in pools], attn_tp_size=tp, total_kv_heads=4)
    src = engine(2, 2)
    assert src.pp_size == 2 and src.num_ranks == 4
    assert [r.name for r in src.regions if src.stage_of(src.regions.index(r)) == 1][:3] == [
        "layers.5", "layers.7", "layers.4.conv"]
    src_blocks, dst_blocks = [*SRC_PAGES, [2]], [*DST_PAGES, [3]]
    for p, d, d_pp in [(2, 4, 1), (4, 1, 2), (1, 8, 1), (2, 2, 2)]:
        a, b = engine(p, 2), engine(d, d_pp)
        got = judge(a, b, src_blocks, dst_blocks, kvplan_rows(a, b, src_blocks, dst_blocks))
        assert got["verdict"] == "exact" and got["writes"] == 1, (p, d, d_pp, got)
    one = SGLangKV.from_pool(hybrid_linear_pool(1))
    state = SGLangMamba2.from_pool(hybrid_linear_pool(1), attn_tp_size=1)
    with pytest.raises(SpecError, match="one SGLangKV and one SGLangMamba2 per PP stage, got 2 "
                                        "and 1"):
        spec_from_sglang_hybrid([one, one], [state], attn_tp_size=1)
    with pytest.raises(SpecError, match="PP stage 1 starts at layer 0, stage 0 ends at layer 3"):
        spec_from_sglang_hybrid([one, one], [state, state], attn_tp_size=1)
    with pytest.raises(SpecError, match=r"PP stage 0: layers \[1\] hold both"):
        spec_from_sglang_hybrid(one, attrs.evolve(state, layers=(0, 1)), attn_tp_size=1)
