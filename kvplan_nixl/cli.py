"""The ``kvplan`` command: ``plan`` prints a plan (pure), ``demo`` moves it for real over NIXL.

``kvplan demo`` builds a prefill and a decode engine from a built-in example (default: a GQA
model with an MLA draft, prefill TP4 -> decode TP2, as in vLLM PR 44583), one Endpoint per rank
in this process over CPU tensors, fills prefill with known bytes, plans one request, transfers
it over NIXL (pull, or push with ``--push``), and checks every destination byte against
``kvplan.simulate`` applied to copies of the same buffers. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

import kvplan
from kvplan import EngineSpec, TransferPlan
from kvplan.examples import EXAMPLES


def _spec(args: argparse.Namespace, tp: int, block_size: int | None) -> EngineSpec:
    kwargs: dict = {"num_blocks": args.num_blocks}
    if block_size is not None:
        kwargs["block_size"] = block_size
    for opt in ("layout", "kv"):
        if getattr(args, opt) is not None:
            kwargs[opt] = getattr(args, opt)
    try:
        return EXAMPLES[args.example](tp, **kwargs)
    except TypeError as exc:
        raise SystemExit(
            f"kvplan: example {args.example!r} does not take that option: {exc}"
        ) from None


def _request(args, src: EngineSpec, dst: EngineSpec) -> tuple[list, list]:
    """Distinct random block ids per group on each side, covering ``--tokens`` positions."""
    rng = np.random.default_rng(args.seed)
    out = []
    for spec in (src, dst):
        lists = []
        for g in range(spec.num_groups):
            regions = [r for r in spec.regions if r.group == g]
            bs = max(r.block_size for r in regions)
            limit = min(r.num_blocks for r in regions)
            need = -(-args.tokens // bs)
            if need > limit:
                raise SystemExit(
                    f"kvplan: {args.tokens} tokens need {need} blocks of {bs}, but group {g} has "
                    f"{limit}; raise --num-blocks or lower --tokens"
                )
            lists.append(rng.permutation(limit)[:need].tolist())
        out.append(lists)
    return out[0], out[1]


def _plans(args, src: EngineSpec, dst: EngineSpec) -> list[TransferPlan]:
    src_blocks, dst_blocks = _request(args, src, dst)
    if args.push:
        maps = [kvplan.push_map(src, dst, r) for r in range(src.tp_size)]
    else:
        maps = [kvplan.pull_map(src, dst, r) for r in range(dst.tp_size)]
    return [m.plan(src_blocks, dst_blocks) for m in maps]


def _engines(args) -> tuple[EngineSpec, EngineSpec]:
    return (
        _spec(args, args.prefill_tp, args.prefill_block_size),
        _spec(args, args.decode_tp, args.decode_block_size),
    )


def cmd_plan(args) -> int:
    src, dst = _engines(args)
    for plan in _plans(args, src, dst):
        print(plan.summary())
    return 0


def _buffers(spec: EngineSpec, rank: int, fill: int | None, rng) -> list:
    """One CPU tensor per region (numpy when torch is absent), with known contents."""
    torch = None
    try:
        import torch
    except ImportError:
        pass
    out = []
    for i in range(len(spec.regions)):
        n = spec.rank_region_nbytes(i)
        data = (
            rng.integers(0, 256, n, dtype=np.uint8) if fill is None else np.full(n, fill, np.uint8)
        )
        out.append(torch.from_numpy(data) if torch is not None else data)
    return out


def _as_numpy(buf) -> np.ndarray:
    return buf if isinstance(buf, np.ndarray) else buf.numpy()


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def cmd_demo(args) -> int:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO lines to stdout otherwise
    import logging

    logging.getLogger("nixl").setLevel(logging.WARNING)
    from kvplan_nixl import Endpoint

    src, dst = _engines(args)
    plans = _plans(args, src, dst)  # refuses incompatible engines before any agent exists
    rng = np.random.default_rng(args.seed)
    p_bufs = [_buffers(src, r, None, rng) for r in range(src.tp_size)]
    d_bufs = [_buffers(dst, r, 0xEE, rng) for r in range(dst.tp_size)]
    ref = {(r, i): _as_numpy(b).copy() for r, bs in enumerate(d_bufs) for i, b in enumerate(bs)}
    srcs = {(r, i): _as_numpy(b) for r, bs in enumerate(p_bufs) for i, b in enumerate(bs)}
    for plan in plans:
        kvplan.simulate(plan, srcs, ref)

    mode = "push" if args.push else "pull"
    print(f"kvplan demo: {args.example}, prefill TP{src.tp_size} -> decode TP{dst.tp_size}, "
          f"{mode}, {args.tokens} tokens")
    t0 = time.perf_counter()
    prefill = [Endpoint("prefill", src, r, b) for r, b in enumerate(p_bufs)]
    decode = [Endpoint("decode", dst, r, b) for r, b in enumerate(d_bufs)]
    try:
        initiators, targets = (prefill, decode) if args.push else (decode, prefill)
        remote = "decode" if args.push else "prefill"
        t1 = time.perf_counter()
        metas = [t.metadata() for t in targets]
        for ep in initiators:
            for m in metas:
                ep.connect(m, mode=mode)
        t2 = time.perf_counter()
        print(f"{len(prefill) + len(decode)} endpoints in {t1 - t0:.2f} s, "
              f"{len(initiators) * len(metas)} connects in {(t2 - t1) * 1e3:.1f} ms\n")
        for plan in plans:
            print(plan.summary())
        print()
        # warm-up: the first transfer of each pair also sets up its UCX connection
        for ep, plan in zip(initiators, plans, strict=True):
            post = ep.write if args.push else ep.read
            post(plan, remote).wait(30, progress=targets)
        for bs in d_bufs:
            for b in bs:
                _as_numpy(b)[:] = 0xEE
        t3 = time.perf_counter()
        posted = []
        for ep, plan in zip(initiators, plans, strict=True):
            post = ep.write if args.push else ep.read
            posted.append(post(plan, remote, notify=b"demo"))
        for t in posted:
            t.wait(30, progress=targets)
        secs = time.perf_counter() - t3
        side = "p" if args.push else "d"
        other = "d" if args.push else "p"
        print(f"{'rank':<6}{'peer':<6}{'bytes':>14}{'descriptors':>13}")
        for ep, t in zip(initiators, posted, strict=True):
            for peer, n in t.bytes_per_peer().items():
                print(f"{side}{ep.rank:<5}{other}{peer:<5}{n:>14}{t.runs()[peer]:>13}")
        total = sum(t.nbytes for t in posted)
        print(f"\nmoved {_mib(total)} in {secs * 1e3:.2f} ms: {total / secs / 1e9:.2f} GB/s "
              f"({sum(sum(t.runs().values()) for t in posted)} NIXL descriptors)")
        notes = sum(len(ep.notifications()) for ep in targets)
        print(f"notifications received by the {'decode' if args.push else 'prefill'} side: {notes}")
    finally:
        for ep in prefill + decode:
            ep.close()
    bad = [k for k, b in ref.items() if not np.array_equal(_as_numpy(d_bufs[k[0]][k[1]]), b)]
    checked = sum(b.size for b in ref.values())
    if bad:
        r, i = bad[0]
        got = _as_numpy(d_bufs[r][i])
        off = int(np.flatnonzero(got != ref[(r, i)])[0])
        print(f"MISMATCH: decode rank {r} region {dst.regions[i].name!r} byte {off}: got "
              f"{got[off]}, expected {ref[(r, i)][off]} ({len(bad)} regions differ)")
        return 1
    print(f"verified: all {checked} destination bytes match kvplan.simulate")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvplan", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, fn, text in (
        ("demo", cmd_demo, "plan one request and move it for real over NIXL, then verify it"),
        ("plan", cmd_plan, "print the plans for one request of a built-in example (no NIXL)"),
    ):
        s = sub.add_parser(name, help=text, description=text)
        s.set_defaults(fn=fn)
        s.add_argument("--example", choices=sorted(EXAMPLES), default="gqa-mla-draft")
        s.add_argument("--prefill-tp", type=int, default=4)
        s.add_argument("--decode-tp", type=int, default=2)
        s.add_argument("--push", action="store_true", help="prefill writes instead of decode reads")
        s.add_argument("--tokens", type=int, default=2048, help="request length (default 2048)")
        s.add_argument("--num-blocks", type=int, default=256, help="blocks per region")
        s.add_argument("--prefill-block-size", type=int, default=None)
        s.add_argument("--decode-block-size", type=int, default=None)
        s.add_argument("--layout", choices=["HND", "NHD"], default=None)
        s.add_argument("--kv", choices=["split", "joint"], default=None)
        s.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.fn(args)
    except kvplan.KVPlanError as exc:
        print(f"kvplan: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
