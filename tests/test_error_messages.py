"""Errors a person reads stay short and start with what to do: a buffer mistake on an 80-layer
engine names the fix first and lists a few buffers, saying how many more (it used to list all
80 regions before the useful part, 1,578 characters)."""

from __future__ import annotations

import numpy as np
import pytest

from kvplan import presets
from kvplan_nixl.buffers import resolve_buffers
from kvplan_nixl.errors import BufferSizeError


def _refusal(spec, buffers) -> str:
    with pytest.raises(BufferSizeError) as info:
        resolve_buffers(spec, 0, buffers)
    return str(info.value)


@pytest.mark.parametrize("layout", ["HND", "LBHNC"])
def test_buffer_errors_of_an_80_layer_engine_are_short_and_lead_with_the_fix(layout):
    spec = presets.spec("llama-3.1-70b", 8, num_blocks=4, layout=layout)
    n = len(spec.buffers)
    bufs = {name: np.zeros(spec.rank_buffer_nbytes(b), np.uint8)
            for b, name in enumerate(spec.buffers)}
    wrong_count = _refusal(spec, list(bufs.values())[:-1])
    if n > 1:
        assert wrong_count.startswith(f"{n - 1} buffers for rank 0, which holds {n} "
                                      "allocation(s): pass them in spec order")
        assert f"and {n - 4} more" in wrong_count
    unknown = _refusal(spec, {**bufs, "nope": bufs[spec.buffers[0]]})
    assert unknown.startswith("buffers: 'nope' is neither a region nor a pool nor a buffer")
    missing = _refusal(spec, dict(list(bufs.items())[1:])) if n > 1 else None
    if missing:
        assert missing.startswith("buffers: rank 0 has no buffer for region 'layers.0.attn'")
    wrong_size = _refusal(spec, {**bufs, spec.buffers[0]: np.zeros(3, np.uint8)})
    assert "buffer has 3 bytes, the spec implies" in wrong_size
    if n == 1:  # one allocation of 80 layer slots: its regions in one label, not 80 names
        assert "allocation 'kv.0' (regions layers.[0-79].attn x80)" in wrong_size
    for msg in filter(None, (wrong_count, unknown, missing, wrong_size)):
        assert "\n" not in msg and len(msg) < 400, (len(msg), msg)
