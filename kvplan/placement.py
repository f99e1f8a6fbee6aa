"""Which ranks hold which heads, and which source rank serves each head a destination needs.

Theory of operation. Every region is a set of ``K`` global heads sharded over ``tp`` ranks
(domain.md section 2). A replicated region (MLA, indexer) is the degenerate case ``K = 1``: every
rank holds head 0. With ``K >= tp`` rank ``r`` holds heads ``[r*K/tp, (r+1)*K/tp)``; with
``K < tp`` it holds head ``r*K//tp`` and ``tp/K`` consecutive ranks share it. That one rule covers
SPLIT, replicated heads and REPLICATE alike, so nothing downstream branches on the model family.

Choosing a source for a head ``h`` needed by destination rank ``d``: ``h`` is held by ``n``
consecutive destination ranks (``d`` is the ``i``-th of them) and ``m`` consecutive source ranks;
``d`` reads it from source ``i*m//n`` among those. Each head is thus read exactly once per
destination rank, and the destinations sharing a head spread evenly over its source replicas
(loads differ by at most one). For a replicated region this is the anchors' ``t * R // T``.

Layer 1 (values): imports nothing from kvplan (pure integer arithmetic on head counts).
"""

from __future__ import annotations

import enum

import attrs


class Placement(enum.Enum):
    """How a region is placed over TP ranks."""

    SPLIT = "S"  # heads sharded (possibly replicated when heads < ranks)
    REPLICATE = "R"  # every rank holds all of it


def held_heads(num_heads: int, tp: int, rank: int) -> range:
    """Global heads held by ``rank`` of ``tp``: post-condition ``len(result) == max(1, K//tp)``."""
    if num_heads >= tp:
        per = num_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank * num_heads // tp
    return range(head, head + 1)


def holders(num_heads: int, tp: int, head: int) -> range:
    """Ranks of ``tp`` that hold global ``head``: one rank, or ``tp/K`` consecutive ranks."""
    if num_heads >= tp:
        rank = head // (num_heads // tp)
        return range(rank, rank + 1)
    share = tp // num_heads
    return range(head * share, (head + 1) * share)


@attrs.frozen
class HeadSource:
    """Heads ``[start, stop)`` (global) that a destination rank reads from ``src_rank``."""

    src_rank: int
    start: int
    stop: int
    replica: int = 0  # the source PCP replica read (prefill context parallelism, kvplan/cp.py)

    def __str__(self) -> str:
        return f"p{self.src_rank} heads {self.start}:{self.stop}"


def head_sources(
    num_heads: int, src_tp: int, dst_tp: int, dst_rank: int, *, src_dcp: int = 1,
    dst_dcp: int = 1, src_dcp_rank: int = 0, src_pcp: int = 1, dst_pcp: int = 1,
    dst_pcp_rank: int = 0,
) -> tuple[HeadSource, ...]:
    """Where destination rank ``dst_rank`` reads each head it holds, as maximal head intervals.

    Under decode context parallelism (``*_dcp`` > 1) a token is held, among a head's holders,
    only by those of its DCP rank (``rank % dcp``): this answers for the tokens source DCP rank
    ``src_dcp_rank`` holds (and ``dst_rank`` holds, which its own DCP rank decides). The same
    rule: ``dst_rank`` is the ``i``-th of the ``n`` destinations holding (head, token) and reads
    from the ``i*m//n``-th of the ``m`` sources holding it.

    Under replicated prefill context parallelism every source holder has ``src_pcp`` replicas
    and every destination holder ``dst_pcp`` (``dst_pcp_rank`` being this one's): the same rule
    over ``m * src_pcp`` sources and ``n * dst_pcp`` destinations spreads the readers over the
    replicas (``HeadSource.replica``), and is the rule above when both are 1. The replica index
    is then turned by the head's holder group, so that destinations reading different heads
    start on different replicas.

    Post-conditions: the intervals are disjoint, ascending, cover exactly
    ``held_heads(num_heads, dst_tp, dst_rank)``, and each source rank holds its interval.
    """
    out: list[HeadSource] = []
    for h in held_heads(num_heads, dst_tp, dst_rank):
        dsts = holders(num_heads, dst_tp, h)  # each starts a DCP group (EngineSpec checks)
        srcs = holders(num_heads, src_tp, h)
        i = (dst_rank - dsts.start) // dst_dcp
        m, n = len(srcs) // src_dcp, len(dsts) // dst_dcp
        k = (dst_pcp_rank * n + i) * m * src_pcp // (n * dst_pcp)  # i*m//n without replicas
        turn = dsts.start // len(dsts)  # heads read by other destinations: other replicas
        src = srcs.start + src_dcp_rank + (k // src_pcp) * src_dcp
        replica = (k + turn) % src_pcp
        last = out[-1] if out else None
        if last and (last.src_rank, last.replica, last.stop) == (src, replica, h):
            out[-1] = HeadSource(src, last.start, h + 1, replica)
        else:
            out.append(HeadSource(src, h, h + 1, replica))
    return tuple(out)


@attrs.frozen
class TokenSharding:
    """How the ranks of one DCP group share the positions of a block id (one side, one region).

    vLLM's decode context parallelism (docs/concepts.md): a block id covers ``span =
    block_size * dcp`` request positions; offset ``o`` in it belongs to DCP rank ``(o //
    interleave) % dcp`` and sits at token ``(o // (dcp * interleave)) * interleave + o %
    interleave`` of that rank's block. ``dcp == 1`` is the plain case: one rank, token ``o``.
    """

    block_size: int
    dcp: int = 1
    interleave: int = 1

    @property
    def span(self) -> int:
        """Request positions one block id covers."""
        return self.block_size * self.dcp

    def holder(self, o):
        """DCP rank holding offset ``o`` of a block id (ints or numpy arrays)."""
        return (o // self.interleave) % self.dcp

    def local(self, o):
        """Token index, in the holder's block, of offset ``o`` of a block id."""
        return (o // (self.dcp * self.interleave)) * self.interleave + o % self.interleave
