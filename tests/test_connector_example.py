"""The reference connector (examples/connector) end to end: a real etcd server, a prefill and a
decode engine of several ranks each (real NIXL agents in two processes), a few hundred requests
pulled and verified, every block freed; both directions of heterogeneous TP (4 -> 2, 2 -> 4).

The example checks each request itself (against kvplan.simulate); here the bytes of a sample
of requests are checked once more against the independent oracle (tests/oracle.py), from the
digests the decode ranks reported, and the byte counts against the specs. The example's own
check is shown to fail on a wrong and on a missing byte, and the example to stay small (under
300 lines of code) on the library's public names only.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tokenize
import types
from pathlib import Path

import pytest

from examples.connector.engine import BLOCKS, fill, kv_cache, model, verify
from examples.connector.etcd import Etcd, etcd_server
from kvplan import pull_map
from tests import oracle

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "connector"
ETCD = shutil.which("etcd")
needs_etcd = pytest.mark.skipif(
    not ETCD, reason="etcd is not on PATH (Debian/Ubuntu: apt-get install etcd-server); the "
    "connector example needs a real etcd server")
# (prefill TP, decode TP, requests, longest prompt): each decode rank reads two prefill ranks;
# two decode ranks read each prefill rank (so a prefill rank waits for two notifications)
RUNS = [(4, 2, 300, 128), (2, 4, 100, 128)]


def _etcd_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "kvplan-etcd-*")))


@pytest.fixture(scope="module", params=RUNS, ids=lambda r: f"P{r[0]}-D{r[1]}")
def run(request):
    p_tp, d_tp, requests, max_tokens = request.param
    if not ETCD:
        pytest.skip("etcd is not on PATH (Debian/Ubuntu: apt-get install etcd-server)")
    before = _etcd_dirs()
    proc = subprocess.run(
        [sys.executable, "-m", "examples.connector", "--requests", str(requests),
         "--max-tokens", str(max_tokens), "--prefill-tp", str(p_tp), "--decode-tp", str(d_tp),
         "--json"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=240,
    )
    results = [json.loads(x) for x in proc.stdout.splitlines()]
    return types.SimpleNamespace(p_tp=p_tp, d_tp=d_tp, requests=requests, proc=proc,
                                 results=results, leftover=_etcd_dirs() - before)


def test_every_request_arrives_verified_and_every_block_is_freed(run):
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    assert sorted(m["id"] for m in run.results) == list(range(run.requests))
    bad = [m for m in run.results if not m["ok"] or m["errors"]]
    assert not bad, bad[:3]
    summary = run.proc.stderr.strip().splitlines()[-1]
    assert summary.startswith(f"{run.requests}/{run.requests} requests verified"), summary
    assert f"prefill {BLOCKS}/{BLOCKS} blocks free" in summary
    assert f"decode {BLOCKS}/{BLOCKS} blocks free" in summary
    assert f"prefill TP{run.p_tp} and decode TP{run.d_tp} ready in" in run.proc.stderr
    # NIXL (glog) logged no error: none in flight, none at shutdown (decode closes first)
    assert not re.findall(r"^[EF]\d{4} .*", run.proc.stderr, re.M), run.proc.stderr[-3000:]
    assert not run.leftover, f"etcd data dirs left behind: {run.leftover}"


def test_block_ids_and_byte_counts_match_the_specs(run):
    dspec = model(run.d_tp)
    # every decode rank receives each of its blocks whole, in every region
    per_block = sum(dspec.rank_block_nbytes(i) for i in range(len(dspec.regions))) * run.d_tp
    for m in run.results:
        n = -(-m["tokens"] // 16)
        assert len(m["src"]) == len(m["dst"]) == n, m
        assert len(set(m["src"])) == len(set(m["dst"])) == n, m  # no block given twice
        assert all(0 <= b < BLOCKS for b in m["src"] + m["dst"]), m
        assert m["bytes"] == n * per_block, m
        assert len(m["sha256"]) == run.d_tp and m["ms"] > 0, m
    # the two schedulers hand out blocks in different orders: ids are really translated
    assert any(m["src"] != m["dst"] for m in run.results)


def _oracle_kv(req: int, p_tp: int, d_tp: int, src_ids: list[int], dst_ids: list[int]):
    """Every decode rank's blocks after a correct transfer of ``req``, by the oracle, as the
    example's kv_cache dict, and each rank's sha256 of its ``dst_ids`` blocks."""
    pspec, dspec = model(p_tp), model(d_tp)
    src = {(r, i): b.reshape(-1) for (r, i), b in kv_cache(pspec).items()}
    for (r, i), buf in src.items():
        buf.reshape(BLOCKS, -1)[src_ids] = fill(req, pspec, r, i, len(src_ids))
    zeros = {k: b.reshape(-1) for k, b in kv_cache(dspec).items()}
    kv, digests = kv_cache(dspec), []
    for d in range(d_tp):
        expected, _ = oracle.expected_destination(
            pspec.to_dict(), dspec.to_dict(), [src_ids], [dst_ids], d, src, zeros)
        sha = hashlib.sha256()
        for j in sorted(expected):
            kv[d, j][:] = expected[j].reshape(BLOCKS, -1)
            sha.update(kv[d, j][dst_ids].tobytes())
        digests.append(sha.hexdigest())
    return kv, digests


def test_bytes_equal_the_oracle_on_a_sample(run):
    by_size = sorted(run.results, key=lambda m: (len(m["dst"]), m["id"]))
    sample = by_size[:4] + by_size[-1:]  # the smallest and the largest (the oracle is slow)
    for m in sample:
        _, digests = _oracle_kv(m["id"], run.p_tp, run.d_tp, m["src"], m["dst"])
        assert m["sha256"] == digests, f"request {m['id']}"
    # and the digests do depend on the bytes: two requests' data differ
    assert sample[0]["sha256"] != sample[1]["sha256"]


def test_the_examples_check_fails_on_a_wrong_or_a_missing_byte():
    """verify(), the decode side's check, on the oracle's bytes: ok; one byte changed, or one
    left unwritten, and it names the rank and region (no NIXL: the reads are stand-ins)."""
    p_tp, d_tp, req, src_ids, dst_ids = 4, 2, 7, [9, 3, 120], [5, 6, 0]
    kv, digests = _oracle_kv(req, p_tp, d_tp, src_ids, dst_ids)
    pspec, dspec = model(p_tp), model(d_tp)
    reads = [types.SimpleNamespace(
        plan=pull_map(pspec, dspec, d).plan([src_ids], [dst_ids]), ok=True, error=lambda: None,
        nbytes=1, seconds=0.001) for d in range(d_tp)]

    def check() -> dict:
        return verify(req, reads, kv, kv_cache(pspec), kv_cache(dspec))

    assert check() == {"ok": True, "sha256": digests, "errors": [], "bytes": 2, "ms": 1.0}
    kv[1, 1][6, 100] ^= 0x5A  # decode rank 1, layers.1.attn, block 6
    assert check()["errors"] == ["rank 1 region layers.1.attn: bytes differ"]
    kv[1, 1][6, 100] ^= 0x5A
    kv[0, 2][0, -1] = 0  # decode rank 0, the MLA draft layer: a byte the read missed
    res = check()
    assert not res["ok"] and res["errors"] == ["rank 0 region draft.0.mla: bytes differ"]
    assert res["sha256"][0] != digests[0] and res["sha256"][1] == digests[1]


@needs_etcd
def test_etcd_helper_round_trip_and_cleanup():
    before = _etcd_dirs()
    with etcd_server() as url:
        assert url.startswith("http://127.0.0.1:")
        assert len(_etcd_dirs() - before) == 1  # its data dir, while it runs
        etcd = Etcd(url)
        etcd.put("/a/rank/0", b"\x00\xff metadata")
        etcd.put("/a/rank/1", b"")
        etcd.put("/b/rank/0", b"other engine")
        assert etcd.prefix("/a/rank/") == {"/a/rank/0": b"\x00\xff metadata", "/a/rank/1": b""}
        assert etcd.wait("/b/", 1) == {"/b/rank/0": b"other engine"}
        with pytest.raises(TimeoutError, match="no 2 keys under '/b/'"):
            etcd.wait("/b/", 2, timeout=0.1)
    assert _etcd_dirs() == before
    with pytest.raises(OSError):  # the server is gone
        Etcd(url).prefix("/")


def test_without_etcd_it_says_what_to_install_and_bad_arguments_are_refused():
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": "/nonexistent"}
    cmd = [sys.executable, "-m", "examples.connector"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "apt-get install etcd-server" in proc.stderr, proc.stderr
    proc = subprocess.run([*cmd, "--max-tokens", str(16 * BLOCKS + 1)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"must be in 1..{16 * BLOCKS}" in proc.stderr, proc.stderr


def code_lines(path: Path) -> int:
    """Lines of code: lines with a token that is not a comment, blank or docstring."""
    text = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and body and isinstance(
                body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
                body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def test_code_line_counter(tmp_path):
    src = '"""Doc\nstring."""\n\n# a comment\nx = (1,\n     2)  # trailing\n\n\ndef f():\n' \
          '    """Doc."""\n    return """not a\n    docstring"""\n'
    p = tmp_path / "m.py"
    p.write_text(src)
    assert code_lines(p) == 5  # x = (1, / 2) / def f(): / return """not a / docstring"""


def test_the_connector_is_small_and_uses_public_names_only():
    files = sorted(EXAMPLE.glob("*.py"))
    counts = {f.name: code_lines(f) for f in files}
    assert {"__main__.py", "engine.py", "etcd.py"} <= counts.keys()
    assert sum(counts.values()) < 300, counts
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            where = f"{f.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvplan"):
                # the packages' public names, and kvplan.examples (documented example engines)
                assert node.module in ("kvplan", "kvplan_nixl", "kvplan.examples"), where
                assert all(not a.name.startswith("_") for a in node.names), where
            elif isinstance(node, ast.Import):
                assert all(not a.name.startswith("kvplan") for a in node.names), where
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):  # no ep._agent
                assert isinstance(node.value, ast.Name) and node.value.id == "self", where
