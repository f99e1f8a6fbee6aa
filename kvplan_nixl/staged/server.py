"""The server side of staged transfers: serve the requests peers OPEN to this rank.

Owns the requests served here (keyed by the initiator's agent and its request id): it checks an
OPEN against this side's own plan of the same block ids (refusing with a FAIL when they
disagree), hands out at most ``window`` credits at a time (GRANT for push, gather then READY
for pull), scatters what a push wrote (DATA) or frees what a pull took (TAKEN), delivers the
user's notify once the part is DONE, and drops a request at its deadline or on ABORT, freeing
its slots. It may not touch the requests this side initiated (``initiator``) nor parse bytes
(``protocol``); it never blocks.
"""

from __future__ import annotations

import time
from typing import Any

from kvplan import KVPlanError, Mode
from kvplan.request import plan_nbytes
from kvplan.staging import stage
from kvplan_nixl.endpoint import Endpoint
from kvplan_nixl.errors import NotConnectedError
from kvplan_nixl.metadata import parse_agent_name
from kvplan_nixl.staged import protocol as proto
from kvplan_nixl.staged.channel import Channel
from kvplan_nixl.staged.pool import RegisteredPool
from kvplan_nixl.staged.runner import LegRunner
from kvplan_nixl.staged.transfer import Job
from kvplan_nixl.transfer import State

__all__ = ["SERVE_TIMEOUT", "Server"]

#: How long a server keeps a request (seconds): the initiator's timeout when it gave a shorter
#: one, never longer (a timeout from the wire never holds slots past this side's limit).
SERVE_TIMEOUT = 60.0


class Server:
    """The requests peers opened to one Stager."""

    def __init__(self, endpoint: Endpoint, pool: RegisteredPool, runner: LegRunner,
                 channel: Channel, window: int) -> None:
        self.ep, self.pool, self.runner, self.channel = endpoint, pool, runner, channel
        self.window = window
        self.served: dict[tuple[str, str], Job] = {}  # (agent, rid) -> server job

    def on_open(self, agent_name: str, m: proto.Message) -> bool:
        """Serve an OPEN, or refuse it with a FAIL naming why (raises for a malformed one);
        False for an OPEN of a request served already (a duplicate: dropped, the request it
        names is left alone)."""
        if (agent_name, m.rid) in self.served:
            return False
        try:
            self._open(agent_name, m)
        except proto.Refuse as exc:
            self.channel.send(agent_name, proto.encode("FAIL", m.rid, f"refused: {exc}"))
        return True

    def on_message(self, agent_name: str, m: proto.Message) -> bool:
        """DATA, TAKEN or ABORT from the initiator of a request served here; False when it
        names no request served for that agent, or a chunk not in flight."""
        j = self.served.get((agent_name, m.rid))
        if j is None:
            return False
        j.heard = time.monotonic()
        if m.op == "ABORT":
            self._drop(j, "initiator aborted: " + m.text(1), tell=False)
            return True
        return self._step(j, m.int(1))

    def peer_gone(self, agent_name: str) -> None:
        """Agent ``agent_name`` was unloaded: drop what it opened here, freeing its slots."""
        for j in [j for j in self.served.values() if j.agent == agent_name]:
            self._drop(j, "initiator gone", tell=False)

    def step(self, now: float) -> None:
        """Drop the requests whose deadline passed, or whose initiator a probe finds gone
        (a dead initiator holds no slot)."""
        for j in list(self.served.values()):
            if now > j.deadline:
                self._drop(j, "server deadline passed", tell=True)
            elif now - j.heard > proto.PROBE_S:
                j.heard = now
                if not self.channel.send(j.agent, proto.encode("PING", j.rid)):
                    self._drop(j, "initiator unreachable (a liveness probe could not be sent)",
                               tell=False)

    def close(self) -> None:
        """Drop every request served (the initiators are told)."""
        for j in list(self.served.values()):
            self._drop(j, "stager closed", tell=True)

    def _open(self, agent_name: str, m: proto.Message) -> None:
        # every check that needs no plan comes first: a refused OPEN costs no planning (the
        # plan's size is counted, not planned: kvplan.request.plan_nbytes)
        op = proto.decode_open(m)
        if op.slot_bytes != self.pool.slot_bytes:
            raise proto.Refuse(f"slot sizes differ: initiator {op.slot_bytes} bytes, this side "
                               f"{self.pool.slot_bytes}")
        if op.nchunks != -(-op.nbytes // op.slot_bytes):
            raise proto.Refuse(f"{op.nbytes} bytes do not make {op.nchunks} chunks of "
                               f"{op.slot_bytes}")
        parsed = parse_agent_name(agent_name)
        engine, rank = parsed if parsed is not None else (agent_name, -1)
        mine = Mode.PULL if op.mode is Mode.PUSH else Mode.PUSH  # this side's map to them
        try:
            tmap = self.ep.map(engine, mine)
            cap = _most_bytes(tmap, mine, op)
            if op.nbytes > cap:
                raise proto.Refuse(f"{op.nbytes} bytes asked, more than the {cap} bytes this "
                                   "rank holds in the blocks listed")
            # the plan's bytes for this peer, counted without planning: a claim that is not
            # them is refused for a small part of what planning and staging would cost
            have = plan_nbytes(tmap, op.src_blocks, op.dst_blocks).get(rank, 0)
            if have != op.nbytes:
                raise proto.Refuse(f"plans disagree: initiator {op.nbytes} bytes, this side "
                                   f"{have} bytes for rank {rank} (counted before planning)")
            sp = stage(tmap.plan(op.src_blocks, op.dst_blocks), self.pool.slot_bytes)
        except (NotConnectedError, KVPlanError) as exc:  # e.g. block ids that do not fit
            raise proto.Refuse(str(exc)) from exc
        limit = SERVE_TIMEOUT if not op.timeout_ms else min(op.timeout_ms / 1000, SERVE_TIMEOUT)
        deadline = time.monotonic() + limit
        j = Job(op.rid, agent_name, rank, sp, mine, deadline)
        j.server = True
        j.notify = op.notify
        if j.nbytes != op.nbytes or len(j.chunks) != op.nchunks:
            raise proto.Refuse(f"plans disagree: initiator {op.nbytes} bytes in {op.nchunks} "
                               f"chunks, this side {j.nbytes} bytes in {len(j.chunks)} chunks")
        self.served[(agent_name, op.rid)] = j
        self.channel.send(agent_name, self.pool.info().encode("ACK", op.rid))
        self._pump(j)

    def _pump(self, j: Job) -> None:
        """Hand out the next chunks of a served request, at most ``window`` in flight."""
        while j.state is State.PENDING and j.next < len(j.chunks) and (
                j.next - j.finished < self.window):
            k = j.next
            j.next += 1

            def go(slot: int, k: int = k) -> None:
                if j.state is not State.PENDING:
                    self.pool.slots.release(slot)
                    return
                j.slots[k] = slot

                def tell(note: str) -> None:
                    if not self.channel.send(j.agent, proto.encode(note, j.rid, k, slot)):
                        self._drop(j, "initiator unreachable", tell=False)

                if j.mode is Mode.PUSH:  # pull initiator: this side gathers, then says READY
                    self.runner.run(j, k, "gather", lambda: tell("READY"), self._leg_failed)
                else:
                    tell("GRANT")

            self.pool.slots.acquire(j, go)

    def _step(self, j: Job, k: int) -> bool:
        """DATA (push: scatter) or TAKEN (pull: nothing to copy) of chunk k: free its slot
        (False: chunk k is not in flight)."""
        if k not in j.slots or k in j.busy:
            return False
        if j.mode is Mode.PULL:
            self.runner.run(j, k, "scatter", lambda: self._done(j, k), self._leg_failed)
        else:
            self._done(j, k)
        return True

    def _done(self, j: Job, k: int) -> None:
        self.pool.slots.release(j.slots.pop(k))
        j.finished += 1
        if j.finished == len(j.chunks):
            j.state = State.DONE
            del self.served[(j.agent, j.rid)]
            # the user's notify, as a direct transfer delivers it: for a push once the last
            # scatter into this rank's buffers returned, for a pull once the last TAKEN (the
            # initiator's last READ completed) came; a failed request never gets here
            if j.notify:
                self.ep._deliver(j.agent, j.notify)
            if j.mode is Mode.PULL:
                self.channel.send(j.agent, proto.encode("DONE", j.rid))
        else:
            self._pump(j)

    def _leg_failed(self, j: Job, why: str) -> None:
        self._drop(j, why, tell=True)

    def _drop(self, j: Job, reason: str, *, tell: bool) -> None:
        if self.served.pop((j.agent, j.rid), None) is None:
            return
        j.state, j.reason = State.FAILED, reason
        self.pool.slots.free_job(j)
        if tell:
            self.channel.send(j.agent, proto.encode("FAIL", j.rid, reason))


def _most_bytes(tmap: Any, mine: Mode, op: proto.Open) -> int:
    """The most bytes an OPEN's plan can move on this rank: every block of this side it
    lists, whole, in every region of its group (no plan needed)."""
    spec, lists = (tmap.src, op.src_blocks) if mine is Mode.PUSH else (tmap.dst, op.dst_blocks)
    return sum(spec.rank_block_nbytes(j) * len(lists[r.group])
               for j, r in enumerate(spec.regions) if r.group < len(lists))
