"""Reserved prefixes of the notification channel: bytes no user message may start with.

Owns the prefixes of the protocols layered on an endpoint's notifications -- :data:`CTRL`, the
endpoints' control notices (hello, close: :mod:`~kvplan_nixl.handshake`), and :data:`STAGED`,
the staged executor's ``kvs1`` messages (:mod:`kvplan_nixl.staged.protocol` takes its tag from
here) -- and what an endpoint does with a staged message that nobody on it serves (it has no
``Stager``, or closed it): such a message never reaches ``notifications()``, and an ``OPEN`` is
answered at once with a ``FAIL`` (:func:`unserved_answer`, in the staged protocol's format, so
that the initiator fails now, naming this endpoint, instead of at its deadline). A user's
``notify`` starting with a reserved prefix is refused when posted (:func:`is_reserved`). It
parses nothing but an OPEN's request id, and imports nothing of the executor.
"""

from __future__ import annotations

__all__ = ["CTRL", "STAGED", "is_reserved", "unserved_answer"]

#: First bytes of the control notices endpoints exchange (hello, close).
CTRL = b"\x00kvplan_nixl\x00"
#: First bytes (the tag) of every staged protocol message.
STAGED = b"kvs1 "
#: Longest request id echoed back in a FAIL (ids are small counters; a longer one is forged).
_RID_LIMIT = 32


def is_reserved(message: bytes) -> bool:
    """True when ``message`` starts with a prefix a layered protocol owns."""
    return message.startswith(CTRL) or message.startswith(STAGED)


def unserved_answer(message: bytes, who: str) -> bytes | None:
    """The FAIL answering a staged ``OPEN`` that endpoint ``who`` cannot serve (None for any
    other message: nothing to answer, it is dropped). The request id is echoed only when it is
    a short run of letters and digits (what the initiator sends), so nothing else read from
    the wire is sent back."""
    if not message.startswith(STAGED + b"OPEN "):
        return None
    head = message[len(STAGED):].split(b"\n", 1)[0].split(b" ")
    rid = head[1] if len(head) > 1 else b""
    if not 0 < len(rid) <= _RID_LIMIT or not rid.isalnum() or not rid.isascii():
        return None
    why = f"{who} serves no staged request (it has no Stager, or closed it)"
    return STAGED + b"FAIL " + rid + b" " + why.encode()
