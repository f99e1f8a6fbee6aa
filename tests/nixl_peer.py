"""A peer engine in its own OS process, for the two-process tests (run as a script).

    python tests/nixl_peer.py --engine prefill --rank 1 --spec '<EngineSpec JSON>' \
        --seed 7 --metadata-out /tmp/x.md

Creates one Endpoint over numpy buffers filled by :func:`buffers` (so the test can recompute every
byte), writes ``Endpoint.metadata()`` to ``--metadata-out`` (atomically), prints ``ready``, then
progresses its agent (it has no progress thread) until its stdin closes or says ``quit``. On
exit it prints one JSON line: the notifications it received and a sha256 per region.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import sys
import time

import numpy as np


def buffers(spec, rank: int, seed: int, how: str) -> list[np.ndarray]:
    """One array per region ``rank`` holds (spec order; the regions of a pool share one), a
    function of (spec, rank, seed, how) only, so the test that started this process can
    recompute every byte."""
    from tests import oracle

    held = spec.regions_on(rank)
    if how == "oracle":
        every = oracle.source_buffers(spec.to_dict(), seed=seed)
    elif how == "sentinel":
        every = oracle.destination_buffers(spec.to_dict(), seed=seed)
    else:
        every = {
            (rank, i): np.random.default_rng([seed, rank, i]).integers(
                0, 256, spec.rank_region_nbytes(i), dtype=np.uint8)
            for i in held if spec.allocation_of(i) == i
        }
        every.update({(rank, i): every[(rank, spec.allocation_of(i))] for i in held})
    return [every[(rank, i)] for i in held]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--spec", required=True, help="EngineSpec as JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--fill", choices=["oracle", "random", "sentinel"], default="oracle",
        help="oracle: tests/oracle.py source bytes; sentinel: its destination pattern",
    )
    ap.add_argument("--metadata-out", required=True)
    ap.add_argument("--stager", default="", help="POOL_BYTES,SLOT_BYTES[,WINDOW]: serve staged "
                    "transfers (kvplan_nixl.staged) from a pool of that size")
    ap.add_argument("--connect", nargs=2, metavar=("FILE", "MODE"), action="append",
                    default=[], help="wait for an initiator's metadata in FILE, connect it in "
                    "MODE (repeatable)")
    ap.add_argument("--max-nap", type=float, default=None,
                    help="seconds: cap of the polling loop's naps (an experiment's knob)")
    args = ap.parse_args()
    if args.max_nap is not None:
        from kvplan_nixl import transfer

        transfer.MAX_SLEEP_SECONDS = args.max_nap

    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from kvplan import EngineSpec
    from kvplan_nixl import Endpoint

    spec = EngineSpec.from_dict(json.loads(args.spec))
    bufs = buffers(spec, args.rank, args.seed, args.fill)
    notes = []
    stager_handles = None
    with Endpoint(args.engine, spec, args.rank, bufs) as ep:
        stager = None
        if args.stager:  # before metadata(): the peer's NIXL metadata must include the pool
            from kvplan_nixl.staged import Stager

            pool, slot, *window = (int(x) for x in args.stager.split(","))
            stager = Stager(ep, pool_bytes=pool, slot_bytes=slot, window=(window or [2])[0])
        tmp = args.metadata_out + ".tmp"
        with open(tmp, "wb") as f:
            f.write(ep.metadata())
        os.replace(tmp, args.metadata_out)
        print("ready", flush=True)
        for path, mode in args.connect:
            while not os.path.exists(path):
                time.sleep(1e-3)
            with open(path, "rb") as f:
                ep.connect(f.read(), mode=mode)
        if args.connect:
            print("connected", flush=True)
        from kvplan_nixl.transfer import drive

        def quit_asked() -> bool:
            notes.extend([n.engine, n.rank, n.message.decode()] for n in ep.notifications())
            ready, _, _ = select.select([sys.stdin], [], [], 0)
            if not ready:
                return False
            line = sys.stdin.readline()
            return not line or line.strip() == "quit"

        # a server's loop: poll again soon after work, nap up to 1 ms when idle
        if stager is not None:
            stager.serve(quit_asked)
        else:
            drive(ep.progress, quit_asked)
        grace = time.monotonic() + 0.2  # a notification may trail its transfer a moment
        while time.monotonic() < grace:
            if stager is not None:
                stager.poll()
            notes += [[n.engine, n.rank, n.message.decode()] for n in ep.notifications()]
            time.sleep(1e-3)
        if stager is not None:
            stager_handles = stager.handles()
            stager.close()
    digests = [hashlib.sha256(b.tobytes()).hexdigest() for b in bufs]
    print(json.dumps({"notifications": notes, "sha256": digests, "stager": stager_handles}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
