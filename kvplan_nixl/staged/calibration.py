"""Measuring what staging costs against one peer: the inputs of the direct-or-staged choice.

``Stager.calibrate`` calls :func:`calibrate`; the measurement needs the Stager's pool, its
protocol (a HELLO / POOL round trip teaches it the peer's pool) and its endpoint, and reads only
staging memory, never engine buffers.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvplan.staging import Costs
from kvplan_nixl.staged import legs
from kvplan_nixl.descriptors import lower
from kvplan_nixl.errors import NixlError, NotConnectedError, nixl_call
from kvplan_nixl.staged.stager import PIECE, _encode

if TYPE_CHECKING:
    from kvplan_nixl.staged.stager import Stager

__all__ = ["calibrate"]


def calibrate(st: Stager, remote: str, *, progress: Iterable[Any] = (),
          timeout: float = 10.0) -> Costs:
    """Measure, for Stager ``st``, the costs ``Stager.prefer`` weighs against one connected peer
    rank of ``remote`` (its Stager must be polled meanwhile: ``progress`` lists other Stagers of
    this process): a notification round trip (``per_chunk``), one READ of a whole slot
    (``per_byte``), a READ of half its bytes as unmergeable 4 KiB descriptors
    (``per_descriptor``), best of three each, and a local 4 KiB-granule gather
    (``local_per_byte``). Reads only the peer's pool, into a free slot of ``st``'s.
    """
    agent = st.ep._require()
    peer = next((p for p in st.ep.peers() if p.engine == remote), None)
    if peer is None:
        raise NotConnectedError(f"calibrate: no rank of engine {remote!r} is connected")
    if not st.pool.free:
        raise RuntimeError("calibrate: every staging slot is in use")
    others = tuple(progress)
    nonce = f"h{next(st._ids)}"
    st._hello.add(nonce)
    t0 = time.perf_counter()
    if not st._send(peer.agent, _encode("HELLO", nonce)):
        raise NixlError("send_notif", "unreachable", f"{remote} rank {peer.rank}")
    deadline = time.monotonic() + timeout
    while nonce in st._hello:
        for o in others:
            o.poll()
        st.poll()
        if time.monotonic() > deadline:
            st._hello.discard(nonce)
            raise TimeoutError(f"calibrate: {remote} rank {peer.rank} did not answer")
    rtt = time.perf_counter() - t0
    slot = st.pool.free.popleft()
    try:
        ladder, dlist = st._remote[peer.agent]
        base, s = slot * st.slot_bytes, st.slot_bytes
        n = s // (2 * PIECE)  # every other 4 KiB piece: nothing merges
        offs = np.arange(n, dtype=np.int64) * 2 * PIECE
        # best of three, after a first read that sets up the connection
        _timed_read(st, agent, ladder, dlist, [base], [0], [s], others)
        one = min(_timed_read(st, agent, ladder, dlist, [base], [0], [s], others)
                  for _ in range(3))
        many = min(_timed_read(st, agent, ladder, dlist, base + offs, offs,
                                    np.full(n, PIECE), others) for _ in range(3))
        half = st.pool.slot(slot).view(-1, PIECE)
        idx = torch.from_numpy(np.random.default_rng(0).permutation(len(half) // 2)).to(
            half.device)
        with legs.cpu_threads(st.cpu_threads, half):
            t = time.perf_counter()
            torch.index_select(half[: len(half) // 2], 0, idx, out=half[len(half) // 2:])
            legs.synchronize(half)
            local = time.perf_counter() - t
    finally:
        st.pool.release(slot)
    per_byte = one / s
    costs = Costs(per_descriptor=max(0.0, (many - n * PIECE * per_byte) / n),
                  per_byte=per_byte, local_per_byte=local / (s // 2), per_chunk=rtt)
    return costs

def _timed_read(st: Stager, agent, ladder, dlist, local, remote, length, others) -> float:
    lw = lower(st._ladder, ladder, np.zeros(len(length)), np.asarray(local),
               np.zeros(len(length)), np.asarray(remote), np.asarray(length))
    with nixl_call("calibration transfer"):
        h = agent.make_prepped_xfer("READ", st._local_dlist, lw.local, dlist, lw.remote,
                                    b"")
    st._live["xfer"] += 1
    try:
        t = time.perf_counter()
        with nixl_call("calibration transfer"):
            state = agent.transfer(h)
            while state == "PROC":
                for o in others:
                    o.poll()
                state = agent.check_xfer_state(h)
        return time.perf_counter() - t
    finally:
        st._release_xfer(h)
