"""Soak across two hosts: 10,000 pulls between network namespaces, UCX over TCP on a veth.

    sudo python benchmarks/soak_two_hosts.py                  # 10,000 requests, a few minutes
    sudo python benchmarks/soak_two_hosts.py --requests 1000  # shorter

Prefill (TP 4, two processes of two ranks) runs on host A, decode (TP 2, one process) on host
B: two network namespaces made for the run and deleted after it (``tests/netns.py``; needs root
and iproute2). Decode keeps ``--inflight`` requests in flight; each request pulls 1 to
``--max-blocks`` random source blocks of every layer into destination blocks that no other
request in flight uses; each of them is read from the prefill ranks of the decode rank's heads.
Every ``--sample``-th request is compared, run by run, with the source bytes as soon as it
completes (before its destination blocks are reused). Resident memory of every process and the
NIXL handle counts are sampled along the way and must stay flat. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvplan import EngineSpec
from tests import netns

#: Growth of resident memory tolerated from the first sample to the last (allocator noise).
RSS_SLACK = 16 << 20


def _spec(tp: int, layers: int, heads: int, dim: int, nb: int, layout: str) -> EngineSpec:
    return EngineSpec.from_dict({"tp_size": tp, "regions": [
        {"name": f"layers.{i}.attn", "kind": "attention", "num_blocks": nb, "block_size": 16,
         "dtype": "bfloat16", "num_kv_heads": heads, "head_dim": dim, "layout": layout}
        for i in range(layers)]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--max-blocks", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--poll", type=float, default=1e-3,
                    help="seconds a prefill process sleeps between progress calls when idle")
    ap.add_argument("--dst-layout", default="HND", choices=["HND", "NHD"],
                    help="decode's KV layout (prefill's is HND)")
    ap.add_argument("--sample", type=int, default=10, help="check every n-th request at once")
    args = ap.parse_args()
    why = netns.unavailable()
    if why is not None:
        print(f"soak_two_hosts: cannot make network namespaces: {why}", file=sys.stderr)
        return 2
    nb = 2 * args.inflight * args.max_blocks
    src = _spec(4, args.layers, args.heads, args.head_dim, nb, "HND")
    dst = _spec(2, args.layers, args.heads, args.head_dim, nb, args.dst_layout)
    block = src.rank_region_nbytes(0) // nb * 4 * args.layers  # one block of every layer, TP 4
    with netns.TwoHosts() as hosts:
        t0 = time.perf_counter()
        p = [netns.HostProc(hosts, "a", "prefill", src, [2 * i, 2 * i + 1], fill="oracle",
                            seed=9, poll=args.poll, wait=False) for i in range(2)]
        prof = {"NETNS_HOST_PROFILE": os.environ["NETNS_HOST_PROFILE"]} if os.environ.get(
            "NETNS_HOST_PROFILE") else {}
        d = netns.HostProc(hosts, "b", "decode", dst, [0, 1], fill="zeros", peer_spec=src,
                           peer_seed=9, wait=False, env=prof)
        for proc in [*p, d]:
            proc.ready(300)
        d.call("connect", metas=[m for x in p for m in x.metadata.values()])
        started = time.perf_counter() - t0
        p0 = [x.call("handles") for x in p]
        p_rss0 = [h["rss"] for h in p0]
        d_cpu0 = d.call("handles")["cpu"]
        out = d.call("soak", requests=args.requests, inflight=args.inflight,
                     max_blocks=args.max_blocks, seed=1, sample=args.sample, deadline=60.0,
                     timeout=3600)
        p_end = [x.call("handles") for x in p]
        d_cpu = d.call("handles")["cpu"] - d_cpu0
        p_cpu = sum(e["cpu"] - h["cpu"] for e, h in zip(p_end, p0, strict=True))
        for x in [*p, d]:
            x.quit()
    rate = out["requests"] / out["seconds"]
    gbps = out["bytes"] / out["seconds"] / 1e9
    lasting = [{r: {k: h[k] for k in ("dlist", "remote_agents", "registrations")}
                for r, h in sample.items()} for sample in out["handles"]]
    d_growth = out["rss"][-1] - out["rss"][0]
    p_growth = max(e["rss"] - r0 for e, r0 in zip(p_end, p_rss0, strict=True))
    flat = all(h == lasting[0] for h in lasting)
    ok = out["sample_bytes_checked"] > 0 and flat and max(d_growth, p_growth) < RSS_SLACK
    print(f"two hosts (veth, UCX_TLS=tcp): prefill TP 4 (2 processes) -> decode TP 2, "
          f"{args.layers} layers x {args.heads} KV heads x {args.head_dim}, bf16, block 16, "
          f"HND -> {args.dst_layout} "
          f"({block / 2**10:.0f} KiB per block, all layers), prefill polls every "
          f"{args.poll * 1e3:g} ms; start and connect {started:.1f} s\n")
    print("| requests | in flight | blocks/request | seconds | requests/s | GB/s | checked "
          "(requests, bytes) | handles flat | RSS growth (decode / prefill) |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {out['requests']} | {args.inflight} | 1-{args.max_blocks} | "
          f"{out['seconds']:.1f} | {rate:.0f} | {gbps:.3f} | "
          f"{out['sampled']}, {out['sample_bytes_checked'] / 2**20:.0f} MiB | {flat} | "
          f"{d_growth / 2**20:+.1f} / {p_growth / 2**20:+.1f} MiB |")
    print(f"\nCPU seconds during the soak: decode {d_cpu:.1f}, prefill {p_cpu:.1f} "
          f"(wall {out['seconds']:.1f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
