"""Refusals and failures in one process: each real, each ending with the right exception, nothing
posted that should not be, and no NIXL handle left (counted with ``Endpoint.handles``)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from kvplan import IncompatibleLayoutError, PlanError, check_plan, push_map, simulate
from kvplan_nixl import (
    BufferSizeError,
    ClosedError,
    Endpoint,
    MetadataError,
    NotConnectedError,
    PlanMismatchError,
)
from kvplan_nixl import metadata as md
from tests.nixl_util import ZERO, attn, mla, pair, shared_copy, spec

SRC = spec(2, attn(heads=4), mla())
DST = spec(1, attn(heads=4), mla())


def _untouched(pr) -> bool:
    return all(np.array_equal(pr.dst_bufs[k], v) for k, v in pr.before.items())


def _forged(plan, **changes):
    """The plan with its first row changed: a plan kvplan would never make, for bounds tests."""
    rows = plan.copies().copy()
    for k, v in changes.items():
        rows[k][0] = v
    rows.flags.writeable = False
    return attrs.evolve(plan, rows=rows)


def test_wrong_buffer_size_refused_before_nixl():
    bufs = [np.zeros(SRC.rank_region_nbytes(i), np.uint8) for i in range(2)]
    bad = [bufs[0], bufs[1][:-2]]
    with pytest.raises(BufferSizeError, match=r"region 'draft.0.mla': buffer has \d+ bytes, the "
                       r"spec implies \d+"):
        Endpoint("prefill", SRC, 0, bad)
    with pytest.raises(BufferSizeError, match=r"1 buffers for rank 0, which holds 2 allocation"):
        Endpoint("prefill", SRC, 0, bufs[:1])
    with pytest.raises(BufferSizeError, match=r"rank 0 has no buffer for region 'draft\.0\.mla'"):
        Endpoint("prefill", SRC, 0, {"layers.0.attn": bufs[0]})
    with pytest.raises(BufferSizeError, match="'nope' is neither a region nor a pool"):
        Endpoint("prefill", SRC, 0, {"layers.0.attn": bufs[0], "draft.0.mla": bufs[1],
                                     "nope": bufs[1]})
    with pytest.raises(BufferSizeError, match="overlap in memory"):
        Endpoint("prefill", SRC, 0, [(bufs[0].ctypes.data, bufs[0].nbytes),
                                     (bufs[0].ctypes.data, bufs[1].nbytes)])
    with pytest.raises(BufferSizeError, match="not C-contiguous"):
        Endpoint("prefill", SRC, 0, [bufs[0], np.zeros(2 * bufs[1].size, np.uint8)[::2]])
    with pytest.raises(TypeError, match="numpy array or an"):
        Endpoint("prefill", SRC, 0, [bufs[0], "not a buffer"])
    with pytest.raises(ValueError, match="rank 2 is not in"):
        Endpoint("prefill", SRC, 2, bufs)


def test_foreign_corrupt_and_other_version_metadata_refused():
    with pair(SRC, DST) as pr:
        d, good = pr.d[0], pr.p[0].metadata()
        before = d.handles()
        raw_nixl = pr.p[0]._agent.get_agent_metadata()
        version1 = bytearray(good)
        version1[8:10] = (1).to_bytes(2, "big")  # what a kvplan_nixl of before PP/pools sends
        flipped = bytearray(good)
        flipped[len(good) // 2] ^= 0x01
        for blob, msg in [
            (raw_nixl, "not kvplan_nixl endpoint metadata"),
            (b"", "not kvplan_nixl endpoint metadata"),
            (bytes(version1), r"format version 1, this endpoint reads version 3 \(the peer "
                              r"runs an older kvplan_nixl\)"),
            (bytes(flipped), "corrupt: checksum mismatch"),
            (good[:-5], "corrupt"),
            (good[:12], "truncated"),
            (d.metadata(), "own metadata"),
        ]:
            with pytest.raises(MetadataError, match=msg):
                d.connect(blob)
            assert d.handles() == before  # nothing added
        d.connect(good)  # and the endpoint still works


def test_incompatible_layout_refused_at_connect():
    other = spec(2, attn(heads=4, dim=128), mla())  # head_dim differs
    with pair(other, DST) as pr:
        before = pr.d[0].handles()
        with pytest.raises(IncompatibleLayoutError, match=r"layers\.0\.attn"):
            pr.d[0].connect(pr.p[0].metadata())
        assert pr.d[0].handles() == before


def test_plan_naming_an_unconnected_peer_posts_nothing():
    with pair(SRC, DST) as pr:
        d = pr.d[0]
        d.connect(pr.p[0].metadata())  # rank 1 never connected
        plan = d.map("prefill").plan([[1, 2, 3]], [[4, 5, 6]])
        assert plan.peers == (0, 1)
        with pytest.raises(NotConnectedError, match=r"ranks \[1\] of engine 'prefill'"):
            d.read(plan, "prefill")
        with pytest.raises(NotConnectedError, match="no pull connection to engine 'elsewhere'"):
            d.read(plan, "elsewhere")
        with pytest.raises(NotConnectedError, match="no push connection"):
            d.write(plan, "prefill")
        assert d.handles()["xfer"] == 0 and d.handles()["transfers"] == 0
        assert _untouched(pr)


@pytest.mark.parametrize(
    ("change", "msg"),
    [
        ({"src_offset": 10**9}, r"bytes 1000000000:\d+ lies outside the \d+-byte source buffer "
                                r"'layers.0.attn' of rank 0"),
        ({"dst_offset": -4096}, r"bytes -4096:.*outside the \d+-byte destination buffer"),
        ({"length": 10**9}, "outside"),
        ({"length": 0}, "run 0 copies 0 bytes"),
        ({"dst_offset": 8}, "not in whole 128-byte granules of region 'layers.0.attn'"),
        ({"dst_region": 7}, "destination region 7, but the engine has regions 0..1"),
        ({"src_region": 1}, "source rank 0 region 1 in buffer 0, but that region lives in "
                            "buffer 1"),
        ({"src_region": 1, "src_buffer": 1, "src_offset": 0},
         "pairs source region 'draft.0.mla' with destination region 'layers.0.attn'"),
        ({"dst_buffer": -64}, "names destination buffer -64, but the engine has 2 buffers"),
        ({"src_buffer": 2**31}, "names source buffer 2147483648"),
        ({"src_rank": 5}, "names source rank 5, but the engine has ranks 0..1"),
    ],
)
def test_run_outside_registered_bounds_posts_nothing(change, msg):
    """Refused by ``kvplan.check_plan`` (what ``simulate`` refuses, with its PlanError)."""
    with pair(SRC, DST) as pr:
        pr.connect("pull")
        d = pr.d[0]
        plan = _forged(d.map("prefill").plan([[1, 2, 3]], [[4, 5, 6]]), **change)
        with pytest.raises(PlanError, match=msg):
            d.read(plan, "prefill")
        with pytest.raises(PlanError, match=msg):
            check_plan(plan)
        assert d.handles()["xfer"] == 0 and d.handles()["transfers"] == 0
        assert _untouched(pr)


def test_plan_for_another_rank_or_direction_refused():
    src, dst = spec(2, attn(heads=4)), spec(2, attn(heads=4))
    with pair(src, dst) as pr:
        pr.connect("pull")
        d0, d1 = pr.d
        other = d1.map("prefill").plan([[1]], [[2]])
        with pytest.raises(PlanMismatchError, match="made for rank 1"):
            d0.read(other, "prefill")
        pushed = push_map(src, dst, 0).plan([[1]], [[2]])
        with pytest.raises(PlanMismatchError, match="read needs a pull plan"):
            d0.read(pushed, "prefill")
        with pytest.raises(TypeError, match="TransferPlan"):
            d0.read("plan", "prefill")
        assert d0.handles()["xfer"] == 0


def test_spec_change_between_ranks_refused():
    a = spec(2, attn(heads=4), mla())
    b = spec(2, attn(heads=4, nb=64), mla(nb=64))
    with pair(a, DST) as pa, pair(b, DST) as pb:
        d = pa.d[0]
        d.connect(pa.p[0].metadata())
        with pytest.raises(MetadataError, match="differs from the one its other ranks"):
            d.connect(pb.p[1].metadata())


def test_closed_endpoint_refuses_and_close_is_idempotent():
    with pair(SRC, DST) as pr:
        pr.connect("pull")
        d = pr.d[0]
        plan = d.map("prefill").plan([[1]], [[2]])
        d.close()
        d.close()
        assert d.closed and d.handles() == ZERO
        for call in (d.metadata, lambda: d.read(plan, "prefill"),
                     lambda: d.connect(pr.p[0].metadata())):
            with pytest.raises(ClosedError, match="is closed"):
                call()


def test_metadata_roundtrip_is_exact():
    with pair(SRC, DST) as pr:
        info = md.decode(pr.p[1].metadata())
        assert (info.engine, info.rank, info.spec) == ("prefill", 1, SRC)
        assert info.nbytes == tuple(SRC.rank_region_nbytes(i) for i in range(2))
        assert info.bases == tuple(pr.src_bufs[(1, i)].ctypes.data for i in range(2))


# -- tampered plans: the executor refuses exactly what kvplan.simulate refuses (issue 28) -------

_COLUMNS = ("src_rank", "src_region", "src_offset", "dst_rank", "dst_region", "dst_offset",
            "length", "src_buffer", "dst_buffer")


def _tamper(rng, plan):
    """``plan`` with 1-2 edits of its arrays: nasty values, a neighbour's value, lengths that
    make two runs overlap."""
    rows = plan.copies().copy()
    for _ in range(int(rng.integers(1, 3))):
        k = int(rng.integers(len(rows)))
        c = _COLUMNS[int(rng.integers(len(_COLUMNS)))]
        v = int(rows[c][k])
        j = int(rng.integers(len(rows)))
        choice = int(rng.integers(8))
        if choice == 0:
            new = [-64, -1, 2**31, 2**62, 0, 1][int(rng.integers(6))]
        elif choice == 1:
            new = v + [-1, 1][int(rng.integers(2))]  # a neighbour rank, region, byte
        elif choice == 2:
            new = int(rows[c][j])  # another run's value (two runs on one destination...)
        elif choice == 3 and c == "length":
            new = v + int(rows["length"][j])  # runs into the next one
        elif choice == 4:
            c, new = "dst_offset", int(rows["dst_offset"][j])  # overlap another run
        else:
            new = v + 128 * int(rng.integers(-4, 5))  # off by whole granules
        rows[c][k] = new
    rows.flags.writeable = False
    return attrs.evolve(plan, rows=rows)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_tampered_plans_are_refused_exactly_when_simulate_refuses_them(mode):
    rng = np.random.default_rng(28 if mode == "pull" else 29)
    with pair(SRC, DST, secret=b"s" * 16) as pr:
        pr.connect(mode)
        ini = pr.d[0] if mode == "pull" else pr.p[0]
        remote = "prefill" if mode == "pull" else "decode"
        post = ini.read if mode == "pull" else ini.write
        genuine = ini.map(remote, mode).plan([[1, 2, 3, 9]], [[4, 5, 6, 7]])
        refused = accepted = 0
        for _ in range(120):
            plan = _tamper(rng, genuine)
            want = shared_copy(pr.before)
            try:
                simulate(plan, pr.src_bufs, want)
                sim_error = None
            except PlanError as exc:
                sim_error = exc
            try:
                t = post(plan, remote, timeout=10)
            except PlanError as exc:
                assert sim_error is not None, f"executor refused what simulate takes: {exc}"
                assert ini.handles()["xfer"] == 0 and ini.handles()["transfers"] == 0
                assert _untouched(pr)
                refused += 1
                continue
            assert sim_error is None, f"executor posted what simulate refuses: {sim_error}"
            t.wait(10, progress=pr.endpoints)
            for k, v in want.items():
                assert np.array_equal(pr.dst_bufs[k], v), k
                pr.dst_bufs[k][...] = pr.before[k]
            accepted += 1
        assert refused > 60 and accepted > 5, (refused, accepted)
        for ep in pr.endpoints:
            assert ep.handles()["xfer"] == 0
