"""The trust boundary, with real NIXL agents: signed metadata, forged metadata refused before
NIXL and without a trace, close notices, restarts, and the progress-thread option.

"Forged" blobs carry a recomputed sha256 (anyone can do that); with a secret only an HMAC under
it is accepted. After every refusal the endpoint must be exactly as before (handles, peers,
routes) and a genuine transfer must still be byte-exact.
"""

from __future__ import annotations

import hashlib
import json
import time

import attrs
import numpy as np
import pytest

from kvplan_nixl import Endpoint, MetadataError, NotConnectedError, TransferFailed
from kvplan_nixl import metadata as md
from kvplan_nixl._nixl import make_agent
from kvplan_nixl.handshake import CLOSE as _CLOSE
from kvplan_nixl.handshake import HELLO as _HELLO
from tests.nixl_util import ZERO, Pair, attn, mla, pair, spec

SRC = spec(2, attn(heads=4), mla())
DST = spec(1, attn(heads=4), mla())
KEY = b"kvplan-test-deployment-secret-0"
SB, DB = [[1, 2, 3]], [[4, 5, 6]]


def _state(ep: Endpoint):
    return ep.handles(), [(p.engine, p.rank, p.agent) for p in ep.peers()], sorted(ep._routes)


def _exact(pr) -> None:
    """A genuine request still moves exactly the right bytes."""
    pr.run("pull", SB, DB)
    assert pr.check(SB, DB) > 0


def _rewrite(blob: bytes, edit=None, agent_md: bytes | None = None) -> bytes:
    """``blob`` with its header JSON edited and its sha256 recomputed: a forgery anyone can make."""
    _, version, hlen, _ = md._FIXED.unpack_from(blob)
    h = json.loads(blob[md._FIXED.size : md._FIXED.size + hlen])
    if edit is not None:
        edit(h)
    a = blob[md._FIXED.size + hlen : -32] if agent_md is None else agent_md
    hb = json.dumps(h).encode()
    body = md._FIXED.pack(md.MAGIC, version, len(hb), len(a)) + hb + a
    return body + hashlib.sha256(body).digest()


def _until(cond, timeout: float = 5.0, progress=()) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        for ep in progress:
            ep.progress()
        time.sleep(1e-3)
    return True


class _Raw:
    """A bare NIXL agent in ``_until``'s progress list."""

    def __init__(self, agent) -> None:
        self.agent = agent

    def progress(self) -> None:
        self.agent.get_new_notifs()


class _Spy:
    """Counts calls of one NIXL method of an agent (the call itself still goes to NIXL)."""

    def __init__(self, monkeypatch, agent, name: str) -> None:
        self.calls = 0
        real = getattr(agent, name)

        def spy(*a, **kw):
            self.calls += 1
            return real(*a, **kw)

        monkeypatch.setattr(agent, name, spy)


def test_signed_metadata_connects_and_transfers_exactly():
    with pair(SRC, DST, secret=KEY) as pr:
        pr.connect("pull")
        _exact(pr)


def test_unsigned_or_wrongly_signed_metadata_never_reaches_nixl(monkeypatch):
    with pair(SRC, DST, secret=KEY) as pr, pair(SRC, DST) as plain:
        d = pr.d[0]
        spy = _Spy(monkeypatch, d._agent, "add_remote_agent")
        good = pr.p[0].metadata()
        other_key = md.encode(md.decode(good, KEY), b"another deployment")
        flipped = bytearray(good)
        flipped[-40] ^= 0x01  # a byte of NIXL's section
        before = _state(d)
        for blob, msg in [
            (plain.p[0].metadata(), r"from peer 'prefill#0#\w+' \(as it claims\) is unsigned, "
                                    "but this endpoint has a secret"),
            (other_key, "is not signed with this endpoint's secret"),
            (bytes(flipped), "is not signed with this endpoint's secret"),
            (_rewrite(good), "is unsigned"),  # a forgery with a recomputed checksum
        ]:
            with pytest.raises(MetadataError, match=msg):
                d.connect(blob)
            assert _state(d) == before
        assert spy.calls == 0  # refused before NIXL
        with pytest.raises(MetadataError, match=r"checksum mismatch \(or signed with a secret"):
            plain.d[0].connect(good)
        with pytest.raises(MetadataError, match="secret must be non-empty"):
            Endpoint("x", SRC, 0, [np.zeros(SRC.rank_region_nbytes(i), np.uint8)
                                   for i in range(2)], secret=b"")
        pr.connect("pull")
        _exact(pr)


def test_forged_metadata_refused_cheaply_and_without_trace():
    """No secret: each forgery has a recomputed checksum; each is refused before NIXL loads
    anything (or, for addresses NIXL itself rejects, with everything undone)."""
    with pair(SRC, DST) as pr, pair(SRC, DST) as third:
        d = pr.d[0]
        pr.connect("pull")
        good = pr.p[0].metadata()
        stranger = third.p[0]._agent.get_agent_metadata()  # another process's NIXL section
        before = _state(d)

        def bigger(h):
            h["regions"][0][2] += 4096

        def shifted(h):  # NIXL registers nothing there: its prep refuses, after loading
            for row in h["regions"]:
                row[1] += 1 << 30

        forged = [
            (_rewrite(good, lambda h: h.update(agent="decode#0#feed")),
             r"agent name 'decode#0#feed' does not name that engine and rank"),
            (_rewrite(good, lambda h: h.update(rank=1)), "does not name that engine and rank"),
            (_rewrite(good, agent_md=stranger), r"its NIXL section names agent 'prefill#0#\w+'"),
            (_rewrite(good, agent_md=b"\x00" * 64), "is not NIXL agent metadata"),
            (_rewrite(good, bigger), r"registers \d+ bytes, its spec implies"),
            (_rewrite(good, lambda h: h["spec"]["regions"][0].update(block_size=2**40)),
             "block_size 1099511627776 exceeds the limit"),
            (_rewrite(good, lambda h: h["spec"].update(tp_size=2**40)),
             "tp_size 1099511627776 exceeds the limit"),
            (_rewrite(good, lambda h: h["spec"]["regions"][0].update(num_blocks=2**60)),
             "byte offsets must fit in int64"),
            (_rewrite(good, lambda h: h.update(mem_type="FILE")), "memory type 'FILE'"),
            (_rewrite(good, lambda h: h.update(regions=[[0, "1", 2, 3]])), "integers"),
            (_rewrite(good, lambda h: h.update(spec=[[[[[]]]]])), "an unreadable spec|invalid"),
        ]
        for blob, msg in forged:
            t = time.perf_counter()
            with pytest.raises(MetadataError, match=msg):
                d.connect(blob)
            assert time.perf_counter() - t < 0.5, msg  # milliseconds, not seconds
            assert _state(d) == before
        # a forgery NIXL loads but whose addresses its prep refuses: loaded agent removed again
        fresh = Pair(SRC, DST)
        try:
            d2 = fresh.d[0]
            before2 = _state(d2)
            with pytest.raises(MetadataError, match="NIXL refused its advertised regions"):
                d2.connect(_rewrite(fresh.p[0].metadata(), shifted))
            assert _state(d2) == before2 == (ZERO | {"registrations": 1}, [], [])
            fresh.connect("pull")  # the genuine peer is not blocked by the refused load
            fresh.run("pull", SB, DB)
            assert fresh.check(SB, DB) > 0
        finally:
            fresh.close()
        _exact(pr)


def test_refused_restart_or_spec_leaves_genuine_peers_alone():
    with pair(SRC, DST) as pr:
        d = pr.d[0]
        pr.connect("pull")
        before = _state(d)
        bufs = {SRC.regions[i].name: pr.src_bufs[(0, i)] for i in SRC.regions_on(0)}
        with Endpoint("prefill", SRC, 0, bufs) as again:  # a real new agent for rank 0

            def shifted(h):
                for row in h["regions"]:
                    row[1] += 1 << 30

            with pytest.raises(MetadataError, match="NIXL refused its advertised regions"):
                d.connect(_rewrite(again.metadata(), shifted))
            assert _state(d) == before  # the genuine rank 0 is neither evicted nor broken
            _exact(pr)
            def doubled(h):  # a consistent blob, but another spec than rank 0's
                for r in h["spec"]["regions"]:
                    r["num_blocks"] *= 2
                for k, row in enumerate(h["regions"]):  # twice the size, laid apart (buffers
                    row[1] = (k + 1) << 40  # advertised overlapping are refused first)
                    row[2] *= 2

            other = _rewrite(pr.p[1].metadata(), doubled)
            with pytest.raises(MetadataError, match="differs from the one its other ranks"):
                d.connect(other)
            assert _state(d) == before
            # the genuine restart is accepted: rank 0 now is the new agent
            d.connect(again.metadata())
            assert [p.agent for p in d.peers()] == [again.agent_name, pr.p[1].agent_name]
            pr.p[0].close()
            pr.p[0] = again
            _exact(pr)
            pr.p[0] = Endpoint("prefill", SRC, 0, bufs)  # closed by the pair; `again` by with


def test_close_tells_initiators_fails_in_flight_and_restart_reconnects():
    with pair(SRC, DST) as pr:
        d, (p0, p1) = pr.d[0], pr.p
        pr.connect("pull")
        # each target learns of its initiator from the hello notice connect sent
        assert _until(lambda: p0.handles()["remote_agents"] == 1 == p1.handles()["remote_agents"],
                      progress=(d, p0, p1))
        plan = d.map("prefill").plan(SB, DB)
        t = d.read(plan, "prefill", notify=b"req-1")
        p0.close()
        try:
            t.wait(10, progress=[p1])  # progresses d too: the close notice arrives
            failed = None
        except TransferFailed as exc:
            failed = exc
        if failed is not None:  # in flight when p0 closed: failed naming rank 0 and its blocks
            # by the notice, or by UCX seeing the torn-down agent first: either way, named
            assert failed.peer_ranks == (0,)
            assert "closed its endpoint" in str(failed) or "REMOTE_DISCONNECT" in str(failed)
            assert failed.blocks[0].tolist() == DB[0]
        assert _until(lambda: [p.rank for p in d.peers()] == [1], progress=(d,))
        with pytest.raises(NotConnectedError, match=r"ranks \[0\]"):
            d.read(plan, "prefill")
        assert d.handles()["remote_agents"] == 1
        # rank 0 comes back (new agent, same memory): connected afresh, exact again
        bufs = {SRC.regions[i].name: pr.src_bufs[(0, i)] for i in SRC.regions_on(0)}
        pr.p[0] = Endpoint("prefill", SRC, 0, bufs)
        d.connect(pr.p[0].metadata())
        _exact(pr)
        # the whole engine closes: the route goes too
        for p in pr.p:
            p.close()
        assert _until(lambda: not d.peers(), progress=(d,))
        assert d.handles() == ZERO | {"registrations": 1}
        with pytest.raises(NotConnectedError, match="no pull connection to engine 'prefill'"):
            d.map("prefill")


def test_single_rank_engine_restarting_with_another_spec_is_connected_afresh():
    """A crashed engine of one rank (no close notice) comes back with more blocks: the route
    built for its old spec is replaced, not kept to refuse the new one."""
    one = spec(1, attn(heads=4))
    with pair(one, one) as pr:
        d = pr.d[0]
        pr.connect("pull")
        before = d.handles()
        bigger = spec(1, attn(heads=4, nb=64))
        bufs = [np.zeros(bigger.rank_region_nbytes(0), np.uint8)]
        with Endpoint("prefill", bigger, 0, bufs) as back:
            d.connect(back.metadata())
            assert d.map("prefill").src == bigger
            assert [p.agent for p in d.peers()] == [back.agent_name]
            assert d.handles() == before  # one local list, one peer list, one agent: swapped
            t = d.read(d.map("prefill").plan([[60, 61]], [[1, 2]]), "prefill")
            t.wait(10, progress=[back])
            pr.p[0].close()  # the "crashed" one


@pytest.mark.parametrize("secret", [None, KEY])
def test_forged_close_notice(secret):
    """An agent that takes a peer's name and sends a close notice: obeyed without a secret
    (peers are trusted), ignored with one (the notice carries no valid MAC)."""
    with pair(SRC, DST, secret=secret) as pr:
        d = pr.d[0]
        pr.connect("pull")
        liar = make_agent(pr.p[0].agent_name, ("UCX",), False)
        liar.add_remote_agent(d._agent.get_agent_metadata())
        liar.send_notif(d.agent_name, _CLOSE + b"\x00" * 32)
        both = (d, _Raw(liar))  # the liar's agent must be progressed for its notice to leave
        if secret is None:
            assert _until(lambda: len(d.peers()) == 1, progress=both)
        else:
            assert _until(lambda: d.ignored_notices == 1, progress=both)
            assert len(d.peers()) == 2
            _exact(pr)
            # a replayed hello (rank 1's genuine signed metadata, sent by another agent) is
            # ignored too: the hello must come from the agent it describes
            agents = d.handles()["remote_agents"]
            other = make_agent("prefill#1#0bad", ("UCX",), False)
            other.add_remote_agent(d._agent.get_agent_metadata())
            other.send_notif(d.agent_name, _HELLO + pr.p[1].metadata())
            assert _until(lambda: d.ignored_notices == 2, progress=(d, _Raw(other)))
            assert d.handles()["remote_agents"] == agents
            other.remove_remote_agent(d.agent_name)
            del other
        liar.remove_remote_agent(d.agent_name)
        del liar


def test_progress_thread_option():
    """With NIXL's progress thread the target needs no progress calls of ours."""
    with pair(spec(1, attn(heads=4)), spec(1, attn(heads=4)), progress_thread=True) as pr:
        assert all(ep.progress_thread for ep in pr.endpoints)
        pr.connect("pull")
        d = pr.d[0]
        t = d.read(d.map("prefill").plan(SB, DB), "prefill", notify=b"done")
        t.wait(10)  # the target is never progressed by this test
        assert pr.check(SB, DB) > 0
        assert _until(lambda: any(n.message == b"done" for n in pr.p[0].notifications()))


def test_metadata_signing_is_pure_and_exact():
    with pair(SRC, DST, secret=KEY) as pr:
        info = md.decode(pr.p[1].metadata(), KEY)
        assert (info.engine, info.rank) == ("prefill", 1)
        assert md.nixl_agent_name(info.agent_metadata) == info.agent == pr.p[1].agent_name
        assert md.decode(md.encode(info, KEY), KEY) == info
        assert md.decode(md.encode(attrs.evolve(info))) == info  # unsigned round trip
