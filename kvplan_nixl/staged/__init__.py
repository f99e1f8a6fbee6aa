"""The staged executor: transfers through registered bounce buffers (staging slots).

Theory of operation. ``kvplan.staging.stage`` turns a plan into gather -> bulk -> scatter, in
chunks of one slot each. Both endpoints of a peer pair run a :class:`Stager` (one pool of
``pool_bytes`` in ``slot_bytes`` slots, registered with NIXL once, before the endpoint's
metadata is handed out). The side that planned (the *initiator*: the destination for pull,
the source for push) always posts the bulk NIXL transfer; the other side (the *server*) derives
the same legs for the pair from the block ids (push and pull plans agree on them) and runs its
local leg. Messages are NIXL notifications beginning with ``kvs1``:

push (initiator = source)               pull (initiator = destination)
  I -> S  OPEN rid, block ids             I -> S  OPEN rid, block ids
  S -> I  ACK rid, its pool               S -> I  ACK rid, its pool
  S -> I  GRANT rid k slot (a credit)     S       gathers chunk k into a slot
  I       gathers chunk k, WRITEs it      S -> I  READY rid k slot
          with notification DATA rid k    I       READs it with notification TAKEN rid k,
  S       scatters chunk k, frees slot            scatters it, frees its slot
  S -> I  DONE rid (all scattered)        S       frees its slot on TAKEN
  I -> S  ABORT rid reason / S -> I FAIL rid reason: free all the request holds

Credits. A slot is a credit. A side takes a slot only for a step that finishes on its own (a
posted transfer, a local copy), never while waiting for the other side, and the server hands
out at most ``window`` chunks of one request at a time, so requests interleave and queue
FIFO for slots, and no cycle of waits can form: a full pool delays, never deadlocks. With
``window`` 2 the gather of chunk k+1 runs while chunk k is in flight.

Failures. Every request ends DONE or FAILED per peer, naming the destination blocks. A NIXL
error, the deadline, ``cancel`` or ``close`` frees the request's slots and handles on this side
and sends FAIL to the other; a server also drops a request whose own deadline (the
initiator's timeout, or :data:`SERVE_TIMEOUT`) passes, so a dead initiator cannot hold its
slots.

The user's ``notify`` travels in the OPEN (after the block ids) and the server queues it into
its endpoint's ``notifications()`` when its part is DONE: push after the last scatter, pull on
the last TAKEN; never for a failed request.

Rooms, bottom up (each module's doc says what it owns and may not touch): ``legs`` (the torch
gather and scatter), ``protocol`` (the one place messages are made and parsed), ``pool``
(slots as credits, the pool's NIXL registration and lists), ``transfer`` (a request's per-peer
jobs, :class:`StagedTransfer`, :class:`MixedTransfer`), ``channel`` (staged messages in and
out of the endpoint), ``runner`` (local legs inline or on a worker thread), ``initiator`` and
``server`` (the two sides of the protocol), ``calibration`` (measuring the costs) and
``stager`` (the :class:`Stager` facade that owns one of each and routes messages).

Not thread-safe: drive a Stager (``poll``, or a transfer's ``wait``) from its endpoint's thread.
"""

from kvplan_nixl.staged.server import SERVE_TIMEOUT
from kvplan_nixl.staged.stager import DEFAULT_COSTS, Stager
from kvplan_nixl.staged.transfer import MixedTransfer, StagedTransfer

__all__ = ["DEFAULT_COSTS", "SERVE_TIMEOUT", "MixedTransfer", "StagedTransfer", "Stager"]
