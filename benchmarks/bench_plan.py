"""Request-path and handshake benchmarks of the planning core, as ratios to a same-run baseline.

    python benchmarks/bench_plan.py            # prints a markdown table

1. Llama-3-70B-like engine (80 layers, 8 KV heads of 128, bf16, HND split, block 16), P TP8 ->
   D TP4, one 128k-token request with scattered block ids: ``plan()`` + ``copies()`` against
   numpy filling an int64 array of the same size (rows x 7 fields). Goal: within 10x.
2. ``pull_map`` at 1e3 vs 1e6 ``num_blocks``. Goal: within 2x (handshake work is per block
   template, independent of num_blocks).
Extra rows show layouts that cost more runs (NHD under hetero TP), a mixed GQA + MLA model and
two hybrids (state parts, shared pools, kernel blocks).
Times are medians of repeated runs; ratios, not absolute times, are what carries over.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvplan import pull_map
from kvplan.cli.progress import step
from kvplan.examples import (
    gqa_with_mla_draft,
    kimi_linear_like,
    llama3_70b,
    nemotron_h_like,
    request_blocks,
)


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def request_path(name: str, src, dst, tokens: int, repeat: int) -> list[str]:
    tmap = pull_map(src, dst, 0)
    rng = np.random.default_rng(0)
    lists_s, lists_d = (request_blocks(s, tokens, seed=rng) for s in (src, dst))
    rows = len(tmap.plan(lists_s, lists_d).copies())
    t_plan = median_time(lambda: tmap.plan(lists_s, lists_d).copies(), repeat)
    t_fill = median_time(lambda: np.full(rows * 7, 1, dtype=np.int64), repeat)
    return [
        f"| {name} | {tokens // 1024}k | {rows:,} | {t_plan * 1e3:.1f} ms | "
        f"{t_fill * 1e3:.1f} ms | **{t_plan / t_fill:.2f}x** |"
    ]


def handshake(repeat: int) -> list[str]:
    out = []
    base = None
    for nb in (1_000, 1_000_000):
        src, dst = llama3_70b(8, num_blocks=nb), llama3_70b(4, num_blocks=nb)
        t = median_time(lambda s=src, d=dst: pull_map(s, d, 0), repeat)
        base = base or t
        out.append(f"| pull_map, Llama-3-70B P TP8 -> D TP4 | {nb:,} | {t * 1e3:.2f} ms | "
                   f"**{t / base:.2f}x** |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--repeat", type=int, default=11, help="timed runs per row (median)")
    repeat = ap.parse_args().repeat
    print("\n".join([
        "### Request path: `plan()` + `copies()` vs `np.full` of the same int64 size",
        "",
        "| engine pair | request | runs | plan + copies | np.full | ratio |",
        "|---|---|---|---|---|---|",
    ]), flush=True)
    cases = [  # each row prints as soon as it is measured
        ("Llama-3-70B HND, P TP8 -> D TP4", lambda: (llama3_70b(8, num_blocks=16384),
                                                      llama3_70b(4, num_blocks=16384)), 128),
        ("Llama-3-70B NHD, P TP8 -> D TP4",
         lambda: (llama3_70b(8, num_blocks=16384, layout="NHD"),
                  llama3_70b(4, num_blocks=16384, layout="NHD")), 32),
        ("GQA + MLA draft (4+1 layers), P TP4 -> D TP2",
         lambda: (gqa_with_mla_draft(4, num_blocks=16384),
                  gqa_with_mla_draft(2, num_blocks=16384)), 128),
        ("KimiLinear-like (12 MLA + 12 KDA, pooled, kernel 16), P TP2 -> D TP4",
         lambda: (kimi_linear_like(2, layers=12, num_blocks=8192, heads=32, head_dim=128),
                  kimi_linear_like(4, layers=12, num_blocks=8192, heads=32, head_dim=128)), 128),
        ("Nemotron-H-like (24 Mamba2 + 1 attention), P TP1 -> D TP4",
         lambda: (nemotron_h_like(1, num_blocks=16384, num_slots=64, mamba_layers=24),
                  nemotron_h_like(4, num_blocks=16384, num_slots=64, mamba_layers=24)), 128),
    ]
    for name, engines, ktokens in cases:
        with step(f"measuring {name}"):
            lines = request_path(name, *engines(), ktokens * 1024, repeat)
        print("\n".join(lines), flush=True)
    print("\n".join([
        "",
        "### Handshake: `pull_map` at 1e3 vs 1e6 `num_blocks`",
        "",
        "| map | num_blocks | time | vs 1e3 |",
        "|---|---|---|---|",
    ]), flush=True)
    with step("measuring pull_map"):
        lines = handshake(repeat)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
