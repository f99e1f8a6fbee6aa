"""kvplan.adapters.vllm: specs derived from vLLM 0.32's KV cache tensors, no vLLM needed.

The fake engines below allocate exactly as vLLM 0.32 does (``create_kv_cache_views`` and
``compute_layout_strides`` in ``vllm/v1/kv_cache_interface.py``): one raw byte buffer per
``KVCacheTensor``, each layer a 4-D ``[B, H, N, C]`` strided view whose strides are the
``KVCacheLayout`` permutation of ``[L, B, H, N, C]``. Each backend's reader is modelled too:
``CPU_ATTN`` keeps a head's page as a K part ``[D, N]`` (transposed) then a V part ``[N, D]``
(``cpu_attn.py``, and what vLLM 0.32's ``cpu_attn_reshape_and_cache`` writes with the ``vec``
ISA, float32, block 32: checked against the kernel, see docs/vllm.md), FLASH_ATTN
and TRITON_ATTN split ``C`` into K and V halves of one token (``flash_attn.py``,
``triton_attn.py``), MLA backends read ``[B, 1, N, latent]``. A transfer is then planned
between two such engines from the derived specs, applied with ``kvplan.simulate``, and every
(layer, token, head, K/V) the destination backend reads is compared with what the source
backend wrote.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvplan import EngineSpec, SpecError, pull_map, simulate
from kvplan.adapters.vllm import spec_from_vllm, vllm_buffers, whole_pages

# vLLM 0.32's KVCacheLayout: the physical order of the logical axes [L, B, H, N, C]
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


class FakeTensor:
    """What the adapter may touch of a torch tensor, over a numpy view."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.shape = a.shape
        self.dtype = a.dtype

    def stride(self):
        return tuple(s // self.a.itemsize for s in self.a.strides)

    def element_size(self):
        return self.a.itemsize

    def data_ptr(self):
        return self.a.__array_interface__["data"][0]


class FullAttentionSpec(SimpleNamespace):
    pass


class MLAAttentionSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


def fake_engine(*, layers=2, heads=2, tp=1, head=8, block=4, kernel=None, num_blocks=6,
                layout="LBHNC", mla=False, dtype=np.float32):
    """(kv_caches, kv_cache_config, raw buffer) of one rank, allocated as vLLM 0.32 does."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    h = 1 if mla else max(1, heads // tp)
    c = head if mla else 2 * head
    n = kernel or block
    b = num_blocks * (block // n)
    es = np.dtype(dtype).itemsize
    shape = (layers, b, h, n, c * es)  # logical [L, B, H, N, C], C in bytes
    order = LAYOUTS[layout]
    strides, step = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    raw = np.zeros(step + 64, np.uint8)  # vLLM's KVCacheTensor.size may exceed the pages
    views = {}
    for i, name in enumerate(names):
        v = np.lib.stride_tricks.as_strided(raw[i * strides[0]:], shape[1:], strides[1:])
        views[name] = v
    kv = {k: FakeTensor(v.view(dtype)) for k, v in views.items()}
    if mla:
        spec = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=head,
                                head_size_v=0, dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=block, num_kv_heads=h, head_size=head,
                                 head_size_v=head, dtype=dtype)
    kt = SimpleNamespace(size=raw.size, layers=names, layer_stride=strides[0],
                         block_stride=strides[1] * (block // n), offset=0)
    cfg = SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=[kt],
                          kv_cache_groups=[SimpleNamespace(layer_names=names,
                                                           kv_cache_spec=spec)])
    return kv, cfg, raw


def backend_read(kv, name, backend, mla=False):
    """What the backend reads from layer ``name``: K and V as [blocks, heads, tokens, D]
    (V None for MLA), per manager block (kernel blocks regrouped)."""
    a = kv[name].a
    b, h, n, c = a.shape
    if mla:
        return a, None
    if backend == "CPU_ATTN":  # a K part [D, N] then a V part [N, D] per (block, head)
        s, e, d = a.strides, a.itemsize, c // 2
        assert s[2] == c * e  # N right outside C: the page is N x 2D values
        k = np.lib.stride_tricks.as_strided(a, (b, h, n, d), (s[0], s[1], e, n * e))
        v_start = a[:, :, n // 2:]  # N*D values into the page (n is even here)
        v = np.lib.stride_tricks.as_strided(v_start, (b, h, n, d), (s[0], s[1], d * e, e))
        return k, v
    return a[..., : c // 2], a[..., c // 2:]  # flash_attn.py: split(head_size, dim=-1)


def fill(kv, backend, mla=False, seed=0):
    rng = np.random.default_rng(seed)
    for name in kv:
        k, v = backend_read(kv, name, backend, mla)
        k[...] = rng.standard_normal(k.shape)
        if v is not None:
            v[...] = rng.standard_normal(v.shape)


def tokens_of(kv, name, backend, ids, block, mla=False, tp_rank=0, tp=1, heads=2):
    """K and V of request positions, one row per token: [tokens, global heads held, D]."""
    out = []
    for part in backend_read(kv, name, backend, mla):
        if part is None:
            continue
        bk, h, n, d = part.shape
        ratio = block // n
        per = part.reshape(bk // ratio, ratio, h, n, d).transpose(0, 1, 3, 2, 4)
        per = per.reshape(bk // ratio, block, h, d)  # [block, token in block, head, D]
        out.append(per[np.asarray(ids)].reshape(-1, h, d))
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_order_from_strides_every_layout(layout):
    kv, cfg, _ = fake_engine(layout=layout)
    spec = spec_from_vllm(kv, cfg, backend="FLASH_ATTN")
    want = layout[:-1] + "SD"  # C = K then V of one token
    assert {r.layout_name for r in spec.regions} == {want}
    assert [r.name for r in spec.regions] == list(kv)
    assert spec.regions[0].allocation == "kv_cache_tensors.0"  # both layers: one buffer
    assert spec.regions[0].num_kv_heads == 2 and spec.regions[0].head_dim == 8


def test_cpu_attn_reads_k_tokens_then_v_tokens():
    kv, cfg, _ = fake_engine()
    spec = spec_from_vllm(kv, cfg, backend="CPU_ATTN")
    assert spec.regions[0].layout_name == "LBHSND"
    # CPU_ATTN supports only LBHNC (cpu_attn.py, supported_kv_cache_layouts): N must sit
    # right outside C for the [2, N, D] reading
    kv, cfg, _ = fake_engine(layout="LBNHC")
    with pytest.raises(SpecError, match="N right outside C"):
        spec_from_vllm(kv, cfg, backend="CPU_ATTN")


def test_single_head_keeps_its_place():
    kv, cfg, _ = fake_engine(heads=2, tp=2)  # one KV head per rank: H of size 1
    spec = spec_from_vllm(kv, cfg, backend="CPU_ATTN", tp_size=2)
    assert spec.regions[0].layout_name == "LBHSND" and spec.regions[0].num_kv_heads == 2


def test_mla_latent_and_kernel_blocks():
    kv, cfg, _ = fake_engine(mla=True, head=24, layout="BLHNC")
    spec = spec_from_vllm(kv, cfg, backend="CPU_MLA", tp_size=2)
    r = spec.regions[0]
    assert (r.kind.value, r.dim) == ("mla", 24)
    assert r.layout_name == "BLHNSD"  # H and S (one each) keep their logical place
    kv, cfg, _ = fake_engine(block=8, kernel=4)
    r = spec_from_vllm(kv, cfg, backend="FLASH_ATTN").regions[0]
    assert (r.block_size, r.kernel_block_size) == (8, 4)


def _roundtrip(src, dst, backend, tokens, src_ids, dst_ids, block, dst_from="zero", mla=False,
               heads=2):
    """Plan P -> every D rank from the derived specs, simulate, compare what D's backend reads
    with what P's backend wrote, for every layer, head and position in ``tokens``."""
    (skv, scfg, sraw, stp), dst_ranks = src, dst  # a TP1 source: rank 0 holds every head
    sspec = spec_from_vllm(skv, scfg, tp_size=stp, backend=backend, total_num_kv_heads=heads)
    dtp = len(dst_ranks)
    for r, (dkv, dcfg, draw) in enumerate(dst_ranks):
        dspec = spec_from_vllm(dkv, dcfg, tp_size=dtp, backend=backend, total_num_kv_heads=heads)
        assert isinstance(dspec, EngineSpec)
        tmap = pull_map(sspec, dspec, r)
        plan = tmap.plan([src_ids], [dst_ids], tokens=tokens, dst_from=dst_from)
        srcb = {(0, name): sraw for name in sspec.buffers}
        dstb = {(r, name): draw for name in dspec.buffers}
        simulate(plan, srcb, dstb)
        lo, hi = tokens
        d_first = lo // block if dst_from == "start" else 0
        for name in skv:
            got = tokens_of(dkv, name, backend, dst_ids, block, mla)
            want = tokens_of(skv, name, backend, src_ids, block, mla)
            for g, w in zip(got, want, strict=True):
                g = g[lo - d_first * block:hi - d_first * block]
                w = w[lo:hi]
                if mla:
                    np.testing.assert_array_equal(g, w)
                else:  # D rank r holds heads [r*k, (r+1)*k) of the P rank's
                    k = g.shape[1]
                    first = r * k if w.shape[1] > k else 0
                    np.testing.assert_array_equal(g, w[:, first:first + k])


@pytest.mark.parametrize("backend,layout", [("CPU_ATTN", "LBHNC"), ("FLASH_ATTN", "LBNHC"),
                                            ("FLASH_ATTN", "BLHNC"), ("TRITON_ATTN", "BHLNC")])
@pytest.mark.parametrize("dtp", [1, 2])
def test_bytes_a_backend_reads_arrive(backend, layout, dtp):
    # a prompt of 13 tokens over blocks of 4: the last block is copied in part (position 12)
    # where the backend reads tokens row by row; CPU_ATTN's pages move whole (whole_pages)
    block, heads = 4, 2
    tokens = (0, 16) if whole_pages(backend) else (0, 13)
    skv, scfg, sraw = fake_engine(layout=layout, heads=heads, block=block)
    fill(skv, backend)
    dst = [fake_engine(layout=layout, heads=heads, tp=dtp, block=block) for _ in range(dtp)]
    _roundtrip((skv, scfg, sraw, 1), dst, backend, tokens, [5, 0, 3, 1], [2, 4, 0, 5],
               block)


def test_cpu_attn_pages_move_whole():
    # CPU_ATTN's K part is [D, N]: copying the first positions of a block as rows would move
    # other tokens' values, which is why whole_pages() is true for it and not for FLASH_ATTN
    assert whole_pages("CPU_ATTN") and not whole_pages("FLASH_ATTN")
    block = 4
    skv, scfg, sraw = fake_engine(block=block)
    fill(skv, "CPU_ATTN")
    dkv, dcfg, draw = fake_engine(block=block)
    with pytest.raises(AssertionError):
        _roundtrip((skv, scfg, sraw, 1), [(dkv, dcfg, draw)], "CPU_ATTN", (0, 6), [1, 2],
                   [3, 4], block)
    _roundtrip((skv, scfg, sraw, 1), [(dkv, dcfg, draw)], "CPU_ATTN", (0, 8), [1, 2], [3, 4],
               block)


def test_prefix_hit_moves_only_the_missing_blocks():
    block = 4
    skv, scfg, sraw = fake_engine(block=block)
    fill(skv, "FLASH_ATTN")
    dkv, dcfg, draw = fake_engine(block=block)
    # decode holds positions 0..7 already; vLLM lists only the blocks it lacks
    _roundtrip((skv, scfg, sraw, 1), [(dkv, dcfg, draw)], "FLASH_ATTN", (8, 14),
               [5, 0, 3, 1], [4, 2], block, dst_from="start")
    k, v = backend_read(dkv, "model.layers.0.self_attn.attn", "FLASH_ATTN")
    assert not k[2, :, 2:].any() and not v[2, :, 2:].any()  # positions 14, 15: not written
    dspec = spec_from_vllm(dkv, dcfg, backend="FLASH_ATTN")
    sspec = spec_from_vllm(skv, scfg, backend="FLASH_ATTN")
    plan = pull_map(sspec, dspec, 0).plan([[5, 0, 3, 1]], [[4, 2]], tokens=(8, 14),
                                          dst_from="start")
    full = pull_map(sspec, dspec, 0).plan([[5, 0, 3, 1]], [[4, 2, 0, 1]], tokens=(0, 14))
    assert plan.nbytes * 14 == full.nbytes * 6  # 6 of 14 positions


def test_mla_roundtrip_tp2_to_tp1():
    block = 4
    skv, scfg, sraw = fake_engine(mla=True, head=24, block=block, layout="BLHNC")
    fill(skv, "CPU_MLA", mla=True)
    dkv, dcfg, draw = fake_engine(mla=True, head=24, block=block, layout="LBHNC")
    _roundtrip((skv, scfg, sraw, 1), [(dkv, dcfg, draw)], "CPU_MLA", (0, 10), [1, 2, 3],
               [3, 4, 5], block, mla=True)


def test_buffers_are_the_allocation():
    kv, cfg, raw = fake_engine(layout="BLNHC")
    spec = spec_from_vllm(kv, cfg, backend="FLASH_ATTN")
    bufs = vllm_buffers(kv, spec)
    (addr, nbytes), = bufs.values()
    assert addr == raw.__array_interface__["data"][0]
    assert nbytes == raw.size - 64  # the pages, not vLLM's padding after them


def test_refusals_name_the_layer():
    kv, cfg, _ = fake_engine()
    name = "model.layers.1.self_attn.attn"
    bad = dict(kv)
    bad[name] = FakeTensor(kv[name].a[:, :, :, :8])  # C of 8, the spec says 2 x 8
    with pytest.raises(SpecError, match=r"layers\.1.*does not match its FullAttentionSpec"):
        spec_from_vllm(bad, cfg)
    with pytest.raises(SpecError, match="without a tensor"):
        spec_from_vllm({k: v for k, v in kv.items() if k != name}, cfg)
    with pytest.raises(SpecError, match="'XFORMERS'"):
        spec_from_vllm(kv, cfg, backend="XFORMERS")
    cfg.kv_cache_groups[0].kv_cache_spec = MambaSpec(block_size=4)
    with pytest.raises(SpecError, match="a MambaSpec tensor is a byte view"):
        spec_from_vllm(kv, cfg)


def test_padded_pages_and_moved_slots_are_refused():
    kv, cfg, _ = fake_engine(layout="BLHNC")
    name = "model.layers.1.self_attn.attn"
    cfg.kv_cache_tensors[0].layer_stride += 4  # pages with a gap between layers
    with pytest.raises(SpecError, match="not a dense permutation"):
        spec_from_vllm(kv, cfg)
    cfg.kv_cache_tensors[0].layer_stride -= 4
    spec = spec_from_vllm(kv, cfg)
    moved = dict(kv)
    moved[name] = FakeTensor(np.lib.stride_tricks.as_strided(
        kv[name].a[..., 1:], kv[name].a.shape, kv[name].a.strides))
    with pytest.raises(SpecError, match=r"layers\.1.*should start at"):
        vllm_buffers(moved, spec)


def test_imports_stay_apart():
    # the adapter is pure (no torch, no vllm); kvplan_nixl never loads vLLM on import; the
    # connector module without vLLM installed is an ImportError naming vllm, nothing else
    code = (
        "import sys, kvplan, kvplan.adapters.vllm\n"
        "assert not any(m.split('.')[0] in ('torch', 'vllm', 'nixl') for m in sys.modules)\n"
        "import kvplan_nixl\n"
        "assert 'vllm' not in sys.modules\n"
        "try:\n"
        "    import vllm\n"
        "except ImportError:\n"
        "    try:\n"
        "        import kvplan_nixl.vllm\n"
        "    except ModuleNotFoundError as e:\n"
        "        assert e.name == 'vllm', e\n"
        "    else:\n"
        "        raise AssertionError('kvplan_nixl.vllm imported without vllm')\n"
    )
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stdout + r.stderr


# -- hybrid engines: a page pool shared by a Mamba2 group and an attention group ------------

HEADS, HEAD_DIM, STATE, TAPS = 4, 4, 2, 3  # Mamba2: 4 heads of 4, state 2, conv kernel 4


def _mamba_channels(groups, tp, rank):
    """Global conv channels one rank holds, in its order x | B | C, by vLLM's rule
    (``mamba2_state_shape``: x and heads sharded; B and C by group, padded up to one group
    per rank when there are fewer groups than ranks)."""
    x = HEADS * HEAD_DIM
    xs = list(range(rank * x // tp, (rank + 1) * x // tp))
    per = max(1, groups // tp)
    g0 = rank * groups // tp if groups < tp else rank * per
    gs = [g for g in range(g0, g0 + per)]
    b = [x + g * STATE + s for g in gs for s in range(STATE)]
    c = [x + groups * STATE + g * STATE + s for g in gs for s in range(STATE)]
    return xs + b + c


def hybrid_engine(*, groups, tp, rank, conv_layout, num_blocks=8, seed=None):
    """(kv_caches, kv_cache_config, pool) of one rank of a tiny Mamba2 + attention model laid
    out as vLLM 0.32's hybrid manager does (what a real engine registered, see docs/vllm.md):
    one pool of ``num_blocks`` pages; layer 0 (group 0) and layer 2 (group 2) Mamba2 views
    ``[B, 1, 1, state bytes]`` of int8 (conv state then SSM state, SD or DS), layer 1 (group 1)
    an attention view ``[B, H, N, 2D]``. With ``seed`` every value is its global identity:
    ``layer * 1e6 + block * 1e4 + tap * 1e3 + channel`` (conv) or ``... + 500 + head * 100 +
    index`` (SSM), so a test can compute what each rank must hold."""
    chans = _mamba_channels(groups, tp, rank)
    heads = list(range(rank * HEADS // tp, (rank + 1) * HEADS // tp))
    conv = len(chans) * TAPS * 4
    ssm = len(heads) * HEAD_DIM * STATE * 4
    h, n, d = max(1, 2 // tp), 4, 16
    page = h * n * 2 * d * 4  # the attention block fills the page; the state is padded to it
    pool = np.zeros(num_blocks * page, np.uint8)
    kv, grp, specs = {}, [], []
    for layer in (0, 1, 2):
        name = f"model.layers.{layer}.mixer" + (".attn" if layer == 1 else "")
        if layer == 1:
            v = np.lib.stride_tricks.as_strided(pool.view(np.float32), (num_blocks, h, n, 2 * d),
                                                (page, n * 2 * d * 4, 2 * d * 4, 4))
            spec = FullAttentionSpec(block_size=n, num_kv_heads=h, head_size=d, head_size_v=d,
                                     dtype="float32")
        else:
            v = np.lib.stride_tricks.as_strided(pool, (num_blocks, 1, 1, conv + ssm),
                                                (page, conv + ssm, conv + ssm, 1))
            cshape = (TAPS, len(chans)) if conv_layout == "SD" else (len(chans), TAPS)
            spec = MambaSpec(block_size=4, shapes=(cshape, (len(heads), HEAD_DIM, STATE)),
                             dtypes=("torch.float32", "torch.float32"),
                             mamba_type="MambaAttentionBackendEnum.MAMBA2")
            if seed is not None:  # the slots the test reads: a page is one group's at a time
                for b in {0: (5,), 2: (7,)}[layer]:
                    base = layer * 1e6 + b * 1e4
                    ident = np.array([[base + t * 1e3 + ch for ch in chans]
                                      for t in range(TAPS)], np.float32)
                    cv = ident if conv_layout == "SD" else ident.T
                    sv = np.array([[[base + 500 + hh * 100 + i * STATE + s for s in range(STATE)]
                                    for i in range(HEAD_DIM)] for hh in heads], np.float32)
                    page_b = pool[b * page: b * page + conv + ssm]
                    page_b[:conv] = cv.ravel().view(np.uint8)
                    page_b[conv:] = sv.ravel().view(np.uint8)
        kv[name] = FakeTensor(v)
        grp.append(SimpleNamespace(layer_names=[name], kv_cache_spec=spec))
        specs.append(SimpleNamespace(size=pool.size, layers=[name], layer_stride=pool.size,
                                     block_stride=page, offset=0))
    cfg = SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=specs, kv_cache_groups=grp)
    return kv, cfg, pool


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
@pytest.mark.parametrize("groups,stp,dtp", [(1, 1, 2), (1, 2, 1), (2, 1, 2), (2, 2, 1),
                                             (1, 2, 2), (2, 2, 2), (4, 2, 1), (4, 1, 2)])
def test_mamba2_state_arrives_as_vllm_shards_it(conv_layout, groups, stp, dtp):
    src = [hybrid_engine(groups=groups, tp=stp, rank=r, conv_layout=conv_layout, seed=1)
           for r in range(stp)]
    dst = [hybrid_engine(groups=groups, tp=dtp, rank=r, conv_layout=conv_layout)
           for r in range(dtp)]
    kw = {"mamba_n_groups": groups, "conv_layout": conv_layout}
    sspec = spec_from_vllm(src[0][0], src[0][1], tp_size=stp, **kw)
    dspec = spec_from_vllm(dst[0][0], dst[0][1], tp_size=dtp, **kw)
    assert sspec.buffers == ("pool.0",) and [r.kind.value for r in sspec.regions] == \
        ["state", "attention", "state"]
    for d in range(dtp):
        tmap = pull_map(sspec, dspec, d)
        # slot 5 (group 0) -> 2, attention blocks [1, 3] -> [4, 6], slot 7 (group 2) -> 0
        plan = tmap.plan([[5], [1, 3], [7]], [[2], [4, 6], [0]])
        out = {(d, "pool.0"): dst[d][2]}
        simulate(plan, {(r, "pool.0"): src[r][2] for r in range(stp)}, out)
        pool_d = dst[d][2]
        chans = _mamba_channels(groups, dtp, d)
        heads = list(range(d * HEADS // dtp, (d + 1) * HEADS // dtp))
        for layer, (sb, db) in ((0, (5, 2)), (2, (7, 0))):
            page = pool_d[db * dspec.rank_page_nbytes(0):].view(np.float32)
            nconv = TAPS * len(chans)
            got = page[:nconv].reshape((TAPS, -1) if conv_layout == "SD" else (-1, TAPS))
            got = got if conv_layout == "SD" else got.T
            want = np.array([[layer * 1e6 + sb * 1e4 + t * 1e3 + c for c in chans]
                             for t in range(TAPS)], np.float32)
            np.testing.assert_array_equal(got, want, err_msg=f"layer {layer} conv, rank {d}")
            ssm = page[nconv:nconv + len(heads) * HEAD_DIM * STATE]
            want = np.array([layer * 1e6 + sb * 1e4 + 500 + h * 100 + i
                             for h in heads for i in range(HEAD_DIM * STATE)], np.float32)
            np.testing.assert_array_equal(ssm, want, err_msg=f"layer {layer} ssm, rank {d}")


def test_mamba2_groups_must_be_named_at_tp_above_1():
    kv, cfg, _ = hybrid_engine(groups=1, tp=2, rank=0, conv_layout="SD")
    with pytest.raises(SpecError, match="needs mamba_n_groups"):
        spec_from_vllm(kv, cfg, tp_size=2)
    with pytest.raises(SpecError, match="n_groups 4 at tp_size 2 means 2 B/C group"):
        spec_from_vllm(kv, cfg, tp_size=2, mamba_n_groups=4)
    with pytest.raises(SpecError, match="conv_layout 'XY'"):
        spec_from_vllm(kv, cfg, conv_layout="XY")


def test_transfer_groups_clip_and_absent_blocks():
    from kvplan import ABSENT
    from kvplan.adapters.vllm import TransferGroups

    class SlidingWindowSpec(SimpleNamespace):
        pass

    cfg = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=MambaSpec(block_size=32, num_speculative_blocks=1)),
        SimpleNamespace(kv_cache_spec=SlidingWindowSpec(block_size=32, sliding_window=32)),
        SimpleNamespace(kv_cache_spec=FullAttentionSpec(block_size=32)),
    ])
    g = TransferGroups.from_config(cfg)
    assert g.kinds == ("state", "window", "full") and g.has_state
    # the prefill's blocks after 100 tokens: a state slot + a scratch slot; the window's first
    # block null (0), and only ceil(32 / 32) + 1 = 2 blocks handed; full attention all four
    handed, first = g.handed(([0, 0, 11, 12], [0, 21, 22, 23], [31, 32, 33, 34]))
    assert handed == [[11], [22, 23], [31, 32, 33, 34]] and first == [2, 2, 0]
    src = g.remote(handed, first)
    assert [a.tolist() for a in src] == [[11], [ABSENT, ABSENT, 22, 23], [31, 32, 33, 34]]
    # a NixlConnector prefill hands no offsets: derived from its 100 computed tokens, the
    # same kvplan lists (a state slot's offset is not used)
    assert g.offsets(handed, 100) == [0, 2, 0]
    assert [a.tolist() for a in g.remote(handed, g.offsets(handed, 100))] == \
        [a.tolist() for a in src]
    assert g.offsets(handed, 40)[1] == 0  # a window list longer than the tokens: from 0
    with pytest.raises(Exception, match="same model"):
        g.offsets(handed[:2], 100)
    dst = g.local(([0, 41, 42], [0, 51, 52, 53], [61, 62, 63, 64]))
    assert [a.tolist() for a in dst] == [[41], [ABSENT, 51, 52, 53], [61, 62, 63, 64]]
    with pytest.raises(Exception, match="same model"):
        g.remote(handed[:2], first[:2])


@pytest.mark.parametrize("tp", [1, 2])
def test_gdn_and_mamba1_state_parts(tp):
    """GDN (q | k | v conv channels, temporal (v_heads, v_dim, k_dim)) and Mamba1 (x only,
    temporal (channels, state)) pages become parts sharded on their own units."""
    k, v, hv, dv, dk = 8 // tp, 16 // tp, 4 // tp, 4, 2
    cases = {
        "MambaAttentionBackendEnum.GDN_ATTN": (((3, 2 * k + v), (hv, dv, dk)),
                                               {"q_conv.0": 8, "k_conv.0": 8, "v_conv.0": 16,
                                                "ssm": 4}),
        "MambaAttentionBackendEnum.MAMBA1": (((3, 8 // tp), (8 // tp, 4)),
                                             {"x_conv.0": 8, "ssm": 8}),
    }
    for mtype, ((conv, temporal), units) in cases.items():
        nbytes = (int(np.prod(conv)) + int(np.prod(temporal))) * 4
        pool = np.zeros(4 * 1024, np.uint8)

        def view(page, pool=pool, nbytes=nbytes):
            return FakeTensor(np.lib.stride_tricks.as_strided(pool, (4, 1, 1, nbytes),
                                                              (page, nbytes, nbytes, 1)))
        spec = MambaSpec(block_size=16, shapes=(conv, temporal), mamba_type=mtype,
                         dtypes=("torch.float32", "torch.float32"))
        cfg = SimpleNamespace(num_blocks=4, kv_cache_groups=[
            SimpleNamespace(layer_names=["m"], kv_cache_spec=spec)], kv_cache_tensors=[
            SimpleNamespace(size=pool.size, layers=["m"], layer_stride=pool.size,
                            block_stride=256, offset=0)])
        with pytest.raises(SpecError, match="padded state page outside a shared pool"):
            spec_from_vllm({"m": view(nbytes + 64)}, cfg, tp_size=tp)  # slots hold less
        r = spec_from_vllm({"m": view(nbytes)}, cfg, tp_size=tp).regions[0]
        got = {p.name: p.units for p in r.parts}
        assert {n: got[n] for n in units} == units, (mtype, got)
        assert sum(p.unit_bytes * max(1, p.units // tp) for p in r.parts) == nbytes
