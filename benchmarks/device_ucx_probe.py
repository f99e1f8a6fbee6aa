"""Which UCX path NIXL takes between two buffers of one process, and at what rate.

One process, two NIXL agents (UCX backend), READs of one large descriptor and of many 4 KiB
descriptors, between CPU (DRAM) or CUDA (VRAM) torch buffers. It answers what the staged
benchmark on a GPU could not: whether a slow NIXL leg is the transport (e.g. a copy through
host memory instead of CUDA IPC) or the cost per descriptor. Set ``UCX_PROTO_INFO=y`` to have
UCX print the protocol it selected for each case.

    python benchmarks/device_ucx_probe.py --device cuda     # on a GPU machine
    python benchmarks/device_ucx_probe.py --device cpu --mib 64

Output: one Markdown row per case (bytes, descriptors, seconds, GB/s), checked byte for byte.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from kvplan_nixl._nixl import make_agent


def _wait(agent, handle, what: str) -> None:
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return
        if state == "ERR":
            raise RuntimeError(f"{what}: NIXL transfer failed")


def case(src_dev: str, dst_dev: str, nbytes: int, run: int, reps: int) -> str:
    a = make_agent(f"src-{src_dev}-{run}", ("UCX",), False, progress_thread=True)
    b = make_agent(f"dst-{dst_dev}-{run}", ("UCX",), False)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=src_dev)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=dst_dev)
    ra, rb = a.register_memory(src), b.register_memory(dst)
    b.add_remote_agent(a.get_agent_metadata())
    mem = {"cpu": "DRAM", "cuda": "VRAM"}
    n = nbytes // run
    # device id 0 for both kinds: DRAM ignores it, and the probe uses the one GPU
    remote = b.get_xfer_descs(
        [(src.data_ptr() + i * run, run, 0) for i in range(n)], mem[src_dev])
    local = b.get_xfer_descs(
        [(dst.data_ptr() + i * run, run, 0) for i in range(n)], mem[dst_dev])
    handle = b.initialize_xfer("READ", local, remote, a.name, b"")
    b.transfer(handle)  # warm-up (and UCX's protocol selection)
    _wait(b, handle, "warm-up")
    times = []
    for _ in range(reps):
        if dst_dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        b.transfer(handle)
        _wait(b, handle, "read")
        times.append(time.perf_counter() - t)
    ok = bool(torch.equal(src.cpu(), dst.cpu()))
    b.release_xfer_handle(handle)
    b.remove_remote_agent(a.name)
    a.deregister_memory(ra)
    b.deregister_memory(rb)
    del a, b  # agents end here, each in turn, not in an arbitrary order at interpreter exit
    best = min(times)
    return (f"| {mem[src_dev]} -> {mem[dst_dev]} | {nbytes >> 20} MiB | {n} x {run} B | "
            f"{best * 1e3:.2f} ms | {nbytes / best / 1e9:.2f} GB/s | {ok} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    nbytes = args.mib << 20
    pairs = [("cpu", "cpu")]
    if args.device == "cuda":
        pairs += [("cuda", "cuda"), ("cpu", "cuda"), ("cuda", "cpu")]
    print("| read | bytes | descriptors | best of reps | rate | verified |")
    print("|---|---|---|---|---|---|")
    for s, d in pairs:
        for run in (nbytes, 1 << 20, 4096):
            size = nbytes if run >= 1 << 20 else min(nbytes, 64 << 20)
            print(case(s, d, size, run, args.reps), flush=True)


if __name__ == "__main__":
    main()
