"""The executor's typed errors, and the one boundary where NIXL's exceptions are translated.

NIXL raises bare exception classes (``nixlNotFoundError``, ``nixlRemoteDisconnectError``, ...)
with no common base and ``str(e)`` equal to a code such as ``'NIXL_ERR_NOT_FOUND'``. Nothing
outside this module looks at them: :func:`nixl_call` turns a failing call into
:class:`NixlError` naming the operation, and :func:`is_nixl_error` / :func:`nixl_code` let the
transfer state machine record a failed peer. This module does not import nixl.

The lowest layer: it may import nothing of kvplan_nixl.
"""

from __future__ import annotations

import contextlib
import reprlib
from collections.abc import Iterator, Mapping

import numpy as np

from kvplan import KVPlanError, PlanError

__all__ = [
    "ArgumentError",
    "BoundsError",
    "BufferSizeError",
    "BusyError",
    "ClosedError",
    "DeadlinePassed",
    "DigestMismatch",
    "ExecutorError",
    "MetadataError",
    "NixlError",
    "NotConnectedError",
    "ParamsError",
    "PeerTimeout",
    "PlanMismatchError",
    "TransferFailed",
    "TransferTimeout",
]


class ExecutorError(KVPlanError):
    """Root of every error kvplan_nixl raises on purpose (itself a :class:`kvplan.KVPlanError`)."""


class ArgumentError(ExecutorError, ValueError, TypeError):
    """An argument of a public call has the wrong type or an out-of-range value; the message
    names the argument and the value given. A ``ValueError`` and a ``TypeError`` both, so that
    callers catching either of those keep working."""


class BufferSizeError(ExecutorError, ValueError):
    """A buffer handed to an Endpoint does not match its region: wrong size, type or layout."""


class MetadataError(ExecutorError, ValueError):
    """Peer metadata is foreign, corrupt, of another format version, or inconsistent."""


class NotConnectedError(ExecutorError, LookupError):
    """A plan names a peer rank (or engine, or direction) this endpoint never connected."""


class PlanMismatchError(ExecutorError, ValueError):
    """A plan was made for another engine pair, rank or direction than the call implies."""


class BoundsError(ExecutorError, PlanError):
    """A run lies outside the registered bytes of a region (or off its granule); nothing posted.
    A :class:`kvplan.PlanError`: what `kvplan.check_plan` refuses, the executor refuses too."""


class BusyError(ExecutorError, RuntimeError):
    """A call that needs a resource now found none free (``Stager.calibrate`` with every
    staging slot in use); nothing was started: retry once requests finished."""


class ClosedError(ExecutorError, RuntimeError):
    """The endpoint was closed."""


class ParamsError(ExecutorError, ValueError):
    """A request's ``kv_transfer_params`` (chosen by whoever sends the HTTP request: no secret
    protects them) has a field of the wrong type or out of range; ``field`` names it and
    ``value`` is what was given (shortened in the message). The request is failed into
    vLLM's ``kv_load_failure_policy``; the engine is untouched."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        shown = _SHORT.repr(value)  # bounded in length and depth (a client chose it)
        super().__init__(f"kv_transfer_params[{field!r}] = {shown}: {allowed}")


class DeadlinePassed(ExecutorError, TimeoutError):
    """A transfer (or a part of one) was not posted because its deadline had already passed:
    nothing was handed to NIXL, so nothing can land late."""


class PeerTimeout(ExecutorError, TimeoutError):
    """A blocking call that is not a transfer's ``wait`` (``Stager.calibrate``) ran past its
    deadline because a peer stopped answering or progressing; ``peer`` names it (engine and
    rank). What the call had in flight was released."""

    def __init__(self, message: str, peer: str) -> None:
        self.peer = peer
        super().__init__(message)


class NixlError(ExecutorError, RuntimeError):
    """A NIXL call outside a transfer failed; ``op`` is the call, ``code`` NIXL's error code."""

    def __init__(self, op: str, code: str, detail: str = "") -> None:
        self.op = op
        self.code = code
        more = f" ({detail})" if detail else ""
        super().__init__(f"NIXL {op} failed with {code}{more}")


class TransferFailed(ExecutorError, RuntimeError):
    """A transfer ended with some peer ranks failed.

    ``peer_rank`` is the first failed peer, ``peer_ranks`` all of them, ``reasons`` maps each to
    what happened, and ``blocks`` holds, per KV-cache group of the destination engine, the
    destination block ids that may not have arrived (a superset: every block of each group the
    failed peers' runs write to), so that a connector can recompute them.
    """

    def __init__(
        self,
        what: str,
        reasons: Mapping[int, str],
        blocks: tuple[np.ndarray, ...],
    ) -> None:
        self.peer_ranks = tuple(sorted(reasons))
        self.peer_rank = self.peer_ranks[0]
        self.reasons = dict(reasons)
        self.blocks = blocks
        parts = "; ".join(f"rank {r}: {self.reasons[r]}" for r in self.peer_ranks)
        lost = ", ".join(f"group {g} {_ids(b)}" for g, b in enumerate(blocks) if len(b))
        super().__init__(
            f"{what}: peer {parts}; destination blocks that may not have arrived: "
            f"{lost or 'none'}"
        )


class TransferTimeout(TransferFailed, TimeoutError):
    """A transfer's deadline passed first; the unfinished parts were cancelled and released."""


class DigestMismatch(TransferFailed):
    """A transfer completed but the bytes received from some source ranks do not match their
    digest (``kvplan_nixl.digest``): ``reasons`` names each, ``blocks`` every destination
    block of the plan (none of the request's KV is to be used)."""


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 60, 60
_SHORT.maxlist, _SHORT.maxdict = 8, 6


def _ids(a: np.ndarray, limit: int = 16) -> str:
    vals = a.tolist()
    head = " ".join(str(v) for v in vals[:limit])
    return f"[{head}{' ...' if len(vals) > limit else ''}] ({len(vals)} blocks)"


def is_nixl_error(exc: BaseException) -> bool:
    """True for an exception raised by NIXL's bindings (nixl*Error from nixl*._bindings)."""
    t = type(exc)
    return t.__module__.startswith("nixl") and t.__name__.startswith("nixl")


def release_counted(h, live: dict[str, int], kind: str) -> None:
    """Release NIXL handle ``h`` and take it off ``live[kind]`` (an endpoint's or a stager's
    handle counts). A NIXL error leaves the count as it is: NIXL keeps such a handle and frees
    it with its agent, so the count stays honest; any other exception propagates."""
    try:
        h.release()
    except Exception as exc:
        if not is_nixl_error(exc):
            raise
        return
    live[kind] -= 1


def nixl_code(exc: BaseException) -> str:
    """NIXL's error code for ``exc`` (its ``str``, e.g. 'NIXL_ERR_REMOTE_DISCONNECT')."""
    return str(exc) or type(exc).__name__


@contextlib.contextmanager
def nixl_call(op: str, detail: str = "") -> Iterator[None]:
    """Run a NIXL call; a NIXL exception leaves as :class:`NixlError` naming ``op``."""
    try:
        yield
    except Exception as exc:
        if is_nixl_error(exc):
            raise NixlError(op, nixl_code(exc), detail) from exc
        raise
