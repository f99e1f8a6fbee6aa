"""Notebook views: HTML tables per peer rank, pandas frames, and the rank-map picture."""

import io
import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

import kvplan
from kvplan import presets, views
from kvplan.examples import gqa_with_mla_draft, nemotron_h_like

pytest.importorskip("matplotlib")
import matplotlib

matplotlib.use("Agg")


def _ids(spec, tokens=256):
    out = []
    for g in range(spec.num_groups):
        regions = [r for r in spec.regions if r.group == g]
        if regions[0].is_state:
            out.append([2])
        else:
            n = -(-tokens // max(r.block_size for r in regions))
            out.append(list(range(0, 2 * n, 2)))
    return out


def _plans(src, dst, tokens=256, mode="pull"):
    if mode == "pull":
        maps = [kvplan.pull_map(src, dst, d) for d in range(dst.num_ranks)]
    else:
        maps = [kvplan.push_map(src, dst, s) for s in range(src.num_ranks)]
    return [m.plan(_ids(src, tokens), _ids(dst, tokens)) for m in maps]


def _edges_from_copies(plans):
    acc = Counter()
    runs = Counter()
    for p in plans:
        for row in p.copies():
            key = (int(row["src_rank"]), int(row["dst_rank"]))
            acc[key] += int(row["length"])
            runs[key] += 1
    return acc, runs


@pytest.mark.parametrize("tps", [(8, 2), (2, 8), (4, 4)])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_rank_map_edges_equal_the_plans(tps, mode):
    src, dst = (gqa_with_mla_draft(t, num_blocks=64) for t in tps)
    plans = _plans(src, dst, mode=mode)
    edges = views.rank_map(plans)
    nbytes, runs = _edges_from_copies(plans)
    assert {(e.src_rank, e.dst_rank): e.nbytes for e in edges} == dict(nbytes)
    assert {(e.src_rank, e.dst_rank): e.runs for e in edges} == dict(runs)
    for e in edges:
        assert sum(f.nbytes for f in e.flows) == e.nbytes


def test_rank_map_of_tp8_to_tp2_reads_each_head_once_and_the_latent_from_one_rank():
    src, dst = gqa_with_mla_draft(8, num_blocks=64), gqa_with_mla_draft(2, num_blocks=64)
    edges = views.rank_map(_plans(src, dst))
    assert [(e.src_rank, e.dst_rank) for e in edges] == [(p, p // 4) for p in range(8)]
    labels = {(e.src_rank, e.dst_rank): [f.label for f in e.flows] for e in edges}
    assert labels[(0, 0)] == ["S(heads 0:1)", "MLA R"] and labels[(1, 0)] == ["S(heads 1:2)"]
    assert labels[(4, 1)] == ["S(heads 4:5)", "MLA R"]


def test_rank_map_of_a_map_is_per_destination_block():
    src, dst = gqa_with_mla_draft(2), gqa_with_mla_draft(4)
    m = kvplan.pull_map(src, dst, 1)
    (edge,) = views.rank_map(m)
    per_block = sum(int(lane.templates[0].length.sum()) for lane in m.lanes)
    assert (edge.src_rank, edge.dst_rank, edge.nbytes) == (0, 1, per_block)


def test_state_flows_show_the_slice_of_every_part():
    src, dst = nemotron_h_like(2), nemotron_h_like(4)
    edges = views.rank_map(_plans(src, dst, tokens=64))
    state = {(e.src_rank, e.dst_rank): f.label for e in edges for f in e.flows
             if f.kind == "state"}
    # the same notation as the text outputs (summary, explain), not a picture-only one
    assert state[(0, 1)] == "S(x 2048:4096, B 2:4, C 2:4, ssm 32:64)"
    assert state[(1, 3)] == "S(x 6144:8192, B 6:8, C 6:8, ssm 96:128)"
    plan = kvplan.pull_map(src, dst, 1).plan(_ids(src, 64), _ids(dst, 64))
    assert f": {state[(0, 1)]} parts x+B+C+ssm" in plan.summary()


def _png(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=60)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


@pytest.mark.parametrize("tps", [(8, 2), (2, 8)])
def test_plot_draws_the_rank_map(tps):
    src, dst = (gqa_with_mla_draft(t, num_blocks=64) for t in tps)
    plans = _plans(src, dst)
    fig = kvplan.plot_rank_map(plans)
    texts = [t.get_text() for t in fig.axes[0].texts]
    flat = [" ".join(t.replace("\u00a0", " ").split()) for t in texts]  # labels wrap
    for e in views.rank_map(plans):  # every edge is labelled with its flows and bytes
        assert any(all(f.label in t for f in e.flows) and views.human_bytes(e.flows[0].nbytes)
                   in t for t in flat)
    assert sum(bool(re.match(r"p\d+\n", t)) for t in texts) == tps[0]  # nodes: "p3\nh3:4"
    assert sum(bool(re.match(r"d\d+\n", t)) for t in texts) == tps[1]
    assert f"prefill\nTP{tps[0]}" in texts
    assert _png(fig)[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_and_map_plot_methods_return_figures():
    src, dst = gqa_with_mla_draft(4, num_blocks=64), gqa_with_mla_draft(2, num_blocks=64)
    m = kvplan.pull_map(src, dst, 0)
    assert _png(m.plot())[:4] == b"\x89PNG"
    assert _png(m.plan(_ids(src), _ids(dst)).plot())[:4] == b"\x89PNG"


def test_spec_html_collapses_layers_alike():
    spec = presets.spec("gemma-3-27b", 4)
    page = spec._repr_html_()
    assert page.count("<table") == 1
    assert "layers.[0-4,6-10,12-16,…,60-61].attn x52" in page
    assert "layers.[5,11,17,…,59].attn x10" in page
    assert page.count("<tr>") == 3  # header and two rows, not 62


def test_map_and_plan_html_have_a_table_per_peer_rank():
    src, dst = presets.spec("llama-3.1-70b", 8), presets.spec("llama-3.1-70b", 2)
    m = kvplan.pull_map(src, dst, 1)
    page = m._repr_html_()
    assert page.count("<table") == 4 and "<caption>p4</caption>" in page
    assert "layers.[0-79].attn x80" in page and "S(heads 4:5)" in page
    plan = m.plan([list(range(0, 64, 2))], [list(range(0, 64, 2))])
    page = plan._repr_html_()
    assert page.count("<table") == 4
    assert f"{views.human_bytes(plan.nbytes)} in {len(plan)} runs" in page
    for peer in plan.peers:
        assert f"<caption>p{peer}: " in page


def test_plan_to_pandas_is_the_copies_with_region_names():
    pd = pytest.importorskip("pandas")
    src, dst = gqa_with_mla_draft(2, num_blocks=64), gqa_with_mla_draft(4, num_blocks=64)
    plan = kvplan.pull_map(src, dst, 3).plan(_ids(src), _ids(dst))
    df = plan.to_pandas()
    assert isinstance(df, pd.DataFrame) and len(df) == len(plan)
    for col in plan.copies().dtype.names:  # byte columns carry their unit
        assert np.array_equal(df[views.FRAME_COLUMNS.get(col, col)].to_numpy(),
                              plan.copies()[col])
    assert {"src_offset_bytes", "dst_offset_bytes", "length_bytes"} <= set(df.columns)
    assert df["length_bytes"].sum() == plan.nbytes
    assert set(df["dst_region_name"]) == {r.name for r in dst.regions}
    assert len(kvplan.pull_map(src, dst, 3).to_pandas()) == len(dst.regions)
    assert list(src.to_pandas()["name"]) == [r.name for r in src.regions]


def test_to_pandas_without_pandas_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    src = gqa_with_mla_draft(2, num_blocks=64)
    plan = kvplan.pull_map(src, src, 0).plan(_ids(src), _ids(src))
    with pytest.raises(ImportError, match=r"needs pandas.*pip install 'kvplan\[view\]'"):
        plan.to_pandas()


def test_name_set_and_human_bytes():
    assert views.name_set(["a"]) == "a"
    assert views.name_set([f"layers.{i}.attn" for i in (0, 1, 2, 5)]) == "layers.[0-2,5].attn x4"
    assert views.name_set(["x.mla", "y.attn"]) == "x.mla … y.attn x2"
    assert views.human_bytes(576) == "576 B" and views.human_bytes(1536) == "1.5 KiB"


def test_the_core_imports_neither_pandas_nor_matplotlib():
    code = ("import sys, kvplan\n"
            "s = kvplan.presets.spec('llama-3.1-8b', 2)\n"
            "s._repr_html_()\n"
            "print(sorted(m for m in ('pandas', 'matplotlib', 'rich') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


def test_summary_folds_the_layer_slots_of_an_allocation():
    """Layer slots start at different offsets inside a block, yet fold to one line per peer."""
    from kvplan import presets, pull_map

    src = presets.spec("llama-3.1-8b", tp_size=4, layout="BLHNC")
    dst = presets.spec("llama-3.1-8b", tp_size=2, layout="LBNHD")
    plan = pull_map(src, dst, 0).plan([[3, 7, 9]], [[0, 1, 2]], merge_slots=False)
    lines = plan.summary().splitlines()
    assert len(lines) == 1 + 2 * 2, lines  # header, then per peer: its total and one row
    assert "layers.[0-31].attn x32" in lines[2] and "layers.[0-31].attn x32" in lines[4]


def _written_by_rows(plan) -> int:
    """Destination block ids some run writes, from the rows (HND split regions of their own:
    buffer = [K|V][block][heads][tokens][dim], so a byte's block is offset % half // block)."""
    dst = plan.map.dst
    rows = plan.copies()
    hit = set()
    for j in np.unique(rows["dst_region"]).tolist():
        r = dst.regions[j]
        half = dst.rank_buffer_nbytes(r.name) // r.streams
        sel = rows[rows["dst_region"] == j]
        for off, n in zip(sel["dst_offset"].tolist(), sel["length"].tolist()):
            per = half // r.num_blocks
            first, last = (off % half) // per, ((off + n - 1) % half) // per
            hit.update((r.group, b) for b in range(first, last + 1))
    lists = plan.dst_blocks
    return len({(g, lists[g].tolist().index(b)) for g, b in hit})


@pytest.mark.parametrize("model", ["llama-3.1-8b", "gemma-3-1b"])  # gemma: sliding windows
@pytest.mark.parametrize("tokens", [None, (0, 3000), (1024, 3000), (2999, 3000), (1500, 1500)])
def test_summary_counts_the_destination_blocks_that_receive_bytes(model, tokens):
    src, dst = presets.spec(model, 2, num_blocks=512), presets.spec(model, 1, num_blocks=512)
    lists = _ids(dst, 3000)
    plan = kvplan.pull_map(src, dst, 0).plan(_ids(src, 3000), lists, tokens=tokens)
    written, listed = views.blocks_written(plan)
    assert listed == sum(len(x) for x in lists)
    assert written == _written_by_rows(plan)
    head = plan.summary().splitlines()[0]
    if written < listed:
        assert f"{written} of {listed} listed destination blocks written" in head
    else:
        assert f"{listed} destination blocks" in head
    if tokens == (1024, 3000) and model == "llama-3.1-8b":
        assert written == 188 - 1024 // 16  # the case: 124 of 188


def test_plot_says_what_its_total_covers_and_what_labels_mean():
    src, dst = presets.spec("llama-3.1-8b", 16, num_blocks=512), presets.spec(
        "llama-3.1-8b", 4, num_blocks=512)
    plans = [kvplan.pull_map(src, dst, d).plan(_ids(src, 3000), _ids(dst, 3000),
                                               tokens=(1024, 3000)) for d in range(4)]
    fig = kvplan.plot_rank_map(plans)
    ax = fig.axes[0]
    assert ax.get_title().endswith("for tokens 1024:3000 of this request")
    texts = [t.get_text() for t in ax.texts]
    notes = " ".join(t for t in texts if t.startswith("under a rank")).replace("\n", " ")
    for term in ("heads a:b", "replica", "DCP", "S(heads a:b)", "R =", "S(x a:b, ...)", "MiB"):
        assert term in notes, term
    assert "p9\nheads 4:5\nreplica 2/2" in texts  # 8 KV heads on 16 ranks: 2 replicas each
    assert "d1\nheads 2:4" in texts
    whole = kvplan.pull_map(src, dst, 0).plan(_ids(src, 3000), _ids(dst, 3000))
    assert whole.plot().axes[0].get_title().endswith("for this request (every listed block)")
    import matplotlib.pyplot as plt

    plt.close("all")


def test_plan_html_keeps_bytes_and_runs_in_view_and_wraps_long_placements():
    """A notebook column is narrow: bytes and runs come right after the regions, and the long
    state placements and stream lists may break after ', ' and '+' (no horizontal scroll)."""
    src, dst = presets.spec("qwen3-next-80b-a3b", 2), presets.spec("qwen3-next-80b-a3b", 4)
    plan = kvplan.pull_map(src, dst, 1).plan(_ids(src, 1024), _ids(dst, 1024))
    page = plan._repr_html_()
    header = re.findall(r"<th>([^<]*)</th>", page)[:5]
    assert header == ["regions", "bytes", "runs", "placement", "streams"]
    assert "white-space:normal" in page
    assert "q_conv+<wbr>k_conv+<wbr>v_conv+<wbr>ssm" in page
    assert "S(q_conv 512:1024, <wbr>k_conv 512:1024" in page
    m_page = kvplan.pull_map(src, dst, 1)._repr_html_()
    assert re.findall(r"<th>([^<]*)</th>", m_page)[:3] == ["regions", "bytes/block", "runs/block"]
    spec_header = re.findall(r"<th>([^<]*)</th>", src._repr_html_())
    assert spec_header[:2] == ["regions", "kind"]  # a spec's table keeps its own order


def test_outputs_say_how_a_rank_of_a_sharded_engine_is_cut():
    """Heads, replica and DCP token slice: in summaries, explain's JSON and plot nodes alike."""
    attn = {"name": "layers.0.attn", "kind": "attention", "group": 0, "num_blocks": 16,
            "block_size": 16, "dtype": "bfloat16", "num_kv_heads": 2, "head_dim": 128}
    src = kvplan.EngineSpec.from_dict({"tp_size": 2, "regions": [attn]})
    dst = kvplan.EngineSpec.from_dict({"tp_size": 8, "dcp_size": 2, "regions": [attn]})
    assert [views.rank_share(dst, r) for r in range(4)] == [
        "heads 0:1, replica 1/2, DCP slice 1/2", "heads 0:1, replica 1/2, DCP slice 2/2",
        "heads 0:1, replica 2/2, DCP slice 1/2", "heads 0:1, replica 2/2, DCP slice 2/2"]
    plan = kvplan.pull_map(src, dst, 3).plan([[0, 1]], [[0]])
    assert plan.summary().startswith(
        "TransferPlan pull d3 (heads 0:1, replica 2/2, DCP slice 2/2): ")
    assert views.rank_share(src, 1) == "heads 1:2"
