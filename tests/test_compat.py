"""Every handshake refusal: type, and a message naming the region and the numbers."""

import pytest

from kvplan import EngineSpec, IncompatibleLayoutError, SpecError, pull_map, push_map


def attn(name="layers.0.attn", **kw):
    r = {"name": name, "kind": "attention", "num_blocks": 8, "block_size": 16,
         "dtype": "bfloat16", "num_kv_heads": 8, "head_dim": 128}
    r.update(kw)
    return r


def mla(name="draft.0.mla", **kw):
    r = {"name": name, "kind": "mla", "num_blocks": 8, "block_size": 16, "dtype": "bfloat16",
         "dim": 576}
    r.update(kw)
    return r


def engine(tp, *regions):
    return EngineSpec.from_dict({"tp_size": tp, "regions": list(regions)})


@pytest.mark.parametrize(
    ("src", "dst", "words"),
    [
        (engine(4, attn()), engine(6, attn(num_kv_heads=12)), ["TP sizes", "4", "6"]),
        (engine(2, attn(), mla()), engine(2, attn()), ["region names", "draft.0.mla"]),
        (engine(2, attn()), engine(2, attn("layers.1.attn")), ["layers.0.attn", "layers.1.attn"]),
        (engine(2, attn(dtype="bfloat16")), engine(2, attn(dtype="float8_e4m3fn")),
         ["layers.0.attn", "dtype", "bfloat16", "float8_e4m3fn"]),
        (engine(2, attn(head_dim=128)), engine(2, attn(head_dim=64)),
         ["layers.0.attn", "head_dim", "128", "64"]),
        (engine(2, attn(num_kv_heads=8)), engine(2, attn(num_kv_heads=4)),
         ["layers.0.attn", "num_kv_heads", "8", "4"]),
        (engine(2, mla(dim=576)), engine(2, mla(dim=512)), ["draft.0.mla", "dim", "576", "512"]),
        (engine(2, attn(window=128)), engine(2, attn(window=256)),
         ["layers.0.attn", "window", "128", "256"]),
        (engine(2, attn("x")), engine(2, mla("x")), ["'x'", "kind", "attention", "mla"]),
    ],
)
def test_refusals_name_the_region_and_numbers(src, dst, words):
    for make in (lambda: pull_map(src, dst, 0), lambda: push_map(src, dst, 0)):
        with pytest.raises(IncompatibleLayoutError) as e:
            make()
        assert isinstance(e.value, ValueError)
        for w in words:
            assert w in str(e.value), (w, str(e.value))


def test_block_sizes_and_groups_need_not_match():
    """Sizes plan by their gcd (tests/test_granules.py), groups per side (tests/test_regroup.py)."""
    pull_map(engine(2, attn(block_size=16)), engine(2, attn(block_size=24)), 0)
    pull_map(engine(2, attn(), attn("b", group=1)), engine(2, attn(group=1), attn("b")), 1)


def test_every_layout_pair_is_accepted():
    for a in ("HND", "NHD"):
        for b in ("HND", "NHD"):
            for ka in ("split", "joint"):
                for kb in ("split", "joint"):
                    pull_map(engine(2, attn(layout=a, kv=ka)), engine(4, attn(layout=b, kv=kb)), 3)


def test_rank_out_of_range():
    s = engine(2, attn())
    with pytest.raises(SpecError, match=r"destination rank 2 is not in \[0, 2\)"):
        pull_map(s, s, 2)
    with pytest.raises(SpecError, match=r"source rank -1"):
        push_map(s, s, -1)


def test_differing_region_names_are_named_compactly():
    """Two different models: the refusal names the regions as families
    (``layers.[0-60].mla x61``), not a list of 141 names sorted as text."""
    from kvplan import presets

    a = presets.spec("deepseek-v3.2", tp_size=1, num_blocks=8)
    b = presets.spec("llama-3.1-8b", tp_size=1, num_blocks=8)
    with pytest.raises(IncompatibleLayoutError) as err:
        pull_map(a, b, 0)
    msg = str(err.value)
    assert ("only on source: layers.[0-60].mla x61, layers.[0-60].indexer x61; "
            "only on destination: layers.[0-31].attn x32") in msg
    assert len(msg) < 250


def test_compact_names_keep_every_family_and_odd_names():
    from kvplan.names import compact_names

    names = ["layers.0.attn", "layers.2.attn", "layers.1.attn", "lm_head", "draft.0.attn"]
    assert compact_names(names) == "layers.[0-2].attn x3, lm_head, draft.0.attn"
    assert compact_names([]) == ""
