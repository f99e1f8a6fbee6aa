"""Refusals and failures in one process: each real, each ending with the right exception, nothing
posted that should not be, and no NIXL handle left (counted with ``Endpoint.handles``)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from kvplan import IncompatibleLayoutError, push_map
from kvplan_nixl import (
    BoundsError,
    BufferSizeError,
    ClosedError,
    Endpoint,
    MetadataError,
    NotConnectedError,
    PlanMismatchError,
)
from kvplan_nixl import metadata as md
from tests.nixl_util import ZERO, attn, mla, pair, spec

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
        ({"src_offset": 10**9}, r"remote run \[\d+:\d+\) is outside the \d+ registered bytes"),
        ({"dst_offset": -4096}, r"local run \[-4096:.*outside"),
        ({"length": 10**9}, "outside"),
        ({"length": 0}, "length 0 is not positive"),
        ({"dst_offset": 8}, "not all multiples of the"),
        ({"dst_region": 7}, "local region 7 does not exist"),
        ({"src_region": 1}, "paired with remote region 'draft.0.mla'"),
    ],
)
def test_run_outside_registered_bounds_posts_nothing(change, msg):
    with pair(SRC, DST) as pr:
        pr.connect("pull")
        d = pr.d[0]
        plan = _forged(d.map("prefill").plan([[1, 2, 3]], [[4, 5, 6]]), **change)
        with pytest.raises(BoundsError, match=msg) as info:
            d.read(plan, "prefill")
        assert "run p0 L" in str(info.value)  # the run, in the project's notation
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
