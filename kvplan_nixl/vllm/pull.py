"""One request's pull on one decode rank (:class:`Pull`): the state that
:class:`kvplan_nixl.vllm.pulling.Pulls` keeps per request and
:mod:`kvplan_nixl.vllm.pull_digest` reads and fills, in a module of its own so that neither
of those two imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplan_nixl.digest import Digest
    from kvplan_nixl.vllm.scheduler import Load


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
    seen_done: float = 0.0  # monotonic time the read was seen complete (the CONFIRM's start)
    beating: bool = False  # a heartbeat job is running (never two at once)
    asked_until: float = 0.0  # digest: monotonic time the answers are due (0: not asked)
    digests: dict[int, tuple[Digest | None, str]] = field(default_factory=dict)  # answers
    verified: bool = False  # digest: every answer matched (checked once)
    received: Any = None  # digest: a Future of this rank's digests of what it read
