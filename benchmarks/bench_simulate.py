"""``kvplan.simulate`` (the reference executor over numpy buffers) against a plain numpy copy.

    python benchmarks/bench_simulate.py        # prints a markdown table

The connector author's check: Llama-3.1-70B, prefill TP8 ``LBHNC`` -> decode TP4 ``BLHNC``, a
request of 3000 tokens with a 1024-token prefix hit (positions 1024..3000 copied), decode rank
0: a 154 MiB plan of 19,840 runs. Goal: at least 1 GB/s, stated as a ratio to ``np.copyto``
of the same number of bytes measured in the same run (warm buffers on both). A second row
plans the same request with NHD on both sides: many short runs, the fancy-indexing path.
Times are medians of repeated runs.
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_plan import median_time  # benchmarks/ is on sys.path when run as a script

import kvplan
from kvplan import presets


def _case(name: str, src_layout: str, dst_layout: str, repeat: int) -> str:
    from kvplan.cli.explain import request

    kw = {"num_blocks": 400}
    src = presets.spec("llama-3.1-70b", 8, layout=src_layout, **kw)
    dst = presets.spec("llama-3.1-70b", 4, layout=dst_layout, **kw)
    plan = kvplan.pull_map(src, dst, 0).plan(request(src, 3000), request(dst, 3000),
                                             tokens=(1024, 3000))
    rng = np.random.default_rng(0)
    srcs = {(r, name): rng.integers(0, 256, src.rank_buffer_nbytes(b), dtype=np.uint8)
            for r in plan.peers for b, name in enumerate(src.buffers)}
    dsts = {(0, name): np.zeros(dst.rank_buffer_nbytes(b), np.uint8)
            for b, name in enumerate(dst.buffers)}
    n = plan.nbytes
    flat_src = rng.integers(0, 256, n, dtype=np.uint8)
    flat_dst = np.zeros(n, np.uint8)
    kvplan.simulate(plan, srcs, dsts)  # warm: every destination page touched once
    np.copyto(flat_dst, flat_src)
    t_sim = median_time(lambda: kvplan.simulate(plan, srcs, dsts), repeat)
    t_copy = median_time(lambda: np.copyto(flat_dst, flat_src), repeat)
    return (f"| {name} | {n / 2**20:.1f} MiB | {len(plan):,} | {t_sim * 1e3:.1f} ms | "
            f"**{n / t_sim / 1e9:.2f} GB/s** | {n / t_copy / 1e9:.2f} GB/s | "
            f"**{t_sim / t_copy:.2f}x** |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--repeat", type=int, default=7, help="timed runs per row (median)")
    args = ap.parse_args()
    print("| plan (Llama-3.1-70B, P TP8 -> D TP4, tokens 1024:3000, d0) | bytes | runs | "
          "simulate | rate | np.copyto rate | simulate / copy |")
    print("|---|---|---|---|---|---|---|")
    for name, s, d in (("LBHNC -> BLHNC", "LBHNC", "BLHNC"), ("NHD -> NHD", "NHD", "NHD")):
        print(_case(name, s, d, args.repeat), flush=True)


if __name__ == "__main__":
    main()
