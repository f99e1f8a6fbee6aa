"""The ``kvplan`` command: ``plan`` prints a plan (pure), ``demo`` moves it for real over NIXL.

``kvplan demo`` builds a prefill and a decode engine from a built-in example (default: a GQA
model with an MLA draft, prefill TP4 -> decode TP2, as in vLLM PR 44583), one Endpoint per rank
in this process over CPU tensors, fills prefill with known bytes, plans one request, transfers
it over NIXL (pull, or push with ``--push``), and checks every destination byte against
``kvplan.simulate`` applied to copies of the same buffers. Exit status 1 on any mismatch.
Hybrid examples work the same way: ``--example kimi-linear`` (MLA and KDA state views of shared
pools), ``--example nemotron-h`` (Mamba2 state and attention), with ``--slots`` state slots per
request and ``--prefill-pp`` / ``--decode-pp`` pipeline stages (any example's regions cut into
contiguous stages); each initiator rank connects only the peer ranks its map names.
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
from kvplan.examples import EXAMPLES, request_blocks


def _spec(args: argparse.Namespace, tp: int, pp: int, block_size: int | None) -> EngineSpec:
    kwargs: dict = {"num_blocks": args.num_blocks}
    if block_size is not None:
        kwargs["block_size"] = block_size
    for opt in ("layout", "kv", "num_slots"):
        if getattr(args, opt) is not None:
            kwargs[opt] = getattr(args, opt)
    try:
        spec = EXAMPLES[args.example](tp, **kwargs)
    except TypeError as exc:
        raise SystemExit(
            f"kvplan: example {args.example!r} does not take that option: {exc}"
        ) from None
    if pp != 1:  # any example: its regions cut into pp contiguous stages
        spec = EngineSpec.from_dict({**spec.to_dict(), "pp_size": pp})
    return spec


def _request(args, src: EngineSpec, dst: EngineSpec) -> tuple[list, list]:
    """Random block ids on each side: ``--tokens`` positions per token group, ``--slots`` per
    state group, disjoint between the groups sharing a pool (kvplan.examples.request_blocks)."""
    rng = np.random.default_rng(args.seed)
    try:
        return tuple(request_blocks(s, args.tokens, slots=args.slots, seed=rng)
                     for s in (src, dst))
    except ValueError as exc:
        raise SystemExit(
            f"kvplan: {exc}; raise --num-blocks or lower --tokens / --slots"
        ) from None


def _plans(args, src: EngineSpec, dst: EngineSpec) -> list[TransferPlan]:
    src_blocks, dst_blocks = _request(args, src, dst)
    if args.push:
        maps = [kvplan.push_map(src, dst, r) for r in range(src.num_ranks)]
    else:
        maps = [kvplan.pull_map(src, dst, r) for r in range(dst.num_ranks)]
    return [m.plan(src_blocks, dst_blocks) for m in maps]


def _engines(args) -> tuple[EngineSpec, EngineSpec]:
    return (
        _spec(args, args.prefill_tp, args.prefill_pp, args.prefill_block_size),
        _spec(args, args.decode_tp, args.decode_pp, args.decode_block_size),
    )


def cmd_plan(args) -> int:
    src, dst = _engines(args)
    for plan in _plans(args, src, dst):
        print(plan.summary())
    return 0


def _buffers(spec: EngineSpec, rank: int, fill: int | None, rng) -> dict[int, object]:
    """One CPU tensor (numpy when torch is absent) per allocation ``rank`` holds (a region, or
    a pool shared by its regions), keyed by the allocation's first region, with known bytes."""
    torch = None
    try:
        import torch
    except ImportError:
        pass
    out = {}
    for a in sorted({spec.allocation_of(i) for i in spec.regions_on(rank)}):
        n = spec.rank_region_nbytes(a)
        data = (
            rng.integers(0, 256, n, dtype=np.uint8) if fill is None else np.full(n, fill, np.uint8)
        )
        out[a] = torch.from_numpy(data) if torch is not None else data
    return out


def _views(spec: EngineSpec, allocs: list[dict[int, object]]) -> dict[tuple[int, int], object]:
    """``{(rank, region): buffer}`` over every region each rank holds: what kvplan.simulate
    takes (the regions of one pool map to the pool's one buffer)."""
    return {
        (r, i): a[spec.allocation_of(i)] for r, a in enumerate(allocs) for i in spec.regions_on(r)
    }


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
    p_bufs = [_buffers(src, r, None, rng) for r in range(src.num_ranks)]
    d_bufs = [_buffers(dst, r, 0xEE, rng) for r in range(dst.num_ranks)]
    ref_allocs = [{a: _as_numpy(b).copy() for a, b in bs.items()} for bs in d_bufs]
    ref = _views(dst, ref_allocs)
    srcs = {k: _as_numpy(b) for k, b in _views(src, p_bufs).items()}
    for plan in plans:
        kvplan.simulate(plan, srcs, ref)

    mode = "push" if args.push else "pull"

    def shape(spec: EngineSpec) -> str:
        return f"TP{spec.tp_size}" + (f" PP{spec.pp_size}" if spec.pp_size > 1 else "")

    print(f"kvplan demo: {args.example}, prefill {shape(src)} -> decode {shape(dst)}, "
          f"{mode}, {args.tokens} tokens")
    t0 = time.perf_counter()
    # one buffer per allocation, by the name of its first region (a pool's: any of its names)
    prefill = [Endpoint("prefill", src, r, {src.regions[a].name: b for a, b in bs.items()})
               for r, bs in enumerate(p_bufs)]
    decode = [Endpoint("decode", dst, r, {dst.regions[a].name: b for a, b in bs.items()})
              for r, bs in enumerate(d_bufs)]
    stagers: dict = {}
    try:
        if not args.direct_only:  # staged mode needs its pools registered before metadata
            from kvplan_nixl import staged_cli

            stagers = staged_cli.attach(prefill + decode)
        initiators, targets = (prefill, decode) if args.push else (decode, prefill)
        remote = "decode" if args.push else "prefill"
        t1 = time.perf_counter()
        metas = [t.metadata() for t in targets]
        connects = 0
        for ep, plan in zip(initiators, plans, strict=True):
            for r in plan.map.peers:  # only the ranks this rank copies with (its stages')
                ep.connect(metas[r], mode=mode)
                connects += 1
        t2 = time.perf_counter()
        print(f"{len(prefill) + len(decode)} endpoints in {t1 - t0:.2f} s, "
              f"{connects} connects in {(t2 - t1) * 1e3:.1f} ms\n")
        for plan in plans:
            print(plan.summary())
        print()
        # warm-up: the first transfer of each pair also sets up its UCX connection
        for ep, plan in zip(initiators, plans, strict=True):
            post = ep.write if args.push else ep.read
            post(plan, remote).wait(30, progress=targets)
        for bs in d_bufs:
            for b in bs.values():
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
        if stagers:  # the same request staged, beside the direct numbers (kvplan_nixl.staged)
            def reset() -> None:
                for bs in d_bufs:
                    for b in bs.values():
                        _as_numpy(b)[:] = 0xEE

            pairs = [(_as_numpy(d_bufs[r][a]), want) for r, allocs in enumerate(ref_allocs)
                     for a, want in allocs.items()]
            if not staged_cli.run(stagers, initiators, targets, plans, remote, args.push, secs,
                                  pairs, reset):
                return 1
    finally:
        if stagers:
            staged_cli.close(stagers)
        for ep in prefill + decode:
            ep.close()
    bad = [
        (r, a) for r, allocs in enumerate(ref_allocs) for a, want in allocs.items()
        if not np.array_equal(_as_numpy(d_bufs[r][a]), want)
    ]
    checked = sum(b.size for allocs in ref_allocs for b in allocs.values())
    if bad:
        r, a = bad[0]
        got, want = _as_numpy(d_bufs[r][a]), ref_allocs[r][a]
        off = int(np.flatnonzero(got != want)[0])
        pool = dst.regions[a].pool
        where = f"pool {pool!r}" if pool is not None else f"region {dst.regions[a].name!r}"
        print(f"MISMATCH: decode rank {r} {where} byte {off}: got {got[off]}, expected "
              f"{want[off]} ({len(bad)} allocations differ)")
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
        s.add_argument("--prefill-pp", type=int, default=1, help="pipeline stages of prefill")
        s.add_argument("--decode-pp", type=int, default=1, help="pipeline stages of decode")
        s.add_argument("--push", action="store_true", help="prefill writes instead of decode reads")
        s.add_argument("--tokens", type=int, default=2048, help="request length (default 2048)")
        s.add_argument("--slots", type=int, default=1,
                       help="state slots per state group of the request (hybrids; default 1)")
        s.add_argument("--num-blocks", type=int, default=256, help="blocks per region")
        s.add_argument("--num-slots", type=int, default=None,
                       help="state slots per state region (nemotron-h)")
        s.add_argument("--prefill-block-size", type=int, default=None)
        s.add_argument("--decode-block-size", type=int, default=None)
        s.add_argument("--layout", choices=["HND", "NHD"], default=None)
        s.add_argument("--kv", choices=["split", "joint"], default=None)
        s.add_argument("--seed", type=int, default=0)
        if name == "demo":
            s.add_argument("--direct-only", action="store_true",
                           help="skip the staged (bounce-buffer) run shown beside the direct one")
    from kvplan_nixl import explain  # explain, check, spec, presets (pure, no NIXL)

    explain.register(sub)
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
