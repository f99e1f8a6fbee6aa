"""Benchmark of the transfer digest: its cost per request against the pull it checks.

    python benchmarks/bench_digest.py              # about a minute on 2 cores

Llama-3-70B (80 layers), P TP8 -> D TP4, decode rank 0 (it reads 2 prefill ranks), random
bytes. Two requests of scattered block ids (a run per block, layer, K/V and prefill rank):
``--tokens`` (2048) and an eighth of it (its fixed costs show). Per request, medians of
interleaved repetitions: the pull (``plan()`` + ``read()`` + ``wait()``), the source side's
digests (each prefill rank over the bytes decode rank 0 reads from it, what a prefill's
``PUSHED`` carries), the destination side's (decode rank 0 over what it received), and the
plan the connector's decode check makes again (push mode). Every repetition checks that the two
sides' digests agree. Pull mode's exchange (:mod:`kvplan_nixl.serving.pull_digest_io`) is run too,
with the connector's messages over real NIXL notifications: decode rank 0 asks each prefill rank
(``DIGASK``), each replans with its push map, digests its side and answers (``DIGEST``); the
decode digests its own side meanwhile, so what a pull gains is the longer of the two. Printed
as markdown tables of ratios against the pull measured in the same run (docs/performance.md,
"Transfer digest").
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
from kvplan_nixl import Digester
from kvplan_nixl.serving.pull_digests import DigestAsk, digest_answer, parse_answer


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def _notices(ep, n: int) -> list:
    """The next ``n`` notifications of ``ep`` (polled; 10 s at most)."""
    got, end = [], time.perf_counter() + 10
    while len(got) < n:
        assert time.perf_counter() < end, "no notification within 10 s"
        got += ep.notifications()
    return got


def exchange(eng: Engines, srcs: list[Digester], sb: list, db: list,
             tokens: tuple[int, int]) -> tuple[float, float, float, dict]:
    """One pull digest exchange, the prefill ranks in turn (each its own engine in a
    deployment): seconds in all, the prefill ranks' replan + digest (the slowest's, all of
    theirs), the answers."""
    t0 = time.perf_counter()
    ask = DigestAsk("req", 1, "dreq", "127.0.0.1", 1, tuple(tuple(g) for g in db), *tokens)
    eng.d.notify("prefill", eng.peers, ask.encode())
    slowest = work = 0.0
    for ep, d in zip(eng.p, srcs):
        (n,) = _notices(ep, 1)
        s0 = time.perf_counter()
        a = DigestAsk.decode(n.message)
        plan = ep.map("decode", "push").plan(sb, [list(g) for g in a.lists],
                                             tokens=(a.start, a.end))
        answer = digest_answer(a.decode_req, d.digests(plan, "src")[0])
        slowest = max(slowest, time.perf_counter() - s0)
        work += time.perf_counter() - s0
        ep.notify("decode", [0], answer)
    got = {n.rank: parse_answer(n.message)[1] for n in _notices(eng.d, len(eng.p))}
    return time.perf_counter() - t0, slowest, work, got


def measure(eng: Engines, sb: list, db: list, tokens: tuple[int, int], reps: int) -> dict:
    """Median seconds of each step over ``reps`` interleaved repetitions."""
    tmap = eng.d.map("prefill")
    srcs = [Digester(eng.src, r, eng.sbufs[r]) for r in eng.peers]
    dst = Digester(eng.dst, 0, eng.dbufs)
    t: dict[str, list[float]] = {k: [] for k in ("pull", "src", "dst", "plan", "exchange",
                                                 "slowest", "messages")}
    plan = None
    for rep in range(reps + 1):  # the first is a warm-up, not counted
        t0 = time.perf_counter()
        plan = tmap.plan(sb, db, tokens=tokens)
        eng.read(plan)
        t1 = time.perf_counter()
        sent = {}
        for p, d in zip(eng.peers, srcs):  # the prefill ranks work in parallel: the slowest
            s0 = time.perf_counter()
            sent[p] = d.digests(plan, "src")[0]
            if rep:
                t["src"].append(time.perf_counter() - s0)
        t2 = time.perf_counter()
        got = dst.digests(plan, "dst")
        t3 = time.perf_counter()
        tmap.plan(sb, db, tokens=tokens)
        t4 = time.perf_counter()
        assert got == sent, (got, sent)  # what arrived is what was read
        ex, slowest, work, answers = exchange(eng, srcs, sb, db, tokens)
        assert answers == sent, (answers, sent)  # the prefill's own replan: the same digests
        if rep:
            t["pull"].append(t1 - t0)
            t["dst"].append(t3 - t2)
            t["plan"].append(t4 - t3)
            t["exchange"].append(ex)
            t["slowest"].append(slowest)
            t["messages"].append(ex - work)
    out = {k: statistics.median(v) for k, v in t.items()}
    out["runs"], out["nbytes"] = len(plan), plan.nbytes
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    nb = 2 * args.tokens // 16
    src, dst = llama3_70b(8, num_blocks=nb), llama3_70b(4, num_blocks=nb)
    eng = Engines(src, dst)
    for ep in eng.p:  # a prefill rank answers a pull's digest as a push connects: push mode
        ep.connect(eng.d.metadata(), mode="push")
    try:
        rng = np.random.default_rng(0)
        for bufs in eng.sbufs.values():  # random bytes: a digest of constants proves little
            for b in {id(b): b for b in bufs}.values():
                b[:] = rng.integers(0, 256, b.size, dtype=np.uint8)
        print("| request (D rank 0 of TP4 from 2 of TP8) | runs | MiB | pull | "
              "source digest (per prefill rank) | destination digest | replan (push check) | "
              "source / pull | destination / pull | both + replan / pull | digest GB/s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        rows = []
        for n in (args.tokens // 16, args.tokens // 128):  # blocks of 16 tokens
            sb, db = [rng.permutation(nb)[:n].tolist()], [rng.permutation(nb)[:n].tolist()]
            name = f"{n * 16} tokens, scattered"
            m = measure(eng, sb, db, (0, n * 16 - 8), args.reps)
            rows.append((name, m))
            pull = m["pull"]
            both = m["src"] + m["dst"] + m["plan"]
            rate = m["nbytes"] / m["dst"] / 1e9
            print(f"| {name} | {m['runs']} | {m['nbytes'] / 2**20:.0f} | {pull * 1e3:.1f} ms | "
                  f"{m['src'] * 1e3:.1f} ms | {m['dst'] * 1e3:.1f} ms | "
                  f"{m['plan'] * 1e3:.1f} ms | {m['src'] / pull:.2f}x | "
                  f"{m['dst'] / pull:.2f}x | {both / pull:.2f}x | {rate:.2f} |")
        print("\n| pull mode's exchange | pull | exchange, prefill ranks in turn | slowest "
              "prefill rank (replan + digest) | messages and the rest | decode's digest | "
              "added: max(decode, messages + slowest) | added / pull |")
        print("|---|---|---|---|---|---|---|---|")
        for name, m in rows:
            msgs = m["messages"]  # the exchange less the prefill ranks' work
            added = max(m["dst"], msgs + m["slowest"])
            print(f"| {name} | {m['pull'] * 1e3:.1f} ms | {m['exchange'] * 1e3:.1f} ms | "
                  f"{m['slowest'] * 1e3:.1f} ms | {msgs * 1e3:.1f} ms | "
                  f"{m['dst'] * 1e3:.1f} ms | {added * 1e3:.1f} ms | "
                  f"{added / m['pull']:.2f}x |")
    finally:
        eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
