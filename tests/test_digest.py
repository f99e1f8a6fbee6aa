"""The transfer digest: the checksum against a plain reference, the runs of a rank pair, and
real NIXL transfers whose digests agree, or disagree once one byte is flipped in flight."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from kvplan import RequestError, pull_map, push_map
from kvplan.pairs import pair_runs
from kvplan_nixl import (
    ArgumentError,
    BoundsError,
    BufferSizeError,
    Digester,
    DigestMismatch,
    PlanMismatchError,
)
from kvplan_nixl import digest as dg
from tests.nixl_util import DIGEST_SCRIPT_SETUP, attn, blocks, mla, pair, spec

P = (1 << 31) - 1


def reference(mem: np.ndarray, starts, lengths) -> tuple[int, int, int]:
    """The digest's definition, byte by byte in Python: the runs concatenated, then
    (n, sum b_k mod P, sum k * b_k mod P)."""
    stream = b"".join(mem[s:s + n].tobytes() for s, n in zip(starts, lengths))
    return (len(stream), sum(stream) % P, sum(k * b for k, b in enumerate(stream)) % P)


@pytest.mark.parametrize("chunk", [4096, 8192, 16 << 20])
def test_checksum_matches_the_reference(monkeypatch, chunk):
    monkeypatch.setattr(dg, "CHUNK", chunk)  # small chunks: runs straddle chunk boundaries
    rng = np.random.default_rng(7)
    mem = rng.integers(0, 256, 60_000, dtype=np.uint8)
    for trial in range(60):
        n = int(rng.integers(0, 12))
        starts = rng.integers(0, 50_000, n)
        lengths = rng.integers(0, 9_000, n)
        if trial % 3 == 0:  # aligned runs: the gather indexes by larger elements
            starts, lengths = starts // 512 * 512, lengths // 512 * 512
        d = dg.checksum(mem, starts, lengths)
        assert (d.nbytes, d.a, d.b) == reference(mem, starts, lengths)


def test_checksum_is_the_same_however_the_stream_is_cut():
    rng = np.random.default_rng(1)
    mem = rng.integers(0, 256, 20_000, dtype=np.uint8)
    whole = dg.checksum(mem, [100], [15_000])
    cuts = np.sort(rng.choice(np.arange(101, 15_100), 40, replace=False))
    edges = np.concatenate(([100], cuts, [15_100]))
    assert dg.checksum(mem, edges[:-1], np.diff(edges)) == whole


def test_checksum_catches_every_single_byte_flip_and_a_swap():
    rng = np.random.default_rng(2)
    mem = rng.integers(0, 256, 10_000, dtype=np.uint8)
    starts, lengths = [0, 5000], [4000, 4000]
    good = dg.checksum(mem, starts, lengths)
    for pos in rng.choice(np.r_[0:4000, 5000:9000], 50, replace=False):
        bad = mem.copy()
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        assert dg.checksum(bad, starts, lengths) != good
    i, j = 10, 5010  # two different bytes swapped: the sum agrees, the weighted sum does not
    mem[i], mem[j] = 3, 200
    before = dg.checksum(mem, starts, lengths)
    mem[i], mem[j] = mem[j], mem[i]
    assert dg.checksum(mem, starts, lengths).a == before.a
    assert dg.checksum(mem, starts, lengths) != before
    outside = mem.copy()
    outside[4500] ^= 0xFF  # a byte no run covers: not the digest's business
    assert dg.checksum(outside, starts, lengths) == dg.checksum(mem, starts, lengths)


def test_digest_hex_round_trip_and_bad_text():
    d = dg.Digest(123456789, P - 1, 42)
    assert dg.Digest.from_hex(d.hex()) == d
    for bad in ("", "12", "zz-0000000000000000", "1-00000000", 7, None,
                f"1-{P:08x}00000000"):
        with pytest.raises(ArgumentError, match="digest"):
            dg.Digest.from_hex(bad)


def _pair_specs():
    # TP2 -> TP1 with two layers: each decode rank reads both prefill ranks, many runs
    src = spec(2, attn("layers.0.attn", nb=24), attn("layers.1.attn", nb=24), mla(nb=24))
    dst = spec(1, attn("layers.0.attn", nb=40), attn("layers.1.attn", nb=40), mla(nb=40))
    return src, dst


def test_pair_runs_are_the_pull_plans_and_the_push_plans_rows_in_destination_order():
    src, dst = _pair_specs()
    rng = np.random.default_rng(3)
    sb, db = blocks(rng, src, 9), blocks(rng, dst, 9)
    pull = pull_map(src, dst, 0).plan(sb, db)
    for p in range(src.num_ranks):
        push = push_map(src, dst, p).plan(sb, db)
        a, b = pair_runs(pull, p, 0), pair_runs(push, p, 0)
        assert len(a) and not a.flags.writeable
        key = np.lexsort((a["dst_offset"], a["dst_buffer"]))
        assert np.array_equal(key, np.arange(len(a)))  # sorted by destination address
        # the same bytes either way: every destination byte once, with its source byte
        for rows in (a, b):
            assert rows["length"].sum() == pull.copies()[pull.copies()["src_rank"] == p][
                "length"].sum()
    with pytest.raises(RequestError, match="src_rank must be an int in \\[0, 2\\), got 2"):
        pair_runs(pull, 2, 0)
    with pytest.raises(RequestError, match="dst_rank"):
        pair_runs(pull, 0, True)


def _digesters(pr):
    srcs = [Digester(pr.src, r, {pr.src.regions[i].name: pr.src_bufs[(r, i)]
                                 for i in pr.src.regions_on(r)})
            for r in range(pr.src.num_ranks)]
    dsts = [Digester(pr.dst, r, {pr.dst.regions[i].name: pr.dst_bufs[(r, i)]
                                 for i in pr.dst.regions_on(r)})
            for r in range(pr.dst.num_ranks)]
    return srcs, dsts


def _source_digests(pr, srcs, sb, db, d):
    """What each prefill rank sends decode rank ``d``: its digest over its own push plan (not
    the decode's pull plan: the two sides never exchange runs)."""
    out = {}
    for p, dig in enumerate(srcs):
        mine = dig.digests(push_map(pr.src, pr.dst, p).plan(sb, db), "src")
        if d in mine:
            out[p] = mine[d].hex()
    return out


@pytest.mark.parametrize("corrupt", ["none", "source", "destination"])
def test_a_byte_flipped_in_flight_fails_the_pull(corrupt):
    src, dst = _pair_specs()
    rng = np.random.default_rng(4)
    sb, db = blocks(rng, src, 9), blocks(rng, dst, 9)
    with pair(src, dst) as pr:
        pr.connect("pull")
        srcs, dsts = _digesters(pr)
        expected = _source_digests(pr, srcs, sb, db, 0)
        assert sorted(expected) == [0, 1]
        plan = pr.d[0].map("prefill", "pull").plan(sb, db)
        rows = pair_runs(plan, 1, 0)
        run = rows[len(rows) // 2]
        if corrupt == "source":  # after the source's digest, before the read: a bad read
            buf = pr.src_bufs[(1, int(run["src_region"]))]
            flat = buf.reshape(-1).view(np.uint8)
            flat[int(run["src_offset"]) + int(run["length"]) // 2] ^= 0x10
        t = pr.d[0].read(plan, "prefill")
        t.wait(30.0, progress=pr.p)
        if corrupt == "destination":  # after arrival, before the check: a bad write
            buf = pr.dst_bufs[(0, int(run["dst_region"]))]
            buf.reshape(-1).view(np.uint8)[int(run["dst_offset"])] ^= 0x01
        if corrupt == "none":
            dsts[0].verify(plan, expected)
            pr.check(sb, db)
            return
        with pytest.raises(DigestMismatch) as e:
            dsts[0].verify(plan, expected)
        assert e.value.peer_ranks == (1,)  # rank 0's bytes were fine
        assert "rank 1: digest mismatch: source" in str(e.value)
        assert sum(len(b) for b in e.value.blocks) == sum(len(b) for b in db)


def test_verify_names_a_rank_that_sent_no_digest_and_refuses_vram():
    src, dst = _pair_specs()
    rng = np.random.default_rng(5)
    sb, db = blocks(rng, src, 4), blocks(rng, dst, 4)
    with pair(src, dst) as pr:
        _, dsts = _digesters(pr)
        plan = pull_map(src, dst, 0).plan(sb, db)
        good = dsts[0].digests(plan, "dst")
        with pytest.raises(DigestMismatch, match="rank 1: sent no digest"):
            dsts[0].verify(plan, {0: good[0]})
        with pytest.raises(ArgumentError, match="side must be 'src' or 'dst'"):
            dsts[0].digests(plan, "both")
        with pytest.raises(PlanMismatchError, match="plan's src engine is not the one"):
            dsts[0].digests(plan, "src")  # a decode Digester given the prefill's side
        rows = plan.copies().copy()
        rows["dst_offset"][-1] = 1 << 40  # a forged run past the buffer: never read
        with pytest.raises(BoundsError, match=r"is outside the \d+ bytes rank 0 holds"):
            dsts[0].digests(attrs.evolve(plan, rows=rows), "dst")
        mine = {dst.regions[i].name: pr.dst_bufs[(0, i)] for i in dst.regions_on(0)}
        with pytest.raises(BufferSizeError, match="VRAM"):
            Digester(dst, 0, mine, memory={"layers.0.attn": "VRAM"})


# -- the connector's push path, without engines (in the vLLM venv: it imports vLLM) -----------

CONNECTOR_CHECK = DIGEST_SCRIPT_SETUP + r"""
import json, time
from types import SimpleNamespace
import numpy as np
from kvplan_nixl.serving.pushes import PUSHED, PushSend, parse_done, push_done
from kvplan_nixl.serving import push_digests
from kvplan_nixl.serving.push_io import Receive, Receives
from kvplan_nixl.serving.settings import Settings

class Decode:  # the worker attributes Receives and digests read; fail() records the verdict
    def __init__(self, ep, d):
        self.c = Settings("decode", "127.0.0.1", 5700, 1, extra={"digest": True})
        self.rank, self.ep, self.digester, self.groups, self.whole = 0, ep, d, groups, False
        self.hs_timeout, self.recv_done, self.failed = 5.0, set(), []
        self.stats = SimpleNamespace(record=lambda *a: None,
                                     record_transfer=lambda *a: None)
    def fail(self, load, why, peers=()):
        self.failed.append(why)

def push(pr, key, flip=False, digest=True):
    # each prefill rank: the connector's PUSHED, signed, as the write's notification
    send = PushSend(key, 1, key, (tuple(ids),), (0,))
    for p, ep in enumerate(pr.p):
        plan = ep.map("decode", "push").plan(groups.remote([ids], [0]), groups.local([mine]),
                                             tokens=(0, end))
        d = digester(src, p, pr.src_bufs) if digest else None
        msg = push_digests.sign(d, plan, send, push_done(PUSHED, key, {0: plan.nbytes}, {0: 1}))
        ep.write(plan, "decode", notify=msg).wait(30, progress=pr.d)
    if flip:  # after arrival, before the decode's check: a byte prefill rank 1 wrote
        row = plan.copies()[len(plan) // 2]
        buf = pr.dst_bufs[(0, int(row["dst_region"]))].reshape(-1).view(np.uint8)
        buf[int(row["dst_offset"]) + int(row["length"]) - 1] ^= 0x04
    w = Decode(pr.d[0], digester(dst, 0, pr.dst_bufs))
    rc = Receives(w)
    load = SimpleNamespace(req_id=key, engine="prefill", local_ids=[mine], start=0, end=end,
                           push=True)
    rc.waiting[key] = Receive(load, frozenset({0, 1}), time.monotonic() + 30, 0.0)
    got, deadline = 0, time.monotonic() + 10
    while got < 2 and time.monotonic() < deadline:
        for n in pr.d[0].notifications():
            got += rc.notice(n, time.monotonic())
    assert got == 2 and not rc.waiting, (got, rc.waiting)
    return w

with pair(src, dst) as pr:
    pr.connect("pull"); pr.connect("push")
    w = push(pr, "ok")
    assert w.recv_done == {"ok"} and w.failed == [], (w.recv_done, w.failed)
    pr.check([ids], [mine], ())  # the oracle agrees the bytes arrived
    w = push(pr, "bad", flip=True)
    assert w.recv_done == set() and len(w.failed) == 1, (w.recv_done, w.failed)
    assert "DigestMismatch" in w.failed[0] and "digest mismatch: source" in w.failed[0], w.failed
    w = push(pr, "unsigned", digest=False)  # a prefill with the digest off: refused too
    assert "sent no source lists" in w.failed[0], w.failed

try:
    Settings("e", "h", 1, 1, extra={"digest": "yes"}).digest()
    raise SystemExit("a non-bool digest was taken")
except ValueError as e:
    assert "kv_connector_extra_config['digest'] must be true or false" in str(e), e
print("ok")
"""


def test_connector_push_checks_the_digest_before_the_first_token(vllm_python):
    from tests.test_vllm_serving import _in_vllm_venv

    _in_vllm_venv(vllm_python, CONNECTOR_CHECK)
