"""Envelope: every message of the notification channel, sealed and opened in one place.

NIXL reports whatever agent name a sender gives itself, and any agent that read a published
metadata blob can notify its endpoint without connecting. So every message an endpoint sends
(hello, close, the staged ``kvs1`` messages, the user's ``notify`` of a transfer or request)
leaves through :meth:`Envelope.seal`, and every message it receives passes
:meth:`Envelope.open` before anything acts on it:

- from an agent that is not *known* (a connected peer, or an initiator whose hello was verified)
  only a hello is accepted, everything else is dropped (counted ``unknown``);
- with a secret, a message is ``MAGIC | counter (u64, big-endian) | tag (16 bytes) | message``,
  ``tag`` the first 16 bytes of HMAC-SHA256 under a key derived from the secret, the sender's
  and the receiver's agent names, over the counter and the message (compared in constant time).
  Anything else is dropped (``unsigned``, ``forged``). The counter is the sender's, strictly
  increasing over the sender endpoint's life (nanoseconds of its clock, at least the last + 1);
  a receiver refuses a counter it has seen or one below its window (``replayed``): it keeps the
  last :data:`WINDOW` counters of each sender (notifications attached to transfers arrive out of
  order with the others), and when a sender is unloaded (disconnect, close, restart) it keeps only
  the highest, so nothing of an older connection is accepted again. Agent names carry a random
  nonce per endpoint, so a message bound to one endpoint pair is refused by every other.

Without a secret nothing is sealed and only the known-sender rule applies (see
docs/executor.md, "Trust boundary"). It knows no message kind but the hello prefix it is given,
holds no peer state but the replay windows, and may not import the endpoint or any protocol.
"""

from __future__ import annotations

import collections
import heapq
import hmac
import struct
import time
from collections.abc import Callable

__all__ = ["MAGIC", "RETAINED", "TAG_BYTES", "WINDOW", "Envelope"]

#: First bytes of a sealed message.
MAGIC = b"\x00kvm"
#: Bytes of the truncated HMAC-SHA256 tag (128 bits).
TAG_BYTES = 16
_HEAD = struct.Struct(f">4sQ{TAG_BYTES}s")
#: Counters of one sender remembered (a message overtaken by more is refused as a replay).
WINDOW = 4096
#: Senders whose replay window is remembered (the oldest is forgotten beyond).
RETAINED = 65536
_KDF = b"kvplan_nixl message key\x00"


class _Window:
    """The counters seen from one sender: all above ``floor`` are in ``seen``."""

    __slots__ = ("floor", "heap", "seen")

    def __init__(self) -> None:
        self.floor = 0
        self.seen: set[int] = set()
        self.heap: list[int] = []

    def accept(self, c: int) -> bool:
        if c <= self.floor or c in self.seen:
            return False
        self.seen.add(c)
        heapq.heappush(self.heap, c)
        if len(self.heap) > WINDOW:
            self.floor = heapq.heappop(self.heap)
            self.seen.discard(self.floor)
        return True

    def retire(self) -> None:
        """The connection ended: nothing at or below the highest counter seen is accepted."""
        if self.seen:
            self.floor = max(self.floor, max(self.seen))
        self.seen.clear()
        self.heap.clear()


class Envelope:
    """Seals what agent ``agent_name`` sends and opens what it receives (see the module doc).

    ``known(name)``: whether agent ``name`` is a connected peer or a verified initiator;
    ``hello``: the prefix of the one message an unknown agent may send; ``foreign(name)``:
    whether agent ``name`` belongs to another connector, which reads messages as sent (they
    leave it unsealed: the protocol it speaks has no seal).
    """

    def __init__(self, agent_name: str, secret: bytes | None, known: Callable[[str], bool],
                 hello: bytes, foreign: Callable[[str], bool] = lambda name: False) -> None:
        self.agent_name, self.secret = agent_name, secret
        self._known, self._hello, self._foreign = known, hello, foreign
        self._last = 0
        self._keys: dict[tuple[str, str], bytes] = {}
        self._windows: collections.OrderedDict[str, _Window] = collections.OrderedDict()
        #: messages dropped, by why: from an agent not known, unsealed under a secret, a tag
        #: that does not verify, a counter seen before
        self.dropped = {"unknown": 0, "unsigned": 0, "forged": 0, "replayed": 0}

    def seal(self, receiver: str, msg: bytes) -> bytes:
        """``msg`` as it goes to agent ``receiver`` (unchanged without a secret or to a foreign
        agent; an empty message stays empty: NIXL sends no notification then)."""
        if self.secret is None or not msg or self._foreign(receiver):
            return msg
        c = self._last = max(self._last + 1, time.time_ns())
        return _HEAD.pack(MAGIC, c, self._tag(self.agent_name, receiver, c, msg)) + msg

    def open(self, sender: str, wire: bytes) -> bytes | None:
        """The message agent ``sender`` sent, or None (dropped and counted)."""
        secret = self.secret
        body = wire if secret is None else wire[_HEAD.size:]
        if not self._known(sender) and not body.startswith(self._hello):
            self.dropped["unknown"] += 1  # checked first: costs nothing, whatever the size
            return None
        if secret is None:
            return wire
        if len(wire) < _HEAD.size or not wire.startswith(MAGIC):
            self.dropped["unsigned"] += 1
            return None
        _, c, tag = _HEAD.unpack_from(wire)
        if not hmac.compare_digest(tag, self._tag(sender, self.agent_name, c, body)):
            self.dropped["forged"] += 1
            return None
        win = self._windows.get(sender)
        if win is None:
            win = self._windows[sender] = _Window()
            if len(self._windows) > RETAINED:
                self._windows.popitem(last=False)
        if not win.accept(c):
            self.dropped["replayed"] += 1
            return None
        return body

    def retire(self, agent: str) -> None:
        """Agent ``agent`` was unloaded: what it sent before is never accepted again, and its
        message keys are forgotten."""
        win = self._windows.get(agent)
        if win is not None:
            win.retire()
        for key in [k for k in self._keys if agent in k]:
            del self._keys[key]

    def _tag(self, sender: str, receiver: str, c: int, msg: bytes) -> bytes:
        key = self._keys.get((sender, receiver))
        if key is None:
            assert self.secret is not None
            key = hmac.digest(self.secret, _KDF + f"{sender}\x00{receiver}".encode(), "sha256")
            if len(self._keys) > 4 * WINDOW:  # keys are cheap to derive again
                self._keys.clear()
            self._keys[(sender, receiver)] = key
        # hmac.digest: OpenSSL's one-shot HMAC, a few microseconds for a message of a chunk
        return hmac.digest(key, c.to_bytes(8, "big") + msg, "sha256")[:TAG_BYTES]
