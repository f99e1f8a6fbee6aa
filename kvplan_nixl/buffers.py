"""Which allocations a rank holds and the buffers its caller gave for them (transport-free).

An allocation is a region, or a whole pool of regions sharing one buffer. ``resolve_buffers``
turns the caller's buffers (a mapping by region or pool name, or a sequence in spec order) into
one ``(address, nbytes, device, memory)`` per allocation the rank holds, refusing, before any
transport is touched, a buffer of the wrong size, for a region of another pipeline stage, a
missing one, two different buffers for one pool, or allocations that overlap in memory.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvplan import EngineSpec
from kvplan_nixl.errors import BufferSizeError


def _alloc_label(spec: EngineSpec, a: int) -> str:
    """How error messages name allocation ``a``: a region, or a pool and its regions."""
    r = spec.regions[a]
    if r.pool is None:
        return f"region {r.name!r}"
    names = [x.name for x in spec.regions if x.pool == r.pool]
    return f"pool {r.pool!r} (regions {', '.join(map(repr, names))})"


def _buffer(buf: Any, spec: EngineSpec, a: int, key: str) -> tuple[int, int, int, str]:
    """(address, nbytes, device, mem_type) of allocation ``a``'s buffer, given as ``key``;
    refuses a wrong size at once."""
    what = _alloc_label(spec, a)
    if key not in (spec.regions[a].name, spec.regions[a].pool):
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
        addr, nbytes, dev, mem = int(buf[0]), int(buf[1]), 0, "DRAM"
    else:
        raise TypeError(
            f"{what}: a buffer is a contiguous torch tensor, a numpy array or an "
            f"(address, nbytes) pair, got {type(buf).__name__}"
        )
    want = spec.rank_region_nbytes(a)
    if nbytes != want:
        page = spec.rank_page_nbytes(a)
        how = (
            f"{want // page} pages of {page} bytes" if spec.regions[a].pool is not None
            else f"{spec.regions[a].num_blocks} blocks x {page} bytes per block"
        )
        raise BufferSizeError(
            f"{what}: buffer has {nbytes} bytes, the spec implies {want} ({how} on one of "
            f"{spec.tp_size} TP ranks)"
        )
    if addr <= 0:
        raise BufferSizeError(f"{what}: address {addr} is not a valid pointer")
    return addr, nbytes, dev, mem


def _stage_text(spec: EngineSpec, stage: int) -> str:
    tp = spec.tp_size
    return f"pipeline stage {stage} (ranks {stage * tp}..{stage * tp + tp - 1})"


def resolve_buffers(
    spec: EngineSpec, rank: int, buffers: Sequence[Any] | Mapping[str, Any]
) -> dict[int, tuple[Any, tuple[int, int, int, str]]]:
    """``{allocation index: (buffer, (address, nbytes, device, mem))}`` for the allocations
    ``rank`` holds, in spec order; every refusal is a :class:`BufferSizeError` naming what."""
    held = spec.regions_on(rank)
    allocs = sorted({spec.allocation_of(i) for i in held})
    labels = [_alloc_label(spec, a) for a in allocs]
    entries: list[tuple[str, int, Any]] = []  # (key, allocation, buffer)
    if isinstance(buffers, Mapping):
        by_name = {r.name: i for i, r in enumerate(spec.regions)}
        pools = {}
        for i, r in enumerate(spec.regions):
            if r.pool is not None:
                pools.setdefault(r.pool, i)
        for key, buf in buffers.items():
            if key in by_name:
                i = by_name[key]
            elif key in pools:
                i = pools[key]
            else:
                raise BufferSizeError(
                    f"buffers: {key!r} is neither a region nor a pool of the spec "
                    f"(rank {rank} needs {', '.join(labels)})"
                )
            if i not in held:
                what = "pool" if key not in by_name else "region"
                raise BufferSizeError(
                    f"buffers: {what} {key!r} lies on {_stage_text(spec, spec.stage_of(i))}, "
                    f"not on rank {rank}'s {_stage_text(spec, rank // spec.tp_size)}; give "
                    f"buffers only for what rank {rank} holds: {', '.join(labels)}"
                )
            entries.append((key, spec.allocation_of(i), buf))
    else:
        bufs = list(buffers)
        if len(bufs) == len(allocs):
            entries = [(spec.regions[a].name, a, b) for a, b in zip(allocs, bufs, strict=True)]
        elif len(bufs) == len(held):
            entries = [
                (spec.regions[i].name, spec.allocation_of(i), b)
                for i, b in zip(held, bufs, strict=True)
            ]
        else:
            per_region = "" if len(held) == len(allocs) else (
                f" (or one per region it holds, {len(held)})"
            )
            raise BufferSizeError(
                f"{len(bufs)} buffers for rank {rank}, which holds {len(allocs)} "
                f"allocation(s){per_region}: {', '.join(labels)}; pass them in spec order, or "
                "a mapping by region or pool name"
            )
    got: dict[int, tuple[str, Any, tuple[int, int, int, str]]] = {}
    for key, a, buf in entries:
        reg = _buffer(buf, spec, a, key)
        if a in got and got[a][2] != reg:
            k0, _, r0 = got[a]
            raise BufferSizeError(
                f"{_alloc_label(spec, a)}: {k0!r} and {key!r} give two different buffers "
                f"(at {r0[0]:#x} and {reg[0]:#x}); the regions of a pool share one allocation, "
                "so give them the same buffer, or give it once (by the pool's name or one "
                "region's)"
            )
        got.setdefault(a, (key, buf, reg))
    missing = [_alloc_label(spec, a) for a in allocs if a not in got]
    if missing:
        raise BufferSizeError(f"buffers: rank {rank} has no buffer for {', '.join(missing)}")
    out = {a: (got[a][1], got[a][2]) for a in allocs}
    spans = sorted((r[3], r[2], r[0], r[0] + r[1], a) for a, (_, r) in out.items())
    for x, y in itertools.pairwise(spans):
        if x[:2] == y[:2] and y[2] < x[3]:
            raise BufferSizeError(
                f"buffers of {_alloc_label(spec, x[4])} and {_alloc_label(spec, y[4])} overlap "
                "in memory; regions share memory only through a pool of the spec"
            )
    return out
