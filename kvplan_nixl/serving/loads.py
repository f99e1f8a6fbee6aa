"""One decode request's load as the scheduler decided it (:class:`Load`): what every worker
rank reads, or waits for, and from whom. The connector's scheduler makes it
(``kvplan_nixl.vllm.scheduler``) and sends it to the workers in its step metadata; the parts
that move it (:mod:`.pulls`, :mod:`.push_io`, :mod:`.control`, :mod:`.restarts`) read it.

A load is a frozen value: its block lists are tuples (a list given is copied into one), and
nothing a worker does changes it; what changes while it moves (posted, seen done, confirmed,
leased) is the pull's (:class:`~kvplan_nixl.serving.pull_state.Pull`) or the push's. A load
that differs from another is a new value (``attrs.evolve``).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from kvplan_nixl.serving.transfer_params import Peer

__all__ = ["Load"]


def _lists(groups: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    """Block lists, one per transfer group, as nested tuples."""
    return tuple(tuple(g) for g in groups)


@attrs.frozen(kw_only=True)
class Load:
    """One decode request's pull (or push to wait for): what the scheduler decided, for every
    worker rank."""

    req_id: str
    remote_req: str
    engine: str
    host: str
    port: int  # the side channel port of the prefill's TP rank 0 (rank r: port + r)
    remote_tp: int
    #: per transfer group, as the prefill handed them
    remote_ids: tuple[tuple[int, ...], ...] = attrs.field(converter=_lists)
    #: block position of each remote list's first element
    remote_first: tuple[int, ...] = attrs.field(converter=tuple)
    #: per transfer group, every block of the request from position 0
    local_ids: tuple[tuple[int, ...], ...] = attrs.field(converter=_lists)
    start: int  # positions decode already holds (a prefix-cache hit)
    end: int  # positions to hold after the pull (the prompt, less the token decode computes)
    parked: bool  # the request waits for this load (False: only release the prefill's blocks)
    generation: int = 0  # the prefill's hold generation (``remote_generation``; 0: none)
    push: bool = False  # the prefill writes (push mode): wait for it instead of reading
    key: str = ""  # push: the transfer key the prefill matches (kvplan_nixl.serving.pushes)
    refused: str = ""  # its params were refused (why): fails at once, nobody contacted
    #: the prefill's connector: ours, or vLLM's NixlConnector
    peer: Peer = attrs.field(default=Peer.KVPLAN,
                             validator=attrs.validators.instance_of(Peer))
    # when the scheduler admitted the request (time.time(): the workers may run elsewhere;
    # 0: unknown): a stock prefill's request admitted before the decode found that prefill
    # restarted is never read from the new instance (kvplan_nixl.serving.restarts)
    admitted: float = 0.0
