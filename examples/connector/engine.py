"""One engine (prefill or decode) in its own process: a toy scheduler and one thread per rank.

Run by ``python -m examples.connector``; talks JSON lines with it on stdin/stdout. Each rank
thread owns one ``kvplan_nixl.Endpoint`` (an Endpoint is used from one thread only) and
publishes its metadata in etcd; decode ranks fetch the prefill ranks' metadata from etcd,
connect, and pull each request with a notification; prefill ranks free a request's blocks
once every decode rank that reads from them has notified.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import threading
import types

import numpy as np

from examples.connector.etcd import Etcd
from kvplan import EngineSpec, pull_map, simulate
from kvplan.examples import gqa_with_mla_draft

NS, BLOCKS = "/kvplan/example", 128  # etcd key prefix; KV-cache blocks per engine


def model(tp: int) -> EngineSpec:
    """The example's KV cache: 2 GQA layers (8 KV heads of 128) + an MLA draft layer; kv 'joint'
    so that one block of a region is one contiguous slice of its buffer."""
    return gqa_with_mla_draft(tp, layers=2, num_blocks=BLOCKS, kv="joint")


def fill(req: int, spec: EngineSpec, rank: int, region: int, n: int) -> np.ndarray:
    """What prefill "computes": the bytes of ``n`` blocks of one request, one rank, one region,
    as an (n, block bytes) array with no zero byte; the same on every rank of a replicated
    region (MLA), since replicas hold the same data."""
    who = 0 if spec.regions[region].is_replicated else rank + 1
    x = np.arange(n * spec.rank_block_nbytes(region), dtype=np.uint32) * np.uint32(2654435761)
    x += np.uint32((((req * 1009 + who) * 1013 + region) * 40503 + 1) & 0xFFFFFFFF)
    # a Weyl sequence per (request, rank, region); its top byte, made odd, is never 0
    return (x >> np.uint32(24) | np.uint32(1)).astype(np.uint8).reshape(n, -1)


class Rank(threading.Thread):
    """One rank: its Endpoint and buffers; commands in ``inbox``, results to ``events``."""

    def __init__(self, a, spec: EngineSpec, rank: int, etcd: Etcd, events: queue.Queue) -> None:
        super().__init__(daemon=True)
        self.role, self.spec, self.rank, self.etcd, self.other = a.role, spec, rank, etcd, a.peers
        self.events, self.inbox, self.inflight = events, queue.Queue(), {}
        self.bufs = [np.zeros(spec.rank_region_nbytes(i), np.uint8) for i in spec.regions_on(rank)]
        self.blocks = [b.reshape(spec.regions[i].num_blocks, -1) for i, b in enumerate(self.bufs)]
        self.src: dict = {}  # decode: the prefill ranks' buffers, as far as recomputed
        self.want = {(rank, i): np.zeros_like(b) for i, b in enumerate(self.bufs)}

    def run(self) -> None:
        from kvplan_nixl import Endpoint  # imported by main() already, before the threads

        with Endpoint(self.role, self.spec, self.rank, self.bufs) as ep:
            self.etcd.put(f"{NS}/{self.role}/rank/{self.rank}", ep.metadata())
            if self.role == "decode":  # pull: connect one prefill rank, then the map's peers
                mds = self.etcd.wait(f"{NS}/prefill/rank/", self.other)
                ep.connect(mds[f"{NS}/prefill/rank/0"])
                for r in ep.map("prefill").peers:
                    ep.connect(mds[f"{NS}/prefill/rank/{r}"])
            self.events.put(("ready", self.rank))
            while True:
                try:  # block briefly only when idle: a target must be progressed regularly
                    cmd = self.inbox.get_nowait() if self.inflight else self.inbox.get(True, 1e-3)
                except queue.Empty:
                    cmd = None
                if cmd == "quit":
                    break
                if cmd:  # decode: plan with the handshake's map, post one read per request
                    req, src, dst = cmd
                    for blk in self.blocks:
                        blk[dst] = 0  # so that a byte the read misses shows up as 0
                    plan = ep.map("prefill").plan([src], [dst])
                    self.inflight[req] = ep.read(plan, "prefill", notify=b"%d" % req, timeout=30)
                for n in ep.notifications():  # progresses the agent; prefill learns the frees
                    self.events.put(("notified", int(n.message), self.rank, n.rank))
                for req, t in list(self.inflight.items()):
                    if t.poll() and t.done:
                        del self.inflight[req]
                        self.events.put(("loaded", req, self.rank, *self.verify(req, t),
                                         t.plan.nbytes, (t.seconds or 0.0) * 1e3))

    def verify(self, req: int, t) -> tuple[bool, str, str]:
        """(ok, sha256 of the request's blocks, error): no byte was missed, and the bytes equal
        what kvplan.simulate moves from the prefill ranks' ``fill``, recomputed here."""
        if not t.ok:
            return False, "", str(t.error())
        plan, pspec = t.plan, t.plan.map.src
        src_ids, dst_ids = plan.src_blocks[0], plan.dst_blocks[0]
        for r, i in {(int(a), int(b)) for a, b in plan.copies()[["src_rank", "src_region"]]}:
            if (r, i) not in self.src:
                self.src[(r, i)] = np.zeros(pspec.rank_region_nbytes(i), np.uint8)
            blocks = self.src[(r, i)].reshape(pspec.regions[i].num_blocks, -1)
            blocks[src_ids] = fill(req, pspec, r, i, len(src_ids))
        simulate(plan, self.src, self.want)  # (a byte it does not write fails got.all())
        sha, err = hashlib.sha256(), ""
        for i, blk in enumerate(self.blocks):
            got, want = blk[dst_ids], self.want[(self.rank, i)].reshape(blk.shape)[dst_ids]
            sha.update(got.tobytes())
            if not got.all() or not np.array_equal(got, want):
                err = err or f"region {self.spec.regions[i].name}: bytes differ"
        return not err, sha.hexdigest(), err


def main() -> int:
    """``python -m examples.connector.engine '{"role": "prefill", "etcd": URL, "tp": 4,
    "peers": 2}'``; JSON lines on stdin and stdout (see __main__.py)."""
    a = types.SimpleNamespace(**json.loads(sys.argv[1]))
    threading.excepthook = _crash
    import kvplan_nixl.endpoint  # noqa: F401  (loads NIXL once, before the rank threads)

    etcd, spec, events = Etcd(a.etcd), model(a.tp), queue.Queue()
    etcd.put(f"{NS}/{a.role}/spec", json.dumps(spec.to_dict()).encode())
    ranks = [Rank(a, spec, r, etcd, events) for r in range(a.tp)]
    for r in ranks:
        r.start()
    # prefill: the (prefill rank, decode rank) pairs notifying per request (each decode rank
    # notifies the ranks its plan reads; every plan of this one-group model reads all of the
    # map's peers, otherwise take the peers of each request's plans)
    expect: set = set()
    if a.role == "prefill":
        dspec = EngineSpec.from_dict(json.loads(etcd.wait(f"{NS}/decode/spec", 1).popitem()[1]))
        expect = {(p, d) for d in range(dspec.num_ranks) for p in pull_map(spec, dspec, d).peers}
    [events.get() for _ in ranks]  # each "ready": registered, published, (decode) connected
    say(op="ready", role=a.role)
    threading.Thread(target=_stdin, args=(events,), daemon=True).start()
    # the toy scheduler: a free list of block ids shared by the ranks, requests waiting FIFO
    free = np.random.default_rng(len(a.role)).permutation(BLOCKS).tolist()
    fifo, live = [], {}  # waiting requests; live: request id -> its blocks, its ranks' reports
    while True:
        kind, *ev = events.get()
        st = live.get(ev[0]) if kind != "in" else None
        if kind == "in" and ev[0]["op"] == "quit":
            break
        if kind == "in" and ev[0]["op"] == "free":  # the proxy gave up on this request
            free += live.pop(ev[0]["id"], {}).get("ids", [])
        elif kind == "in":
            fifo.append(ev[0])
        elif st and kind == "notified":
            st["acks"][(ev[1], ev[2])] = True
            if expect <= st["acks"].keys():  # every decode rank read it: free its blocks
                free += live.pop(ev[0])["ids"]
                say(op="freed", id=ev[0])
        elif st and kind == "loaded":
            st["acks"][ev[1]] = ev[2:]  # ok, sha256, error, bytes, ms
            if len(st["acks"]) == a.tp:  # every rank has the request: "decode" it, free
                free += live.pop(ev[0])["ids"]
                res = [st["acks"][r] for r in range(a.tp)]
                say(op="done", id=ev[0], ok=all(x[0] for x in res), src=st["src"], dst=st["ids"],
                    sha256=[x[1] for x in res], errors=[x[2] for x in res if x[2]],
                    bytes=sum(x[3] for x in res), ms=max(x[4] for x in res))
        while fifo and (n := -(-fifo[0]["tokens"] // spec.regions[0].block_size)) <= len(free):
            m = fifo.pop(0)  # admit: allocate its blocks
            ids, free = free[:n], free[n:]
            live[m["id"]] = {**m, "ids": ids, "acks": {}}
            if a.role == "prefill":  # the "forward pass" writes its KV into every rank's blocks
                for r in ranks:
                    for i, blk in enumerate(r.blocks):
                        blk[ids] = fill(m["id"], spec, r.rank, i, n)
                say(op="prefilled", id=m["id"], blocks=ids)
            else:
                for r in ranks:
                    r.inbox.put((m["id"], m["src"], ids))
    for r in ranks:
        r.inbox.put("quit")
        r.join(30)
    say(op="bye", role=a.role, free=len(free), blocks=BLOCKS)
    return 0


def _crash(args) -> None:
    threading.__excepthook__(args)
    os._exit(1)  # a rank failed: end the engine, the proxy sees it exit and says so


def say(**msg) -> None:
    """One JSON line to the proxy."""
    print(json.dumps(msg), flush=True)


def _stdin(events: queue.Queue) -> None:
    for line in sys.stdin:
        events.put(("in", json.loads(line)))
    events.put(("in", {"op": "quit"}))  # the proxy went away


if __name__ == "__main__":
    sys.exit(main())
