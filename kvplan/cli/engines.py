"""Which engines and which request: the options ``kvplan plan`` and ``kvplan demo`` share.

Layer: the CLI (top of the core). :func:`engine_options` adds the options to a sub-command;
:func:`engines` builds the prefill and decode :class:`~kvplan.EngineSpec` from a built-in
example (:mod:`kvplan.examples`) or a packaged preset, and :func:`plans` plans one random
request on every initiating rank. The NIXL package's ``demo`` imports this module (never
:mod:`kvplan.cli.command`, which loads ``demo``'s entry point: that would close a circle).
"""

from __future__ import annotations

import argparse

import numpy as np

import kvplan
from kvplan import EngineSpec, TransferPlan, presets
from kvplan.cli.cliargs import MAX_BLOCK_SIZE, MAX_BLOCKS, MAX_TOKENS, MAX_TP, UsageError, int_in
from kvplan.cli.models import context_options, context_sizes
from kvplan.cli.models import layout_arg as explain_layout
from kvplan.examples import EXAMPLES, request_blocks

#: Choices of ``--example``: the small built-in examples, then every packaged preset.
EXAMPLE_CHOICES = (*sorted(EXAMPLES), *presets.names())



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
    """The engine of ``--example`` on one side, with ``--{side}-dcp-size``... if given,
    re-laid out by ``--{side}-layout`` if given."""
    spec = _base_spec(args, tp, pp, block_size)
    context = context_sizes(args, side) if side else {}
    if context:
        spec = EngineSpec.from_dict({**spec.to_dict(), **context})
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


def plans(args, src: EngineSpec, dst: EngineSpec) -> list[TransferPlan]:
    """One plan per initiating rank (each destination rank's pull, or each source's push)."""
    src_blocks, dst_blocks = _request(args, src, dst)
    if args.push:
        maps = [kvplan.push_map(src, dst, r) for r in range(src.num_ranks)]
    else:
        maps = [kvplan.pull_map(src, dst, r) for r in range(dst.num_ranks)]
    return [m.plan(src_blocks, dst_blocks) for m in maps]


def engines(args) -> tuple[EngineSpec, EngineSpec]:
    """The prefill and decode engines :func:`engine_options` describe."""
    return (
        _spec(args, args.prefill_tp, args.prefill_pp, args.prefill_block_size, "prefill"),
        _spec(args, args.decode_tp, args.decode_pp, args.decode_block_size, "decode"),
    )


def engine_options(s: argparse.ArgumentParser) -> None:
    """The options of ``plan`` (and of the NIXL package's ``demo``): which engines, which
    request; :func:`engines` and :func:`plans` read them."""
    tp, pp = int_in(1, MAX_TP), int_in(1, MAX_TP)
    s.add_argument("--example", choices=EXAMPLE_CHOICES, default="gqa-mla-draft",
                   metavar="NAME", help="a small built-in example (" + ", ".join(
                       sorted(EXAMPLES)) + ") or a model preset (kvplan presets)")
    s.add_argument("--prefill-tp", type=tp, default=4, help="tensor-parallel ranks of prefill")
    s.add_argument("--decode-tp", type=tp, default=2, help="tensor-parallel ranks of decode")
    s.add_argument("--prefill-pp", type=pp, default=1, help="pipeline stages of prefill")
    s.add_argument("--decode-pp", type=pp, default=1, help="pipeline stages of decode")
    context_options(s, "prefill")
    context_options(s, "decode")
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
                   help="attention layout of prefill and decode (default: the example's, HND)")
    s.add_argument("--prefill-layout", type=explain_layout, default=None,
                   help="prefill's layout: HND, NHD, vLLM's BLHNC... or an order of LBSHND "
                        "(default: --layout)")
    s.add_argument("--decode-layout", type=explain_layout, default=None,
                   help="decode's layout (as --prefill-layout)")
    s.add_argument("--kv", choices=["split", "joint"], default=None,
                   help="K and V in two tensors or one (default: the example's, split)")
    s.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0,
                   help="seed of the random block ids and buffer bytes")
