"""Fragmented requests between two hosts against the link's own speed (root; UCX over TCP).

    sudo python benchmarks/bench_two_hosts.py              # every case, ~5 min on 2 cores
    sudo python benchmarks/bench_two_hosts.py --quick      # Llama 2k tokens only, ~1 min
    sudo python benchmarks/bench_two_hosts.py --ucx default   # UCX's own TCP settings

Two network namespaces joined by a veth (``tests/netns.py``) are the hosts: prefill ranks on
host A, decode on host B, every process with ``UCX_TLS=tcp`` on the veth only. For a pull the
initiator is decode rank 0 (this script re-run inside host B with ``--role initiator``) and
its prefill peers are ``tests/nixl_peer.py --stager`` processes on host A, one per rank; for a
push the prefill peers initiate (host A) and decode rank 0 serves (host B).

Per case and mode, in one run, timed alternately (median of ``--reps``):

- ``link``: one contiguous NIXL READ (pull) or WRITE (push) per peer of that peer's bytes of
  the request, between the staging pools, all peers at once: what the link moves when
  descriptors cost nothing. For pulls also a plain TCP stream of the same bytes between the
  two hosts (a socket, one ``sendall``), the ceiling of anything over TCP.
- ``direct``, ``staged`` and ``auto`` (``Stager.post(how=...)``, after ``calibrate()``).
- requests per second with ``--inflight`` auto requests in flight.
- CPU seconds per GB moved, initiator process and peer processes (from /proc).
- dead peer: a peer killed while an auto request (and, separately, a staged one) waits on it:
  seconds from the kill to the request's failure.

Prints a markdown table of ratios (each against the link measured in the same run) and, with
``--json FILE``, the raw numbers. Environment knobs for experiments: ``KVPLAN_BENCH_SLOT``,
``KVPLAN_BENCH_POOL`` (staging slot and pool bytes, 16 and 64 MiB), ``KVPLAN_BENCH_WINDOW``
(chunks in flight per peer, 2) and ``KVPLAN_BENCH_MAX_NAP`` (the polling loops' longest nap,
seconds, on both sides; unset: the library's 1 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from kvplan import EngineSpec  # noqa: E402
from tests import netns  # noqa: E402

SLOT = int(os.environ.get("KVPLAN_BENCH_SLOT", 16 << 20))
POOL = int(os.environ.get("KVPLAN_BENCH_POOL", 64 << 20))
WINDOW = int(os.environ.get("KVPLAN_BENCH_WINDOW", 2))
#: An experiment's knob: the polling loops' longest nap (both sides), unset: the library's.
MAX_NAP = os.environ.get("KVPLAN_BENCH_MAX_NAP")
#: Requests whose destination blocks are disjoint (the engines hold this many requests' blocks).
SLOTS = 4
STREAM_PORT = 47011

#: What kvplan_nixl sets unless the user did (kvplan_nixl._nixl.UCX_TCP_DEFAULTS); ``--ucx
#: default`` passes UCX's own values explicitly instead, for the comparison.
TUNED_UCX = {"UCX_TCP_TX_SEG_SIZE": "256K", "UCX_TCP_RX_SEG_SIZE": "256K"}
UCX_OWN = {"UCX_TCP_TX_SEG_SIZE": "8K", "UCX_TCP_RX_SEG_SIZE": "64K"}


# -- cases ---------------------------------------------------------------------------------


def _attention(tp: int, layers: int, nb: int, layout: str = "HND", allocation=None) -> dict:
    regions = []
    for i in range(layers):
        r = {"name": f"layers.{i}.attn", "kind": "attention", "num_blocks": nb,
             "block_size": 16, "dtype": "bfloat16", "num_kv_heads": 8, "head_dim": 128,
             "layout": layout}
        if allocation is not None:
            r["allocation"] = allocation
        regions.append(r)
    return {"tp_size": tp, "regions": regions}


def _mla(tp: int, layers: int, nb: int) -> dict:
    return {"tp_size": tp, "regions": [
        {"name": f"layers.{i}.mla", "kind": "mla", "num_blocks": nb, "block_size": 16,
         "dtype": "bfloat16", "dim": 576} for i in range(layers)]}


def case(name: str) -> tuple[dict, dict, int]:
    """(prefill spec, decode spec, tokens) of a case; every case moves 8-64 MiB to decode
    rank 0 from its prefill peers (P TP 8 -> D TP 4)."""
    if name == "llama-2k":  # Llama-3-70B-like heads, 32 layers: 16,384 runs of 4 KiB
        tokens, layers = 2048, 32
        nb = tokens // 16 * SLOTS + 16
        return _attention(8, layers, nb), _attention(4, layers, nb), tokens
    if name == "llama-32k":  # 2 layers of 32k tokens: 16,384 runs of 4 KiB
        tokens, layers = 32768, 2
        nb = tokens // 16 * SLOTS + 16
        return _attention(8, layers, nb), _attention(4, layers, nb), tokens
    if name == "cross-layer":  # vLLM cross-layer blocks (one buffer) -> token-major pages
        tokens, layers = 1024, 8
        nb = tokens // 16 * SLOTS + 16
        return (_attention(8, layers, nb, "BLHNC", "kv"), _attention(4, layers, nb, "NHD"),
                tokens)
    if name == "mla":  # DeepSeek-like latent, replicated: one prefill peer, whole blocks
        tokens, layers = 2048, 28
        nb = tokens // 16 * SLOTS + 16
        return _mla(8, layers, nb), _mla(4, layers, nb), tokens
    if name == "tiny":  # the tests' case (tests/test_netns_staged.py): P TP 4 -> D TP 2
        tokens, layers = 256, 3
        nb = tokens // 16 * SLOTS + 16
        spec = _attention(4, layers, nb)
        return spec, dict(spec, tp_size=2), tokens
    raise ValueError(f"unknown case {name!r}")


CASES = ("llama-2k", "llama-32k", "cross-layer", "mla")
#: Fill seed of the peers' buffers in ``--check`` runs (tests/oracle.py's source or sentinel).
SEED = 5


def blocks(nb: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).permutation(nb)[:n].tolist()


# -- helpers run inside a host -------------------------------------------------------------


def _cpu(pid: int | str = "self") -> float:
    """CPU seconds (user + system) of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream_server(port: int) -> int:
    """Host A: send the requested number of bytes on every connection (the TCP ceiling)."""
    srv = socket.create_server(("0.0.0.0", port))
    data = memoryview(np.random.default_rng(0).integers(0, 256, 256 << 20, np.uint8))
    print("ready", flush=True)
    while True:
        c, _ = srv.accept()
        with c:
            n = int(c.recv(64).decode())
            while n > 0:
                k = min(n, len(data))
                c.sendall(data[:k])
                n -= k


def stream_seconds(host: str, port: int, nbytes: int) -> float:
    """Seconds to receive ``nbytes`` on one TCP connection (connection set up before)."""
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with socket.create_connection((host, port)) as c:
        t = time.perf_counter()
        c.sendall(str(nbytes).encode())
        got = 0
        while got < nbytes:
            k = c.recv_into(view)
            if not k:
                raise ConnectionError("stream server closed early")
            got += k
        return time.perf_counter() - t


class Peers:
    """The other engine's ranks, ``tests/nixl_peer.py --stager`` processes in the other host."""

    def __init__(self, tmp: str, engine: str, spec: dict, ranks, back: list[str], mode: str,
                 host: str | None, fill: str = "random") -> None:
        self.procs, self.paths = [], []
        self.final: list[dict] = []  # each process's last line (notifications, sha256)
        env = dict(os.environ, PYTHONPATH=ROOT)
        for r in ranks:
            path = os.path.join(tmp, f"{engine}-{r}.md")
            cmd = [sys.executable, os.path.join(ROOT, "tests", "nixl_peer.py"), "--engine",
                   engine, "--rank", str(r), "--spec", json.dumps(spec), "--seed",
                   str(SEED if fill != "random" else r + 1), "--fill", fill,
                   "--metadata-out", path,
                   "--stager", f"{POOL},{SLOT},{WINDOW}"]
            for b in back:
                cmd += ["--connect", b, mode]
            if MAX_NAP:
                cmd += ["--max-nap", MAX_NAP]
            if host is not None:  # started from the initiator, inside the other namespace
                cmd = ["ip", "netns", "exec", host, *cmd]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, env=env, text=True))
            self.paths.append(path)

    def metadata(self) -> list[bytes]:
        out = []
        for p, path in zip(self.procs, self.paths, strict=True):
            line = p.stdout.readline().strip()
            assert line == "ready", f"peer said {line!r} (rc {p.poll()})"
            with open(path, "rb") as f:
                out.append(f.read())
        return out

    def connected(self) -> None:
        for p in self.procs:
            assert p.stdout.readline().strip() == "connected"

    def cpu(self) -> float:
        return sum(_cpu(p.pid) for p in self.procs if p.poll() is None)

    def close(self) -> None:
        if self.final:
            return
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.write("quit\n")
                    p.stdin.flush()
                except OSError:
                    pass
        for p in self.procs:
            try:
                if p.poll() is None or p.returncode == 0:
                    last = [x for x in p.stdout.read().splitlines() if x.startswith("{")]
                    self.final.append(json.loads(last[-1]) if last else {})
                p.wait(30)
            except (subprocess.TimeoutExpired, ValueError):
                p.kill()


def _write(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _bufs(spec: EngineSpec, rank: int) -> list:
    import torch

    return [torch.zeros(spec.rank_buffer_nbytes(b), dtype=torch.uint8)
            for b in range(len(spec.buffers))]


def initiator(args) -> dict:
    """Inside the initiating host: connect, measure every mode, report one JSON dict."""
    from kvplan import pull_map, push_map
    from kvplan_nixl import Endpoint
    from kvplan_nixl.staged import Stager

    if MAX_NAP:
        from kvplan_nixl import transfer

        transfer.MAX_SLEEP_SECONDS = float(MAX_NAP)
    src_d, dst_d, tokens = case(args.case)
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    nb = src.regions[0].num_blocks
    n = tokens // 16
    pull = args.mode == "pull"
    peers = pull_map(src, dst, 0).peers  # the prefill ranks decode rank 0 reads
    tmp = args.tmp
    if pull:
        dbufs = _bufs(dst, 0)
        local = [Endpoint("decode", dst, 0, dbufs)]
        remote = Peers(tmp, "prefill", src_d, peers, [os.path.join(tmp, "local-0.md")],
                       "push", args.other, "oracle" if args.check else "random")
        engine = "prefill"
    else:
        local = [Endpoint("prefill", src, r, _source(src, r) if args.check else _bufs(src, r))
                 for r in peers]
        remote = Peers(tmp, "decode", dst_d, [0],
                       [os.path.join(tmp, f"local-{i}.md") for i in range(len(local))],
                       "pull", args.other, "sentinel" if args.check else "random")
        engine = "decode"
        dbufs = []
    sts = [Stager(ep, pool_bytes=POOL, slot_bytes=SLOT, window=WINDOW) for ep in local]
    out: dict = {"case": args.case, "mode": args.mode}
    try:
        metas = remote.metadata()
        for i, ep in enumerate(local):
            _write(os.path.join(tmp, f"local-{i}.md"), ep.metadata())
            for m in metas:
                ep.connect(m, mode=args.mode)
        remote.connected()
        inflight = args.inflight
        reqs = []  # disjoint block ids per request in flight (both sides)
        dperm = np.random.default_rng(1).permutation(nb)
        for k in range(max(inflight, 1)):
            db = dperm[(k % SLOTS) * n:(k % SLOTS + 1) * n].tolist()
            reqs.append(([blocks(nb, n, 10 + k)], [db]))
        maps = [(pull_map(src, dst, 0),) if pull else
                tuple(push_map(src, dst, r) for r in peers)][0]
        plans = [m.plan(*reqs[0]) for m in maps]
        nbytes = sum(p.nbytes for p in plans)
        runs = sum(len(p) for p in plans)
        out.update(nbytes=nbytes, runs=runs, peers=len(peers) if pull else 1)

        def go(how: str, ps=plans) -> list:
            ts = [st.post(p, engine, how=how, timeout=120) for st, p in zip(sts, ps,
                                                                            strict=True)]
            for t in ts:
                t.wait(120, progress=sts)
            for t in ts:
                if not t.ok:
                    raise RuntimeError(f"{how}: {t.error()}")
            return ts

        if args.check:
            out["check"] = _check(args, sts, plans, maps, reqs[0], engine, remote, src_d, dst_d,
                                  dbufs)
            return out
        go("staged")  # sets up connections and teaches each Stager its peers' pools
        go("direct")
        costs = [st.calibrate(engine, progress=sts) for st in sts]
        out["costs"] = [{k: getattr(c, k) for k in ("per_descriptor", "per_byte",
                                                    "local_per_byte", "per_chunk")}
                        for c in costs]
        out["auto_choice"] = [list(st.staged_peers(p, engine)) for st, p in zip(sts, plans)]
        link = _link(sts, pull, plans)
        times: dict[str, list[float]] = {k: [] for k in ("link", "direct", "staged", "auto")}
        cpu: dict[str, list[float]] = {k: [0.0, 0.0] for k in times}
        if pull:
            times["tcp"] = []
            stream_seconds(args.peer_addr, STREAM_PORT, 1 << 20)  # warm
        for _ in range(args.reps):
            for how in [h for h in ("link", "direct", "staged", "auto") if h in args.measure]:
                c0, r0 = _cpu(), remote.cpu()
                t = time.perf_counter()
                if how == "link":
                    link()
                else:
                    go(how)
                times[how].append(time.perf_counter() - t)
                cpu[how][0] += _cpu() - c0
                cpu[how][1] += remote.cpu() - r0
            if pull:
                times["tcp"].append(stream_seconds(args.peer_addr, STREAM_PORT, nbytes))
        out["auto_why"] = sts[0].last_choice
        out["rates"] = {m: v * 1e9 for r in sts[0].measured.rate.values() for m, v in r.items()}
        out["seconds"] = {k: statistics.median(v) if v else float("nan")
                          for k, v in times.items()}
        out["all_seconds"] = times
        moved = nbytes * args.reps / 1e9
        out["cpu_per_gb"] = {k: [v[0] / moved, v[1] / moved] for k, v in cpu.items()}
        # several auto requests in flight (the soak's shape): requests per second
        multi = [[m.plan(*r) for m in maps] for r in reqs[:inflight]]
        rounds = max(1, args.reps)
        t = time.perf_counter()
        for _ in range(rounds):
            ts = [st.post(p, engine, how="auto", timeout=120)
                  for ps in multi for st, p in zip(sts, ps, strict=True)]
            for tr in ts:
                tr.wait(120, progress=sts)
                assert tr.ok, tr.error()
        el = max(time.perf_counter() - t, 1e-9)
        out["inflight"] = {"requests": rounds * inflight, "seconds": el, "inflight": inflight,
                           "rps": rounds * inflight / el, "gbps": rounds * inflight * nbytes
                           / el / 1e9}
        if args.dead and pull:
            out["dead"] = _dead_peer(sts[0], plans[0], engine, remote, args.dead)
    finally:
        for st in sts:
            st.close()
        for ep in local:
            ep.close()
        remote.close()
    return out


def _source(spec: EngineSpec, rank: int) -> list:
    """Source rank ``rank``'s buffers with tests/oracle.py's content (one per region)."""
    import torch

    from tests import oracle

    every = oracle.source_buffers(spec.to_dict(), seed=SEED)
    return [torch.from_numpy(every[(rank, i)].copy()) for i in range(len(spec.regions))]


def _check(args, sts, plans, maps, req, engine: str, remote: Peers, src_d, dst_d,
           dbufs: list) -> dict:
    """``--check``: the request's bytes against tests/oracle.py for each mode, and auto's
    choice against the cost model evaluated here on the calibrated costs."""
    from kvplan.staging import prefer_staged
    from kvplan_nixl.staged import MixedTransfer, StagedTransfer
    from tests import oracle

    pull = args.mode == "pull"
    sb, db = req
    src = oracle.source_buffers(src_d, seed=SEED)
    res: dict = {}

    def expected(before: dict) -> dict:
        exp, _ = oracle.expected_destination(src_d, dst_d, sb, db, 0, src, before)
        return exp

    def go(how: str) -> object:
        ts = [st.post(p, engine, how=how, timeout=60) for st, p in zip(sts, plans, strict=True)]
        for t in ts:
            t.wait(60, progress=sts)
        return ts[0]

    go("staged")  # connects, teaches each Stager its peers' pools
    costs = [st.calibrate(engine, progress=sts) for st in sts]
    choice, model = [], []
    for st, p, c in zip(sts, plans, costs, strict=True):
        rows = p.copies()
        col = rows["src_rank" if pull else "dst_rank"]
        want = []
        for r in np.unique(col).tolist():
            lengths = rows["length"][col == r]
            n = int(lengths.sum())
            if prefer_staged(len(lengths), n, -(-n // st.slot_bytes), c):
                want.append(r)
        model.append(want)
        choice.append(list(st.staged_peers(p, engine)))
    res["auto_choice"], res["model_choice"] = choice, model
    res["costs"] = [[c.per_descriptor, c.per_byte, c.local_per_byte, c.per_chunk]
                    for c in costs]
    if pull:
        bufs = [b.numpy() for b in dbufs]  # one per region in the cases checked
        res["exact"] = {}
        for how in ("direct", "staged", "auto"):
            for b in bufs:
                b[:] = 0
            t = go(how)
            got = {(0, i): bufs[i] for i in range(len(bufs))}
            exp = expected({k: np.zeros_like(v) for k, v in got.items()})
            res["exact"][how] = all(np.array_equal(got[(0, k)], exp[k]) for k in exp)
            if how == "auto":
                res["auto_staged"] = isinstance(t, StagedTransfer)
                res["auto_why"] = sts[0].last_choice
                rates = next(iter(sts[0].measured.rate.values()))
                picked = "staged" if isinstance(t, StagedTransfer) else (
                    "mixed" if isinstance(t, MixedTransfer) else "direct")
                res["auto_follows_measured"] = picked == min(rates, key=rates.__getitem__)
    else:  # the destination is the peer: its digest once it quits, after one staged push
        go("staged")
        res["auto_staged"] = None
        before = oracle.destination_buffers(dst_d, seed=SEED)
        exp = expected(before)
        remote.close()
        import hashlib

        want = [hashlib.sha256(exp[i].tobytes()).hexdigest() for i in range(len(exp))]
        res["exact"] = {"staged": remote.final[0].get("sha256") == want}
    return res


def _link(sts, pull: bool, plans):
    """A callable moving each peer's bytes of the request as one contiguous READ (pull) or
    WRITE (push) between the staging pools, all peers at once."""
    from kvplan_nixl.staged.pool import PIECE

    jobs = []
    for st, p in zip(sts, plans, strict=True):
        pool = st._pool
        agent = st.ep._require()
        col = "src_rank" if pull else "dst_rank"
        rows = p.copies()
        ranks = np.unique(rows[col]).tolist()
        off = 0
        for r in ranks:
            nbytes = int(rows["length"][rows[col] == r].sum())
            nbytes = -(-nbytes // PIECE) * PIECE
            # the peer's own pool: at most its size, repeated to make up the bytes
            name = next(x.agent for x in st.ep.peers() if x.rank == r)
            left = nbytes
            while left > 0:
                k = min(left, POOL, POOL - off % POOL)
                jobs.append((pool, agent, "READ" if pull else "WRITE", name, off % POOL, k))
                off += k
                left -= k
    def run() -> None:
        hs = []
        for pool, agent, op, name, o, k in jobs:
            h = pool.make_xfer(agent, op, name, np.asarray([o]), np.asarray([0]),
                               np.asarray([k]), b"")
            hs.append((agent, pool, h))
            assert agent.transfer(h) in ("PROC", "DONE")
        for agent, pool, h in hs:
            while True:
                s = agent.check_xfer_state(h)
                if s == "DONE":
                    break
                assert s == "PROC", s
            pool.handles.release(h)

    return run


def _dead_peer(st, plan, engine: str, remote: Peers, kill_after: float) -> dict:
    """Kill the second prefill peer while a request waits on it: auto, then staged (each on
    the peers still alive after the previous kill fails fast against a dead rank)."""
    victim = remote.procs[-1]
    victim.send_signal(signal.SIGSTOP)
    res = {}
    t = st.post(plan, engine, how="auto", timeout=60)
    time.sleep(kill_after)
    victim.send_signal(signal.SIGKILL)
    victim.wait(30)
    k = time.perf_counter()
    _wait_quiet(t, st)
    res["auto_seconds_after_kill"] = time.perf_counter() - k
    res["auto_error"] = type(t.error()).__name__ if not t.ok else None
    k = time.perf_counter()
    t2 = st.post(plan, engine, how="staged", timeout=60)
    _wait_quiet(t2, st)
    res["staged_seconds_dead"] = time.perf_counter() - k
    res["staged_error"] = type(t2.error()).__name__ if not t2.ok else None
    k = time.perf_counter()
    t3 = st.post(plan, engine, how="auto", timeout=60)
    _wait_quiet(t3, st)
    res["auto_seconds_dead"] = time.perf_counter() - k
    res["auto_dead_error"] = type(t3.error()).__name__ if not t3.ok else None
    return res


def _wait_quiet(t, st) -> None:
    try:
        t.wait(90, progress=[st])
    except Exception:
        pass


# -- the driver (root) ---------------------------------------------------------------------


def run_case(name: str, mode: str, args, ucx: dict) -> dict:
    with netns.TwoHosts() as hosts, tempfile.TemporaryDirectory(prefix="kvplan-2h-") as tmp:
        env = {**netns.ucx_env(), **ucx, "PYTHONPATH": ROOT}
        me, other = ("b", "a") if mode == "pull" else ("a", "b")
        stream = None
        if mode == "pull":
            stream = hosts.spawn("a", [sys.executable, __file__, "--role", "stream-server"],
                                 stdout=subprocess.PIPE, text=True, env=env)
            assert stream.stdout.readline().strip() == "ready"
        cmd = [sys.executable, __file__, "--role", "initiator", "--case", name, "--mode", mode,
               "--tmp", tmp, "--other", hosts.ns[other], "--peer-addr", netns.ADDRS["a"],
               "--reps", str(args.reps), "--inflight", str(args.inflight),
               "--measure", args.measure] + (["--check"] if args.check else [])
        cmd += ["--dead", str(args.dead if name == "llama-2k" and mode == "pull" else 0)]
        p = hosts.spawn(me, cmd, stdout=subprocess.PIPE, text=True, env=env)
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{name} {mode}: initiator exited {p.returncode}")
        return json.loads(out.strip().splitlines()[-1])


def report(results: list[dict]) -> str:
    lines = ["| case | mode | MiB, runs | link GB/s | link / TCP stream | direct / link | "
             "staged / link | auto / link | auto chose (staged peers) | auto, in flight: "
             "req/s (GB/s) | CPU s/GB initiator / peers (link, direct, staged, auto) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["seconds"]
        gb = r["nbytes"] / 1e9
        tcp = f"{s['tcp'] and s['link'] and s['tcp'] / s['link']:.0%}" if "tcp" in s else "-"
        cpu = ", ".join(f"{r['cpu_per_gb'][k][0]:.2f} / {r['cpu_per_gb'][k][1]:.2f}"
                        for k in ("link", "direct", "staged", "auto"))
        f = r["inflight"]
        lines.append(
            f"| {r['case']} | {r['mode']} | {r['nbytes'] / 2**20:.0f}, {r['runs']} | "
            f"{gb / s['link']:.2f} | {tcp} | {s['link'] / s['direct']:.0%} | "
            f"{s['link'] / s['staged']:.0%} | {s['link'] / s['auto']:.0%} | "
            f"{r['auto_choice']} | {f['rps']:.1f} ({f['gbps']:.2f}) x{f['inflight']} | {cpu} |")
    dead = [r["dead"] for r in results if r.get("dead")]
    for d in dead:
        lines.append("")
        lines.append("dead peer (killed mid-request): auto failed "
                     f"{d['auto_seconds_after_kill']:.2f} s after the kill ({d['auto_error']}); "
                     "then, against the dead rank, "
                     f"staged failed in {d['staged_seconds_dead']:.2f} s ({d['staged_error']}), "
                     f"auto in {d['auto_seconds_dead']:.2f} s ({d['auto_dead_error']})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", default="driver", choices=["driver", "initiator", "stream-server"])
    ap.add_argument("--case", action="append", choices=(*CASES, "tiny"))
    ap.add_argument("--mode", action="append", choices=["pull", "push"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="Llama 2k tokens only")
    ap.add_argument("--ucx", default="tuned", choices=["tuned", "default"])
    ap.add_argument("--dead", type=float, default=0.3,
                    help="seconds into a request to kill a peer (0: skip)")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--measure", default="link,direct,staged,auto",
                    help="which of link,direct,staged,auto to time (comma-separated)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="extra environment of every process (UCX settings to try)")
    ap.add_argument("--check", action="store_true",
                    help="instead of timing: check every mode's bytes against tests/oracle.py "
                         "and auto's choice against the cost model (the tests run this)")
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    ap.add_argument("--other", help=argparse.SUPPRESS)
    ap.add_argument("--peer-addr", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "stream-server":
        return stream_server(STREAM_PORT)
    if args.role == "initiator":
        args.case, args.mode = args.case[0], args.mode[0]
        print(json.dumps(initiator(args)), flush=True)
        return 0
    why = netns.unavailable()
    if why is not None:
        print(f"bench_two_hosts: cannot make network namespaces: {why}", file=sys.stderr)
        return 2
    cases = args.case or (["llama-2k"] if args.quick else list(CASES))
    modes = args.mode or ["pull", "push"]
    ucx = dict(TUNED_UCX if args.ucx == "tuned" else UCX_OWN)
    ucx.update(x.split("=", 1) for x in args.env)
    results = []
    for name in cases:
        for mode in modes:
            t = time.perf_counter()
            results.append(run_case(name, mode, args, ucx))
            print(f"# {name} {mode}: {time.perf_counter() - t:.0f} s", file=sys.stderr,
                  flush=True)
    if args.check:
        print(json.dumps(results))
        return 0
    print(f"UCX over TCP, {ucx}; median of {args.reps}")
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
