"""Staged (bounce-buffer) transfers: a plan -> three plans through contiguous staging areas.

Theory of operation. A fragmented plan (tens of thousands of small runs) costs one NIXL
descriptor per run, and descriptors, not bytes, bound its speed. Staging moves the same bytes in
three legs, each an ordinary list of byte runs (:data:`kvplan.COPY_DTYPE` rows, so
``kvplan.simulate`` and the test oracle check them like any plan):

1. **gather**, local to each source rank: the plan's runs -> that rank's staging area;
2. **bulk**, between staging areas: one run per chunk (a handful of descriptors per peer);
3. **scatter**, local to each destination rank: staging area -> the plan's destinations.

A staging area is addressed like an engine region whose blocks are consecutive: region index
:data:`STAGING`, byte offsets in one *staging space* per request, shared by both sides (the bulk
leg copies offset ``x`` to offset ``x``). Each peer of the plan owns a span of that space,
starting at a multiple of ``chunk_bytes``; its runs are packed in canonical order (by destination
buffer, then destination offset, which push and pull plans of the same peer pair agree on) and
cut at every multiple of ``chunk_bytes``, so chunk ``k`` of a peer is one bulk run and fits one
staging slot of ``chunk_bytes`` bytes. Post-condition (tested against the oracle): gather, then
bulk, then scatter writes exactly the bytes the direct plan writes.

Everything here is numpy over the runs, no Python loop per run; an executor (the NIXL
package's staged transfers) runs the local legs as index copies and the bulk leg over its
transport.

Layer 5 (built on plans): imports lanes, plan, planner and errors; an executor reads its legs.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from kvplan.errors import RequestError
from kvplan.lanes import Mode, ReadOnlyArrays
from kvplan.plan import COPY_DTYPE, TransferPlan
from kvplan.planner import TransferMap

#: Region index that names a staging area in a leg's rows (engine regions are >= 0).
STAGING = -1

#: One row per chunk: the peer rank it goes to or comes from, its index among that peer's
#: chunks, its span of the staging space, and its rows ``[row_start, row_end)`` in the gather
#: and scatter legs (the two legs have the same rows, in the same order).
CHUNK_DTYPE = np.dtype(
    [
        ("peer", np.int64),
        ("index", np.int64),
        ("offset", np.int64),
        ("nbytes", np.int64),
        ("row_start", np.int64),
        ("row_end", np.int64),
    ]
)


@attrs.frozen(eq=False, repr=False, getstate_setstate=False)
class Leg(ReadOnlyArrays):
    """One leg of a staged transfer: byte runs like a plan's (``copies()``, ``nbytes``).

    ``name`` is ``"gather"``, ``"bulk"`` or ``"scatter"``. Rows use :data:`COPY_DTYPE`; a
    staging side has region :data:`STAGING` and offsets in the request's staging space; the
    gather leg's "destination" rank is the source rank (its staging area lives there) and the
    scatter leg's "source" rank is the destination rank.
    """

    name: str
    rows: np.ndarray
    map: TransferMap  # the plan's: names the engine sides' buffers (kvplan.simulate uses it)

    def copies(self) -> np.ndarray:
        """The runs as a read-only structured array of :data:`COPY_DTYPE`."""
        return self.rows

    @property
    def nbytes(self) -> int:
        """Total bytes the leg copies."""
        return int(self.rows["length"].sum())

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"Leg({self.name}, runs={len(self)}, nbytes={self.nbytes})"


@attrs.frozen(eq=False, repr=False, getstate_setstate=False)
class Pieces(ReadOnlyArrays):
    """The plan's runs cut at chunk boundaries, in staging order, as plain columns.

    Piece ``i`` is bytes ``[delta[i], delta[i] + length[i])`` of plan row ``index[i]`` (of
    ``rows``, the plan's ``copies()``), and sits at ``stage_offset[i]`` of the staging space.
    ``index`` and ``delta`` are ``None`` when they would be the identity and zeros (a plan
    already in staging order whose runs no chunk boundary cuts: the common case), so that a
    column costs nothing until it is asked for. Both local legs are views of these pieces: the
    executor reads the two columns of its side (:meth:`StagedPlan.side`) instead of the nine of
    a leg's rows (building those took most of :func:`stage`'s time, 10 of 13 ms for 40,960
    runs).
    """

    rows: np.ndarray
    index: np.ndarray | None
    delta: np.ndarray | None
    stage_offset: np.ndarray
    length: np.ndarray

    def column(self, name: str, pieces: slice = slice(None)) -> np.ndarray:
        """Plan column ``name`` for ``pieces`` (all by default); ``*_offset`` columns include
        each piece's delta."""
        col = self.rows[name][pieces] if self.index is None else (
            self.rows[name][self.index[pieces]])
        if self.delta is not None and name.endswith("_offset"):
            col = col + self.delta[pieces]
        return col

    def __len__(self) -> int:
        return len(self.length)


def _leg_rows(p: Pieces, name: str) -> np.ndarray:
    """The gather or scatter leg of ``p`` as :data:`COPY_DTYPE` rows (built on demand)."""
    out = np.empty(len(p), dtype=COPY_DTYPE)
    engine = "src" if name == "gather" else "dst"
    stage_side = "dst" if name == "gather" else "src"
    rank = p.column(f"{engine}_rank")
    for f in ("rank", "region", "buffer", "offset"):
        out[f"{engine}_{f}"] = rank if f == "rank" else p.column(f"{engine}_{f}")
    out[f"{stage_side}_rank"] = rank  # the staging area lives on the engine side's rank
    out[f"{stage_side}_region"] = out[f"{stage_side}_buffer"] = STAGING
    out[f"{stage_side}_offset"] = p.stage_offset
    out["length"] = p.length
    out.flags.writeable = False
    return out


@attrs.frozen(eq=False, repr=False, getstate_setstate=False)
class StagedPlan(ReadOnlyArrays):
    """A plan as gather -> bulk -> scatter through staging areas, in chunks (see module doc).

    ``granule`` (a power of two) divides every offset and length of the gather and scatter legs
    (and ``chunk_bytes``), so the executor may copy whole granules. ``chunks`` is a read-only
    array of :data:`CHUNK_DTYPE`, peer-major; bulk row ``i`` is chunk ``i``. ``pieces`` holds
    both local legs as columns; :attr:`gather` and :attr:`scatter` build their rows from it on
    first use (the executor needs only :meth:`side`).
    """

    plan: TransferPlan
    chunk_bytes: int
    granule: int
    pieces: Pieces
    bulk: Leg
    chunks: np.ndarray
    _legs: dict = attrs.field(factory=dict, init=False)  # built gather / scatter legs

    @property
    def gather(self) -> Leg:
        """The local gather leg: each source rank's runs -> its staging area."""
        return self._local("gather")

    @property
    def scatter(self) -> Leg:
        """The local scatter leg: each destination rank's staging area -> its runs."""
        return self._local("scatter")

    def _local(self, name: str) -> Leg:
        leg = self._legs.get(name)
        if leg is None:
            leg = self._legs[name] = Leg(name, _leg_rows(self.pieces, name), self.plan.map)
        return leg

    def side(self, which: str, pieces: slice = slice(None)
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The engine side ``"src"`` (gather) or ``"dst"`` (scatter) of the local legs, in
        staging order: ``(buffer, offset, length, stage_offset)`` per piece of ``pieces`` (all
        by default; one peer's chunks are one contiguous range of pieces)."""
        if which not in ("src", "dst"):
            raise ValueError(f"side must be 'src' or 'dst', got {which!r}")
        p = self.pieces
        return (p.column(f"{which}_buffer", pieces), p.column(f"{which}_offset", pieces),
                p.length[pieces], p.stage_offset[pieces])

    @property
    def legs(self) -> tuple[Leg, Leg, Leg]:
        """``(gather, bulk, scatter)``."""
        return self.gather, self.bulk, self.scatter

    @property
    def peers(self) -> tuple[int, ...]:
        """The plan's peer ranks, ascending (each has at least one chunk)."""
        return tuple(int(x) for x in np.unique(self.chunks["peer"]))

    @property
    def nbytes(self) -> int:
        """Bytes the plan moves (each leg moves exactly these)."""
        return int(self.chunks["nbytes"].sum())

    def peer_chunks(self, peer: int) -> np.ndarray:
        """The chunks of one peer rank, in order (a read-only view)."""
        return self.chunks[self.chunks["peer"] == peer]

    def __repr__(self) -> str:
        m = self.plan.map
        return (
            f"StagedPlan(mode={m.mode.value}, rank={m.rank}, peers={list(self.peers)}, "
            f"runs={len(self.plan)}, chunks={len(self.chunks)}, chunk_bytes={self.chunk_bytes}, "
            f"nbytes={self.nbytes})"
        )


def _split(start: np.ndarray, length: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``(start, length)`` cut at every multiple of ``chunk``: (source row, delta) per piece,
    or ``(None, None)`` when no row crosses a multiple (every row is one piece).

    Piece ``i`` covers bytes ``[start[row[i]] + delta[i], ...)`` of its row.
    """
    first = start // chunk
    pieces = (start + length - 1) // chunk - first + 1
    if (pieces == 1).all():
        return None, None
    row = np.repeat(np.arange(len(start), dtype=np.int64), pieces)
    j = np.arange(len(row), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    k = first[row] + j
    delta = np.maximum(start[row], k * chunk) - start[row]
    return row, delta


def _ascending(*keys: np.ndarray) -> bool:
    """True when rows are in ascending lexicographic order of ``keys`` (most significant
    first), with no two rows equal in all keys."""
    if len(keys[0]) < 2:
        return True
    gt = np.zeros(len(keys[0]) - 1, dtype=bool)  # decided: strictly greater so far
    eq = np.ones(len(keys[0]) - 1, dtype=bool)  # undecided: equal so far
    for k in keys:
        gt |= eq & (k[1:] > k[:-1])
        eq &= k[1:] == k[:-1]
    return bool(gt.all())


def _granule(chunk: int, *cols: np.ndarray) -> int:
    """The largest power of two dividing ``chunk`` and every value of ``cols``."""
    bits = chunk
    for c in cols:
        if len(c):
            bits |= int(np.bitwise_or.reduce(c))
    return bits & -bits


def stage(plan: TransferPlan, chunk_bytes: int) -> StagedPlan:
    """Derive the three legs of ``plan`` with chunks of at most ``chunk_bytes`` bytes.

    Raises :class:`~kvplan.errors.RequestError` if ``chunk_bytes`` is not a positive integer.
    Post-conditions: the gather and scatter legs have one row per piece of a plan run (a run is
    cut where it crosses a chunk boundary), in the same order, with equal staging offsets and
    lengths; the bulk leg has one row per chunk; each leg moves ``plan.nbytes`` bytes; applying
    the three legs in order writes exactly the bytes the plan writes. Cost: a few numpy passes
    over the plan's length column (about 2 ms for 40,960 runs); the legs' rows are built only
    when asked for.
    """
    if not isinstance(plan, TransferPlan):
        raise RequestError(f"plan must be a TransferPlan, got {type(plan).__name__}")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, (int, np.integer)) or (
        chunk_bytes <= 0
    ):
        raise RequestError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
    chunk = int(chunk_bytes)
    rows = plan.copies()
    pull = plan.map.mode is Mode.PULL
    peer_col = "src_rank" if pull else "dst_rank"
    key = (rows[peer_col], rows["dst_buffer"], rows["dst_offset"])
    # plans come in canonical order already (no sort then); the columns stay views
    order = None if _ascending(*key) else np.lexsort(key[::-1])
    peer = rows[peer_col] if order is None else rows[peer_col][order]
    length = np.ascontiguousarray(rows["length"] if order is None else rows["length"][order])
    # each peer's span: packed runs, starting on a chunk boundary
    starts = np.flatnonzero(np.concatenate(([True], peer[1:] != peer[:-1]))) if len(rows) else (
        np.zeros(0, dtype=np.int64))
    ends = np.append(starts[1:], len(rows))
    csum = np.cumsum(length) - length  # request-wide exclusive sum
    peer_bytes = np.add.reduceat(length, starts) if len(rows) else np.zeros(0, dtype=np.int64)
    peer_chunks = -(-peer_bytes // chunk)
    peer_base = (np.cumsum(peer_chunks) - peer_chunks) * chunk
    seg = np.repeat(np.arange(len(starts)), ends - starts)
    local = csum - csum[starts][seg] if len(rows) else csum  # offset inside the peer's span
    row, delta = _split(local, length, chunk)
    if row is None:  # no run crosses a chunk boundary: pieces are the (ordered) rows
        stage_off = peer_base[seg] + local
        piece_len = length
        index = order
    else:
        piece_local = local[row] + delta
        piece_end = np.minimum(local[row] + length[row], (piece_local // chunk + 1) * chunk)
        piece_len = piece_end - piece_local
        stage_off = peer_base[seg[row]] + piece_local
        index = row if order is None else order[row]
    pieces = Pieces(rows, index, delta, stage_off, piece_len)
    # chunks, peer-major
    n_chunks = int(peer_chunks.sum())
    cpeer_idx = np.repeat(np.arange(len(starts)), peer_chunks)
    cindex = np.arange(n_chunks, dtype=np.int64) - np.repeat(
        np.cumsum(peer_chunks) - peer_chunks, peer_chunks)
    chunks = np.empty(n_chunks, dtype=CHUNK_DTYPE)
    chunks["peer"] = peer[starts][cpeer_idx] if n_chunks else 0
    chunks["index"] = cindex
    chunks["offset"] = peer_base[cpeer_idx] + cindex * chunk
    chunks["nbytes"] = np.minimum(chunk, peer_bytes[cpeer_idx] - cindex * chunk)
    bounds = np.searchsorted(stage_off, chunks["offset"])
    chunks["row_start"] = bounds
    chunks["row_end"] = np.append(bounds[1:], len(stage_off))
    bulk = np.empty(n_chunks, dtype=COPY_DTYPE)
    me = plan.map.rank
    bulk["src_rank"] = chunks["peer"] if pull else me
    bulk["dst_rank"] = me if pull else chunks["peer"]
    bulk["src_region"] = bulk["dst_region"] = STAGING
    bulk["src_buffer"] = bulk["dst_buffer"] = STAGING
    bulk["src_offset"] = bulk["dst_offset"] = chunks["offset"]
    bulk["length"] = chunks["nbytes"]
    granule = _granule(chunk, rows["src_offset"], rows["dst_offset"], length)
    for a in (bulk, chunks, stage_off, piece_len, index, delta):
        if a is not None:
            a.flags.writeable = False
    return StagedPlan(
        plan=plan,
        chunk_bytes=chunk,
        granule=granule,
        pieces=pieces,
        bulk=Leg("bulk", bulk, plan.map),
        chunks=chunks,
    )


# -- choosing direct or staged ----------------------------------------------------------------


@attrs.frozen
class Costs:
    """Per-peer transfer costs, measured at connect (seconds): what the chooser weighs.

    ``per_descriptor``: NIXL's cost of one more descriptor; ``per_byte``: its cost of one more
    byte (1 / bandwidth); ``local_per_byte``: one local gather or scatter pass per byte;
    ``per_chunk``: the fixed cost of one staged chunk (notifications, posting, a few kernel
    launches). All must be >= 0.
    """

    per_descriptor: float
    per_byte: float
    local_per_byte: float
    per_chunk: float

    def __attrs_post_init__(self) -> None:
        for f in attrs.fields(type(self)):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise RequestError(f"Costs.{f.name} must be a finite number >= 0, got {v!r}")


def direct_seconds(runs: int, nbytes: int, costs: Costs) -> float:
    """Predicted time of posting ``runs`` descriptors of ``nbytes`` bytes in total."""
    return runs * costs.per_descriptor + nbytes * costs.per_byte


def staged_seconds(nbytes: int, chunks: int, costs: Costs, *, overlap: bool = False) -> float:
    """Predicted time of a staged transfer: gather + bulk + scatter, or with ``overlap`` (legs
    of consecutive chunks running concurrently, as on a GPU) the slowest leg."""
    bulk = chunks * (costs.per_descriptor + costs.per_chunk) + nbytes * costs.per_byte
    local = nbytes * costs.local_per_byte
    return max(bulk, local) if overlap else bulk + 2 * local


def prefer_staged(runs: int, nbytes: int, chunks: int, costs: Costs, *,
                  overlap: bool = False) -> bool:
    """True when staging is predicted faster than posting the runs directly.

    A plan of at most one run per chunk is never staged (its runs are already as large as
    staging would make them): mergeable plans stay direct.
    """
    if runs <= max(chunks, 1):
        return False
    return staged_seconds(nbytes, chunks, costs, overlap=overlap) < direct_seconds(
        runs, nbytes, costs)


__all__ = [
    "CHUNK_DTYPE",
    "STAGING",
    "Costs",
    "Leg",
    "Pieces",
    "StagedPlan",
    "direct_seconds",
    "prefer_staged",
    "stage",
    "staged_seconds",
]
