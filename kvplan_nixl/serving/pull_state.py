"""One request's pull on one decode rank (:class:`Pull`): the state that
:class:`kvplan_nixl.serving.pulls.Pulls` keeps per request and
:mod:`kvplan_nixl.serving.pull_digest_io` reads and fills, in a module of its own so that neither
of those two imports the other for it; and what its LEASEs proved (:class:`Lease`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplan_nixl.digest import Digest
    from kvplan_nixl.serving.loads import Load


class LeaseState(enum.Enum):
    """Where a pull's LEASEs stand (docs/vllm.md, "Reporting inside a lease")."""

    NONE = "none"  # not asked: leases off, a NixlConnector prefill, or one that lacks LEASE
    ASKING = "asking"  # sent to the prefill ranks read; the answers are not all in
    HELD = "held"  # every rank read answered yes: see Lease.until
    REFUSED = "refused"  # a rank did not: the pull waits for its CONFIRM, as without leases


@dataclass(frozen=True)
class Lease:
    """What a pull's LEASEs proved, as one value: the pool thread that asks them replaces it
    whole (one assignment), and the progress thread reads it whole, so neither sees half of
    an answer.

    ``until`` (HELD; this rank's monotonic clock): a read seen complete before it was read
    from blocks the prefill held throughout, so the pull is reported at once and its CONFIRM
    (a RETURN) follows, awaited by nothing. ``granted``: the prefill ranks that pinned the
    hold, which get RETURN rather than CONFIRM (so that their pins end at once). ``answered``:
    when the last answer came (the timeline's ``confirmed`` mark of a pull reported inside
    its lease). ``why`` (REFUSED): the answer that refused it."""

    state: LeaseState
    until: float = 0.0
    granted: frozenset[int] = frozenset()
    answered: float = 0.0
    why: str = ""


#: The lease of a pull that asked none.
NO_LEASE = Lease(LeaseState.NONE)
#: The lease of a pull whose LEASEs are on their way.
ASKING = Lease(LeaseState.ASKING)


class LeaseSlot:
    """Where a pull's :class:`Lease` is kept: made before the read is posted (the LEASEs go
    out first), filled by the LEASE job with one complete value."""

    __slots__ = ("value",)

    def __init__(self, value: Lease = NO_LEASE) -> None:
        self.value = value


@dataclass
class Pull:
    """One request's pull on this decode rank, from posting until it is reported."""

    load: Load
    t: Any  # kvplan_nixl.Transfer
    counts: list[int]  # decode ranks reading each prefill rank (CONFIRM's readers)
    peers: tuple[int, ...]  # the prefill ranks this rank reads
    post_s: float
    runs: int
    descriptors: int
    next_beat: float
    admitted: float = 0.0  # the timeline (stats.MARKS, monotonic): the worker got the load,
    started: float = 0.0  # started planning it (its prefill connected),
    posted: float = 0.0  # Endpoint.read returned
    confirming: bool = False
    seen_done: float = 0.0  # monotonic time, taken after a poll saw the read complete
    beating: bool = False  # a heartbeat job is running (never two at once)
    asked_until: float = 0.0  # digest: monotonic time the answers are due (0: not asked)
    digests: dict[int, tuple[Digest | None, str]] = field(default_factory=dict)  # answers
    verified: bool = False  # digest: every answer matched (checked once)
    received: Any = None  # digest: a Future of this rank's digests of what it read
    lease: LeaseSlot = field(default_factory=LeaseSlot)  # what its LEASEs proved
