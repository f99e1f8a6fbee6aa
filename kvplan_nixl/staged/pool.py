"""The staging pool: slots handed out as credits, and the pool's NIXL registration and lists.

Owns the memory of staging and nothing of a request's meaning. :class:`SlotPool` hands out the
slots of one tensor FIFO (a slot is a credit; a request waits in line, never holds a slot while
waiting for its peer). :class:`RegisteredPool` registers the pool with NIXL once, prepares its
local descriptor list and one list per peer pool it learnt (keyed by the peer's agent name:
the staged executor's per-peer NIXL state, dropped by :meth:`RegisteredPool.forget`), and makes
the one-descriptor bulk transfer of a chunk between two slots. It may not import the protocol,
the jobs or the Stager; it sends no message.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvplan_nixl._nixl import NIXL_LOCAL
from kvplan_nixl.descriptors import Ladder, lower
from kvplan_nixl.errors import nixl_call
from kvplan_nixl.handles import Handles
from kvplan_nixl.staged.protocol import PoolInfo

__all__ = ["PIECE", "RegisteredPool", "SlotPool"]

#: Bulk transfers are whole multiples of this many bytes (slots are too): one NIXL piece size
#: serves every chunk, so each chunk posts as exactly one descriptor.
PIECE = 4096


class SlotPool:
    """Slots of a staging tensor, handed out FIFO (a slot is a credit)."""

    def __init__(self, tensor: torch.Tensor, slot_bytes: int) -> None:
        self.tensor = tensor
        self.slot_bytes = slot_bytes
        self.nslots = tensor.numel() // slot_bytes
        self.free: collections.deque[int] = collections.deque(range(self.nslots))
        self.waiters: collections.deque[tuple[Any, Callable[[int], None]]] = collections.deque()
        self._pumping = False

    def slot(self, i: int) -> torch.Tensor:
        """Slot ``i``'s bytes."""
        return self.tensor[i * self.slot_bytes:(i + 1) * self.slot_bytes]

    @property
    def in_use(self) -> int:
        """Slots handed out."""
        return self.nslots - len(self.free)

    def acquire(self, owner: Any, then: Callable[[int], None]) -> None:
        """Queue ``then(slot)``; it runs as soon as a slot is free and earlier waiters are
        served (now, if one is)."""
        self.waiters.append((owner, then))
        self.pump()

    def release(self, slot: int) -> None:
        """Give a slot back (and serve the next waiter)."""
        self.free.append(slot)
        self.pump()

    def forget(self, owner: Any) -> None:
        """Drop the waits of ``owner`` (a failed request)."""
        self.waiters = collections.deque(w for w in self.waiters if w[0] is not owner)

    def free_job(self, j: Any) -> None:
        """Drop job ``j``'s waits and free its slots (``j.slots``), but those a running leg
        still uses (``j.busy``: freed when the leg returns)."""
        self.forget(j)
        for k in [k for k in j.slots if k not in j.busy]:
            self.release(j.slots.pop(k))

    def pump(self) -> None:
        """Serve waiters while slots are free."""
        if self._pumping:  # a callback that releases a slot must not recurse
            return
        self._pumping = True
        try:
            while self.free and self.waiters:
                _, then = self.waiters.popleft()
                then(self.free.popleft())
        finally:
            self._pumping = False


class RegisteredPool:
    """A :class:`SlotPool` registered with NIXL on ``agent``, with its descriptor lists."""

    def __init__(self, agent: Any, pool_bytes: int, slot_bytes: int, device: torch.device,
                 mem: str) -> None:
        # zeroed now: the pool's pages are faulted in once, not during the first requests
        self.slots = SlotPool(torch.zeros(pool_bytes, dtype=torch.uint8, device=device),
                              slot_bytes)
        t = self.slots.tensor
        self.slot_bytes = slot_bytes
        self.mem = mem
        self.dev = (t.device.index or 0) if t.device.type == "cuda" else 0
        with nixl_call("register_memory", f"staging pool of {pool_bytes} bytes"):
            self._reg = agent.register_memory([(t.data_ptr(), pool_bytes, self.dev, "")], mem)
        self.handles = Handles(registrations=1)
        self.ladder = Ladder.build(["staging"], [pool_bytes], [PIECE])
        try:
            self.local_dlist = self.handles.prep(
                agent, NIXL_LOCAL, self.ladder.rows([t.data_ptr()], self.dev), mem,
                "staging pool (local)")
        except BaseException:
            agent.deregister_memory(self._reg)
            raise
        self.remote: dict[str, tuple[Ladder, Any]] = {}  # agent -> its pool's ladder, dlist

    def info(self) -> PoolInfo:
        """This pool as ACK and POOL describe it."""
        t = self.slots.tensor
        return PoolInfo(t.data_ptr(), t.numel(), self.slot_bytes, self.dev, self.mem)

    def learn(self, agent: Any, name: str, info: PoolInfo) -> None:
        """Prepare the list of agent ``name``'s pool (once per agent: until :meth:`forget`);
        ``ValueError`` for a pool of other slots than this one's."""
        if name in self.remote:
            return
        if info.slot_bytes != self.slot_bytes:
            raise ValueError(f"peer pool of {info.slot_bytes}-byte slots, this side's "
                             f"{self.slot_bytes}")
        ladder = Ladder.build(["staging"], [info.nbytes], [PIECE])
        dl = self.handles.prep(agent, name, ladder.rows([info.addr], info.device), info.mem,
                               f"staging pool of {name}")
        self.remote[name] = (ladder, dl)

    def forget(self, name: str) -> None:
        """Release the list of agent ``name``'s pool, if one was prepared."""
        entry = self.remote.pop(name, None)
        if entry is not None:
            self.handles.release(entry[1], "dlist")

    def make_xfer(self, agent: Any, op: str, name: str, local: np.ndarray,
                  remote: np.ndarray, length: np.ndarray, note: bytes) -> Any:
        """A transfer handle of runs between this pool (byte offsets ``local``) and agent
        ``name``'s (``remote``), counted; NIXL errors propagate as NIXL raised them."""
        ladder, dlist = self.remote[name]
        zeros = np.zeros(len(length))
        lw = lower(self.ladder, ladder, zeros, np.asarray(local), zeros, np.asarray(remote),
                   np.asarray(length))
        h = agent.make_prepped_xfer(op, self.local_dlist, lw.local, dlist, lw.remote, note)
        self.handles.count_xfer()
        return h

    def chunk_xfer(self, agent: Any, op: str, name: str, slot: int, rslot: int, nbytes: int,
                   note: bytes) -> Any:
        """The bulk transfer of one chunk of ``nbytes``, slot to slot: one descriptor."""
        padded = min(-(-nbytes // PIECE) * PIECE, self.slot_bytes)
        return self.make_xfer(agent, op, name, np.array([slot * self.slot_bytes]),
                              np.array([rslot * self.slot_bytes]), np.array([padded]), note)

    def close(self, agent: Any | None) -> None:
        """Release every list and deregister (``agent`` None: NIXL freed all with the agent)."""
        if agent is None:
            self.handles.live.clear()
            self.remote.clear()
            return
        for name in list(self.remote):
            self.forget(name)
        if self.local_dlist is not None:
            self.handles.release(self.local_dlist, "dlist")
            self.local_dlist = None
        if self.handles.live["registrations"]:
            with nixl_call("deregister_memory", "staging pool"):
                agent.deregister_memory(self._reg)
            self.handles.live["registrations"] -= 1
