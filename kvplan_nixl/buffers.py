"""Which allocations a rank holds and the buffers its caller gave for them (transport-free).

A buffer (``EngineSpec.buffers``) is a region's own, a pool's, an allocation's (its regions
being layer slots), or the K or V buffer of regions keeping them apart. ``resolve_buffers``
turns the caller's buffers (a mapping by region, pool, allocation or buffer name, or a
sequence in spec order) into one ``(address, nbytes, device, memory)`` per buffer the rank
holds, refusing, before any transport is touched, a buffer of the wrong size, for a region of
another pipeline stage, a missing one, two different buffers for one pool or allocation, or
buffers that overlap in memory. ``memory`` declares which buffer is in which NIXL memory
type (DRAM or VRAM): a tensor or array whose device disagrees is refused, naming the buffer;
an ``(address, nbytes)`` pair takes the declared type (DRAM when none is declared).

Bottom layer: pure, no NIXL call; it may import only the core and ``errors``.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvplan import EngineSpec
from kvplan_nixl.errors import BufferSizeError


def _alloc_label(spec: EngineSpec, b: int) -> str:
    """How error messages name buffer ``b`` (an index of ``spec.buffers``): a region, a pool,
    an allocation, or a K or V buffer, and the regions living in it."""
    from kvplan.views import name_set

    name = spec.buffers[b]
    regions = [spec.regions[i] for i in spec.buffer_regions(b)]
    r = regions[0]
    names = (", ".join(repr(x.name) for x in regions) if len(regions) <= LISTED
             else name_set([x.name for x in regions]))  # 80 slots: layers.[0-79].attn x80
    if r.separate_kv:
        which = "K" if spec.buffer_of(spec.regions.index(r), 0) == b else "V"
        return f"{which} buffer {name!r} (regions {names})"
    if r.allocation is not None:
        return f"allocation {name!r} (regions {names})"
    if r.pool is not None:
        return f"pool {r.pool!r} (regions {names})"
    return f"region {r.name!r}"


def _buffer(buf: Any, spec: EngineSpec, a: int, key: str,
            declared: str | None = None) -> tuple[int, int, int, str]:
    """(address, nbytes, device, mem_type) of buffer ``a`` (an index of ``spec.buffers``),
    given as ``key`` and declared to be in ``declared`` (None: not declared); refuses a wrong
    size or a device that is not the declared memory at once."""
    what = _alloc_label(spec, a)
    if key != spec.buffers[a]:
        what += f", given as {key!r}"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise BufferSizeError(f"{what}: tensor is not contiguous")
        if buf.device.type not in ("cpu", "cuda"):
            raise BufferSizeError(f"{what}: tensor on {buf.device}, not cpu or cuda")
        cuda = buf.device.type == "cuda"
        addr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
        dev, mem = (buf.device.index or 0, "VRAM") if cuda else (0, "DRAM")
    elif isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise BufferSizeError(f"{what}: numpy array is not C-contiguous")
        addr, nbytes, dev, mem = buf.ctypes.data, buf.nbytes, 0, "DRAM"
    elif (
        isinstance(buf, tuple)
        and len(buf) == 2
        and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in buf)
    ):
        addr, nbytes, dev, mem = int(buf[0]), int(buf[1]), 0, declared or "DRAM"
    else:
        raise TypeError(
            f"{what}: a buffer is a contiguous torch tensor, a numpy array or an "
            f"(address, nbytes) pair, got {type(buf).__name__}"
        )
    if declared is not None and mem != declared:
        raise BufferSizeError(
            f"{what}: declared {declared} in memory=, but the buffer is {mem} memory "
            f"({_device_text(buf)}); give a {'CUDA' if declared == 'VRAM' else 'CPU'} buffer "
            "or declare it as what it is")
    want = spec.rank_buffer_nbytes(a)
    if nbytes != want:
        i = spec.buffer_regions(a)[0]
        page = spec.rank_page_nbytes(i) // (2 if spec.regions[i].separate_kv else 1)
        slots = spec.slot_of(i)[1]
        how = (
            f"{want // page} pages of {page} bytes" if spec.regions[i].pool is not None
            else f"{spec.regions[i].num_blocks} blocks x {page} bytes per block"
        ) + (f" x {slots} layer slots" if slots > 1 else "")
        raise BufferSizeError(
            f"{what}: buffer has {nbytes} bytes, the spec implies {want} ({how} on one of "
            f"{spec.tp_size} TP ranks)"
        )
    if addr <= 0:
        raise BufferSizeError(f"{what}: address {addr} is not a valid pointer")
    if addr + nbytes > 1 << 63:  # NIXL's descriptors and the plans' offsets are int64
        raise BufferSizeError(f"{what}: {nbytes} bytes at address {addr:#x} end past 2**63")
    return addr, nbytes, dev, mem


def _device_text(buf: Any) -> str:
    """Where a buffer lives, for an error message."""
    if isinstance(buf, np.ndarray):
        return "a numpy array, host memory"
    return f"a tensor on {buf.device}"


def declared_memory(spec: EngineSpec, memory: Mapping[str, str] | None,
                    types: Sequence[str]) -> dict[int, str]:
    """``{buffer index: NIXL memory type}`` from ``memory``, keyed by buffer name (an entry
    of ``spec.buffers``: a region, pool, allocation or K/V buffer) or by a region's name
    (the buffer it lives in); refuses an unknown name or a type not in ``types``, naming it
    (the endpoint checked that ``memory`` is a mapping)."""
    if memory is None:
        return {}
    names = {name: b for b, name in enumerate(spec.buffers)}
    regions = {r.name: i for i, r in enumerate(spec.regions)}
    out: dict[int, str] = {}
    for key, mem in memory.items():
        if mem not in types:
            raise BufferSizeError(f"memory[{key!r}] is {mem!r}, not one of {list(types)}")
        if key in names:
            bs = [names[key]]
        elif key in regions:  # both buffers of a region keeping K and V apart
            bs = sorted({spec.buffer_of(regions[key], s) for s in (0, 1)})
        else:
            raise BufferSizeError(
                f"memory: {key!r} is neither a buffer nor a region of the spec (buffers: "
                f"{_listed(list(spec.buffers))})")
        for b in bs:
            if out.setdefault(b, mem) != mem:
                raise BufferSizeError(f"memory: buffer {spec.buffers[b]!r} is declared both "
                                      f"{out[b]} and {mem} (through {key!r})")
    return out


def memory_text(spec: EngineSpec, mem_types: Sequence[str]) -> str:
    """``DRAM: 'a', 'b'; VRAM: 'c'``: the buffers held per memory type, for an error message
    (``mem_types``: one per buffer of the spec, "" for those not held)."""
    kinds = sorted({m for m in mem_types if m})
    return "; ".join(
        f"{m}: " + _listed([repr(spec.buffers[b]) for b, x in enumerate(mem_types) if x == m])
        for m in kinds)


#: An error lists at most this many buffers, then says how many more (a message stays short).
LISTED = 4


def _listed(labels: Sequence[str]) -> str:
    """``a, b, c, d and 76 more``: a list in an error message, capped at :data:`LISTED`."""
    more = len(labels) - LISTED
    return ", ".join(labels[:LISTED]) + (f" and {more} more" if more > 0 else "")


def _stage_text(spec: EngineSpec, stage: int) -> str:
    tp = spec.tp_size
    return f"pipeline stage {stage} (ranks {stage * tp}..{stage * tp + tp - 1})"


def resolve_buffers(
    spec: EngineSpec, rank: int, buffers: Sequence[Any] | Mapping[str, Any],
    declared: Mapping[int, str] | None = None,
) -> dict[int, tuple[Any, tuple[int, int, int, str]]]:
    """``{buffer index: (buffer, (address, nbytes, device, mem))}`` for the buffers ``rank``
    holds (indices of ``spec.buffers``: regions, pools, allocations, K and V buffers), in that
    order, each checked against its memory type in ``declared`` (by buffer index, from
    :func:`declared_memory`; buffers of other stages may be declared, so that a deployment
    passes one mapping to every rank); every refusal is a :class:`BufferSizeError` naming
    what."""
    if isinstance(buffers, (str, bytes)) or not isinstance(buffers, (Mapping, Sequence)):
        raise BufferSizeError(f"buffers must be a mapping by name or a sequence of buffers, got "
                              f"{type(buffers).__name__}")
    declared = declared or {}
    held = spec.regions_on(rank)
    allocs = sorted({spec.buffer_of(i, s) for i in held for s in (0, 1)})
    labels = [_alloc_label(spec, a) for a in allocs]
    entries: list[tuple[str, int, Any]] = []  # (key, buffer, buffer object)
    if isinstance(buffers, Mapping):
        by_name = {r.name: i for i, r in enumerate(spec.regions)}
        names = {name: b for b, name in enumerate(spec.buffers)}
        for r in spec.regions:  # a region's or pool's name reaches the buffer holding it
            if r.pool is not None and not r.separate_kv:
                names.setdefault(r.pool, spec.buffer_of(spec.regions.index(r)))
        for key, buf in buffers.items():
            if key in by_name and not spec.regions[by_name[key]].separate_kv:
                b = spec.buffer_of(by_name[key])
            elif key in names:
                b = names[key]
            elif key in by_name:
                k, v = spec.regions[by_name[key]].allocation
                raise BufferSizeError(
                    f"buffers: region {key!r} keeps K and V in two buffers; give them by "
                    f"their names {k!r} and {v!r}"
                )
            else:
                raise BufferSizeError(
                    f"buffers: {key!r} is neither a region nor a pool nor a buffer of the spec; "
                    f"rank {rank} needs {len(labels)}: {_listed(labels)}"
                )
            if b not in allocs:
                i = spec.buffer_regions(b)[0]
                short = _alloc_label(spec, b).split(" (")[0]  # without its regions
                if key in by_name:
                    short = f"region {key!r}"
                raise BufferSizeError(
                    f"buffers: {short} lies on "
                    f"{_stage_text(spec, spec.stage_of(i))}, not on rank {rank}'s "
                    f"{_stage_text(spec, rank // spec.tp_size)}; give buffers only for what "
                    f"rank {rank} holds: {_listed(labels)}"
                )
            entries.append((key, b, buf))
    else:
        bufs = list(buffers)
        separate = any(spec.regions[i].separate_kv for i in held)
        if len(bufs) == len(allocs):
            entries = [(spec.buffers[a], a, b) for a, b in zip(allocs, bufs, strict=True)]
        elif len(bufs) == len(held) and not separate:
            entries = [
                (spec.regions[i].name, spec.buffer_of(i), b)
                for i, b in zip(held, bufs, strict=True)
            ]
        else:
            per_region = "" if len(held) == len(allocs) or separate else (
                f" (or one per region it holds, {len(held)})"
            )
            raise BufferSizeError(
                f"{len(bufs)} buffers for rank {rank}, which holds {len(allocs)} "
                f"allocation(s){per_region}: pass them in spec order, or a mapping by region, "
                f"pool, allocation or buffer name; it holds {_listed(labels)}"
            )
    got: dict[int, tuple[str, Any, tuple[int, int, int, str]]] = {}
    for key, a, buf in entries:
        reg = _buffer(buf, spec, a, key, declared.get(a))
        if a in got and got[a][2] != reg:
            k0, _, r0 = got[a]
            raise BufferSizeError(
                f"{_alloc_label(spec, a)}: {k0!r} and {key!r} give two different buffers "
                f"(at {r0[0]:#x} and {reg[0]:#x}); the regions of a pool or of an allocation "
                "share one allocation, so give them the same buffer, or give it once (by its "
                "name or one region's)"
            )
        got.setdefault(a, (key, buf, reg))
    missing = [_alloc_label(spec, a) for a in allocs if a not in got]
    if missing:
        raise BufferSizeError(f"buffers: rank {rank} has no buffer for {_listed(missing)}")
    out = {a: (got[a][1], got[a][2]) for a in allocs}
    spans = sorted((r[3], r[2], r[0], r[0] + r[1], a) for a, (_, r) in out.items())
    for x, y in itertools.pairwise(spans):
        if x[:2] == y[:2] and y[2] < x[3]:
            raise BufferSizeError(
                f"buffers of {_alloc_label(spec, x[4])} and {_alloc_label(spec, y[4])} overlap "
                "in memory; regions share memory only through a pool or an allocation of the "
                "spec"
            )
    return out
