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
``--example`` also takes any preset name (``kvplan presets``): the real model's cache.

Errors: :func:`main` prints one ``kvplan: ...`` line and returns the exit status (EPILOG);
options are typed with bounds (:mod:`kvplan_nixl.cliargs`), so a user's value is used or
refused, never replaced by a default.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

import kvplan
from kvplan import EngineSpec, TransferPlan, presets
from kvplan.examples import EXAMPLES, request_blocks
from kvplan.views import human_bytes
from kvplan_nixl.cliargs import (
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_TOKENS,
    MAX_TP,
    HelpFormatter,
    Parser,
    UsageError,
    columns,
    int_in,
    legend,
    wrap,
)
from kvplan_nixl.explain import layout_arg as explain_layout
from kvplan_nixl.progress import step

#: ``kvplan demo`` refuses to allocate more CPU memory than this for its buffers (prefill,
#: decode, and a reference copy of decode).
DEMO_MAX_BYTES = 4 << 30


def _preset_spec(args: argparse.Namespace, tp: int, pp: int, block_size: int | None) -> EngineSpec:
    """A packaged model preset (``--example llama-3.1-70b``): the real model's cache."""
    if args.num_slots is not None:
        raise UsageError(f"--num-slots applies to the small examples, not to the preset "
                         f"{args.example!r} (its state regions have --num-blocks slots)")
    kwargs: dict = {"num_blocks": args.num_blocks, "pp_size": pp}
    for opt, value in (("block_size", block_size), ("layout", args.layout), ("kv", args.kv)):
        if value is not None:
            kwargs[opt] = value
    return presets.spec(args.example, tp, **kwargs)


def _spec(args: argparse.Namespace, tp: int, pp: int, block_size: int | None,
          side: str | None = None) -> EngineSpec:
    """The engine of ``--example`` on one side, re-laid out by ``--{side}-layout`` if given."""
    spec = _base_spec(args, tp, pp, block_size)
    own = getattr(args, f"{side}_layout", None) if side else None
    return spec if own is None else spec.with_layout(own, args.kv or "split")


def _base_spec(args: argparse.Namespace, tp: int, pp: int, block_size: int | None) -> EngineSpec:
    if args.example not in EXAMPLES:
        return _preset_spec(args, tp, pp, block_size)
    kwargs: dict = {"num_blocks": args.num_blocks}
    if block_size is not None:
        kwargs["block_size"] = block_size
    for opt in ("layout", "kv", "num_slots"):
        if getattr(args, opt) is not None:
            kwargs[opt] = getattr(args, opt)
    try:
        spec = EXAMPLES[args.example](tp, **kwargs)
    except TypeError as exc:
        raise UsageError(f"example {args.example!r} does not take that option: {exc}") from None
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
        raise UsageError(f"{exc}; raise --num-blocks or lower --tokens / --slots") from None


def _plans(args, src: EngineSpec, dst: EngineSpec) -> list[TransferPlan]:
    src_blocks, dst_blocks = _request(args, src, dst)
    if args.push:
        maps = [kvplan.push_map(src, dst, r) for r in range(src.num_ranks)]
    else:
        maps = [kvplan.pull_map(src, dst, r) for r in range(dst.num_ranks)]
    return [m.plan(src_blocks, dst_blocks) for m in maps]


def _engines(args) -> tuple[EngineSpec, EngineSpec]:
    return (
        _spec(args, args.prefill_tp, args.prefill_pp, args.prefill_block_size, "prefill"),
        _spec(args, args.decode_tp, args.decode_pp, args.decode_block_size, "decode"),
    )


def _fitted(text: str) -> str:
    """``text`` with each line wrapped to the terminal between words, continuation lines
    indented under their line (a summary's long state placements)."""
    width = columns()
    return "\n".join(wrap(line, width, "", " " * (len(line) - len(line.lstrip()) + 4))
                     if len(line) > width else line for line in text.splitlines())


def cmd_plan(args) -> int:
    src, dst = _engines(args)
    with step("planning"):
        plans = _plans(args, src, dst)
    for plan in plans:
        print(_fitted(plan.summary()))
    print(f"\n{legend(columns())}")
    return 0


#: The demo fills its buffers this many bytes at a time, reporting each step: one numpy call
#: over GiBs holds the GIL for seconds, and the spinner (a thread) would freeze meanwhile.
FILL_CHUNK = 64 << 20


def _buffers(spec: EngineSpec, rank: int, fill: int | None, rng,
             done=lambda nbytes: None) -> dict[int, object]:
    """One CPU tensor (numpy when torch is absent) per buffer ``rank`` holds (a region, a pool
    or an allocation shared by its regions, a K or V buffer), keyed by its index in
    ``spec.buffers``, with known bytes, filled :data:`FILL_CHUNK` bytes at a time (``done(n)``
    after each)."""
    torch = None
    try:
        import torch
    except ImportError:
        pass
    out = {}
    for a in sorted({spec.buffer_of(i, s) for i in spec.regions_on(rank) for s in (0, 1)}):
        n = spec.rank_buffer_nbytes(a)
        data = np.empty(n, np.uint8)
        for at in range(0, n, FILL_CHUNK):
            end = min(n, at + FILL_CHUNK)
            data[at:end] = rng.integers(0, 256, end - at, dtype=np.uint8) if fill is None else fill
            done(end - at)
        out[a] = torch.from_numpy(data) if torch is not None else data
    return out


def _views(spec: EngineSpec, allocs: list[dict[int, object]]) -> dict[tuple[int, int], object]:
    """``{(rank, buffer name): buffer}`` over every buffer each rank holds: what
    kvplan.simulate takes."""
    return {(r, spec.buffers[b]): buf for r, a in enumerate(allocs) for b, buf in a.items()}


def _as_numpy(buf) -> np.ndarray:
    return buf if isinstance(buf, np.ndarray) else buf.numpy()


def _alloc_nbytes(spec: EngineSpec) -> int:
    """Bytes of every rank's buffers (a pool or an allocation counted once per rank)."""
    return sum(spec.rank_buffer_nbytes(b) for r in range(spec.num_ranks)
               for b in {spec.buffer_of(i, s) for i in spec.regions_on(r) for s in (0, 1)})


def _import_endpoint():
    """``kvplan_nixl.Endpoint``, or a one-line usage error naming the install command."""
    try:
        with step("importing NIXL and torch"):  # seconds each; the buffers are torch tensors
            from kvplan_nixl.endpoint import Endpoint
            try:
                import torch  # noqa: F401
            except ImportError:  # numpy buffers then
                pass
    except ImportError as exc:
        what = ("which is not installed" if exc.name in ("nixl", "nixl_cu12", "nixl_cu13")
                and "installed but" not in str(exc) else f"which does not import ({exc})")
        raise UsageError(
            f"kvplan demo moves bytes over NIXL, {what}: pip install -e \".[nixl]\" in a "
            "checkout of kvplan (README.md: install torch first)"
        ) from None
    return Endpoint


def cmd_demo(args) -> int:
    src, dst = _engines(args)
    with step("planning"):
        plans = _plans(args, src, dst)  # refuses incompatible engines before any agent exists
    need = _alloc_nbytes(src) + 2 * _alloc_nbytes(dst)
    if need > DEMO_MAX_BYTES:
        raise UsageError(
            f"the demo would allocate {human_bytes(need)} of CPU buffers (prefill, decode and a "
            f"reference copy of decode; limit {human_bytes(DEMO_MAX_BYTES)}): lower --num-blocks "
            "or the TP sizes"
        )
    Endpoint = _import_endpoint()
    rng = np.random.default_rng(args.seed)
    with step(f"filling {human_bytes(need)} of buffers and computing the expected bytes") as update:
        filled = [0]

        def done(nbytes: int) -> None:
            filled[0] += nbytes
            update(f"{human_bytes(filled[0])} filled")

        p_bufs = [_buffers(src, r, None, rng, done) for r in range(src.num_ranks)]
        d_bufs = [_buffers(dst, r, 0xEE, rng, done) for r in range(dst.num_ranks)]
        ref_allocs = [{a: _as_numpy(b).copy() for a, b in bs.items()} for bs in d_bufs]
        ref = _views(dst, ref_allocs)
        srcs = {k: _as_numpy(b) for k, b in _views(src, p_bufs).items()}
        for k, plan in enumerate(plans):
            update(f"expected bytes of plan {k + 1} of {len(plans)} (kvplan.simulate)")
            kvplan.simulate(plan, srcs, ref)

    mode = "push" if args.push else "pull"

    def shape(spec: EngineSpec) -> str:
        return f"TP{spec.tp_size}" + (f" PP{spec.pp_size}" if spec.pp_size > 1 else "")

    print(f"kvplan demo: {args.example}, prefill {shape(src)} -> decode {shape(dst)}, "
          f"{mode}, {args.tokens} tokens")
    t0 = time.perf_counter()
    # one buffer per buffer of the spec, by its name (a region's, pool's, allocation's...)
    prefill: list = []
    decode: list = []
    stagers: dict = {}
    try:
        with step(f"creating {src.num_ranks + dst.num_ranks} NIXL endpoints"):
            for r, bs in enumerate(p_bufs):
                prefill.append(Endpoint("prefill", src, r,
                                        {src.buffers[a]: b for a, b in bs.items()}))
            for r, bs in enumerate(d_bufs):
                decode.append(Endpoint("decode", dst, r,
                                       {dst.buffers[a]: b for a, b in bs.items()}))
        if not args.direct_only:  # staged mode needs its pools registered before metadata
            from kvplan_nixl import staged_cli

            stagers = staged_cli.attach(prefill + decode)
        initiators, targets = (prefill, decode) if args.push else (decode, prefill)
        remote = "decode" if args.push else "prefill"
        t1 = time.perf_counter()
        connects = 0
        with step("exchanging metadata and connecting"):
            metas = [t.metadata() for t in targets]
            for ep, plan in zip(initiators, plans, strict=True):
                for r in plan.map.peers:  # only the ranks this rank copies with (its stages')
                    ep.connect(metas[r], mode=mode)
                    connects += 1
        t2 = time.perf_counter()
        print(f"{len(prefill) + len(decode)} endpoints in {t1 - t0:.2f} s, "
              f"{connects} connects in {(t2 - t1) * 1e3:.1f} ms\n")
        for plan in plans:
            print(_fitted(plan.summary()))
        print()
        # warm-up: the first transfer of each pair also sets up its UCX connection
        with step("warm-up transfer (sets up the UCX connections)"):
            for ep, plan in zip(initiators, plans, strict=True):
                post = ep.write if args.push else ep.read
                post(plan, remote).wait(30, progress=targets)
            for bs in d_bufs:
                for b in bs.values():
                    _as_numpy(b)[:] = 0xEE
        with step("timed transfer"):
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
        print(f"{'rank':<6}{'peer':<6}{'bytes':>12}{'descriptors':>13}")
        for ep, t in zip(initiators, posted, strict=True):
            for peer, n in t.bytes_per_peer().items():
                print(f"{side}{ep.rank:<5}{other}{peer:<5}{human_bytes(n):>12}"
                      f"{t.runs()[peer]:>13}")
        total = sum(t.nbytes for t in posted)
        print(f"\nmoved {human_bytes(total)} in {secs * 1e3:.2f} ms: {total / secs / 1e9:.2f} "
              f"GB/s ({sum(sum(t.runs().values()) for t in posted)} NIXL descriptors, one per run)")
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
    with step("verifying every decode byte"):
        bad = [
            (r, a) for r, allocs in enumerate(ref_allocs) for a, want in allocs.items()
            if not np.array_equal(_as_numpy(d_bufs[r][a]), want)
        ]
    checked = sum(b.size for allocs in ref_allocs for b in allocs.values())
    if bad:
        r, a = bad[0]
        got, want = _as_numpy(d_bufs[r][a]), ref_allocs[r][a]
        off = int(np.flatnonzero(got != want)[0])
        where = f"buffer {dst.buffers[a]!r}"
        print(f"MISMATCH: decode rank {r} {where} byte {off}: got {got[off]}, expected "
              f"{want[off]} ({len(bad)} allocations differ)")
        return 1
    print(f"verified: all {human_bytes(checked)} ({checked} bytes) of the decode ranks' "
          f"buffers match kvplan.simulate: the {human_bytes(total)} moved landed where the plan "
          "says, and every other byte is untouched")
    print(f"\n{legend(columns())}")
    return 0


DESCRIPTION = """\
kvplan: plan KV-cache transfers between prefill and decode engines, and move them over NIXL.
Only demo needs NIXL (the nixl extra); the other commands are pure: no NIXL, no GPU, nothing
downloaded."""

EPILOG = """\
Run 'kvplan COMMAND --help' for a command's options and their defaults.
Exit status: 0 done; 1 refused (the engines cannot talk) or a demo byte mismatch;
2 bad input (one 'kvplan: ...' line on stderr); 3 internal error (a bug)."""

#: Choices of ``--example``: the small built-in examples, then every packaged preset.
EXAMPLE_CHOICES = (*sorted(EXAMPLES), *presets.names())


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvplan")
    except Exception:  # not installed (a plain checkout on PYTHONPATH)
        return kvplan.__version__


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvplan", description=DESCRIPTION, epilog=EPILOG,
               formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"kvplan {_version()}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", title="commands")
    tp, pp = int_in(1, MAX_TP), int_in(1, MAX_TP)
    for name, fn, text in (
        ("demo", cmd_demo, "plan one request and move it for real over NIXL, then verify it"),
        ("plan", cmd_plan, "print the plans of one request of an example or preset (no NIXL)"),
    ):
        s = sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)
        s.set_defaults(fn=fn)
        s.add_argument("--example", choices=EXAMPLE_CHOICES, default="gqa-mla-draft",
                       metavar="NAME", help="a small built-in example (" + ", ".join(
                           sorted(EXAMPLES)) + ") or a model preset (kvplan presets)")
        s.add_argument("--prefill-tp", type=tp, default=4, help="tensor-parallel ranks of prefill")
        s.add_argument("--decode-tp", type=tp, default=2, help="tensor-parallel ranks of decode")
        s.add_argument("--prefill-pp", type=pp, default=1, help="pipeline stages of prefill")
        s.add_argument("--decode-pp", type=pp, default=1, help="pipeline stages of decode")
        s.add_argument("--push", action="store_true", help="prefill writes instead of decode reads")
        s.add_argument("--tokens", type=int_in(1, MAX_TOKENS), default=2048,
                       help="request length in tokens")
        s.add_argument("--slots", type=int_in(1, MAX_BLOCKS), default=1,
                       help="state slots per state group of the request (hybrids)")
        s.add_argument("--num-blocks", type=int_in(1, MAX_BLOCKS), default=256,
                       help="blocks per region")
        s.add_argument("--num-slots", type=int_in(1, MAX_BLOCKS), default=None,
                       help="state slots per state region (nemotron-h; default: the example's)")
        s.add_argument("--prefill-block-size", type=int_in(1, MAX_BLOCK_SIZE), default=None,
                       help="tokens per block on prefill (default: the example's)")
        s.add_argument("--decode-block-size", type=int_in(1, MAX_BLOCK_SIZE), default=None,
                       help="tokens per block on decode (default: the example's)")
        s.add_argument("--layout", choices=["HND", "NHD"], default=None,
                       help="attention layout on both sides (default: the example's, HND)")
        s.add_argument("--prefill-layout", type=explain_layout, default=None,
                       help="prefill's layout: HND, NHD, vLLM's BLHNC... or an order of LBSHND "
                            "(default: --layout)")
        s.add_argument("--decode-layout", type=explain_layout, default=None,
                       help="decode's layout (as --prefill-layout)")
        s.add_argument("--kv", choices=["split", "joint"], default=None,
                       help="K and V in two tensors or one (default: the example's, split)")
        s.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0,
                       help="seed of the random block ids and buffer bytes")
        if name == "demo":
            s.add_argument("--direct-only", action="store_true",
                           help="skip the staged (bounce-buffer) run shown beside the direct one")
    from kvplan_nixl import explain  # explain, check, spec, presets (pure, no NIXL)

    explain.register(sub)
    return p


def _broken_pipe() -> int:
    """The reader of stdout went away (``kvplan plan | head``): stop quietly, as Unix tools do."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail too
    except (OSError, ValueError):
        pass
    return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the broken pipe


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvplan`` command; returns the exit status (see EPILOG). Never raises, and
    prints at most one ``kvplan: ...`` line on stderr on failure, never a traceback."""
    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if not argv:  # bare `kvplan`: the help, not "required: COMMAND"
            parser.print_help()
            return 0
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version, or a usage error already printed
            return exc.code if isinstance(exc.code, int) else 2
        if getattr(args, "fn", None) is None:
            parser.print_help()
            return 0
        rc = args.fn(args)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        return _broken_pipe()
    except KeyboardInterrupt:
        print("kvplan: interrupted", file=sys.stderr)
        return 130
    except UsageError as exc:
        print(f"kvplan: {exc}", file=sys.stderr)
        return 2
    except kvplan.KVPlanError as exc:
        print(f"kvplan: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug: still one line; KVPLAN_TRACEBACK=1 shows where
        if os.environ.get("KVPLAN_TRACEBACK"):
            raise
        print(f"kvplan: internal error: {type(exc).__name__}: {exc} (please report it; "
              "KVPLAN_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
