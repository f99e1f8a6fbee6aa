"""``python -m examples.connector``: etcd, a prefill and a decode engine, requests P -> D.

Starts etcd on loopback, starts the two engine processes (``engine.py``), then acts as the
proxy of a disaggregated server: each request goes to prefill, its block ids (the
``kv_transfer_params``) go to decode, which pulls the KV over NIXL and verifies it. Prints one
line per request (bytes, transfer time, result) and a summary; exits 0 only if every request
was verified and both engines ended with every block free.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time

import numpy as np

from examples.connector.etcd import EtcdServer

MiB = 1 << 20


def _engine(role: str, url: str, tp: int, other: int, blocks: int) -> subprocess.Popen:
    env = {**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", "examples.connector.engine", role, "--etcd", url, "--tp", str(tp),
         "--other-tp", str(other), "--num-blocks", str(blocks)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.connector", description=__doc__)
    ap.add_argument("--requests", type=int, default=100, help="requests to run (default 100)")
    ap.add_argument("--prefill-tp", type=int, default=4, help="prefill ranks (default 4)")
    ap.add_argument("--decode-tp", type=int, default=2, help="decode ranks (default 2)")
    ap.add_argument("--num-blocks", type=int, default=128, help="blocks per engine (default 128)")
    ap.add_argument("--max-tokens", type=int, default=512, help="longest prompt (default 512)")
    ap.add_argument("--seed", type=int, default=0, help="prompt lengths' seed (default 0)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per request")
    a = ap.parse_args(argv)
    if EtcdServer.binary() is None:
        print("etcd is not installed (Debian/Ubuntu: apt-get install etcd-server)",
              file=sys.stderr)
        return 2
    lengths = np.random.default_rng(a.seed).integers(1, a.max_tokens + 1, a.requests).tolist()
    with EtcdServer() as url:
        print(f"etcd at {url}; starting prefill TP{a.prefill_tp} and decode TP{a.decode_tp}",
              file=sys.stderr, flush=True)
        p = _engine("prefill", url, a.prefill_tp, a.decode_tp, a.num_blocks)
        d = _engine("decode", url, a.decode_tp, a.prefill_tp, a.num_blocks)
        try:
            return _proxy(a, p, d, lengths)
        finally:
            for e in (p, d):
                if e.poll() is None:
                    e.kill()
                e.wait()


def _reader(e: subprocess.Popen, events: queue.Queue) -> None:
    for line in e.stdout:
        events.put(json.loads(line))
    events.put({"op": "exit"})


def _proxy(a, p: subprocess.Popen, d: subprocess.Popen, lengths: list[int]) -> int:
    start = time.perf_counter()
    events: queue.Queue = queue.Queue()
    for e in (p, d):
        threading.Thread(target=_reader, args=(e, events), daemon=True).start()

    def send(e: subprocess.Popen, **msg) -> None:
        e.stdin.write(json.dumps(msg) + "\n")
        e.stdin.flush()

    def get() -> dict:
        msg = events.get(timeout=120)
        if msg["op"] == "exit":
            raise RuntimeError("an engine process exited early (its error is above)")
        return msg

    for _ in range(2):  # both engines registered, published in etcd, decode connected
        if (m := get())["op"] != "ready":
            raise RuntimeError(f"expected 'ready' from the engines, got {m}")
    print(f"engines ready (registered, published, connected) in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    for i, n in enumerate(lengths):
        send(p, op="prefill", id=i, tokens=n)
    done: dict[int, dict] = {}
    freed: set[int] = set()
    while len(done) < len(lengths) or len(freed) < len(lengths):
        m = get()
        if m["op"] == "prefilled":  # the kv_transfer_params: prefill's block ids
            send(d, op="decode", id=m["id"], tokens=lengths[m["id"]], src=m["blocks"])
        elif m["op"] == "done":
            done[m["id"]] = m
            if not m["ok"]:  # no notification will come: tell prefill to free
                send(p, op="free", id=m["id"])
                freed.add(m["id"])
            m["tokens"] = lengths[m["id"]]
            print(json.dumps(m) if a.json else
                  f"req {m['id']:4d}  {m['tokens']:4d} tokens  {len(m['dst']):3d} blocks  "
                  f"{m['bytes'] / MiB:7.3f} MiB  {m['ms']:7.2f} ms  "
                  f"{'ok' if m['ok'] else 'FAILED ' + '; '.join(m['errors'])}", flush=True)
        elif m["op"] == "freed":
            freed.add(m["id"])
    wall = time.perf_counter() - t0
    for e in (p, d):
        send(e, op="quit")
    byes = [get(), get()]
    ok = sum(m["ok"] for m in done.values())
    total = sum(m["bytes"] for m in done.values())
    clean = all(b["free"] == b["blocks"] and b["live"] == 0 for b in byes)
    print(f"{ok}/{len(lengths)} requests verified, {total / MiB:.1f} MiB in {wall:.2f} s; "
          + ", ".join(f"{b['role']} {b['free']}/{b['blocks']} blocks free" for b in byes),
          file=sys.stderr, flush=True)
    return 0 if ok == len(lengths) and clean else 1


if __name__ == "__main__":
    sys.exit(main())
