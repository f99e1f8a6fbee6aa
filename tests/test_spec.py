"""EngineSpec / RegionSpec: the JSON form, defaults, and every refusal of a malformed spec."""

import pytest

from kvplan import EngineSpec, Kind, RegionSpec, SpecError

ISSUE_EXAMPLE = {
    "tp_size": 4,
    "regions": [
        {"name": "layers.0.attn", "kind": "attention", "group": 0, "num_blocks": 1024,
         "block_size": 16, "dtype": "bfloat16", "num_kv_heads": 8, "head_dim": 128,
         "layout": "HND", "kv": "split", "window": None},
        {"name": "draft.0.mla", "kind": "mla", "group": 0, "num_blocks": 1024,
         "block_size": 16, "dtype": "bfloat16", "dim": 576},
        {"name": "layers.0.indexer", "kind": "indexer", "group": 0, "num_blocks": 1024,
         "block_size": 16, "dtype": "uint8", "dim": 132},
    ],
}


def test_round_trip_of_the_documented_form():
    spec = EngineSpec.from_dict(ISSUE_EXAMPLE)
    assert spec.to_dict() == ISSUE_EXAMPLE
    assert EngineSpec.from_dict(spec.to_dict()) == spec
    assert spec.regions[1].kind is Kind.MLA


def test_defaults_are_filled_in():
    r = RegionSpec.from_dict({"name": "a", "kind": "attention", "num_blocks": 4,
                              "block_size": 16, "dtype": "float16", "num_kv_heads": 2,
                              "head_dim": 64})
    d = r.to_dict()
    assert (d["group"], d["layout"], d["kv"], d["window"]) == (0, "HND", "split", None)


def test_per_rank_bytes():
    spec = EngineSpec.from_dict(ISSUE_EXAMPLE)
    # 2 streams x 16 tokens x 2 heads (8 over tp 4) x 128 x 2 B
    assert spec.rank_block_nbytes(0) == 2 * 16 * 2 * 128 * 2
    assert spec.rank_region_nbytes(0) == 1024 * 16384
    assert spec.rank_block_nbytes(1) == 16 * 576 * 2  # MLA: whole latent on every rank
    assert spec.rank_block_nbytes(2) == 16 * 132


def test_replicated_heads_take_one_head_per_rank():
    d = {"tp_size": 8, "regions": [dict(ISSUE_EXAMPLE["regions"][0], num_kv_heads=2)]}
    assert EngineSpec.from_dict(d).rank_block_nbytes(0) == 2 * 16 * 1 * 128 * 2


def _attn(**kw):
    base = dict(ISSUE_EXAMPLE["regions"][0])
    base.update(kw)
    return {"tp_size": 4, "regions": [base]}


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (_attn(num_kv_heads=6), ["layers.0.attn", "num_kv_heads 6", "tp_size 4"]),
        (_attn(dtype="float64"), ["layers.0.attn", "float64"]),
        (_attn(kind="ssm"), ["layers.0.attn", "'ssm'"]),
        (_attn(layout="HDN"), ["layers.0.attn", "'HDN'"]),
        (_attn(kv="both"), ["layers.0.attn", "'both'"]),
        (_attn(block_size=0), ["layers.0.attn", "block_size", "0"]),
        (_attn(num_blocks=-1), ["layers.0.attn", "num_blocks", "-1"]),
        (_attn(head_dim=True), ["layers.0.attn", "head_dim"]),
        (_attn(window=0), ["layers.0.attn", "window"]),
        (_attn(dim=576), ["layers.0.attn", "dim"]),
        (_attn(group=1), ["group ids", "[1]"]),
        (_attn(colour="red"), ["layers.0.attn", "colour"]),
        ({"tp_size": 0, "regions": ISSUE_EXAMPLE["regions"]}, ["tp_size", "0"]),
        ({"tp_size": 2, "regions": []}, ["at least one region"]),
        ({"tp_size": 2}, ["regions"]),
        ({"tp_size": 2, "regions": ISSUE_EXAMPLE["regions"] * 2}, ["'layers.0.attn'", "twice"]),
        ({"tp_size": 2, "regions": [{"name": "m", "kind": "mla", "num_blocks": 4,
                                     "block_size": 16, "dtype": "bfloat16"}]}, ["'m'", "dim"]),
        ({"tp_size": 2, "regions": [{"name": "m", "kind": "mla", "num_blocks": 4,
                                     "block_size": 16, "dtype": "bfloat16", "dim": 8,
                                     "num_kv_heads": 2}]}, ["'m'", "num_kv_heads"]),
    ],
)
def test_malformed_specs_are_refused_with_the_region_and_numbers(spec, words):
    with pytest.raises(SpecError) as e:
        EngineSpec.from_dict(spec)
    for w in words:
        assert w in str(e.value)
    assert isinstance(e.value, ValueError)


def test_specs_are_frozen_values():
    spec = EngineSpec.from_dict(ISSUE_EXAMPLE)
    with pytest.raises(AttributeError):
        spec.tp_size = 8
    assert spec == EngineSpec.from_dict(ISSUE_EXAMPLE)
    assert hash(spec) == hash(EngineSpec.from_dict(ISSUE_EXAMPLE))
    assert "layers.0.attn" in str(spec) and "RegionSpec(" in repr(spec)


def test_rank_buffer_nbytes_takes_a_buffer_name_or_its_index():
    """The docs pass the names of ``spec.buffers``; an index (numpy's too) works as well, and
    anything else is a SpecError listing the valid names (not a raw TypeError)."""
    import numpy as np

    from kvplan import presets

    spec = presets.spec("llama-3.1-70b", 8)
    for b, name in enumerate(spec.buffers):
        assert spec.rank_buffer_nbytes(name) == spec.rank_buffer_nbytes(b)
        assert spec.rank_buffer_nbytes(np.int64(b)) == spec.rank_buffer_nbytes(b)
    assert spec.rank_buffer_nbytes("layers.0.attn") == 2 * 1024 * 16 * 128 * 2  # K+V, 1 head
    for bad in ("layers.80.attn", len(spec.buffers), -1, True, 1.0, None):
        with pytest.raises(SpecError, match=r"'layers\.0\.attn', 'layers\.1\.attn'") as info:
            spec.rank_buffer_nbytes(bad)
        assert "(80 in all)" in str(info.value) and len(str(info.value)) < 300


def _one_stream(name, stream, head_dim, **extra):
    return {"name": name, "kind": "attention", "num_blocks": 6, "block_size": 4,
            "dtype": "bfloat16", "num_kv_heads": 4, "head_dim": head_dim,
            "layout": "LBNHD", "stream": stream, **extra}


def test_an_attention_region_may_hold_k_or_v_alone():
    # K heads of 12 values and V heads of 8 (MiMo-V2's 192 / 128): two one-stream regions
    spec = EngineSpec.from_dict({"tp_size": 2, "regions": [
        _one_stream("l0.k", "k", 12), _one_stream("l0.v", "v", 8)]})
    k, v = spec.regions
    assert (k.streams, v.streams) == (1, 1)
    assert EngineSpec.from_dict(spec.to_dict()) == spec and spec.to_dict()["regions"][1][
        "stream"] == "v"
    # a rank's buffer: 6 blocks x 4 tokens x 2 local heads x head size x 2 bytes, one stream
    assert [spec.rank_buffer_nbytes(b) for b in spec.buffers] == [6 * 4 * 2 * 12 * 2,
                                                                  6 * 4 * 2 * 8 * 2]
    assert "stream" not in EngineSpec.from_dict(ISSUE_EXAMPLE).to_dict()["regions"][0]


@pytest.mark.parametrize("region, words", [
    (_one_stream("a", "kv", 8), "stream 'kv' is not one of 'k', 'v'"),
    (_one_stream("a", "k", 8, allocation=["x", "y"]), "holds one stream ('k')"),
    ({**_one_stream("a", "k", 8), "stream": None}, "has no S axis"),
    ({"name": "a", "kind": "mla", "num_blocks": 4, "block_size": 4, "dtype": "bfloat16",
      "dim": 8, "stream": "k"}, "unknown field"),
])
def test_a_stream_that_cannot_be_is_refused(region, words):
    with pytest.raises(SpecError, match=words.replace("(", r"\(").replace(")", r"\)")):
        RegionSpec.from_dict(region)


def test_k_alone_does_not_pair_with_v_alone():
    from kvplan import IncompatibleLayoutError, pull_map

    a = EngineSpec.from_dict({"tp_size": 1, "regions": [_one_stream("l0", "k", 8)]})
    b = EngineSpec.from_dict({"tp_size": 1, "regions": [_one_stream("l0", "v", 8)]})
    with pytest.raises(IncompatibleLayoutError, match=r"stream \(K or V alone\) differs"):
        pull_map(a, b, 0)
