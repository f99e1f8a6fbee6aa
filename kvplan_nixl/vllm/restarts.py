"""A decode request whose post or read failed because its prefill may have restarted in place
(docs/vllm.md, "Restarts in place"): :class:`Again`, what the worker keeps of the failed
attempt while the prefill is connected afresh, once per request.

A prefill restarted at the same address under the same ``engine_id`` comes back with new NIXL
agents. The decode learns it from the old agents' close notice (the endpoint's
``on_peer_gone``) or, when none came (a stock NixlConnector prefill sends none, a SIGKILLed
one cannot), from the next post or read with them failing. Either way the engine is forgotten
and the request that found it gone is handshaken again and posted once more, but only if the
fresh handshake connected other agents than those the failed attempt read through: the same
agents answering means the prefill did not restart, and the failure stands.

Only a KvplanConnector prefill's request is posted again: its CONFIRM proves the new instance
holds the request (an old instance's generation is refused at once), so a request whose
prefill leg ran on the instance that died is never used. A stock NixlConnector prefill
confirms nothing, and the decode cannot tell whether the new instance holds the block ids the
request names: its request fails (``kv_load_failure_policy``), and only the engine is
forgotten, so that the next request connects afresh.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger

if TYPE_CHECKING:
    from kvplan_nixl.serving.handshakes import HandshakeState
    from kvplan_nixl.vllm.rank import Rank
    from kvplan_nixl.vllm.scheduler import Load

__all__ = ["Again", "Restarts"]

logger = init_logger("vllm.kvplan_nixl")


@dataclass(frozen=True)
class Again:
    """A load's failed attempt: ``why`` it failed, the prefill ``peers`` (ranks) it read and
    the engine's ``agents`` it failed with (empty: its peer had gone)."""

    why: str
    peers: tuple[int, ...] = ()
    agents: tuple[str, ...] = ()

    def replaced(self, agents: tuple[str, ...]) -> bool:
        """Whether the engine's ``agents`` now are a new incarnation: none of the failed
        attempt's agents is among them (always, when that attempt read through none)."""
        return not set(self.agents) & set(agents)


class Restarts:
    """One decode rank's prefills restarted in place (see the module docstring): what it
    forgets when a peer goes, and the loads connecting afresh after a failed attempt
    (``again``, by request id, kept until the request is reported: once each). Called under
    the rank's lock."""

    def __init__(self, rank: Rank) -> None:
        self.w = rank
        self.again: dict[str, Again] = {}

    def forget(self, engine: str) -> None:
        """Forget what is known of prefill ``engine`` (its handshakes, its pull map): the next
        request naming it connects afresh. Its pin stays (a stock prefill's address)."""
        w = self.w
        w.hs.forget(engine)
        w.nixl.forget(engine)
        w.engines.pop(engine, None)

    def gone(self, engine: str, rank: int, why: str) -> None:
        """The endpoint's ``on_peer_gone`` (a peer's close notice, inside a progress): a
        prefill, or a push-mode decode, that stopped or restarted is connected afresh by the
        next request naming it."""
        logger.info("kvplan: engine %s rank %d went (%s): the next request naming it "
                    "connects afresh", engine, rank, why)
        self.forget(engine)
        if self.w.writes is not None:  # a push-mode decode: its prefill's handshake with it
            self.w.writes.hs.forget(engine)

    def connect_again(self, load: Load, error: BaseException, peers: tuple[int, ...],
                      deadline: float | None = None) -> bool:
        """``load``'s post or read failed (``error``; ``peers``: the prefill ranks it read):
        forget its engine and, the first time for this load, wait for a fresh handshake, then
        post again (:meth:`settle`); True then. False (the caller fails it): it failed this
        way before, it is a push, its prefill is a stock one (the module docstring), or it
        ran out of time (a restarted prefill refuses at once; a slow or stopped one would
        only cost the request another handshake's wait)."""
        w = self.w
        why = f"{type(error).__name__}: {error}"
        agents = self.agents(load.engine)  # what it failed with (none: its peer had gone)
        self.forget(load.engine)
        if load.push or load.peer != "kvplan" or load.req_id in self.again \
                or isinstance(error, TimeoutError):
            self.again.pop(load.req_id, None)
            return False
        self.again[load.req_id] = Again(why, peers, agents)
        w.waiting[load.req_id] = (load, deadline or time.monotonic() + w.timeout)
        # (not the "pull req=... from ... failed" line: the request has not failed yet)
        logger.warning("kvplan: pull req=%s from %s: %s; connecting the prefill afresh and "
                       "posting once more (it may have restarted in place)", load.req_id,
                       load.engine, why)
        return True

    def settle(self, load: Load, st: HandshakeState,
               dialled: str) -> tuple[str, tuple[int, ...]] | None:
        """``load``'s handshake ended (``st``): None to post it, or why it fails and the
        prefill ranks whose holds to end. A load connecting afresh fails if the handshake
        did, or if it found the agents its failed attempt read through (no restart)."""
        again = self.again.get(load.req_id)
        was, peers = (f"{again.why}; then ", again.peers) if again is not None else ("", ())
        if st.failed:
            self.again.pop(load.req_id, None)
            return f"{was}handshake failed: {st.reason}{dialled}", peers
        if again is not None and not again.replaced(self.agents(load.engine)):
            self.again.pop(load.req_id, None)
            return (f"{again.why} (a fresh handshake found the same prefill agents: not a "
                    "restart)", peers)
        return None  # posted (again): its entry stays until it is reported, so never twice

    def reported(self, req_ids: set[str]) -> None:
        """These requests were reported to vLLM (loaded or failed): forget their attempts."""
        for r in req_ids & self.again.keys():
            del self.again[r]

    def agents(self, engine: str) -> tuple[str, ...]:
        """The NIXL agents ``engine``'s connected ranks are read through."""
        return tuple(p.agent for p in self.w.ep.peers() if p.engine == engine)
