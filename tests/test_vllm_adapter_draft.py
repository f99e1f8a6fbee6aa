"""kvplan.adapters.vllm: one KV-cache group holding an MLA model's layers and a GQA EAGLE-3
draft's attention layer (vLLM's ``UniformTypeKVCacheSpecs``, PR 44583's case), every layer
described from its own ``KVCacheSpec`` and backend.

The engines are allocated as vLLM 0.32 does (see tests/test_vllm_adapter.py): one
``KVCacheTensor`` per layer, the MLA layers ``[B, 1, N, latent]`` read by an MLA backend, the
draft's ``[B, H, N, 2D]`` read by ``CPU_ATTN`` (a head's page: K transposed, then V). The
draft has 2 KV heads, the MLA model's config 4: the count the connector used to apply to every
layer. Checked: what each destination rank's backend reads equals what the source's wrote,
for every layer, at TP 1 -> 2 and 2 -> 1; the derived spec equals an independently written
oracle spec (tests/oracle.py) and each region's bytes on a rank equal its tensor's; a head
count that does not match a tensor is refused naming the layer and both numbers.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvplan import SpecError, pull_map, simulate
from kvplan.adapters.vllm import spec_from_vllm, whole_pages
from tests import oracle
from tests.test_vllm_adapter import (
    FakeTensor,
    FullAttentionSpec,
    MLAAttentionSpec,
    backend_read,
    tokens_of,
)

MLA_LAYERS, LATENT = 4, 576  # a DeepSeek-V2-shaped main model: 4 MLA layers of 512 + 64
DRAFT_HEADS, HEAD_DIM = 2, 16  # the EAGLE-3 draft: one Llama layer of 2 KV heads
TARGET_HEADS = 4  # the main model's num_key_value_heads: not the draft's
BLOCK, NUM_BLOCKS = 8, 6
DRAFT = f"model.layers.{MLA_LAYERS}.self_attn.attn"  # vLLM numbers the draft after the target
BACKENDS = {**{f"model.layers.{i}.self_attn.attn": "CPU_MLA" for i in range(MLA_LAYERS)},
            DRAFT: "CPU_ATTN"}


class UniformTypeKVCacheSpecs(SimpleNamespace):
    pass


def mixed_engine(tp: int, dtype=np.float32):
    """(kv_caches, kv_cache_config, {layer: raw buffer}) of one rank: one group, one tensor per
    layer, the group's spec a UniformTypeKVCacheSpecs naming each layer's own spec."""
    kv, raws, specs, tensors = {}, {}, {}, []
    es = np.dtype(dtype).itemsize
    for name in BACKENDS:
        mla = name != DRAFT
        h = 1 if mla else max(1, DRAFT_HEADS // tp)
        c = LATENT if mla else 2 * HEAD_DIM
        raw = np.zeros(NUM_BLOCKS * h * BLOCK * c * es + 64, np.uint8)  # vLLM pads the size
        kv[name] = FakeTensor(raw[:NUM_BLOCKS * h * BLOCK * c * es].view(dtype).reshape(
            NUM_BLOCKS, h, BLOCK, c))
        raws[name] = raw
        specs[name] = (MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT,
                                        head_size_v=0, dtype=dtype) if mla else
                       FullAttentionSpec(block_size=BLOCK, num_kv_heads=h, head_size=HEAD_DIM,
                                         head_size_v=HEAD_DIM, dtype=dtype))
        tensors.append(SimpleNamespace(size=raw.size, layers=[name], layer_stride=raw.size,
                                       block_stride=h * BLOCK * c * es, offset=0))
    group = SimpleNamespace(layer_names=list(BACKENDS), kv_cache_spec=UniformTypeKVCacheSpecs(
        block_size=BLOCK, kv_cache_specs=specs))
    cfg = SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors,
                          kv_cache_groups=[group])
    return kv, cfg, raws


def derive(kv, cfg, tp):
    heads = {n: TARGET_HEADS if n != DRAFT else DRAFT_HEADS for n in BACKENDS}
    return spec_from_vllm(kv, cfg, tp_size=tp, backend=BACKENDS, total_num_kv_heads=heads)


def fill(kv, rank, tp, seed=3):
    """Every (layer, block, head, token) the backend reads gets values that depend on the
    global head only, so the replicas of an MLA latent and of a head agree across ranks."""
    for name, t in kv.items():
        mla = name != DRAFT
        k, v = backend_read(kv, name, BACKENDS[name], mla)
        rng = np.random.default_rng([seed, list(BACKENDS).index(name)])
        heads = 1 if mla else DRAFT_HEADS
        kk = rng.standard_normal((k.shape[0], heads, *k.shape[2:])).astype(t.dtype)
        vv = rng.standard_normal((k.shape[0], heads, *k.shape[2:])).astype(t.dtype)
        h = k.shape[1]
        first = 0 if mla else rank * h
        k[...] = kk[:, first:first + h]
        if v is not None:
            v[...] = vv[:, first:first + h]


def test_each_layer_gets_its_own_heads_and_page_order():
    kv, cfg, _ = mixed_engine(1)
    spec = derive(kv, cfg, 1)
    by = {r.name: r for r in spec.regions}
    d = by[DRAFT]
    assert (d.kind.value, d.num_kv_heads, d.head_dim, d.layout_name) == \
        ("attention", DRAFT_HEADS, HEAD_DIM, "LBHSND")  # CPU_ATTN: K part then V part
    for name in BACKENDS:
        if name != DRAFT:
            assert (by[name].kind.value, by[name].dim, by[name].layout_name) == \
                ("mla", LATENT, "LBHNSD")
    assert whole_pages(BACKENDS)  # the draft's pages move whole, so the request's blocks do
    assert not whole_pages({n: "CPU_MLA" for n in BACKENDS})


@pytest.mark.parametrize("tp", [1, 2])
def test_spec_equals_the_oracle_and_the_tensors(tp):
    """The derived spec, as the oracle reads it, is what an independent description of the
    model gives, and each region's bytes per rank are its tensor's: the bug described the
    draft with 4 heads, a buffer twice its tensor."""
    kv, cfg, _ = mixed_engine(tp)
    spec = derive(kv, cfg, tp)
    want = {"tp_size": tp, "regions": [
        {"name": f"model.layers.{i}.self_attn.attn", "kind": "mla", "group": 0,
         "num_blocks": NUM_BLOCKS, "block_size": BLOCK, "dtype": "float32", "dim": LATENT}
        for i in range(MLA_LAYERS)] + [
        {"name": DRAFT, "kind": "attention", "group": 0, "num_blocks": NUM_BLOCKS,
         "block_size": BLOCK, "dtype": "float32", "num_kv_heads": DRAFT_HEADS,
         "head_dim": HEAD_DIM, "layout": "LBHSND"}]}
    for r, w in zip(spec.regions, want["regions"], strict=True):
        got = {k: getattr(r, k, None) for k in w if k not in ("kind", "layout")}
        got.update(kind=r.kind.value)
        if "layout" in w:
            got["layout"] = r.layout_name
        assert got == w
        t = kv[r.name]
        assert oracle.rank_region_nbytes(w, tp) == int(np.prod(t.shape)) * t.element_size()
    assert [spec.rank_region_nbytes(i) for i in range(len(spec.regions))] == \
        [oracle.rank_region_nbytes(w, tp) for w in want["regions"]]


@pytest.mark.parametrize("stp,dtp", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_draft_and_mla_bytes_arrive_as_each_backend_reads_them(stp, dtp):
    """P TP ``stp`` -> D TP ``dtp``: every D rank's backends read, in every layer, what the
    P ranks' backends wrote (MLA replicated, the draft's heads split); a 13-token prompt over
    blocks of 8 moves whole blocks, as CPU_ATTN's pages require."""
    src = [mixed_engine(stp) for _ in range(stp)]
    for r, (kv, _, _) in enumerate(src):
        fill(kv, r, stp)
    dst = [mixed_engine(dtp) for _ in range(dtp)]
    sspec = derive(src[0][0], src[0][1], stp)
    dspec = derive(dst[0][0], dst[0][1], dtp)
    src_ids, dst_ids = [4, 1], [2, 5]
    tokens = (0, 16)  # 13 tokens rounded out to whole blocks (whole_pages)
    for d, (dkv, _, draws) in enumerate(dst):
        plan = pull_map(sspec, dspec, d).plan([src_ids], [dst_ids], tokens=tokens)
        sbufs = {(r, i): src[r][2][reg.name] for r in range(stp)
                 for i, reg in enumerate(sspec.regions)}
        dbufs = {(d, i): draws[reg.name] for i, reg in enumerate(dspec.regions)}
        simulate(plan, sbufs, dbufs)
        for name in BACKENDS:
            mla = name != DRAFT
            got = tokens_of(dkv, name, BACKENDS[name], dst_ids, BLOCK, mla)
            if mla:  # every rank holds the latent: rank 0's
                want = tokens_of(src[0][0], name, BACKENDS[name], src_ids, BLOCK, True)
            else:  # D's heads, each from the P rank holding it (vLLM's contiguous shards)
                per_d, per_s = DRAFT_HEADS // dtp, DRAFT_HEADS // stp
                parts = [[w[:, gh % per_s:gh % per_s + 1] for w in tokens_of(
                    src[gh // per_s][0], name, BACKENDS[name], src_ids, BLOCK)]
                    for gh in range(d * per_d, (d + 1) * per_d)]
                want = [np.concatenate([p[s] for p in parts], axis=1) for s in (0, 1)]
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w, err_msg=f"{name} rank {d}")
        # the draft's region moved: 2 blocks x 8 tokens x this rank's heads x K and V x 16
        # values x 4 bytes (with the target's 4 heads it would be twice that)
        assert plan.part([DRAFT]).nbytes == 2 * BLOCK * (DRAFT_HEADS // dtp) * 2 * HEAD_DIM * 4
        mla_bytes = plan.part([n for n in BACKENDS if n != DRAFT]).nbytes
        assert mla_bytes == MLA_LAYERS * 2 * BLOCK * LATENT * 4


def test_a_head_count_that_is_not_the_tensor_is_refused_by_name():
    kv, cfg, _ = mixed_engine(1)
    with pytest.raises(SpecError, match=rf"{DRAFT}.*total_num_kv_heads 4 at tp_size 1 means 4 "
                                        r"KV head\(s\) per rank, its tensor holds 2"):
        spec_from_vllm(kv, cfg, backend=BACKENDS, total_num_kv_heads=TARGET_HEADS)
    kv2, cfg2, _ = mixed_engine(2)
    with pytest.raises(SpecError, match=rf"{DRAFT}.*total_num_kv_heads 4 at tp_size 2 means 2"):
        spec_from_vllm(kv2, cfg2, tp_size=2, backend=BACKENDS,
                       total_num_kv_heads={**dict.fromkeys(BACKENDS, TARGET_HEADS)})
    # a backend mapping that leaves out a layer is refused by the layer's name
    partial = {n: b for n, b in BACKENDS.items() if n != DRAFT}
    with pytest.raises(SpecError, match=rf"{DRAFT}.*no entry in the backend mapping"):
        spec_from_vllm(kv, cfg, backend=partial)
    # one name for every layer (the API before per-layer backends) still works where true
    spec = spec_from_vllm(kv, cfg, backend="CPU_ATTN")
    assert {r.name: r.num_kv_heads for r in spec.regions if r.kind.value == "attention"} == \
        {DRAFT: DRAFT_HEADS}

