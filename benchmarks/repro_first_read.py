"""A first read from two fresh "stock" NIXL agents, with no vLLM engine (issue 46, item 3).

docs/vllm.md, "A first read that hangs": a kvplan TP 1 decode's first read from a stock vLLM
NixlConnector TP 2 prefill (one plan reading both of its ranks at once) sometimes never
completed on one rank. This script repeats that first read with bare NIXL agents:

- two *stock-like* agents, each in its own process (like an engine's workers), configured as
  vLLM 0.32's NixlConnector configures its agent (``nixl_agent_config(num_threads=4,
  capture_telemetry=True)``: NIXL's defaults otherwise, so a progress thread, UCX only; the
  environment the engine tests give it: ``UCX_NET_DEVICES=lo``, ``UCX_MODULES=^efa``, and
  ``UCX_RCACHE_MAX_UNRELEASED=1024`` which vLLM sets), each registering a few DRAM regions
  (a layer's K and V each, as vLLM registers its caches) filled with a known pattern;
- a *reader* agent configured as kvplan configures its own (``kvplan_nixl._nixl.make_agent``:
  no progress thread, no UCX threads, kvplan's UCX TCP segment sizes), which loads both
  agents' metadata and posts one READ per agent at once (as ``Endpoint.read`` posts one
  plan spanning both ranks), then polls ``check_xfer_state`` until both are DONE or a
  deadline passes, and checks the bytes.

Each run starts a fresh pair of stock processes (and, with ``--fresh-reader``, a fresh reader
process); ``--runs`` runs, a line per run, a summary line at the end. The variants:
``--stock-threads`` (vLLM's 4, or 0), ``--stock-pt`` (progress thread on the stock agents),
``--stock-poll`` (the stock process calls ``get_new_notifs`` in a loop, as an engine's busy
step would; an idle vLLM worker does not), ``--stock-spin busy|yield`` (a thread of each stock
process spins, as a vLLM worker does on its queue while a request awaits its read),
``--stock-cpu``/``--stock-nice``/``--burn`` (the stock processes pinned, niced, and spinning
processes beside them: a starved prefill), ``--order together|serial`` (both reads posted at
once, or the second after the first completed), ``--connect`` (``make_connection`` to each
stock agent before the read), ``--hb`` (a notification to each stock agent right after the
post, as our decode heartbeats a stock prefill's request), ``--settle`` (seconds between the
stock agents' start and the read), ``--tls`` (``UCX_TLS`` for every process).

Found with it (docs/vllm.md, "A first read that hangs"): a first read completes only once the
stock agent's worker has answered UCX's wireup, so a stock agent that is not progressed (its
progress thread off: ``--stock-pt 0``) leaves every first read stuck, and a starved one slows
it; with vLLM's config none was stuck.

Run from the repository root with the kvplan venv (the stock processes run the same
interpreter unless ``--stock-python``)::

    python benchmarks/repro_first_read.py --runs 20
    python benchmarks/repro_first_read.py --runs 20 --stock-threads 0
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARK = "@@stock "

#: bytes per block, regions (K and V of each layer) per rank, blocks per region, blocks read
BLOCK, REGIONS, BLOCKS, READ = 8192, 4, 40, 3


def pattern(rank: int, region: int, nbytes: int):
    """The bytes region ``region`` of stock rank ``rank`` holds."""
    import numpy as np

    return ((np.arange(nbytes, dtype=np.uint32) * 7 + rank * 131 + region * 17) % 251) \
        .astype(np.uint8)


# -- the stock side ------------------------------------------------------------------------


def stock(args: argparse.Namespace) -> None:
    """One stock-like agent: print its metadata and regions, serve until stdin says bye."""

    try:  # what vLLM's ``nixl._api`` resolves to on a machine without CUDA (the meta
        # package's import would first look for torch's CUDA, a second or more)
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl._api import nixl_agent, nixl_agent_config
    import uuid

    if args.stock_pt is None:  # exactly vLLM's call: NIXL's defaults for the rest
        cfg = nixl_agent_config(num_threads=args.stock_threads, capture_telemetry=True)
    else:
        cfg = nixl_agent_config(enable_prog_thread=bool(args.stock_pt),
                                num_threads=args.stock_threads, capture_telemetry=True)
    agent = nixl_agent(str(uuid.uuid4()), cfg)
    bufs = [pattern(args.rank, i, BLOCK * BLOCKS) for i in range(REGIONS)]
    regs = [(b.ctypes.data, b.nbytes, 0, "") for b in bufs]
    agent.register_memory(agent.get_reg_descs(regs, "DRAM"))
    out = {"agent": agent.name, "md": base64.b64encode(agent.get_agent_metadata()).decode(),
           "regions": [(a, n) for a, n, _, _ in regs]}
    print(MARK + json.dumps(out), flush=True)
    if args.stock_spin:  # a worker spinning on its step queue (vLLM's, awaiting a read)
        import threading

        def spin() -> None:
            if args.stock_spin == "yield":  # vLLM's workers wait on their queue so
                while True:
                    os.sched_yield()
            while True:
                pass

        threading.Thread(target=spin, daemon=True).start()
    if args.stock_poll:
        import select

        while not select.select([sys.stdin], [], [], 0.001)[0]:
            agent.get_new_notifs()
    sys.stdin.readline()  # the reader is done
    print("bye", flush=True)


# -- the reader ----------------------------------------------------------------------------


class Reader:
    """A kvplan-configured agent that reads READ blocks of every region of each stock rank."""

    def __init__(self) -> None:
        import numpy as np

        sys.path.insert(0, str(REPO))
        from kvplan_nixl._nixl import make_agent

        self.agent = make_agent(f"reader-{os.getpid()}", ("UCX",), False)
        n = 2 * REGIONS * READ * BLOCK  # room for both ranks' blocks
        self.buf = np.zeros(n, dtype=np.uint8)
        reg = [(self.buf.ctypes.data, n, 0, "")]
        self.agent.register_memory(self.agent.get_reg_descs(reg, "DRAM"))
        base = self.buf.ctypes.data
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(base + i * BLOCK, BLOCK, 0) for i in range(n // BLOCK)], "DRAM")
        self.blocks = [5, 6, 17]  # the blocks of the request, in every region

    def read(self, stocks: list[dict], order: str, connect: bool, deadline: float,
             hb: bool = False, grace: float = 0.0) -> dict:
        import numpy as np

        a = self.agent
        self.buf[:] = 0
        names = [a.add_remote_agent(base64.b64decode(s["md"])) for s in stocks]
        if connect:
            for name in names:
                a.make_connection(name)
        t0 = time.monotonic()
        handles, remotes = [], []
        per = REGIONS * READ
        for r, (s, name) in enumerate(zip(stocks, names, strict=True)):
            descs = [(addr + b * BLOCK, BLOCK, 0) for addr, _ in s["regions"]
                     for b in self.blocks]
            remote = a.prep_xfer_dlist(name, descs, "DRAM")
            remotes.append(remote)
            local_idx = list(range(r * per, (r + 1) * per))
            h = a.make_prepped_xfer("READ", self.local, local_idx, remote, list(range(per)), b"")
            handles.append(h)
        states = ["" for _ in handles]
        times = [None for _ in handles]
        for i, h in enumerate(handles):
            states[i] = a.transfer(h)
            if order == "serial":
                while states[i] == "PROC" and time.monotonic() - t0 < deadline:
                    states[i] = a.check_xfer_state(h)
            if states[i] == "DONE":
                times[i] = time.monotonic() - t0
        if hb:  # kvplan beats a stock prefill's request at once after posting its read
            for name in names:
                a.send_notif(name, b"HB:req-0")
        while "PROC" in states and time.monotonic() - t0 < deadline:
            for i, h in enumerate(handles):
                if states[i] == "PROC":
                    states[i] = a.check_xfer_state(h)
                    if states[i] == "DONE":
                        times[i] = time.monotonic() - t0
        late = [None for _ in handles]  # past the deadline: polled on for ``grace`` s
        while grace and "PROC" in states and time.monotonic() - t0 < deadline + grace:
            for i, h in enumerate(handles):
                if states[i] == "PROC":
                    states[i] = a.check_xfer_state(h)
                    if states[i] == "DONE":
                        late[i] = time.monotonic() - t0
        for i, t in enumerate(late):
            if t is not None:
                states[i] = "PROC"  # missed the deadline all the same
        ok = True
        for r, s in enumerate(stocks):
            for i, (_, nbytes) in enumerate(s["regions"]):
                want = pattern(r, i, nbytes).reshape(BLOCKS, BLOCK)[self.blocks].ravel()
                k = (r * REGIONS + i) * READ * BLOCK
                got = self.buf[k:k + READ * BLOCK]
                if (states[r] == "DONE" or late[r] is not None) \
                        and not np.array_equal(got, want):
                    ok = False
        for h in handles:
            a.release_xfer_handle(h)  # aborts one still in flight
        for rh in remotes:
            a.release_dlist_handle(rh)
        for name in names:
            a.remove_remote_agent(name)
        return {"states": states, "times": times, "late": late, "bytes_ok": ok}


def reader_child() -> None:
    """A fresh reader process: one read per line of stdin (a JSON request)."""
    rd = Reader()
    for line in sys.stdin:
        req = json.loads(line)
        print(MARK + json.dumps(rd.read(**req)), flush=True)


# -- the loop ------------------------------------------------------------------------------


def env(args: argparse.Namespace) -> dict[str, str]:
    e = dict(os.environ, UCX_NET_DEVICES="lo", UCX_MODULES="^efa",
             UCX_RCACHE_MAX_UNRELEASED="1024", NIXL_LOG_LEVEL="WARN")
    if args.tls:
        e["UCX_TLS"] = args.tls
    return e


def _marked(f) -> dict:
    """The first line of ``f`` starting with :data:`MARK`, decoded (UCX may print others)."""
    for line in f:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError("a stock process ended before its metadata")


def one_run(args: argparse.Namespace, k: int, reader) -> dict:
    py = args.stock_python or sys.executable
    cmd = [py, __file__, "stock", "--stock-threads", str(args.stock_threads)]
    if args.stock_pt is not None:
        cmd += ["--stock-pt", str(args.stock_pt)]
    if args.stock_poll:
        cmd += ["--stock-poll"]
    if args.stock_spin:
        cmd += ["--stock-spin", args.stock_spin]
    if args.stock_cpu is not None:  # every thread of the stock processes on one core
        cmd = ["taskset", "-c", args.stock_cpu, *cmd]
    if args.stock_nice:
        cmd = ["nice", "-n", str(args.stock_nice), *cmd]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env(args))
             for r in range(2)]
    try:
        stocks = [_marked(p.stdout) for p in procs]
        if args.settle:
            time.sleep(args.settle)
        res = reader(stocks)
    finally:
        for p in procs:
            try:
                p.stdin.write("bye\n")
                p.stdin.flush()
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", nargs="?", default="loop", choices=("loop", "stock", "reader"))
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--stock-threads", type=int, default=4, help="vLLM's num_threads (4)")
    ap.add_argument("--stock-pt", type=int, default=None, choices=(0, 1),
                    help="progress thread on the stock agents (default: NIXL's, on)")
    ap.add_argument("--stock-poll", action="store_true",
                    help="the stock processes call get_new_notifs in a loop")
    ap.add_argument("--stock-spin", nargs="?", const="busy", default=None,
                    choices=("busy", "yield"),
                    help="a thread of each stock process spins (a worker awaiting its step): "
                         "busy (holding the GIL) or yield (sched_yield in a loop)")
    ap.add_argument("--stock-cpu", default=None,
                    help="pin the stock processes (all their threads) to these cores")
    ap.add_argument("--stock-nice", type=int, default=0,
                    help="niceness added to the stock processes (the tests' TP 2 engine: 10)")
    ap.add_argument("--stock-python", default=None, help="interpreter of the stock agents")
    ap.add_argument("--order", choices=("together", "serial"), default="together")
    ap.add_argument("--connect", action="store_true", help="make_connection before the read")
    ap.add_argument("--hb", action="store_true",
                    help="send each stock agent a notification right after posting the read")
    ap.add_argument("--burn", type=int, default=0,
                    help="processes spinning on the cores during each run (a loaded machine)")
    ap.add_argument("--tls", default=None, help="UCX_TLS for every process")
    ap.add_argument("--deadline", type=float, default=5.0, help="seconds per read")
    ap.add_argument("--grace", type=float, default=0.0,
                    help="seconds a read that missed its deadline is polled on (late or stuck)")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds between the stock agents' start and the read")
    ap.add_argument("--fresh-reader", action="store_true", help="a new reader process per run")
    args = ap.parse_args()
    if args.role == "stock":
        return stock(args)
    if args.role == "reader":
        return reader_child()
    if args.tls:
        os.environ["UCX_TLS"] = args.tls
    os.environ.update(UCX_NET_DEVICES="lo", UCX_MODULES="^efa")
    persistent = None if args.fresh_reader else Reader()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(args.burn)]
    stuck = bad = 0
    took = []
    for k in range(args.runs):
        req = {"order": args.order, "connect": args.connect, "deadline": args.deadline,
               "hb": args.hb, "grace": args.grace}
        if persistent is not None:
            def reader(stocks, req=req):
                return persistent.read(stocks, **req)
        else:
            def reader(stocks, req=req):
                p = subprocess.Popen([sys.executable, __file__, "reader"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env(args))
                out, _ = p.communicate(json.dumps({"stocks": stocks, **req}) + "\n", timeout=90)
                return _marked(iter(out.splitlines()))
        res = one_run(args, k, reader)
        hung = [r for r, s in enumerate(res["states"]) if s != "DONE"]
        stuck += bool(hung)
        bad += not res["bytes_ok"]
        if not hung:
            took.append(max(res["times"]))
        times = " ".join("-" if t is None else f"{t:.3f}" for t in res["times"])
        late = [r for r, t in enumerate(res.get("late", [])) if t is not None]
        lates = " ".join(f"{res['late'][r]:.3f}" for r in late)
        print(f"run {k}: states {res['states']} s {times} bytes_ok {res['bytes_ok']}"
              + (f" STUCK ranks {hung}" if hung else "")
              + (f" (ranks {late} completed late, at {lates} s)" if late else ""), flush=True)
    for b in burners:
        b.kill()
        b.wait()
    med = sorted(took)[len(took) // 2] if took else float("nan")
    print(f"summary: runs {args.runs} stuck {stuck} bad_bytes {bad} median_s {med:.4f} "
          f"variant threads={args.stock_threads} pt={args.stock_pt} poll={args.stock_poll} "
          f"spin={args.stock_spin} cpu={args.stock_cpu} nice+={args.stock_nice} "
          f"order={args.order} connect={args.connect} hb={args.hb} burn={args.burn} "
          f"tls={args.tls} "
          f"fresh_reader={args.fresh_reader}", flush=True)


if __name__ == "__main__":
    main()
