"""Notifications: NIXL notifications received by one Endpoint, each routed to its owner.

Owns the receiving side of the notification channel: :meth:`NotificationRouter.progress`
drains NIXL's new notifications, opens each (``open``: the endpoint's
:class:`~kvplan_nixl.envelope.Envelope`, which drops what an unknown, forging or replaying sender
sent) and routes the message by its prefix: the endpoints' control
notices (hello, close) to the handshake, a protocol layered on the endpoint (the staged
executor's ``kvs1``) to the hook it registered (a reserved prefix nobody hooked to its
fallback handler, never to the user), everything else to the user's queue, which
``Endpoint.notifications()`` drains. It parses no message body and may not import the
endpoint, the handshake or any protocol: they are handed in as callbacks.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import attrs

from kvplan_nixl import metadata as md
from kvplan_nixl.errors import nixl_call

__all__ = ["Notification", "NotificationRouter", "sender"]

#: ``handler(agent_name, message)``
Handler = Callable[[str, bytes], None]


@attrs.frozen
class Notification:
    """A message a peer attached to a transfer, delivered when its part completed here."""

    engine: str
    rank: int
    message: bytes


def sender(agent_name: str) -> tuple[str, int]:
    """(engine, rank) of an agent name (``(name, -1)`` for a name not ours)."""
    parsed = md.parse_agent_name(agent_name)
    return parsed if parsed is not None else (agent_name, -1)


class NotificationRouter:
    """Routes received notifications: ``control_prefix`` to ``control``, hooks by their
    5-byte prefix (``reserved``: handlers of prefixes no hook serves), the rest to the
    user's queue."""

    def __init__(self, control_prefix: bytes, control: Handler,
                 open_: Callable[[str, bytes], bytes | None],
                 reserved: dict[bytes, Handler] | None = None) -> None:
        self._control_prefix = control_prefix
        self._open = open_
        self._control = control
        self.hooks: dict[bytes, Handler | None] = {}
        #: per reserved 5-byte prefix, its handler while no hook serves it: a protocol's
        #: message never reaches the user's queue, served or not
        self.reserved: dict[bytes, Handler] = dict(reserved or {})
        self.queue: collections.deque[Notification] = collections.deque()

    def progress(self, agent: Any) -> int:
        """Progress ``agent`` (a target must be progressed) and route what arrived; how many
        messages went to the user's queue."""
        with nixl_call("get_new_notifs"):
            new = agent.get_new_notifs()
        n = 0
        for name, msgs in new.items():
            name = name.decode() if isinstance(name, bytes) else name
            for wire in msgs:
                m = self._open(name, bytes(wire))
                if m is None:  # dropped (and counted) by the envelope
                    continue
                if m.startswith(self._control_prefix):
                    self._control(name, m)
                    continue
                hook = self.hooks.get(m[:5]) or self.reserved.get(m[:5])
                if hook is not None:
                    hook(name, m)
                    continue
                self.deliver(name, m)
                n += 1
        return n

    def deliver(self, agent_name: str, message: bytes) -> None:
        """Queue ``message`` for the user as if NIXL had delivered it from ``agent_name``."""
        engine, rank = sender(agent_name)
        self.queue.append(Notification(engine, rank, bytes(message)))

    def drain(self) -> list[Notification]:
        """The queued messages, oldest first (the queue is emptied)."""
        out = list(self.queue)
        self.queue.clear()
        return out
