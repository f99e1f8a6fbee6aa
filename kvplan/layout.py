"""Byte layouts of a region on one rank, as shape:stride. The address formula lives only here.

A region's block on a rank is made of components (``spec.Component``: the KV heads of an
attention layer, the latent of an MLA layer, the parts of a state slot). A byte run of one unit
(one head's features, one state unit) of component ``c`` is addressed by (stream, block, unit,
token)::

    offset = base[c] + s*stream[c] + b*block + (t // kernel_size)*kernel
             + (t % kernel_size)*token[c] + (u - first_unit[c])*unit[c]

The strides come from the region's axis order (``RegionSpec.order``: a permutation of
``LBSHND``, layer slot, kernel block, stream, head, token, bytes of one head) over the dense
tensor of its allocation: :func:`dense_strides`. The legacy layouts are four such orders
(HND/NHD swap the unit and token strides, split/joint the stream and kernel-block strides),
vLLM's ``BLHNC``... and TensorRT-LLM's ``BLSHND`` are others; ``base`` holds the layer slot's
offset (and a state part's place in its slot). MLA and indexer are one stream of one unit, a
state slot is one token whose parts sit side by side. Kernel blocks (``kernel_block_size`` <
``block_size``) make a logical block ``n`` consecutive kernel blocks; a pooled region steps its
blocks by the pool's page instead of its own size. With K and V in separate buffers, stream 1
lies past the K buffer (:func:`kv_split`) and :func:`buffer_offsets` maps offsets back.

Layer 1 (values): imports spec and placement only; the planner and allocations read it.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import numpy as np

from kvplan.placement import held_heads
from kvplan.spec import EngineSpec


@attrs.frozen(kw_only=True)
class ComponentLayout:
    """Strides of one component of a region on one rank (bytes; see the module docstring)."""

    first_unit: int  # global index of the rank's first held unit (head, channel group)
    local_units: int
    unit_bytes: int
    streams: int
    base: int
    stream: int
    unit: int
    token: int


@attrs.frozen(kw_only=True)
class RankLayout:
    """Where every unit-run of one region lives on one rank, in bytes from its allocation's base.

    Post-condition of :meth:`offset`: distinct (component, stream, block, unit, token) within
    the region's blocks map to disjoint ``unit_bytes`` runs inside ``[0, nbytes)``.
    """

    num_blocks: int
    block_size: int
    kernel_size: int
    block: int  # stride of a logical block: the page of a pool, else n kernel blocks
    kernel: int  # stride of a kernel block inside a logical block
    components: tuple[ComponentLayout, ...]

    def offset(self, c: int, stream, block, unit, token):  # ints or numpy arrays alike
        """Byte offset of (component ``c``, stream, block, global unit, token)."""
        k = self.components[c]
        return (
            k.base
            + stream * k.stream
            + block * self.block
            + (token // self.kernel_size) * self.kernel
            + (token % self.kernel_size) * k.token
            + (unit - k.first_unit) * k.unit
        )

    def shape_stride(self) -> str:
        """CuTe-style notation per component, e.g. ``(2,1024,2,16):(...,4096,2048,256) x 256 B``."""
        out = []
        for k in self.components:
            shape = (k.streams, self.num_blocks, k.local_units, self.block_size)
            stride = (k.stream, self.block, k.unit, k.token)
            out.append(
                f"({','.join(map(str, shape))}):({','.join(map(str, stride))}) x {k.unit_bytes} B"
            )
        return "; ".join(out)


def dense_strides(order: str, sizes: Mapping[str, int]) -> dict[str, int]:
    """Byte strides of a dense row-major tensor whose axes are ``order`` (outermost first) with
    ``sizes``; ``D`` counts bytes, so its stride is 1. Post-condition: ``stride[order[0]] *
    sizes[order[0]]`` is the tensor's size."""
    strides, step = {}, 1
    for axis in reversed(order):
        strides[axis] = step
        step *= sizes[axis]
    return strides


def _axis_sizes(spec: EngineSpec, index: int, rank: int) -> tuple[dict[str, int], list]:
    """Sizes of the axes of region ``index``'s allocation on ``rank`` (B in kernel blocks),
    and per component ``(first unit, local units, unit bytes, start within D)``."""
    region = spec.regions[index]
    tp, tp_rank = spec.tp_size, rank % spec.tp_size
    n = region.block_size // region.kernel_size
    comps, start = [], 0
    for c in region.components:
        units = held_heads(c.units, tp, tp_rank)
        comps.append((units.start, len(units), c.unit_bytes, start))
        start += len(units) * c.unit_bytes
    if region.is_state:  # one slot of parts side by side: the content is the D axis
        sizes = dict(S=1, H=1, N=1, D=start)
    else:
        sizes = dict(S=region.streams, H=comps[0][1], N=region.kernel_size, D=comps[0][2])
    sizes.update(L=spec.slot_of(index)[1], B=region.num_blocks * n)
    return sizes, comps


def rank_layout(spec: EngineSpec, index: int, rank: int) -> RankLayout:
    """The byte layout of region ``index`` of ``spec`` on flat rank ``rank``.

    The strides come from the region's axis order (``RegionSpec.order``) over its allocation:
    a dense row-major tensor of sizes L (slots), B (kernel blocks), S, H (local heads), N
    (tokens of a kernel block), D (bytes of one head of one token). A pooled region's block is
    a page, L and B outermost, the rest of the order inside the page. With K and V in separate
    buffers the order drops S, and stream 1 is addressed past the K buffer (see
    :func:`kv_split`), so that no run can join the two.
    """
    region = spec.regions[index]
    ks = region.kernel_size
    n = region.block_size // ks
    sizes, comps = _axis_sizes(spec, index, rank)
    order = region.order.replace("S", "") if region.separate_kv else region.order
    slot = spec.slot_of(index)[0]
    if region.pool is not None:  # L and B outermost (checked by the spec), pages of the pool
        page = spec.rank_page_nbytes(index)
        inner = dense_strides("".join(a for a in order if a not in "LB"), sizes)
        kernel = sizes["S"] * sizes["H"] * sizes["N"] * sizes["D"]
        pages = spec.rank_region_nbytes(index) // (page * sizes["L"])
        outer = dense_strides("".join(a for a in order if a in "LB"),
                              dict(L=sizes["L"], B=pages, D=1))
        strides = {**inner, "L": outer["L"] * page, "B": outer["B"] * page}
        block = strides["B"]
    else:
        strides = dense_strides(order, sizes)
        kernel = strides["B"]
        block = n * kernel
    # separate K/V: V one block past the K buffer's end (see kv_split)
    stream = spec.rank_region_nbytes(index) + block if region.separate_kv else strides["S"]
    layouts = []
    for first, local, unit_bytes, start in comps:
        if region.is_state:
            unit, token = unit_bytes, 0
        else:
            unit, token = strides["H"], strides["N"]
        layouts.append(ComponentLayout(
            first_unit=first, local_units=local, unit_bytes=unit_bytes,
            streams=region.components[0].streams if not region.is_state else 1,
            base=slot * strides["L"] + start, stream=stream, unit=unit, token=token,
        ))
    return RankLayout(
        num_blocks=region.num_blocks, block_size=region.block_size, kernel_size=ks, block=block,
        kernel=kernel, components=tuple(layouts),
    )


def kv_split(spec: EngineSpec, index: int) -> int:
    """Where region ``index``'s V stream starts in the offsets the planner works with when K
    and V live in separate buffers: one block past the end of the K buffer.

    The planner sees the two buffers of a region as one space, V after a one-block gap: so the
    V stream sits a whole number of blocks up (as a split layout's V does) and no run is ever
    contiguous across the two. :func:`buffer_offsets` maps these offsets back to (buffer,
    offset). 0 when K and V share a buffer.
    """
    if not spec.regions[index].separate_kv:
        return 0
    rank = spec.stage_of(index) * spec.tp_size  # a rank holding it; the stride is the same on all
    return rank_layout(spec, index, rank).components[0].stream


def buffer_offsets(
    spec: EngineSpec, regions: np.ndarray, offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Planner offsets of rows in ``regions`` -> ``(buffer index, offset in that buffer)``.

    The buffer index is one of ``spec.buffers``; offsets past :func:`kv_split` are in the V
    buffer. Vectorised over rows (one small table per spec)."""
    n = len(spec.regions)
    k = np.array([spec.buffer_of(i, 0) for i in range(n)], dtype=np.int64)
    v = np.array([spec.buffer_of(i, 1) for i in range(n)], dtype=np.int64)
    split = np.array([kv_split(spec, i) for i in range(n)], dtype=np.int64)
    s = split[regions]
    in_v = (s > 0) & (offsets >= s)
    return np.where(in_v, v[regions], k[regions]), offsets - np.where(in_v, s, 0)
