"""Benchmark of layer-wise posting: one request in 80 parts against the same request at once.

    python benchmarks/bench_layerwise.py            # about half a minute on 2 cores

Llama-3-70B (80 layers), P TP8 -> D TP4, a scattered request of 2048 tokens with a partly
filled last block (``tokens=(0, 2040)``). Single shot: ``plan()`` then ``read(plan)``. Layer-wise:
``plan()``, ``Endpoint.request(plan)``, then per layer ``post([layer])`` (80 parts,
each one NIXL transfer per peer rank), then ``end()``. Timed: planning and posting (the CPU work
on the request path), not the wire; each repetition is waited for, untimed, before the next.
Goal (issue 10): layer-wise at most 1.2x the single shot. Over UCX on one host the READs are
performed inside NIXL's post call (shared memory), so "post" here includes moving the bytes;
the time to completion is printed too. Printed as a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_executor import Engines
from kvplan.examples import llama3_70b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    nb = 2 * args.tokens // 16
    src, dst = llama3_70b(8, num_blocks=nb), llama3_70b(4, num_blocks=nb)
    eng = Engines(src, dst)
    try:
        rng = np.random.default_rng(0)
        n = args.tokens // 16
        sb, db = [rng.permutation(nb)[:n].tolist()], [rng.permutation(nb)[:n].tolist()]
        tokens = (0, args.tokens - 8)
        tmap = eng.d.map("prefill")
        names = [r.name for r in dst.regions]
        agent = eng.d._agent
        post = agent.transfer
        in_post = [0.0]

        def timed_transfer(*a, **kw):  # time inside NIXL's post, where loopback copies
            t = time.perf_counter()
            try:
                return post(*a, **kw)
            finally:
                in_post[0] += time.perf_counter() - t

        agent.transfer = timed_transfer

        def single():
            in_post[0] = 0.0
            t0 = time.perf_counter()
            plan = tmap.plan(sb, db, tokens=tokens)
            t = eng.d.read(plan, "prefill")
            dt = time.perf_counter() - t0
            t.wait(60, progress=eng.p)
            return dt, time.perf_counter() - t0, dt - in_post[0]

        def layerwise():
            in_post[0] = 0.0
            t0 = time.perf_counter()
            plan = tmap.plan(sb, db, tokens=tokens)
            req = eng.d.request(plan, "prefill", notify=b"done")
            for name in names:
                req.post([name])  # as plan.part([name]), without building the part
            req.end()
            dt = time.perf_counter() - t0
            req.wait(60, progress=eng.p)
            done = time.perf_counter() - t0
            for ep in eng.p:
                ep.notifications()
            return dt, done, dt - in_post[0]

        single()
        layerwise()
        t_one, t_parts, t_plan = [], [], []
        for _ in range(args.reps):  # interleaved, so that load from other work hits both
            t_one.append(single())
            t_parts.append(layerwise())
            t0 = time.perf_counter()
            plan = tmap.plan(sb, db, tokens=tokens)
            t_plan.append(time.perf_counter() - t0)
        a, b = (statistics.median(x[0] for x in t) for t in (t_one, t_parts))
        a2, b2 = (statistics.median(x[1] for x in t) for t in (t_one, t_parts))
        a3, b3 = (statistics.median(x[2] for x in t) for t in (t_one, t_parts))
        p = statistics.median(t_plan)
        rows = len(plan.copies())
        parts = [plan.part([name]) for name in names]
        t0 = time.perf_counter()
        for name in names:
            plan.part([name])
        t_slice = time.perf_counter() - t0
        print("| measure | result | goal | |")
        print("|---|---|---|---|")
        print(f"| request: Llama-3-70B P TP8 -> D TP4, tokens 0:{tokens[1]}, scattered | "
              f"{rows} runs, {plan.nbytes / 2**20:.0f} MiB, {len(eng.peers)} peers | | |")
        print(f"| plan() alone | {p * 1e3:.2f} ms | | |")
        print(f"| 80 x plan.part([layer]) alone | {t_slice * 1e3:.2f} ms "
              f"({sum(len(x) for x in parts)} runs) | | |")
        print(f"| single shot: plan + read | {a * 1e3:.2f} ms | | |")
        print(f"| layer-wise: plan + request + 80 x post([layer]) + end | {b * 1e3:.2f} ms "
              "| | |")
        print(f"| layer-wise / single shot | {b / a:.3f}x | <= 1.2x | "
              f"{'met' if b / a <= 1.2 else 'NOT met'} |")
        print(f"| the same without the time inside NIXL's transfer(): single / layer-wise | "
              f"{a3 * 1e3:.2f} ms / {b3 * 1e3:.2f} ms | | |")
        print(f"| layer-wise / single shot, without NIXL's transfer() | {b3 / a3:.3f}x | "
              f"<= 1.2x | {'met' if b3 / a3 <= 1.2 else 'NOT met'} |")
        print(f"| to completion (+ wait): single shot / layer-wise | {a2 * 1e3:.2f} ms / "
              f"{b2 * 1e3:.2f} ms ({b2 / a2:.3f}x) | | |")
    finally:
        eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
