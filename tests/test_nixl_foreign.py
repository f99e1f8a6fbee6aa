"""``Endpoint.connect_foreign``: peers run by another connector, played by bare NIXL agents
(what a vLLM NixlConnector prefill is to NIXL: an agent with registered memory, reading its
notifications as raw bytes). Real agents, UCX over loopback: the reads land byte for byte as
the oracle says, every message reaches the foreign agent exactly as given even under a
secret, and it is sent nothing else: no hello on connect, no close notice on close."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvplan_nixl import BufferSizeError, Endpoint, MetadataError
from kvplan_nixl._nixl import make_agent
from tests import oracle
from tests.nixl_util import attn, blocks, spec


class Bare:
    """One rank of a foreign engine: a NIXL agent with one registered buffer, progressed (and
    its notifications collected, as bytes) by ``progress``."""

    def __init__(self, name: str, buf: np.ndarray) -> None:
        self.buf = buf
        self.agent = make_agent(name, ("UCX",), False)
        self.descs = self.agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        self.agent.register_memory(self.descs)
        self.got: list[bytes] = []

    def progress(self) -> int:
        for msgs in self.agent.get_new_notifs().values():
            self.got += [bytes(m) for m in msgs]
        return 0

    def close(self) -> None:
        self.agent.deregister_memory(self.descs)


def drain(bares: list[Bare], want: int, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while sum(len(b.got) for b in bares) < want and time.monotonic() < end:
        for b in bares:
            b.progress()
        time.sleep(1e-3)


@pytest.fixture
def stock():
    """A 2-rank foreign prefill (4 KV heads split) and its source buffers."""
    src = spec(2, attn(heads=4))
    bufs = oracle.source_buffers(src.to_dict(), seed=3)
    bares = [Bare(f"stock-agent-{r}", bufs[(r, 0)]) for r in range(2)]
    yield src, bufs, bares
    for b in bares:
        b.close()


def test_reads_from_a_foreign_prefill_are_exact_and_its_messages_unsealed(stock):
    src, src_bufs, bares = stock
    dst = spec(1, attn(heads=4))
    dst_bufs = oracle.destination_buffers(dst.to_dict(), seed=4)
    before = {k: v.copy() for k, v in dst_bufs.items()}
    rng = np.random.default_rng(0)
    sb, db = blocks(rng, src, 5), blocks(rng, dst, 5)
    with Endpoint("decode", dst, 0, {"layers.0.attn": dst_bufs[(0, 0)]},
                  secret="deployment") as ep:
        for r, b in enumerate(bares):
            peer = ep.connect_foreign("stock", r, src, {"layers.0.attn": (
                b.buf.ctypes.data, b.buf.nbytes)}, b.agent.get_agent_metadata())
            assert (peer.engine, peer.rank, peer.agent) == ("stock", r, f"stock-agent-{r}")
        drain(bares, 1, timeout=0.3)
        assert [b.got for b in bares] == [[], []]  # no hello
        plan = ep.map("stock").plan(sb, db)
        assert plan.peers == (0, 1)
        ep.read(plan, "stock", notify=b"req-7:1").wait(30, progress=bares)
        drain(bares, 2)
        assert [b.got for b in bares] == [[b"req-7:1"], [b"req-7:1"]]  # as given, unsealed
        ep.notify("stock", [0, 1], b"HB:req-7,req-8")
        drain(bares, 4)
        assert [b.got for b in bares] == [[b"req-7:1", b"HB:req-7,req-8"]] * 2
        assert ep.handles()["remote_agents"] == 2
    exp, _ = oracle.expected_destination(src.to_dict(), dst.to_dict(), sb, db, 0, src_bufs,
                                         before)
    assert np.array_equal(dst_bufs[(0, 0)], exp[0])
    assert not np.array_equal(dst_bufs[(0, 0)], before[(0, 0)])
    drain(bares, 5, timeout=0.5)
    assert [len(b.got) for b in bares] == [2, 2]  # closed: no close notice to either


def test_a_foreign_peer_is_refused_by_name_before_nixl_loads_it(stock):
    src, _, bares = stock
    b = bares[0]
    whole = {"layers.0.attn": (b.buf.ctypes.data, b.buf.nbytes)}
    with Endpoint("decode", spec(1, attn(heads=4)), 0,
                  {"layers.0.attn": np.zeros(spec(1, attn(heads=4)).rank_buffer_nbytes(0),
                                             np.uint8)}) as ep:
        with pytest.raises(MetadataError, match="'stock' rank 0: agent_metadata is not NIXL"):
            ep.connect_foreign("stock", 0, src, whole, b"not nixl")
        with pytest.raises(BufferSizeError):
            ep.connect_foreign("stock", 0, src, {"layers.0.attn": (b.buf.ctypes.data, 64)},
                               b.agent.get_agent_metadata())
        with pytest.raises(Exception, match="rank 2 is not in"):
            ep.connect_foreign("stock", 2, src, whole, b.agent.get_agent_metadata())
        assert ep.peers() == () and ep.handles()["remote_agents"] == 0
