"""The torch local legs (kvplan_nixl/staged/legs.py) against kvplan.simulate of the same legs.

For plans of generated engine pairs, every chunk is gathered into a slot tensor with
``legs.gather`` and scattered out of it with ``legs.scatter``; the destination must equal what
``simulate`` makes of the plan. No NIXL: the bulk leg is the identity here (one slot shared).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvplan.strategies as ks
from kvplan import EngineSpec, pull_map, simulate
from kvplan.staging import stage
from kvplan_nixl.staged import legs
from tests import oracle


def _buffers(spec, bufs, rank, kind):
    """Flat byte tensors per buffer index (``spec.buffers``) of ``rank``, sharing memory with
    the oracle's numpy arrays (keyed by region index, or by buffer name for K/V buffers), given
    to torch as arrays, tensors or (address, nbytes) pairs."""
    out = {}
    for (r, key), b in bufs.items():
        if r != rank:
            continue
        i = spec.buffers.index(key) if isinstance(key, str) else spec.buffer_of(key)
        if kind == "tensor":
            out[i] = torch.from_numpy(b)
        elif kind == "pair":
            out[i] = legs.byte_tensor((b.ctypes.data, b.nbytes))
        else:
            out[i] = legs.byte_tensor(b)
    return out


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ks.spec_pairs().flatmap(lambda p: st.tuples(
    st.just(p), ks.requests(*p), st.sampled_from([64, 4096, 1 << 16]),
    st.sampled_from(["tensor", "pair", "array"]))))
def test_torch_legs_move_exactly_what_simulate_moves(case):
    (src_d, dst_d), (sb, db), chunk, kind = case
    src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
    src_bufs = oracle.source_buffers(src_d, seed=3, request_blocks=sb)
    before = oracle.destination_buffers(dst_d, seed=4)
    for rank in range(dst.num_ranks):
        plan = pull_map(src, dst, rank).plan(sb, db)
        sp = stage(plan, chunk)
        want = oracle.clone_buffers(before, rank)
        simulate(plan, src_bufs, want)
        got = oracle.clone_buffers(before, rank)
        dst_buffers = _buffers(dst, got, rank, kind)
        slot = torch.zeros(chunk, dtype=torch.uint8)
        gi, si = legs.SideIndex(sp, "src"), legs.SideIndex(sp, "dst")
        per_peer = {}  # the executor's view: one index per peer's range of pieces
        for peer in sp.peers:
            pc = sp.peer_chunks(peer)
            mine = slice(int(pc["row_start"][0]), int(pc["row_end"][-1]))
            per_peer[peer] = legs.SideIndex(sp, "src", mine), legs.SideIndex(sp, "dst", mine)
        for ch in sp.chunks:
            src_buffers = _buffers(src, src_bufs, int(ch["peer"]), kind)
            g, s = gi.chunk(ch), si.chunk(ch)
            assert g.nbytes == s.nbytes == ch["nbytes"]
            for whole, part in zip((g, s), (x.chunk(ch) for x in per_peer[int(ch["peer"])]),
                                   strict=True):
                assert part.nbytes == whole.nbytes and len(part.ops) == len(whole.ops)
                for (b1, a1, e1, i1), (b2, a2, e2, i2) in zip(whole.ops, part.ops, strict=True):
                    assert (b1, a1, e1) == (b2, a2, e2) and np.array_equal(i1, i2)
            for ops in (g.ops, s.ops):  # stretches tile the slot from its first granule
                assert [a for _, a, _, _ in ops] == [0, *(b for _, _, b, _ in ops[:-1])]
            legs.gather(g, src_buffers, slot, sp.granule)
            legs.scatter(s, dst_buffers, slot, sp.granule)
        for k in want:
            assert np.array_equal(got[k], want[k]), k


def test_granule_index_expands_runs():
    idx = legs.granule_index(np.array([0, 64, 256]), np.array([64, 128, 32]), 32)
    assert idx.tolist() == [0, 1, 2, 3, 4, 5, 8]
    one = legs.granule_index(np.array([4096, 0]), np.array([4096, 4096]), 4096)
    assert one.tolist() == [1, 0]


@pytest.mark.parametrize("n", [None, 1])
def test_cpu_threads_restores_torch_setting(n):
    before = torch.get_num_threads()
    with legs.cpu_threads(n, torch.zeros(1)):
        assert torch.get_num_threads() == (before if n is None else n)
    assert torch.get_num_threads() == before


def test_cpu_threads_shared_by_legs_asking_the_same_count():
    """Legs of several Stagers asking the same count hold it together (they used to run one
    after another); the setting is restored when the last leaves."""
    import threading

    before = torch.get_num_threads()
    inside = threading.Barrier(2, timeout=10)

    def leg():
        with legs.cpu_threads(1, torch.zeros(1)):
            inside.wait()  # both legs inside at once, or the barrier times out

    ts = [threading.Thread(target=leg) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not inside.broken
    assert torch.get_num_threads() == before
