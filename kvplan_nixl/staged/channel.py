"""The staged executor's notification channel: staged messages in and out of one Endpoint.

Owns the inbox of staged messages (the endpoint hands every notification starting with
:data:`~kvplan_nixl.staged.protocol.TAG` to :meth:`Channel.receive`, never to the user's
``notifications()``) and the sending of messages to a peer agent. Every staged message passes
here, in both directions: what arrives was opened by the endpoint's envelope (a known sender;
with a secret, a valid tag and a fresh counter), what leaves is sealed for its receiver
(:meth:`Channel.seal` too for the notes attached to bulk transfers). It may not parse a message
(``protocol`` does) nor act on one (the Stager does).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from kvplan_nixl.endpoint import Endpoint
from kvplan_nixl.errors import is_nixl_error
from kvplan_nixl.staged.protocol import TAG

__all__ = ["Channel"]


class Channel:
    """Staged messages between one Endpoint and its peers' Stagers."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.ep = endpoint
        self.inbox: collections.deque[tuple[str, bytes]] = collections.deque()
        endpoint._hook(TAG, self.receive)

    def receive(self, agent_name: str, msg: bytes) -> None:
        """Queue a message from agent ``agent_name`` (the endpoint calls it as it progresses)."""
        self.inbox.append((agent_name, msg))

    def drain(self) -> Iterator[tuple[str, bytes]]:
        """The queued messages, oldest first, each removed as it is handed out."""
        while self.inbox:
            yield self.inbox.popleft()

    def seal(self, agent_name: str, msg: bytes) -> bytes:
        """``msg`` as it must leave for ``agent_name`` attached to a transfer (sealed)."""
        return self.ep._seal(agent_name, msg)

    def send(self, agent_name: str, msg: bytes) -> bool:
        """Send ``msg`` to agent ``agent_name``; False when it could not leave (endpoint closed,
        peer unreachable)."""
        agent = self.ep._agent_or_none()
        if agent is None:
            return False
        try:
            agent.send_notif(agent_name, self.ep._seal(agent_name, msg))
        except Exception as exc:
            if not is_nixl_error(exc):
                raise
            return False
        return True

    def close(self) -> None:
        """From now on the endpoint serves staged messages itself: peers may still send about
        requests this side dropped (a DONE, a HELLO), and they are protocol, never the user's
        notifications: the endpoint drops them and answers a new OPEN with a FAIL
        (``kvplan_nixl.reserved``)."""
        self.ep._hook(TAG, None)
        self.inbox.clear()
