"""Buffers of two memory kinds (DRAM and VRAM) on one rank (issue 19), and ``spread_pcp``.

On a CPU machine NIXL cannot register VRAM, so here: the grouping of runs into one NIXL
transfer per (local kind, remote kind) is checked as pure numpy against the descriptors'
addresses; each buffer's kind travels through the metadata and a forged kind is refused; a
buffer whose device disagrees with its declared kind is refused naming it; declared all-DRAM
endpoints still move exact bytes (pull and push, heterogeneous TP). Where CUDA is present, a
rank with DRAM and VRAM buffers moves exact bytes (pull, push, layer-wise parts) and the
staged path refuses it; elsewhere those cases skip with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplan_nixl import BufferSizeError, Endpoint, MetadataError, NotConnectedError
from kvplan_nixl import metadata as md
from kvplan_nixl.descriptors import Ladder, kind_shifts, lower, split_kinds
from tests.nixl_util import attn, blocks, mla, notifications, pair, spec
from tests.test_nixl_cp import CASES
from tests.test_nixl_metadata import SPEC, _info
from tests.test_nixl_tensors import DST, SRC, TensorPair
from tests.test_nixl_trust import _rewrite

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="no CUDA device on this machine (torch sees none)")


# -- the grouping, pure --------------------------------------------------------------------

def _table(ladder: Ladder, bases, kinds, kind=None) -> np.ndarray:
    """The address of every descriptor of the list NIXL expands from ``ladder``'s rows (only
    the rows of entries of ``kind`` when given): what an index addresses."""
    rows = ladder.rows(bases)
    entry = np.nonzero(ladder.count > 0)[0]
    if kind is not None:
        rows = rows[np.asarray(kinds)[entry] == kind]
    return np.concatenate([a + np.arange(c) * s for a, _, _, s, c in rows])


@pytest.mark.parametrize("seed", range(6))
def test_split_kinds_addresses_the_same_bytes_per_kind_pair(seed):
    rng = np.random.default_rng(seed)
    unit, n = 256, 5
    nbytes = [unit * int(x) for x in rng.integers(4, 40, n)]
    lk = rng.integers(0, 2, n)
    rk = rng.integers(0, 2, n)
    lk[0], lk[1], rk[0], rk[1] = 0, 1, 1, 0  # both kinds on both sides
    local = Ladder.build([f"l{i}" for i in range(n)], nbytes, [unit] * n)
    remote = Ladder.build([f"r{i}" for i in range(n)], nbytes, [unit] * n)
    lbase = [(i + 1) << 24 for i in range(n)]
    rbase = [(i + 1) << 32 for i in range(n)]
    runs = 60
    reg = rng.integers(0, n, runs)
    size = np.array(nbytes)[reg] // unit
    ln = rng.integers(1, 5, runs)
    ln = np.minimum(ln, size)
    lo = rng.integers(0, size - ln + 1) * unit
    ro = rng.integers(0, size - ln + 1) * unit
    ln = ln * unit
    lw = lower(local, remote, reg, lo, reg, ro, ln)
    ls, rs = kind_shifts(local, lk), kind_shifts(remote, rk)
    groups = split_kinds(lw, ln, lk[reg], rk[reg], ls[reg], rs[reg])
    pairs = [(a, b) for a, b, _ in groups]
    assert pairs == sorted(set(zip(lk[reg].tolist(), rk[reg].tolist(), strict=True)))
    assert sum(g.runs for _, _, g in groups) == runs
    assert sum(g.nbytes for _, _, g in groups) == int(ln.sum())
    # every descriptor of a group addresses, in its kinds' lists, what its global index does
    gl, gr = _table(local, lbase, lk), _table(remote, rbase, rk)
    want = sorted(zip(gl[lw.local].tolist(), gr[lw.remote].tolist(), strict=True))
    got = []
    for a, b, g in groups:
        tl, tr = _table(local, lbase, lk, a), _table(remote, rbase, rk, b)
        assert g.local.max() < len(tl) and g.remote.max() < len(tr)
        got += zip(tl[g.local].tolist(), tr[g.remote].tolist(), strict=True)
        assert len(g.local) == int(g.pieces.sum())
    assert sorted(got) == want


def test_split_kinds_one_kind_is_the_lowering_itself():
    lad = Ladder.build(["a", "b"], [4096, 4096], [256, 256])
    lw = lower(lad, lad, np.array([0, 1]), np.array([0, 256]), np.array([1, 0]),
               np.array([512, 0]), np.array([256, 1024]))
    zero = np.zeros(2, dtype=np.int64)
    assert split_kinds(lw, np.array([256, 1024]), zero + 1, zero, zero, zero) == [(1, 0, lw)]
    assert not kind_shifts(lad, [1, 1]).any()
    assert kind_shifts(lad, [1, 0]).tolist() == [0, lad.count[0].sum()]


# -- metadata ------------------------------------------------------------------------------

def _mixed_info() -> md.PeerInfo:
    held = {SPEC.buffer_of(i) for i in SPEC.regions_on(3)}
    first = min(held)
    memory = tuple("" if b not in held else ("VRAM" if b == first else "DRAM")
                   for b in range(len(SPEC.buffers)))
    return _info(mem_type="VRAM", memory=memory)


def test_metadata_carries_each_buffers_kind():
    info = _mixed_info()
    got = md.decode(md.encode(info))
    assert got == info
    kinds = {got.buffer_mem(SPEC.buffer_of(i)) for i in SPEC.regions_on(3)}
    assert kinds == {"DRAM", "VRAM"}
    assert md.decode(md.encode(_info())).memory == ()  # one kind: nothing more on the wire


@pytest.mark.parametrize(("edit", "msg"), [
    (lambda h: h.update(memory=[[1, "FILE"]]), r"listed as 'FILE'"),
    (lambda h: h.update(memory=[[1, "DRAM"]]), r"other than mem_type 'DRAM'"),
    (lambda h: h.update(memory=[[1, "VRAM"], [1, "VRAM"]]), "listed twice"),
    (lambda h: h.update(memory=[[99, "VRAM"]]), "buffer 99, which that rank does not hold"),
    (lambda h: h.update(memory=[["1", "VRAM"]]), r"\[buffer index, memory type\] pairs"),
    (lambda h: h.update(memory={"1": "VRAM"}), r"\[buffer index, memory type\] pairs"),
])
def test_forged_memory_rows_are_refused(edit, msg):
    blob = md.encode(_info())
    with pytest.raises(MetadataError, match=msg):
        md.decode(_rewrite(blob, edit))


# -- declared kinds on real endpoints ------------------------------------------------------

S1 = spec(1, attn(heads=4, nb=8), mla(nb=8))


def _bufs(device: str = "cpu"):
    return {r.name: torch.zeros(S1.rank_buffer_nbytes(S1.buffer_of(i)), dtype=torch.uint8,
                                device=device) for i, r in enumerate(S1.regions)}


@pytest.mark.parametrize(("memory", "buffers", "msg"), [
    ({"draft.0.mla": "VRAM"}, None,
     r"'draft.0.mla'.*declared VRAM in memory=, but the buffer is DRAM memory \(a tensor on cpu"),
    ({"layers.0.attn": "VRAM"}, "numpy",
     r"'layers.0.attn'.*declared VRAM.*a numpy array, host memory"),
    ({"nope": "DRAM"}, None, "'nope' is neither a buffer nor a region"),
    ({"draft.0.mla": "HBM"}, None, r"memory\['draft.0.mla'\] is 'HBM', not one of"),
])
def test_a_buffer_not_in_its_declared_memory_is_refused(memory, buffers, msg):
    bufs = _bufs()
    if buffers == "numpy":
        bufs = {k: v.numpy() for k, v in bufs.items()}
    with pytest.raises(BufferSizeError, match=msg):
        Endpoint("e", S1, 0, bufs, memory=memory)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_declared_dram_moves_exact_bytes(mode):
    """Every buffer declared DRAM (by region name), hetero TP 4 -> 2: one registration, one
    local list, the bytes of kvplan.simulate and the oracle."""
    memory = {r.name: "DRAM" for r in SRC.regions}
    rng = np.random.default_rng(5)
    sb, db = blocks(rng, SRC, 30), blocks(rng, DST, 30)
    with pair(SRC, DST, cls=TensorPair, device="cpu", memory=memory) as pr:
        ep = pr.d[0]
        assert ep.mem_type == "DRAM" and ep.handles()["registrations"] == 1
        assert {m for m in ep.mem_types if m} == {"DRAM"}
        assert md.decode(ep.metadata()).memory == ()
        pr.connect(mode)
        posted = pr.run(mode, sb, db)
        assert all(t.ok for t in posted)
        pr.sync()
        assert pr.check(sb, db, [t.plan for t in posted]) > 0


# -- spread_pcp ----------------------------------------------------------------------------

def test_spread_pcp_false_reads_pcp_rank_0_only():
    """A connector that only gets PCP rank 0's metadata (vLLM's handshake) pulls everything
    from it with ``spread_pcp=False``; the default map also names replica 1, not connected."""
    _, src, dst, sb, db = next(c for c in CASES if c[0] == "pcp-replicas")
    with pair(src, dst, src_blocks=sb, spread_pcp=False) as pr:
        meta = pr.p[0].metadata()  # PCP rank 0 (ranks: PCP x TP, TP 1)
        for ep in pr.d:
            ep.connect(meta, mode="pull")
        posted = pr.run("pull", sb, db)
        assert {p for t in posted for p in t.peers} == {0}
        assert pr.check(sb, db, [t.plan for t in posted]) > 0
    with pair(src, dst, src_blocks=sb) as pr:
        for ep in pr.d:
            ep.connect(pr.p[0].metadata(), mode="pull")
        with pytest.raises(NotConnectedError, match="ranks"):
            pr.run("pull", sb, db)


def test_spread_pcp_must_be_a_bool():
    with pytest.raises(TypeError, match="spread_pcp must be a bool"):
        Endpoint("e", S1, 0, _bufs(), spread_pcp="no")


# -- two kinds on one rank (CUDA) ----------------------------------------------------------

class MixedPair(TensorPair):
    """Each rank's first buffer on one device and its second on the other; the source puts
    attention on CUDA and the draft MLA on the host, the destination the other way round, so
    every (local kind, remote kind) pair occurs."""

    def _buffer(self, arr):
        t = self._tensors.get(id(arr))
        if t is None:  # SRC and DST hold two buffers per rank: attention, then the MLA
            src_side = len(self.p) < self.src.num_ranks  # the source's endpoints come first
            first = len(self._mine) % 2 == 0
            self._mine.append(id(arr))
            on_cuda = first == src_side
            t = self._tensors[id(arr)] = torch.from_numpy(arr.copy()).to(
                "cuda" if on_cuda else "cpu")
        return t

    def __init__(self, src, dst, **kw) -> None:
        self._mine: list[int] = []
        super().__init__(src, dst, **kw)


@CUDA
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("how", ["whole", "parts"])
def test_dram_and_vram_on_one_rank_move_exact_bytes(mode, how):
    rng = np.random.default_rng(8)
    sb, db = blocks(rng, SRC, 40), blocks(rng, DST, 40)
    # under a secret every notification is sealed: the deferred one (sent after the kinds'
    # transfers) must arrive opened, once, as a carried one does
    with pair(SRC, DST, cls=MixedPair, device="cuda", secret=b"mk secret") as pr:
        for ep in pr.endpoints:
            assert ep.mem_type is None and {m for m in ep.mem_types if m} == {"DRAM", "VRAM"}
            assert ep.handles()["registrations"] == 2
            assert {md.decode(ep.metadata(), b"mk secret").buffer_mem(b) for b in range(2)} == {
                "DRAM", "VRAM"}
        pr.connect(mode)
        initiators = pr.d if mode == "pull" else pr.p
        targets = pr.p if mode == "pull" else pr.d
        remote = "prefill" if mode == "pull" else "decode"
        plans, posted = [], []
        for ep in initiators:
            plan = ep.map(remote, mode).plan(sb, db)
            plans.append(plan)
            if how == "whole":  # a peer's transfers (one per kind pair) notify it once
                posted.append((ep.read if mode == "pull" else ep.write)(plan, remote,
                                                                        notify=b"mk"))
            else:
                rt = ep.request(plan, remote)
                for r in plan.map.dst.regions:
                    rt.post([r.name])
                rt.end()
                posted.append(rt)
        for t in posted:
            t.wait(60, progress=targets)
        pr.sync()
        assert pr.check(sb, db, plans=plans) > 0
        if how == "whole":
            want = sum(len(t.peers) for t in posted)
            got = notifications(targets, want + 1, timeout=2.0)  # waits for one too many
            assert len(got) == want and {n.message for _, n in got} == {b"mk"}


@CUDA
def test_staged_refuses_two_memory_kinds():
    from kvplan_nixl.staged.stager import Stager

    with pair(SRC, DST, cls=MixedPair, device="cuda") as pr:
        with pytest.raises(BufferSizeError, match=r"one memory kind.*DRAM: .*VRAM: "):
            Stager(pr.d[0])



def test_a_kind_the_peer_did_not_register_is_refused_at_connect():
    """A forged memory row (well formed, checksummed) saying a DRAM buffer is VRAM: NIXL finds
    no VRAM registered there when preparing that kind's remote list, and connect refuses the
    peer with nothing left behind (no list, no loaded agent)."""
    with Endpoint("prefill", S1, 0, _bufs()) as p, Endpoint("decode", S1, 0, _bufs()) as d:
        forged = _rewrite(p.metadata(), lambda h: h.update(memory=[[1, "VRAM"]]))
        assert md.decode(forged).buffer_mem(1) == "VRAM"
        with pytest.raises(MetadataError, match="NIXL refused its advertised regions"):
            d.connect(forged, mode="pull")
        assert d.handles() == {"xfer": 0, "dlist": 0, "remote_agents": 0, "registrations": 1,
                               "transfers": 0}
        d.connect(p.metadata(), mode="pull")  # the genuine metadata still connects
        assert d.handles()["dlist"] == 2
