"""An :class:`~kvplan.EngineSpec` from SGLang's own KV cache: its token pools and their sizes.

SGLang (release 0.5.23) keeps one rank's KV cache in a token pool
(``sglang/srt/mem_cache/memory_pool.py``) and tells its disaggregation connections about it as
``kv_data_ptrs``, ``kv_data_lens`` and ``kv_item_lens`` (``get_contiguous_buf_infos``: one
entry per buffer, ``item_len`` = the bytes of one page). What the pools allocate:

- ``MHATokenToKVPool`` (GQA and MHA): per layer a ``k_buffer`` and a ``v_buffer`` of
  ``[size + page_size, head_num, head_dim]`` (the NHD layout; token ``t`` of page ``p`` is
  row ``p * page_size + t``; page 0 is the padded page no request owns). ``head_num`` is this
  rank's share of the model's KV heads over the *attention* TP size: ``max(1, K //
  attn_tp_size)``, rank ``r`` holding head ``r * K // attn_tp_size`` when ``K <
  attn_tp_size`` (replicated heads). kvplan writes each layer as one region with separate K
  and V buffers, ``"layout": "LBNHD"``, ``"allocation": [<layer>.k, <layer>.v]``. When V's
  head size differs from K's (``v_head_dim``, MiMo-V2 style: K 192, V 128) a layer is two
  regions of one stream each, ``<layer>.k`` (``"stream": "k"``, K's head size) and
  ``<layer>.v`` (``"stream": "v"``, V's), each its own buffer of the same names.
- ``MLATokenToKVPool`` (DeepSeek, Kimi): per layer one ``kv_buffer`` of ``[size + page_size,
  1, kv_lora_rank + qk_rope_head_dim]``, the same on every rank: one ``mla`` region per
  layer.

- ``MambaPool`` (Mamba2 layers of hybrid models such as Nemotron-H): per layer a conv state
  ``[size + 1, conv_dim / tp, conv_kernel - 1]`` and a temporal state ``[size + 1, heads /
  tp, head_dim, state_size]``, one slot per request. A rank's conv channels are its share of
  x (``heads * head_dim`` channels), then of B and of C (``n_groups`` groups of
  ``state_size`` channels each; with fewer groups than ranks every rank holds the group its
  heads need: replicated). :class:`SGLangMamba2` describes it (:meth:`SGLangMamba2.from_pool`
  reads it from the pool object); :func:`spec_from_sglang_mamba2`
  makes a ``state`` region per layer and tensor (``layers.<n>.conv`` with parts ``x``, ``B``,
  ``C``; ``layers.<n>.ssm`` with part ``ssm``).

Under pipeline parallelism each stage's pool holds its own layers (``start_layer`` on);
:func:`spec_from_sglang` takes one :class:`SGLangKV` per stage and places each layer in its
stage.

What an engine knows is read into a :class:`SGLangKV` value, either from a pool object
(:meth:`SGLangKV.from_pool`, read only through attributes, ``.shape``, ``.dtype`` and
``.data_ptr()``, so neither torch nor SGLang is imported) or from plain numbers
(:meth:`SGLangKV.mha`, :meth:`SGLangKV.mla`, what ``KVArgs`` carries: ``kv_item_lens``,
``page_size``, head counts). :func:`spec_from_sglang` turns it into a spec; the planner then
plans the transfers SGLang's Mooncake and NIXL connections make between two such engines
(``send_kvcache`` at equal TP and for MLA, ``send_kvcache_slice`` at different attention TP
sizes), byte for byte, including the cases those connections get wrong or refuse
(docs/sglang.md).

Refused with a :class:`~kvplan.SpecError` naming the pool (not described yet): layouts other
than NHD (``SGLANG_USE_HND_KVCACHE``, ``vectorized_5d``), the FP4 / MXFP8 pools and their scale
buffers, ``PageMajorMHATokenToKVPool``, DSA pools (also as a hybrid pool's full-attention
pool), a ``SWAKVPool`` given to :meth:`SGLangKV.from_pool` (:meth:`SGLangKV.from_swa_pool`
reads it) and a ``MambaPool`` given to it (:meth:`SGLangMamba2.from_pool` reads that; Mamba1
states are not described), draft buffers appended to a pool, a head count neither dividing
nor divided by the attention TP size.

Hybrid pools: a ``HybridLinearKVPool`` (Mamba2 / GDN / KDA hybrids) is read by
:meth:`SGLangKV.from_pool` as its full-attention sub-pool at the layers' global ids, and by
:meth:`SGLangMamba2.from_pool` as its ``mamba_pool``; :func:`spec_from_sglang_hybrid` joins
them (group 0 pages, group 1 the state slot). A ``SWAKVPool``'s two sub-pools are read by
:meth:`SGLangKV.from_swa_pool` and joined by :func:`spec_from_sglang_swa` (group 0 the full
pages, group 1 the SWA pages, a separate index space).

DP attention (``--enable-dp-attention``: ``dp_size`` attention groups of ``tp_size //
dp_size`` ranks, each with its own pools and requests) is one spec per attention-TP group:
:func:`spec_from_sglang` at the group's ``attn_tp_size``, and
:func:`sglang_attention_rank` maps an SGLang ``tp_rank`` to its group and to its flat rank in
that spec, as SGLang's ``compute_dp_attention_world_info`` does. A request lives in one
group on each side, so a plan is made between the two groups that hold it.

Layer 5 (adapters, beside hf): imports spec, constants and errors.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvplan.constants import DTYPE_SIZES
from kvplan.errors import SpecError
from kvplan.spec import EngineSpec

#: Pool classes this adapter describes, by ``type(pool).__name__``.
POOLS = ("MHATokenToKVPool", "MLATokenToKVPool", "HybridLinearKVPool")
#: SGLang pool classes known and refused, with the reason given.
REFUSED_POOLS: Mapping[str, str] = {
    "MHATokenToKVPoolFP4": "FP4 pages with separate scale buffers",
    "MHATokenToKVPoolMXFP8": "MXFP8 pages with separate scale buffers",
    "PageMajorMHATokenToKVPool": "page-major buffers",
    "NoOpMHATokenToKVPool": "a pool without KV buffers",
    "MambaPool": "a recurrent-state pool (Mamba2, GDN, KDA: read it with "
                 "SGLangMamba2.from_pool and spec_from_sglang_mamba2)",
    "SWAKVPool": "a sliding-window pool beside a full-attention pool (two sub-pools, two "
                 "page index spaces: read it with SGLangKV.from_swa_pool and "
                 "spec_from_sglang_swa)",
    "DSATokenToKVPool": "a DSA pool (MLA latents beside an index-key cache)",
}


@attrs.frozen
class SGLangKV:
    """What one SGLang rank knows about its KV cache, as plain values.

    ``kind`` is ``"mha"`` (``MHATokenToKVPool``) or ``"mla"`` (``MLATokenToKVPool``);
    ``layers`` the global layer ids of this rank's pool (``start_layer`` on); ``pages`` the
    pages of each buffer (``(size + page_size) // page_size``, page 0 the padded one);
    ``page_size`` tokens per page; ``dtype`` the stored element type (SGLang stores fp8 as
    ``uint8``); ``head_num`` this rank's KV heads and ``head_dim`` / ``v_head_dim`` their sizes
    (MLA: ``head_num`` 1, ``head_dim`` = ``kv_lora_rank + qk_rope_head_dim``).
    """

    kind: str
    layers: tuple[int, ...]
    pages: int
    page_size: int
    dtype: str
    head_num: int
    head_dim: int
    v_head_dim: int

    @property
    def item_len(self) -> int:
        """Bytes of one page of one K (or MLA) buffer: SGLang's ``kv_item_len``."""
        return self.page_size * self.head_num * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def v_item_len(self) -> int:
        """Bytes of one page of one V buffer (SGLang's ``kv_item_lens`` of its V entries)."""
        return self.page_size * self.head_num * self.v_head_dim * DTYPE_SIZES[self.dtype]

    @classmethod
    def mha(cls, *, layer_num: int, size: int, page_size: int, dtype: str, head_num: int,
            head_dim: int, v_head_dim: int | None = None, start_layer: int = 0) -> SGLangKV:
        """An ``MHATokenToKVPool``'s values (its constructor's arguments, ``head_num`` this
        rank's heads)."""
        return cls._checked("mha", start_layer, layer_num, size, page_size, dtype, head_num,
                            head_dim, head_dim if v_head_dim is None else v_head_dim)

    @classmethod
    def mla(cls, *, layer_num: int, size: int, page_size: int, dtype: str, kv_lora_rank: int,
            qk_rope_head_dim: int, start_layer: int = 0) -> SGLangKV:
        """An ``MLATokenToKVPool``'s values (its constructor's arguments)."""
        dim = kv_lora_rank + qk_rope_head_dim
        return cls._checked("mla", start_layer, layer_num, size, page_size, dtype, 1, dim, dim)

    @classmethod
    def _checked(cls, kind: str, start: int, layer_num: int, size: int, page_size: int,
                 dtype: str, head_num: int, head_dim: int, v_head_dim: int) -> SGLangKV:
        pool = "MHATokenToKVPool" if kind == "mha" else "MLATokenToKVPool"
        if dtype not in DTYPE_SIZES:
            raise SpecError(f"{pool}: dtype {dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
        for field, value in (("layer_num", layer_num), ("page_size", page_size),
                             ("head_num", head_num), ("head_dim", head_dim),
                             ("v_head_dim", v_head_dim)):
            if value < 1:
                raise SpecError(f"{pool}: {field} must be at least 1, got {value}")
        if size < 0 or (size + page_size) % page_size:
            raise SpecError(f"{pool}: size {size} + page_size {page_size} is not whole pages")
        return cls(kind, tuple(range(start, start + layer_num)), (size + page_size) // page_size,
                   page_size, dtype, head_num, head_dim, v_head_dim)

    @classmethod
    def from_pool(cls, pool: Any) -> SGLangKV:
        """The values of an SGLang token pool object, checked against its buffers' shapes.

        ``layers`` are the pool's global model layer ids (``model_layer_ids``, which SGLang
        sets on a sub-pool of a hybrid pool; else ``start_layer`` on). A
        ``HybridLinearKVPool`` (the attention pool of a Mamba2 / GDN / KDA hybrid) is read
        through its ``full_kv_pool`` (an ``MHATokenToKVPool`` or ``MLATokenToKVPool`` dense
        over the full-attention layers only) at the global ids of
        ``full_attention_layer_id_mapping``, which SGLang publishes to its peers as
        ``kv_layer_ids``; its state is :meth:`SGLangMamba2.from_pool`'s. A ``SWAKVPool`` has
        two sub-pools with page ids of their own: :meth:`from_swa_pool` reads it."""
        name = type(pool).__name__
        if name == "HybridLinearKVPool":
            return cls._from_hybrid_linear(pool)
        if name in REFUSED_POOLS:
            raise SpecError(f"{name}: {REFUSED_POOLS[name]} is not described by kvplan's "
                            "SGLang adapter yet")
        if name not in POOLS:
            raise SpecError(f"{name}: not an SGLang pool kvplan's adapter knows "
                            f"({', '.join(POOLS)})")
        layout = getattr(pool, "kv_cache_layout", None) or "nhd"
        if getattr(pool, "use_hnd", False) or str(layout).lower() != "nhd":
            raise SpecError(f"{name}: KV cache layout {layout!r} (HND or vectorized_5d) is not "
                            "described yet; SGLang's disaggregation assumes NHD too")
        start = int(getattr(pool, "start_layer", 0) or 0)
        common = {"layer_num": int(pool.layer_num), "size": int(pool.size),
                  "page_size": int(pool.page_size), "start_layer": start}
        if name == "MLATokenToKVPool":
            bufs = list(pool.kv_buffer)
            kv = cls.mla(dtype=_dtype(name, bufs), kv_lora_rank=int(pool.kv_lora_rank),
                         qk_rope_head_dim=int(pool.qk_rope_head_dim), **common)
            kv = kv._at(name, getattr(pool, "model_layer_ids", None))
            _check_shapes(name, "kv_buffer", bufs, kv, (1, kv.head_dim))
            return kv
        k, v = list(pool.k_buffer), list(pool.v_buffer)
        kv = cls.mha(dtype=_dtype(name, k + v), head_num=int(pool.head_num),
                     head_dim=int(pool.head_dim), v_head_dim=int(pool.v_head_dim), **common)
        kv = kv._at(name, getattr(pool, "model_layer_ids", None))
        _check_shapes(name, "k_buffer", k, kv, (kv.head_num, kv.head_dim))
        _check_shapes(name, "v_buffer", v, kv, (kv.head_num, kv.v_head_dim))
        return kv

    def _at(self, pool: str, ids: Sequence[int] | None) -> SGLangKV:
        """These values at the global layer ids ``ids`` (a pool's ``model_layer_ids``; None
        keeps ``start_layer`` on), which must be one increasing id per layer."""
        if ids is None:
            return self
        ids = tuple(int(i) for i in ids)
        if len(ids) != len(self.layers) or any(a >= b for a, b in itertools.pairwise(ids)) \
                or (ids and ids[0] < 0):
            raise SpecError(f"{pool}: model_layer_ids {list(ids)} are not {len(self.layers)} "
                            "increasing layer ids, one per layer of the pool")
        return attrs.evolve(self, layers=ids)

    @classmethod
    def _from_hybrid_linear(cls, pool: Any) -> SGLangKV:
        """A ``HybridLinearKVPool``'s full-attention sub-pool at its global layer ids."""
        full = pool.full_kv_pool
        sub = type(full).__name__
        if sub not in ("MHATokenToKVPool", "MLATokenToKVPool"):
            raise SpecError(f"HybridLinearKVPool: its full-attention pool is a {sub}, which "
                            "kvplan's SGLang adapter does not describe "
                            f"({REFUSED_POOLS.get(sub, 'not an MHA or MLA pool')})")
        ids = [int(i) for i in pool.full_attention_layer_id_mapping]
        if [int(i) for i in pool.full_attention_layer_id_mapping.values()] \
                != list(range(len(ids))):
            raise SpecError("HybridLinearKVPool: full_attention_layer_id_mapping "
                            f"{dict(pool.full_attention_layer_id_mapping)} does not number its "
                            "layers 0, 1, ... in order")
        if int(pool.page_size) != int(full.page_size) or len(ids) != int(full.layer_num):
            raise SpecError(f"HybridLinearKVPool: page_size {pool.page_size} and "
                            f"{len(ids)} full-attention layers, its {sub} page_size "
                            f"{full.page_size} and layer_num {full.layer_num}")
        own = getattr(full, "model_layer_ids", None)
        if own is not None and [int(i) for i in own] != ids:
            raise SpecError(f"HybridLinearKVPool: its {sub}'s model_layer_ids {list(own)} are "
                            f"not the full-attention layers {ids}")
        return cls.from_pool(full)._at("HybridLinearKVPool", ids)

    @classmethod
    def from_swa_pool(cls, pool: Any) -> tuple[SGLangKV, SGLangKV]:
        """The full-attention and the sliding-window sub-pools of an SGLang ``SWAKVPool``
        (``full_kv_pool``, ``swa_kv_pool``: two ``MHATokenToKVPool``s or two
        ``MLATokenToKVPool``s, each dense over its own layers, at the global ids SGLang
        gives them as ``model_layer_ids``), as ``(full, swa)``. Their pages are two index
        spaces: a request's full pages index the first, and the pages SGLang hands over for
        its SWA layers (the window's, ``translate_swa_indices_for_transfer``, sent as the
        SWA state's indices) the second; :func:`spec_from_sglang_swa` makes them two groups.
        Raises :class:`~kvplan.SpecError` for another class, sub-pools kvplan does not
        describe, page sizes that differ or layers the two sub-pools share."""
        name = type(pool).__name__
        if name != "SWAKVPool":
            raise SpecError(f"{name}: not SGLang's SWAKVPool")
        full, swa = cls.from_pool(pool.full_kv_pool), cls.from_pool(pool.swa_kv_pool)
        if not (int(pool.page_size) == full.page_size == swa.page_size):
            raise SpecError(f"SWAKVPool: page_size {pool.page_size}, its full pool's "
                            f"{full.page_size}, its SWA pool's {swa.page_size}")
        if set(full.layers) & set(swa.layers):
            raise SpecError(f"SWAKVPool: layers {sorted(set(full.layers) & set(swa.layers))} "
                            "are in both its full and its SWA pool")
        if len(full.layers) + len(swa.layers) != int(pool.layer_num):
            raise SpecError(f"SWAKVPool: layer_num {pool.layer_num}, its sub-pools hold "
                            f"{len(full.layers)} + {len(swa.layers)} layers")
        return full, swa


def _dtype(pool: str, tensors: Sequence[Any]) -> str:
    names = {str(t.dtype).rsplit(".", 1)[-1] for t in tensors}
    if len(names) != 1:
        raise SpecError(f"{pool}: its buffers have dtypes {sorted(names)}, not one")
    return names.pop()


def _check_shapes(pool: str, field: str, tensors: Sequence[Any], kv: SGLangKV,
                  tail: tuple[int, int]) -> None:
    want = (kv.pages * kv.page_size, *tail)
    if len(tensors) != len(kv.layers):
        raise SpecError(f"{pool}: {len(tensors)} {field} tensors for layer_num "
                        f"{len(kv.layers)} (draft buffers appended to a pool are not "
                        "described yet)")
    for layer, t in zip(kv.layers, tensors):
        if tuple(int(x) for x in t.shape) != want:
            raise SpecError(f"{pool}: {field} of layer {layer} has shape {tuple(t.shape)}, "
                            f"the pool's sizes say {want}")


@attrs.frozen
class SGLangAttentionRank:
    """Where an SGLang ``tp_rank`` sits under DP attention: its attention-DP group
    (``attn_dp_rank``: which spec), its rank in that group (``attn_tp_rank``: the flat rank of
    that spec, PP aside) and the group's size (``attn_tp_size``: the spec's ``tp_size``)."""

    attn_dp_rank: int
    attn_tp_rank: int
    attn_tp_size: int


def sglang_attention_rank(tp_rank: int, *, tp_size: int, dp_size: int = 1
                          ) -> SGLangAttentionRank:
    """SGLang's attention topology for ``tp_rank`` of ``tp_size`` with ``dp_size``
    attention-DP groups (1 without DP attention): ``attn_tp_size = tp_size // dp_size``,
    ``attn_tp_rank = tp_rank % attn_tp_size``, ``attn_dp_rank = tp_rank // attn_tp_size``
    (``runtime_context.py`` ``derive_attn_tp_size`` / ``derive_attention_ranks``; attention
    CP is not described). Raises :class:`~kvplan.SpecError` when ``dp_size`` does not divide
    ``tp_size`` or ``tp_rank`` is out of range."""
    for name, v in (("tp_size", tp_size), ("dp_size", dp_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpecError(f"{name} must be a positive integer, got {v!r}")
    if tp_size % dp_size:
        raise SpecError(f"DP attention: dp_size {dp_size} does not divide tp_size {tp_size}")
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise SpecError(f"tp_rank must be an int in [0, {tp_size}), got {tp_rank!r}")
    attn = tp_size // dp_size
    return SGLangAttentionRank(tp_rank // attn, tp_rank % attn, attn)


def region_name(layer: int) -> str:
    """The region name of global layer ``layer``: ``layers.<layer>``."""
    return f"layers.{layer}"


def spec_from_sglang(kv: SGLangKV | Sequence[SGLangKV], *, attn_tp_size: int,
                     total_kv_heads: int | None = None) -> EngineSpec:
    """The :class:`~kvplan.EngineSpec` of an SGLang engine whose ranks hold pools like ``kv``;
    under pipeline parallelism, a sequence of one pool's values per PP stage, in stage order
    (each stage's pool holds its own layers, ``start_layer`` on: SGLang's
    ``prefill_start_layer``).

    ``attn_tp_size`` is the engine's attention TP size (``tp_size`` without DP attention;
    ``tp_size // dp_size`` with it: one attention-TP group), ``total_kv_heads`` the model's
    KV head count (``model_config.get_total_num_kv_heads()``, SGLang's ``total_kv_head_num``),
    needed for MHA pools when heads are replicated (fewer heads than ranks), else read as
    ``head_num * attn_tp_size``. One region per layer (:func:`region_name`); MHA layers have
    buffers ``<region>.k`` and ``<region>.v``, MLA layers one buffer named as the region. An
    MHA pool whose ``v_head_dim`` is not its ``head_dim`` gives two regions per layer,
    ``<region>.k`` and ``<region>.v``, each holding one stream in the buffer of its name.

    Raises :class:`~kvplan.SpecError` when ``head_num`` is not this engine's share of
    ``total_kv_heads`` (SGLang's ``max(1, K // attn_tp_size)``), the head count and TP size
    divide neither way, or PP stages disagree on what a layer holds or do not hold
    consecutive layers.
    """
    stages = [kv] if isinstance(kv, SGLangKV) else list(kv)
    if not stages:
        raise SpecError("no pool values: pass one SGLangKV, or one per PP stage")
    if attn_tp_size < 1:
        raise SpecError(f"attn_tp_size must be at least 1, got {attn_tp_size}")
    first = stages[0]
    for s, st in enumerate(stages[1:], 1):
        for field in ("kind", "page_size", "dtype", "head_num", "head_dim", "v_head_dim"):
            if getattr(st, field) != getattr(first, field):
                raise SpecError(f"PP stage {s}'s pool has {field} {getattr(st, field)!r}, "
                                f"stage 0's {getattr(first, field)!r}")
        if st.layers[0] != stages[s - 1].layers[-1] + 1:
            raise SpecError(f"PP stage {s} starts at layer {st.layers[0]}, stage {s - 1} ends "
                            f"at layer {stages[s - 1].layers[-1]}: not consecutive")
    heads = first.head_num * attn_tp_size if total_kv_heads is None else total_kv_heads
    if first.kind == "mha":
        if heads % attn_tp_size and attn_tp_size % heads:
            raise SpecError(f"MHATokenToKVPool: {heads} KV heads over attention TP "
                            f"{attn_tp_size}: neither divides the other")
        if first.head_num != max(1, heads // attn_tp_size):
            raise SpecError(f"MHATokenToKVPool: head_num {first.head_num} is not this rank's "
                            f"share of {heads} KV heads at attention TP {attn_tp_size} "
                            f"({max(1, heads // attn_tp_size)}); pass total_kv_heads")
    regions = []
    for s, st in enumerate(stages):
        block = {"num_blocks": st.pages, "block_size": st.page_size, "dtype": st.dtype}
        if len(stages) > 1:
            block["stage"] = s
        for n in st.layers:
            if st.kind == "mla":
                regions.append({"name": region_name(n), "kind": "mla", "dim": st.head_dim,
                                **block})
            elif st.v_head_dim != st.head_dim:  # K and V of different widths: one each
                regions += [{"name": f"{region_name(n)}.{stream}", "kind": "attention",
                             "num_kv_heads": heads, "head_dim": dim, "layout": "LBNHD",
                             "stream": stream, **block}
                            for stream, dim in (("k", st.head_dim), ("v", st.v_head_dim))]
            else:
                regions.append({"name": region_name(n), "kind": "attention",
                                "num_kv_heads": heads, "head_dim": st.head_dim,
                                "layout": "LBNHD",
                                "allocation": [f"{region_name(n)}.k", f"{region_name(n)}.v"],
                                **block})
    return EngineSpec.from_dict({"tp_size": attn_tp_size, "pp_size": len(stages),
                                 "regions": regions})


def sglang_buffers(pool: Any, spec: EngineSpec) -> dict[str, tuple[int, int]]:
    """``{buffer name: (address, nbytes)}`` of one rank's ``pool`` for ``spec`` (made by
    :func:`spec_from_sglang` from this pool's values; under PP, from every stage's: a rank
    gets the buffers of its stage): what an executor registers, the same addresses as
    SGLang's ``kv_data_ptrs`` / ``kv_data_lens``. For a ``MambaPool`` (a spec of
    :func:`spec_from_sglang_mamba2` or :func:`spec_from_sglang_hybrid`), its state buffers
    at the addresses of its ``get_contiguous_buf_infos`` (SGLang's ``state_data_ptrs``)."""
    name = type(pool).__name__
    if name == "MambaPool":  # its entries: every layer's conv, then temporal
        ptrs = pool.get_contiguous_buf_infos()[0]
        ids = list(pool.mamba_layer_ids)
        names = [f"{region_name(n)}.{t}" for t in ("conv", "ssm") for n in ids]
        if len(ptrs) != len(names) or not set(names) <= set(spec.buffers):
            raise SpecError(f"the MambaPool's {len(ptrs)} state entries are not the spec's "
                            f"buffers {names}")
        return {b: (int(a), spec.rank_buffer_nbytes(b)) for b, a in zip(names, ptrs)}
    if name == "SWAKVPool":  # both sub-pools, each at its own layers' names
        SGLangKV.from_swa_pool(pool)  # checks the sub-pools
        return {**sglang_buffers(pool.full_kv_pool, spec),
                **sglang_buffers(pool.swa_kv_pool, spec)}
    if name == "HybridLinearKVPool":  # its attention buffers, and its state where spec has it
        kv = SGLangKV.from_pool(pool)
        out = _kv_buffers(pool.full_kv_pool, kv, spec)
        state = getattr(pool, "mamba_pool", None)
        if state is not None and any(f"{region_name(n)}.conv" in spec.buffers
                                     for n in state.mamba_layer_ids):
            out.update(sglang_buffers(state, spec))
        return out
    return _kv_buffers(pool, SGLangKV.from_pool(pool), spec)


def _kv_buffers(pool: Any, kv: SGLangKV, spec: EngineSpec) -> dict[str, tuple[int, int]]:
    """The K/V (or MLA) buffers of an MHA / MLA ``pool`` read as ``kv``, for ``spec``."""
    tensors: dict[str, Any] = {}
    for i, layer in enumerate(kv.layers):
        name = region_name(layer)
        if kv.kind == "mla":
            tensors[name] = pool.kv_buffer[i]
        else:
            tensors[f"{name}.k"], tensors[f"{name}.v"] = pool.k_buffer[i], pool.v_buffer[i]
    if not set(tensors) <= set(spec.buffers):
        raise SpecError(f"the pool's buffers {sorted(set(tensors) - set(spec.buffers))} are "
                        "not the spec's")
    return {b: (int(tensors[b].data_ptr()), spec.rank_buffer_nbytes(b))
            for b in spec.buffers if b in tensors}


@attrs.frozen
class SGLangMamba2:
    """What one SGLang rank knows about the Mamba2 (or Gated DeltaNet) state of a hybrid
    model, as plain values: the numbers its config passes to SGLang's
    ``Mamba2StateShape.create`` (Mamba2, Nemotron-H: ``mamba_num_heads``, ``mamba_head_dim``,
    ``ssm_state_size``, ``n_groups``, ``conv_kernel``; GDN, Qwen3-Next, ``kind="gdn"``:
    ``num_heads`` = ``linear_num_value_heads``, ``head_dim`` = ``linear_value_head_dim``,
    ``state_size`` = ``linear_key_head_dim``, ``n_groups`` = ``linear_num_key_heads``), the
    global ids of the pool's layers, ``slots`` per state tensor (``size + 1``), and the conv
    and temporal dtypes (``Mamba2StateDType``). A Mamba2 rank's conv channels are ``[x | B |
    C]``, a GDN rank's ``[q | k | v]`` (q and k ``n_groups`` heads of ``state_size``, v
    ``num_heads`` of ``head_dim``), each part sharded on its own. KDA (Kimi-Linear,
    ``kind="kda"``: ``KimiLinearStateShape``, ``num_heads`` heads of ``head_dim`` for q, k
    and v; ``state_size`` and ``n_groups`` unused) keeps its conv state taps-major,
    ``[conv_kernel - 1, channels]``, every tap a row ``q | k | v``, and a temporal state of
    ``(heads, head_dim, head_dim)``."""

    layers: tuple[int, ...]
    slots: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    conv_dtype: str
    ssm_dtype: str
    kind: str = "mamba2"

    def conv_dim(self, tp: int) -> int:
        """Conv channels per rank at attention TP ``tp`` (SGLang's ``conv_state`` dim)."""
        if self.kind == "kda":  # q, k and v of num_heads heads each
            return 3 * self.num_heads * self.head_dim // tp
        return (self.num_heads * self.head_dim + 2 * self._groups(tp) * self.state_size) // tp

    def _groups(self, tp: int) -> int:
        """B/C groups after SGLang pads them to shard with the heads
        (``extra_groups_for_head_shards``): ``tp`` groups when there are fewer than ranks."""
        return self.n_groups if self.n_groups % tp == 0 else tp

    def item_lens(self, tp: int) -> tuple[int, int]:
        """Bytes of one slot of the conv and of the temporal state on a rank (SGLang's state
        ``item_lens``)."""
        conv = self.conv_dim(tp) * (self.conv_kernel - 1) * DTYPE_SIZES[self.conv_dtype]
        ssm = (self.num_heads // tp * self.head_dim
               * (self.head_dim if self.kind == "kda" else self.state_size)
               * DTYPE_SIZES[self.ssm_dtype])
        return conv, ssm

    @classmethod
    def from_pool(cls, pool: Any, *, attn_tp_size: int, n_groups: int | None = None
                  ) -> SGLangMamba2:
        """The values of one rank's SGLang ``MambaPool`` at attention TP ``attn_tp_size``,
        read from the pool itself: its layer ids and slots, the shapes and dtypes of its conv
        and temporal tensors (``mamba_cache.conv`` / ``.temporal``), what it tells its
        disaggregation connections (``get_contiguous_buf_infos``,
        ``get_state_conv_shard_groups``) and its conv slice axis. KDA is the pool whose conv
        slice axis is 1 (taps-major), GDN the one whose conv state comes in shard groups
        ``[key_dim, key_dim, value_dim]`` (``n_groups`` = key heads, read from them), Mamba2
        the other: its B/C groups are padded to the TP size on a rank, so ``n_groups`` (the
        model config's) must be given. Nothing is imported: attributes, ``.shape`` and
        ``.dtype`` only.

        Raises :class:`~kvplan.SpecError` naming the pool for another class, state entries
        beyond one conv and one temporal tensor per layer (ReplaySSM rings, sibling states,
        several conv tensors), or sizes that do not match the values read.
        """
        name = type(pool).__name__
        if name == "HybridLinearKVPool":  # the MambaPool it holds (req_to_token_pool's)
            return cls.from_pool(pool.mamba_pool, attn_tp_size=attn_tp_size,
                                 n_groups=n_groups)
        if name != "MambaPool":
            raise SpecError(f"{name}: not SGLang's MambaPool")
        layers = tuple(int(n) for n in pool.mamba_layer_ids)
        convs = list(pool.mamba_cache.conv)
        if len(convs) != 1:
            raise SpecError(f"MambaPool: {len(convs)} conv state tensors; one is described")
        conv, temporal = convs[0], pool.mamba_cache.temporal
        _, lens, items = pool.get_contiguous_buf_infos()
        if len(items) != 2 * len(layers):
            raise SpecError(f"MambaPool: {len(items)} state entries for {len(layers)} layers; "
                            "one conv and one temporal entry per layer are described (not "
                            "ReplaySSM rings or sibling states)")
        cshape, tshape = tuple(map(int, conv.shape)), tuple(map(int, temporal.shape))
        slots = int(pool.size) + 1
        if cshape[:2] != (len(layers), slots) or tshape[:2] != (len(layers), slots) \
                or len(cshape) != 4 or len(tshape) != 5:
            raise SpecError(f"MambaPool: conv {cshape} and temporal {tshape} are not "
                            f"[{len(layers)} layers, {slots} slots, ...]")
        tp = attn_tp_size
        groups = pool.get_state_conv_shard_groups()[0]
        if int(getattr(pool, "conv_slice_axis", 0) or 0) == 1:
            kind, (taps, dim), n_groups = "kda", cshape[2:], 1
        else:
            (dim, taps), kind = cshape[2:], "mamba2" if groups is None else "gdn"
        heads, head_dim, state = tshape[2] * tp, tshape[3], tshape[4]
        if kind == "gdn":
            key = int(groups[0])
            if len(groups) != 3 or groups[1] != key or groups[2] != heads * head_dim \
                    or key % state or n_groups not in (None, key // state):
                raise SpecError(f"MambaPool: conv shard groups {list(groups)} are not [key "
                                f"heads x {state}, the same, {heads} value heads x {head_dim}]"
                                + ("" if n_groups is None else f" with {n_groups} key heads"))
            n_groups = key // state
        if n_groups is None:
            raise SpecError("MambaPool: a Mamba2 rank's B/C groups are padded to the TP size; "
                            "pass n_groups from the model config")
        m = cls(layers=layers, slots=slots, num_heads=heads, head_dim=head_dim,
                state_size=state, n_groups=n_groups, conv_kernel=taps + 1,
                conv_dtype=_dtype(name, [conv]), ssm_dtype=_dtype(name, [temporal]),
                kind=kind)
        for label in (m.conv_dtype, m.ssm_dtype):
            if label not in DTYPE_SIZES:
                raise SpecError(f"MambaPool: dtype {label!r} is not one of "
                                f"{', '.join(DTYPE_SIZES)}")
        want = (m.item_lens(tp), m.conv_dim(tp))
        if (items[0], items[len(layers)]) != want[0] or dim != want[1] \
                or lens[0] != slots * items[0]:
            raise SpecError(f"MambaPool: entries of {items[0]} / {items[len(layers)]} bytes "
                            f"per slot and {dim} conv channels; {m} at attention TP {tp} "
                            f"gives {want[0]} and {want[1]}")
        return m


def spec_from_sglang_mamba2(m: SGLangMamba2, *, attn_tp_size: int, group: int = 0
                            ) -> EngineSpec:
    """The state regions of an SGLang engine's ``MambaPool`` (Mamba2), in KV-cache group
    ``group`` (0 for a spec of the state alone; beside a hybrid model's attention regions the
    state takes a group of its own): per layer ``layers.<n>.conv`` (parts ``x``, ``B``,
    ``C``, or GDN's ``q``, ``k``, ``v``, each channel ``conv_kernel - 1`` values) and
    ``layers.<n>.ssm`` (part ``ssm``, one head each), in SGLang's entry order (every layer's
    conv, then every layer's temporal state).

    Raises :class:`~kvplan.SpecError` for dtypes kvplan does not know, heads that do not
    divide over ``attn_tp_size``, or a group count that neither divides nor is divided by it
    (SGLang pads such groups unevenly; not described yet).
    """
    tp = attn_tp_size
    for label in (m.conv_dtype, m.ssm_dtype):
        if label not in DTYPE_SIZES:
            raise SpecError(f"MambaPool: dtype {label!r} is not one of {', '.join(DTYPE_SIZES)}")
    if tp < 1 or m.num_heads % tp:
        raise SpecError(f"MambaPool: {m.num_heads} Mamba heads do not divide over attention "
                        f"TP {tp}")
    if m.n_groups % tp and tp % m.n_groups:
        raise SpecError(f"MambaPool: n_groups {m.n_groups} and attention TP {tp}: neither "
                        "divides the other (SGLang's padded groups are not described yet)")
    taps, ec = m.conv_kernel - 1, DTYPE_SIZES[m.conv_dtype]
    group_part = {"units": m.n_groups, "unit_bytes": m.state_size * taps * ec}
    if m.kind == "mamba2":
        conv = [{"name": "x", "units": m.num_heads * m.head_dim, "unit_bytes": taps * ec},
                {"name": "B", **group_part}, {"name": "C", **group_part}]
    elif m.kind == "gdn":
        conv = [{"name": "q", **group_part}, {"name": "k", **group_part},
                {"name": "v", "units": m.num_heads, "unit_bytes": m.head_dim * taps * ec}]
    elif m.kind == "kda":  # [conv_kernel - 1, channels]: every tap a row q | k | v
        head = {"units": m.num_heads, "unit_bytes": m.head_dim * ec}
        conv = [{"name": f"{sub}.{j}", **head} for j in range(taps) for sub in "qkv"]
    else:
        raise SpecError(f"MambaPool: state kind {m.kind!r} is not described by kvplan's SGLang "
                        "adapter (mamba2, gdn, kda are)")
    ssm = [{"name": "ssm", "units": m.num_heads,
            "unit_bytes": m.head_dim * (m.head_dim if m.kind == "kda" else m.state_size)
            * DTYPE_SIZES[m.ssm_dtype]}]
    base = {"kind": "state", "group": group, "num_blocks": m.slots}
    regions = ([{"name": f"{region_name(n)}.conv", "dtype": m.conv_dtype, "parts": conv,
                 **base} for n in m.layers]
               + [{"name": f"{region_name(n)}.ssm", "dtype": m.ssm_dtype, "parts": ssm,
                   **base} for n in m.layers])
    spec = EngineSpec.from_dict({"tp_size": tp, "regions": regions})
    conv_len, ssm_len = m.item_lens(tp)
    got = (spec.rank_buffer_nbytes(0) // m.slots, spec.rank_buffer_nbytes(len(m.layers))
           // m.slots)
    if got != (conv_len, ssm_len):
        raise SpecError(f"MambaPool: kvplan's parts hold {got} bytes per slot, SGLang's "
                        f"tensors {(conv_len, ssm_len)}")
    return spec


def spec_from_sglang_hybrid(kv: SGLangKV | Sequence[SGLangKV],
                            state: SGLangMamba2 | Sequence[SGLangMamba2], *,
                            attn_tp_size: int, total_kv_heads: int | None = None
                            ) -> EngineSpec:
    """One spec for a hybrid model's engine (Nemotron-H, Qwen3-Next, Kimi-Linear): its
    attention layers (:func:`spec_from_sglang` of ``kv``, KV-cache group 0: a request's page
    ids) and its Mamba2, GDN or KDA state (:func:`spec_from_sglang_mamba2` of ``state``,
    group 1: the request's state slot). A plan then takes ``[pages, [slot]]`` per side.

    Under pipeline parallelism pass one ``kv`` and one ``state`` per stage, in stage order
    (each stage's ``HybridLinearKVPool`` holds its own full-attention layers and its
    ``MambaPool`` its own state layers, at global ids): each stage's regions are its
    attention layers then its state layers, and a rank holds its stage's. SGLang pairs a
    prefill stage's entries with the decode's by these global layer ids (``kv_layer_ids``,
    ``state_layer_ids``, ``build_transfer_entry_pairs``), as kvplan does by region name.

    Raises :class:`~kvplan.SpecError` when the stages disagree in number or in what a layer
    holds, a stage's layers do not all come after the previous stage's, or attention and
    state share a layer."""
    kvs = [kv] if isinstance(kv, SGLangKV) else list(kv)
    states = [state] if isinstance(state, SGLangMamba2) else list(state)
    if not kvs or len(kvs) != len(states):
        raise SpecError(f"a hybrid spec takes one SGLangKV and one SGLangMamba2 per PP stage, "
                        f"got {len(kvs)} and {len(states)}")
    regions: list[dict] = []
    last = -1
    for s, (a, m) in enumerate(zip(kvs, states)):
        attn = spec_from_sglang(a, attn_tp_size=attn_tp_size, total_kv_heads=total_kv_heads)
        st = spec_from_sglang_mamba2(m, attn_tp_size=attn_tp_size, group=0)
        for field in ("kind", "page_size", "dtype", "head_num", "head_dim", "v_head_dim"):
            if getattr(a, field) != getattr(kvs[0], field):
                raise SpecError(f"PP stage {s}'s pool has {field} {getattr(a, field)!r}, "
                                f"stage 0's {getattr(kvs[0], field)!r}")
        for field in ("slots", "num_heads", "head_dim", "state_size", "n_groups",
                      "conv_kernel", "conv_dtype", "ssm_dtype", "kind"):
            if getattr(m, field) != getattr(states[0], field):
                raise SpecError(f"PP stage {s}'s MambaPool has {field} "
                                f"{getattr(m, field)!r}, stage 0's "
                                f"{getattr(states[0], field)!r}")
        if set(a.layers) & set(m.layers):
            raise SpecError(f"PP stage {s}: layers {sorted(set(a.layers) & set(m.layers))} "
                            "hold both attention and state")
        layers = sorted({*a.layers, *m.layers})
        if layers[0] <= last:
            raise SpecError(f"PP stage {s} starts at layer {layers[0]}, stage {s - 1} ends at "
                            f"layer {last}: not after it")
        last = layers[-1]
        stage = {"stage": s} if len(kvs) > 1 else {}
        regions += [{**r, **stage} for r in attn.to_dict()["regions"]]
        regions += [{**r, "group": 1, **stage} for r in st.to_dict()["regions"]]
    return EngineSpec.from_dict({"tp_size": attn_tp_size, "pp_size": len(kvs),
                                 "regions": regions})


def spec_from_sglang_swa(full: SGLangKV, swa: SGLangKV, *, attn_tp_size: int,
                         total_kv_heads: int | None = None,
                         swa_total_kv_heads: int | None = None) -> EngineSpec:
    """One spec for an SGLang engine whose ``SWAKVPool`` holds ``full`` and ``swa``
    (:meth:`SGLangKV.from_swa_pool`): the full-attention layers in KV-cache group 0 (a
    request's pages in the full pool) and the sliding-window layers in group 1 (the pages
    SGLang hands over for them: the window's, in the SWA pool's own index space). A plan
    takes ``[full pages, SWA pages]`` per side. ``total_kv_heads`` / ``swa_total_kv_heads``
    are the model's KV heads of each kind of layer (an SWA layer may have fewer: MiMo-V2,
    ``swa_head_num``), needed where heads are replicated. Raises :class:`~kvplan.SpecError`
    as :func:`spec_from_sglang` does, or when the two share a layer."""
    a = spec_from_sglang(full, attn_tp_size=attn_tp_size, total_kv_heads=total_kv_heads)
    b = spec_from_sglang(swa, attn_tp_size=attn_tp_size, total_kv_heads=swa_total_kv_heads)
    names = {r.name for r in a.regions} & {r.name for r in b.regions}
    if names:
        raise SpecError(f"SWAKVPool: full and SWA regions share names {sorted(names)}")
    regions = a.to_dict()["regions"] + [{**r, "group": 1} for r in b.to_dict()["regions"]]
    return EngineSpec.from_dict({"tp_size": attn_tp_size, "regions": regions})
