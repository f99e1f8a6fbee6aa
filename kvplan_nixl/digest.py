"""Transfer digest: a checksum of exactly the bytes a plan copies between two ranks.

Opt-in integrity check of a transfer (``kv_connector_extra_config["digest"]`` in the vLLM
connector; docs/executor.md, "Transfer digest"). The source rank computes it over the bytes its
runs read, the destination rank over the bytes it received, both over the runs of their rank
pair in destination-address order (:func:`kvplan.pairs.pair_runs`), so both read one byte
stream however their plans cut it into runs. Equal digests: the bytes arrived as they left.

The checksum is Fletcher-style over the stream ``b_0 .. b_{n-1}`` modulo the prime
``P = 2**31 - 1``: ``A = sum(b_k) mod P``, ``B = sum(k * b_k) mod P``, and ``n``. It catches
every change of one byte, every pair of changed bytes less than ``P`` bytes apart, every swap of
two different bytes, a missing or extra byte (``n``), and a random corruption with probability
about ``1 - 2**-62``. It is an integrity check, not a MAC: anyone who can change the bytes can
also make the digests agree, so it guards against faults (a NIC, a driver, a bug that writes the
wrong blocks), never against an attacker. It checks only the bytes the plan copies.

Why this sum: it vectorises. The stream is gathered (numpy fancy indexing of the runs' aligned
elements, no Python loop per run) a chunk at a time and viewed as rows of :data:`ROW` bytes:
with ``k = row * ROW + column``, ``sum(k * b_k)`` is ``ROW * sum(row * rowsum) +
sum(column * columnsum)``, two uint32 reductions (exact: no sum reaches ``2**32``) and two
small dot products in int64, reduced modulo ``P`` per chunk. Host memory only (DRAM):
a buffer in VRAM is refused.

Bottom layer, beside buffers.py: it imports the core and buffers/errors, no NIXL.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvplan import EngineSpec, TransferPlan
from kvplan.pairs import pair_runs
from kvplan_nixl.buffers import declared_memory, resolve_buffers
from kvplan_nixl.errors import (
    ArgumentError,
    BoundsError,
    BufferSizeError,
    DigestMismatch,
    PlanMismatchError,
)

#: The checksum's prime modulus (a Mersenne prime: sums stay far inside int64).
MODULUS = (1 << 31) - 1
#: Bytes per row: a chunk is summed along its rows and its columns (uint32 sums, exact).
ROW = 4096
#: Bytes gathered at once (bounds the copy the gather makes).
CHUNK = 16 << 20
#: Largest element the gather indexes by (a power of two dividing ROW: so is its gcd with
#: the runs).
MAX_ELEMENT = ROW

_COLUMN = np.arange(ROW, dtype=np.int64)


@dataclass(frozen=True)
class Digest:
    """The digest of one byte stream: its length ``nbytes`` and the two sums ``a``, ``b``."""

    nbytes: int
    a: int
    b: int

    def hex(self) -> str:
        """``"NBYTES-AAAAAAAABBBBBBBB"`` (hex), the form messages carry."""
        return f"{self.nbytes:x}-{self.a:08x}{self.b:08x}"

    @classmethod
    def from_hex(cls, text: Any) -> Digest:
        """Parse :meth:`hex`'s form; :class:`ArgumentError` naming the value otherwise."""
        try:
            n, ab = text.split("-")
            if len(ab) != 16 or len(n) > 16:
                raise ValueError
            d = cls(int(n, 16), int(ab[:8], 16), int(ab[8:], 16))
        except (AttributeError, ValueError):
            raise ArgumentError(f"a digest must be 'NBYTES-' and 16 hex digits (Digest.hex), "
                                f"got {text!r:.80}") from None
        if d.a >= MODULUS or d.b >= MODULUS:
            raise ArgumentError(f"a digest's sums are below 2**31 - 1, got {text!r:.80}")
        return d


def checksum(memory: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> Digest:
    """The digest of the runs ``memory[starts[i] : starts[i] + lengths[i]]``, concatenated in
    the given order (``memory``: a one-dimensional uint8 array; the runs inside it)."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    total = int(lengths.sum())
    if total == 0:
        return Digest(0, 0, 0)
    # gather by the largest element every run is aligned to: fewer indices than bytes
    g = int(np.gcd.reduce(np.concatenate((starts, lengths, [MAX_ELEMENT]))))
    elems = memory[: len(memory) - len(memory) % g].reshape(-1, g)
    first, count = starts // g, lengths // g
    ends = np.cumsum(count)
    per_chunk = CHUNK // g  # a multiple of ROW bytes: g divides MAX_ELEMENT = ROW
    a = b = 0
    pos = 0  # stream position of the chunk's first byte (a multiple of ROW)
    for e0 in range(0, int(ends[-1]), per_chunk):  # one pass per CHUNK bytes, not per run
        k = np.arange(e0, min(e0 + per_chunk, int(ends[-1])), dtype=np.int64)
        run = np.searchsorted(ends, k, side="right")
        stream = elems[first[run] + k - (ends[run] - count[run])].reshape(-1)
        pad = -len(stream) % ROW
        if pad:  # the stream's last chunk: zeros add nothing to either sum
            stream = np.concatenate((stream, np.zeros(pad, np.uint8)))
        rows = stream.reshape(-1, ROW)
        s0 = rows.sum(axis=1, dtype=np.uint32).astype(np.int64)  # each < 255 * ROW
        cols = rows.sum(axis=0, dtype=np.uint32).astype(np.int64)  # each < 255 * rows
        sa = int(s0.sum())
        # sum of k * b_k over the chunk, k = pos + ROW * row + column
        sb = pos * sa + ROW * int(s0 @ np.arange(len(s0))) + int(cols @ _COLUMN)
        a, b = (a + sa) % MODULUS, (b + sb) % MODULUS
        pos += len(stream)
    return Digest(total, a, b)


def _host_bytes(lo: int, hi: int) -> np.ndarray:
    """A uint8 view of host memory ``[lo, hi)`` (read only where a run lies)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * (hi - lo)).from_address(lo))


class Digester:
    """Digests of one rank's side of plans, over the buffers it registered.

    ``buffers`` and ``memory`` as for :class:`kvplan_nixl.Endpoint` (the same mapping the rank
    registers); every buffer must be host memory (DRAM), else :class:`BufferSizeError`.
    """

    def __init__(self, spec: EngineSpec, rank: int, buffers: Sequence[Any] | Mapping[str, Any],
                 memory: Mapping[str, str] | None = None) -> None:
        self.spec, self.rank = spec, rank
        allocs = resolve_buffers(spec, rank, buffers,
                                 declared_memory(spec, memory, ("DRAM", "VRAM")))
        vram = [spec.buffers[i] for i, (_, (_, _, _, mem)) in allocs.items() if mem == "VRAM"]
        if vram:
            raise BufferSizeError(f"transfer digest: buffer {vram[0]!r} is in VRAM; the digest "
                                  "reads host memory (DRAM) only")
        self.bases = np.zeros(len(spec.buffers), dtype=np.int64)
        self.sizes = np.zeros(len(spec.buffers), dtype=np.int64)  # 0: a buffer not held here
        self._held = [buf for buf, _ in allocs.values()]  # alive while the addresses are used
        for i, (_, (addr, nbytes, _, _)) in allocs.items():
            self.bases[i], self.sizes[i] = addr, nbytes

    def digests(self, plan: TransferPlan, side: str) -> dict[int, Digest]:
        """Per peer rank, the digest of this rank's side of ``plan``: ``side="src"`` reads the
        bytes this rank's runs send (this rank is their source), ``"dst"`` the bytes its runs
        received. Works for a plan of either mode (a push plan's source, a pull plan's
        destination)."""
        if side not in ("src", "dst"):
            raise ArgumentError(f"side must be 'src' or 'dst', got {side!r}")
        other = "dst" if side == "src" else "src"
        if getattr(plan.map, side) != self.spec:
            raise PlanMismatchError(f"transfer digest: the plan's {side} engine is not the one "
                                    "this Digester was built for")
        rows = plan.copies()
        peers = np.unique(rows[f"{other}_rank"][rows[f"{side}_rank"] == self.rank])
        out = {}
        for p in peers.tolist():  # per peer rank: a handful, never per run
            pair = (self.rank, p) if side == "src" else (p, self.rank)
            runs = pair_runs(plan, *pair)
            buf, off, n = runs[f"{side}_buffer"], runs[f"{side}_offset"], runs["length"]
            out_of = (off < 0) | (n < 0) | (off + n > self.sizes[buf])
            if out_of.any():  # never read memory this rank did not hand over
                k = int(np.flatnonzero(out_of)[0])
                raise BoundsError(f"transfer digest: run {k} of rank pair {pair} ({side} buffer "
                                  f"{self.spec.buffers[buf[k]]!r}, offset {int(off[k])}, length "
                                  f"{int(n[k])}) is outside the {int(self.sizes[buf[k]])} "
                                  f"bytes rank {self.rank} holds")
            addr = self.bases[buf] + off
            lo, hi = int(addr.min()), int((addr + runs["length"]).max())
            out[p] = checksum(_host_bytes(lo, hi), addr - lo, runs["length"])
        return out

    def verify(self, plan: TransferPlan, expected: Mapping[int, Digest | str],
               got: Mapping[int, Digest] | None = None) -> None:
        """Check the bytes this rank received by ``plan`` (its destination side) against each
        source rank's digest in ``expected`` (a :class:`Digest` or its hex); raise
        :class:`DigestMismatch` naming every rank that differs or sent none. ``got``: this
        rank's ``digests(plan, "dst")`` if already computed (None: computed now)."""
        got = self.digests(plan, "dst") if got is None else got
        reasons = {}
        for p, mine in got.items():
            theirs = expected.get(p)
            if theirs is None:
                reasons[p] = "sent no digest"
                continue
            if isinstance(theirs, str):
                theirs = Digest.from_hex(theirs)
            if theirs != mine:
                reasons[p] = (f"digest mismatch: source {theirs.hex()}, received "
                              f"{mine.hex()}")
        if reasons:
            m = plan.map
            raise DigestMismatch(f"{m.mode.value} plan, destination rank {self.rank}: the "
                                 "bytes received differ from the source's",
                                 reasons, tuple(np.asarray(b) for b in plan.dst_blocks))
