"""One engine (prefill or decode) in its own process: a toy scheduler and one thread per rank.

Run by ``python -m examples.connector``; talks JSON lines with it on stdin/stdout. Each rank
thread owns one ``kvplan_nixl.Endpoint`` (an Endpoint is used from one thread only) and
publishes its metadata in etcd; decode ranks fetch the prefill ranks' metadata from etcd,
connect, and pull each request with a notification; prefill ranks free a request's blocks
once every decode rank that reads from them has notified.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import queue
import sys
import threading

import numpy as np

from examples.connector.etcd import Etcd
from kvplan import EngineSpec, pull_map, simulate
from kvplan.examples import gqa_with_mla_draft

NS = "/kvplan/example"


def model(tp: int, num_blocks: int) -> EngineSpec:
    """The example's KV cache: 2 GQA layers (8 KV heads of 128) + an MLA draft layer; kv 'joint'
    so that one block of a region is one contiguous slice of its buffer."""
    return gqa_with_mla_draft(tp, layers=2, num_blocks=num_blocks, kv="joint")


def fill(req: int, spec: EngineSpec, rank: int, region: int, n: int) -> np.ndarray:
    """What prefill "computes": the bytes of ``n`` blocks of one request, one rank, one region,
    as an (n, block bytes) array with no zero byte; the same on every rank of a replicated
    region (MLA), since replicas hold the same data."""
    who = 0 if spec.regions[region].is_replicated else rank + 1
    key = (((req * 1009 + who) * 1013 + region) * 40503 + 1) & 0xFFFFFFFF
    x = np.arange(n * spec.rank_block_nbytes(region), dtype=np.uint32) * np.uint32(2654435761)
    x += np.uint32(key)  # a Weyl sequence per key; its top byte, made odd, is never 0
    return (x >> np.uint32(24) | np.uint32(1)).astype(np.uint8).reshape(n, -1)


class Rank(threading.Thread):
    """One rank: its Endpoint and buffers; commands in ``inbox``, results to ``events``."""

    def __init__(self, role: str, spec: EngineSpec, rank: int, etcd: Etcd, other: int,
                 events: queue.Queue) -> None:
        super().__init__(daemon=True)
        self.role, self.spec, self.rank, self.etcd, self.other = role, spec, rank, etcd, other
        self.events, self.inbox = events, queue.Queue()
        self.bufs = [np.zeros(spec.rank_region_nbytes(i), np.uint8)
                     for i in range(len(spec.regions))]
        self.blocks = [b.reshape(spec.regions[i].num_blocks, -1) for i, b in enumerate(self.bufs)]
        self.inflight: dict = {}
        self.src: dict = {}  # decode: (prefill rank, region) -> what it holds, recomputed
        self.want = {(rank, i): np.zeros_like(b) for i, b in enumerate(self.bufs)}

    def run(self) -> None:
        from kvplan_nixl import Endpoint  # imported by main() already, before the threads

        with Endpoint(self.role, self.spec, self.rank, self.bufs) as ep:
            self.ep = ep
            key = f"{NS}/{self.role}/rank/{self.rank}"
            self.etcd.put(key, ep.metadata())
            if self.role == "decode":  # pull: connect one prefill rank, then the map's peers
                mds = self.etcd.wait(f"{NS}/prefill/rank/", self.other)
                md = [mds[f"{NS}/prefill/rank/{r}"] for r in range(self.other)]
                ep.connect(md[0])
                for r in ep.map("prefill").peers:
                    ep.connect(md[r])
            self.events.put(("ready", self.rank))
            while self.step():
                pass
            self.etcd.delete(key)

    def step(self) -> bool:
        try:  # block briefly only when idle; a target must still be progressed regularly
            cmd = self.inbox.get(timeout=0.001) if not self.inflight else self.inbox.get_nowait()
        except queue.Empty:
            cmd = None
        if cmd == "quit":
            return False
        if cmd and cmd[0] == "compute":  # prefill: write the request's KV into its blocks
            _, req, ids = cmd
            for i, blk in enumerate(self.blocks):
                blk[ids] = fill(req, self.spec, self.rank, i, len(ids))
            self.events.put(("computed", req, self.rank))
        elif cmd and cmd[0] == "load":  # decode: plan with the handshake's map, post one read
            _, req, src, dst = cmd
            for blk in self.blocks:
                blk[dst] = 0  # so that a byte the read misses shows up as 0
            plan = self.ep.map("prefill").plan([src], [dst])
            t = self.ep.read(plan, "prefill", notify=str(req).encode(), timeout=30.0)
            self.inflight[req] = t
        for n in self.ep.notifications():  # progresses the agent (prefill: learn the frees)
            self.events.put(("notified", int(n.message), self.rank, n.rank))
        for req, t in list(self.inflight.items()):
            t.poll()
            if t.done:
                del self.inflight[req]
                self.events.put(("loaded", req, self.rank, *self.verify(req, t), t.plan.nbytes,
                                 (t.seconds or 0.0) * 1e3))
        return True

    def verify(self, req: int, t) -> tuple[bool, str, str]:
        """(ok, sha256 of the request's blocks, error): no byte was missed, and the bytes equal
        what kvplan.simulate moves from the prefill ranks' ``fill`` rebuilt here (into
        ``src``, the prefill ranks' buffers as this rank can recompute them, and ``want``)."""
        if not t.ok:
            return False, "", str(t.error())
        plan, pspec = t.plan, t.plan.map.src
        src_ids, dst_ids = plan.src_blocks[0], plan.dst_blocks[0]
        for r, i in {(int(a), int(b)) for a, b in plan.copies()[["src_rank", "src_region"]]}:
            if (r, i) not in self.src:
                self.src[(r, i)] = np.zeros(pspec.rank_region_nbytes(i), np.uint8)
            blocks = self.src[(r, i)].reshape(pspec.regions[i].num_blocks, -1)
            blocks[src_ids] = fill(req, pspec, r, i, len(src_ids))
        for i, blk in enumerate(self.blocks):
            self.want[(self.rank, i)].reshape(blk.shape)[dst_ids] = 0
        simulate(plan, self.src, self.want)
        sha = hashlib.sha256()
        for i, blk in enumerate(self.blocks):
            got = blk[dst_ids]
            sha.update(got.tobytes())
            exp = self.want[(self.rank, i)].reshape(blk.shape)[dst_ids]
            if not got.all() or not np.array_equal(got, exp):
                return False, sha.hexdigest(), f"region {self.spec.regions[i].name}: bytes differ"
        return True, sha.hexdigest(), ""


class Scheduler:
    """A toy scheduler: a free list of block ids shared by the engine's ranks, FIFO waiting."""

    def __init__(self, num_blocks: int, block_size: int, seed: int) -> None:
        self.free = list(np.random.default_rng(seed).permutation(num_blocks).tolist())
        self.block_size, self.waiting, self.total = block_size, [], num_blocks

    def allocate(self, tokens: int) -> list[int] | None:
        n = -(-tokens // self.block_size)
        if n > len(self.free):
            return None
        ids, self.free = self.free[:n], self.free[n:]
        return ids

    def release(self, ids: list[int]) -> None:
        self.free += ids


def _stdin(events: queue.Queue) -> None:
    for line in sys.stdin:
        events.put(("in", json.loads(line)))
    events.put(("in", {"op": "quit"}))  # the proxy went away


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--etcd", required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--other-tp", type=int, required=True)
    ap.add_argument("--num-blocks", type=int, default=128)
    a = ap.parse_args()
    import kvplan_nixl.endpoint  # noqa: F401  (loads NIXL once, before the rank threads)

    etcd, spec, events = Etcd(a.etcd), model(a.tp, a.num_blocks), queue.Queue()
    etcd.put(f"{NS}/{a.role}/spec", json.dumps(spec.to_dict()).encode())
    ranks = [Rank(a.role, spec, r, etcd, a.other_tp, events) for r in range(a.tp)]
    for r in ranks:
        r.start()
    sched = Scheduler(a.num_blocks, spec.regions[0].block_size, seed=len(a.role))
    live: dict[int, dict] = {}  # request id -> its state on this engine
    expect: set = set()
    if a.role == "prefill":  # the (prefill rank, decode rank) pairs that notify per request
        d = json.loads(etcd.wait(f"{NS}/decode/spec", 1)[f"{NS}/decode/spec"])
        dspec = EngineSpec.from_dict(d)
        expect = {(p, r) for r in range(dspec.num_ranks) for p in pull_map(spec, dspec, r).peers}

    def say(**msg) -> None:
        print(json.dumps(msg), flush=True)

    def admit() -> None:  # FIFO: start waiting requests while their blocks fit
        while sched.waiting and (ids := sched.allocate(sched.waiting[0]["tokens"])) is not None:
            m = sched.waiting.pop(0)
            live[m["id"]] = {**m, "ids": ids, "acks": {}, "notes": set()}
            for r in ranks:
                r.inbox.put(("compute", m["id"], ids) if a.role == "prefill"
                            else ("load", m["id"], m["src"], ids))

    threading.Thread(target=_stdin, args=(events,), daemon=True).start()
    ready = 0
    while True:
        kind, *ev = events.get()
        st = live.get(ev[0]) if kind in ("computed", "notified", "loaded") else None
        if kind == "ready":
            ready += 1
            if ready == a.tp:
                say(op="ready", role=a.role)
        elif kind == "in" and ev[0]["op"] == "quit":
            break
        elif kind == "in" and ev[0]["op"] == "free":  # the proxy gave up on a request
            if (gone := live.pop(ev[0]["id"], None)) is not None:
                sched.release(gone["ids"])
        elif kind == "in":
            sched.waiting.append(ev[0])
        elif st is None:
            pass  # a late event of a request already freed
        elif kind == "computed":
            st["acks"][ev[1]] = True
            if len(st["acks"]) == a.tp:
                say(op="prefilled", id=ev[0], blocks=st["ids"])
        elif kind == "notified":
            st["notes"].add((ev[1], ev[2]))
            if expect <= st["notes"]:  # every decode rank read this request: free its blocks
                sched.release(live.pop(ev[0])["ids"])
                say(op="freed", id=ev[0])
        elif kind == "loaded":
            st["acks"][ev[1]] = ev[2:]  # ok, sha256, error, bytes, ms
            if len(st["acks"]) == a.tp:  # every rank has the request: "decode" it, free
                sched.release(live.pop(ev[0])["ids"])
                res = [st["acks"][r] for r in range(a.tp)]
                say(op="done", id=ev[0], ok=all(x[0] for x in res), src=st["src"], dst=st["ids"],
                    sha256=[x[1] for x in res], errors=[x[2] for x in res if x[2]],
                    bytes=sum(x[3] for x in res), ms=max(x[4] for x in res))
        admit()
    for r in ranks:
        r.inbox.put("quit")
    for r in ranks:
        r.join(30)
    etcd.delete(f"{NS}/{a.role}/spec")
    say(op="bye", role=a.role, free=len(sched.free), blocks=sched.total, live=len(live))
    return 0


if __name__ == "__main__":
    sys.exit(main())
