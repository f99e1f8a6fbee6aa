"""Push mode of ``KvplanConnector`` (:mod:`kvplan_nixl.vllm`), the part that performs no I/O
(docs/vllm.md, "Push mode"): the words the two engines exchange, how a decode request is
matched with its prefill, and a prefill rank's table of sends waiting for registrations and
registrations waiting for sends.

The flow, as vLLM 0.32's push connector orders it (``nixl/push_scheduler.py``): the proxy
sends the request to the decode first; the decode allocates its blocks and its TP rank 0
sends a ``REGISTER`` (its blocks, the positions it lacks, where to reach it) to every rank of
the prefill engine named in the request's params. The prefill computes the prompt; each of its
ranks matches the finished request with the registration by their :func:`transfer_key`,
plans with its push map (kvplan's pull map transposed) and posts one WRITE that carries a
``PUSHED`` notification, which NIXL delivers to each decode rank after that rank's bytes. A
decode rank's request proceeds once every prefill rank its pull map names said ``PUSHED``;
a ``PUSHFAIL`` or its deadline hands the request to vLLM's ``kv_load_failure_policy``.

Never a late write: a registration is valid until ``ttl`` seconds after the decode sent it
(its ``sent`` time against the prefill's wall clock, and never longer than ``ttl`` from its
arrival), and a write is posted only inside that window with a NIXL deadline at its end; the
decode gives up no earlier than ``ttl`` plus a grace after it sent the registration, so its
blocks are never freed (or reused) while a write into them may still land. What this assumes:
the prefill's wall clock is not behind the decode's by more than the grace, and the prefill's
progress loop enforces a deadline within the grace (it polls every few milliseconds).

Nothing here imports vLLM or NIXL, so every rule is tested on its own (tests/test_pushes.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["MAX_MESSAGE", "MAX_UNSEEN", "PUSHED", "PUSHFAIL", "REGISTER", "EarlyAnswers",
           "Match", "PushSend", "Pusher", "Registration", "block_ids", "parse_done",
           "push_done", "transfer_key"]

#: First bytes of the three push messages (NIXL notifications, sealed by the endpoint).
REGISTER = b"kvplan-push-register "
PUSHED = b"kvplan-push-done "
PUSHFAIL = b"kvplan-push-fail "

# the "-<8 hex>" suffix vLLM's input processor appends to a request id
# (``assign_request_id``; ``get_base_request_id`` in kv_connector/v1/nixl/utils.py)
_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)

#: Longest transfer key accepted (a key is echoed in logs and messages).
MAX_KEY = 256

#: Longest push message parsed (bytes): a registration of 2**18 block ids fits; a longer one
#: is dropped unread.
MAX_MESSAGE = 4 << 20

#: Block ids are below 2**31 (vLLM's block tables are int32).
MAX_BLOCK_ID = (1 << 31) - 1


def block_ids(g: Any) -> list[int] | None:
    """``g`` as a list of block ids (ints in [0, 2**31)), or None if it is not one: any other
    type, nesting or range is refused, never raised. No Python loop per block."""
    if not isinstance(g, (list, tuple)):
        return None
    if not g:
        return []
    if not set(map(type, g)) <= {int}:  # no bool, float, str or list among them (map: in C)
        return None
    try:
        a = np.array(g, dtype=np.int64)
    except OverflowError:
        return None
    if a.min() < 0 or a.max() > MAX_BLOCK_ID:
        return None
    return a.tolist()


def group_lists(lists: Any, what: str) -> tuple[tuple[int, ...], ...]:
    """``lists`` of a message (one list of block ids per KV-cache group, at most 64 groups)
    checked with :func:`block_ids`; a ValueError naming ``what`` otherwise."""
    checked = [block_ids(g) if isinstance(g, list) else None
               for g in (lists if isinstance(lists, list) and len(lists) <= 64 else [0])]
    if any(g is None for g in checked):
        raise ValueError(f"{what}: lists must be lists of block ids (ints 0 to "
                         f"{MAX_BLOCK_ID}), one per KV-cache group")
    return tuple(tuple(g) for g in checked)


def message_body(message: bytes, prefix: bytes, what: str) -> dict[str, Any]:
    """The JSON object after ``prefix``; ValueError naming what is wrong. Bounded: a message
    over :data:`MAX_MESSAGE` bytes is not parsed, and nesting too deep for the parser (a
    ``RecursionError``) is a ValueError like any other malformed body."""
    if len(message) > MAX_MESSAGE:
        raise ValueError(f"{what} of {len(message)} bytes, above {MAX_MESSAGE}")
    try:
        d = json.loads(message[len(prefix):])
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{what} is not JSON: {type(e).__name__}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{what} is not an object")
    return d


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63


def transfer_key(request_id: str, params: Mapping[str, Any]) -> str | None:
    """What pairs a decode request with its prefill request: ``params["transfer_id"]`` when
    the proxy sets one in both legs' ``kv_transfer_params``, else the request id without
    vLLM's random suffix (vLLM's push proxy sends both legs under one request id). None when
    it is empty or longer than :data:`MAX_KEY` characters (such a request cannot push)."""
    tid = params.get("transfer_id")
    key = str(tid) if tid is not None else _SUFFIX.sub("", str(request_id))
    return key if 0 < len(key) <= MAX_KEY else None


@dataclass(frozen=True)
class Registration:
    """A decode request's blocks, registered with the prefill before it computes.

    ``lists`` are the decode's blocks per transfer group from position 0 (as
    ``KVCacheBlocks.get_block_ids()`` gives them), ``[start, end)`` the positions it lacks,
    ``engine``/``host``/``port``/``tp`` where its ranks serve their metadata (``port`` is rank
    0's), ``ttl`` how long the registration is valid after it was sent, ``sent`` when the
    decode sent it (its wall clock, ``time.time()``).
    """

    key: str
    decode_req: str
    engine: str
    host: str
    port: int
    tp: int
    lists: tuple[tuple[int, ...], ...]
    start: int
    end: int
    ttl: float
    sent: float

    def encode(self) -> bytes:
        d = {k: getattr(self, k) for k in ("key", "decode_req", "engine", "host", "port", "tp",
                                           "start", "end", "ttl", "sent")}
        d["lists"] = [list(g) for g in self.lists]
        return REGISTER + json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, message: bytes) -> Registration:
        """The registration in ``message``; ValueError naming what is wrong."""
        if not message.startswith(REGISTER):
            raise ValueError("not a push registration")
        d = message_body(message, REGISTER, "push registration")
        strs = {k: d.get(k) for k in ("key", "decode_req", "engine", "host")}
        ints = {k: d.get(k) for k in ("port", "tp", "start", "end")}
        lists, ttl, sent = d.get("lists"), d.get("ttl"), d.get("sent")
        if not all(isinstance(v, str) and 0 < len(v) <= MAX_KEY for v in strs.values()):
            raise ValueError(f"push registration: bad names {strs}")
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_BLOCK_ID
                   for v in ints.values()) or not 0 < ints["port"] < 65536 \
                or not 1 <= ints["tp"] <= 128 or ints["port"] + ints["tp"] > 65536 \
                or ints["start"] > ints["end"]:
            raise ValueError(f"push registration: bad numbers {ints}")
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0 < ttl < 1e6:
            raise ValueError(f"push registration: bad ttl {ttl!r}")
        if not isinstance(sent, (int, float)) or isinstance(sent, bool) or not 0 < sent < 1e11:
            raise ValueError(f"push registration: bad sent time {sent!r}")
        return cls(lists=group_lists(lists, "push registration"), ttl=float(ttl),
                   sent=float(sent), **strs, **ints)


def push_done(prefix: bytes, decode_req: str, nbytes: Mapping[int, int] | None = None,
              runs: Mapping[int, int] | None = None, why: str = "") -> bytes:
    """A ``PUSHED`` (``prefix=PUSHED``: the write's notification) or ``PUSHFAIL`` message;
    ``nbytes`` and ``runs`` per decode rank written."""
    body = {"decode_req": decode_req, "why": why[:500],
            "bytes": {str(r): int(n) for r, n in (nbytes or {}).items()},
            "runs": {str(r): int(n) for r, n in (runs or {}).items()}}
    return prefix + json.dumps(body, separators=(",", ":")).encode()


def parse_done(message: bytes) -> tuple[bool, dict[str, Any]] | None:
    """(True for PUSHED / False for PUSHFAIL, its fields), or None for any other message;
    ValueError naming what is wrong for a malformed one (``decode_req`` a string, ``bytes``
    and ``runs`` maps of decode rank to counts, ``why`` a string)."""
    for prefix, ok in ((PUSHED, True), (PUSHFAIL, False)):
        if message.startswith(prefix):
            d = message_body(message, prefix, "push answer")
            req, why = d.get("decode_req"), d.get("why", "")
            if not isinstance(req, str) or not 0 < len(req) <= 4 * MAX_KEY \
                    or not isinstance(why, str):
                raise ValueError(f"push answer: bad decode_req {req!r:.80} or why")
            for k in ("bytes", "runs"):
                m = d.get(k)
                if not isinstance(m, dict) or len(m) > 1024 or not all(
                        isinstance(r, str) and r.isascii() and r.isdigit() and len(r) <= 4
                        and _count(n) for r, n in m.items()):
                    raise ValueError(f"push answer: {k} must map decode ranks to counts")
            return ok, d
    return None


@dataclass(frozen=True)
class PushSend:
    """A finished prefill request to push: its hold's generation and its block lists as it
    would hand them to a pulling decode (``TransferGroups.handed``)."""

    req_id: str
    generation: int
    key: str
    ids: tuple[tuple[int, ...], ...]
    first: tuple[int, ...]


@dataclass(frozen=True)
class Match:
    """A send and its registration: write ``send``'s blocks into ``reg``'s by ``valid_until``
    (this rank's monotonic clock)."""

    send: PushSend
    reg: Registration
    valid_until: float


@dataclass
class Pusher:
    """A prefill rank's push table: sends that wait for their registration (until their hold's
    lease ends) and registrations that wait for their send (until they are no longer valid).
    Each :meth:`add_send` / :meth:`add_registration` returns the match it completed, if any;
    each key is matched once.

    A key is a pairing only while one request of each side holds it. Two registrations of one
    key waiting at once (two decode requests under one key: clients reusing ``X-Request-Id``
    with no ``transfer_id``), or two sends, cannot be told apart, so neither is matched: both
    go to :attr:`refused` (the caller answers a registration with PUSHFAIL and ends a send's
    hold), and the key stays refused until the later of their windows ends, so that the other
    side's request of that key is refused too instead of being paired with either."""

    sends: dict[str, tuple[PushSend, float]] = field(default_factory=dict)
    regs: dict[str, tuple[Registration, float]] = field(default_factory=dict)
    collided: dict[str, float] = field(default_factory=dict)  # key -> refused until
    refused: list[tuple[Registration | PushSend, str]] = field(default_factory=list)

    def _refused(self, key: str, item: Registration | PushSend, now: float) -> bool:
        until = self.collided.get(key)
        if until is None or until <= now:
            return False
        self.refused.append((item, f"transfer key {key!r} is used by more than one request "
                                   "at once: none of them is paired"))
        return True

    def _collide(self, key: str, until: float, now: float, *items: Any) -> None:
        self.collided[key] = max(until, self.collided.get(key, now))
        for item in items:
            self._refused(key, item, now)

    def add_send(self, send: PushSend, now: float, lease: float) -> Match | None:
        if self._refused(send.key, send, now):
            return None
        other = self.sends.get(send.key)
        if other is not None and other[1] > now:  # two prefill requests of one key
            del self.sends[send.key]
            self._collide(send.key, now + lease, now, other[0], send)
            return None
        got = self.regs.pop(send.key, None)
        if got is not None and got[1] > now:
            return Match(send, got[0], got[1])
        self.sends[send.key] = (send, now + lease)
        return None

    def registration(self, key: str, now: float) -> Registration | None:
        """The registration of ``key`` waiting for its send, if still valid (not taken)."""
        got = self.regs.get(key)
        return got[0] if got is not None and got[1] > now else None

    def add_registration(self, reg: Registration, now: float, age: float) -> Match | None:
        """``age``: how long ago the decode sent ``reg`` by the wall clocks (this host's
        ``time.time()`` less ``reg.sent``). The window ends ``ttl`` after the send, clipped
        to at most ``ttl`` after now: a registration delayed in transit or in a stalled
        progress loop gets a shorter window, never a longer one, so that it closes before the
        decode gives up as long as this host's clock is not behind the decode's by more than
        the decode's grace."""
        until = now + reg.ttl - max(0.0, age)
        if until <= now:  # dead on arrival: never matched
            return None
        if self._refused(reg.key, reg, now):
            return None
        other = self.regs.get(reg.key)
        if other is not None and other[1] > now:
            if (other[0].engine, other[0].decode_req) == (reg.engine, reg.decode_req):
                return None  # the same request again: its first registration stands
            del self.regs[reg.key]  # two decode requests of one key: neither is paired
            self._collide(reg.key, max(until, other[1]), now, other[0], reg)
            return None
        got = self.sends.pop(reg.key, None)
        if got is not None:
            return Match(got[0], reg, until)
        self.regs[reg.key] = (reg, until)
        return None

    def expire(self, now: float) -> tuple[list[PushSend], list[Registration]]:
        """Drop what waited too long: sends whose lease ended (the hold frees their blocks)
        and registrations no longer valid (their decode recomputes); forget refused keys
        whose windows ended."""
        sends = [k for k, (_, t) in self.sends.items() if t <= now]
        regs = [k for k, (_, t) in self.regs.items() if t <= now]
        for k in [k for k, t in self.collided.items() if t <= now]:
            del self.collided[k]
        return ([self.sends.pop(k)[0] for k in sends], [self.regs.pop(k)[0] for k in regs])


#: Early answers kept per prefill engine for decode requests a rank has not seen yet.
MAX_UNSEEN = 64


@dataclass
class EarlyAnswers:
    """PUSHED / PUSHFAIL messages that reached a decode rank before the request waits there
    (its own handshake with the prefill is slower than rank 0's, which registered it).

    The policy (docs/vllm.md, "Push mode"): an answer counts only from the engine the request
    names, early or not. One for a request this rank knows (its load waits for its handshake:
    ``named`` is the engine its params name) is kept if it comes from that engine: bounded by
    the requests admitted. One for a request this rank has not seen yet is kept only up to
    :data:`MAX_UNSEEN` per sending engine; when that engine's share is full the new one is
    dropped, so junk from one engine never displaces another engine's answers, nor an answer
    already kept. Every answer expires ``ttl`` seconds after it arrived (the longest a
    genuine one can precede its request: the decode's push deadline)."""

    ttl: float
    table: dict[str, dict[int, tuple[str, bool, dict[str, Any], float, bool]]] = field(
        default_factory=dict)

    def keep(self, req: str, engine: str, rank: int, ok: bool, fields: dict[str, Any],
             now: float, named: str | None) -> bool:
        """Keep the answer of prefill ``engine``'s ``rank`` for decode request ``req``;
        ``named``: the engine the request names if this rank knows it (None: unseen). False
        when it is dropped."""
        if named is not None and named != engine:
            return False
        if named is None and sum(1 for per in self.table.values() for e, *_, known
                                 in per.values() if e == engine and not known) >= MAX_UNSEEN:
            return False
        self.table.setdefault(req, {})[rank] = (engine, ok, fields, now, named is not None)
        return True

    def take(self, req: str, engine: str) -> list[tuple[int, bool, dict[str, Any]]]:
        """The answers kept for ``req`` from ``engine`` (those from another engine dropped)."""
        return [(r, ok, f) for r, (e, ok, f, _, _) in self.table.pop(req, {}).items()
                if e == engine]

    def expire(self, now: float) -> int:
        """Drop answers older than ``ttl``; how many were dropped."""
        dropped = 0
        for req in list(self.table):
            per = self.table[req]
            old = [r for r, v in per.items() if now - v[3] >= self.ttl]
            for r in old:
                del per[r]
            dropped += len(old)
            if not per:
                del self.table[req]
        return dropped
