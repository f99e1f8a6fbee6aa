"""Handshake: connecting to a peer from its metadata, and the control notices between endpoints.

Owns trust at connection time and the control notices: :meth:`Handshake.connect` decodes a
peer's metadata (checked against the deployment's secret, then against its own NIXL section,
before NIXL parses a byte), builds what a route to it needs aside and commits only a fully
successful connect; ``hello`` tells a target how to reach its initiator, ``close`` (signed under
a secret, as every message: :mod:`~kvplan_nixl.envelope`) tells peers this endpoint went.
Messages of this kind start with :data:`CTRL` and never reach the user's ``notifications()``; they
reach :meth:`Handshake.on_control` only once the envelope opened them (a known sender, or a hello;
with a secret, a valid tag and a fresh counter). It holds no per-peer state of its own (``peers``
and ``routes`` do) and may not import the endpoint or posting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvplan import Mode
from kvplan_nixl import metadata as md
from kvplan_nixl.errors import MetadataError, NixlError, is_nixl_error, nixl_call
from kvplan_nixl.peers import Peer, PeerTable
from kvplan_nixl.reserved import CTRL
from kvplan_nixl.routes import RouteTable

__all__ = ["CLOSE", "CTRL", "HELLO", "Handshake"]

#: Prefix of the control messages endpoints exchange as NIXL notifications (never delivered to
#: ``notifications()``): ``hello`` carries the connecting endpoint's metadata so that the target
#: can reach it, ``close`` says the sender closed. With a secret, both are sealed (as every
#: message) by the envelope.
HELLO = CTRL + b"hello"
CLOSE = CTRL + b"close"
#: How long close() keeps progressing so that its notices leave: rounds x sleep (~5 ms).
_CLOSE_FLUSH_ROUNDS = 10
_CLOSE_FLUSH_SLEEP = 0.5e-3



class Handshake:
    """Connect and control notices for the endpoint whose agent is ``agent_name``."""

    def __init__(self, agent_name: str, secret: bytes | None, peers: PeerTable,
                 routes: RouteTable, own_metadata: Callable[[], bytes],
                 progress: Callable[[], int], seal: Callable[[str, bytes], bytes]) -> None:
        self.agent_name, self.secret = agent_name, secret
        self._seal = seal
        self.peers, self.routes = peers, routes
        self._own_metadata, self._progress = own_metadata, progress
        #: control notices ignored (unknown sender, bad MAC, unreadable)
        self.ignored = 0
        #: ``gone(engine, rank, why)``: told when a connected peer rank went on its own (its
        #: close notice), after it was dropped (:meth:`kvplan_nixl.Endpoint.on_peer_gone`)
        self.gone: Callable[[str, int, str], None] | None = None

    def connect(self, agent: Any, metadata: bytes, mode: str | Mode) -> Peer:
        """See :meth:`kvplan_nixl.Endpoint.connect`."""
        return self.attach(agent, md.decode(metadata, self.secret), mode, foreign=False)

    def attach(self, agent: Any, info: md.PeerInfo, mode: str | Mode, *,
               foreign: bool) -> Peer:
        """Connect the peer ``info`` describes (decoded and trusted by the caller);
        ``foreign``: see :meth:`kvplan_nixl.Endpoint.connect_foreign`."""
        mode = Mode(mode)
        if info.agent == self.agent_name:
            raise MetadataError("this is the endpoint's own metadata; connect to a peer's")
        who = f"engine {info.engine!r} rank {info.rank}"
        named = md.nixl_agent_name(info.agent_metadata)
        if named != info.agent:  # checked on the bytes, before NIXL parses them
            what = "is not NIXL agent metadata" if named is None else f"names agent {named!r}"
            raise MetadataError(f"metadata of {who}: its NIXL section {what}, but the metadata "
                                f"advertises agent {info.agent!r}")
        self._progress()  # act on close notices already here before deciding anything
        peers, routes = self.peers, self.routes
        old = peers.peers.get((info.engine, info.rank))
        _check_agent_owner(peers, info, who)
        # a rank that comes back with a new agent is a restart; with another spec too, the
        # whole engine restarted: its other ranks are of the old incarnation, and go
        restarted = old is not None and old.agent != info.agent
        key = (info.engine, mode)
        route = routes.routes.get(key)
        stale = None  # a route whose only rank comes back with another spec: replaced
        outdated: list[Peer] = []  # the engine's other ranks, when it restarted with a new spec
        if route is not None:
            other = route.map.src if mode is Mode.PULL else route.map.dst
            if other != info.spec:
                others = set(route.peer_dlists) - {info.rank}
                if others and not restarted:
                    raise MetadataError(
                        f"engine {info.engine!r} rank {info.rank} advertises a spec that differs "
                        f"from the one its other ranks advertised; every rank of an engine has "
                        f"one spec"
                    )
                outdated = [p for (e, r), p in sorted(peers.peers.items())
                            if e == info.engine and r != info.rank]
                stale, route = route, None
        if old is not None and old.agent == info.agent and route is not None \
                and info.rank in route.peer_dlists:
            return old  # connected already
        # Build everything new aside; only a fully successful connect changes this endpoint
        # (a refused one leaves no route, list or agent, and no connected peer is touched).
        new_route = routes.new_route(agent, info, mode) if route is None else None
        load = info.agent not in peers.loaded
        try:
            if load:
                peers.load(agent, info, who)
            try:
                ladder, dlist = routes.peer_list(agent, info, new_route or route)
            except NixlError as exc:  # e.g. advertised regions its NIXL section does not register
                raise MetadataError(
                    f"metadata of {who}: NIXL refused its advertised regions ({exc.code}): they "
                    "are not what its NIXL metadata registers"
                ) from exc
        except BaseException:
            if load and info.agent in peers.loaded:
                peers.unload(agent, info.agent, quiet=True)
            if new_route is not None:
                routes.release(new_route, [])
            raise
        if restarted:  # the rank restarted: new agent
            for gone, why in [(old, "restarted with new metadata")] + [
                    (p, f"its engine restarted (rank {info.rank} came back with a new agent "
                        "and spec)") for p in outdated]:
                try:
                    peers.drop(agent, gone, why)
                except Exception:  # best effort: the old agent is gone either way
                    pass
        if stale is not None:  # what the drop did not release (the same agent re-advertised)
            routes.release(stale, [])
        if new_route is not None:
            routes.routes[key] = route = new_route
        assert route is not None
        peer = Peer(info.engine, info.rank, info.agent, info.spec)
        if old is not None and old.agent == info.agent and stale is None:
            peer = old
        peers.peers[(info.engine, info.rank)] = peer
        route.peer_ladders[info.rank] = ladder
        route.peer_dlists[info.rank] = dlist
        if foreign:  # another connector's agent: it would not understand a hello
            peers.foreign.add(info.agent)
        else:
            self._send_hello(agent, info.agent)
        return peer

    def _send_hello(self, agent: Any, peer_agent: str) -> None:
        """Tell a peer we connected, with our metadata, so that it can notify us when it closes
        (a target never loads its initiators' metadata otherwise). Best effort."""
        try:
            with nixl_call("get_agent_metadata"):
                blob = self._own_metadata()
            with nixl_call("send_notif", peer_agent):
                agent.send_notif(peer_agent, self._seal(peer_agent, HELLO + blob))
        except NixlError:
            pass  # the peer then learns of our close by the failure of its next transfer

    def on_control(self, agent: Any, sender: str, msg: bytes) -> None:
        """A control notice from agent ``sender``: load a hello's sender, drop a closed peer."""
        if agent is None:
            return
        peers = self.peers
        if msg.startswith(HELLO):
            # checked even from a connected peer: a hello marks a route *from* the sender,
            # which keeps its agent known after our route to it is disconnected
            try:
                info = md.decode(msg[len(HELLO):], self.secret)
                if info.agent != sender or md.nixl_agent_name(info.agent_metadata) != sender:
                    raise MetadataError(f"hello from {sender!r} carries another agent's metadata")
                if sender not in peers.loaded:
                    peers.load(agent, info, f"engine {info.engine!r} rank {info.rank}")
                peers.hellos.add(sender)
            except (MetadataError, NixlError):
                self.ignored += 1
            return
        if not msg.startswith(CLOSE) or sender not in peers.loaded:
            self.ignored += 1
            return
        engine, rank = peers.loaded[sender]
        peer = peers.peers.get((engine, rank))
        if peer is not None and peer.agent == sender:
            peers.drop(agent, peer, "peer closed its endpoint")
            if not any(e == engine for e, _ in peers.peers):  # the engine is gone: its routes
                self.routes.drop_engine(engine)
            if self.gone is not None:
                self.gone(engine, rank, "peer closed its endpoint")
        else:
            peers.unload(agent, sender, quiet=True)

    def send_close(self, agent: Any, flush: bool) -> None:
        """Tell every loaded agent (peers and initiators that said hello) that we close;
        ``flush``: progress a few times so that the notices leave (no progress thread)."""
        loaded = self.peers.loaded
        for name in [n for n in loaded if n not in self.peers.foreign]:
            try:
                agent.send_notif(name, self._seal(name, CLOSE))
            except Exception as exc:  # a peer already gone: nothing to tell
                if not is_nixl_error(exc):
                    raise
        if len(loaded) > len(self.peers.foreign) and flush:
            # the notices leave on worker progress: progress a few times before the agent is
            # destroyed, or UCX cancels them (what arrives meanwhile is of no use any more)
            for _ in range(_CLOSE_FLUSH_ROUNDS):
                try:
                    agent.get_new_notifs()
                except Exception as exc:
                    if not is_nixl_error(exc):
                        raise
                time.sleep(_CLOSE_FLUSH_SLEEP)


def _check_agent_owner(peers: PeerTable, info: md.PeerInfo, who: str) -> None:
    """Refuse metadata whose agent another connected peer rank uses: one agent serves one
    rank, so such metadata is not the rank it claims to be (a copy of another rank's, or
    ranks swapped), and replacing the rank's agent with it would later unload an agent the
    other rank still reads through."""
    owner = peers.loaded.get(info.agent)
    if owner is None or owner == (info.engine, info.rank):
        return
    other = peers.peers.get(owner)
    if other is not None and other.agent == info.agent:
        raise MetadataError(
            f"metadata of {who}: its agent {info.agent!r} is the one engine {owner[0]!r} rank "
            f"{owner[1]} is connected through; one agent serves one rank, so this is not "
            f"{who}'s metadata (another rank's, copied or swapped)")
