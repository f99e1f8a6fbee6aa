"""Peers: the connected peer ranks of one Endpoint and the remote agents it loaded.

Owns per-peer state and its teardown: which (engine, rank) is connected through which agent,
which remote agents NIXL has loaded (peers, and initiators that said hello), loading and
unloading them, and :meth:`PeerTable.drop`, the one way a peer goes (disconnect, restart, its
close notice, our close). What else holds per-peer state registers a *drop listener* and
releases it there (the routes' lists, the transfers in flight); what is held per remote *agent*
(a staged pool's list, the envelope's replay window) registers an *unload listener*, called
whenever an agent is unloaded (a peer dropped, an initiator that said hello gone). It decides
nothing about trust (``handshake`` does) and may not import the endpoint, routes or posting.

NIXL 1.5.1 keeps two sockets open per ``remove_remote_agent`` of a live agent until the agent
is destroyed, so a peer that is disconnected (alive) is *parked*: forgotten here, its lists and
state released, but left loaded in NIXL; connecting the same agent with the same NIXL metadata
again takes it back without ``add_remote_agent``. At most :data:`PARKED` agents stay parked
(the oldest is removed beyond, leaking its two sockets); ``close`` removes them all.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import attrs

from kvplan import EngineSpec
from kvplan_nixl import metadata as md
from kvplan_nixl.errors import MetadataError, NixlError, nixl_call
from kvplan_nixl.handles import Handles

__all__ = ["PARKED", "Peer", "PeerTable"]

#: Disconnected agents kept loaded in NIXL for a reconnect (see the module doc).
PARKED = 8

#: ``listener(peer, why, errors)``: release what is held for ``peer`` (append failures)
DropListener = Callable[["Peer", str, list[BaseException]], None]
#: ``listener(agent_name)``: release what is held for that remote agent (before NIXL forgets it)
UnloadListener = Callable[[str], None]


@attrs.frozen
class Peer:
    """A connected peer rank, as :meth:`Endpoint.connect` returns it."""

    engine: str
    rank: int
    agent: str
    spec: EngineSpec = attrs.field(repr=False)


class PeerTable:
    """Connected peers by (engine, rank) and loaded remote agents by name."""

    def __init__(self, handles: Handles) -> None:
        self.handles = handles
        self.peers: dict[tuple[str, int], Peer] = {}
        self.loaded: dict[str, tuple[str, int]] = {}  # remote agents loaded: peers, listeners
        #: loaded agents whose hello verified: they hold a route to this endpoint, so they stay
        #: loaded (and known to the envelope) when our own route to them is disconnected
        self.hellos: set[str] = set()
        #: loaded agents of another connector (:meth:`Endpoint.connect_foreign`): they speak
        #: NIXL only, so they get no hello or close notice and messages to them go unsealed
        self.foreign: set[str] = set()
        self._listeners: list[DropListener] = []
        self._unload_listeners: list[UnloadListener] = []
        #: agents disconnected but still loaded in NIXL: name -> their NIXL metadata
        self.parked: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._nixl_md: dict[str, bytes] = {}  # loaded agents: their NIXL metadata (to park)

    def on_drop(self, listener: DropListener) -> None:
        """Call ``listener`` whenever a peer is dropped, before its agent is unloaded."""
        self._listeners.append(listener)

    def on_unload(self, listener: UnloadListener) -> None:
        """Call ``listener(name)`` whenever remote agent ``name`` is unloaded, before NIXL
        removes it."""
        self._unload_listeners.append(listener)

    def off_drop(self, listener: DropListener) -> None:
        """Stop calling drop ``listener`` (its owner closed)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def off_unload(self, listener: UnloadListener) -> None:
        """Stop calling ``listener`` (its owner closed)."""
        if listener in self._unload_listeners:
            self._unload_listeners.remove(listener)

    def sorted(self) -> tuple[Peer, ...]:
        """The connected peers, ordered by (engine, rank)."""
        return tuple(self.peers[k] for k in sorted(self.peers))

    def load(self, agent: Any, info: md.PeerInfo, who: str) -> None:
        """Load a peer's NIXL metadata; on any failure nothing of it stays loaded."""
        parked = self.parked.pop(info.agent, None)
        if parked == info.agent_metadata:  # a parked agent, unchanged: NIXL still has it
            self.handles.live["remote_agents"] += 1
            self.loaded[info.agent] = (info.engine, info.rank)
            self._nixl_md[info.agent] = parked
            return
        if parked is not None:  # the same name with other NIXL metadata: load it afresh
            self._remove(agent, info.agent, quiet=True)
        try:
            with nixl_call("add_remote_agent", who):
                loaded = agent.add_remote_agent(info.agent_metadata)
        except NixlError as exc:  # NIXL may keep a half-loaded agent: remove it by name
            self.unload(agent, info.agent, quiet=True, counted=False)
            raise MetadataError(f"metadata of {who}: NIXL refused its agent metadata "
                                f"({exc.code})") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self.handles.live["remote_agents"] += 1
        self.loaded[loaded] = (info.engine, info.rank)
        self._nixl_md[loaded] = info.agent_metadata
        if loaded != info.agent:  # cannot happen once the prefix was checked; kept as a guard
            self.unload(agent, loaded, quiet=True)
            raise MetadataError(
                f"metadata names agent {info.agent!r} but carries NIXL metadata of {loaded!r}"
            )

    def unload(self, agent: Any, name: str, *, quiet: bool = False,
               counted: bool = True, park: bool = False) -> None:
        """Remove a loaded remote agent (``quiet``: a NIXL refusal is ignored); ``park``: keep
        it loaded in NIXL for a reconnect instead (see the module doc)."""
        self.loaded.pop(name, None)
        self.hellos.discard(name)
        self.foreign.discard(name)
        nixl_md = self._nixl_md.pop(name, None)
        for listener in list(self._unload_listeners):
            listener(name)
        if park and nixl_md is not None:
            if counted:
                self.handles.live["remote_agents"] -= 1
            self.parked[name] = nixl_md
            while len(self.parked) > PARKED:
                self._remove(agent, self.parked.popitem(last=False)[0], quiet=True)
            return
        if self._remove(agent, name, quiet) and counted:
            self.handles.live["remote_agents"] -= 1

    def _remove(self, agent: Any, name: str, quiet: bool) -> bool:
        """``remove_remote_agent``; False when NIXL refused and ``quiet``."""
        try:
            with nixl_call("remove_remote_agent", name):
                agent.remove_remote_agent(name)
        except NixlError:
            if not quiet:
                raise
            return False
        return True

    def drop(self, agent: Any, peer: Peer, why: str = "disconnected",
             park: bool = False) -> None:
        """Forget ``peer``: every listener releases what it holds for it, then its agent is
        unloaded (``park``: kept loaded in NIXL, a live peer disconnected: see the module doc).
        A peer disconnected (``park``) whose hello verified keeps its agent loaded: its own
        route to this endpoint still lives (its notifications, its staged requests), and goes
        only with its close notice, a restart or our close. Raises the first failure once
        everything was attempted."""
        errors: list[BaseException] = []
        for listener in list(self._listeners):
            listener(peer, why, errors)
        del self.peers[(peer.engine, peer.rank)]
        if park and peer.agent in self.hellos:
            if errors:
                raise errors[0]
            return
        try:
            self.unload(agent, peer.agent, park=park)
        except Exception as exc:
            errors.append(exc)
        if errors:
            raise errors[0]

    def close(self, agent: Any, why: str, errors: list[BaseException]) -> None:
        """Drop every peer and unload every other agent (initiators that said hello),
        appending failures to ``errors`` and releasing the rest."""
        for peer in list(self.peers.values()):
            try:
                self.drop(agent, peer, why)
            except Exception as exc:  # keep releasing the rest
                errors.append(exc)
        for name in list(self.loaded):
            try:
                self.unload(agent, name)
            except Exception as exc:
                errors.append(exc)
        while self.parked:
            self._remove(agent, self.parked.popitem()[0], quiet=True)
