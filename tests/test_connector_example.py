"""The reference connector (examples/connector) end to end: etcd, a prefill engine of 4 ranks
and a decode engine of 2, a few hundred requests pulled and verified, every block freed.

The example checks each request itself (against kvplan.simulate); here the bytes of a sample
of requests are checked once more against the independent oracle (tests/oracle.py), from the
digests the decode ranks reported, and the byte counts against the specs.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from examples.connector.engine import BLOCKS, fill, model
from tests import oracle

if not shutil.which("etcd"):
    pytest.skip("etcd is not on PATH (Debian/Ubuntu: apt-get install etcd-server); the "
                "connector example needs a real etcd server", allow_module_level=True)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUESTS, MAX_TOKENS, P_TP, D_TP = 300, 128, 4, 2


@pytest.fixture(scope="module")
def run():
    tmp = tempfile.gettempdir()
    before = set(glob.glob(os.path.join(tmp, "kvplan-etcd-*")))
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, "-m", "examples.connector", "--requests", str(REQUESTS),
         "--max-tokens", str(MAX_TOKENS), "--prefill-tp", str(P_TP), "--decode-tp", str(D_TP),
         "--json"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    leftover = set(glob.glob(os.path.join(tmp, "kvplan-etcd-*"))) - before
    results = [json.loads(x) for x in proc.stdout.splitlines()]
    return proc, results, leftover


def test_every_request_arrives_verified_and_every_block_is_freed(run):
    proc, results, leftover = run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(m["id"] for m in results) == list(range(REQUESTS))
    bad = [m for m in results if not m["ok"]]
    assert not bad, bad[:3]
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith(f"{REQUESTS}/{REQUESTS} requests verified"), summary
    assert f"prefill {BLOCKS}/{BLOCKS} blocks free" in summary
    assert f"decode {BLOCKS}/{BLOCKS} blocks free" in summary
    assert not leftover, f"etcd data dirs left behind: {leftover}"


def test_byte_counts_match_the_specs(run):
    _, results, _ = run
    dspec = model(D_TP)
    # every decode rank receives each of its blocks whole, in every region
    per_block = sum(dspec.rank_block_nbytes(i) for i in range(len(dspec.regions))) * D_TP
    for m in results:
        n = -(-m["tokens"] // 16)
        assert len(m["src"]) == len(m["dst"]) == n
        assert m["bytes"] == n * per_block, m


def _oracle_digests(m) -> list[str]:
    """sha256 of the request's destination blocks per decode rank, from the oracle."""
    pspec, dspec = model(P_TP), model(D_TP)
    src = {}
    for r in range(P_TP):
        for i in range(len(pspec.regions)):
            buf = np.zeros(pspec.rank_region_nbytes(i), np.uint8)
            buf.reshape(BLOCKS, -1)[m["src"]] = fill(m["id"], pspec, r, i, len(m["src"]))
            src[(r, i)] = buf
    zeros = {(d, j): np.zeros(dspec.rank_region_nbytes(j), np.uint8)
             for d in range(D_TP) for j in range(len(dspec.regions))}
    out = []
    for d in range(D_TP):
        expected, _ = oracle.expected_destination(
            pspec.to_dict(), dspec.to_dict(), [m["src"]], [m["dst"]], d, src, zeros)
        sha = hashlib.sha256()
        for j in sorted(expected):
            sha.update(expected[j].reshape(BLOCKS, -1)[m["dst"]].tobytes())
        out.append(sha.hexdigest())
    return out


def test_bytes_equal_the_oracle_on_a_sample(run):
    _, results, _ = run
    by_size = sorted(results, key=lambda m: (len(m["dst"]), m["id"]))
    sample = by_size[:4] + by_size[-1:]  # the smallest and the largest (the oracle is slow)
    for m in sample:
        assert m["sha256"] == _oracle_digests(m), f"request {m['id']}"
    # and the digests do depend on the bytes: two requests' data differ
    assert sample[0]["sha256"] != sample[1]["sha256"]


def test_etcd_helper_round_trip_and_cleanup():
    from examples.connector.etcd import Etcd, etcd_server

    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "kvplan-etcd-*")))
    with etcd_server() as url:
        assert url.startswith("http://127.0.0.1:")
        etcd = Etcd(url)
        etcd.put("/a/rank/0", b"\x00\xff metadata")
        etcd.put("/a/rank/1", b"")
        etcd.put("/b/rank/0", b"other engine")
        assert etcd.prefix("/a/rank/") == {"/a/rank/0": b"\x00\xff metadata", "/a/rank/1": b""}
        assert etcd.wait("/b/", 1) == {"/b/rank/0": b"other engine"}
        with pytest.raises(TimeoutError, match="no 2 keys under '/b/'"):
            etcd.wait("/b/", 2, timeout=0.1)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "kvplan-etcd-*"))) == before
    with pytest.raises(OSError):  # the server is gone
        Etcd(url).prefix("/")
