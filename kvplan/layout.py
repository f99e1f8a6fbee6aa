"""Byte layouts of a region on one rank, as shape:stride. The address formula lives only here.

A region's block on a rank is made of components (``spec.Component``: the KV heads of an
attention layer, the latent of an MLA layer, the parts of a state slot). A byte run of one unit
(one head's features, one state unit) of component ``c`` is addressed by (stream, block, unit,
token)::

    offset = base[c] + s*stream[c] + b*block + (t // kernel_size)*kernel
             + (t % kernel_size)*token[c] + (u - first_unit[c])*unit[c]

Each layout of domain.md section 4 is a choice of these strides: HND/NHD swap the unit and token
strides, split/joint swap the stream and kernel-block strides, MLA and indexer are one stream of
one unit, a state slot is one token whose parts sit side by side (``base``). Kernel blocks
(``kernel_block_size`` < ``block_size``) make a logical block ``n`` consecutive kernel blocks;
a pooled region steps its blocks by the pool's page instead of its own size.
"""

from __future__ import annotations

import attrs

from kvplan.placement import held_heads
from kvplan.spec import KV, EngineSpec, Layout


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


def rank_layout(spec: EngineSpec, index: int, rank: int) -> RankLayout:
    """The byte layout of region ``index`` of ``spec`` on flat rank ``rank``."""
    region = spec.regions[index]
    tp, tp_rank = spec.tp_size, rank % spec.tp_size
    ks, nb = region.kernel_size, region.num_blocks
    n = region.block_size // ks
    comps = region.components
    if region.is_state:  # one slot: parts side by side, each its local units
        base, layouts = 0, []
        for c in comps:
            units = held_heads(c.units, tp, tp_rank)
            layouts.append(ComponentLayout(
                first_unit=units.start, local_units=len(units), unit_bytes=c.unit_bytes,
                streams=1, base=base, stream=0, unit=c.unit_bytes, token=0,
            ))
            base += len(units) * c.unit_bytes
        kernel = base
    else:  # attention, MLA, indexer: one component
        (c,) = comps
        units = held_heads(c.units, tp, tp_rank)
        nh, hb = len(units), c.unit_bytes
        token, unit = (hb, ks * hb) if region.layout is Layout.HND else (nh * hb, hb)
        one_stream = nh * ks * hb  # one stream of one kernel block
        if region.kv is KV.SPLIT or c.streams == 1:  # (S, NB*n, ...)
            kernel, stream = one_stream, nb * n * one_stream
        else:  # joint: (NB*n, S, ...)
            stream, kernel = one_stream, c.streams * one_stream
        layouts = [ComponentLayout(
            first_unit=units.start, local_units=nh, unit_bytes=hb, streams=c.streams, base=0,
            stream=stream, unit=unit, token=token,
        )]
    block = spec.rank_page_nbytes(index) if region.pool is not None else n * kernel
    return RankLayout(
        num_blocks=nb, block_size=region.block_size, kernel_size=ks, block=block, kernel=kernel,
        components=tuple(layouts),
    )
