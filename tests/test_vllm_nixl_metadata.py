"""kvplan.adapters.vllm_nixl: a stock NixlConnector prefill's spec from its published metadata.

The prefill engines are tests/test_vllm_adapter.py's (allocated as vLLM 0.32 allocates). Their
``NixlAgentMetadata`` is rebuilt from the tensors as vLLM 0.32's
``NixlBaseConnectorWorker.register_kv_caches`` (``kv_connector/v1/nixl/base_worker.py``) fills
it: layers in ``_region_sort_key`` order, one region per layer page, ``(data_ptr, page bytes,
stride(0) bytes)``, layers at an address already seen joining its region (group -1 when the
groups differ), ``block_size`` / ``num_blocks`` of kernel blocks, ``ssm_sizes`` from the
``MambaSpec`` shapes (``derive_mamba_conv_split``), ``region_num_blocks`` all the kernel block
count once a state layer is present. The metadata is read from the tensors, never from a
kvplan spec, so the two derivations check each other.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvplan import EngineSpec, IncompatibleLayoutError, pull_map, simulate
from kvplan.adapters.vllm import spec_from_vllm, vllm_buffers
from kvplan.adapters.vllm_nixl import NixlMetadataError, prefill_from_nixl, region_sort_key
from tests import oracle
from tests.test_vllm_adapter import MambaSpec, fake_engine, hybrid_engine


def nixl_metadata(kv, cfg, raw_nbytes, *, layout, backend, ratio=1):
    """One rank's NixlAgentMetadata fields, as register_kv_caches builds them."""
    specs = {n: g.kv_cache_spec for g in cfg.kv_cache_groups for n in g.layer_names}
    group = {n: gi for gi, g in enumerate(cfg.kv_cache_groups) for n in g.layer_names}
    has_mamba = any(isinstance(s, MambaSpec) for s in specs.values())
    bases, lens, strides, nbs, groups, names = [], [], [], [], [], []
    ssm = (0, 0)
    for name in sorted(kv, key=region_sort_key):
        t, s = kv[name], specs[name]
        es = t.element_size()
        if isinstance(s, MambaSpec):  # page_size_bytes: padded to the pool's page
            page = t.stride()[0] * es
            blen, stride, nb = page // ratio, page // ratio, cfg.num_blocks
            conv, temporal = s.shapes  # DS; float32 in these engines
            ssm = (int(np.prod(conv)) * 4, int(np.prod(temporal)) * 4)
        else:
            page = int(np.prod(t.shape[1:])) * es  # page_size_bytes // ratio
            stride, nb = t.stride()[0] * es, cfg.num_blocks * ratio
            block_major = 0 <= raw_nbytes - nb * stride < stride
            # torch's cache[0].is_contiguous(): axes of size 1 do not count
            dense, step = True, es
            for size, st in reversed(list(zip(t.shape[1:], t.stride()[1:]))):
                dense &= size == 1 or st * es == step
                step *= size
            # a block-major storage whose page is not one run registers whole storage rows,
            # a segmented one a region per segment: neither is built here
            assert dense if block_major else stride == page
            blen = page
        mla = type(s).__name__.startswith("MLA")
        ptr = t.data_ptr()
        if ptr in bases:
            i = bases.index(ptr)
            if mla:
                lens[i], strides[i], nbs[i] = blen, stride, nb
            if groups[i] != group[name]:
                groups[i] = -1
            continue
        bases.append(ptr)
        lens.append(blen)
        strides.append(stride)
        nbs.append(nb)
        groups.append(group[name])
        names.append(name)
    kernel_block = next(iter(kv.values())).shape[2] if not has_mamba else 4
    return {"engine_id": "prefill-0", "agent_metadata": b"", "kv_caches_base_addr": bases,
            "device_id": 0, "num_blocks": cfg.num_blocks * ratio, "block_lens": lens,
            "block_strides": strides, "kv_cache_layout": layout, "block_size": kernel_block,
            "ssm_sizes": ssm, "attn_backend_name": backend,
            "physical_blocks_per_logical_kv_block": ratio,
            "region_num_blocks": [cfg.num_blocks * ratio] * len(bases) if has_mamba else nbs,
            "region_group_ids": groups, "region_names": names, "region_mem_types": None,
            "dcp_size": 1, "pcp_size": 1, "ple_block_len": None, "region_members": [],
            "packed_member_layouts": {}}


def _check_bytes(pspec, dspec, src_blocks, dst_blocks):
    """Plan the prefill -> every decode rank from the adapter's spec; the oracle's bytes."""
    sd, dd = pspec.to_dict(), dspec.to_dict()
    sbuf = oracle.source_buffers(sd, seed=5, request_blocks=src_blocks)
    for rank in range(dspec.num_ranks):
        plan = pull_map(pspec, dspec, rank).plan(src_blocks, dst_blocks)
        before = oracle.destination_buffers(dd, seed=6)
        expected, _ = oracle.expected_buffers(sd, dd, src_blocks, dst_blocks, rank, sbuf, before)
        got = oracle.clone_buffers(before, rank)
        simulate(plan, sbuf, got)
        for name, exp in expected.items():
            j = dspec.buffer_regions(dspec.buffers.index(name))[0]
            assert np.array_equal(got[(rank, j)], exp), (name, rank)


DENSE = [("FLASH_ATTN", "LBHNC", False), ("FLASH_ATTN", "LBNHC", False),
         ("TRITON_ATTN", "BLHNC", False), ("CPU_MLA", "LBHNC", True)]


@pytest.mark.parametrize("backend,layout,mla", DENSE)
@pytest.mark.parametrize("ptp,dtp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_dense_and_mla_spec_from_metadata_is_the_prefills(backend, layout, mla, ptp, dtp):
    kw = {"layout": layout, "mla": mla, "heads": 2, "block": 4, "num_blocks": 6}
    prefill = [fake_engine(tp=ptp, **kw) for _ in range(ptp)]
    decode = fake_engine(tp=dtp, **{**kw, "num_blocks": 9})
    truth = spec_from_vllm(prefill[0][0], prefill[0][1], tp_size=ptp, backend=backend,
                           total_num_kv_heads=2)
    dspec = spec_from_vllm(decode[0], decode[1], tp_size=dtp, backend=backend,
                           total_num_kv_heads=2)
    metas = [nixl_metadata(kv, cfg, raw.size, layout=layout, backend=backend)
             for kv, cfg, raw in prefill]
    got = prefill_from_nixl(dspec, metas, backend=backend)
    assert got.spec == truth
    assert got.buffers == tuple(vllm_buffers(kv, truth, r) for r, (kv, _, _)
                                in enumerate(prefill))
    _check_bytes(got.spec, dspec, [[5, 0, 3]], [[2, 8, 4]])


def test_kernel_blocks_and_another_decode_block_size():
    # the prefill runs logical blocks of 8 as kernel blocks of 4 (physical_blocks_per_logical 2):
    # it publishes block_size 4 and twice the blocks; the decode uses blocks of 4
    prefill = fake_engine(block=8, kernel=4, num_blocks=6)
    decode = fake_engine(block=4, num_blocks=12)
    truth = spec_from_vllm(prefill[0], prefill[1], backend="FLASH_ATTN")
    dspec = spec_from_vllm(decode[0], decode[1], backend="FLASH_ATTN")
    meta = nixl_metadata(prefill[0], prefill[1], prefill[2].size, layout="LBHNC",
                         backend="FLASH_ATTN", ratio=2)
    assert (meta["block_size"], meta["num_blocks"]) == (4, 12)
    got = prefill_from_nixl(dspec, [meta], backend="FLASH_ATTN")
    assert got.spec == truth and got.spec.regions[0].kernel_block_size == 4
    _check_bytes(got.spec, dspec, [[5, 1]], [[3, 7, 0, 11]])


@pytest.mark.parametrize("decode_conv", ["SD", "DS"])
@pytest.mark.parametrize("groups,ptp,dtp", [(1, 1, 2), (1, 2, 1), (2, 2, 2), (2, 1, 1)])
def test_mamba2_hybrid_spec_from_metadata(decode_conv, groups, ptp, dtp):
    # the stock prefill's conv state is DS (NixlConnector asserts it); the decode may be SD
    prefill = [hybrid_engine(groups=groups, tp=ptp, rank=r, conv_layout="DS") for r in range(ptp)]
    decode = hybrid_engine(groups=groups, tp=dtp, rank=0, conv_layout=decode_conv)
    truth = spec_from_vllm(prefill[0][0], prefill[0][1], tp_size=ptp, mamba_n_groups=groups,
                           conv_layout="DS")
    dspec = spec_from_vllm(decode[0], decode[1], tp_size=dtp, mamba_n_groups=groups,
                           conv_layout=decode_conv)
    metas = [nixl_metadata(kv, cfg, pool.size, layout="LBHNC", backend="FLASH_ATTN")
             for kv, cfg, pool in prefill]
    # the three layers view one pool from byte 0: one region, named by the first layer
    assert metas[0]["region_names"] == ["model.layers.0.mixer"]
    assert metas[0]["region_group_ids"] == [-1]
    got = prefill_from_nixl(dspec, metas, backend="FLASH_ATTN")
    assert got.spec == truth
    assert got.buffers == tuple(vllm_buffers(kv, truth, r) for r, (kv, _, _)
                                in enumerate(prefill))
    if decode_conv == "DS":
        _check_bytes(got.spec, dspec, [[5], [1, 3], [7]], [[2], [4, 6], [0]])
    else:  # the spec is exact, but kvplan's planner pairs only equal state parts
        with pytest.raises(IncompatibleLayoutError, match=r"'model.layers.0.mixer': state "
                                                          r"parts differs: source \['x_conv:"):
            pull_map(got.spec, dspec, 0)


def _dense(layout="LBHNC"):
    prefill = fake_engine(layout=layout)
    dspec = spec_from_vllm(*fake_engine(layout="LBHNC")[:2], backend="FLASH_ATTN")
    meta = nixl_metadata(prefill[0], prefill[1], prefill[2].size, layout=layout,
                         backend="FLASH_ATTN")
    return dspec, meta


@pytest.mark.parametrize("field,value,match", [
    ("block_lens", [512, 256], r"region 'model.layers.1.self_attn.attn': block_lens 256, "
                               r"this model at TP 1 has 512"),
    ("block_strides", [512, 1024], r"'model.layers.1.self_attn.attn': block_strides 1024, "
                                   r"this model at TP 1 has 512"),
    ("kv_cache_layout", "LHBNC", r"kv_cache_layout LHBNC: NixlConnector registers"),
    ("block_size", 8, r"'model.layers.0.self_attn.attn': block_lens 512, this model at TP 1 "
                      r"has 1024"),
    ("attn_backend_name", "TRITON_ATTN", r"the prefill runs 'TRITON_ATTN', this decode "
                                         r"'FLASH_ATTN'"),
    ("region_names", ["a", "b"], r"region_names \['a', 'b'\]"),
    ("dcp_size", 2, r"dcp_size is 2"),
])
def test_refusals_name_the_field_and_both_numbers(field, value, match):
    dspec, meta = _dense()
    meta[field] = value
    with pytest.raises(NixlMetadataError, match=match):
        prefill_from_nixl(dspec, [meta], backend="FLASH_ATTN")


def test_address_and_rank_disagreements_are_refused():
    dspec, meta = _dense()
    moved = dict(meta, kv_caches_base_addr=[meta["kv_caches_base_addr"][0],
                                            meta["kv_caches_base_addr"][1] + 64])
    with pytest.raises(NixlMetadataError, match=r"region 'model.layers.1.self_attn.attn': "
                                                r"kv_caches_base_addr 0x.* puts its buffer "
                                                r"'kv_cache_tensors.0' at 0x"):
        prefill_from_nixl(dspec, [moved], backend="FLASH_ATTN")
    other = dict(meta, num_blocks=7)
    with pytest.raises(NixlMetadataError, match=r"num_blocks: prefill rank 1 publishes 7, "
                                                r"rank 0 6"):
        prefill_from_nixl(dspec, [meta, other], backend="FLASH_ATTN")


def test_ssm_size_mismatch_is_refused():
    prefill = hybrid_engine(groups=2, tp=1, rank=0, conv_layout="DS")
    decode = hybrid_engine(groups=2, tp=1, rank=0, conv_layout="DS")
    dspec = spec_from_vllm(decode[0], decode[1], conv_layout="DS")
    meta = nixl_metadata(prefill[0], prefill[1], prefill[2].size, layout="LBHNC",
                         backend="FLASH_ATTN")
    conv, temporal = meta["ssm_sizes"]
    meta["ssm_sizes"] = (conv, temporal * 2)  # a model with twice the heads
    with pytest.raises(NixlMetadataError, match=rf"region 'model.layers.0.mixer': ssm_sizes "
                                                rf"\({conv}, {temporal * 2}\), this model at "
                                                rf"TP 1 has \({conv}, {temporal}\)"):
        prefill_from_nixl(dspec, [meta], backend="FLASH_ATTN")


def test_result_is_a_spec_a_plan_takes():
    dspec, meta = _dense("BLHNC")
    got = prefill_from_nixl(dspec, [meta], backend="FLASH_ATTN")
    assert isinstance(got.spec, EngineSpec) and got.spec.regions[0].layout_name == "BLHNSD"
    assert got.device_ids == (0,) and got.engine_id == "prefill-0"
