"""Malformed spec and request input: each a typed error naming the field, region or group.

The limits (``kvplan.spec.MAX_*``) keep every byte offset a plan computes inside int64 and make
a forged spec cheap to refuse; each test checks the refusal and that it is quick.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from kvplan import EngineSpec, RequestError, SpecError, pull_map
from kvplan import spec as kspec
from kvplan.hf import from_hf_config


def attn(name="layers.0.attn", *, heads=4, dim=64, nb=32, bs=16, kv="split", group=0,
         dtype="bfloat16") -> dict:
    return {"name": name, "kind": "attention", "group": group, "num_blocks": nb,
            "block_size": bs, "dtype": dtype, "num_kv_heads": heads, "head_dim": dim,
            "layout": "HND", "kv": kv, "window": None}


def mla(name="draft.0.mla", *, group=0) -> dict:
    return {"name": name, "kind": "mla", "group": group, "num_blocks": 32, "block_size": 16,
            "dtype": "bfloat16", "dim": 576}


def _spec(tp: int, *regions: dict, **kw) -> EngineSpec:
    return EngineSpec.from_dict({"tp_size": tp, "regions": list(regions), **kw})


def _pooled(name: str, group: int, page: int) -> dict:
    return {**attn(name, kv="joint", group=group), "pool": "p", "page_bytes": page}


@pytest.mark.parametrize(
    ("make", "msg"),
    [
        (lambda: _spec(1, attn(dtype=["bfloat16"])), r"'layers\.0\.attn': dtype \['bfloat16'\]"),
        (lambda: _spec(1, attn(group=None), mla(group=None)), r"group must be an integer >= 0, "
                                                            "got None"),
        (lambda: _spec(1, attn(), {"name": "s", "kind": "state", "num_blocks": 4, "group": None,
                                   "dtype": "bfloat16",
                                   "parts": [{"name": "x", "units": 1, "unit_bytes": 8}]}),
         r"region 's': group must be an integer >= 0, got None"),
        (lambda: _spec(1, attn(nb=2**62)), r"'layers\.0\.attn': \d+ bytes on a rank .* exceed "
                                           r"the limit 2305843009213693952 \(2\*\*61\)"),
        (lambda: _spec(1, attn(nb=2**52, heads=16, dim=16)), "byte offsets must fit in int64"),
        (lambda: _spec(1, attn(bs=2**40)), "block_size 1099511627776 exceeds the limit 65536"),
        (lambda: _spec(1, attn(heads=2**40)), r"pieces, over the limit 1048576"),
        (lambda: _spec(2**40, attn(heads=2**40)), "tp_size 1099511627776 exceeds the limit 256"),
        (lambda: _spec(1, attn(), pp_size=10**30), "pp_size 10+ exceeds the limit 256"),
        (lambda: _spec(1, _pooled("a", 0, 1 << 20), _pooled("b", 1, 1 << 21)),
         r"pool 'p': its regions give different page_bytes \[1048576, 2097152\]"),
        (lambda: _spec(1, {**attn(), "stage": "0"}), "stage must be an integer"),
        (lambda: _spec(True, attn()), "tp_size must be a positive integer, got True"),
        (lambda: _spec(1, *[attn(f"l{i}") for i in range(kspec.MAX_REGIONS + 1)]),
         "1025 regions exceed the limit 1024"),
    ],
)
def test_bad_spec_is_a_typed_error(make, msg):
    t = time.perf_counter()
    with pytest.raises(SpecError, match=msg):
        make()
    assert time.perf_counter() - t < 0.5  # refused cheaply, whatever the numbers


def test_limits_accept_the_largest_allowed_values():
    s = _spec(kspec.MAX_TP_SIZE, attn(heads=8, bs=16, nb=4))
    assert s.tp_size == kspec.MAX_TP_SIZE
    # the largest allocation allowed still plans offsets that fit in int64
    nb = kspec.MAX_ALLOCATION_BYTES // s.rank_block_nbytes(0) // 2  # split: K and V halves
    big = _spec(1, attn(heads=1, dim=64, bs=16, nb=nb))
    assert big.rank_region_nbytes(0) <= kspec.MAX_ALLOCATION_BYTES
    plan = pull_map(big, big, 0).plan([[nb - 1]], [[nb - 1]])
    rows = plan.copies()
    assert (rows["dst_offset"] >= 0).all()
    assert int(rows["dst_offset"].max() + rows["length"][rows["dst_offset"].argmax()]) \
        <= big.rank_region_nbytes(0)


M = pull_map(_spec(1, attn()), _spec(1, attn()), 0)


@pytest.mark.parametrize(
    ("src", "msg"),
    [
        ([[[1], [1, 2]]], r"source group 0: block ids must be a flat sequence of integers"),
        ([[1.5]], "dtype float64"),
        ([[None]], "dtype object"),
        ([[2**70]], "dtype object"),
        ([["1"]], "must be a flat sequence"),
        ([{1, 2}], "got set"),
        (["12"], "got str"),
        ([{0: 1}], "got dict"),
        ([np.array([2**64 - 1], dtype=np.uint64)], r"block id 18446744073709551615 at position 0 "
                                                   r"is out of range \[0, 32\)"),
        (None, "expected one sequence per group"),
        ([[1], [2]], "2 lists for 1 KV-cache group"),
    ],
)
def test_bad_request_is_a_typed_error(src, msg):
    with pytest.raises(RequestError, match=msg):
        M.plan(src, [[1, 2]])


def test_deeply_nested_ids_are_a_request_error():
    deep: list = [1]
    for _ in range(10_000):
        deep = [deep]
    with pytest.raises(RequestError, match="source group 0"):
        M.plan([deep], [[1]])


def test_config_file_not_utf8_or_too_deep_is_a_spec_error(tmp_path):
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"model_type": "llama\xe9"}')
    with pytest.raises(SpecError, match="is not UTF-8 text"):
        from_hf_config(str(bad), tp_size=1)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SpecError, match="is not readable JSON"):
        from_hf_config(str(deep), tp_size=1)
    assert json.loads(json.dumps({"ok": 1}))  # (json itself is fine)
