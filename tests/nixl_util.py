"""Shared helpers of the NIXL executor tests: engines of real endpoints and an exact check.

Sources are filled by the independent oracle (``tests/oracle.py``: every byte a hash of its
logical coordinates), destinations with a sentinel; after a transfer each destination rank must
equal ``oracle.expected_destination`` byte for byte, untouched bytes included.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import numpy as np

from kvplan import EngineSpec, pull_map, push_map, simulate
from kvplan.examples import request_blocks
from kvplan_nixl import Endpoint
from kvplan_nixl import metadata as md
from tests import oracle

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZERO = {"xfer": 0, "dlist": 0, "remote_agents": 0, "registrations": 0, "transfers": 0}


#: The setting the transfer digest's connector scripts share (tests/test_digest.py: push,
#: tests/test_pull_digest.py: pull), run in the vLLM venv: one KV-cache group of blocks of 16,
#: prefill TP 2 -> decode TP 1 of two attention layers, a request's block lists, and a
#: ``digester(spec, rank, buffers)`` over a pair's buffers.
DIGEST_SCRIPT_SETUP = r"""
from kvplan.adapters.vllm import TransferGroups
from kvplan_nixl import Digester
from tests.nixl_util import attn, pair, spec

groups = TransferGroups(index=(0,), kinds=("full",), block_sizes=(16,), windows=(None,),
                        scratch=(0,))
src = spec(2, attn("layers.0.attn", nb=24), attn("layers.1.attn", nb=24))
dst = spec(1, attn("layers.0.attn", nb=40), attn("layers.1.attn", nb=40))
ids, mine, end = [3, 17, 5, 9, 1, 11], [31, 2, 8, 20, 14, 39], 96  # whole blocks

def digester(sp, r, bufs):
    return Digester(sp, r, {sp.regions[i].name: bufs[(r, i)] for i in sp.regions_on(r)})
"""

def spec(tp: int, *regions: dict) -> EngineSpec:
    return EngineSpec.from_dict({"tp_size": tp, "regions": list(regions)})


def peer_info(app: dict[str, str], engine: str = "prefill") -> md.PeerInfo:
    """Rank 0 of a TP 1 engine's metadata advertising ``app``, without NIXL: its agent
    section is the agent's name alone, all :func:`kvplan_nixl.metadata.decode` reads of it."""
    sp = spec(1, attn(heads=2, nb=4))
    name = md.agent_name(engine, 0, "n1")
    agent = b"nixlSerDes|Agent" + len(name).to_bytes(8, "little") + name.encode() + b"|rest"
    return md.PeerInfo(engine=engine, rank=0, agent=name, spec=sp, mem_type="DRAM",
                       bases=(1 << 32,), nbytes=(sp.rank_region_nbytes(0),), devices=(0,),
                       agent_metadata=agent, app=md.check_app(app))


def attn(name="layers.0.attn", *, heads=4, dim=64, nb=32, bs=16, layout="HND", kv="split",
         group=0, window=None, dtype="bfloat16") -> dict:
    return {"name": name, "kind": "attention", "group": group, "num_blocks": nb,
            "block_size": bs, "dtype": dtype, "num_kv_heads": heads, "head_dim": dim,
            "layout": layout, "kv": kv, "window": window}


def mla(name="draft.0.mla", *, dim=576, nb=32, bs=16, group=0, kind="mla",
        dtype="bfloat16") -> dict:
    return {"name": name, "kind": kind, "group": group, "num_blocks": nb, "block_size": bs,
            "dtype": dtype, "dim": dim}


def shared_copy(bufs: dict) -> dict:
    """A copy of ``{(rank, region): array}`` in which the regions of one pool still share one
    array (a plain dict copy would split a pool into independent copies)."""
    copies: dict[int, np.ndarray] = {}
    return {k: copies.setdefault(id(v), v.copy()) for k, v in bufs.items()}


class Pair:
    """A source and a destination engine, one real Endpoint per (flat) rank, in this process.

    Each endpoint gets its buffers as a mapping by region name over the regions its rank holds;
    the regions of a pool map to the same array (the oracle's buffers share it). ``src_blocks``
    fills pooled sources page by page with the view of the group that lists the page (see
    ``oracle.source_buffers``); pass the request's source blocks for engines with pools.
    """

    def __init__(self, src: EngineSpec, dst: EngineSpec, *, telemetry: bool = False,
                 src_blocks=None, **endpoint_kw) -> None:
        self.src, self.dst = src, dst
        self.src_bufs = oracle.source_buffers(src.to_dict(), seed=3, request_blocks=src_blocks)
        self.dst_bufs = oracle.destination_buffers(dst.to_dict(), seed=4)
        self.before = shared_copy(self.dst_bufs)
        self.p: list[Endpoint] = []
        self.d: list[Endpoint] = []
        try:
            for eps, engine, sp, bufs in ((self.p, "prefill", src, self.src_bufs),
                                          (self.d, "decode", dst, self.dst_bufs)):
                for r in range(sp.num_ranks):
                    mine = {sp.regions[i].name: self._buffer(bufs[(r, i)])
                            for i in sp.regions_on(r)}
                    eps.append(Endpoint(engine, sp, r, mine, telemetry=telemetry,
                                        **endpoint_kw))
        except BaseException:
            self.close()
            raise

    def _buffer(self, arr: np.ndarray):
        """What the endpoint gets for host array ``arr`` (the array itself; subclasses may
        hand out another kind of buffer holding the same bytes)."""
        return arr

    @property
    def endpoints(self) -> list[Endpoint]:
        return self.p + self.d

    def connect(self, mode: str) -> None:
        initiators, targets = (self.d, self.p) if mode == "pull" else (self.p, self.d)
        metas = [t.metadata() for t in targets]
        for ep in initiators:
            for m in metas:
                ep.connect(m, mode=mode)

    def plans(self, mode: str, src_blocks, dst_blocks):
        if mode == "pull":
            maps = [pull_map(self.src, self.dst, r) for r in range(self.dst.num_ranks)]
        else:
            maps = [push_map(self.src, self.dst, r) for r in range(self.src.num_ranks)]
        return [m.plan(src_blocks, dst_blocks) for m in maps]

    def run(self, mode: str, src_blocks, dst_blocks, *, notify=None, timeout=30.0):
        """Plan on every initiator rank, post all, wait all; returns the transfers."""
        initiators, targets = (self.d, self.p) if mode == "pull" else (self.p, self.d)
        remote = "prefill" if mode == "pull" else "decode"
        posted = []
        for ep in initiators:
            plan = ep.map(remote, mode).plan(src_blocks, dst_blocks)
            post = ep.read if mode == "pull" else ep.write
            posted.append(post(plan, remote, notify=notify))
        for t in posted:
            t.wait(timeout, progress=targets)
        return posted

    def check(self, src_blocks, dst_blocks, plans=()) -> int:
        """Every destination byte equals the oracle's expectation; returns bytes checked.

        With ``plans``, first checks that NIXL moved exactly what ``kvplan.simulate`` moves for
        them (the executor's own contract), then the oracle (the whole stack's).
        """
        if plans:
            ref = shared_copy(self.before)
            for plan in plans:
                simulate(plan, self.src_bufs, ref)
            for k, want in ref.items():
                if not np.array_equal(self.dst_bufs[k], want):
                    bad = np.flatnonzero(self.dst_bufs[k] != want)
                    raise AssertionError(
                        f"executor differs from kvplan.simulate on decode rank {k[0]} region "
                        f"{k[1]}: {bad.size} bytes, first at {int(bad[0])}"
                    )
        checked = 0
        sd, dd = self.src.to_dict(), self.dst.to_dict()
        for r in range(self.dst.num_ranks):
            expected, _ = oracle.expected_destination(
                sd, dd, src_blocks, dst_blocks, r, self.src_bufs, self.before
            )
            for j, exp in expected.items():
                got = self.dst_bufs[(r, j)]
                if not np.array_equal(got, exp):
                    bad = np.flatnonzero(got != exp)
                    raise AssertionError(
                        f"decode rank {r} region {self.dst.regions[j].name}: {bad.size} bytes "
                        f"differ, first at {int(bad[0])}"
                    )
                checked += exp.size  # a pool counted once per view
        return checked

    def close(self) -> None:
        for ep in self.p + self.d:
            ep.close()


@contextlib.contextmanager
def pair(src: EngineSpec, dst: EngineSpec, *, cls: type[Pair] = Pair, **kw) -> Iterator[Pair]:
    """A ``cls`` (``Pair`` or a subclass) of connected-later endpoints, closed on exit, with
    every endpoint's NIXL handles checked back to zero."""
    pr = cls(src, dst, **kw)
    try:
        yield pr
    finally:
        pr.close()
    for ep in pr.endpoints:
        assert ep.handles() == ZERO, ep.handles()


def notifications(endpoints, expected: int, timeout: float = 10.0) -> list[tuple]:
    """``(receiver rank, Notification)`` pairs, progressing until ``expected`` have arrived.

    A notification travels separately from the data, so it may land a moment after the
    initiator saw its transfer done.
    """
    got: list[tuple] = []
    deadline = time.monotonic() + timeout
    while True:
        got += [(ep.rank, n) for ep in endpoints for n in ep.notifications()]
        if len(got) >= expected or time.monotonic() > deadline:
            return got
        time.sleep(1e-3)


def blocks(rng: np.random.Generator, spec: EngineSpec, n: int | Sequence[int]) -> list[list[int]]:
    """Distinct random block ids, ``n`` (or ``n[g]``) per group."""
    out = []
    for g in range(spec.num_groups):
        k = n if isinstance(n, int) else n[g]
        limit = min(r.num_blocks for r in spec.regions if r.group == g)
        out.append(rng.permutation(limit)[:k].tolist())
    return out


def hybrid_blocks(rng: np.random.Generator, spec: EngineSpec, tokens: int,
                  slots: int) -> list[list[int]]:
    """One request's block ids on one side (see kvplan.examples.request_blocks)."""
    return request_blocks(spec, tokens, slots=slots, seed=rng)


def peer_cmd(*args: str) -> list[str]:
    return [sys.executable, os.path.join(REPO, "tests", "nixl_peer.py"), *args]


def peer_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    return env


class PeerProc:
    """One engine rank in its own OS process (``tests/nixl_peer.py``), driven by lines.

    It writes its metadata to ``md_path`` and says ``ready``; ``extra`` are more arguments of
    ``nixl_peer.py`` (``--stager POOL,SLOT``, ``--connect PATH MODE``, ...). ``finish`` asks it
    to quit and returns its report (notifications, buffer digests, stager handles); ``kill``
    ends it at once, stalled or not.
    """

    def __init__(self, tmp, engine: str, s: EngineSpec, rank: int, *, seed: int,
                 fill: str = "oracle", extra: Sequence[str] = ()) -> None:
        self.rank = rank
        self.md_path = str(tmp / f"{engine}-{rank}-{time.monotonic_ns()}.md")
        self.proc = subprocess.Popen(
            peer_cmd("--engine", engine, "--rank", str(rank), "--spec", json.dumps(s.to_dict()),
                     "--seed", str(seed), "--fill", fill, "--metadata-out", self.md_path,
                     *extra),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=peer_env(), text=True,
        )

    def line(self, timeout: float = 60.0) -> str:
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert r, f"peer rank {self.rank} silent for {timeout} s"
        return self.proc.stdout.readline().strip()

    def ready(self, timeout: float = 60.0) -> bytes:
        """Wait for ``ready``; the peer's metadata."""
        line = self.line(timeout)
        assert line == "ready", line
        with open(self.md_path, "rb") as f:
            return f.read()

    def finish(self) -> dict:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        out = json.loads(self.line(30))
        assert self.proc.wait(30) == 0
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(30)
