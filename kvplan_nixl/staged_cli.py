"""``kvplan demo``'s staged half: the same request moved staged, beside the direct numbers.

``attach`` gives every endpoint a :class:`~kvplan_nixl.staged.Stager` (before any metadata is
handed out); ``run`` connects the targets back to the initiators (a staged transfer needs
notifications both ways), checks the direct result, resets the destination, moves the request
staged (a warm-up, then a timed run) and prints its bandwidth and descriptor count next to the
direct ones. The demo's final byte check then verifies the staged result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvplan import TransferPlan
from kvplan_nixl.staged import Stager

#: Staging pool per rank in the demo, and its slot (chunk) size.
DEMO_POOL = 32 << 20
DEMO_SLOT = 8 << 20


def attach(endpoints: Sequence) -> dict:
    """One Stager per endpoint, keyed by endpoint."""
    return {ep: Stager(ep, pool_bytes=DEMO_POOL, slot_bytes=DEMO_SLOT) for ep in endpoints}


def run(stagers: dict, initiators: Sequence, targets: Sequence, plans: Sequence[TransferPlan],
        remote: str, push: bool, direct_seconds: float,
        pairs: Sequence[tuple[np.ndarray, np.ndarray]], reset: Callable[[], None]) -> bool:
    """Print the staged line of the demo; False if the direct result was wrong."""
    import time

    back = "pull" if push else "push"
    metas = [ep.metadata() for ep in initiators]
    for t in targets:
        for ep, m in zip(initiators, metas, strict=True):
            if t.rank in [int(x) for x in np.unique(
                    _peer_ranks(plans[initiators.index(ep)], push))]:
                t.connect(m, mode=back)
    direct_ok = all(np.array_equal(got, want) for got, want in pairs)
    everyone = list(stagers.values())

    def once() -> list:
        posted = [stagers[ep].post(plan, remote, how="staged")
                  for ep, plan in zip(initiators, plans, strict=True) if len(plan)]
        for t in posted:
            t.wait(30, progress=everyone)
        return posted

    once()  # warm-up
    reset()
    t0 = time.perf_counter()
    posted = once()
    secs = time.perf_counter() - t0
    for _ in range(100):  # servers free their last slots when the final notes arrive
        for s in everyone:
            s.poll()
    total = sum(t.nbytes for t in posted)
    chunks = sum(t.chunks for t in posted)
    desc = sum(t.descriptors for t in posted)
    runs = sum(len(p) for p in plans)
    print(f"staged: moved {total / 2**20:.2f} MiB in {secs * 1e3:.2f} ms: "
          f"{total / secs / 1e9:.2f} GB/s ({desc} NIXL descriptors for {runs} runs, {chunks} "
          f"chunks of <= {DEMO_SLOT >> 20} MiB; direct/staged time {direct_seconds / secs:.2f}x)")
    auto = [stagers[ep].prefer(plan, remote) for ep, plan in zip(initiators, plans, strict=True)]
    print(f"post(how='auto') would choose: {'staged' if any(auto) else 'direct'} "
          "(cost model with default costs; Stager.calibrate measures them)")
    if not direct_ok:
        print("MISMATCH: the direct transfer's bytes differ from kvplan.simulate")
    return direct_ok


def _peer_ranks(plan: TransferPlan, push: bool) -> np.ndarray:
    rows = plan.copies()
    return rows["dst_rank"] if push else rows["src_rank"]


def close(stagers: dict) -> None:
    """Close every Stager (before the endpoints)."""
    for s in stagers.values():
        s.close()
