"""The staged protocol's messages: the one place that creates and parses them.

Every staged message is a NIXL notification ``kvs1 OP field field...`` with an optional body
after a newline (the OPEN's block ids and the user's notify). This module owns the byte format
only: :func:`encode` / :func:`decode` for every message, :func:`open_messages` /
:func:`decode_open` for the OPEN (whose fields must agree with its body), and the pool
descriptions of ACK and POOL. It decides nothing about a request and holds no state; it may not
import the rest of the staged executor. A message that does not parse raises ``ValueError``,
``IndexError`` or :class:`Refuse` (the caller answers with a FAIL or ABORT). Nothing parsed from
the wire is trusted for resources: counts, sizes and pool fields are bounded here, before any
list or array is built from them. Authentication is not here: every message is sealed and
opened by the endpoint's envelope (:mod:`kvplan_nixl.envelope`) before it reaches the Stager.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from kvplan import Mode
from kvplan_nixl.reserved import STAGED

__all__ = ["PROBE_S", "TAG", "Message", "Open", "PoolInfo", "Refuse", "decode", "decode_open",
           "encode", "open_messages"]

#: Protocol tag: the first five bytes of every staged message (reserved on every endpoint,
#: Stager or not: :mod:`kvplan_nixl.reserved`).
TAG = STAGED
#: Seconds either side of a request may go without hearing from the other before it sends a
#: ``PING`` (answered by nothing). A peer whose process died had its sockets closed by its
#: kernel: NIXL reports it disconnected, the probe cannot leave, and the request fails at
#: once instead of at its deadline (a stopped peer or a cut link accepts the probe: those
#: still end at the deadline, as direct transfers do).
PROBE_S = 0.25
#: Most block id lists an OPEN may carry per side (a spec has at most 1024 regions).
MAX_LISTS = 1024
#: Pool fields an ACK or POOL may carry: addresses in 64 bits, sizes below 2**61 bytes.
_ADDR_LIMIT, _SIZE_LIMIT = 1 << 64, 1 << 61


class Refuse(Exception):
    """An OPEN this server cannot serve; its text goes back in a FAIL."""


def encode(*fields: object, body: bytes = b"") -> bytes:
    """``kvs1 f0 f1 ...`` (+ ``\\n`` + body)."""
    return TAG + " ".join(str(f) for f in fields).encode() + (b"\n" + body if body else b"")


@attrs.frozen
class Message:
    """A parsed message: its operation, its fields after the operation, its body."""

    op: str
    fields: tuple[str, ...]
    body: bytes

    @property
    def rid(self) -> str:
        """The request id (or the calibration nonce) every message but a bare one carries."""
        return self.fields[0]

    def int(self, i: int) -> int:
        """Field ``i`` (after the operation) as an int (``ValueError``/``IndexError`` if not)."""
        return int(self.fields[i])

    def text(self, i: int) -> str:
        """Fields from ``i`` on, joined: a reason."""
        return " ".join(self.fields[i:])


def decode(msg: bytes) -> Message:
    """Split a message (starting with :data:`TAG`) into operation, fields and body."""
    head, _, body = msg[len(TAG):].partition(b"\n")
    f = head.decode(errors="replace").split(" ")
    return Message(f[0], tuple(f[1:]), body)


@attrs.frozen
class PoolInfo:
    """Where a Stager's registered pool is (ACK and POOL carry it)."""

    addr: int
    nbytes: int
    slot_bytes: int
    device: int
    mem: str

    def encode(self, op: str, rid: str) -> bytes:
        """``op rid addr nbytes slot_bytes device mem``."""
        return encode(op, rid, self.addr, self.nbytes, self.slot_bytes, self.device, self.mem)

    @classmethod
    def decode(cls, m: Message) -> PoolInfo:
        """The pool an ACK or POOL message describes (``ValueError`` for fields out of
        bounds: an address past 64 bits, a size that is not a positive multiple of a positive
        slot size, a negative device, a memory type other than DRAM or VRAM)."""
        info = cls(m.int(1), m.int(2), m.int(3), m.int(4), m.fields[5])
        if not (0 < info.addr and info.addr + info.nbytes <= _ADDR_LIMIT
                and 0 < info.slot_bytes <= info.nbytes < _SIZE_LIMIT
                and info.nbytes % info.slot_bytes == 0 and 0 <= info.device < 1 << 31
                and info.mem in ("DRAM", "VRAM")):
            raise ValueError(f"pool fields out of bounds: {info}")
        return info


@attrs.frozen
class Open:
    """A parsed OPEN: what the initiator asks the server to serve."""

    rid: str
    mode: Mode  # the initiator's
    slot_bytes: int
    timeout_ms: int  # 0: none given
    nbytes: int  # this peer's bytes, as the initiator planned them
    nchunks: int
    src_blocks: list[list[int]]
    dst_blocks: list[list[int]]
    notify: bytes


def open_messages(rid: str, mode: Mode, slot_bytes: int, timeout_ms: int,
                  per_peer: Mapping[int, int], src_blocks: Sequence[np.ndarray],
                  dst_blocks: Sequence[np.ndarray], notify: bytes) -> dict[int, bytes]:
    """One OPEN per peer rank (``per_peer``: its bytes): fields, then one length per block id
    list and the notify's length; the body is the block ids (little-endian int64) then the
    notify. The body is built once for every peer."""
    body = np.concatenate([*src_blocks, *dst_blocks]).astype("<i8").tobytes() + notify
    lens = [len(b) for b in src_blocks] + [len(b) for b in dst_blocks]
    return {r: encode("OPEN", rid, mode.value, slot_bytes, timeout_ms, n, -(-n // slot_bytes),
                      len(src_blocks), len(dst_blocks), *lens, len(notify), body=body)
            for r, n in per_peer.items()}


def decode_open(m: Message) -> Open:
    """Parse an OPEN; :class:`Refuse` (or ``ValueError``) when its parts do not agree."""
    f, body = m.fields, m.body
    mode = Mode(f[1])
    chunk, tmo, nbytes, nchunks, ng, ngd = (int(x) for x in f[2:8])
    # then one length per block id list, then the length of the user's notify, which follows
    # the block ids in the body
    if not (0 <= ng <= MAX_LISTS and 0 <= ngd <= MAX_LISTS) or len(f) != 9 + ng + ngd:
        raise Refuse(f"OPEN has {len(f) + 1} fields for {ng} + {ngd} block id lists")
    if chunk <= 0 or tmo < 0 or nbytes < 0 or nchunks < 0:
        raise Refuse(f"OPEN fields out of bounds: slot {chunk}, timeout {tmo} ms, "
                     f"{nbytes} bytes, {nchunks} chunks")
    lens = [int(x) for x in f[8:8 + ng + ngd]]
    nnote = int(f[-1])
    if not 0 <= nnote <= len(body):
        raise Refuse(f"notify of {nnote} bytes in a body of {len(body)}")
    note = body[len(body) - nnote:]
    body = body[:len(body) - nnote]
    if len(body) % 8:
        raise Refuse(f"block ids of {len(body)} bytes, not a multiple of 8")
    ids = np.frombuffer(body, dtype="<i8")
    if len(ids) != sum(lens) or min(lens, default=0) < 0:
        raise Refuse(f"block id lists malformed: {len(ids)} ids for lengths {lens}")
    cuts = np.cumsum([0, *lens])
    lists = [ids[a:b].tolist() for a, b in itertools.pairwise(cuts)]
    return Open(m.rid, mode, chunk, tmo, nbytes, nchunks, lists[:ng], lists[ng:], note)
