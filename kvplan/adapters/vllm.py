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

Not covered yet (refused with a :class:`~kvplan.SpecError` naming the layer): Mamba and
other state specs, layers of different groups sharing one ``KVCacheTensor`` (hybrid
overlays), padded pages, ``head_size_v`` different from ``head_size``, pipeline stages.

Layer 4 (adapters, beside hf): imports spec, regions, layout, errors and hooks; serves
``EngineSpec.from_vllm`` through :mod:`kvplan.hooks`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvplan.errors import SpecError
from kvplan.layout import rank_layout
from kvplan.regions import DTYPE_SIZES
from kvplan.spec import EngineSpec

#: Backends whose content ``C`` is K then V of one token (vLLM's definition).
TOKEN_CONTENT = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"})
#: Backends that read one head's ``[N, C]`` page as a K part then a V part, each in the
#: kernel's own order (see :func:`whole_pages`).
STREAM_CONTENT = frozenset({"CPU_ATTN"})


def whole_pages(backend: str | None) -> bool:
    """Whether ``backend`` keeps a (block, head, K or V) page in a kernel-specific order, so
    that only whole pages may be copied: whole blocks, equal block sizes on both sides
    (``CPU_ATTN``). Head slices (heterogeneous TP) stay exact: heads are outside the page."""
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
    if hasattr(s, "num_kv_heads") and hasattr(s, "head_size") and "Mamba" not in cls:
        return "attention"
    raise SpecError(f"layer {name!r}: a {cls} is not supported by kvplan's vLLM adapter yet "
                    "(attention and MLA layers are)")


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


def spec_from_vllm(
    kv_caches: Mapping[str, Any],
    kv_cache_config: Any,
    *,
    tp_size: int = 1,
    backend: str | None = None,
    total_num_kv_heads: int | None = None,
    dcp_size: int = 1,
    dcp_interleave: int = 1,
) -> EngineSpec:
    """The :class:`~kvplan.EngineSpec` of a vLLM engine, from one rank's ``kv_caches`` (the
    dict ``register_kv_caches`` receives) and its ``KVCacheConfig``.

    One region per layer, named as vLLM names the layer, in the group of its KV-cache group;
    the layers of one ``KVCacheTensor`` are the layer slots of one allocation (named
    ``kv_cache_tensors.<i>``), and the axis order comes from the tensors' strides. ``tp_size``
    and ``dcp_size`` / ``dcp_interleave`` are the engine's (vLLM's
    ``tensor_parallel_size``, ``decode_context_parallel_size``,
    ``cp_kv_cache_interleave_size``); ``backend`` is the attention backend's name (see the
    module docstring); ``total_num_kv_heads`` is the model's KV head count, needed only when
    it is smaller than ``tp_size`` (replicated heads), else read from the tensors.

    Raises :class:`~kvplan.SpecError` naming the layer for a tensor whose shape, dtype or
    strides do not match its ``KVCacheSpec``, a layer missing on either side, or a cache this
    adapter does not cover (see the module docstring).
    """
    layers = _layer_specs(kv_cache_config)
    missing = sorted(set(layers) - set(kv_caches))
    extra = sorted(set(kv_caches) - set(layers))
    if missing or extra:
        raise SpecError(f"kv_caches and the KVCacheConfig disagree: layers without a tensor "
                        f"{missing}, tensors without a group {extra}")
    num_blocks = kv_cache_config.num_blocks
    regions: list[dict[str, Any]] = []
    seen: set[str] = set()
    for ti, kt in enumerate(kv_cache_config.kv_cache_tensors):
        names = [n for n in kt.layers if n in layers]
        if not names:
            continue
        if len({layers[n][0] for n in names}) > 1:
            raise SpecError(f"KVCacheTensor {ti} holds layers of several KV-cache groups "
                            f"({names}): shared hybrid pools are not supported yet")
        alloc = f"kv_cache_tensors.{ti}" if len(kt.layers) > 1 else None
        for slot, name in enumerate(kt.layers):
            if name in seen:
                raise SpecError(f"layer {name!r} is in more than one KVCacheTensor")
            seen.add(name)
            regions.append(_region(name, kv_caches[name], layers[name], kt, slot, num_blocks,
                                   alloc, tp_size, backend, total_num_kv_heads, dcp_size))
    unplaced = sorted(set(layers) - seen)
    if unplaced:
        raise SpecError(f"layers {unplaced} are in no KVCacheTensor of the KVCacheConfig")
    return EngineSpec.from_dict({"tp_size": tp_size, "dcp_size": dcp_size,
                                 "dcp_interleave": dcp_interleave, "regions": regions})


def _region(name: str, t: Any, group_spec: tuple[int, Any], kt: Any, slot: int,
            num_blocks: int, alloc: str | None, tp_size: int, backend: str | None,
            total_heads: int | None, dcp_size: int) -> dict[str, Any]:
    group, s = group_spec
    kind = _kind(name, s)
    shape = tuple(int(x) for x in t.shape)
    if len(shape) != 4:
        raise SpecError(f"layer {name!r}: vLLM 0.32 KV caches are 4-D [B, H, N, C], got "
                        f"shape {shape}")
    dtype = _dtype_name(t)
    es = int(t.element_size())
    if dtype not in DTYPE_SIZES or DTYPE_SIZES[dtype] != es:
        raise SpecError(f"layer {name!r}: dtype {dtype} ({es} bytes) is not one of "
                        f"{', '.join(DTYPE_SIZES)}")
    b, h, n, c = shape
    if b % num_blocks:
        raise SpecError(f"layer {name!r}: {b} blocks in the tensor is not a multiple of the "
                        f"KVCacheConfig's num_blocks {num_blocks}")
    block_size = n * (b // num_blocks)
    if s.block_size not in (block_size, block_size * dcp_size):
        raise SpecError(f"layer {name!r}: the KVCacheSpec's block_size {s.block_size} is "
                        f"not the tensor's {block_size} tokens per block (x dcp {dcp_size})")
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
    st = tuple(int(x) * es for x in t.stride())
    if st[3] != es:
        raise SpecError(f"layer {name!r}: the content axis C is not contiguous (byte stride "
                        f"{st[3]}, element size {es})")
    nl = len(kt.layers)
    axes = [("L", nl, int(kt.layer_stride)), ("B", b, st[0]), ("H", h, st[1]),
            ("N", n, st[2]), ("C", c, es)]
    order = _order(name, axes, _content(backend, kind == "mla"))
    r: dict[str, Any] = {"name": name, "kind": kind, "group": group, "num_blocks": num_blocks,
                         "block_size": block_size, "dtype": dtype, "layout": order}
    if kind == "mla":
        r["dim"] = hs
    else:
        heads = total_heads if total_heads is not None else h * tp_size
        r.update(num_kv_heads=heads, head_dim=hs)
        if getattr(s, "sliding_window", None):
            r["window"] = int(s.sliding_window)
    if n != block_size:
        r["kernel_block_size"] = n
    if alloc is not None:
        r["allocation"] = alloc
    return r


def vllm_buffers(
    kv_caches: Mapping[str, Any], spec: EngineSpec, rank: int = 0
) -> dict[str, tuple[int, int]]:
    """``{buffer name: (address, nbytes)}`` of every buffer of ``spec`` (made by
    :func:`spec_from_vllm` from these ``kv_caches``) on flat rank ``rank``: what
    ``kvplan_nixl.Endpoint`` registers.

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
