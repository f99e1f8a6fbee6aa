"""Benchmark of the NIXL executor, in one run, printed as a markdown table.

    python benchmarks/bench_executor.py            # about a minute on 2 cores

1. A 256 MiB pull with mergeable runs (same TP, consecutive block ids) against numpy copying
   the same runs between the same buffers (goal: at least 70% of numpy's rate).
2. The executor end to end (``read`` + ``wait``) against raw NIXL calls with hand-built Nx3
   descriptors for the same runs (prep both lists, make, post, poll, release), on the 256 MiB
   pull and on a scattered hetero-TP pull (goal: at most 1.1x).
3. ``Endpoint.connect`` (metadata decode, kvplan pull_map, strided lists, add_remote_agent) at
   1e3 and 1e6 blocks per region (goal: within 2x). The big regions are address space reserved
   with MAP_NORESERVE: NIXL registers them without touching a page.
   Baseline: the per-block descriptor list engines prepare at handshake, at 1e3 and 1e5 blocks.
4. Descriptors of a hetero-TP plan: the plan's runs, NIXL's own count after merging
   (telemetry), and the maximal contiguous runs counted independently (goal: equal).
5. A hybrid engine (KimiLinear-like: MLA and KDA state views of shared pools, kernel blocks),
   P TP2 -> D TP4: executor against raw NIXL (goal: at most 1.1x) and descriptors (equal).
6. Parallel posting: the scattered hetero-TP pull of 2. through ``Endpoint.read`` with
   ``num_threads=0`` and ``num_threads=2`` on every agent, timed interleaved in one run
   (``--only "parallel posting"`` runs this section alone).

Every engine lives in this process; agents have no progress thread (the targets are progressed
by ``Transfer.wait(progress=...)``, the raw loop does the same).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import resource
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvplan
from kvplan import EngineSpec
from kvplan.cli.progress import step
from kvplan.examples import kimi_linear_like, llama3_70b
from kvplan_nixl import Endpoint
from kvplan_nixl._nixl import NIXL_LOCAL, make_agent


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _spec(tp: int, layers: int, nb: int) -> EngineSpec:
    return EngineSpec.from_dict({"tp_size": tp, "regions": [
        {"name": f"layers.{i}.attn", "kind": "attention", "num_blocks": nb, "block_size": 16,
         "dtype": "bfloat16", "num_kv_heads": 8, "head_dim": 128} for i in range(layers)]})


def _buffers(spec: EngineSpec, fill: int | None) -> list[np.ndarray]:
    """One array per region (pp 1), the regions of a pool sharing their pool's array."""
    out: list[np.ndarray] = []
    for i in range(len(spec.regions)):
        a = spec.allocation_of(i)
        if a != i:
            out.append(out[a])
            continue
        b = np.empty(spec.rank_region_nbytes(i), np.uint8)
        b[:] = np.uint8(i + 1) if fill is None else fill  # touch every page: no faults timed
        out.append(b)
    return out


def _allocations(bufs: list[np.ndarray]) -> list[np.ndarray]:
    return list({id(b): b for b in bufs}.values())


class Engines:
    """Source ranks and one destination rank over real buffers, connected for pull."""

    def __init__(self, src: EngineSpec, dst: EngineSpec, dst_rank: int = 0,
                 num_threads: int = 0) -> None:
        self.src, self.dst = src, dst
        m = kvplan.pull_map(src, dst, dst_rank)
        self.peers = m.peers
        self.sbufs = {r: _buffers(src, None) for r in self.peers}
        self.dbufs = _buffers(dst, 0)
        self.p = [Endpoint("prefill", src, r, self.sbufs[r], num_threads=num_threads)
                  for r in self.peers]
        self.d = Endpoint("decode", dst, dst_rank, self.dbufs, telemetry=True,
                          num_threads=num_threads)
        for ep in self.p:
            self.d.connect(ep.metadata())

    def read(self, plan) -> None:
        self.d.read(plan, "prefill").wait(60, progress=self.p)

    def close(self) -> None:
        for ep in [*self.p, self.d]:
            ep.close()


class Raw:
    """The same transfer with raw NIXL calls and hand-built Nx3 descriptors, per request."""

    def __init__(self, eng: Engines) -> None:
        self.eng = eng
        self.targets = {}
        for r in eng.peers:
            a = make_agent(f"raw-p{r}", ("UCX",), False)
            a.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in _allocations(
                eng.sbufs[r])], "DRAM")
            self.targets[r] = a
        self.agent = make_agent("raw-d", ("UCX",), False)
        self.agent.register_memory([(b.ctypes.data, b.nbytes, 0, "")
                                    for b in _allocations(eng.dbufs)], "DRAM")
        self.names = {r: self.agent.add_remote_agent(a.get_agent_metadata())
                      for r, a in self.targets.items()}
        self.sbase = {r: np.array([b.ctypes.data for b in eng.sbufs[r]]) for r in eng.peers}
        self.dbase = np.array([b.ctypes.data for b in eng.dbufs])

    def read(self, plan) -> None:
        rows = plan.copies()
        handles = []
        for r in plan.peers:
            sel = rows[rows["src_rank"] == r]
            n = len(sel)
            zeros = np.zeros(n, np.int64)
            local = np.stack([self.dbase[sel["dst_region"]] + sel["dst_offset"], sel["length"],
                              zeros], axis=1)
            remote = np.stack([self.sbase[r][sel["src_region"]] + sel["src_offset"],
                               sel["length"], zeros], axis=1)
            lh = self.agent.prep_xfer_dlist(NIXL_LOCAL, local, "DRAM")
            rh = self.agent.prep_xfer_dlist(self.names[r], remote, "DRAM")
            idx = np.arange(n)
            h = self.agent.make_prepped_xfer("READ", lh, idx, rh, idx, b"")
            handles.append((h, lh, rh, self.agent.transfer(h)))
        for h, lh, rh, s in handles:
            while s == "PROC":
                for a in self.targets.values():
                    a.get_new_notifs()
                s = self.agent.check_xfer_state(h)
            assert s == "DONE", s
            h.release()
            lh.release()
            rh.release()


def _versus_raw(eng: Engines, plan, reps: int) -> tuple[float, float, int]:
    """Median seconds of the executor and of raw NIXL for ``plan`` (interleaved, after one
    warm-up each), and the NIXL descriptors one executor read posted (telemetry)."""
    raw = Raw(eng)
    eng.read(plan)
    raw.read(plan)
    t_ex, t_raw = [], []
    for _ in range(reps):
        t_ex.append(_time(lambda: eng.read(plan)))
        t_raw.append(_time(lambda: raw.read(plan)))
    t = eng.d.read(plan, "prefill")
    t.wait(60, progress=eng.p)
    return statistics.median(t_ex), statistics.median(t_raw), sum(t.desc_counts().values())


def bench_bulk(reps: int) -> list[tuple]:
    """256 MiB, same TP, consecutive blocks: 16 runs of 16 MiB."""
    spec = _spec(1, 8, 512)  # 8 regions x 512 blocks x 64 KiB = 256 MiB per rank
    eng = Engines(spec, spec)
    try:
        ids = list(range(512))
        plan = eng.d.map("prefill").plan([ids], [ids])
        nbytes = plan.nbytes
        rows = plan.copies()
        src, dst = eng.sbufs[0], eng.dbufs

        def numpy_copy():
            for row in rows:
                a, b, n = int(row["src_offset"]), int(row["dst_offset"]), int(row["length"])
                np.copyto(dst[row["dst_region"]][b : b + n], src[row["src_region"]][a : a + n])

        raw = Raw(eng)
        eng.read(plan)  # warm up both paths (connections, page tables)
        raw.read(plan)
        t_np, t_ex, t_raw = [], [], []
        for _ in range(reps):  # interleaved, so machine noise hits all three alike
            t_np.append(_time(numpy_copy))
            t_ex.append(_time(lambda: eng.read(plan)))
            t_raw.append(_time(lambda: raw.read(plan)))
        t_np, t_ex, t_raw = (statistics.median(x) for x in (t_np, t_ex, t_raw))
        ok = all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))
        gb = nbytes / 1e9
        return [
            ("256 MiB pull, mergeable runs: numpy copy", f"{gb / t_np:.2f} GB/s", "", ""),
            ("256 MiB pull, mergeable runs: executor", f"{gb / t_ex:.2f} GB/s "
             f"({len(rows)} runs, verified {ok})", ">= 70% of numpy",
             f"{t_np / t_ex:.0%} {'met' if t_np / t_ex >= 0.7 else 'NOT met'}"),
            ("256 MiB pull: raw NIXL, hand-built Nx3", f"{t_raw * 1e3:.2f} ms", "", ""),
            ("256 MiB pull: executor / raw NIXL", f"{t_ex / t_raw:.3f}x", "<= 1.1x",
             "met" if t_ex / t_raw <= 1.1 else "NOT met"),
        ]
    finally:
        eng.close()


def bench_hetero(reps: int, tokens: int) -> list[tuple]:
    """Llama-3-70B-like (80 layers), P TP8 -> D TP4, scattered blocks: many 4 KiB runs."""
    nb = 2 * tokens // 16
    src, dst = llama3_70b(8, num_blocks=nb), llama3_70b(4, num_blocks=nb)
    eng = Engines(src, dst)
    try:
        rng = np.random.default_rng(0)
        n = tokens // 16
        sb, db = [rng.permutation(nb)[:n].tolist()], [rng.permutation(nb)[:n].tolist()]
        plan = eng.d.map("prefill").plan(sb, db)
        t_ex, t_raw, posted = _versus_raw(eng, plan, reps)
        rows = plan.copies()
        contiguous = [list(range(n))]
        plan_c = eng.d.map("prefill").plan(contiguous, contiguous)
        t = eng.d.read(plan_c, "prefill")
        t.wait(60, progress=eng.p)
        posted_c = sum(t.desc_counts().values())
        return [
            (f"hetero pull P TP8 -> D TP4, {tokens} tokens scattered: raw NIXL",
             f"{t_raw * 1e3:.1f} ms ({len(rows)} runs, {plan.nbytes / 2**20:.0f} MiB)", "", ""),
            ("hetero pull: executor / raw NIXL", f"{t_ex / t_raw:.3f}x", "<= 1.1x",
             "met" if t_ex / t_raw <= 1.1 else "NOT met"),
            ("hetero plan, scattered: plan runs / NIXL descCount / maximal runs",
             f"{len(rows)} / {posted} / {_maximal_runs(rows)}", "equal",
             "met" if len(rows) == posted == _maximal_runs(rows) else "NOT met"),
            ("hetero plan, consecutive ids: plan runs / NIXL descCount / maximal runs",
             f"{len(plan_c.copies())} / {posted_c} / {_maximal_runs(plan_c.copies())}", "equal",
             "met" if len(plan_c.copies()) == posted_c == _maximal_runs(plan_c.copies())
             else "NOT met"),
        ]
    finally:
        eng.close()


def bench_num_threads(reps: int, tokens: int) -> list[tuple]:
    """The scattered hetero-TP pull of :func:`bench_hetero` through ``Endpoint.read``, with
    every agent at NIXL's default and with ``num_threads=2`` (UCX's multi-threaded engine),
    both alive in this run and timed interleaved; bytes checked after each side's last read."""
    nb = 2 * tokens // 16
    src, dst = llama3_70b(8, num_blocks=nb), llama3_70b(4, num_blocks=nb)
    rng = np.random.default_rng(0)
    n = tokens // 16
    sb, db = [rng.permutation(nb)[:n].tolist()], [rng.permutation(nb)[:n].tolist()]
    engs = {0: Engines(src, dst), 2: Engines(src, dst, num_threads=2)}
    try:
        plans = {k: e.d.map("prefill").plan(sb, db) for k, e in engs.items()}
        for k, e in engs.items():  # warm up: connections, page tables
            e.read(plans[k])
        times: dict[int, list[float]] = {0: [], 2: []}
        cpu = {0: 0.0, 2: 0.0}  # process CPU seconds (every thread, NIXL's and UCX's too)
        for _ in range(reps):
            for k, e in engs.items():
                c = _cpu()
                times[k].append(_time(lambda e=e, k=k: e.read(plans[k])))
                cpu[k] += _cpu() - c
        t0, t2 = (statistics.median(times[k]) for k in (0, 2))
        c0, c2 = (cpu[k] / reps for k in (0, 2))
        ok = all(np.array_equal(engs[0].dbufs[i], engs[2].dbufs[i])
                 for i in range(len(dst.regions)))
        runs, mib = len(plans[0].copies()), plans[0].nbytes / 2**20
        return [
            (f"hetero pull P TP8 -> D TP4, {tokens} tokens scattered ({runs} runs, {mib:.0f} "
             f"MiB), Endpoint.read: num_threads=0 / 2",
             f"{t0 * 1e3:.1f} / {t2 * 1e3:.1f} ms ({t0 / t2:.2f}x; CPU {c0 * 1e3:.0f} / "
             f"{c2 * 1e3:.0f} ms per read; same bytes: {ok})", "measure", ""),
        ]
    finally:
        for e in engs.values():
            e.close()


def bench_hybrid(reps: int, tokens: int) -> list[tuple]:
    """KimiLinear-like (MLA + KDA state views of shared pools, kernel blocks of 16), P TP2 ->
    D TP4, scattered pages and one state slot: executor against raw NIXL, and descriptors."""
    layers, nb = 12, tokens // 64 + 8
    src, dst = (kimi_linear_like(tp, layers=layers, num_blocks=nb) for tp in (2, 4))
    eng = Engines(src, dst)
    try:
        rng = np.random.default_rng(1)
        n = tokens // 64

        def ids():  # disjoint pages for the MLA group's blocks and the KDA group's slot
            perm = rng.permutation(nb).tolist()
            return [perm[:n], perm[n:n + 1]]

        sb, db = ids(), ids()
        plan = eng.d.map("prefill").plan(sb, db)
        t_ex, t_raw, posted = _versus_raw(eng, plan, reps)
        rows = plan.copies()
        return [
            (f"hybrid pull, KimiLinear-like ({layers} MLA + {layers} KDA pooled, kernel 16), "
             f"P TP2 -> D TP4, {tokens} tokens + 1 slot scattered: raw NIXL",
             f"{t_raw * 1e3:.1f} ms ({len(rows)} runs, {plan.nbytes / 2**20:.0f} MiB, "
             f"{plan.nbytes / t_ex / 1e9:.2f} GB/s executor)", "", ""),
            ("hybrid pull: executor / raw NIXL", f"{t_ex / t_raw:.3f}x", "<= 1.1x",
             "met" if t_ex / t_raw <= 1.1 else "NOT met"),
            ("hybrid plan: plan runs / NIXL descCount / maximal runs",
             f"{len(rows)} / {posted} / {_maximal_runs(rows)}", "equal",
             "met" if len(rows) == posted == _maximal_runs(rows) else "NOT met"),
        ]
    finally:
        eng.close()


def _maximal_runs(rows: np.ndarray) -> int:
    """Runs left after merging every pair contiguous on both sides (independent of kvplan)."""
    order = np.lexsort((rows["dst_offset"], rows["dst_region"], rows["src_region"],
                        rows["dst_rank"], rows["src_rank"]))
    r = rows[order]
    same = (
        (r["src_rank"][1:] == r["src_rank"][:-1]) & (r["dst_rank"][1:] == r["dst_rank"][:-1])
        & (r["src_region"][1:] == r["src_region"][:-1])
        & (r["dst_region"][1:] == r["dst_region"][:-1])
        & (r["dst_offset"][1:] == r["dst_offset"][:-1] + r["length"][:-1])
        & (r["src_offset"][1:] == r["src_offset"][:-1] + r["length"][:-1])
    )
    return int(len(r) - same.sum())


def _reserved(spec: EngineSpec, keep: list) -> list[tuple[int, int]]:
    """(address, nbytes) per region inside one MAP_NORESERVE mapping (no page touched)."""
    sizes = [spec.rank_region_nbytes(i) for i in range(len(spec.regions))]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    m = mmap.mmap(-1, sum(sizes), flags=flags)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    keep.append(m)
    offs = np.cumsum([0, *sizes])[:-1]
    return [(base + int(o), n) for o, n in zip(offs, sizes, strict=True)]


def bench_connect(reps: int) -> list[tuple]:
    """connect() of decode rank 0 to its two prefill peers, Llama-3-70B-like, P TP8 -> D TP4."""
    out, res = [], {}
    for nb in (1_000, 1_000_000):
        keep: list = []
        src, dst = llama3_70b(8, num_blocks=nb), llama3_70b(4, num_blocks=nb)
        peers = [Endpoint("prefill", src, r, _reserved(src, keep)) for r in (0, 1)]
        metas = [p.metadata() for p in peers]
        firsts, seconds = [], []
        dbufs = _reserved(dst, keep)
        for _ in range(reps):
            d = Endpoint("decode", dst, 0, dbufs)
            t0 = time.perf_counter()
            d.connect(metas[0])
            t1 = time.perf_counter()
            d.connect(metas[1])
            t2 = time.perf_counter()
            firsts.append(t1 - t0)
            seconds.append(t2 - t1)
            d.close()
        for p in peers:
            p.close()
        res[nb] = statistics.median(firsts)
        gib = sum(s[1] for s in dbufs) / 2**30
        out.append((f"connect, {nb:.0e} blocks/region ({gib:,.0f} GiB registered on D rank)",
                    f"{res[nb] * 1e3:.1f} ms first peer, {statistics.median(seconds) * 1e3:.1f}"
                    " ms each further peer", "", ""))
        del keep
    ratio = res[1_000_000] / res[1_000]
    out.append(("connect 1e6 / 1e3 blocks", f"{ratio:.2f}x", "<= 2x",
                "met" if ratio <= 2 else "NOT met"))
    return out


def bench_engine_style_prep(reps: int) -> list[tuple]:
    """Baseline: what engines ship at handshake (vLLM's NIXL connector): one descriptor per
    (layer, stream, block) of the remote rank, prepared once, so handshake cost and memory grow
    with num_blocks. Same Llama-3-70B-like peer (80 layers, P TP8 head slice read by D TP4)."""
    out = []
    for nb in (1_000, 100_000):
        keep: list = []
        src = llama3_70b(8, num_blocks=nb)
        regions = _reserved(src, keep)
        target = make_agent("engine-style-p", ("UCX",), False)
        target.register_memory([(a, n, 0, "") for a, n in regions], "DRAM")
        agent = make_agent("engine-style-d", ("UCX",), False)
        name = agent.add_remote_agent(target.get_agent_metadata())
        blk = src.rank_block_nbytes(0) // 2  # one stream of one block
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            addr = np.concatenate([
                base + s * nb * blk + np.arange(nb, dtype=np.int64) * blk
                for base, _ in regions for s in range(2)
            ])
            rows = np.stack([addr, np.full(len(addr), blk), np.zeros(len(addr), np.int64)], 1)
            h = agent.prep_xfer_dlist(name, rows, "DRAM")
            times.append(time.perf_counter() - t0)
            h.release()
        agent.remove_remote_agent(name)
        del agent, target, keep
        out.append((f"engine-style handshake: per-block descriptor list, {nb:.0e} blocks/region "
                    f"({len(rows):,} descriptors)", f"{statistics.median(times) * 1e3:.1f} ms",
                    "baseline", ""))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=2048, help="hetero-TP request length")
    ap.add_argument("--only", default="", help="run only the sections whose name contains this")
    args = ap.parse_args(argv)
    print("| measure | result | goal | |")
    print("|---|---|---|---|", flush=True)
    for what, run in (  # each section's rows print as soon as it is measured
        ("bulk reads and writes", lambda: bench_bulk(args.reps)),
        ("heterogeneous TP", lambda: bench_hetero(max(3, args.reps // 2), args.tokens)),
        ("parallel posting (num_threads)",
         lambda: bench_num_threads(max(3, args.reps // 2), args.tokens)),
        ("hybrid", lambda: bench_hybrid(max(3, args.reps // 2), 8 * args.tokens)),
        ("connect", lambda: bench_connect(5)),
        ("engine-style preparation", lambda: bench_engine_style_prep(3)),
    ):
        if args.only not in what:
            continue
        with step(f"measuring {what}"):
            rows = run()
        for r in rows:
            print("| " + " | ".join(r) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
