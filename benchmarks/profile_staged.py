"""Where a staged transfer's time goes: a timeline of one staged pull and push (one process).

    python benchmarks/profile_staged.py [--tokens 2048] [--layers 80]

Wraps the Stager's steps (stage() planning, SideIndex building and its per-chunk slicing,
gather, scatter, NIXL post -> completion) with timers and prints, per request, the sum per
step and the timeline (ms from the request's start) per chunk, so one can see whether legs of
chunks overlap.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from bench_staged import World, _llama

import kvplan_nixl.staged as staged
from kvplan_nixl.staged import initiator, legs, server

EVENTS: list[tuple[str, str, float, float]] = []  # (step, thread, start, end)
_LOCK = threading.Lock()
QUIET = False
STARTS: list[float] = []  # when each staged request was posted
DONE: list = []  # its StagedTransfer


def _wrap(obj, name, label):
    fn = getattr(obj, name)

    def w(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            with _LOCK:
                EVENTS.append((label, threading.current_thread().name, t, time.perf_counter()))
    setattr(obj, name, w)


def install() -> None:
    _wrap(initiator, "stage", "stage()")
    _wrap(server, "stage", "stage()")
    _wrap(legs.SideIndex, "chunk", "chunk ops")
    _wrap(legs.SideIndex, "__init__", "side index")
    _wrap(legs, "gather", "gather")
    _wrap(legs, "scatter", "scatter")
    post = initiator.Initiator._post
    posted = {}

    def _post(self, j, k, slot, rslot):
        posted[(id(j), k)] = time.perf_counter()
        return post(self, j, k, slot, rslot)
    initiator.Initiator._post = _post
    adv = initiator.Initiator._advance

    def _advance(self, j):
        before = set(j.xfers)
        n = adv(self, j)
        now = time.perf_counter()
        for k in before - set(j.xfers):
            t0 = posted.pop((id(j), k), None)
            if t0 is not None:
                with _LOCK:
                    EVENTS.append((f"nixl {k}", "main", t0, now))
        return n
    initiator.Initiator._advance = _advance
    start = initiator.Initiator.start

    def _start(self, *a, **k):
        STARTS.append(time.perf_counter())
        t = start(self, *a, **k)
        DONE.append(t)
        return t
    initiator.Initiator.start = _start


def report(label: str, t0: float, t1: float) -> None:
    ev = [e for e in EVENTS if t0 <= e[2] <= t1]
    tot = collections.defaultdict(float)
    cnt = collections.Counter()
    for s, _, a, b in ev:
        key = "nixl bulk" if s.startswith("nixl") else s
        tot[key] += b - a
        cnt[key] += 1
    print(f"\n== {label}: {1e3 * (t1 - t0):.1f} ms wall")
    for k in sorted(tot, key=lambda k: -tot[k]):
        print(f"  {k:12s} n={cnt[k]:3d} sum {1e3 * tot[k]:7.1f} ms  "
              f"mean {1e3 * tot[k] / cnt[k]:6.2f} ms")
    busy = sum(b - a for s, th, a, b in ev if s in ("gather", "scatter", "chunk ops", "side index"))
    print(f"  local legs busy {1e3 * busy:.1f} ms of {1e3 * (t1 - t0):.1f} ms wall")
    for s, th, a, b in [] if QUIET else sorted(ev, key=lambda e: e[2]):
        print(f"    {1e3 * (a - t0):7.1f} -> {1e3 * (b - t0):7.1f}  {s:12s} [{th}]")


def two_process(args) -> None:
    import bench_staged

    marks = []
    orig = bench_staged._median_time

    def timed(fn, reps):  # mark the staged requests' windows
        t0 = time.perf_counter()
        r = orig(fn, reps)
        marks.append((t0, time.perf_counter(), r))
        return r
    bench_staged._median_time = timed
    for row in bench_staged.bench_two_process(args.tokens, args.layers, 3):
        print(" | ".join(row))
    # per mode, 3 reps of (numpy, direct, staged): the last staged window of each mode
    for label, (t0, t1, _) in (("pull", marks[8]), ("push", marks[17])):
        report(f"two processes, {label} staged (last), this process's side", t0, t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--window", type=int, default=None, help="Stager window (default: its own)")
    ap.add_argument("--two-process", action="store_true",
                    help="the other engine in its own processes (bench_staged's setup); "
                    "only this process's steps are timed")
    ap.add_argument("--quiet", action="store_true", help="sums only, no timeline")
    args = ap.parse_args()
    if args.window is not None:
        staged.Stager.__init__.__kwdefaults__["window"] = args.window
    global QUIET
    QUIET = args.quiet
    install()
    if args.two_process:
        two_process(args)
        return
    n = args.tokens // 16
    nb = n + 16
    w = World(_llama(8, args.layers, nb), _llama(4, args.layers, nb))
    try:
        rng = np.random.default_rng(0)
        sb, db = [rng.permutation(nb)[:n].tolist()], [rng.permutation(nb)[:n].tolist()]
        nbytes = w.d.map("prefill").plan(sb, db).nbytes
        a, b = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        for mode in ("pull", "push"):
            go = w.pull if mode == "pull" else w.push
            go(sb, db, "direct")
            go(sb, db, "staged")
            w.drain()
            for _ in range(2):
                t = time.perf_counter()
                np.copyto(b, a)
                tn = time.perf_counter() - t
                t = time.perf_counter()
                go(sb, db, "direct")
                td = time.perf_counter() - t
                t0 = time.perf_counter()
                go(sb, db, "staged")
                t1 = time.perf_counter()
                w.drain()
                print(f"\n{mode}: numpy {1e3 * tn:.1f} ms, direct {1e3 * td:.1f} ms, "
                      f"staged {1e3 * (t1 - t0):.1f} ms")
            report(f"{mode} staged (last)", t0, t1)
    finally:
        w.close()


if __name__ == "__main__":
    main()
