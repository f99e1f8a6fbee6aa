"""Measuring what staging costs against one peer: the inputs of the direct-or-staged choice.

Owns the measurement only: ``Stager.calibrate`` calls :func:`calibrate` with its endpoint, its
registered pool and a way to ask a peer where its pool is (a HELLO / POOL round trip, which the
Stager's protocol answers). It reads only staging memory, never engine buffers, and stores
nothing: the Stager keeps the costs. It may not import the Stager or the protocol's sides.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from kvplan.staging import Costs
from kvplan_nixl.arguments import check_progress, check_timeout
from kvplan_nixl.endpoint import Endpoint
from kvplan_nixl.errors import BusyError, NixlError, NotConnectedError, PeerTimeout, nixl_call
from kvplan_nixl.staged import legs
from kvplan_nixl.staged.pool import PIECE, RegisteredPool

__all__ = ["calibrate"]


def calibrate(ep: Endpoint, pool: RegisteredPool, hello: Callable[[str], str | None],
              asking: set[str], poll: Callable[[], int], remote: str, *,
              cpu_threads: int | None = 1, progress: Iterable[Any] = (),
              timeout: float = 10.0) -> Costs:
    """Measure the costs ``Stager.prefer`` weighs against one connected peer rank of
    ``remote`` (its Stager must be polled meanwhile: ``progress`` lists other Stagers of this
    process; ``poll`` polls this side's): a notification round trip (``per_chunk``:
    ``hello`` sends a HELLO and returns its nonce, in ``asking`` until the POOL came), one READ
    of a whole slot (``per_byte``), a READ of half its bytes as unmergeable 4 KiB descriptors
    (``per_descriptor``), best of three each, and a local 4 KiB-granule gather
    (``local_per_byte``, with ``cpu_threads``, best of three). Reads only the peer's pool, into
    a free slot of ``pool``. Every wait ends by ``timeout`` seconds after the call:
    :class:`PeerTimeout` names the peer then (the READ in flight is released).
    :class:`BusyError` when no slot is free.
    """
    agent = ep._require()
    timeout = check_timeout("timeout", timeout, optional=False)
    peer = next((p for p in ep.peers() if p.engine == remote), None)
    if peer is None:
        raise NotConnectedError(f"calibrate: no rank of engine {remote!r} is connected")
    slots = pool.slots
    if not slots.free:
        raise BusyError(f"calibrate: every staging slot is in use ({slots.in_use} of "
                        f"{slots.nslots}); calibrate while no staged request is in flight")
    who = f"engine {remote!r} rank {peer.rank}"
    others = check_progress(progress, "poll")
    # one deadline for every wait below: a peer that answers HELLO and then stops progressing
    # must not hold a READ (or the round trip) forever
    deadline = time.monotonic() + timeout
    t0 = time.perf_counter()
    nonce = hello(peer.agent)
    if nonce is None:
        raise NixlError("send_notif", "unreachable", who)
    while nonce in asking:  # spins (no nap): the round trip is what is measured
        for o in others:
            o.poll()
        poll()
        if time.monotonic() > deadline:
            asking.discard(nonce)
            raise PeerTimeout(f"calibrate: {who} did not answer HELLO within {timeout} s", who)
    rtt = time.perf_counter() - t0
    slot = slots.free.popleft()
    stuck = []  # a READ NIXL would not abort: it may still write into the slot
    try:
        base, s = slot * pool.slot_bytes, pool.slot_bytes
        n = s // (2 * PIECE)  # every other 4 KiB piece: nothing merges
        offs = np.arange(n, dtype=np.int64) * 2 * PIECE

        def read(local, remote_off, length) -> float:
            return _timed_read(pool, agent, peer.agent, local, remote_off, length, others,
                               deadline, who, stuck)

        read([base], [0], [s])  # sets up the connection; then best of three
        one = min(read([base], [0], [s]) for _ in range(3))
        many = min(read(base + offs, offs, np.full(n, PIECE)) for _ in range(3))
        half = slots.slot(slot).view(-1, PIECE)
        idx = torch.from_numpy(np.random.default_rng(0).permutation(len(half) // 2)).to(
            half.device)
        local = float("inf")
        with legs.cpu_threads(cpu_threads, half):
            for _ in range(3):  # best of three, as the reads: one sample swung 0.45-5.8 GB/s
                t = time.perf_counter()  # on a loaded machine and flipped auto's choice
                torch.index_select(half[: len(half) // 2], 0, idx, out=half[len(half) // 2:])
                legs.synchronize(half)
                local = min(local, time.perf_counter() - t)
    finally:
        if not stuck:
            slots.release(slot)
    per_byte = one / s
    return Costs(per_descriptor=max(0.0, (many - n * PIECE * per_byte) / n),
                 per_byte=per_byte, local_per_byte=local / (s // 2), per_chunk=rtt)


def _timed_read(pool: RegisteredPool, agent, name: str, local, remote, length, others,
                deadline: float, who: str, stuck: list) -> float:
    """Seconds one READ took; :class:`PeerTimeout` once ``deadline`` passed (the READ is
    released, which aborts it; one NIXL refuses to release is noted in ``stuck``)."""
    with nixl_call("calibration transfer"):
        h = pool.make_xfer(agent, "READ", name, np.asarray(local), np.asarray(remote),
                           np.asarray(length), b"")
    try:
        t = time.perf_counter()
        with nixl_call("calibration transfer"):
            state = agent.transfer(h)
            while state == "PROC":
                for o in others:
                    o.poll()
                state = agent.check_xfer_state(h)
                if state == "PROC" and time.monotonic() > deadline:
                    raise PeerTimeout(f"calibrate: a READ from {who}'s staging pool did not "
                                      "complete before the deadline", who)
        if state != "DONE":
            raise NixlError("calibration transfer", f"NIXL state {state}", who)
        return time.perf_counter() - t
    finally:
        before = pool.handles.live["xfer"]
        pool.handles.release(h)
        if pool.handles.live["xfer"] == before:
            stuck.append(h)
