"""Benchmark of staged transfers (kvplan_nixl/staged.py) against direct posting and numpy.

    python benchmarks/bench_staged.py              # about a minute on 2 cores

Llama-3-70B-like, P TP8 -> D TP4, decode rank 0 and its two prefill peers in this process,
random (scattered) block ids: every run is 4 KiB. For pull (decode reads) and push (both
prefill ranks write), the same request is moved directly (one NIXL descriptor per run) and
staged (gather -> one descriptor per chunk -> scatter), interleaved with a numpy copy of the
same number of bytes between two contiguous buffers (the memory-bandwidth reference). Every
staged and direct result is verified byte for byte against the direct one. Also: a mergeable
request (consecutive ids, same TP) through ``Stager.post(how="auto")``, which must stay direct.

Every ratio is within one run (the shared 2-core machine moves absolute numbers by 2x).

``--device cuda`` runs only the one-process cases with every engine buffer a CUDA tensor (the
staging pools follow the buffers' device), against a device-to-device copy of the same bytes;
``benchmarks/device_check.sh`` runs it on a GPU machine.
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

import kvplan
from kvplan import EngineSpec
from kvplan_nixl import Endpoint
from kvplan_nixl._nixl import NIXL_LOCAL, nixl_agent, nixl_agent_config
from kvplan_nixl.staged import Stager

SLOT = int(os.environ.get("KVPLAN_BENCH_SLOT", 16 << 20))
#: Where the engine buffers live ("cpu" or "cuda"); set by ``--device``.
DEVICE = "cpu"
POOL = int(os.environ.get("KVPLAN_BENCH_POOL", 4 * SLOT))


def _llama(tp: int, layers: int, nb: int) -> EngineSpec:
    return EngineSpec.from_dict({"tp_size": tp, "regions": [
        {"name": f"layers.{i}.attn", "kind": "attention", "num_blocks": nb, "block_size": 16,
         "dtype": "bfloat16", "num_kv_heads": 8, "head_dim": 128} for i in range(layers)]})


def _bufs(spec: EngineSpec, seed: int | None) -> list:
    """Per region, the rank's bytes: numpy arrays, or tensors on :data:`DEVICE`."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(len(spec.regions)):
        n = spec.rank_region_nbytes(i)
        out.append(np.zeros(n, np.uint8) if seed is None else rng.integers(0, 256, n, np.uint8))
    if DEVICE == "cpu":
        return out
    import torch

    return [torch.from_numpy(x).to(DEVICE) for x in out]


def _clone(x):
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def _equal(x, y) -> bool:
    if isinstance(x, np.ndarray):
        return bool(np.array_equal(x, y))
    import torch

    return bool(torch.equal(x, y))


def _reference_copy(nbytes: int):
    """The bandwidth reference: a copy of ``nbytes`` between two contiguous buffers of the
    engine buffers' kind (numpy on the CPU, a device-to-device copy on CUDA)."""
    if DEVICE == "cpu":
        a, b = np.ones(nbytes, np.uint8), np.full(nbytes, 7, np.uint8)  # pages touched
        return lambda: np.copyto(b, a)
    import torch

    a = torch.ones(nbytes, dtype=torch.uint8, device=DEVICE)
    b = torch.full((nbytes,), 7, dtype=torch.uint8, device=DEVICE)

    def copy() -> None:
        b.copy_(a)
        if b.is_cuda:
            torch.cuda.synchronize()
    return copy


class World:
    """Decode rank 0 and the prefill ranks it reads from, each with an Endpoint and a Stager,
    connected both ways."""

    def __init__(self, src: EngineSpec, dst: EngineSpec, *, telemetry: bool = False) -> None:
        self.peers = kvplan.pull_map(src, dst, 0).peers
        self.sbufs = {r: _bufs(src, r + 1) for r in self.peers}
        self.dbufs = _bufs(dst, None)
        self.p = {r: Endpoint("prefill", src, r, self.sbufs[r]) for r in self.peers}
        self.d = Endpoint("decode", dst, 0, self.dbufs, telemetry=telemetry)
        self.eps = [*self.p.values(), self.d]
        self.st = {ep: Stager(ep, pool_bytes=POOL, slot_bytes=SLOT) for ep in self.eps}
        for ep in self.p.values():
            self.d.connect(ep.metadata(), mode="pull")
            ep.connect(self.d.metadata(), mode="push")

    def pull(self, sb, db, how: str):
        plan = self.d.map("prefill").plan(sb, db)
        t = self.st[self.d].post(plan, "prefill", how=how)
        t.wait(120, progress=list(self.st.values()) if how != "direct" else list(self.p.values()))
        return t

    def push(self, sb, db, how: str):
        ts = []
        for ep in self.p.values():
            plan = ep.map("decode", "push").plan(sb, db)
            ts.append(self.st[ep].post(plan, "decode", how=how))
        others = list(self.st.values()) if how != "direct" else [self.d]
        for t in ts:
            t.wait(120, progress=others)
        return ts

    def drain(self) -> None:
        for _ in range(200):
            for s in self.st.values():
                s.poll()
            if all(s.handles()["slots_in_use"] == 0 for s in self.st.values()):
                return
            time.sleep(1e-3)

    def close(self) -> None:
        for s in self.st.values():
            s.close()
        for ep in self.eps:
            ep.close()


def _median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bench_scattered(tokens: int, layers: int, reps: int) -> list[tuple]:
    n = tokens // 16
    nb = n + 16
    src, dst = _llama(8, layers, nb), _llama(4, layers, nb)
    w = World(src, dst)
    try:
        rng = np.random.default_rng(0)
        sb, db = [rng.permutation(nb)[:n].tolist()], [rng.permutation(nb)[:n].tolist()]
        plan = w.d.map("prefill").plan(sb, db)
        nbytes = plan.nbytes
        copy = _reference_copy(nbytes)
        ref_name = "numpy copy" if DEVICE == "cpu" else f"{DEVICE} copy"
        out = []
        for mode in ("pull", "push"):
            go = w.pull if mode == "pull" else w.push
            go(sb, db, "direct")  # warm up connections and page tables
            ref = [_clone(x) for x in w.dbufs]
            for x in w.dbufs:
                x[:] = 0
            staged = go(sb, db, "staged")
            w.drain()
            ok = all(_equal(x, y) for x, y in zip(w.dbufs, ref, strict=True))
            first = ""
            if mode == "pull":  # the first auto request of this shape, on calibration alone
                st = w.st[w.d]
                st.calibrate("prefill", progress=[w.st[e] for e in w.p.values()])
                kinds = {type(go(sb, db, m)).__name__: m for m in ("direct", "staged")}
                st.measured = type(st.measured)()  # forget those two: calibration alone
                first = kinds.get(type(go(sb, db, "auto")).__name__, "mixed")
                w.drain()
            times: dict[str, list[float]] = {"direct": [], "staged": [], "auto": []}
            modes = list(times)
            for i in range(reps):  # interleaved: machine noise hits all four alike
                times.setdefault("numpy", []).append(_median_time(copy, 1))
                # each mode after a drain, in a rotating order: a request posted right behind
                # another waits for that one's server-side tail, which is not its own cost
                # (auto has timed both modes by its first timed request: every post feeds it)
                for how in modes[i % 3:] + modes[:i % 3]:
                    w.drain()
                    times[how].append(_median_time(lambda go=go, how=how: go(sb, db, how), 1))
                w.drain()
            t_np, t_dir, t_st, t_auto = (statistics.median(times[k])
                                         for k in ("numpy", "direct", "staged", "auto"))
            best = min(t_dir, t_st)
            ts = staged if isinstance(staged, list) else [staged]
            chunks = sum(t.chunks for t in ts)
            desc = sum(t.descriptors for t in ts)
            gb = nbytes / 1e9
            out += [
                (f"{DEVICE}: {mode}, {tokens} tokens scattered, {layers} layers ({len(plan)} "
                 f"runs of 4 KiB, {nbytes / 2**20:.0f} MiB): {ref_name} / direct / staged",
                 f"{gb / t_np:.2f} / {gb / t_dir:.2f} / {gb / t_st:.2f} GB/s "
                 f"(verified {ok})", "", ""),
                (f"{mode}, {tokens} tokens: staged / direct", f"{t_dir / t_st:.2f}x", ">= 3x",
                 "met" if t_dir / t_st >= 3 else "NOT met"),
                (f"{mode}, {tokens} tokens: auto / the faster mode (after learning)",
                 f"{best / t_auto:.2f}x ({gb / t_auto:.2f} GB/s)", ">= 0.95x (noise)",
                 "met" if best / t_auto >= 0.95 else "NOT met"),
                (f"{mode}, {tokens} tokens: staged / {ref_name}", f"{t_np / t_st:.0%}",
                 ">= 40%", "met" if t_np / t_st >= 0.4 else "NOT met"),
                (f"{mode}, {tokens} tokens: descriptors per staged request (peers x chunks)",
                 f"{desc} ({len(plan.peers)} peers, {chunks} chunks of <= {SLOT >> 20} MiB)",
                 "<= peers x chunks x c", "met" if desc <= chunks else "NOT met"),
            ]
            if first:
                faster = "direct" if t_dir <= t_st else "staged"
                slow = max(t_dir, t_st) / min(t_dir, t_st)
                ok_first = first == faster or slow <= 1.10
                out.append((f"{mode}, {tokens} tokens: first auto request after calibrate",
                            f"chose {first} (measured faster: {faster}, by {slow:.2f}x)",
                            "not > 10% slower",
                            "met" if ok_first else "NOT met"))
        return out
    finally:
        w.close()


class Remote:
    """Peer ranks in their own processes (tests/nixl_peer.py --stager): the other engine of a
    two-process run, each serving staged requests and progressing its agent every ~1 ms."""

    def __init__(self, tmp: str, engine: str, spec: EngineSpec, ranks, back: list[str],
                 mode: str) -> None:
        import json
        import subprocess

        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.procs, self.paths = [], []
        for r in ranks:
            path = os.path.join(tmp, f"{engine}-{r}.md")
            args = [sys.executable, os.path.join(here, "tests", "nixl_peer.py"), "--engine",
                    engine, "--rank", str(r), "--spec", json.dumps(spec.to_dict()), "--seed",
                    str(r + 1), "--fill", "random", "--metadata-out", path, "--stager",
                    f"{POOL},{SLOT}"]
            for b in back:
                args += ["--connect", b, mode]
            self.procs.append(subprocess.Popen(args, stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, env=env, text=True))
            self.paths.append(path)

    def metadata(self) -> list[bytes]:
        out = []
        for p, path in zip(self.procs, self.paths, strict=True):
            assert p.stdout.readline().strip() == "ready"
            with open(path, "rb") as f:
                out.append(f.read())
        return out

    def connected(self) -> None:
        for p in self.procs:
            assert p.stdout.readline().strip() == "connected"

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.stdin.write("quit\n")
                p.stdin.flush()
        for p in self.procs:
            try:
                p.wait(30)
            except Exception:
                p.kill()


def _write(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def bench_two_process(tokens: int, layers: int, reps: int) -> list[tuple]:
    """The scattered request with the other engine in its own processes: the source's gather
    and the destination's copy legs run on different cores, as in a deployment."""
    import tempfile

    n = tokens // 16
    nb = n + 16
    src, dst = _llama(8, layers, nb), _llama(4, layers, nb)
    rng = np.random.default_rng(0)
    sb, db = [rng.permutation(nb)[:n].tolist()], [rng.permutation(nb)[:n].tolist()]
    out = []
    for mode in ("pull", "push"):
        tmp = tempfile.mkdtemp(prefix="kvplan-bench-")
        peers = kvplan.pull_map(src, dst, 0).peers
        if mode == "pull":  # this process: decode rank 0; prefill peers serve
            local = [Endpoint("decode", dst, 0, _bufs(dst, None))]
            remote = Remote(tmp, "prefill", src, peers, [os.path.join(tmp, "local-0.md")],
                            "push")
            engine = "prefill"
        else:  # this process: prefill ranks; decode rank 0 serves
            local = [Endpoint("prefill", src, r, _bufs(src, r + 1)) for r in peers]
            remote = Remote(tmp, "decode", dst, [0],
                            [os.path.join(tmp, f"local-{i}.md") for i in range(len(local))],
                            "pull")
            engine = "decode"
        sts = [Stager(ep, pool_bytes=POOL, slot_bytes=SLOT) for ep in local]
        try:
            metas = remote.metadata()
            for i, ep in enumerate(local):
                _write(os.path.join(tmp, f"local-{i}.md"), ep.metadata())
                for m in metas:
                    ep.connect(m, mode=mode)
            remote.connected()
            plans = [ep.map(engine, mode).plan(sb, db) for ep in local]
            nbytes = sum(p.nbytes for p in plans)
            a, b = np.ones(nbytes, np.uint8), np.full(nbytes, 7, np.uint8)

            def go(how: str, sts=sts, plans=plans, engine=engine) -> list:
                ts = [st.post(p, engine, how=how) for st, p in zip(sts, plans, strict=True)]
                for t in ts:
                    t.wait(120, progress=sts)
                return ts

            go("direct")
            staged = go("staged")
            t_np, t_dir, t_st = [], [], []
            for _ in range(reps):
                t_np.append(_median_time(lambda a=a, b=b: np.copyto(b, a), 1))
                t_dir.append(_median_time(lambda go=go: go("direct"), 1))
                t_st.append(_median_time(lambda go=go: go("staged"), 1))
            t_np, t_dir, t_st = (statistics.median(x) for x in (t_np, t_dir, t_st))
            gb = nbytes / 1e9
            runs = sum(len(p) for p in plans)
            desc = sum(t.descriptors for t in staged)
            out += [
                (f"two processes, {mode}, {tokens} tokens scattered, {layers} layers ({runs} "
                 f"runs, {nbytes / 2**20:.0f} MiB): numpy copy / direct / staged",
                 f"{gb / t_np:.2f} / {gb / t_dir:.2f} / {gb / t_st:.2f} GB/s "
                 f"({desc} staged descriptors)", "", ""),
                (f"two processes, {mode}, {tokens} tokens: staged / direct",
                 f"{t_dir / t_st:.2f}x", ">= 3x", "met" if t_dir / t_st >= 3 else "NOT met"),
                (f"two processes, {mode}, {tokens} tokens: staged / numpy copy",
                 f"{t_np / t_st:.0%}", ">= 40%", "met" if t_np / t_st >= 0.4 else "NOT met"),
            ]
        finally:
            for st in sts:
                st.close()
            for ep in local:
                ep.close()
            remote.close()
    return out


def bench_mergeable(reps: int) -> list[tuple]:
    """256 MiB, same TP, consecutive ids: post(how="auto") must stay direct at numpy speed
    (numpy copying the same 16 runs, as in bench_executor.py)."""
    spec = _llama(1, 8, 512)
    w = World(spec, spec)
    try:
        ids = [list(range(512))]
        plan = w.d.map("prefill").plan(ids, ids)
        nbytes = plan.nbytes
        rows = plan.copies()
        srcb, dstb = w.sbufs[0], [np.full_like(x, 7) for x in w.dbufs]

        def numpy_copy():  # the same runs between the same kind of buffers (bench_executor's)
            for row in rows:
                a, b, n = int(row["src_offset"]), int(row["dst_offset"]), int(row["length"])
                np.copyto(dstb[row["dst_region"]][b:b + n], srcb[row["src_region"]][a:a + n])

        chosen = type(w.pull(ids, ids, "auto")).__name__
        t_np, t_auto = [], []
        for _ in range(reps):
            t_np.append(_median_time(numpy_copy, 1))
            t_auto.append(_median_time(lambda: w.pull(ids, ids, "auto"), 1))
        t_np, t_auto = statistics.median(t_np), statistics.median(t_auto)
        gb = nbytes / 1e9
        return [
            ("mergeable 256 MiB pull, post(how='auto'): chosen / numpy / auto",
             f"{chosen} / {gb / t_np:.2f} / {gb / t_auto:.2f} GB/s", "", ""),
            ("mergeable: auto / numpy copy", f"{t_np / t_auto:.0%}", ">= 90%",
             "met" if t_np / t_auto >= 0.9 else "NOT met"),
        ]
    finally:
        w.close()


def bench_parallel_posting(reps: int, n: int = 40_960, piece: int = 4096) -> list[tuple]:
    """Raw NIXL, the direct mode's wall: ``n`` scattered 4 KiB READs posted as one handle, as
    four handles posted together, with UCX ``num_workers=4``, and with the agent's
    ``num_threads=2`` (UCX's multi-threaded engine)."""
    src, dst = np.ones(2 * n * piece, np.uint8), np.zeros(2 * n * piece, np.uint8)
    rng = np.random.default_rng(0)
    so, do = (rng.permutation(2 * n)[:n] * piece for _ in range(2))
    z = np.zeros(n, np.int64)
    out = []
    base = None
    for label, params, threads, handles in (
        ("1 handle", {}, 0, 1),
        ("4 handles posted together", {}, 0, 4),
        ("4 handles, UCX num_workers=4", {"num_workers": "4"}, 0, 4),
        ("4 handles, agent num_threads=2", {}, 2, 4),
    ):
        tag = f"{time.monotonic_ns()}"
        agents = []
        for name in ("A", "B"):
            cfg = nixl_agent_config(enable_prog_thread=False, backends=[], num_threads=threads)
            ag = nixl_agent(name + tag, cfg)
            ag.create_backend("UCX", {**params, **({"num_threads": str(threads)}
                                                   if threads else {})})
            agents.append(ag)
        a, b = agents
        a.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
        b.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
        name = a.add_remote_agent(b.get_agent_metadata())
        lh = a.prep_xfer_dlist(NIXL_LOCAL, np.stack([dst.ctypes.data + do, z + piece, z], 1),
                               "DRAM")
        rh = a.prep_xfer_dlist(name, np.stack([src.ctypes.data + so, z + piece, z], 1), "DRAM")
        parts = np.array_split(np.arange(n), handles)

        def once(a=a, b=b, lh=lh, rh=rh, parts=parts):
            hs = [a.make_prepped_xfer("READ", lh, p, rh, p, b"") for p in parts]
            states = [a.transfer(h) for h in hs]
            for h, s in zip(hs, states, strict=True):
                while s == "PROC":
                    b.get_new_notifs()
                    s = a.check_xfer_state(h)
                h.release()

        once()
        t = _median_time(once, reps)
        lh.release()
        rh.release()
        a.remove_remote_agent(name)
        base = base or t
        out.append((f"parallel posting, raw NIXL, {n} scattered 4 KiB READs: {label}",
                    f"{n * piece / t / 1e9:.2f} GB/s ({base / t:.2f}x of 1 handle)", "", ""))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--big-layers", type=int, default=16,
                    help="layers of the 32k-token case (80 needs ~10 GiB)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="engine buffers on this device (cuda: the one-process cases only)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    small, big = args.reps, max(3, args.reps // 2)
    rows = []
    if DEVICE == "cpu":  # the other engine's processes and the raw NIXL rows are host-only
        rows += bench_two_process(2048, 80, small)
        rows += bench_two_process(32768, args.big_layers, big)
    rows += bench_scattered(2048, 80, small)
    rows += bench_scattered(32768, args.big_layers, big)
    if DEVICE == "cpu":
        rows += bench_mergeable(small)
        rows += bench_parallel_posting(small)
    print("| measure | result | goal | |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
