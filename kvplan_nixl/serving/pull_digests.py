"""The words of the transfer digest in pull mode (``kv_connector_extra_config["digest"]``;
docs/vllm.md, "Transfer digest"), the part that performs no I/O.

A decode rank whose read of a request completed asks each prefill rank it read, before its
CONFIRM (so while the prefill still holds the blocks), for the digest of exactly the bytes it
read from that rank: a ``DIGASK`` NIXL notification that carries what the prefill needs to plan
the request itself and nothing it must trust about runs: the prefill's request and hold
generation, the decode's block lists and token span, and where the decode's ranks serve their
metadata (the prefill connects the decode as a push would, verified). The decode rank is the
notification's sender (the envelope names it). The prefill plans with its own handed lists
(never the decode's copy of them), digests its side and answers ``DIGEST`` with the digest, or
with why it cannot (the digest off there, the hold gone, lists it cannot plan).

Nothing here imports vLLM or NIXL (tests/test_pull_digests.py checks every rule).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvplan_nixl.digest import Digest
from kvplan_nixl.serving.pushes import MAX_BLOCK_ID, MAX_KEY, group_lists, message_body

__all__ = ["DIGASK", "DIGEST", "DigestAsk", "digest_answer", "parse_answer"]

#: First bytes of a decode rank's question and of a prefill rank's answer (NIXL
#: notifications, sealed by the endpoint).
DIGASK = b"kvplan-pull-digest-ask "
DIGEST = b"kvplan-pull-digest "


@dataclass(frozen=True)
class DigestAsk:
    """A decode rank's question: the digest of what it read of prefill request ``req`` held
    under ``generation``, for decode request ``decode_req`` whose blocks per transfer group are
    ``lists`` (from position 0) and which read positions ``[start, end)``; ``host`` / ``port``:
    where the decode's rank 0 serves its metadata (its rank r at ``port + r``)."""

    req: str
    generation: int
    decode_req: str
    host: str
    port: int
    lists: tuple[tuple[int, ...], ...]
    start: int
    end: int

    def encode(self) -> bytes:
        d = {k: getattr(self, k) for k in ("req", "generation", "decode_req", "host", "port",
                                           "start", "end")}
        d["lists"] = [list(g) for g in self.lists]
        return DIGASK + json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, message: bytes) -> DigestAsk:
        """The question in ``message``; ValueError naming what is wrong (the bounds are a push
        registration's: :data:`kvplan_nixl.serving.pushes.MAX_MESSAGE`, block ids, 64 lists)."""
        if not message.startswith(DIGASK):
            raise ValueError("not a pull digest question")
        d = message_body(message, DIGASK, "pull digest question")
        strs = {k: d.get(k) for k in ("req", "decode_req", "host")}
        ints = {k: d.get(k) for k in ("port", "start", "end")}
        gen, lists = d.get("generation"), d.get("lists")
        if not all(isinstance(v, str) and 0 < len(v) <= 4 * MAX_KEY for v in strs.values()):
            raise ValueError(f"pull digest question: bad names {strs}")
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_BLOCK_ID
                   for v in ints.values()) or not 0 < ints["port"] < 65536 \
                or ints["start"] > ints["end"]:
            raise ValueError(f"pull digest question: bad numbers {ints}")
        if not isinstance(gen, int) or isinstance(gen, bool) or not 0 < gen < 1 << 63:
            raise ValueError(f"pull digest question: bad generation {gen!r}")
        return cls(lists=group_lists(lists, "pull digest question"), generation=gen, **strs,
                   **ints)


def digest_answer(decode_req: str, digest: Digest | None, why: str = "") -> bytes:
    """A prefill rank's ``DIGEST`` answer: ``digest`` of the bytes the asking decode rank read
    from it, or None and ``why`` it cannot say."""
    body = {"decode_req": decode_req, "digest": None if digest is None else digest.hex(),
            "why": why[:500]}
    return DIGEST + json.dumps(body, separators=(",", ":")).encode()


def parse_answer(message: bytes) -> tuple[str, Digest | None, str] | None:
    """``(decode_req, digest or None, why)`` of a ``DIGEST`` answer, None for any other
    message; ValueError naming what is wrong for one whose request cannot be read. A malformed
    digest of a readable request is its refusal (``why`` names it): the request fails now."""
    if not message.startswith(DIGEST):
        return None
    d = message_body(message, DIGEST, "pull digest answer")
    req, digest, why = d.get("decode_req"), d.get("digest"), d.get("why", "")
    if not isinstance(req, str) or not 0 < len(req) <= 4 * MAX_KEY or not isinstance(why, str):
        raise ValueError(f"pull digest answer: bad decode_req {req!r:.80} or why")
    if digest is None:
        return req, None, why[:500] or "no reason given"
    try:
        return req, Digest.from_hex(digest), ""
    except ValueError as e:
        return req, None, f"a malformed digest: {e}"
