"""One engine, prefill or decode, in its own process: one Endpoint per rank and a toy scheduler.

Started by ``python -m examples.connector`` (the proxy), which it talks to over a pipe. Every
rank registers its buffers and publishes its metadata in etcd; decode ranks fetch the prefill
ranks' metadata, connect, and pull each request with a notification; prefill frees a request's
blocks once every decode rank that reads them has notified. One loop, the engine's only
thread, drives all its Endpoints (an Endpoint is called from one thread only).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from multiprocessing.connection import Connection

import numpy as np

from examples.connector.etcd import Etcd
from kvplan import EngineSpec, pull_map, simulate
from kvplan.examples import gqa_with_mla_draft
from kvplan_nixl import Endpoint, Transfer

NS, BLOCKS = "/kvplan/example", 128  # etcd key prefix; KV-cache blocks per engine


def model(tp: int) -> EngineSpec:
    """The example's KV cache: 2 GQA layers (8 KV heads of 128) + an MLA draft layer; kv 'joint'
    so that one block of a region is one contiguous slice of its buffer."""
    return gqa_with_mla_draft(tp, layers=2, num_blocks=BLOCKS, kv="joint")


def fill(req: int, spec: EngineSpec, rank: int, region: int, n: int) -> np.ndarray:
    """What prefill "computes": ``n`` blocks of one request, rank and region, as an (n, block
    bytes) array with no zero byte; the same on every rank of a replicated region (MLA), since
    replicas hold the same data."""
    who = 0 if spec.regions[region].is_replicated else rank + 1
    rng = np.random.default_rng((req, who, region))
    return rng.integers(1, 256, (n, spec.rank_block_nbytes(region)), np.uint8)


def kv_cache(spec: EngineSpec) -> dict[tuple[int, int], np.ndarray]:
    """Every rank's KV cache, one zeroed (blocks, block bytes) array per (rank, region)."""
    return {(r, i): np.zeros((spec.regions[i].num_blocks, spec.rank_block_nbytes(i)), np.uint8)
            for r in range(spec.num_ranks) for i in spec.regions_on(r)}


def run(role: str, etcd_url: str, tp: int, peer_tp: int, proxy: Connection) -> None:
    """The engine: register, publish, (decode) connect, then serve the proxy's requests."""
    spec, etcd = model(tp), Etcd(etcd_url)
    kv, expect, src, want = kv_cache(spec), set(), {}, {}
    with contextlib.ExitStack() as stack:  # start-up [register_kv_caches]: one Endpoint per rank
        eps = [stack.enter_context(Endpoint(role, spec, r, [kv[r, i] for i in spec.regions_on(r)]))
               for r in range(tp)]
        etcd.put(f"{NS}/{role}/spec", json.dumps(spec.to_dict()).encode())
        for ep in eps:
            etcd.put(f"{NS}/{role}/rank/{ep.rank}", ep.metadata())
        if role == "decode":  # handshake: one prefill rank (it makes the map), the map's peers
            mds = etcd.wait(f"{NS}/prefill/rank/", peer_tp)
            for ep in eps:
                ep.connect(mds[f"{NS}/prefill/rank/0"])
                for r in ep.map("prefill").peers:
                    ep.connect(mds[f"{NS}/prefill/rank/{r}"])
            src, want = kv_cache(eps[0].map("prefill").src), kv_cache(spec)  # for verify()
        else:  # the (prefill rank, decode rank) pairs that notify each request
            dspec = EngineSpec.from_dict(json.loads(etcd.wait(f"{NS}/decode/spec", 1).popitem()[1]))
            expect = {(p, d) for d in range(dspec.num_ranks)
                      for p in pull_map(spec, dspec, d).peers}
        proxy.send({"op": "ready"})
        # the toy scheduler: a free list of block ids shared by the ranks, requests wait FIFO
        free = np.random.default_rng(len(role)).permutation(BLOCKS).tolist()  # P, D: 2 orders
        fifo, live = [], {}  # live: request id -> the request, its blocks, reads or acks
        while True:  # block briefly only when idle: a target must be progressed regularly
            if proxy.poll(0 if role == "decode" and live else 1e-3):
                m = proxy.recv()
                if m["op"] == "quit":
                    break
                if m["op"] == "free":  # the proxy gave up on this request
                    free += live.pop(m["id"], {}).get("ids", [])
                else:
                    fifo.append(m)
            while fifo and (n := -(-fifo[0]["tokens"] // spec.regions[0].block_size)) <= len(free):
                m, ids, free = fifo.pop(0), free[:n], free[n:]  # admit: allocate its blocks
                live[m["id"]] = st = {**m, "ids": ids, "acks": set(), "reads": []}
                if role == "prefill":  # the "forward pass" writes its KV into every rank
                    for (r, i), blocks in kv.items():
                        blocks[ids] = fill(m["id"], spec, r, i, n)
                    proxy.send({"op": "prefilled", "id": m["id"], "blocks": ids})
                    continue
                for blocks in kv.values():
                    blocks[ids] = 0  # so that a byte a read misses shows up as 0
                for ep in eps:  # [start_load_kv]: plan with the handshake's map, read, notify
                    plan = ep.map("prefill").plan([m["src"]], [ids])
                    st["reads"].append(ep.read(plan, "prefill", notify=b"%d" % m["id"], timeout=30))
            for ep in eps:  # prefill [get_finished]: a notification per decode rank and read
                for note in ep.notifications():  # (also progresses the agent)
                    if (st := live.get(int(note.message))) is not None:
                        st["acks"].add((ep.rank, note.rank))
                        if expect <= st["acks"]:  # every decode rank read it: free its blocks
                            free += live.pop(st["id"])["ids"]
                            proxy.send({"op": "freed", "id": st["id"]})
            for st in [st for st in live.values() if st["reads"]]:  # decode [get_finished]
                for t in st["reads"]:
                    t.poll()  # never raises for a failed read
                if all(t.done for t in st["reads"]):  # "decode" the request: free its blocks
                    free += live.pop(st["id"])["ids"]
                    proxy.send({"op": "done", "id": st["id"], "src": st["src"], "dst": st["ids"],
                                **verify(st["id"], st["reads"], kv, src, want)})
    proxy.send({"op": "bye", "role": role, "free": len(free), "blocks": BLOCKS})  # all closed


def verify(req: int, reads: list[Transfer], kv: dict, src: dict, want: dict) -> dict:
    """The decode ranks' reads of one request: ok if every byte of its blocks was written and
    equals what kvplan.simulate moves from the prefill bytes (``fill``, recomputed here); the
    sha256 of each rank's blocks, the bytes read, the slowest read's time."""
    plan = reads[0].plan
    for (p, i), blocks in src.items():
        blocks[plan.src_blocks[0]] = fill(req, plan.map.src, p, i, len(plan.src_blocks[0]))
    errors, digests, ids = [str(t.error()) for t in reads if not t.ok], [], plan.dst_blocks[0]
    flat_src, flat_want = ({k: b.reshape(-1) for k, b in x.items()} for x in (src, want))
    for t in reads:
        simulate(t.plan, flat_src, flat_want)
        sha = hashlib.sha256()
        for (d, i), blocks in kv.items():
            if d == t.plan.map.rank:
                sha.update(blocks[ids].tobytes())
                if not blocks[ids].all() or not np.array_equal(blocks[ids], want[d, i][ids]):
                    errors.append(f"rank {d} region {plan.map.dst.regions[i].name}: bytes differ")
        digests.append(sha.hexdigest())
    return {"ok": not errors, "sha256": digests, "errors": errors,
            "bytes": sum(t.nbytes for t in reads), "ms": max(t.seconds or 0 for t in reads) * 1e3}
