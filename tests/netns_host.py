"""One engine's ranks in one OS process on one "host", driven over stdin/stdout (run as a script).

    python tests/netns_host.py --engine decode --spec '<EngineSpec JSON>' --ranks 0,1 \
        --fill zeros --peer-spec '<the other engine's spec>' --peer-seed 7

The two-host tests (``tests/test_netns.py``) start one of these per engine (or per rank) inside
a network namespace. It makes one Endpoint per rank in ``--ranks`` over numpy buffers (the
oracle's source bytes with ``--fill oracle``, its sentinel with ``--fill sentinel``, zeros with
``--fill zeros``), prints one JSON line ``{"ready": ..., "metadata": {rank: base64}}``, then
answers one JSON command per stdin line with one JSON line. Between commands it progresses its
agents and polls its transfers in flight (an agent without a progress thread must be driven:
a target that is not progressed stalls the transfers it serves).

Commands (``op``): ``connect`` (metas, mode), ``disconnect`` (remote, rank), ``post`` (mode,
remote, src_blocks, dst_blocks, deadline, notify: every local rank posts its plan), ``states``,
``wait`` (every posted transfer to done or failed; its outcome), ``digest`` (sha256 per rank and
region), ``fill`` (reset the buffers), ``handles``, ``soak`` (many requests, see ``_soak``),
``quit``. A failed request is reported with its error's class, failed peer ranks, reasons and
the destination blocks it names, so that the test asserts on exactly what a caller would see.
"""

from __future__ import annotations

import argparse
import base64
import faulthandler
import hashlib
import json
import os
import select
import signal
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvplan import EngineSpec
from kvplan_nixl import Endpoint, TransferFailed
from tests import oracle


def _fill(spec: EngineSpec, ranks: list[int], how: str, seed: int) -> dict:
    """``{(rank, region): array}``, the regions of a pool sharing one array, as the oracle."""
    if how == "oracle":
        every = oracle.source_buffers(spec.to_dict(), seed=seed)
    elif how == "sentinel":
        every = oracle.destination_buffers(spec.to_dict(), seed=seed)
    else:
        every = {}
        for r in range(spec.num_ranks):
            for i in spec.regions_on(r):
                a = spec.allocation_of(i)
                if (r, a) not in every:
                    every[(r, a)] = np.zeros(spec.rank_region_nbytes(i), np.uint8)
                every[(r, i)] = every[(r, a)]
    return {k: v for k, v in every.items() if k[0] in ranks}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _outcome(ep: Endpoint, t) -> dict:
    err = t.error()
    out = {"rank": ep.rank, "ok": t.ok, "seconds": t.seconds, "nbytes": t.nbytes,
           "states": {str(k): v.value for k, v in t.states().items()}}
    if err is not None:
        out.update(error=type(err).__name__, message=str(err), peer_ranks=list(err.peer_ranks),
                   reasons={str(k): v for k, v in err.reasons.items()},
                   blocks=[b.tolist() for b in err.blocks])
    return out


def _byte_index(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    starts = np.repeat(offsets - (np.cumsum(lengths) - lengths), lengths)
    return starts + np.arange(int(lengths.sum()), dtype=np.int64)


def _check_runs(plan, src: dict, dst: dict) -> int:
    """Every run of a completed pull plan: destination bytes equal the source bytes it names
    (``kvplan.simulate``'s semantics, checked for this plan alone); returns bytes compared."""
    rows = plan.copies()
    r = plan.map.rank
    keys = np.stack([rows["src_rank"], rows["src_region"], rows["dst_region"]], axis=1)
    checked = 0
    for sr, si, dj in np.unique(keys, axis=0).tolist():
        sel = rows[(keys == (sr, si, dj)).all(axis=1)]
        got = dst[(r, dj)][_byte_index(sel["dst_offset"], sel["length"])]
        want = src[(sr, si)][_byte_index(sel["src_offset"], sel["length"])]
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero(got != want)[0])
            raise AssertionError(f"rank {r} region {dj}: byte {bad} of the runs from prefill "
                                 f"rank {sr} region {si} differs")
        checked += got.size
    return checked


class Host:
    def __init__(self, args) -> None:
        self.spec = EngineSpec.from_dict(json.loads(args.spec))
        self.ranks = [int(r) for r in args.ranks.split(",")]
        self.args = args
        self.bufs = _fill(self.spec, self.ranks, args.fill, args.seed)
        self.eps = {}
        for r in self.ranks:
            mine = {self.spec.regions[i].name: self.bufs[(r, i)] for i in self.spec.regions_on(r)}
            self.eps[r] = Endpoint(args.engine, self.spec, r, mine)
        self.posted: list[tuple[Endpoint, object]] = []
        self.notes: list[list] = []

    # -- the loop ------------------------------------------------------------------------------

    def idle(self) -> None:
        for ep in self.eps.values():
            self.notes += [[n.engine, n.rank, n.message.decode()] for n in ep.notifications()]
        for _, t in self.posted:
            if not t.done:
                t.poll()

    def handles(self) -> dict:
        return {str(r): ep.handles() for r, ep in self.eps.items()}

    def metadata(self) -> dict:
        return {str(r): base64.b64encode(ep.metadata()).decode() for r, ep in self.eps.items()}

    # -- commands ------------------------------------------------------------------------------

    def op_connect(self, metas, mode="pull"):
        for ep in self.eps.values():
            for m in metas:
                ep.connect(base64.b64decode(m), mode=mode)
        return {"handles": self.handles()}

    def op_disconnect(self, remote, rank):
        for ep in self.eps.values():
            ep.disconnect(remote, rank)
        return {"handles": self.handles()}

    def op_post(self, mode, remote, src_blocks, dst_blocks, deadline=None, notify=None):
        for ep in self.eps.values():
            plan = ep.map(remote, mode).plan(src_blocks, dst_blocks)
            post = ep.read if mode == "pull" else ep.write
            t = post(plan, remote, notify=None if notify is None else notify.encode(),
                     timeout=deadline)
            self.posted.append((ep, t))
        return self.op_states()

    def op_states(self):
        return {"states": [{str(k): v.value for k, v in t.poll().items()}
                           for _, t in self.posted]}

    def op_wait(self, limit=120.0):
        """Wait every posted transfer (deadlines given at post apply; ``limit`` is a backstop)."""
        out = []
        for ep, t in self.posted:
            try:
                t.wait(limit, progress=[e for e in self.eps.values() if e is not ep])
            except TransferFailed:
                pass
            out.append(_outcome(ep, t))
        self.posted = []
        return {"transfers": out, "handles": self.handles()}

    def op_digest(self):
        return {"sha256": {f"{r},{i}": hashlib.sha256(b.tobytes()).hexdigest()
                           for (r, i), b in sorted(self.bufs.items())}}

    def op_fill(self):
        fresh = _fill(self.spec, self.ranks, self.args.fill, self.args.seed)
        for k, v in fresh.items():
            self.bufs[k][:] = v
        return {}

    def op_notifications(self):
        notes, self.notes = self.notes, []
        return {"notifications": notes}

    def op_handles(self):
        t = os.times()
        return {"handles": self.handles(), "rss": _rss(), "cpu": t.user + t.system}

    def op_soak(self, requests, inflight, remote="prefill", seed=0, max_blocks=16,
                sample=10, deadline=30.0):
        """``requests`` pulls from ``remote``, ``inflight`` at once (every local rank posts its
        plan of each), random source blocks and disjoint destination blocks among those in
        flight. Every ``sample``-th request is checked run by run against the peer's source bytes
        (recomputed here from its spec and seed) as soon as it completes, before its
        destination blocks are reused. Reports rates, and RSS and handles ten times along the
        way."""
        peer = EngineSpec.from_dict(json.loads(self.args.peer_spec))
        src = oracle.source_buffers(peer.to_dict(), seed=self.args.peer_seed)
        rng = np.random.default_rng(seed)
        n_src = min(r.num_blocks for r in peer.regions)
        n_dst = min(r.num_blocks for r in self.spec.regions)
        free = list(rng.permutation(n_dst))
        live: list[tuple[int, list[int], list]] = []  # (request, its dst blocks, transfers)
        eps = list(self.eps.values())
        moved = checked = done = 0
        rss, handles = [], []
        start = time.perf_counter()
        i = 0
        nap = 1e-5
        while done < requests:
            while i < requests and len(live) < inflight and len(free) >= max_blocks:
                k = int(rng.integers(1, max_blocks + 1))
                dst = [int(free.pop()) for _ in range(k)]
                sb = [rng.choice(n_src, k, replace=False).tolist()]
                ts = []
                for ep in eps:
                    plan = ep.map(remote).plan(sb, [dst])
                    ts.append(ep.read(plan, remote, timeout=deadline))
                live.append((i, dst, ts))
                i += 1
            for ep in eps:
                ep.progress()
            still = []
            for req, dst, ts in live:
                for t in ts:
                    t.poll()
                if not all(t.done for t in ts):
                    still.append((req, dst, ts))
                    continue
                for t in ts:
                    if not t.ok:
                        raise t.error()
                    moved += t.nbytes
                    if req % sample == 0:
                        checked += _check_runs(t.plan, src, self.bufs)
                free.extend(dst)
                done += 1
                if done % max(1, requests // 10) == 0:
                    rss.append(_rss())
                    handles.append(self.handles())
            if len(still) == len(live):  # nothing finished: let the peers have the CPU
                time.sleep(nap)
                nap = min(2 * nap, 1e-3)
            else:
                nap = 1e-5
            live = still
        seconds = time.perf_counter() - start
        return {"requests": requests, "seconds": seconds, "bytes": moved,
                "sample_bytes_checked": checked, "sampled": (requests + sample - 1) // sample,
                "rss": rss, "handles": handles}


def main() -> int:
    # the protocol gets its own copy of stdout; fd 1 goes to stderr, so that whatever native
    # code prints (UCX_PROTO_INFO=y prints to stdout) cannot break the JSON lines
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 pid`: where is it stuck?
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--spec", required=True, help="EngineSpec as JSON")
    ap.add_argument("--ranks", required=True, help="comma-separated flat ranks to host")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fill", choices=["oracle", "sentinel", "zeros"], default="oracle")
    ap.add_argument("--peer-spec", default="null", help="the other engine's spec (for soak)")
    ap.add_argument("--peer-seed", type=int, default=0)
    ap.add_argument("--poll", type=float, default=1e-3,
                    help="seconds between progress calls while idle (a target's reply latency)")
    host = Host(ap.parse_args())
    print(json.dumps({"ready": True, "pid": os.getpid(), "metadata": host.metadata()}),
          file=out, flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], host.args.poll)
        if not ready:
            host.idle()
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            break
        try:
            if os.environ.get("NETNS_HOST_PROFILE") and op == "soak":  # where the time goes
                import cProfile

                with cProfile.Profile() as prof:
                    reply = {"ok": True, **host.op_soak(**cmd)}
                prof.dump_stats(os.environ["NETNS_HOST_PROFILE"])
            else:
                reply = {"ok": True, **getattr(host, f"op_{op}")(**cmd)}
        except Exception as exc:
            reply = {"ok": False, "error": type(exc).__name__, "message": str(exc),
                     "traceback": traceback.format_exc()}
        print(json.dumps(reply), file=out, flush=True)
    for ep in host.eps.values():
        ep.close()
    print(json.dumps({"closed": True, "handles": host.handles()}), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
