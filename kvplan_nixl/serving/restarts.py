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

**Stale stock requests** (issue 45, gap d). Nothing in a stock prefill's params says which
instance answered its prefill leg, so a request whose leg ran on the instance that died, read
after the new one is connected, would read whatever the new instance keeps in those blocks:
another request's KV, used unconfirmed. So once a fresh handshake connects *other* agents than
those a failed read or post of that engine used (a restart, not a request naming bad blocks:
the same agents answering clear the suspicion), the time of that failure is kept per engine
(``gone_at``; the latest such failure), and a stock request the scheduler admitted before it
fails by name, alone, before its handshake or post (:meth:`Restarts.stale`); the new
connection is not touched. A leg the old instance answered ran before that failure was seen,
and a front sends the decode leg right after the prefill leg's answer, so such requests are
admitted before it and caught; a genuine request admitted between the new instance starting and
the failure being seen is refused too (recomputed: a cost, never a wrong read). Not caught: a
decode leg sent long after its prefill leg's answer (after the failure was seen), an engine the
decode had never read from before it restarted (no old agents to compare), and requests whose
admission time is unknown (``Load.admitted`` 0).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvplan_nixl.serving.transfer_params import Peer

if TYPE_CHECKING:
    from kvplan_nixl.serving.handshakes import HandshakeState
    from kvplan_nixl.serving.loads import Load
    from kvplan_nixl.serving.rank import Rank

__all__ = ["Again", "Restarts"]

logger = logging.getLogger(__name__)


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
        # stock prefills: when a read or post with these agents failed (a restart, if a fresh
        # handshake connects others), and when one was found restarted (the docstring)
        self.suspect: dict[str, tuple[float, tuple[str, ...]]] = {}
        self.gone_at: dict[str, float] = {}  # (not ``gone``: the endpoint's hook below)

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
        if load.peer is Peer.NIXL and agents:  # the latest failure with these agents: a leg
            # admitted before it may have run on them even if an earlier failure was no restart
            self.suspect.pop(load.engine, None)
            _bounded(self.suspect)
            self.suspect[load.engine] = (time.time(), agents)
        if load.push or load.peer is not Peer.KVPLAN or load.req_id in self.again \
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
        if load.peer is Peer.NIXL:
            self._settle_suspect(load.engine)
            stale = self.stale(load)
            if stale is not None:
                return stale, ()
        if again is not None and not again.replaced(self.agents(load.engine)):
            self.again.pop(load.req_id, None)
            return (f"{again.why} (a fresh handshake found the same prefill agents: not a "
                    "restart)", peers)
        return None  # posted (again): its entry stays until it is reported, so never twice

    def _settle_suspect(self, engine: str) -> None:
        """A stock ``engine`` is connected again after a failed read or post: other agents
        than that attempt's mean it restarted (its failure's time kept in ``gone_at``), the
        same ones that it did not."""
        failed = self.suspect.get(engine)
        now = self.agents(engine)
        if failed is None or not now:
            return
        del self.suspect[engine]
        if not set(failed[1]) & set(now):
            _bounded(self.gone_at)
            self.gone_at[engine] = failed[0]
            logger.warning("kvplan: NixlConnector prefill %s restarted in place (new agents): "
                           "its requests admitted before %.3f (when a read from its old "
                           "instance failed) fail, never read from the new one", engine,
                           failed[0])

    def stale(self, load: Load) -> str | None:
        """Why stock ``load`` must not be read (its prefill leg may have run on an instance of
        its prefill that was found gone after the request was admitted), or None."""
        gone = self.gone_at.get(load.engine)
        if load.peer is not Peer.NIXL or gone is None or not 0 < load.admitted < gone:
            return None
        return (f"StaleStockRequest: NixlConnector prefill {load.engine!r} restarted in place; "
                f"a read from its old instance failed {gone - load.admitted:.3f} s after this "
                "request was admitted, so its prefill leg may have run on the instance that "
                "died, and the new one may hold other KV in the block ids it names (a stock "
                "prefill confirms nothing); not read")

    def reported(self, req_ids: set[str]) -> None:
        """These requests were reported to vLLM (loaded or failed): forget their attempts."""
        for r in req_ids & self.again.keys():
            del self.again[r]

    def agents(self, engine: str) -> tuple[str, ...]:
        """The NIXL agents ``engine``'s connected ranks are read through."""
        return tuple(p.agent for p in self.w.ep.peers() if p.engine == engine)


def _bounded(table: dict[str, object], most: int = 1024) -> None:
    """Make room for one entry: the oldest dropped past ``most`` (a request may name engines
    without end)."""
    while len(table) >= most:
        del table[next(iter(table))]
