"""kvplan_nixl/vllm/versions.py without an engine: which vLLM pairs a handshake lets through,
that the version a peer advertises travels signed in its metadata and is checked before
anything of the peer is connected, and that the compatibility hash a stock prefill of the
previous vLLM publishes is the one a decode of this vLLM accepts. The real pairs (a 0.31 engine
beside a 0.32 one) are tests/test_vllm_upgrade.py's.

The metadata's ``app`` section is the fast tier's (no vLLM); the rules run in the vLLM venv,
since ``kvplan_nixl.vllm`` imports vLLM (the engine tier, no engine started)."""

from __future__ import annotations

import json

import pytest

from kvplan_nixl import metadata as md
from kvplan_nixl.errors import MetadataError
from kvplan_nixl.serving.handshakes import identity
from tests import venv_runner, vllm_env
from tests.nixl_util import peer_info as _info
from tests.test_vllm_serving import _in_vllm_venv


def test_the_app_section_travels_signed_and_is_checked_before_connect():
    blob = md.encode(_info({"vllm": "0.31.0"}), "s3cret")
    assert md.decode(blob, "s3cret").app == (("vllm", "0.31.0"),)
    # a peer of before the section (or one advertising nothing): no key, read as before
    assert b'"app"' not in md.encode(_info({}), "s3cret")
    assert md.decode(md.encode(_info({}), "s3cret"), "s3cret").app == ()
    seen = []
    assert identity("s3cret", seen.append)(blob) == ("prefill", 0)
    assert seen[0].app == (("vllm", "0.31.0"),)

    def refuse(info: md.PeerInfo) -> None:
        raise ValueError(f"refused {dict(info.app)}")

    with pytest.raises(ValueError, match=r"refused \{'vllm': '0\.31\.0'\}"):
        identity("s3cret", refuse)(blob)
    # signed with the rest: changed on the wire, the blob is refused as forged
    with pytest.raises(MetadataError, match="not signed with this endpoint's secret"):
        md.decode(blob.replace(b"0.31.0", b"0.32.0"), "s3cret")


def test_an_app_section_is_bounded():
    with pytest.raises(MetadataError, match="at most 16 non-empty strings"):
        md.check_app({f"k{i}": "v" for i in range(17)})
    with pytest.raises(MetadataError, match="at most 16 non-empty strings"):
        md.check_app({"vllm": "x" * 129})
    with pytest.raises(MetadataError, match="not name -> value strings"):
        md.check_app([("a",)])


#: In the vLLM venv: the pair rules, and a signed blob of an unlisted version refused by the
#: handshake's identify (what Worker and Writes build), named.
RULES = r"""
from kvplan_nixl import metadata as md
from tests.nixl_util import peer_info as _info
from kvplan_nixl.serving.handshakes import identity
from kvplan_nixl.vllm import versions
from kvplan_nixl.vllm.versions import VERSIONS, Version, VersionRefused, check_pair, line

assert versions.local_version() == "0.32.0", versions.local_version()
assert line("0.32.0") == "0.32" and line("0.31.1+cpu") == "0.31"
check_pair("0.31.0", "0.32.0"); check_pair("0.32.0", "0.31.0")  # both directions
check_pair("0.32.0", "0.32.1+cpu")  # a patch release keeps its line's layouts
check_pair("0.99.0", "0.99.0")  # equal versions always pass, listed or not

def refused(local, remote, who="the peer"):
    try:
        check_pair(local, remote, who)
    except VersionRefused as e:
        return str(e)
    raise AssertionError(f"{local} -> {remote} passed")

msg = refused("0.32.0", "0.33.0")
assert "runs vLLM 0.33.0, this engine 0.32.0: vLLM 0.33.0 is not a version this kvplan " \
       "knows (0.31, 0.32;" in msg, msg
assert "vLLM 0.30.2 is not a version" in refused("0.30.2", "0.31.0"), refused("0.30.2", "0.31.0")
VERSIONS["0.33"] = Version(layouts=2, nixl_connector=15)  # a line that changes a layout
msg = refused("0.32.0", "0.33.0", "engine 'p' rank 1")
assert "engine 'p' rank 1 runs vLLM 0.33.0, this engine 0.32.0: their KV cache layouts " \
       "differ (layout epoch 2 vs 1" in msg, msg
del VERSIONS["0.33"]

ok = md.encode(_info(versions.advertised("0.31.0")), "k")
assert identity("k", versions.check_peer("0.32.0"))(ok) == ("prefill", 0)
assert identity("k", versions.check_peer("0.32.0"))(md.encode(_info({}), "k")) == ("prefill", 0)
try:
    identity("k", versions.check_peer("0.32.0"))(md.encode(_info(versions.advertised("0.40.0")),
                                                           "k"))
    raise AssertionError("an unlisted version passed the handshake's identify")
except VersionRefused as e:
    assert "engine 'prefill' rank 0 runs vLLM 0.40.0" in str(e), e
print("ok")
"""


def test_version_pairs_are_refused_by_name_at_handshake(vllm_python):
    _in_vllm_venv(vllm_python, RULES)


#: In either venv (``MODEL`` and ``WHAT`` set before it): prints the stock NixlConnector pull
#: hash vLLM computes for a config built as tests/vllm_engine.py builds a NixlConnector
#: engine's, and, where kvplan_nixl.vllm.versions is asked (``WHAT == "kvplan"``), every hash
#: the decode accepts.
HASHES = r"""
import json
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    compute_nixl_compatibility_hash)

cfg = EngineArgs(model=MODEL, skip_tokenizer_init=True, dtype="float32", block_size=32,
                 max_model_len=1024, enable_prefix_caching=True, enforce_eager=True, seed=0,
                 kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector",
                                                     kv_role="kv_both",
                                                     kv_buffer_device="cpu"),
                 ).create_engine_config()
out = {"own": compute_nixl_compatibility_hash(cfg, "CPU_ATTN", transfer_mode="pull")}
if WHAT == "kvplan":
    from kvplan_nixl.vllm.versions import stock_hashes
    out["accepted"] = stock_hashes(cfg, "CPU_ATTN")
print(json.dumps(out))
"""


def test_a_decode_accepts_the_hash_a_stock_prefill_of_the_previous_vllm_publishes(
        vllm_python, vllm_previous, tmp_path):
    """The hash is vLLM's own function of each version; the decode's is computed from the
    factors versions.py lists: equal only if they are the previous version's factors. Each
    script runs forked from an interpreter of its venv that imported vLLM once
    (tests/venv_runner.py: this venv's is the one the test above started)."""
    model = tmp_path / "tiny-llama"

    def run(py, script: str) -> str:
        rc, out, err = venv_runner.run(py, script, timeout=300)
        assert rc == 0, f"exit status {rc}\n{out}{err[-3000:]}"
        return out

    run(vllm_python, f"from tests.vllm_engine import write_model; write_model({str(model)!r})")

    def hashes(py, what: str) -> dict:
        out = run(py, f"MODEL, WHAT = {str(model)!r}, {what!r}\n{HASHES}")
        return json.loads(out.strip().splitlines()[-1])

    previous = hashes(vllm_previous, "own")["own"]
    here = hashes(vllm_python, "kvplan")
    assert previous != here["own"]  # vLLM's own decode refuses the mixed pair
    assert here["accepted"] == {here["own"]: vllm_env.VLLM_VERSION,
                                previous: vllm_env.PREVIOUS}, (here, previous)
