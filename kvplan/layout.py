"""Byte layouts of a region on one rank, as shape:stride. The address formula lives only here.

A region on a rank is addressed by (stream, block, local head, token) plus a contiguous run of
``head_bytes`` (one head's features). Each of the five layouts of domain.md section 4 is just a
choice of the four byte strides; MLA and indexer regions are the HND/split case with one stream
and one head, which gives their ``(NB, bs, F)`` formula exactly.
"""

from __future__ import annotations

import attrs

from kvplan.placement import held_heads
from kvplan.spec import KV, Layout, RegionSpec


@attrs.frozen(kw_only=True)
class RankLayout:
    """Where every head-run of one region lives on one rank, in bytes from the region's base.

    ``offset(s, b, h, t) = s*stream + b*block + (h - first_head)*head + t*token`` for stream ``s``,
    block ``b``, global head ``h`` held by the rank, token ``t``; the run is ``head_bytes`` long.
    """

    streams: int
    num_blocks: int
    block_size: int
    first_head: int  # global index of the rank's first held head
    local_heads: int
    head_bytes: int
    stream: int  # byte strides
    block: int
    head: int
    token: int

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block on this rank (all streams and local heads)."""
        return self.streams * self.local_heads * self.block_size * self.head_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole region on this rank."""
        return self.num_blocks * self.block_nbytes

    def offset(self, stream, block, head, token):  # ints or numpy arrays alike
        """Byte offset of (stream, block, global head, token); see the class docstring."""
        return (
            stream * self.stream
            + block * self.block
            + (head - self.first_head) * self.head
            + token * self.token
        )

    def shape_stride(self) -> str:
        """CuTe-style notation, e.g. ``(2,1024,2,16):(4194304,4096,2048,256) x 256 B``."""
        shape = (self.streams, self.num_blocks, self.local_heads, self.block_size)
        stride = (self.stream, self.block, self.head, self.token)
        return (
            f"({','.join(map(str, shape))}):({','.join(map(str, stride))}) x {self.head_bytes} B"
        )


def rank_layout(region: RegionSpec, tp_size: int, rank: int) -> RankLayout:
    """The byte layout of ``region`` on ``rank`` of an engine with ``tp_size`` ranks."""
    heads = held_heads(region.heads, tp_size, rank)
    nh, bs, nb, hb = len(heads), region.block_size, region.num_blocks, region.head_bytes
    s_count = region.streams
    if region.layout is Layout.HND:  # ... heads, tokens, features
        token, head = hb, bs * hb
    else:  # NHD: ... tokens, heads, features
        head, token = hb, nh * hb
    one_stream = nh * bs * hb  # one stream of one block
    if region.kv is KV.SPLIT or s_count == 1:  # (S, NB, ...)
        block, stream = one_stream, nb * one_stream
    else:  # joint: (NB, S, ...)
        stream, block = one_stream, s_count * one_stream
    return RankLayout(
        streams=s_count,
        num_blocks=nb,
        block_size=bs,
        first_head=heads.start,
        local_heads=nh,
        head_bytes=hb,
        stream=stream,
        block=block,
        head=head,
        token=token,
    )
