"""An :class:`~kvplan.EngineSpec` from vLLM's own KV cache: the tensors and config it allocated.

vLLM (V1, release 0.32.0) hands a KV connector two things at start-up: the ``kv_caches`` dict
of ``register_kv_caches`` (one tensor per attention layer) and the ``KVCacheConfig`` the
engine core resolved (``vllm/v1/kv_cache_interface.py``). Both say exactly what this rank
holds, so a spec derived from them describes what is registered rather than what someone
believed the model to be.

What vLLM 0.32 allocates (``create_kv_cache_views``, ``compute_layout_strides`` in
``vllm/v1/kv_cache_interface.py``; ``KVCacheLayout`` in ``vllm/v1/kv_cache_layout.py``):

- every layer's tensor is a 4-D view ``[B, H, N, C]`` (blocks -- kernel blocks when the
  backend splits a block --, head slots, tokens of a block, content), cut from one raw buffer
  per ``KVCacheTensor`` that holds ``layers`` (in L order) at ``offset + l * layer_stride``;
- the group's ``KVCacheLayout`` (``LBHNC``, ``LBNHC``, ``LHBNC``, ``BLHNC``, ``BLNHC``,
  ``BHLNC``) permutes the strides of ``[L, B, H, N, C]``; the adapter reads the order back
  from the strides, so it needs no layout name;
- ``C`` is ``head_size + head_size_v`` values for attention (K then V) and ``head_size``
  values for MLA's latent (one stream, ``H`` = 1).

How a backend reads the content is the backend's business, and the bytes that move depend
on it when a block is copied only in part (a prompt ending mid-block, a prefix-cache hit)
or when heads are sliced (hetero TP). ``backend`` names it:

- ``FLASH_ATTN``, ``TRITON_ATTN`` (``flash_attn.py``, ``triton_attn.py``: ``split(head_size,
  dim=-1)``): ``C`` is K then V of one token, kvplan's ``C`` = ``SD``;
- ``CPU_ATTN`` (``cpu_attn.py``: views ``[B, H, N, 2D]`` as ``[B, H, 2N, D]``, K from the
  first ``N`` rows): one head's page holds its K part, then its V part, so ``NC`` reads
  ``SND``. Inside a part the kernel decides: with the ``vec`` ISA (float32, block 32) vLLM's
  own ``cpu_attn_reshape_and_cache`` writes K transposed (value ``d`` of token ``t`` at
  ``d * N + t``) and V by token. Such pages are exact only as a whole, so
  :func:`whole_pages` says so and a plan must move whole blocks (``tokens`` rounded out to
  block boundaries) between equal block sizes;
- MLA backends (``CPU_MLA``, ``FLASHMLA``, ``TRITON_MLA``...): one latent per token.
- ``None``: vLLM's definition of ``C`` (K then V of one token).

Hybrid models (vLLM's hybrid KV cache manager, ``vllm/v1/core/kv_cache_utils.py``) give
every layer of a KV-cache group its own blocks of memory that layers of the *other* groups
share: each ``KVCacheTensor`` is one page pool, its layers views of it (the tensors start at
the same address, one per group), a block id naming the same page in every view. Such layers
become regions of one kvplan ``pool`` with ``page_bytes`` = the tensor's block stride; a
group's block ids index pages of it. Mamba-family state layers (``MambaSpec``:
``vllm/v1/kv_cache_interface.py``; shapes from ``mamba_utils.py``) are views ``[B, 1, 1,
page bytes]`` of ``int8`` whose page holds the conv state then the temporal (SSM) state:

- the conv state of Mamba2 is the concatenation of the sub-projections x (``heads * head_dim``
  channels), B and C (``n_groups`` groups of ``state_size`` channels each), each sharded over
  TP on its own channels; with fewer groups than TP ranks every rank holds the group its heads
  need (``extra_groups_for_head_shards``), i.e. the groups are replicated. The conv state is
  stored ``DS`` (``(channels, kernel - 1)``: each sub-projection one contiguous part) or ``SD``
  (``(kernel - 1, channels)``: a row per conv tap, each row x | B | C), per
  ``VLLM_SSM_CONV_STATE_LAYOUT`` (``get_conv_state_layout``); both become exact state parts.
  Mamba1 has x only; GDN has q | k | v (``ssm_conv_transfer_utils.py`` decomposes them alike);
- the temporal state is sharded on heads (Mamba2: ``(heads, head_dim, state_size)``; GDN:
  ``(v_heads, v_dim, k_dim)``; Mamba1: ``(channels, state_size)``).
- KDA (Kimi-Linear) is a GDN layer to vLLM 0.32 (``KimiGatedDeltaNetAttention`` subclasses
  ``GatedDeltaNetAttention``, ``mamba_type`` ``GDN_ATTN``; shapes from ``kda_state_shape``):
  one conv state of q | k | v (``heads * head_dim`` channels each, each sharded on its own
  channels: the fused conv weight loader shards them one by one) and the recurrent state
  ``(heads, head_dim, head_dim)``, float32 by default (``kda_state_dtype``) where the conv
  state is the model's dtype; the parts are GDN's (``q_conv``, ``k_conv``, ``v_conv``,
  ``ssm`` = the recurrent state).

vLLM 0.32 aliases every KV-cache group of a hybrid model from byte 0 of one allocation, a
group's layers the layer slots of its ``KVCacheTensor`` (``get_kv_cache_config_from_groups``):
with several layers per group (Kimi-Linear: 3 KDA groups and 1 MLA group of ``n`` layers
each) layer slot ``s`` of every group views the same pages, one pool per slot (``pool.<t>.<s>``
after the first such tensor ``t``; ``pool.<t>`` when a tensor holds one layer).

Every layer is read with its own ``KVCacheSpec`` (head count and size, per rank) and, given a
mapping, its own backend and its model's total KV head count: the layers of one KV-cache
group (``UniformTypeKVCacheSpecs``) may differ, e.g. an MLA model's layers and a GQA
EAGLE-3 draft's attention layer (vLLM PR 44583's case).

Not covered yet (refused with a :class:`~kvplan.SpecError` naming the layer): layers of two
groups in one multi-layer ``KVCacheTensor`` slot scheme other than the page pools above,
padded attention pages, ``head_size_v`` different from ``head_size``, pipeline stages, other
state kinds than Mamba1, Mamba2 and GDN / KDA (``mamba_type``), states of more than a conv
and a temporal part (Kimi-K3's ``use_kda_recoverssm`` records).

Layer 5 (adapters, beside hf): imports spec, constants, layout, request (for ``ABSENT``) and
errors; the spec it builds never imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvplan.constants import DTYPE_SIZES
from kvplan.errors import RequestError, SpecError
from kvplan.layout import rank_layout
from kvplan.request import ABSENT
from kvplan.spec import EngineSpec

#: Backends whose content ``C`` is K then V of one token (vLLM's definition).
TOKEN_CONTENT = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"})
#: Backends that read one head's ``[N, C]`` page as a K part then a V part, each in the
#: kernel's own order (see :func:`whole_pages`).
STREAM_CONTENT = frozenset({"CPU_ATTN"})


def whole_pages(backend: str | Mapping[str, str | None] | None) -> bool:
    """Whether ``backend`` keeps a (block, head, K or V) page in a kernel-specific order, so
    that only whole pages may be copied: whole blocks, equal block sizes on both sides
    (``CPU_ATTN``). Head slices (heterogeneous TP) stay exact: heads are outside the page.
    For a mapping of layer backends: whether any layer's backend does (a request moves the
    blocks of every layer at once)."""
    if isinstance(backend, Mapping):
        return any(b in STREAM_CONTENT for b in backend.values())
    return backend in STREAM_CONTENT


def _content(backend: str | None, mla: bool) -> str:
    """How the content axis ``C`` reads in kvplan's letters: ``SD`` or, with ``N``, ``SND``."""
    if mla or backend is None or backend in TOKEN_CONTENT or backend.endswith("MLA"):
        return "SD"
    if backend in STREAM_CONTENT:
        return "SND"
    known = ", ".join(sorted(TOKEN_CONTENT | STREAM_CONTENT)) + ", *MLA"
    raise SpecError(
        f"attention backend {backend!r}: how it reads a page's content is not known to "
        f"kvplan's vLLM adapter (known: {known}); pass backend=None if it reads C as K then "
        f"V of one token"
    )


def _dtype_name(t: Any) -> str:
    return str(t.dtype).rsplit(".", 1)[-1]


def _layer_specs(kv_cache_config: Any) -> dict[str, tuple[int, Any]]:
    """Layer name -> (transfer group index, the layer's KVCacheSpec)."""
    out: dict[str, tuple[int, Any]] = {}
    groups = [g for g in kv_cache_config.kv_cache_groups
              if getattr(g, "enable_kv_transfer", True)]
    for gi, group in enumerate(groups):
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        for name in group.layer_names:
            out[name] = (gi, per_layer[name] if per_layer else spec)
    return out


def _kind(name: str, s: Any) -> str:
    cls = type(s).__name__
    if "MLA" in cls:
        return "mla"
    if "Mamba" in cls:
        return "state"
    if hasattr(s, "num_kv_heads") and hasattr(s, "head_size"):
        return "attention"
    raise SpecError(f"layer {name!r}: a {cls} is not supported by kvplan's vLLM adapter yet "
                    "(attention, MLA and Mamba-family state layers are)")


def _order(name: str, axes: list[tuple[str, int, int]], content: str) -> str:
    """kvplan's axis order from ``(letter, size, byte stride)`` of ``L, B, H, N, C`` (in that
    order): the axes longer than 1 by decreasing stride, which must be those of a dense
    tensor."""
    outer = [a for a in axes if a[0] != "C"]
    big = iter(sorted((a for a in outer if a[1] > 1), key=lambda a: -a[2]))
    # axes of size 1 keep their logical place (their stride means nothing); the others are
    # ordered by stride in the places they leave
    seq = [a if a[1] == 1 else next(big) for a in outer]
    c = axes[-1]
    seq.append(c)
    step = c[1] * c[2]  # C's bytes; C's stride is the element size (checked by the caller)
    for letter, size, stride in reversed(seq[:-1]):
        if size > 1 and stride != step:
            got = ", ".join(f"{x}={n}@{s}" for x, n, s in axes)
            raise SpecError(
                f"layer {name!r}: the KV cache is not a dense permutation of [L, B, H, N, C] "
                f"(axis {letter} has byte stride {stride}, a dense layout needs {step}; "
                f"size@stride: {got}): padded pages are not supported yet"
            )
        step *= size
    order = "".join(a[0] for a in seq)
    if content == "SND":
        if not order.endswith("NC"):
            raise SpecError(
                f"layer {name!r}: this backend reads a head's tokens and content as one page "
                f"[2, N, D], which needs N right outside C; the strides give order {order}"
            )
        return order[:-2] + "SND"
    return order[:-1] + "SD"


#: ``VLLM_SSM_CONV_STATE_LAYOUT`` values: conv state ``(kernel - 1, channels)`` or
#: ``(channels, kernel - 1)`` per slot (``mamba_utils.get_conv_state_layout``).
CONV_LAYOUTS = ("SD", "DS")


def spec_from_vllm(
    kv_caches: Mapping[str, Any],
    kv_cache_config: Any,
    *,
    tp_size: int = 1,
    backend: str | Mapping[str, str | None] | None = None,
    total_num_kv_heads: int | Mapping[str, int] | None = None,
    dcp_size: int = 1,
    dcp_interleave: int = 1,
    mamba_n_groups: int | None = None,
    conv_layout: str = "SD",
) -> EngineSpec:
    """The :class:`~kvplan.EngineSpec` of a vLLM engine, from one rank's ``kv_caches`` (the
    dict ``register_kv_caches`` receives) and its ``KVCacheConfig``.

    One region per layer, named as vLLM names the layer, in the group of its KV-cache group;
    the layers of one ``KVCacheTensor`` are the layer slots of one allocation (named
    ``kv_cache_tensors.<i>``), layers of several groups viewing the same memory are the
    regions of one pool (``pool.<i>``, pages of the tensors' block stride), and the axis order
    comes from the tensors' strides. ``tp_size`` and ``dcp_size`` / ``dcp_interleave`` are the
    engine's (vLLM's ``tensor_parallel_size``, ``decode_context_parallel_size``,
    ``cp_kv_cache_interleave_size``); ``backend`` is the attention backend's name (see the
    module docstring), or a mapping from layer name to the backend of that layer (vLLM gives
    each layer its own: an EAGLE-3 draft's attention layer beside an MLA model's layers);
    ``total_num_kv_heads`` is the model's KV head count, or a mapping from layer name to the
    count of the model that owns the layer (a draft's is its own, never the target's), needed
    only where it is smaller than ``tp_size`` (replicated heads), else read from the tensors.
    A given count is checked against the layer's tensor: a count that does not match it is
    refused naming the layer and both numbers. Every layer is described by its own
    ``KVCacheSpec`` (head count, head size) and its own backend, so the layers of one
    KV-cache group (``UniformTypeKVCacheSpecs``) may differ.

    Mamba2 state layers need ``mamba_n_groups`` (the model's ``n_groups``) when ``tp_size`` >
    1: a rank's tensors look the same whether its B/C group is its own share or a replica of
    the only group (``n_groups`` < ``tp_size``), and the two are read from different places.
    ``conv_layout`` is the engine's ``VLLM_SSM_CONV_STATE_LAYOUT`` (``"SD"``, vLLM's default,
    or ``"DS"``).

    Raises :class:`~kvplan.SpecError` naming the layer for a tensor whose shape, dtype or
    strides do not match its ``KVCacheSpec`` or its head count, a layer missing on either side
    (or from a ``backend`` / ``total_num_kv_heads`` mapping), or a cache this adapter does not
    cover (see the module docstring).
    """
    if conv_layout not in CONV_LAYOUTS:
        raise SpecError(f"conv_layout {conv_layout!r} is not one of {CONV_LAYOUTS} "
                        "(vLLM's VLLM_SSM_CONV_STATE_LAYOUT)")
    layers = _layer_specs(kv_cache_config)
    missing = sorted(set(layers) - set(kv_caches))
    extra = sorted(set(kv_caches) - set(layers))
    if missing or extra:
        raise SpecError(f"kv_caches and the KVCacheConfig disagree: layers without a tensor "
                        f"{missing}, tensors without a group {extra}")
    num_blocks = kv_cache_config.num_blocks
    pools = _pools(kv_caches, kv_cache_config, layers)
    ctx = _Context(tp_size, backend, total_num_kv_heads, dcp_size, mamba_n_groups, conv_layout)
    regions: list[dict[str, Any]] = []
    seen: set[str] = set()
    for ti, kt in enumerate(kv_cache_config.kv_cache_tensors):
        names = [n for n in kt.layers if n in layers]
        if not names:
            continue
        if len(names) > 1 and len({layers[n][0] for n in names}) > 1:
            raise SpecError(f"KVCacheTensor {ti} holds layers of several KV-cache groups "
                            f"({names}) as layer slots: kvplan's vLLM adapter takes a hybrid "
                            "pool as one tensor per group viewing the same pages")
        pooled = [n for n in kt.layers if n in pools]
        if pooled and len(pooled) < len(kt.layers):
            raise SpecError(f"KVCacheTensor {ti}: layers {pooled} share their pages with other "
                            f"KV-cache groups, layers {sorted(set(kt.layers) - set(pooled))} "
                            "do not: kvplan's vLLM adapter takes a tensor's layer slots all "
                            "pooled or none")
        # a multi-layer tensor whose slots other groups overlay (vLLM 0.32 aliases every
        # group from byte 0: Kimi-Linear's MLA and KDA groups) is one pool per layer slot
        alloc = f"kv_cache_tensors.{ti}" if len(kt.layers) > 1 and not pooled else None
        for name in kt.layers:
            if name in seen:
                raise SpecError(f"layer {name!r} is in more than one KVCacheTensor")
            seen.add(name)
            r = _region(name, kv_caches[name], layers[name], kt, num_blocks, alloc, ctx)
            if name in pools:
                r["pool"], r["page_bytes"] = pools[name]
            elif r["kind"] == "state":  # its slots step by its own page, which must be dense
                t = kv_caches[name]
                page, used = int(t.stride()[0]) * int(t.element_size()), int(t.shape[3])
                if page != used:
                    raise SpecError(f"layer {name!r}: state slots {page} bytes apart hold "
                                    f"{used} bytes: a padded state page outside a shared pool "
                                    "is not supported yet")
            regions.append(r)
    unplaced = sorted(set(layers) - seen)
    if unplaced:
        raise SpecError(f"layers {unplaced} are in no KVCacheTensor of the KVCacheConfig")
    return EngineSpec.from_dict({"tp_size": tp_size, "dcp_size": dcp_size,
                                 "dcp_interleave": dcp_interleave, "regions": regions})


@attrs.frozen
class _Context:
    """What every region of one engine is read with (spec_from_vllm's keywords)."""

    tp_size: int
    backend: str | Mapping[str, str | None] | None
    total_heads: int | Mapping[str, int] | None
    dcp_size: int
    mamba_n_groups: int | None
    conv_layout: str

    def backend_of(self, name: str) -> str | None:
        """The attention backend of layer ``name``: its own entry of a mapping, else the one
        name given for every layer."""
        if isinstance(self.backend, Mapping):
            if name not in self.backend:
                raise SpecError(f"layer {name!r} has no entry in the backend mapping (it names "
                                f"{len(self.backend)} layers): give every attention layer its "
                                "backend")
            return self.backend[name]
        return self.backend

    def heads_of(self, name: str, local: int) -> int:
        """Layer ``name``'s total KV head count, checked against the ``local`` heads its
        tensor holds on this rank (vLLM: ``max(1, total // tp)``, heads replicated when
        fewer than ranks)."""
        given = self.total_heads
        if isinstance(given, Mapping):
            given = given.get(name)
        if given is None:
            return local * self.tp_size
        total, tp = int(given), self.tp_size
        want = total // tp if total >= tp else 1
        if total < 1 or local != want or (total >= tp and total % tp) or (total < tp
                                                                           and tp % total):
            raise SpecError(f"layer {name!r}: total_num_kv_heads {total} at tp_size {tp} "
                            f"means {want} KV head(s) per rank, its tensor holds {local}: "
                            "pass the head count of the model that owns this layer (a "
                            "draft's own, not the target's)")
        return total


def _pools(kv_caches: Mapping[str, Any], kv_cache_config: Any,
           layers: dict[str, tuple[int, Any]]) -> dict[str, tuple[str, int]]:
    """Layer name -> (pool name, page bytes) for the layers whose tensors view the same memory:
    the hybrid manager's page pools, one layer of each group per pool."""
    by_addr: dict[int, list[str]] = {}
    for kt in kv_cache_config.kv_cache_tensors:
        for name in kt.layers:
            if name in layers:
                by_addr.setdefault(int(kv_caches[name].data_ptr()), []).append(name)
    tensor_of = {n: i for i, kt in enumerate(kv_cache_config.kv_cache_tensors) for n in kt.layers}
    out: dict[str, tuple[str, int]] = {}
    for names in by_addr.values():
        if len(names) < 2:
            continue
        groups = [layers[n][0] for n in names]
        if len(set(groups)) < len(groups):
            raise SpecError(f"layers {names} start at the same address and share KV-cache "
                            "groups: a page pool holds one layer of each group")
        pages = {n: int(kv_caches[n].stride()[0]) * int(kv_caches[n].element_size())
                 for n in names}
        if len(set(pages.values())) > 1:
            raise SpecError(f"layers {names} view the same memory with different block "
                            f"strides {pages}: a page pool has one page size")
        first = min(names, key=lambda n: tensor_of[n])
        kt = kv_cache_config.kv_cache_tensors[tensor_of[first]]
        slot = f".{kt.layers.index(first)}" if len(kt.layers) > 1 else ""
        pool = f"pool.{tensor_of[first]}{slot}"
        out.update((n, (pool, pages[n])) for n in names)
    return out


def _region(name: str, t: Any, group_spec: tuple[int, Any], kt: Any, num_blocks: int,
            alloc: str | None, ctx: _Context) -> dict[str, Any]:
    group, s = group_spec
    kind = _kind(name, s)
    shape = tuple(int(x) for x in t.shape)
    if len(shape) != 4:
        raise SpecError(f"layer {name!r}: vLLM 0.32 KV caches are 4-D [B, H, N, C], got "
                        f"shape {shape}")
    dtype = _dtype_name(t)
    es = int(t.element_size())
    b, h, n, c = shape
    if b % num_blocks:
        raise SpecError(f"layer {name!r}: {b} blocks in the tensor is not a multiple of the "
                        f"KVCacheConfig's num_blocks {num_blocks}")
    st = tuple(int(x) * es for x in t.stride())
    if st[3] != es:
        raise SpecError(f"layer {name!r}: the content axis C is not contiguous (byte stride "
                        f"{st[3]}, element size {es})")
    if kind == "state":
        return _state_region(name, s, group, shape, dtype, num_blocks, alloc, ctx)
    if dtype not in DTYPE_SIZES or DTYPE_SIZES[dtype] != es:
        raise SpecError(f"layer {name!r}: dtype {dtype} ({es} bytes) is not one of "
                        f"{', '.join(DTYPE_SIZES)}")
    block_size = n * (b // num_blocks)
    if s.block_size not in (block_size, block_size * ctx.dcp_size):
        raise SpecError(f"layer {name!r}: the KVCacheSpec's block_size {s.block_size} is "
                        f"not the tensor's {block_size} tokens per block (x dcp {ctx.dcp_size})")
    hs = int(s.head_size)
    if kind == "mla":
        want = (b, 1, n, hs)
    else:
        hv = int(getattr(s, "head_size_v", hs) or hs)
        if hv != hs:
            raise SpecError(f"layer {name!r}: head_size_v {hv} != head_size {hs} is not "
                            "supported yet")
        want = (b, int(getattr(s, "num_heads", s.num_kv_heads)), n, 2 * hs)
    if shape != want:
        raise SpecError(f"layer {name!r}: tensor shape {shape} does not match its "
                        f"{type(s).__name__} ([B, H, N, C] = {want})")
    nl = len(kt.layers) if alloc is not None else 1  # a pooled slot steps by its own pages
    axes = [("L", nl, int(kt.layer_stride)), ("B", b, st[0]), ("H", h, st[1]),
            ("N", n, st[2]), ("C", c, es)]
    order = _order(name, axes, _content(ctx.backend_of(name), kind == "mla"))
    r: dict[str, Any] = {"name": name, "kind": kind, "group": group, "num_blocks": num_blocks,
                         "block_size": block_size, "dtype": dtype, "layout": order}
    if kind == "mla":
        r["dim"] = hs
    else:
        heads = ctx.heads_of(name, h)
        r.update(num_kv_heads=heads, head_dim=hs)
        if getattr(s, "sliding_window", None):
            r["window"] = int(s.sliding_window)
    if n != block_size:
        r["kernel_block_size"] = n
    if alloc is not None:
        r["allocation"] = alloc
    return r


def _state_region(name: str, s: Any, group: int, shape: tuple[int, ...], dtype: str,
                  num_blocks: int, alloc: str | None,
                  ctx: _Context) -> dict[str, Any]:
    """A Mamba-family layer: one state slot per block, its page the conv state then the
    temporal state, as exact parts (see the module docstring)."""
    b, h, n, c = shape
    if (b, h, n) != (num_blocks, 1, 1) or dtype not in ("int8", "uint8"):
        raise SpecError(f"layer {name!r}: a {type(s).__name__} tensor is a byte view "
                        f"[num_blocks, 1, 1, page bytes] = [{num_blocks}, 1, 1, ...] of "
                        f"int8, got shape {shape} {dtype}")
    if alloc is not None:
        raise SpecError(f"layer {name!r}: a state layer sharing a KVCacheTensor with other "
                        "layers as a layer slot is not supported")
    parts, state_dtype = _state_parts(name, s, ctx)
    have = sum(p["units"] // min(p["units"], ctx.tp_size) * p["unit_bytes"] for p in parts)
    if have != c:
        raise SpecError(f"layer {name!r}: its state parts {[p['name'] for p in parts]} hold "
                        f"{have} bytes per slot on this rank, the tensor's page content is "
                        f"{c} bytes (MambaSpec shapes {tuple(map(tuple, s.shapes))})")
    return {"name": name, "kind": "state", "group": group, "num_blocks": num_blocks,
            "dtype": state_dtype, "parts": parts}


def _state_parts(name: str, s: Any, ctx: _Context) -> tuple[list[dict[str, Any]], str]:
    """The parts of one slot on this rank's page, global units each, and the conv dtype."""
    shapes = tuple(tuple(int(x) for x in sh) for sh in s.shapes)
    kind = str(getattr(s.mamba_type, "name", s.mamba_type)).upper()
    sizes = [_torch_dtype_size(name, d) for d in s.dtypes]
    if len(shapes) != 2 or len(sizes) != 2 or len(shapes[0]) != 2:
        raise SpecError(f"layer {name!r}: a {kind} state of shapes {shapes} is not a conv "
                        "state (2-D) and one temporal state: not supported yet")
    conv, temporal = shapes
    ec, et = sizes
    taps, dim = conv if ctx.conv_layout == "SD" else conv[::-1]
    tp = ctx.tp_size
    if "MAMBA2" in kind:
        heads, head_dim, state = _dims(name, temporal, 3, kind)
        x = heads * head_dim
        groups_local, rest = divmod(dim - x, 2 * state)
        if rest or groups_local < 1:
            raise SpecError(f"layer {name!r}: conv channels {dim} - x {x} is not two whole "
                            f"B/C blocks of state_size {state}")
        groups = _mamba_groups(name, groups_local, ctx)
        subs = [("x", x * tp, x), ("B", groups, groups_local * state),
                ("C", groups, groups_local * state)]
        ssm = ("ssm", heads * tp, head_dim * state * et)
    elif "GDN" in kind:
        v_heads, v_dim, k_dim = _dims(name, temporal, 3, kind)
        v = v_heads * v_dim
        k, rest = divmod(dim - v, 2)
        if rest or k < 1:
            raise SpecError(f"layer {name!r}: conv channels {dim} - v {v} is not two equal "
                            "q and k blocks")
        subs = [("q", k * tp, k), ("k", k * tp, k), ("v", v * tp, v)]
        ssm = ("ssm", v_heads * tp, v_dim * k_dim * et)
    elif "MAMBA1" in kind:
        channels, state = _dims(name, temporal, 2, kind)
        subs = [("x", dim * tp, dim)]
        ssm = ("ssm", channels * tp, state * et)
    else:
        raise SpecError(f"layer {name!r}: state kind {kind} is not supported by kvplan's vLLM "
                        "adapter yet (Mamba1, Mamba2, GDN are)")
    if getattr(s, "tp_replicated", False):  # every rank holds the whole state
        subs = [(p, 1, local) for p, _, local in subs]
        ssm = ("ssm", 1, int(np.prod(temporal)) * et)
    parts: list[dict[str, Any]] = []

    def part(pname: str, units: int, local_values: int, value_bytes: int) -> None:
        local_units = max(1, units // tp)
        if local_values % local_units:
            raise SpecError(f"layer {name!r}: part {pname} holds {local_values} values on this "
                            f"rank, not a multiple of its {local_units} unit(s)")
        parts.append({"name": pname, "units": units,
                      "unit_bytes": local_values // local_units * value_bytes})

    if ctx.conv_layout == "DS":  # (channels, taps): each sub-projection one run of channels
        for pname, units, local in subs:
            part(f"{pname}_conv", units, local, taps * ec)
    else:  # (taps, channels): every tap a row x | B | C
        for j in range(taps):
            for pname, units, local in subs:
                part(f"{pname}_conv.{j}", units, local, ec)
    pname, units, unit_bytes = ssm
    parts.append({"name": pname, "units": units, "unit_bytes": unit_bytes})
    return parts, _dtype_label(s.dtypes[0])


def _dims(name: str, shape: tuple[int, ...], n: int, kind: str) -> tuple[int, ...]:
    if len(shape) != n:
        raise SpecError(f"layer {name!r}: a {kind} temporal state has {n} axes, got {shape}")
    return shape


def _mamba_groups(name: str, local: int, ctx: _Context) -> int:
    """The global B/C group count: ``mamba_n_groups``, checked against this rank's share."""
    tp, g = ctx.tp_size, ctx.mamba_n_groups
    if g is None:
        if tp == 1:
            return local
        raise SpecError(f"layer {name!r}: Mamba2 at tp_size {tp} needs mamba_n_groups (the "
                        "model's n_groups): a rank's B/C group may be its share or a replica "
                        "of fewer groups than ranks, and its tensors look the same")
    want = max(1, g // tp) if g % tp == 0 else 1  # vLLM pads groups up to the TP size
    if g % tp and tp % g:
        raise SpecError(f"layer {name!r}: n_groups {g} and tp_size {tp}: neither divides the "
                        "other")
    if local != want:
        raise SpecError(f"layer {name!r}: n_groups {g} at tp_size {tp} means {want} B/C "
                        f"group(s) per rank, the tensor holds {local}")
    return g


def _torch_dtype_size(name: str, d: Any) -> int:
    label = _dtype_label(d)
    if label not in DTYPE_SIZES:
        raise SpecError(f"layer {name!r}: state dtype {label} is not one of "
                        f"{', '.join(DTYPE_SIZES)}")
    return DTYPE_SIZES[label]


def _dtype_label(d: Any) -> str:
    return str(d).rsplit(".", 1)[-1]


def vllm_buffers(
    kv_caches: Mapping[str, Any], spec: EngineSpec, rank: int = 0
) -> dict[str, tuple[int, int]]:
    """``{buffer name: (address, nbytes)}`` of every buffer of ``spec`` (made by
    :func:`spec_from_vllm` from these ``kv_caches``) on flat rank ``rank``: what
    an executor registers with its transport.

    A buffer starts at its first layer slot's tensor. Every other layer's tensor must start
    where the spec's layout puts its slot; a :class:`~kvplan.SpecError` names the layer and
    both addresses otherwise (the spec would describe other bytes than the tensor holds).
    """
    out: dict[str, tuple[int, int]] = {}
    for b, bname in enumerate(spec.buffers):
        regs = spec.buffer_regions(b)
        first = spec.regions[regs[0]].name
        slot0 = rank_layout(spec, regs[0], rank).components[0].base
        base = int(kv_caches[first].data_ptr()) - slot0
        for i in regs:
            r = spec.regions[i]
            want = base + rank_layout(spec, i, rank).components[0].base
            got = int(kv_caches[r.name].data_ptr())
            if got != want:
                raise SpecError(f"layer {r.name!r}: its tensor starts at {got:#x}, but as slot "
                                f"{spec.slot_of(i)[0]} of buffer {bname!r} it should start at "
                                f"{want:#x}")
        out[bname] = (base, spec.rank_buffer_nbytes(b))
    return out


#: vLLM's null block: the first block of its pool (``BlockPool.null_block`` in
#: ``vllm/v1/core/block_pool.py``), a placeholder no request owns -- the blocks a sliding
#: window dropped, the slots before a state group's running state.
NULL_BLOCK = 0


@attrs.frozen
class TransferGroups:
    """How the KV-cache groups of one vLLM engine take part in a transfer, read from its
    ``KVCacheConfig`` (:meth:`from_config`), and its block lists turned into kvplan's.

    ``index`` is each transfer group's index among vLLM's groups (those with
    ``enable_kv_transfer``, in order: kvplan's group numbers), ``kinds`` ``"full"``,
    ``"window"`` or ``"state"``, ``block_sizes`` tokens per block, ``windows`` the sliding
    window in tokens (``None`` for others), ``scratch`` the trailing speculative scratch slots
    of a state group (``num_speculative_blocks``).

    What moves, per kind, as vLLM 0.32's NixlConnector agrees with
    (``get_exchange_clipped_blocks`` in ``kv_connector/v1/nixl/base_scheduler.py``):

    - full attention: every block of the request, from position 0;
    - sliding window: the last ``ceil(window / block_size) + 1`` blocks (vLLM nulls the
      blocks before them once they leave the window; kvplan moves only the window's positions,
      and never a null block, which becomes :data:`kvplan.ABSENT`);
    - state (Mamba, GDN): the one slot holding the running state, the last block before the
      scratch slots.
    """

    index: tuple[int, ...]
    kinds: tuple[str, ...]
    block_sizes: tuple[int, ...]
    windows: tuple[int | None, ...]
    scratch: tuple[int, ...]

    @classmethod
    def from_config(cls, kv_cache_config: Any) -> TransferGroups:
        """The transfer groups of a ``KVCacheConfig`` (``kv_cache_groups``)."""
        index, kinds, sizes, windows, scratch = [], [], [], [], []
        for i, g in enumerate(kv_cache_config.kv_cache_groups):
            if not getattr(g, "enable_kv_transfer", True):
                continue
            s = g.kv_cache_spec
            state = "Mamba" in type(s).__name__
            window = None if state else getattr(s, "sliding_window", None)
            index.append(i)
            kinds.append("state" if state else "window" if window else "full")
            sizes.append(int(s.block_size))
            windows.append(int(window) if window else None)
            scratch.append(int(getattr(s, "num_speculative_blocks", 0) or 0) if state else 0)
        return cls(tuple(index), tuple(kinds), tuple(sizes), tuple(windows), tuple(scratch))

    @property
    def has_state(self) -> bool:
        """True when a group holds recurrent state: its slot after ``n`` tokens cannot be
        advanced by recomputing token ``n - 1``, so the prefill stops one token short and the
        decode computes the last prompt token itself (vLLM's ``_prefill_backoff``)."""
        return "state" in self.kinds

    def _transfer(self, block_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        if len(block_ids) == len(self.index):  # already the transfer groups only
            lists = list(block_ids)
        else:
            lists = [block_ids[i] for i in self.index]
        return [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in lists]

    def _slot(self, g: int, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """A state group's running-state slot (the last before the scratch slots) and its
        position in ``ids``."""
        live = len(ids) - min(self.scratch[g], max(0, len(ids) - 1))
        return ids[live - 1: live], max(0, live - 1)

    def handed(self, block_ids: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
        """Prefill side: the lists to hand the decode (``remote_block_ids``, one per transfer
        group, clipped as the class docstring says) and the block position of each list's
        first element (0 for full attention)."""
        out, first = [], []
        for g, ids in enumerate(self._transfer(block_ids)):
            if self.kinds[g] == "state":
                keep, start = self._slot(g, ids)
            elif self.kinds[g] == "window":
                w, bs = self.windows[g], self.block_sizes[g]
                n = -(-w // bs) + 1
                keep = ids[-n:]
                start = len(ids) - len(keep)
            else:
                keep, start = ids, 0
            out.append(keep.tolist())
            first.append(int(start))
        return out, first

    def offsets(self, lists: Sequence[Sequence[int]], tokens: int) -> list[int]:
        """Decode side, for a prefill that hands no offsets (vLLM's own NixlConnector): the
        block position of each handed list's first element, as :meth:`handed` would have
        said it for a request of ``tokens`` computed tokens (``remote_num_tokens``): 0 for
        full attention and state, and a window's clipped list ends at the last block those
        tokens fill."""
        if len(lists) != len(self.index):
            raise RequestError(f"the prefill handed {len(lists)} block lists for this "
                               f"engine's {len(self.index)} KV-cache groups: prefill and "
                               "decode must run the same model")
        return [max(0, -(-tokens // self.block_sizes[g]) - len(ids))
                if self.kinds[g] == "window" else 0 for g, ids in enumerate(lists)]

    def remote(self, lists: Sequence[Sequence[int]], first: Sequence[int]) -> list[np.ndarray]:
        """Decode side: the prefill's handed lists as kvplan source lists: each list from
        position 0 (positions before ``first`` and null blocks :data:`kvplan.ABSENT`); a
        state group's slot as it is."""
        if len(lists) != len(self.index) or len(first) != len(self.index):
            raise RequestError(f"the prefill handed {len(lists)} block lists ({len(first)} "
                               f"offsets) for this engine's {len(self.index)} KV-cache groups: "
                               "prefill and decode must run the same model")
        out = []
        for g, ids in enumerate(lists):
            a = np.asarray(ids, dtype=np.int64).reshape(-1)
            if self.kinds[g] != "state":
                a = np.concatenate([np.full(int(first[g]), ABSENT, np.int64), a])
                a[a == NULL_BLOCK] = ABSENT
            out.append(a)
        return out

    def local(self, block_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Decode side: the request's own blocks (every group's list from position 0, as
        ``KVCacheBlocks.get_block_ids()`` gives them) as kvplan destination lists: null blocks
        :data:`kvplan.ABSENT`, a state group its running-state slot."""
        out = []
        for g, ids in enumerate(self._transfer(block_ids)):
            if self.kinds[g] == "state":
                out.append(self._slot(g, ids)[0])
            else:
                a = ids.copy()
                a[a == NULL_BLOCK] = ABSENT
                out.append(a)
        return out
