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

__all__ = ["PUSHED", "PUSHFAIL", "REGISTER", "Match", "PushSend", "Pusher", "Registration",
           "parse_done", "push_done", "transfer_key"]

#: First bytes of the three push messages (NIXL notifications, sealed by the endpoint).
REGISTER = b"kvplan-push-register "
PUSHED = b"kvplan-push-done "
PUSHFAIL = b"kvplan-push-fail "

# the "-<8 hex>" suffix vLLM's input processor appends to a request id
# (``assign_request_id``; ``get_base_request_id`` in kv_connector/v1/nixl/utils.py)
_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)

#: Longest transfer key accepted (a key is echoed in logs and messages).
MAX_KEY = 256


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
        try:
            d = json.loads(message[len(REGISTER):])
        except ValueError as e:
            raise ValueError(f"push registration is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("push registration is not an object")
        strs = {k: d.get(k) for k in ("key", "decode_req", "engine", "host")}
        ints = {k: d.get(k) for k in ("port", "tp", "start", "end")}
        lists, ttl, sent = d.get("lists"), d.get("ttl"), d.get("sent")
        if not all(isinstance(v, str) and 0 < len(v) <= MAX_KEY for v in strs.values()):
            raise ValueError(f"push registration: bad names {strs}")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                   for v in ints.values()) or not 0 < ints["port"] < 65536 \
                or ints["tp"] < 1 or ints["start"] > ints["end"]:
            raise ValueError(f"push registration: bad numbers {ints}")
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0 < ttl < 1e6:
            raise ValueError(f"push registration: bad ttl {ttl!r}")
        if not isinstance(sent, (int, float)) or isinstance(sent, bool) or not 0 < sent < 1e11:
            raise ValueError(f"push registration: bad sent time {sent!r}")
        if not isinstance(lists, list) or not all(
                isinstance(g, list) and all(isinstance(b, int) and not isinstance(b, bool)
                                            for b in g) for g in lists):
            raise ValueError("push registration: lists must be lists of block ids")
        return cls(lists=tuple(tuple(g) for g in lists), ttl=float(ttl), sent=float(sent),
                   **strs, **ints)


def push_done(prefix: bytes, decode_req: str, nbytes: Mapping[int, int] | None = None,
              runs: Mapping[int, int] | None = None, why: str = "") -> bytes:
    """A ``PUSHED`` (``prefix=PUSHED``: the write's notification) or ``PUSHFAIL`` message;
    ``nbytes`` and ``runs`` per decode rank written."""
    body = {"decode_req": decode_req, "why": why[:500],
            "bytes": {str(r): int(n) for r, n in (nbytes or {}).items()},
            "runs": {str(r): int(n) for r, n in (runs or {}).items()}}
    return prefix + json.dumps(body, separators=(",", ":")).encode()


def parse_done(message: bytes) -> tuple[bool, dict[str, Any]] | None:
    """(True for PUSHED / False for PUSHFAIL, its fields), or None for any other message or a
    malformed one."""
    for prefix, ok in ((PUSHED, True), (PUSHFAIL, False)):
        if message.startswith(prefix):
            try:
                d = json.loads(message[len(prefix):])
            except ValueError:
                return None
            if isinstance(d, dict) and isinstance(d.get("decode_req"), str) \
                    and isinstance(d.get("bytes"), dict) and isinstance(d.get("runs"), dict):
                return ok, d
            return None
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
    each key is matched once."""

    sends: dict[str, tuple[PushSend, float]] = field(default_factory=dict)
    regs: dict[str, tuple[Registration, float]] = field(default_factory=dict)

    def add_send(self, send: PushSend, now: float, lease: float) -> Match | None:
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
        got = self.sends.pop(reg.key, None)
        if got is not None:
            return Match(got[0], reg, until)
        self.regs[reg.key] = (reg, until)
        return None

    def expire(self, now: float) -> tuple[list[PushSend], list[Registration]]:
        """Drop what waited too long: sends whose lease ended (the hold frees their blocks)
        and registrations no longer valid (their decode recomputes)."""
        sends = [k for k, (_, t) in self.sends.items() if t <= now]
        regs = [k for k, (_, t) in self.regs.items() if t <= now]
        return ([self.sends.pop(k)[0] for k in sends], [self.regs.pop(k)[0] for k in regs])
