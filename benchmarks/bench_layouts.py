"""Runs per request for every pair of layouts: which axis order to pick.

Llama-3-70B (80 layers, 8 KV heads of 128, bf16, block 16), P TP8 -> D TP4, one 128k-token
request with scattered block ids (``kvplan.examples.request_blocks``), pulled by D rank 0.
Rows: the prefill engine's order; columns: the decode engine's. vLLM's six orders put all 80
layers in one allocation; ``HND split`` is the legacy per-layer layout. Each cell is the number
of runs (= NIXL descriptors) D rank 0 posts for the request; the plan time of the cell is
printed after the table. Run: ``python benchmarks/bench_layouts.py [--tokens 131072]``.

The request is planned in pieces of ``--chunk`` blocks and the runs summed, so that no plan
holds tens of millions of rows at once (an interleaved-K/V order against a split one costs a
run per token). The sum is exact: a run can only continue across two consecutive positions
of a request whose block ids are consecutive on both sides, and the script checks that no
piece boundary has such ids.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvplan import pull_map
from kvplan.examples import llama3_70b, request_blocks
from kvplan.spec import VLLM_ORDERS

LAYOUTS = ("HND", *VLLM_ORDERS)


def label(layout: str) -> str:
    return "HND split (per layer)" if layout == "HND" else layout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128 * 1024)
    ap.add_argument("--num-blocks", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=512, help="blocks per planned piece")
    args = ap.parse_args()
    runs: dict[tuple[str, str], int] = {}
    times: dict[tuple[str, str], float] = {}
    for a in LAYOUTS:
        src = llama3_70b(8, num_blocks=args.num_blocks, layout=a)
        for b in LAYOUTS:
            dst = llama3_70b(4, num_blocks=args.num_blocks, layout=b)
            tmap = pull_map(src, dst, 0)
            rng = np.random.default_rng(0)
            (ids_s,), (ids_d,) = (request_blocks(s, args.tokens, seed=rng) for s in (src, dst))
            cuts = range(args.chunk, len(ids_d), args.chunk)
            joinable = [c for c in cuts if ids_s[c] == ids_s[c - 1] + 1
                        and ids_d[c] == ids_d[c - 1] + 1]
            if joinable:
                raise SystemExit(f"piece boundaries {joinable} could join runs: change --chunk")
            runs[(a, b)], times[(a, b)] = 0, 0.0
            for at in range(0, len(ids_d), args.chunk):
                piece_s, piece_d = [ids_s[at:at + args.chunk]], [ids_d[at:at + args.chunk]]
                t = time.perf_counter()
                plan = tmap.plan(piece_s, piece_d)
                times[(a, b)] += time.perf_counter() - t
                runs[(a, b)] += len(plan)
                del plan
    print(f"Runs per request, D rank 0, {args.tokens // 1024}k tokens, scattered ids "
          "(rows: P TP8 order, columns: D TP4 order)\n")
    print("| P \\ D | " + " | ".join(label(b) for b in LAYOUTS) + " |")
    print("|---|" + "---:|" * len(LAYOUTS))
    for a in LAYOUTS:
        print(f"| {label(a)} | " + " | ".join(f"{runs[(a, b)]:,}" for b in LAYOUTS) + " |")
    print("\nplan() time per cell (ms, the pieces summed):\n")
    print("| P \\ D | " + " | ".join(label(b) for b in LAYOUTS) + " |")
    print("|---|" + "---:|" * len(LAYOUTS))
    for a in LAYOUTS:
        print(f"| {label(a)} | " + " | ".join(f"{times[(a, b)] * 1e3:.0f}" for b in LAYOUTS)
              + " |")


if __name__ == "__main__":
    main()
