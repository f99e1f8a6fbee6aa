"""Direct and staged transfers between endpoints whose buffers are torch tensors, on the CPU
and, where a GPU is present, on CUDA (kvplan_nixl with ``mem_type`` VRAM).

The same engines and requests as the numpy-buffer tests, with every engine buffer a tensor on
``device`` (regions of one pool share one tensor, as they share one array in the oracle).
After each transfer the destination tensors are copied to the host and checked byte for byte
against ``kvplan.simulate`` and the independent oracle (``Pair.check``), and no slot, NIXL
transfer or request may be left on any side. On a machine without CUDA the ``cuda`` cases skip
with the reason; they are the device check a session with a GPU runs first
(``benchmarks/device_check.sh``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.nixl_util import Pair, attn, blocks, mla, spec
from tests.test_nixl_staged import staged_pair

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device on this machine (torch sees none)")),
]

SRC = spec(4, attn(heads=8, nb=64), mla(nb=64))  # P TP4 -> D TP2: heterogeneous heads
DST = spec(2, attn(heads=8, nb=64), mla(nb=64))


class TensorPair(Pair):
    """``Pair`` with each endpoint's buffers as tensors on ``device``; ``sync()`` copies the
    destination tensors back into the host arrays ``Pair.check`` reads."""

    def __init__(self, src, dst, *, device: str, **kw) -> None:
        self.device = device
        self._tensors: dict[int, torch.Tensor] = {}  # id(host array) -> its device tensor
        super().__init__(src, dst, **kw)

    def _buffer(self, arr: np.ndarray) -> torch.Tensor:
        t = self._tensors.get(id(arr))
        if t is None:  # a pool's regions share one array: give them one tensor too
            t = self._tensors[id(arr)] = torch.from_numpy(arr.copy()).to(self.device)
        return t

    def sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for arr in {id(a): a for a in self.dst_bufs.values()}.values():
            arr[...] = self._tensors[id(arr)].cpu().numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("how", ["direct", "staged"])
def test_tensor_buffers_move_exact_bytes(device, mode, how):
    rng = np.random.default_rng(21)
    sb, db = blocks(rng, SRC, 40), blocks(rng, DST, 40)
    with staged_pair(SRC, DST, cls=TensorPair, device=device) as pr:
        for ep in pr.endpoints:
            assert ep.mem_type == ("VRAM" if device == "cuda" else "DRAM")
        initiators = pr.d if mode == "pull" else pr.p
        remote = "prefill" if mode == "pull" else "decode"
        others = list(pr.stagers.values()) if how == "staged" else (
            pr.p if mode == "pull" else pr.d)
        plans, posted = [], []
        for ep in initiators:
            plan = ep.map(remote, mode).plan(sb, db)
            plans.append(plan)
            if how == "staged":
                st = pr.stagers[ep]
                posted.append((st.read if mode == "pull" else st.write)(plan, remote))
            else:
                posted.append((ep.read if mode == "pull" else ep.write)(plan, remote))
        for t in posted:
            t.wait(60, progress=others)
        if how == "staged":
            assert sum(t.descriptors for t in posted) < sum(len(p) for p in plans)
        pr.sync()
        assert pr.check(sb, db, plans=plans) > 0
