"""End-to-end: real NIXL transfers between engines of different layouts (issue 8).

vLLM cross-layer blocks (``BLHNC``) into per-layer ``LBHNC``, TensorRT-LLM's block-major pool
(``BLSHND``) into SGLang's separate K and V buffers (``LBNHD``, ``[k, v]``), and the legacy
``HND`` split into ``BHLNC``; pull and push, TP both ways. Every buffer is registered once;
each destination buffer must equal the independent oracle's expectation byte for byte.
"""

import numpy as np
import pytest

from kvplan import EngineSpec
from kvplan_nixl import Endpoint
from tests import oracle
from tests.nixl_util import ZERO, Pair, blocks


def model(tp: int, style: str, layers: int = 3) -> EngineSpec:
    regions = []
    for i in range(layers):
        r = {"name": f"layers.{i}.attn", "kind": "attention", "num_blocks": 16,
             "block_size": 16, "dtype": "bfloat16", "num_kv_heads": 4, "head_dim": 64}
        if style == "legacy":
            r.update(layout="HND", kv="split")
        elif style == "sglang":
            r.update(layout="LBNHD", allocation=[f"k.{i}", f"v.{i}"])
        else:
            r.update(layout="BLSHND" if style == "trt" else style, allocation="kv")
        regions.append(r)
    regions.append({"name": "draft.0.mla", "kind": "mla", "num_blocks": 16, "block_size": 16,
                    "dtype": "bfloat16", "dim": 96,
                    **({} if style in ("legacy", "sglang") else {"layout": "BLHNC"})})
    return EngineSpec.from_dict({"tp_size": tp, "regions": regions})


class BufferPair(Pair):
    """Pair whose endpoints get their buffers by buffer name (``spec.buffers``): an
    allocation, a K or V buffer, or a region's own; each is registered once."""

    def __init__(self, src: EngineSpec, dst: EngineSpec) -> None:
        self.src, self.dst = src, dst
        self.src_bufs = oracle.source_buffers(src.to_dict(), seed=3)
        self.dst_bufs = oracle.destination_buffers(dst.to_dict(), seed=4)
        self.before = {k: v.copy() for k, v in self.dst_bufs.items()}
        self.p, self.d = [], []
        try:
            for eps, engine, sp, bufs in ((self.p, "prefill", src, self.src_bufs),
                                          (self.d, "decode", dst, self.dst_bufs)):
                for r in range(sp.num_ranks):
                    mine = named(sp, r, bufs)
                    ep = Endpoint(engine, sp, r, mine)
                    assert ep.handles()["registrations"] == 1  # one call, every buffer once
                    eps.append(ep)
        except BaseException:
            self.close()
            raise

    def check(self, src_blocks, dst_blocks, plans=()) -> int:
        checked = 0
        sd, dd = self.src.to_dict(), self.dst.to_dict()
        for r in range(self.dst.num_ranks):
            expected, _ = oracle.expected_buffers(sd, dd, src_blocks, dst_blocks, r,
                                                  self.src_bufs, self.before)
            got = named(self.dst, r, self.dst_bufs)
            assert set(got) == set(expected)
            for name, exp in expected.items():
                bad = np.flatnonzero(got[name] != exp)
                assert bad.size == 0, f"decode rank {r} buffer {name}: {bad.size} bytes differ"
                checked += exp.size
        return checked


def named(spec: EngineSpec, rank: int, bufs: dict) -> dict:
    """The oracle's arrays of ``rank`` by buffer name (a region's key reaches its buffer)."""
    out = {}
    for b, name in enumerate(spec.buffers):
        if (rank, name) in bufs:
            out[name] = bufs[(rank, name)]
            continue
        held = [i for i in spec.buffer_regions(b) if (rank, i) in bufs]
        if held:
            out[name] = bufs[(rank, held[0])]
    return out


@pytest.mark.parametrize("src_style, dst_style, tps", [
    ("BLHNC", "LBHNC", (2, 4)),
    ("BLHNC", "LBHNC", (4, 2)),
    ("trt", "sglang", (2, 4)),
    ("sglang", "trt", (4, 2)),
    ("legacy", "BHLNC", (4, 2)),
    ("legacy", "BHLNC", (2, 4)),
])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_layouts_move_exactly_over_nixl(src_style, dst_style, tps, mode):
    src, dst = model(tps[0], src_style), model(tps[1], dst_style)
    rng = np.random.default_rng(7)
    src_blocks, dst_blocks = blocks(rng, src, 5), blocks(rng, dst, 5)
    pr = BufferPair(src, dst)
    try:
        pr.connect(mode)
        posted = pr.run(mode, src_blocks, dst_blocks)
        assert all(t.done for t in posted)
        assert pr.check(src_blocks, dst_blocks) > 0
        # the separate V buffers were written too (not only K): compare with the sentinel
        for r in range(dst.num_ranks):
            for name, arr in named(dst, r, pr.dst_bufs).items():
                assert not np.array_equal(arr, named(dst, r, pr.before)[name]), name
    finally:
        pr.close()
    for ep in pr.endpoints:
        assert ep.handles() == ZERO, ep.handles()


def test_k_and_v_buffers_are_given_by_name():
    from kvplan_nixl.errors import BufferSizeError

    s = model(2, "sglang", layers=1)
    bufs = named(s, 0, oracle.destination_buffers(s.to_dict()))
    with pytest.raises(BufferSizeError, match=r"region 'layers.0.attn' keeps K and V in two "
                                              r"buffers; give them by their names 'k.0' and 'v.0'"):
        Endpoint("x", s, 0, {"layers.0.attn": bufs["k.0"], "draft.0.mla": bufs["draft.0.mla"]})
    with pytest.raises(BufferSizeError, match=r"no buffer for V buffer 'v.0'"):
        Endpoint("x", s, 0, {"k.0": bufs["k.0"], "draft.0.mla": bufs["draft.0.mla"]})
    ep = Endpoint("x", s, 0, [bufs["k.0"], bufs["v.0"], bufs["draft.0.mla"]])  # spec order
    ep.close()


def test_metadata_carries_v_bases_and_refuses_their_absence():
    import attrs

    from kvplan_nixl import MetadataError
    from kvplan_nixl import metadata as md

    s = model(2, "sglang", layers=2)
    n = len(s.regions)
    info = md.PeerInfo(
        engine="decode", rank=1, agent="decode#1#abc", spec=s, mem_type="DRAM",
        bases=tuple((i + 1) << 24 for i in range(n)),  # apart: overlapping buffers are refused
        nbytes=tuple(s.rank_region_nbytes(i) for i in range(n)), devices=(0,) * n,
        agent_metadata=b"nixl", v_bases=(1 << 30, 2 << 30, 0),
    )
    assert md.decode(md.encode(info)) == info
    with pytest.raises(MetadataError, match=r"regions \['layers.0.attn', 'layers.1.attn'\] keep "
                                            r"K and V in separate buffers, but the metadata "
                                            r"carries no V buffer base"):
        md.decode(md.encode(attrs.evolve(info, v_bases=())))
