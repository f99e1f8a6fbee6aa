"""A stock vLLM prefill's :class:`~kvplan.EngineSpec`, from the metadata its NixlConnector
publishes: the first brick of reading from an unmodified NixlConnector prefill (issue 38).

vLLM 0.32's NixlConnector (``kv_connector/v1/nixl/``) answers a decode's handshake with one
``NixlAgentMetadata`` per prefill TP rank (``metadata.py``), filled by
``NixlBaseConnectorWorker.register_kv_caches`` (``base_worker.py``). What it says, and what
this adapter reads from it:

- ``kv_caches_base_addr``, ``block_lens``, ``block_strides``, ``region_num_blocks``,
  ``region_group_ids``, ``region_names``: one entry per NIXL *region*. Layers are visited in
  ``_region_sort_key`` order (``layers.2`` before ``layers.10``); a layer is one region
  ``(data_ptr, page bytes, block stride)`` in layouts ``LBHNC``, ``LBNHC`` and ``BLHNC`` (a
  layer-major storage is one segment per layer; a block-major one has pages that torch calls
  contiguous), while ``BLNHC``, ``LHBNC`` and ``BHLNC`` register whole storage rows or one
  region per head segment; layers starting at an address already registered
  (the hybrid manager's page pools: every group views a pool from byte 0) join that region,
  named by its first layer, its group id ``-1`` (``_SHARED_REGION_GROUP_ID``) when the groups
  differ, its block length the first layer's unless an MLA layer overrides it;
- ``block_size`` and ``num_blocks`` are the *kernel* block's (``_sync_block_size_with_kernel``):
  a logical block is ``physical_blocks_per_logical_kv_block`` of them; a Mamba-family layer's
  region counts logical blocks, yet every region then publishes the physical count;
- ``ssm_sizes``: ``(conv state bytes, temporal state bytes)`` of one state slot on the rank
  (``ssm_conv_transfer_utils.derive_mamba_conv_split``); the conv state is always ``DS``
  (``(channels, kernel - 1)``: ``__init__`` asserts ``is_conv_state_dim_first``);
- ``kv_cache_layout`` (a ``KVCacheLayout`` name), ``attn_backend_name`` (the first layer's
  backend), ``dcp_size``, ``pcp_size``, ``device_id``; ``ple_block_len`` and
  ``packed_member_layouts`` for caches this adapter does not describe.

The metadata does not say the model (head counts, head size, state shapes): NixlConnector's own
decode takes them from its own engine, trusting the compatibility hash
(``compute_nixl_compatibility_hash``: model, dtype, KV heads, head size, layers, backend,
cache dtype) and then checking every region's length (``_validate_remote_agent_handshake``).
:func:`prefill_from_nixl` does the same, exactly: it derives the prefill's spec from the
decode's own per-layer truth at the prefill's TP size, block size and layout, computes the
regions ``register_kv_caches`` would publish for it, and refuses with a
:class:`NixlMetadataError` naming the region, the field and both numbers where any differs.

Not described yet (refused by name): several ranks' metadata that disagree, ``pcp_size`` or
``dcp_size`` above 1 (the DCP interleave is not published), layouts whose page is not one run
(``BLNHC``, ``LHBNC``, ``BHLNC``: vLLM registers storage rows or head segments), packed PP push
layouts, PLE state, a backend other than the decode's.

Layer 5 (adapters, beside :mod:`kvplan.adapters.vllm`): imports spec, layout and errors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvplan.constants import (
    MAX_ALLOCATION_BYTES,
    MAX_BLOCK_SIZE,
    MAX_REGIONS,
    MAX_TP_SIZE,
)
from kvplan.errors import SpecError
from kvplan.layout import rank_layout
from kvplan.spec import EngineSpec

#: vLLM 0.32 ``KVCacheLayout`` names whose ``[H, N, C]`` page is one run of bytes: one NIXL
#: region per layer (``register_kv_caches``' ``storage_is_block_major`` / segment branches).
PAGE_RUN_LAYOUTS = frozenset({"LBHNC", "LBNHC", "BLHNC"})
#: ``region_group_ids`` entry of a region shared by layers of several groups
#: (``_SHARED_REGION_GROUP_ID`` in ``base_worker.py``).
SHARED_GROUP = -1
#: Fields every prefill rank publishes alike (one engine, one config).
ENGINE_FIELDS = ("engine_id", "num_blocks", "block_size", "kv_cache_layout",
                 "attn_backend_name", "physical_blocks_per_logical_kv_block", "dcp_size",
                 "pcp_size", "region_names")


#: Each number a rank's metadata publishes, and its range (``low``, ``high``: inclusive): a
#: prefill's sizes are checked as kvplan's own metadata's are before any is used (addresses
#: positive and below 2**63, the int64 offsets NIXL's descriptors take; sizes and counts
#: positive), so that a forged or corrupt one is refused naming the field, never an untyped
#: exception later.
NUMBER_FIELDS: Mapping[str, tuple[int, int]] = {
    "num_blocks": (1, (1 << 31) - 1), "block_size": (1, MAX_BLOCK_SIZE),
    "physical_blocks_per_logical_kv_block": (1, MAX_BLOCK_SIZE),
    "device_id": (0, (1 << 31) - 1), "dcp_size": (1, MAX_TP_SIZE), "pcp_size": (1, MAX_TP_SIZE),
}
#: The per-region columns and the range of each entry (``region_num_blocks`` and
#: ``region_group_ids`` may be absent: None).
COLUMN_FIELDS: Mapping[str, tuple[int, int]] = {
    "kv_caches_base_addr": (1, (1 << 63) - 1), "block_lens": (1, MAX_ALLOCATION_BYTES),
    "block_strides": (1, MAX_ALLOCATION_BYTES), "region_num_blocks": (0, (1 << 31) - 1),
    "region_group_ids": (SHARED_GROUP, (1 << 31) - 1),
}


class NixlMetadataError(SpecError):
    """A NixlConnector prefill's published metadata cannot be described exactly as a kvplan
    spec of the same model: the message names the rank, region and field, and both numbers."""


@attrs.frozen
class NixlPrefill:
    """A stock NixlConnector prefill as kvplan sees it: ``spec`` (its :class:`EngineSpec`),
    ``buffers`` (per prefill TP rank, ``{buffer name: (address, nbytes)}`` of ``spec.buffers``
    as :func:`kvplan.adapters.vllm.vllm_buffers` gives them for an engine's own tensors),
    ``device_ids`` (per rank, NIXL's device id), ``engine_id`` and ``backend`` as published."""

    spec: EngineSpec
    buffers: tuple[dict[str, tuple[int, int]], ...]
    device_ids: tuple[int, ...]
    engine_id: str
    backend: str


def region_sort_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """vLLM 0.32's region order (``_region_sort_key`` in ``base_worker.py``): digit runs as
    numbers, so ``layers.2`` sorts before ``layers.10``."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name))


def prefill_from_nixl(decode: EngineSpec, metadata: Sequence[Mapping[str, Any]], *,
                      backend: str | None) -> NixlPrefill:
    """The prefill's spec and buffer addresses from its ``NixlAgentMetadata``, one mapping of
    its fields per prefill TP rank in rank order (``msgspec.structs.asdict`` of the decoded
    struct, or any mapping of the same names), given ``decode``, the decode's own spec of the
    same model (:func:`~kvplan.adapters.vllm.spec_from_vllm`), and ``backend``, the decode's
    attention backend name.

    The prefill's spec is ``decode``'s regions at the prefill's TP size (``len(metadata)``),
    block count, block and kernel block size and ``kv_cache_layout``, its state regions' conv
    parts in ``DS`` order, its pools' pages the published block strides. Every published
    region is then checked against the one ``register_kv_caches`` would publish for that spec
    (name, block length, block stride, block count, group, ``ssm_sizes``), and every region's
    address against its place in its buffer. Raises :class:`NixlMetadataError` naming the rank,
    region, field and both numbers for any difference, and for what the module docstring lists
    as not described yet.
    """
    if not metadata:
        raise NixlMetadataError("no NixlAgentMetadata: one per prefill TP rank is needed")
    meta0 = _agree(metadata)
    spec = _first_rank_spec(decode, meta0, len(metadata), backend)
    buffers = tuple(_check_rank(spec, m, k, meta0) for k, m in enumerate(metadata))
    return NixlPrefill(spec=spec, buffers=buffers,
                       device_ids=tuple(int(m["device_id"]) for m in metadata),
                       engine_id=str(meta0["engine_id"]), backend=str(backend))


def check_first_rank(decode: EngineSpec, meta0: Mapping[str, Any], tp_size: int, *,
                     backend: str | None) -> None:
    """Check prefill rank 0's ``NixlAgentMetadata`` fields ``meta0`` alone, as
    :func:`prefill_from_nixl` checks every rank, for a prefill of ``tp_size`` ranks (what a
    request claims): before any other rank is asked for, since vLLM 0.32's listener dies on a
    rank it lacks. A rank's block lengths and state sizes are its share of the model's heads,
    so a claimed size whose share differs from the published one is refused
    (:class:`NixlMetadataError` naming ``tp_size``, the region, the field and both numbers).
    Where every rank holds the same bytes at either size (MLA, or fewer KV heads than ranks)
    the two sizes publish alike, and this cannot tell them apart."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) \
            or not 1 <= tp_size <= MAX_TP_SIZE:
        raise NixlMetadataError(f"tp_size {tp_size!r}: must be an int 1 to {MAX_TP_SIZE}")
    meta0 = _agree([meta0])
    try:
        _check_rank(_first_rank_spec(decode, meta0, tp_size, backend), meta0, 0, meta0)
    except SpecError as e:  # NixlMetadataError, or no spec of this model at that size at all
        # (a hybrid's state shares a page that its attention at fewer ranks would overflow)
        raise NixlMetadataError(f"tp_size {tp_size} (the request's): prefill rank 0's "
                                f"metadata is not this model's at that size: {e}") from None


def fewer_ranks_fit(decode: EngineSpec, meta0: Mapping[str, Any], tp_size: int, *,
                    backend: str | None) -> int | None:
    """The smallest TP size below ``tp_size`` that prefill rank 0's metadata ``meta0`` also
    fits (:func:`check_first_rank` passes), among the sizes vLLM can run this model at (each
    attention region's KV heads a multiple or a divisor of it); None if none does.

    Where one exists, rank 0's metadata cannot tell the prefill's TP size: every rank holds the
    same bytes at either size (an MLA latent, or fewer KV heads than ranks), so a claim of
    ``tp_size`` ranks is unverified, and asking for a rank the prefill lacks kills vLLM 0.32's
    listener thread. Checks at most ``tp_size - 1`` sizes (128 at most, each a spec built)."""
    heads = {r.num_kv_heads for r in decode.regions
             if r.kind.value == "attention" and r.num_kv_heads}
    for t in range(1, tp_size):
        if any(h % t and t % h for h in heads):  # a size vLLM refuses for this model
            continue
        try:
            check_first_rank(decode, meta0, t, backend=backend)
        except NixlMetadataError:
            continue
        return t
    return None


def _first_rank_spec(decode: EngineSpec, meta0: Mapping[str, Any], tp: int,
                     backend: str | None) -> EngineSpec:
    """The engine-wide checks of :func:`prefill_from_nixl`, then the prefill's spec."""
    if meta0.get("ple_block_len") is not None or meta0.get("packed_member_layouts"):
        raise NixlMetadataError("the prefill publishes a PLE state page or packed PP members "
                                "(ple_block_len, packed_member_layouts): not described yet")
    for field in ("pcp_size", "dcp_size"):
        if int(meta0.get(field, 1)) != 1:
            raise NixlMetadataError(f"the prefill's {field} is {meta0[field]}: context "
                                    "parallel prefills are not described yet (vLLM does not "
                                    "publish the DCP interleave)")
    if backend != meta0["attn_backend_name"]:
        raise NixlMetadataError(f"attn_backend_name: the prefill runs "
                                f"{meta0['attn_backend_name']!r}, this decode {backend!r}: a "
                                "page's content order is the backend's")
    return _prefill_spec(decode, meta0, tp)


def _agree(metadata: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    for k, m in enumerate(metadata):
        missing = [f for f in (*ENGINE_FIELDS, "kv_caches_base_addr", "block_lens",
                               "block_strides", "ssm_sizes", "device_id") if f not in m]
        if missing:
            raise NixlMetadataError(f"prefill rank {k}: NixlAgentMetadata lacks {missing} "
                                    "(vLLM 0.32's NIXL_CONNECTOR_VERSION 14 publishes them)")
        _numbers(m, k)
        for f in ENGINE_FIELDS:
            if m[f] != metadata[0][f]:
                raise NixlMetadataError(f"{f}: prefill rank {k} publishes {m[f]!r}, rank 0 "
                                        f"{metadata[0][f]!r}: one engine's ranks must agree")
    return metadata[0]


def _int_in(v: Any, low: int, high: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _numbers(m: Mapping[str, Any], rank: int) -> None:
    """Every number and name of rank ``rank``'s metadata in its range and type
    (:data:`NUMBER_FIELDS`, :data:`COLUMN_FIELDS`), before any is used."""
    who = f"prefill rank {rank}"
    for f, (low, high) in NUMBER_FIELDS.items():
        if f in m and not _int_in(m[f], low, high):
            raise NixlMetadataError(f"{who}: {f} {m[f]!r:.80}: must be an int {low} to {high}")
    for f in ("engine_id", "kv_cache_layout", "attn_backend_name"):
        if not isinstance(m[f], str):
            raise NixlMetadataError(f"{who}: {f} {m[f]!r:.80}: must be a string")
    for f, (low, high) in COLUMN_FIELDS.items():
        col = m.get(f)
        if col is None and f in ("region_num_blocks", "region_group_ids"):
            continue
        if not isinstance(col, (list, tuple)) or len(col) > MAX_REGIONS:
            raise NixlMetadataError(f"{who}: {f} must be a list of at most {MAX_REGIONS} "
                                    f"ints, one per region, got {type(col).__name__}")
        bad = next((j for j, v in enumerate(col) if not _int_in(v, low, high)), None)
        if bad is not None:
            raise NixlMetadataError(f"{who}: {f}[{bad}] {col[bad]!r:.80}: must be an int "
                                    f"{low} to {high}")
    names = m["region_names"]
    if names is not None and (not isinstance(names, (list, tuple)) or len(names) > MAX_REGIONS
                              or not all(isinstance(n, str) for n in names)):
        raise NixlMetadataError(f"{who}: region_names must be a list of at most "
                                f"{MAX_REGIONS} strings")
    ssm = m["ssm_sizes"]
    if not isinstance(ssm, (list, tuple)) or len(ssm) != 2 or not all(
            _int_in(v, 0, MAX_ALLOCATION_BYTES) for v in ssm):
        raise NixlMetadataError(f"{who}: ssm_sizes {ssm!r:.80}: must be two ints 0 to "
                                f"{MAX_ALLOCATION_BYTES} (conv, temporal bytes)")


def _content(region: Any) -> str:
    order = region.order
    if order.endswith("SND"):
        return "SND"
    if order.endswith("SD"):
        return "SD"
    raise NixlMetadataError(f"region {region.name!r}: the decode's layout {region.layout_name} "
                            "is not a vLLM KV cache's (content K then V of a token, or "
                            "CPU_ATTN's K part then V part)")


def _order(region: Any, layout: str, sizes: Mapping[str, int]) -> str:
    """kvplan's axis order of ``region`` in vLLM layout ``layout``, named as
    :func:`~kvplan.adapters.vllm.spec_from_vllm` names it from a tensor's strides: axes of
    size 1 (``sizes``) keep their logical place in ``LBHN``, the others follow ``layout``."""
    big = iter(a for a in layout[:-1] if sizes[a] > 1)
    order = "".join(a if sizes[a] == 1 else next(big) for a in "LBHN")
    if _content(region) == "SD":
        return order + "SD"
    if not order.endswith("N"):
        raise NixlMetadataError(f"region {region.name!r}: kv_cache_layout {layout} puts H "
                                "inside N; the backend reads a head's page as [2, N, D]")
    return order[:-1] + "SND"


def _prefill_spec(decode: EngineSpec, meta: Mapping[str, Any], tp: int) -> EngineSpec:
    """``decode``'s regions as the prefill holds them (see :func:`prefill_from_nixl`)."""
    layout = str(meta["kv_cache_layout"])
    if layout not in PAGE_RUN_LAYOUTS:
        raise NixlMetadataError(f"kv_cache_layout {layout}: NixlConnector registers its "
                                "pages as several regions (heads or whole storage rows); "
                                f"described layouts: {', '.join(sorted(PAGE_RUN_LAYOUTS))}")
    ratio = int(meta["physical_blocks_per_logical_kv_block"])
    kernel_blocks = int(meta["num_blocks"])
    if ratio < 1 or kernel_blocks % ratio:
        raise NixlMetadataError(f"num_blocks {kernel_blocks} is not a multiple of "
                                f"physical_blocks_per_logical_kv_block {ratio}")
    names = list(meta["region_names"] or [])
    strides = dict(zip(names, meta["block_strides"], strict=False))
    out = decode.to_dict()
    out.update(tp_size=tp)
    pools: dict[str, int] = {}
    for src, r in zip(decode.regions, out["regions"], strict=True):
        r["num_blocks"] = kernel_blocks // ratio
        if r["kind"] == "state":
            r["parts"] = _ds_parts(r["parts"])
        else:
            slots = decode.slot_of(decode.region_index(src.name))[1]
            heads = 1 if src.kind.value == "mla" else max(1, src.num_kv_heads // tp)
            sizes = {"L": slots if src.allocation is not None and src.pool is None else 1,
                     "B": kernel_blocks, "H": heads, "N": int(meta["block_size"])}
            r["layout"] = _order(src, layout, sizes)
            r["block_size"] = int(meta["block_size"]) * ratio
            r.pop("kernel_block_size", None)
            if ratio > 1:
                r["kernel_block_size"] = int(meta["block_size"])
        if src.pool is not None:
            pools.setdefault(src.pool, _pool_page(decode, src.pool, strides, ratio))
            r["page_bytes"] = pools[src.pool]
    return EngineSpec.from_dict(out)


def _pool_page(decode: EngineSpec, pool: str, strides: Mapping[str, int], ratio: int) -> int:
    """A pool's page on the prefill: the published block stride of the region its first layer
    (in vLLM's order) names, times the kernel blocks of a logical block."""
    first = min((r.name for r in decode.regions if r.pool == pool), key=region_sort_key)
    if first not in strides:
        raise NixlMetadataError(f"pool {pool!r}: the prefill publishes no region named {first!r}"
                                f" (its regions: {sorted(strides)[:8]})")
    return int(strides[first]) * ratio


def _ds_parts(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A state slot's parts in ``DS`` order: each sub-projection's conv taps one run
    (``x_conv.0``, ``x_conv.1``... of ``SD`` become ``x_conv``), then the temporal state."""
    merged: dict[str, dict[str, Any]] = {}
    for p in parts:
        stem = p["name"].split(".", 1)[0]
        if stem in merged:
            if merged[stem]["units"] != p["units"]:
                raise NixlMetadataError(f"state part {p['name']}: {p['units']} units, its "
                                        f"other taps {merged[stem]['units']}")
            merged[stem]["unit_bytes"] += p["unit_bytes"]
        else:
            merged[stem] = {**p, "name": stem}
    return list(merged.values())


def _expected(spec: EngineSpec, rank: int, meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The regions ``register_kv_caches`` publishes for ``spec`` on ``rank``, in its order:
    name, buffer, offset in the buffer, block length and stride, block count, group."""
    ratio = int(meta["physical_blocks_per_logical_kv_block"])
    has_state = any(r.is_state for r in spec.regions)
    out: list[dict[str, Any]] = []
    at: dict[tuple[int, int], dict[str, Any]] = {}
    order = sorted(range(len(spec.regions)), key=lambda i: region_sort_key(spec.regions[i].name))
    for i in order:
        r = spec.regions[i]
        lay = rank_layout(spec, i, rank)
        if r.is_state:
            page = spec.rank_page_nbytes(i)  # MambaSpec.page_size_bytes, padded to the pool's
            blen, stride, nb = page // ratio, page // ratio, r.num_blocks
        else:
            blen = spec.rank_block_nbytes(i) // ratio
            stride, nb = lay.kernel, r.num_blocks * ratio
        key = (spec.buffer_of(i), lay.components[0].base)
        region = at.get(key)
        if region is None:
            region = {"name": r.name, "buffer": key[0], "offset": key[1], "block_len": blen,
                      "block_stride": stride, "num_blocks": nb, "group": r.group,
                      "state": r.is_state, "index": i}
            at[key] = region
            out.append(region)
            continue
        if r.kind.value == "mla":  # an MLA member's geometry wins (register_kv_caches)
            region.update(block_len=blen, block_stride=stride, num_blocks=nb)
        if region["group"] != r.group:
            region["group"] = SHARED_GROUP
        region["state"] |= r.is_state
    if has_state:  # register_kv_caches: region_num_blocks = [self.num_blocks] * regions
        for region in out:
            region["num_blocks"] = int(meta["num_blocks"])
    return out


def _ssm_sizes(spec: EngineSpec, index: int, rank: int) -> tuple[int, int]:
    """(conv bytes, temporal bytes) of one slot of state region ``index`` on ``rank``."""
    conv = ssm = 0
    for part, comp in zip(spec.regions[index].parts or (), rank_layout(spec, index, rank)
                          .components, strict=True):
        n = comp.local_units * comp.unit_bytes
        if part.name.endswith("_conv"):
            conv += n
        else:
            ssm += n
    return conv, ssm


def _check_rank(spec: EngineSpec, m: Mapping[str, Any], rank: int,
                meta0: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Check rank ``rank``'s published regions against ``spec``; its buffers' addresses."""
    want = _expected(spec, rank, meta0)
    names = list(m["region_names"] or [])
    got_names = [w["name"] for w in want]
    if names != got_names:
        raise NixlMetadataError(f"prefill rank {rank}: region_names {names[:6]}... "
                                f"({len(names)}), this model's are {got_names[:6]}... "
                                f"({len(got_names)})")
    n = len(want)
    columns = {"kv_caches_base_addr": m["kv_caches_base_addr"], "block_lens": m["block_lens"],
               "block_strides": m["block_strides"]}
    for f in ("region_num_blocks", "region_group_ids"):
        if m.get(f) is not None:
            columns[f] = m[f]
    for f, col in columns.items():
        if len(col) != n:
            raise NixlMetadataError(f"prefill rank {rank}: {f} has {len(col)} entries for "
                                    f"{n} regions")
    fields = (("block_lens", "block_len"), ("block_strides", "block_stride"),
              ("region_num_blocks", "num_blocks"), ("region_group_ids", "group"))
    ssm_pub = tuple(int(x) for x in m["ssm_sizes"])
    bases: dict[int, tuple[int, str]] = {}
    for j, w in enumerate(want):
        for f, key in fields:
            if f in columns and int(columns[f][j]) != w[key]:
                raise NixlMetadataError(f"prefill rank {rank}, region {w['name']!r}: {f} "
                                        f"{columns[f][j]}, this model at TP {spec.tp_size} "
                                        f"has {w[key]}")
        if w["state"]:
            states = [i for i in spec.buffer_regions(w["buffer"]) if spec.regions[i].is_state]
            for i in states:
                have = _ssm_sizes(spec, i, rank)
                if have != ssm_pub:
                    raise NixlMetadataError(
                        f"prefill rank {rank}, region {spec.regions[i].name!r}: ssm_sizes "
                        f"{ssm_pub}, this model at TP {spec.tp_size} has {have} (conv, "
                        "temporal bytes)")
        base = int(columns["kv_caches_base_addr"][j]) - w["offset"]
        first = bases.setdefault(w["buffer"], (base, w["name"]))
        if first[0] != base:
            raise NixlMetadataError(
                f"prefill rank {rank}, region {w['name']!r}: kv_caches_base_addr "
                f"{int(columns['kv_caches_base_addr'][j]):#x} puts its buffer "
                f"{spec.buffers[w['buffer']]!r} at {base:#x}, region {first[1]!r} at "
                f"{first[0]:#x}")
    out = {}
    for b, (base, name) in sorted(bases.items()):
        size = spec.rank_buffer_nbytes(b)
        if not 0 < base or base + size > 1 << 63:  # NIXL's descriptors take int64 addresses
            raise NixlMetadataError(
                f"prefill rank {rank}, region {name!r}: kv_caches_base_addr puts its buffer "
                f"{spec.buffers[b]!r} ({size} bytes) at {base:#x}: it must lie in (0, 2**63)")
        out[spec.buffers[b]] = (base, size)
    return out
