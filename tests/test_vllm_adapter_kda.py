"""Kimi-Linear (MLA + KDA, vLLM PR 49762's hybrid) through kvplan's vLLM adapter, with the
KV-cache config, tensors and state views vLLM 0.32 itself builds (no kernels needed):
tests/vllm_kda_check.py, run by the vLLM venv's python. Skipped where that venv is not built
(``python tests/vllm_env.py`` builds it)."""

from __future__ import annotations

import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kimi_linear_state_and_mla_pages_arrive_at_every_tp_pair(vllm_python):
    r = subprocess.run([str(vllm_python), "tests/vllm_kda_check.py"], cwd=REPO,
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": REPO})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("KDA", "negative"))]
    print("\n".join(lines))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len([ln for ln in lines if ln.endswith("block 128")]) == 4
    assert any(ln.startswith("negative control") for ln in lines)


def _aliased(nb=4, page=256, state_bytes=64):
    """Two groups of two layers as vLLM 0.32 lays out a hybrid (``get_kv_cache_config_from_
    groups``): every group from byte 0, a group's layers the slots of its KVCacheTensor (layer
    stride = the pages of one layer), a state group (``[B, 1, 1, bytes]`` int8, GDN) and an
    MLA group (``[B, 1, N, 16]`` float32)."""
    from types import SimpleNamespace

    import numpy as np

    from tests.test_vllm_adapter import FakeTensor, MambaSpec, MLAAttentionSpec

    raw = np.zeros(2 * nb * page, np.uint8)
    kv, tensors, groups = {}, [], []
    for g, names in enumerate((["s0", "s1"], ["m0", "m1"])):
        for slot, name in enumerate(names):
            base = raw[slot * nb * page:]
            if g == 0:
                kv[name] = FakeTensor(np.lib.stride_tricks.as_strided(
                    base, (nb, 1, 1, state_bytes), (page, state_bytes, state_bytes, 1)))
            else:
                kv[name] = FakeTensor(np.lib.stride_tricks.as_strided(
                    base.view(np.float32), (nb, 1, page // 64, 16), (page, page, 64, 4)))
        spec = (MambaSpec(block_size=4, shapes=((2, 6), (1, 2, 2)),  # q|k|v 2 each, 2 taps
                          dtypes=("torch.float32", "torch.float32"),
                          mamba_type="MambaAttentionBackendEnum.GDN_ATTN") if g == 0 else
                MLAAttentionSpec(block_size=page // 64, num_kv_heads=1, head_size=16,
                                 head_size_v=0, dtype="float32"))
        groups.append(SimpleNamespace(layer_names=names, kv_cache_spec=spec))
        tensors.append(SimpleNamespace(size=raw.size, layers=names, layer_stride=nb * page,
                                       block_stride=page, offset=0))
    return kv, SimpleNamespace(num_blocks=nb, kv_cache_tensors=tensors, kv_cache_groups=groups)


def test_aliased_groups_become_one_pool_per_layer_slot():
    """No vLLM needed: the layout above gives pools ``pool.0.<slot>`` of the tensors' block
    stride, each holding one layer of each group; a tensor whose slots are pooled only in part
    is refused by name."""
    from kvplan import SpecError
    from kvplan.adapters.vllm import spec_from_vllm, vllm_buffers

    kv, cfg = _aliased()
    spec = spec_from_vllm(kv, cfg, backend={"m0": "CPU_MLA", "m1": "CPU_MLA",
                                            "s0": None, "s1": None})
    got = {r.name: (r.kind.value, r.pool, r.page_bytes, r.allocation) for r in spec.regions}
    assert got == {"s0": ("state", "pool.0.0", 256, None), "s1": ("state", "pool.0.1", 256, None),
                   "m0": ("mla", "pool.0.0", 256, None), "m1": ("mla", "pool.0.1", 256, None)}
    bufs = vllm_buffers(kv, spec)
    base = kv["s0"].data_ptr()
    assert bufs == {"pool.0.0": (base, 4 * 256), "pool.0.1": (base + 4 * 256, 4 * 256)}
    kv2, cfg2 = _aliased()
    kv2["m1"] = type(kv2["m1"])(kv2["m1"].a.copy())  # slot 1 of the MLA group not aliased
    with pytest.raises(SpecError, match=r"KVCacheTensor 0: layers \['s0'\] share"):
        spec_from_vllm(kv2, cfg2, backend="CPU_MLA")
