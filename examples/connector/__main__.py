"""python -m examples.connector: etcd, a prefill and a decode engine, requests P -> D.

Starts etcd on loopback, starts the two engine processes (engine.py), then acts as the
proxy of a disaggregated server: each request goes to prefill, its block ids (the
kv_transfer_params) go to decode, which pulls the KV over NIXL and verifies it. Prints one
line per request (bytes, transfer time, result) and a summary; exits 0 only if every request
was verified and both engines ended with every block free.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import time
from multiprocessing.connection import Connection, wait

import numpy as np

from examples.connector.engine import BLOCKS, run
from examples.connector.etcd import etcd_server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.connector", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100, help="requests to run (default 100)")
    ap.add_argument("--prefill-tp", type=int, default=4, help="prefill ranks (default 4)")
    ap.add_argument("--decode-tp", type=int, default=2, help="decode ranks (default 2)")
    ap.add_argument("--max-tokens", type=int, default=512, help="longest prompt (default 512)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per request")
    a = ap.parse_args(argv)
    if not 0 < a.max_tokens <= 16 * BLOCKS:  # a longer prompt would never fit an engine
        ap.error(f"--max-tokens must be in 1..{16 * BLOCKS} ({BLOCKS} blocks of 16 tokens)")
    if shutil.which("etcd") is None:
        sys.exit("etcd is not installed (Debian/Ubuntu: apt-get install etcd-server)")
    lengths = np.random.default_rng(0).integers(1, a.max_tokens + 1, a.requests).tolist()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    print("starting etcd, then the engines (importing NIXL takes seconds)", file=sys.stderr)
    spawn = multiprocessing.get_context("spawn")  # fresh interpreters, nothing forked
    with etcd_server() as url:
        (p, p_end), (d, d_end) = spawn.Pipe(), spawn.Pipe()  # the proxy's end, the engine's
        engines = [spawn.Process(target=run, args=args) for args in (
            ("prefill", url, a.prefill_tp, a.decode_tp, p_end),
            ("decode", url, a.decode_tp, a.prefill_tp, d_end))]
        for e in engines:
            e.start()
        try:
            return proxy(a, p, d, [e.sentinel for e in engines], lengths)
        finally:
            for e in engines:
                e.kill()
                e.join()


def proxy(a, p: Connection, d: Connection, sentinels: list[int], lengths: list[int]) -> int:
    """The disaggregated server's proxy: prompt to prefill, its block ids to decode."""
    start = time.perf_counter()

    def get() -> dict:  # the next message of either engine
        for ready in wait([p, d, *sentinels], timeout=120):
            if ready in (p, d):
                return ready.recv()
        raise RuntimeError("an engine exited (its error is above) or was silent for 2 minutes")

    get(), get()  # "ready" from each: ranks registered, published in etcd, decode connected
    t0 = time.perf_counter()
    print(f"prefill TP{a.prefill_tp} and decode TP{a.decode_tp} ready in {t0 - start:.1f} s",
          file=sys.stderr, flush=True)
    for i, n in enumerate(lengths):
        p.send({"op": "prefill", "id": i, "tokens": n})
    done, freed = {}, set()
    while len(done) < len(lengths) or len(freed) < len(lengths):
        m = get()
        if m["op"] == "prefilled":  # the kv_transfer_params: prefill's block ids
            d.send({"op": "decode", "id": m["id"], "tokens": lengths[m["id"]], "src": m["blocks"]})
        elif m["op"] == "freed":
            freed.add(m["id"])
        elif m["op"] == "done":
            done[m["id"]] = m = m | {"tokens": lengths[m["id"]]}
            if not m["ok"]:  # some notification may never come: prefill frees on our word
                p.send({"op": "free", "id": m["id"]})
                freed.add(m["id"])
            print(json.dumps(m) if a.json else
                  f"req {m['id']:4d}  {m['tokens']:4d} tokens  {len(m['dst']):3d} blocks  "
                  f"{m['bytes'] / 2**20:7.3f} MiB  {m['ms']:7.2f} ms  "
                  f"{'ok' if m['ok'] else 'FAILED ' + '; '.join(m['errors'])}", flush=True)
    wall = time.perf_counter() - t0
    byes = []  # each engine's free blocks; decode first: its Endpoints' goodbyes reach prefill
    for e in (d, p):
        e.send({"op": "quit"})
        byes.append(get())
    ok = sum(m["ok"] for m in done.values())
    print(f"{ok}/{len(lengths)} requests verified, "
          f"{sum(m['bytes'] for m in done.values()) / 2**20:.1f} MiB in {wall:.2f} s; "
          + ", ".join(f"{b['role']} {b['free']}/{b['blocks']} blocks free" for b in byes),
          file=sys.stderr, flush=True)
    return 0 if ok == len(lengths) and all(b["free"] == b["blocks"] for b in byes) else 1


if __name__ == "__main__":
    sys.exit(main())
