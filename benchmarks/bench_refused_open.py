"""What a staged OPEN that the server refuses costs the server (issue 45, item 9).

    python benchmarks/bench_refused_open.py              # about half a minute on 2 cores

A prefill rank (P TP2 rank 0, a Stager) and a connected decode (D TP1), in this process. The
decode's pull OPEN lists ``--blocks`` block ids a side (8 bytes each: 64 KiB at 4096) and
claims one byte fewer than the plan of those ids moves (a wrong size, within what the listed
blocks hold, so that no cheaper check refuses it). The server's CPU time (``process_time``) to
handle it, the median of ``--repeat``, is printed beside the time to plan the same ids for a
genuine request (``TransferMap.plan``) and to plan and stage them (what the server did before
it refused such an OPEN). The OPEN is put in the server's inbox as the envelope hands it on
(sealed or not does not change the server's work).
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

from kvplan import EngineSpec, Mode
from kvplan.staging import stage
from kvplan_nixl import Endpoint
from kvplan_nixl.staged import Stager
from kvplan_nixl.staged import protocol as proto

SLOT = 1 << 20


def spec(tp: int, layers: int, blocks: int, layout: str) -> EngineSpec:
    return EngineSpec.from_dict({"tp_size": tp, "regions": [
        {"name": f"layers.{i}.attn", "kind": "attention", "group": 0, "num_blocks": blocks,
         "block_size": 16, "dtype": "bfloat16", "num_kv_heads": 4, "head_dim": 64,
         "layout": layout, "kv": "split"} for i in range(layers)]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=4096, help="block ids a side (default 4096)")
    ap.add_argument("--layers", type=int, default=4, help="attention layers (default 4)")
    ap.add_argument("--repeat", type=int, default=3, help="OPENs measured (default 3)")
    a = ap.parse_args()
    n = a.blocks
    src, dst = spec(2, a.layers, n, "NHD"), spec(1, a.layers, n, "HND")  # pieces per head
    # untouched zeros: the pages are never read here
    bufs = {r: {x.name: np.zeros(src.rank_region_nbytes(i), np.uint8)
                for i, x in enumerate(src.regions)} for r in range(2)}
    dbuf = {x.name: np.zeros(dst.rank_region_nbytes(i), np.uint8)
            for i, x in enumerate(dst.regions)}
    rng = np.random.default_rng(0)
    sb, db = [rng.permutation(n).tolist()], [rng.permutation(n).tolist()]
    with Endpoint("prefill", src, 0, bufs[0]) as p, Endpoint("decode", dst, 0, dbuf) as d, \
            Stager(p, pool_bytes=4 * SLOT, slot_bytes=SLOT) as st:
        d.connect(p.metadata(), mode="pull")
        p.connect(d.metadata(), mode="push")
        pull, push = d.map("prefill"), p.map("decode", Mode.PUSH)
        rows = pull.plan(sb, db).copies()
        nbytes = int(rows["length"][rows["src_rank"] == 0].sum())  # what rank 0 serves
        claim = nbytes - 1
        msgs = proto.open_messages("7", Mode.PULL, SLOT, 0, {0: claim},
                                   [np.asarray(sb[0])], [np.asarray(db[0])], b"")
        body = msgs[0]
        refused, plans, staged = [], [], []
        for k in range(a.repeat):
            t0 = time.process_time()
            st.channel.inbox.append((d.agent_name, body.replace(b"OPEN 7", f"OPEN 7{k}".encode())))
            st.poll()
            refused.append(time.process_time() - t0)
            t0 = time.process_time()
            plan = push.plan(sb, db)
            plans.append(time.process_time() - t0)
            runs = len(plan)
            stage(plan, SLOT)
            staged.append(time.process_time() - t0)
        assert st.handles()["serving"] == 0, st.handles()
        print(f"OPEN of {n} + {n} block ids ({len(body) >> 10} KiB), {a.layers} layers, "
              f"claiming {claim} of {nbytes} bytes; CPU seconds, median of {a.repeat}:")
        print(f"  refused OPEN           {statistics.median(refused):.4f}")
        print(f"  plan (genuine request) {statistics.median(plans):.4f}  ({runs} runs)")
        print(f"  plan + stage           {statistics.median(staged):.4f}")


if __name__ == "__main__":
    main()
