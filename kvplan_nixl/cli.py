"""``kvplan demo``: plan one request and move it for real over NIXL (the NIXL package's commands).

Layer: the executor's command line. :func:`register` is the entry point
(``[project.entry-points."kvplan.commands"] demo``, pyproject.toml) through which the core CLI
(:mod:`kvplan.cli.command`) adds the commands that move bytes; it imports neither nixl nor
torch, so registering costs nothing and ``kvplan explain`` stays fast. nixl is imported when
``demo`` runs (:func:`_import_endpoint`), with one ``kvplan: ...`` line naming the install
command where it is missing.

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

The whole command is ``kvplan`` (``python -m kvplan.cli``, :func:`kvplan.cli.main`); this module
has no ``main`` of its own, so that it never imports the command it plugs into (no circle).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import kvplan
from kvplan import EngineSpec
from kvplan.cli.cliargs import HelpFormatter, UsageError, fitted, print_legend, recorded
from kvplan.cli.engines import engine_options, engines
from kvplan.cli.engines import plans as make_plans
from kvplan.cli.progress import step
from kvplan.cp import parallel_label
from kvplan.views import human_bytes

__all__ = ["register"]

#: ``kvplan demo`` refuses to allocate more CPU memory than this for its buffers (prefill,
#: decode, and a reference copy of decode).
DEMO_MAX_BYTES = 4 << 30


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``demo`` to the ``kvplan`` command: the ``kvplan.commands`` entry point ``demo``,
    loaded by :func:`kvplan.cli.command._plugins`."""
    text = "plan one request and move it for real over NIXL, then verify it"
    s = sub.add_parser("demo", help=text, description=text, formatter_class=HelpFormatter)
    s.set_defaults(fn=cmd_demo)
    engine_options(s)
    s.add_argument("--direct-only", action="store_true",
                   help="skip the staged (bounce-buffer) run shown beside the direct one")


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
    except ImportError:  # numpy buffers: nixl-cu12 wants torch, but a user may have NIXL alone
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
    """``kvplan demo``: :func:`_demo`, then the legend of the notation its output used."""
    with recorded() as shown:
        code = _demo(args)
    if code == 0:
        print_legend(shown.text)
    return code


def _demo(args) -> int:
    src, dst = engines(args)
    with step("planning"):
        plans = make_plans(args, src, dst)  # refuses incompatible engines before any agent exists
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

    shape = parallel_label
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
            print(fitted(plan.summary()))
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
    return 0
