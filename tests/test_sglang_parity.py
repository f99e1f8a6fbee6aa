"""SGLang 0.5.23's own KV transfer code against kvplan's plans, byte by byte (engine tier).

tests/sglang_parity.py runs SGLang's Mooncake and NIXL connections (their rank mapping and
slicing, on CPU, in the SGLang venv) over :func:`cases` and prints the copies they make; here
both those copies and kvplan's plans (specs from :mod:`kvplan.adapters.sglang`) are applied to
the oracle's buffers (tests/oracle.py, through tests/sglang_judge.py) and judged: ``exact``,
``wrong``, ``raises`` or ``refuses``. kvplan must be exact, writing each byte once, in every
case; SGLang's verdicts must be the ones docs/sglang.md tabulates.

``python `` (in the project's venv) runs the same and rewrites the
table in docs/sglang.md.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from kvplan import SpecError  # noqa: E402
from kvplan.adapters.sglang import (  # noqa: E402
    SGLangKV,
    SGLangMamba2,
    sglang_attention_rank,
    sglang_buffers,
    spec_from_sglang,
    spec_from_sglang_hybrid,
    spec_from_sglang_mamba2,
    spec_from_sglang_swa,
)
from tests.sglang_judge import judge, kvplan_rows  # noqa: E402

DOC = ROOT / "docs" / "sglang.md"
BEGIN, END = "<!-- parity-table: begin -->", "<!-- parity-table: end -->"
TPS = (1, 2, 4, 8)
PAGE_SIZES = (1, 16, 64)
SRC_PAGES, DST_PAGES = [3, 1, 4], [2, 5, 1]
SRC_SLOTS, DST_SLOTS = [2], [3]  # a request's Mamba state slot on each side
# a SWAKVPool's own pages (page 0 padding): a request's window, in the SWA pool's index space
SWA_POOL_PAGES, SRC_SWA_PAGES, DST_SWA_PAGES = 5, [4, 1], [2, 3]
BACKENDS = ("mooncake", "nixl")
STATE = ("mamba2", "gdn", "kda")  # kinds whose request holds one state slot


def cases() -> list[dict]:
    """The grid: GQA/MHA with 1-16 KV heads at every pair of attention TP 1/2/4/8 where the
    heads fit both sides, and MLA at every pair, each at page sizes 1, 16, 64; then one
    prefill serving two decode engines of different TP sizes (``d2``); Mamba2 and GDN state;
    a prefill of two PP stages (``p_pp``; four layers) into a decode of one or two
    (``d_pp``); sliding-window layers beside full attention of 8 heads; SGLang's own
    ``HybridLinearKVPool`` (GDN state and attention, also under PP) and ``SWAKVPool``
    (``kind`` ``"hybrid"`` / ``"swapool"``: KV then state). Two layers, six
    pages, K heads of 8 values (MLA latent 8 + 4), bfloat16 (state: fp32 temporal)."""
    out = []
    for page, (p, d) in itertools.product(PAGE_SIZES, itertools.product(TPS, TPS)):
        for heads in range(1, 17):
            if all(heads % t == 0 or t % heads == 0 for t in (p, d)):
                out.append({"id": f"mha K{heads} P{p} D{d} page{page}", "kind": "mha",
                            "heads": heads, "p": p, "d": d, "page": page, "head_dim": 8})
        out.append({"id": f"mla P{p} D{d} page{page}", "kind": "mla", "heads": 1, "p": p,
                    "d": d, "page": page, "head_dim": 12})
    # one prefill serving two decode engines of different TP sizes at once
    for heads, p, d, d2 in itertools.product((8, 16), (1, 2), (2, 4), (4, 8)):
        if d < d2:
            out.append({"id": f"mha K{heads} P{p} D{d}+D{d2} page16", "kind": "mha",
                        "heads": heads, "p": p, "d": d, "d2": d2, "page": 16,
                        "head_dim": 8})
    # MiMo-V2 style pools: V heads narrower than K heads (192 / 128 scaled down to 12 / 8)
    for page, (p, d), heads in itertools.product((1, 16), itertools.product(TPS, TPS),
                                                 (2, 4, 8)):
        out.append({"id": f"mimo K{heads} P{p} D{d} page{page}", "kind": "mha",
                    "heads": heads, "p": p, "d": d, "page": page, "head_dim": 12,
                    "v_head_dim": 8})
    # Mamba2 state (Nemotron-H's shapes, scaled down): 8 heads of 4, state 4, conv kernel 4,
    # B/C groups 1 (replicated at TP > 1) or 8
    for groups, (p, d) in itertools.product((1, 8), itertools.product(TPS, TPS)):
        out.append({"id": f"mamba2 G{groups} P{p} D{d}", "kind": "mamba2", "heads": 1,
                    "p": p, "d": d, "page": 1, "head_dim": 0,
                    "mamba": {"heads": 8, "head_dim": 4, "state_size": 4,
                              "n_groups": groups, "conv_kernel": 4}})
    # Gated DeltaNet state (Qwen3-Next's shapes, scaled down): 8 value heads of 4, 2 or 8 key
    # heads of 4 (2 key heads: replicated at TP 4 and 8), conv kernel 4
    for k_heads, (p, d) in itertools.product((2, 8), itertools.product(TPS, TPS)):
        out.append({"id": f"gdn Kh{k_heads} P{p} D{d}", "kind": "gdn", "heads": 1,
                    "p": p, "d": d, "page": 1, "head_dim": 0,
                    "mamba": {"heads": 8, "head_dim": 4, "state_size": 4,
                              "n_groups": k_heads, "conv_kernel": 4}})
    # KDA state (Kimi-Linear's shapes, scaled down): 8 heads of 4, conv kernel 4
    for p, d in itertools.product(TPS, TPS):
        out.append({"id": f"kda P{p} D{d}", "kind": "kda", "heads": 1, "p": p, "d": d,
                    "page": 1, "head_dim": 0,
                    "mamba": {"heads": 8, "head_dim": 4, "state_size": 4, "n_groups": 1,
                              "conv_kernel": 4}})
    # pipeline parallelism: a prefill of 2 stages (4 layers, 2 each) into a decode of 1 or 2
    for kind, p, d, d_pp in itertools.product(("mha", "mla"), (1, 2, 4), TPS, (1, 2)):
        heads, head_dim = (8, 8) if kind == "mha" else (1, 12)
        out.append({"id": f"{kind}{' K8' if kind == 'mha' else ''} P{p} PP2 D{d} PP{d_pp} "
                          "page16", "kind": kind, "heads": heads, "p": p, "p_pp": 2, "d": d,
                    "d_pp": d_pp, "page": 16, "head_dim": head_dim, "layers": 4})
    # DP attention: TP ranks in dp groups of tp / dp, the request in the prefill's last group
    # (the decode's ranks know only their rank in their group); a case's "p" / "d" are the
    # attention-TP sizes, as before
    for kind, (p_tp, p_dp), (d_tp, d_dp) in itertools.product(
            ("mha", "mla"), ((8, 8), (8, 2), (4, 2)), ((8, 4), (4, 1), (2, 2))):
        heads, head_dim = (8, 8) if kind == "mha" else (1, 12)
        out.append({"id": f"{kind}{' K8' if kind == 'mha' else ''} P{p_tp} dp{p_dp} "
                          f"D{d_tp} dp{d_dp} page16", "kind": kind, "heads": heads,
                    "p": p_tp // p_dp, "p_dp": p_dp, "p_group": p_dp - 1,
                    "d": d_tp // d_dp, "d_dp": d_dp, "page": 16,
                    "head_dim": head_dim})
    # sliding-window layers: their own MHA pool (2, 4 or 8 KV heads) handed over as SWA state
    # beside full attention of 8 KV heads, page 16
    for swa, (p, d) in itertools.product((2, 4, 8), itertools.product(TPS, TPS)):
        if all(swa % t == 0 or t % swa == 0 for t in (p, d)):
            out.append({"id": f"swa K{swa} full K8 P{p} D{d} page16", "kind": "swa",
                        "heads": swa, "full_heads": 8, "p": p, "d": d, "page": 16,
                        "head_dim": 8})
    # MiMo-V2 style sliding-window layers (V heads narrower than K heads, 12 / 8) beside full
    # attention of 8 KV heads
    for swa, (p, d) in itertools.product((4, 8), itertools.product(TPS, TPS)):
        out.append({"id": f"swa mimo K{swa} full K8 P{p} D{d} page16", "kind": "swa",
                    "heads": swa, "full_heads": 8, "p": p, "d": d, "page": 16,
                    "head_dim": 12, "v_head_dim": 8})
    # SGLang's hybrid pool objects, four layers: a HybridLinearKVPool (GDN state on layers 0
    # and 2, 8 value and 8 key heads; full attention on 1 and 3 with 4 KV heads, replicated
    # at TP 8) and a SWAKVPool (full attention on 1 and 3 with 8 KV heads; sliding-window
    # layers 0 and 2 with 8 or 4 KV heads in a pool of their own, 5 pages), page 16
    for p, d in itertools.product(TPS, TPS):
        out.append({"id": f"hybrid pool gdn K4 P{p} D{d} page16", "kind": "hybrid",
                    "heads": 4, "p": p, "d": d, "page": 16, "head_dim": 8, "layers": 4,
                    "full_layers": [1, 3], "state_layers": [0, 2],
                    "mamba": {"heads": 8, "head_dim": 4, "state_size": 4, "n_groups": 8,
                              "conv_kernel": 4}})
    # the same HybridLinearKVPool under pipeline parallelism (a stage: one state layer, one
    # attention layer), a prefill of two stages at TP 2 or 4 into a decode of one or two
    for p, d, d_pp in itertools.product((2, 4), TPS, (1, 2)):
        out.append({"id": f"hybrid pool gdn K4 P{p} PP2 D{d} PP{d_pp} page16",
                    "kind": "hybrid", "heads": 4, "p": p, "p_pp": 2, "d": d, "d_pp": d_pp,
                    "page": 16, "head_dim": 8, "layers": 4, "full_layers": [1, 3],
                    "state_layers": [0, 2],
                    "mamba": {"heads": 8, "head_dim": 4, "state_size": 4, "n_groups": 8,
                              "conv_kernel": 4}})
    for swa, (p, d) in itertools.product((8, 4), itertools.product(TPS, TPS)):
        out.append({"id": f"swa pool K8 swa K{swa} P{p} D{d} page16", "kind": "swapool",
                    "heads": 8, "swa_heads": swa, "p": p, "d": d, "page": 16,
                    "head_dim": 8, "layers": 4, "full_layers": [1, 3], "swa_layers": [0, 2],
                    "swa_pages_total": SWA_POOL_PAGES})
    for c in out:
        c.setdefault("layers", 2)
        c.update(pages=6, src_pages=SRC_PAGES, dst_pages=DST_PAGES, src_slots=SRC_SLOTS,
                 dst_slots=DST_SLOTS, src_swa_pages=SRC_SWA_PAGES, dst_swa_pages=DST_SWA_PAGES)
    return out


class _Tensor:
    """A buffer of an SGLang pool as the driver described it: shape, dtype, address."""

    def __init__(self, d: dict):
        self.shape, self.dtype, self._ptr = tuple(d["shape"]), d["dtype"], d["ptr"]

    def data_ptr(self) -> int:
        return self._ptr


def pool_object(face: dict):
    """An object that reads like the SGLang pool the driver built (class name, attributes,
    buffers, what it tells its connections), for :meth:`SGLangKV.from_pool` and
    :meth:`SGLangMamba2.from_pool`."""
    attrs = {k: v for k, v in face.items() if k not in ("class", "buf_infos")}
    for k in ("k_buffer", "v_buffer", "kv_buffer"):
        if k in attrs:
            attrs[k] = [_Tensor(t) for t in attrs[k]]
    for k in ("full_kv_pool", "swa_kv_pool", "mamba_pool"):  # a hybrid pool's sub-pools
        if k in attrs:
            attrs[k] = pool_object(attrs[k])
    if "full_attention_layer_id_mapping" in attrs:
        attrs["full_attention_layer_id_mapping"] = dict(
            map(tuple, attrs["full_attention_layer_id_mapping"]))
    if "mamba_cache" in attrs:
        cache = attrs["mamba_cache"]
        attrs["mamba_cache"] = SimpleNamespace(conv=[_Tensor(t) for t in cache["conv"]],
                                               temporal=_Tensor(cache["temporal"]))
    said = {"get_contiguous_buf_infos": face["buf_infos"],
            "get_state_conv_shard_groups": face.get("state_conv_shard_groups")}
    methods = {k: (lambda self, v=v: v) for k, v in said.items()}
    return type(face["class"], (SimpleNamespace,), methods)(**attrs)


def spec(case: dict, tp: int, face: dict):
    """kvplan's spec of one side, read by the adapter from SGLang's own pool of that side
    (``SGLangKV.from_pool``; Mamba2, GDN and KDA state: ``SGLangMamba2.from_pool``, checked
    against the model's numbers); the buffers it names are checked against SGLang's
    ``get_contiguous_buf_infos``."""
    faces = face if isinstance(face, list) else [face]  # one per PP stage
    pools = [pool_object(f) for f in faces]
    if case["kind"] in STATE:
        m = case["mamba"]
        values = SGLangMamba2.from_pool(pools[0], attn_tp_size=tp, n_groups=m["n_groups"])
        assert values == SGLangMamba2(
            layers=tuple(range(case["layers"])), slots=case["pages"], num_heads=m["heads"],
            head_dim=m["head_dim"], state_size=m["state_size"],
            n_groups=1 if case["kind"] == "kda" else m["n_groups"],
            conv_kernel=m["conv_kernel"], conv_dtype="bfloat16", ssm_dtype="float32",
            kind=case["kind"]), (case["id"], values)
        out = spec_from_sglang_mamba2(values, attn_tp_size=tp)
    elif case["kind"] == "hybrid":  # HybridLinearKVPool(s): attention and state per stage
        kvs = [SGLangKV.from_pool(p) for p in pools]
        states = [SGLangMamba2.from_pool(p, attn_tp_size=tp) for p in pools]
        assert [x for kv in kvs for x in kv.layers] == case["full_layers"], (case["id"], kvs)
        assert [x for m in states for x in m.layers] == case["state_layers"], case["id"]
        assert {(m.kind, m.n_groups) for m in states} == {
            ("gdn", case["mamba"]["n_groups"])}, (case["id"], states)
        out = spec_from_sglang_hybrid(kvs, states, attn_tp_size=tp,
                                      total_kv_heads=case["heads"])
    elif case["kind"] == "swapool":  # SWAKVPool: full pages, then the SWA pool's own
        full, swa = SGLangKV.from_swa_pool(pools[0])
        assert (full.layers, swa.layers, swa.pages) == (
            tuple(case["full_layers"]), tuple(case["swa_layers"]),
            case["swa_pages_total"]), (case["id"], full, swa)
        out = spec_from_sglang_swa(full, swa, attn_tp_size=tp, total_kv_heads=case["heads"],
                                   swa_total_kv_heads=case["swa_heads"])
    else:
        kvs = [SGLangKV.from_pool(p) for p in pools]
        out = spec_from_sglang(kvs if len(kvs) > 1 else kvs[0], attn_tp_size=tp,
                               total_kv_heads=case["heads"])
    named: dict = {}  # every buffer of the spec, from some stage's pool
    for f, pool in zip(faces, pools):
        ptrs, lens, _ = f["buf_infos"]
        for sub in ("swa_kv_pool", "mamba_pool"):  # a hybrid pool's state entries too
            if sub in f:
                ptrs, lens = ptrs + f[sub]["buf_infos"][0], lens + f[sub]["buf_infos"][1]
        got = sglang_buffers(pool, out)
        assert sorted(got.values()) == sorted(zip(ptrs, lens)), (case["id"], got, f)
        named.update(got)
    assert len(named) == len(out.buffers), (case["id"], sorted(named), out.buffers)
    return out


def blocks(case: dict) -> tuple[list[list[int]], list[list[int]]]:
    """A request's block ids on each side, one list per KV-cache group of its spec."""
    if case["kind"] in STATE:
        return [SRC_SLOTS], [DST_SLOTS]
    if case["kind"] == "hybrid":
        return [SRC_PAGES, SRC_SLOTS], [DST_PAGES, DST_SLOTS]
    if case["kind"] == "swapool":
        return [SRC_PAGES, SRC_SWA_PAGES], [DST_PAGES, DST_SWA_PAGES]
    return [SRC_PAGES], [DST_PAGES]


def verdict(case: dict, result: dict | None, pools: dict) -> dict:
    """SGLang's verdict on one case from the driver's ``result``; kvplan's when None.
    ``pools`` are the faces of both sides' pools."""
    if result is not None and result["status"] != "ran":
        return {"verdict": result["status"], "detail": result.get("error", ""),
                "where": result.get("where", "")}
    engines = [("d", "rows")] + ([("e", "rows2")] if case.get("d2") else [])
    out = {"verdict": "exact", "detail": "", "writes": 0, "bytes": 0}
    for side, key in engines:  # each decode engine judged on its own bytes
        try:
            src = spec(case, case["p"], pools["p"])
            dst = spec(case, case["d2" if side == "e" else "d"], pools[side])
        except SpecError as e:
            return {"verdict": "refuses", "detail": str(e)}
        ids = blocks(case)
        rows = (kvplan_rows(src, dst, *ids) if result is None
                else [tuple(r) for r in result[key]])
        got = judge(src, dst, *ids, rows)
        if got["verdict"] != "exact":
            out.update(verdict=got["verdict"], detail=f"{side}: {got['detail']}")
        out["writes"] = max(out["writes"], got["writes"])
        out["bytes"] += got["bytes"]
    return out


def run_sglang(python: Path, grid: list[dict] | None = None,
               env: dict[str, str] | None = None) -> dict[tuple[str, str], dict]:
    """The driver's results over ``grid`` (default :func:`cases`), keyed ``(case id,
    backend)``."""
    proc = subprocess.run([str(python), str(ROOT / "tests" / "sglang_parity.py")],
                          input=json.dumps(cases() if grid is None else grid),
                          capture_output=True, text=True, timeout=900, check=False,
                          env=None if env is None else {**os.environ, **env})
    if proc.returncode != 0:
        raise AssertionError(f"the SGLang driver exited {proc.returncode}:\n"
                             f"{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout)
    return {(r["id"], r["backend"]): r for r in out["results"]}


def judged(results: dict) -> list[dict]:
    """One row per case: its id, each backend's verdict and kvplan's."""
    rows = []
    for c in cases():
        pools = next(results[(c["id"], b)]["pools"] for b in BACKENDS
                     if "pools" in results[(c["id"], b)])
        row = {"id": c["id"], "kvplan": verdict(c, None, pools)}
        for b in BACKENDS:
            row[b] = verdict(c, results[(c["id"], b)], pools)
        rows.append(row)
    return rows


def _cell(v: dict) -> str:
    text = v["verdict"]
    if v.get("writes", 1) > 1:
        text += f" (x{v['writes']})"
    if v.get("where"):
        text += f" `{v['where']}`"
    return text


def table(rows: list[dict]) -> str:
    """The docs' table: totals per connection, then every case that is not exact
    everywhere, then (folded) every case."""
    count = {k: collections.Counter(r[k]["verdict"] for r in rows)
             for k in (*BACKENDS, "kvplan")}
    kinds = ("exact", "wrong", "raises", "refuses")
    lines = ["| | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    names = {"mooncake": "SGLang Mooncake", "nixl": "SGLang NIXL", "kvplan": "kvplan"}
    for k in (*BACKENDS, "kvplan"):
        lines.append(f"| {names[k]} | " + " | ".join(str(count[k][v]) for v in kinds) + " |")
    lines += ["", f"{len(rows)} cases. Where SGLang is not exact on either connection:", "",
              "| case | Mooncake | NIXL | kvplan |", "|---|---|---|---|"]
    bad = [r for r in rows if any(r[b]["verdict"] != "exact" for b in BACKENDS)]
    lines += [f"| {r['id']} | " + " | ".join(_cell(r[k]) for k in (*BACKENDS, "kvplan"))
              + " |" for r in bad]
    lines += ["", "<details><summary>Every case</summary>", "",
              "| case | Mooncake | NIXL | kvplan |", "|---|---|---|---|"]
    lines += [f"| {r['id']} | " + " | ".join(_cell(r[k]) for k in (*BACKENDS, "kvplan"))
              + " |" for r in rows]
    lines += ["", "</details>"]
    return "\n".join(lines)


def documented() -> str:
    text = DOC.read_text()
    m = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    assert m, f"{DOC} has no {BEGIN} ... {END} block"
    return m.group(1)


@pytest.fixture(scope="module")
def results(sglang_python):
    return run_sglang(sglang_python)


@pytest.fixture(scope="module")
def parity(results):
    return judged(results)


def test_dp_attention_ranks_are_sglangs(results):
    """Under DP attention the adapter places every TP rank in its group and at its rank there
    as SGLang's own ``compute_dp_attention_world_info`` does (reported by the driver)."""
    seen = 0
    for c in cases():
        got = results[(c["id"], "mooncake")].get("attention_ranks")
        if got is None or "p_dp" not in c:
            continue
        for side in ("p", "d"):
            dp = c[f"{side}_dp"]
            for r, (tp_rank, tp_size, dp_rank, _) in enumerate(got[side]):
                mine = sglang_attention_rank(r, tp_size=c[side] * dp, dp_size=dp)
                assert (mine.attn_tp_rank, mine.attn_tp_size, mine.attn_dp_rank) == (
                    tp_rank, tp_size, dp_rank), (c["id"], side, r)
                seen += 1
    assert seen >= 100


def test_kvplan_is_exact_everywhere_and_writes_each_byte_once(parity):
    bad = [(r["id"], r["kvplan"]) for r in parity
           if r["kvplan"]["verdict"] != "exact" or r["kvplan"]["writes"] != 1]
    assert not bad, bad[:5]


def test_kvplan_refuses_nothing_sglang_moves_exactly(parity):
    moved = [r["id"] for r in parity if r["kvplan"]["verdict"] == "refuses"
             and any(r[b]["verdict"] == "exact" for b in BACKENDS)]
    assert not moved, moved[:5]


def test_sglang_verdicts_are_the_documented_ones(parity):
    got = table(parity)
    assert got == documented(), (
        "docs/sglang.md's parity table differs from this run; rewrite it with "
        "`python ` and read what changed")


def test_the_judge_calls_a_broken_sglang_wrong(sglang_python):
    """The same driver with SGLang's head offsets swapped (``KVPLAN_SGLANG_PARITY_BREAK``):
    its copies must be judged wrong, so an exact verdict above means the bytes were right."""
    grid = [c for c in cases() if c["id"] in ("mha K8 P4 D2 page16", "mha K8 P2 D4 page1",
                                              "hybrid pool gdn K4 P2 D4 page16",
                                              "swa pool K8 swa K8 P4 D2 page16")]
    got = run_sglang(sglang_python, grid, {"KVPLAN_SGLANG_PARITY_BREAK": "1"})
    for c in grid:
        for b in BACKENDS:
            v = verdict(c, got[(c["id"], b)], got[(c["id"], b)]["pools"])["verdict"]
            assert v in ("wrong", "raises"), (c["id"], b, v)
    first = got[(grid[0]["id"], "mooncake")]
    assert verdict(grid[0], first, first["pools"])["verdict"] == "wrong"


def test_nixl_refuses_what_the_recording_agent_refuses():
    """The driver's NIXL stand-in refuses a descriptor outside registered memory and a pair of
    descriptors of different lengths; real NIXL agents do too (fast tier: NIXL, no SGLang)."""
    torch = pytest.importorskip("torch")
    api = None
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = __import__(name, fromlist=["nixl_agent"])
            break
        except ImportError:
            continue
    if api is None:
        pytest.skip("no NIXL build installed")
    import kvplan_nixl  # noqa: F401  (sets UCX_MODULES before the first agent)

    a = api.nixl_agent("sgl-a", api.nixl_agent_config(backends=["UCX"]))
    b = api.nixl_agent("sgl-b", api.nixl_agent_config(backends=["UCX"]))
    ta, tb = torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    a.register_memory(a.get_reg_descs([ta]))
    b.register_memory(b.get_reg_descs([tb]))
    a.add_remote_agent(b.get_agent_metadata())
    src = a.prep_xfer_dlist("", [(ta.data_ptr(), 512, 0)], "DRAM")
    dst = a.prep_xfer_dlist("sgl-b", [(tb.data_ptr(), 256, 0)], "DRAM")
    with pytest.raises(Exception, match="NIXL_ERR_INVALID_PARAM"):
        a.make_prepped_xfer("WRITE", src, [0], dst, [0])
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
        a.prep_xfer_dlist("sgl-b", [(tb.data_ptr() + 4000, 256, 0)], "DRAM")


def main() -> None:
    """Run the parity grid and rewrite the table in docs/sglang.md."""
    from tests import sglang_env

    got = table(judged(run_sglang(sglang_env.ensure())))
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:start] + "\n" + got + "\n" + text[end:])
    print(got.split("\n\n")[0])


if __name__ == "__main__":
    main()
