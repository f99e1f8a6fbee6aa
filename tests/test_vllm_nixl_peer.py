"""kvplan_nixl.vllm.nixl_peer against a real, stock NixlConnector prefill (issue 38): its
handshake fetched as vLLM's decode fetches it, and the metadata vLLM's own
``register_kv_caches`` published fed to :func:`kvplan.adapters.vllm_nixl.prefill_from_nixl`
(tests/test_vllm_nixl_metadata.py checks the adapter against a reconstruction of it).

One engine, ``llama-p1-nixl-few`` (tests/vllm_pool.py): the tiny Llama (2 layers, 2 KV heads
of 64, float32, blocks of 32, 40 of them, CPU_ATTN, layout LBHNC) under vLLM's NixlConnector,
``kv_both``: the stock prefill test_vllm_mixed.py reads, which this test leaves unable to answer
handshakes and stops (it runs after those, by file order).
The fetch runs in vLLM's venv (:data:`FETCH`); the adapter runs here.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvplan.adapters.vllm import spec_from_vllm
from kvplan.adapters.vllm_nixl import NixlMetadataError, prefill_from_nixl
from tests.test_vllm_adapter import fake_engine
from tests.vllm_pool import REPO, free_base_port

#: In vLLM's venv: argv model path, host, port, a port nobody serves. The decode's hash from
#: a VllmConfig built as tests/vllm_engine.py builds the engine's (vLLM's own function), rank
#: 0's metadata fetched with it; then each refusal: a wrong hash, a rank the prefill lacks
#: (refused unsent), a port nobody serves (the timeout). Rank 0 is fetched again: the prefill
#: still answers. Last, rank 1 asked raw (what the unsent refusal prevents): vLLM's listener
#: thread dies of a KeyError, and rank 0 is not answered after.
FETCH = r"""
import json, sys
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from kvplan_nixl.errors import ArgumentError
from kvplan_nixl.serving.sidechannel import SideChannelTimeout
from kvplan_nixl.vllm.nixl_peer import NixlHashMismatch, compat_hash, fetch_nixl_metadata

model, host, port, idle = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = EngineArgs(model=model, skip_tokenizer_init=True, dtype="float32", block_size=32,
                 max_model_len=1024, enable_prefix_caching=True, enforce_eager=True, seed=0,
                 kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector",
                                                     kv_role="kv_both",
                                                     kv_buffer_device="cpu"),
                 ).create_engine_config()
h = compat_hash(cfg, "CPU_ATTN")
meta = fetch_nixl_metadata(host, port, 0, tp_size=1, expected_hash=h)
refusals = {}
try:
    fetch_nixl_metadata(host, port, 0, tp_size=1, expected_hash="0" * 64)
except NixlHashMismatch as e:
    refusals["hash"] = str(e)
try:
    fetch_nixl_metadata(host, port, 1, tp_size=1, expected_hash=h)
except ArgumentError as e:
    refusals["rank"] = str(e)
try:
    fetch_nixl_metadata(host, idle, 0, tp_size=1, expected_hash=h, timeout_s=0.5)
except SideChannelTimeout as e:
    refusals["timeout"] = str(e)
again = fetch_nixl_metadata(host, port, 0, tp_size=1, expected_hash=h)
# why a rank beyond tp_size is refused unsent: asked raw, vLLM's listener thread dies
import msgspec, zmq
ctx = zmq.Context()
raw = ctx.socket(zmq.REQ)
raw.setsockopt(zmq.RCVTIMEO, 2000)
raw.connect(f"tcp://{host}:{port}")
raw.send(msgspec.msgpack.encode((b"get_meta_msg", 0, 1)))
try:
    raw.recv_multipart()
except zmq.Again:
    refusals["raw rank 1"] = "no answer"
ctx.destroy(linger=0)
try:
    fetch_nixl_metadata(host, port, 0, tp_size=1, expected_hash=h, timeout_s=2)
except SideChannelTimeout as e:
    refusals["after"] = str(e)
meta["agent_metadata"] = len(meta["agent_metadata"])
again["agent_metadata"] = len(again["agent_metadata"])
print(json.dumps({"meta": meta, "again": again, "refusals": refusals}))
"""


def _fetch(pool, engine) -> dict:
    idle = free_base_port(1)  # nothing listens there: the timeout's port
    r = subprocess.run([str(pool.py), "-c", FETCH, str(pool.model("llama")), "127.0.0.1",
                        str(engine.port), str(idle)], capture_output=True, text=True,
                       timeout=300, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.engines("llama")
def test_stock_prefill_metadata_is_accepted_exactly(pool):
    (p,) = pool.only("llama-p1-nixl-few")
    out = _fetch(pool, p)
    meta, ref = out["meta"], out["refusals"]
    port = f"127.0.0.1:{p.port}"
    assert port in ref["hash"] and "0" * 64 in ref["hash"], ref
    assert "tp_rank 1" in ref["rank"] and port in ref["rank"], ref
    assert "no handshake answer in 0.5 s" in ref["timeout"], ref
    assert out["again"] == meta  # the refusals left the prefill's listener serving
    assert meta["engine_id"] == p.engine_id and meta["agent_metadata"] > 0
    # asked raw for a rank it lacks, the stock prefill stops answering handshakes at all
    assert ref["raw rank 1"] == "no answer", ref
    assert "no handshake answer in 2 s" in ref["after"] and port in ref["after"], ref
    assert p.log_lines(r"KeyError: \(0, 1\)"), "the listener died otherwise" + p.tail()
    pool.stop(p.name)  # a prefill that answers no handshake: no later test may be given it

    # the decode: the same model allocated as vLLM 0.32 allocates it, its own block count
    kw = {"layers": 2, "heads": 2, "head": 64, "block": 32, "layout": "LBHNC"}
    dspec = spec_from_vllm(*fake_engine(num_blocks=9, **kw)[:2], backend="CPU_ATTN",
                           total_num_kv_heads=2)
    got = prefill_from_nixl(dspec, [meta], backend="CPU_ATTN")
    truth = spec_from_vllm(*fake_engine(num_blocks=meta["num_blocks"], **kw)[:2],
                           backend="CPU_ATTN", total_num_kv_heads=2)
    assert got.spec == truth, (meta, got.spec.to_dict())
    assert got.engine_id == p.engine_id and got.backend == "CPU_ATTN"
    (bufs,) = got.buffers
    assert bufs["kv_cache_tensors.0"][0] == meta["kv_caches_base_addr"][0]

    # a field altered by one is refused, naming it and both numbers
    bad = dict(meta, block_lens=[meta["block_lens"][0], meta["block_lens"][1] + 1])
    with pytest.raises(NixlMetadataError, match=rf"'model.layers.1.self_attn.attn': block_lens "
                                                rf"{meta['block_lens'][1] + 1}, this model at "
                                                rf"TP 1 has {meta['block_lens'][1]}"):
        prefill_from_nixl(dspec, [bad], backend="CPU_ATTN")


#: In vLLM's venv, no engine: vLLM's own listener (``_nixl_handshake_listener``) serving
#: crafted answers per rank; each is refused by name. Rank 0: bytes that are no payload; rank
#: 1: a payload whose metadata is no ``NixlAgentMetadata``; rank 2: a good one, of another
#: engine than the one asked for; rank 3: the same, engine as asked: returned.
CRAFTED = r"""
import dataclasses, socket, threading
import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata, NixlHandshakePayload)
from kvplan_nixl.serving.sidechannel import SideChannelProtocolError
from kvplan_nixl.vllm.nixl_peer import fetch_nixl_metadata

enc = msgspec.msgpack.Encoder()
meta = NixlAgentMetadata(engine_id="p-7", agent_metadata=b"a", kv_caches_base_addr=[4096],
                         device_id=0, num_blocks=3, block_lens=[64], block_strides=[64],
                         kv_cache_layout="LBHNC", block_size=4, ssm_sizes=(0, 0),
                         attn_backend_name="CPU_ATTN", physical_blocks_per_logical_kv_block=1)
good = enc.encode(NixlHandshakePayload("h", enc.encode(meta)))
data = {(0, 0): b"\xc1", (0, 1): enc.encode(NixlHandshakePayload("h", b"\x93\x01")),
        (0, 2): good, (0, 3): good}
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
ready, stop = threading.Event(), threading.Event()
t = threading.Thread(target=NixlBaseConnectorScheduler._nixl_handshake_listener,
                     args=(data, ready, stop, "127.0.0.1", port), daemon=True)
t.start()
ready.wait()
for rank, want in ((0, "not a NixlHandshakePayload"), (1, "not a NixlAgentMetadata"),
                   (2, "serves engine 'p-7', not 'p-8'")):
    try:
        fetch_nixl_metadata("127.0.0.1", port, rank, tp_size=4, expected_hash="h",
                            engine_id="p-8")
        raise SystemExit(f"rank {rank} accepted")
    except SideChannelProtocolError as e:
        assert want in str(e) and f"127.0.0.1:{port}" in str(e), (rank, str(e))
got = fetch_nixl_metadata("127.0.0.1", port, 3, tp_size=4, expected_hash="h", engine_id="p-7")
assert got == dataclasses.asdict(meta), got
stop.set()
t.join()
print("ok")
"""


def test_answers_that_are_no_handshake_are_refused_by_name(vllm_python):
    """vLLM's own listener, serving crafted answers: not a payload, a payload whose metadata
    does not decode, another engine's; each a ``SideChannelProtocolError`` naming the peer."""
    r = subprocess.run([str(vllm_python), "-c", CRAFTED], capture_output=True, text=True,
                       timeout=300, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
