"""The mixed fleet as a trust boundary (issue 45, items 3 to 9): what a request's params, a
stock NixlConnector prefill's listener and its metadata may cost a KvplanConnector decode, the
request ids its notifications can carry, and what a staged OPEN may cost a prefill; and the
gaps closed after: an unverifiable ``tp_size`` claim (a'), a load failed before its prefill
was connected (b), ``stock_prefills: []`` (c), the answer's cap and name resolution (e).

The params rules are checked where the connector's scheduler admits a request
(:func:`kvplan_nixl.serving.transfer_params.check_decode`, and in the vLLM venv through
:class:`kvplan_nixl.vllm.scheduler.Scheduler` with vLLM's own ``Request``); the listener's cap
with :func:`kvplan_nixl.vllm.nixl_peer.fetch_nixl_metadata` against a real ZMQ listener in its
own process; the metadata's ranges with :func:`kvplan.adapters.vllm_nixl.prefill_from_nixl`.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvplan_nixl import ParamsError
from kvplan_nixl.serving.transfer_params import check_decode

#: a decode request's params as vLLM 0.32's NixlConnector prefill hands them
STOCK = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4, 5]],
         "remote_engine_id": "stock-p", "remote_request_id": "cmpl-2-0-abcdef12",
         "remote_host": "10.0.0.8", "remote_port": 5600, "tp_size": 1, "dcp_size": 1,
         "pp_size": 1, "remote_num_tokens": 70, "transfer_mode": "pull"}
#: the same from a KvplanConnector prefill (it hands its lists' offsets)
OURS = dict(STOCK, transfer_mode="kvplan", remote_block_offsets=[0], remote_generation=5)


# -- item 3: sizes a request names are bounded by the decode's max_model_len ------------------

def test_offsets_and_token_counts_are_bounded_by_max_model_len():
    """``remote_block_offsets`` (the decode pads each list to it: 16 bytes a position) and
    ``remote_num_tokens`` (a stock prefill's window offsets are derived from it) above the
    decode's ``max_model_len`` are refused by name, with the bound; at it, taken."""
    at = check_decode("d", dict(OURS, remote_block_offsets=[4096], remote_num_tokens=4096),
                      1, max_model_len=4096)
    assert at.first == (4096,) and at.tokens == 4096
    for params, field in ((dict(OURS, remote_block_offsets=[2**31 - 1]), "remote_block_offsets"),
                          (dict(OURS, remote_block_offsets=[4097]), "remote_block_offsets"),
                          (dict(STOCK, remote_num_tokens=2**31 - 1), "remote_num_tokens"),
                          (dict(STOCK, remote_num_tokens=4097), "remote_num_tokens"),
                          (dict(OURS, remote_num_tokens=4097), "remote_num_tokens")):
        with pytest.raises(ParamsError, match="4096") as e:
            check_decode("d", params, 1, max_model_len=4096)
        assert e.value.field == field and "max_model_len" in str(e.value), e.value
    # without a max_model_len (a caller that has none) the wire format's bound holds
    assert check_decode("d", dict(OURS, remote_block_offsets=[2**31 - 1]), 1).first == \
        (2**31 - 1,)


# -- item 5: request ids a stock prefill's notifications cannot carry -------------------------

@pytest.mark.parametrize("rid", ["a,b", "HB:cmpl-1", "kvs1 OPEN 9", ",", "HB:"])
def test_stock_request_ids_the_notifications_cannot_carry_are_refused(rid):
    """vLLM 0.32's prefill splits a heartbeat's ids at ',' and reads any ``HB:...`` as a
    heartbeat; ``kvs1 `` is the staged executor's prefix, which an endpoint will not send.
    Such an id of a stock prefill's request is refused at admission, naming the field."""
    with pytest.raises(ParamsError, match="NixlConnector prefill's request id") as e:
        check_decode("d", dict(STOCK, remote_request_id=rid), 1)
    assert e.value.field == "remote_request_id" and e.value.value == rid
    # a kvplan prefill's ids travel on its own side channel (quoted): not refused
    assert check_decode("d", dict(OURS, remote_request_id=rid), 1).remote_req == rid


def test_stock_request_ids_vllm_reads_back_exactly_are_taken():
    for rid in ("cmpl-2-0-abcdef12", "a:b:c", "x HB:y", "chat-1-kvs1", "hb:lower"):
        assert check_decode("d", dict(STOCK, remote_request_id=rid), 1).remote_req == rid


# -- items 3 and 5 through the connector's scheduler, vLLM's own Request (in the vLLM venv) ---

SCHEDULER = r"""
from types import SimpleNamespace
import torch
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        SlidingWindowSpec)
from vllm.v1.request import Request
from kvplan_nixl.vllm import KvplanConnector

cfg = VllmConfig(kv_transfer_config=KVTransferConfig(
    kv_connector="KvplanConnector", kv_connector_module_path="kvplan_nixl.vllm",
    kv_role="kv_both", kv_buffer_device="cpu", engine_id="dec"))
cfg.model_config = SimpleNamespace(max_model_len=4096)  # what the facade reads of the model
full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16,
                           sliding_window=32)
kcfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                     kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], full),
                                      KVCacheGroupSpec(["layers.1.attn"], window)])
c = KvplanConnector(cfg, KVConnectorRole.SCHEDULER, kcfg)
STOCK = {"do_remote_prefill": True, "remote_block_ids": [[1, 2, 3], [2, 3]],
         "remote_engine_id": "stock-p", "remote_request_id": "cmpl-1", "remote_host": "10.0.0.8",
         "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 40, "transfer_mode": "pull"}
OURS = dict(STOCK, transfer_mode="kvplan", remote_block_offsets=[0, 1])
blocks = KVCacheBlocks(([KVCacheBlock(block_id=i) for i in (5, 6, 7)],
                        [KVCacheBlock(block_id=i) for i in (8, 9, 10)]))

def load(i, params):  # vLLM's order: admission, match, allocation, this step's metadata
    r = Request(f"r{i}", list(range(2, 42)), SamplingParams(
        max_tokens=4, extra_args={"kv_transfer_params": params}), None)
    c.on_new_request(r)
    assert c.get_num_new_matched_tokens(r, 0) == (40, True)
    c.update_state_after_alloc(r, blocks, 40)
    (ld,) = c.build_connector_meta(SimpleNamespace(scheduled_new_reqs=())).loads
    return ld

refused = {}
for i, (params, field) in enumerate([
        (dict(STOCK, remote_num_tokens=2**31 - 1), "remote_num_tokens"),  # 2 GiB of window
        (dict(OURS, remote_block_offsets=[0, 2**31 - 1]), "remote_block_offsets"),  # 32 GiB
        (dict(STOCK, remote_request_id="a,b"), "remote_request_id"),
        (dict(STOCK, remote_request_id="HB:x"), "remote_request_id"),
        (dict(STOCK, remote_request_id="kvs1 x"), "remote_request_id")]):
    ld = load(i, params)
    assert f"kv_transfer_params[{field!r}]" in ld.refused and ld.parked, (field, ld)
    assert ld.host == "" and ld.remote_ids == (), ld  # nothing of it reaches the workers
    refused[field] = ld.refused
assert "4096" in refused["remote_num_tokens"] and "max_model_len" in refused["remote_num_tokens"]
assert "4096" in refused["remote_block_offsets"]
# at the bound: taken; the window's derived offset stays within max_model_len's blocks
import time
ld = load(10, dict(STOCK, remote_num_tokens=4096))
assert not ld.refused and ld.remote_first == (0, 4096 // 16 - 2), ld
# gap (d): the scheduler's admission time travels with the load (a stock request admitted
# before its prefill was found restarted is not read: tests/test_restarts.py)
assert time.time() - 60 < ld.admitted <= time.time(), ld
ld = load(11, dict(OURS, remote_block_offsets=[0, 4096]))
assert not ld.refused and ld.remote_first == (0, 4096), ld
print("ok")
"""


def test_the_connectors_scheduler_bounds_and_refuses_them_at_admission(vllm_python):
    """Items 3 and 5 at the connector's scheduler (its facade, as vLLM calls it): the request
    is refused at admission naming the field and, for a size, ``max_model_len`` and its value;
    its load fails at once into the policy, carrying no block list, offset or address."""
    from tests.test_vllm_serving import _in_vllm_venv

    _in_vllm_venv(vllm_python, SCHEDULER)


# -- item 6: a stock prefill's metadata, range-checked as kvplan's own -----------------------

def _stock(tp: int = 1, **kw):
    """A stock prefill's per-rank metadata (as vLLM's register_kv_caches builds it) and the
    decode's spec of the same model (2 layers, 2 KV heads, blocks of 4, CPU_ATTN)."""
    from kvplan.adapters.vllm import spec_from_vllm
    from tests.test_vllm_adapter import fake_engine
    from tests.test_vllm_nixl_metadata import nixl_metadata

    model = {"layout": "LBHNC", "heads": 2, "block": 4, "num_blocks": 6, **kw}
    prefill = [fake_engine(tp=tp, **model) for _ in range(tp)]
    dec = fake_engine(tp=1, **{**model, "num_blocks": 9})
    dspec = spec_from_vllm(dec[0], dec[1], tp_size=1, backend="CPU_ATTN", total_num_kv_heads=2)
    metas = [nixl_metadata(kv, cfg, raw.size, layout="LBHNC", backend="CPU_ATTN")
             for kv, cfg, raw in prefill]
    return dspec, metas, prefill


BAD_METADATA = [
    ("num_blocks", 0, "num_blocks 0: must be an int 1 to"),
    ("num_blocks", -3, "num_blocks -3: must be an int 1 to"),
    ("block_size", 0, "block_size 0: must be an int 1 to 65536"),
    ("block_size", -4, "block_size -4"), ("block_size", "4", "block_size '4'"),
    ("physical_blocks_per_logical_kv_block", 0, "physical_blocks_per_logical_kv_block 0"),
    ("device_id", -1, "device_id -1"), ("dcp_size", 0, "dcp_size 0"),
    ("kv_caches_base_addr", [2**63 + 4096, 2**63 + 8192], r"kv_caches_base_addr\[0\]"),
    ("kv_caches_base_addr", [0, 64], r"kv_caches_base_addr\[0\] 0"),
    ("kv_caches_base_addr", "x", "kv_caches_base_addr must be a list"),
    ("block_lens", [0, 0], r"block_lens\[0\] 0"), ("block_strides", [1.5, 2], "block_strides"),
    ("region_num_blocks", [-1, 6], r"region_num_blocks\[0\] -1"),
    ("region_group_ids", [-2, 0], r"region_group_ids\[0\] -2"),
    ("ssm_sizes", (0,), "ssm_sizes"), ("ssm_sizes", (-1, 0), "ssm_sizes"),
    ("engine_id", 7, "engine_id 7: must be a string"),
    ("kv_cache_layout", ["LBHNC"], "kv_cache_layout"),
    ("region_names", [1, 2], "region_names must be a list"),
]


@pytest.mark.parametrize(("field", "value", "words"), BAD_METADATA,
                         ids=[f"{f}={str(v)[:10]}" for f, v, _ in BAD_METADATA])
def test_metadata_numbers_out_of_range_are_refused_naming_the_field(field, value, words):
    """Sizes <= 0 once raised ``RuntimeError: generator raised StopIteration``, an address past
    2**63 an ``OverflowError`` in ``connect_foreign``; each is now a NixlMetadataError naming
    the rank, the field and the value."""
    from kvplan.adapters.vllm_nixl import NixlMetadataError, prefill_from_nixl

    dspec, (meta,), _ = _stock()
    with pytest.raises(NixlMetadataError, match=words) as e:
        prefill_from_nixl(dspec, [dict(meta, **{field: value})], backend="CPU_ATTN")
    assert "prefill rank 0" in str(e.value)


def test_a_buffer_ending_past_2_63_is_refused_before_nixl_sees_it():
    """The buffer's base is in range but its end is not: refused by the adapter (naming
    kv_caches_base_addr) and, given to ``connect_foreign`` directly, by the endpoint (a
    BufferSizeError naming the buffer), never an OverflowError."""
    from kvplan.adapters.vllm_nixl import NixlMetadataError, prefill_from_nixl
    from kvplan_nixl import BufferSizeError, Endpoint
    from kvplan_nixl._nixl import make_agent

    dspec, (meta,), _ = _stock()
    good = prefill_from_nixl(dspec, [meta], backend="CPU_ATTN")
    (name, (base, size)), = good.buffers[0].items()
    top = (1 << 63) - size + 1  # every region starts below 2**63, the buffer ends past it
    moved = dict(meta, kv_caches_base_addr=[a - base + top for a in meta["kv_caches_base_addr"]])
    with pytest.raises(NixlMetadataError, match=r"kv_caches_base_addr .* \(0, 2\*\*63\)"):
        prefill_from_nixl(dspec, [moved], backend="CPU_ATTN")
    agent = make_agent("stock-past-63", ("UCX",), False)
    buf = np.zeros(dspec.rank_buffer_nbytes(0), np.uint8)
    with Endpoint("decode", dspec, 0, {dspec.buffers[0]: buf}) as ep, \
            pytest.raises(BufferSizeError, match="past 2\\*\\*63"):
        ep.connect_foreign("stock", 0, good.spec, {name: (top, size)},
                           agent.get_agent_metadata())


# -- item 7: the request's tp_size against the prefill's own rank 0 --------------------------

def test_a_claimed_tp_size_is_checked_against_rank_0s_block_lengths():
    """A TP 1 prefill's rank 0 publishes both KV heads per block; claimed TP 2 (a rank 1 the
    prefill lacks, which kills vLLM's listener if asked for) is refused from rank 0 alone,
    naming tp_size, the region and both block lengths. A TP 2 prefill's rank 0, claimed TP 1,
    likewise; each at its own size is taken."""
    from kvplan.adapters.vllm_nixl import NixlMetadataError, check_first_rank

    dspec, (meta1,), _ = _stock(tp=1)
    check_first_rank(dspec, meta1, 1, backend="CPU_ATTN")
    with pytest.raises(NixlMetadataError, match=r"tp_size 2 \(the request's\).*block_lens "
                       r"\d+, this model at TP 2 has \d+"):
        check_first_rank(dspec, meta1, 2, backend="CPU_ATTN")
    _, metas2, _ = _stock(tp=2)
    check_first_rank(dspec, metas2[0], 2, backend="CPU_ATTN")
    with pytest.raises(NixlMetadataError, match="tp_size 1"):
        check_first_rank(dspec, metas2[0], 1, backend="CPU_ATTN")
    with pytest.raises(NixlMetadataError, match="tp_size 0"):
        check_first_rank(dspec, meta1, 0, backend="CPU_ATTN")


@pytest.mark.parametrize(("mla", "heads", "tp", "claim", "fits"), [
    (False, 2, 2, 2, None), (False, 2, 2, 4, 2), (False, 2, 2, 128, 2), (False, 2, 1, 1, None),
    (False, 4, 4, 4, None),  # TP 3 would read alike, but vLLM cannot run 4 heads at TP 3
    (False, 4, 2, 2, None), (True, 2, 1, 2, 1), (True, 2, 2, 2, 1), (True, 2, 4, 4, 1),
    (True, 2, 1, 1, None)])
def test_a_claim_rank_0_cannot_tell_from_fewer_ranks_is_found(mla, heads, tp, claim, fits):
    """Gap (a'): :func:`kvplan.adapters.vllm_nixl.fewer_ranks_fit` says the smallest TP size
    below the claim that rank 0's metadata fits as well (the claim then unverified): an MLA
    latent fits TP 1 at any size, a head a rank fits every size above the head count."""
    from kvplan.adapters.vllm import spec_from_vllm
    from kvplan.adapters.vllm_nixl import check_first_rank, fewer_ranks_fit
    from tests.test_vllm_adapter import fake_engine
    from tests.test_vllm_nixl_metadata import nixl_metadata

    backend = "CPU_MLA" if mla else "CPU_ATTN"
    model = {"layout": "LBHNC", "mla": mla, "heads": heads, "block": 4, "num_blocks": 6}
    kv, cfg, raw = fake_engine(tp=tp, **model)
    dec = fake_engine(tp=1, **{**model, "num_blocks": 9})
    dspec = spec_from_vllm(dec[0], dec[1], tp_size=1, backend=backend,
                           total_num_kv_heads=heads)
    meta = nixl_metadata(kv, cfg, raw.size, layout="LBHNC", backend=backend)
    check_first_rank(dspec, meta, claim, backend=backend)  # the claim alone passes
    assert fewer_ranks_fit(dspec, meta, claim, backend=backend) == fits


# -- items 4 and 7 against vLLM 0.32's own listener (in the vLLM venv) ------------------------

#: vLLM 0.32's handshake listener (``_nixl_handshake_listener``, run as its scheduler runs it),
#: in a process of its own: a genuine TP 1 prefill's rank 0 on one port, and the same listener
#: serving a 256 MiB answer on another; on a third a ROUTER answering 20 frames of 19 MiB
#: (each below a ZMQ socket's per-frame cap). argv: the ports, the hash, the metadata's JSON.
LISTENERS = r"""
import json, sys, threading
import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata, NixlHandshakePayload)
genuine, big, many, digest = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
meta, mid = json.loads(sys.argv[5]), int(sys.argv[6])
meta["agent_metadata"] = b"not read: this check fails before any rank is connected"
enc = msgspec.msgpack.Encoder()
payload = NixlHandshakePayload(compatibility_hash=digest,
                               agent_metadata_bytes=enc.encode(NixlAgentMetadata(**meta)))
for port, data in ((genuine, {(0, 0): enc.encode(payload)}), (big, {(0, 0): b"x" * (256 << 20)}),
                   (mid, {(0, 0): b"x" * (5 << 20)})):
    ready = threading.Event()
    threading.Thread(target=NixlBaseConnectorScheduler._nixl_handshake_listener, daemon=True,
                     args=(data, ready, threading.Event(), "127.0.0.1", port)).start()
    ready.wait()
import zmq
router = zmq.Context().socket(zmq.ROUTER)
router.bind(f"tcp://127.0.0.1:{many}")
def frames():
    part = b"x" * (19 << 20)
    while True:
        ident, _, _ = router.recv_multipart()
        router.send_multipart([ident, b""] + [part] * 20)
threading.Thread(target=frames, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""

FETCH_LIMITS = r"""
import json, resource, subprocess, sys, threading, time
from types import SimpleNamespace
from kvplan import EngineSpec
from kvplan_nixl.serving.sidechannel import SideChannelTimeout
from kvplan_nixl.vllm.nixl_peer import (MAX_ANSWER, NixlAnswerTooLarge, NixlPrefills,
                                        fetch_nixl_metadata)

genuine, big, idle, many, mid, dspec, meta = json.loads(sys.argv[1])
listeners = subprocess.Popen([sys.executable, "-c", LISTENERS, str(genuine), str(big), str(many),
                              "h" * 64, json.dumps(meta), str(mid)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
assert listeners.stdout.readline().strip() == "ready"
got = fetch_nixl_metadata("127.0.0.1", genuine, 0, tp_size=1, expected_hash="h" * 64)
assert got["engine_id"] == meta["engine_id"] and got["block_lens"] == meta["block_lens"], got

# item 4: a 256 MiB answer is refused from its length, at once, holding none of it
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.monotonic()
try:
    fetch_nixl_metadata("127.0.0.1", big, 0, tp_size=1, expected_hash="h" * 64, timeout_s=20)
except NixlAnswerTooLarge as e:
    took, why, limit = time.monotonic() - t0, str(e), e.limit
else:
    raise AssertionError("a 256 MiB answer was taken")
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB
assert limit == MAX_ANSWER == 4_259_840 and "4 MiB" in why and f":{big}" in why, why
assert took < 5 and grew < 32 << 10, (took, grew)
# gap (e): 5 MiB, below the side channel's 20 MiB that capped it before, above what 1,024
# regions of stock metadata take (about 4 MiB with room): refused unread too
try:
    fetch_nixl_metadata("127.0.0.1", mid, 0, tp_size=1, expected_hash="h" * 64, timeout_s=20)
except NixlAnswerTooLarge as e:
    assert "4259840 byte cap" in str(e), e
else:
    raise AssertionError("a 5 MiB answer was taken")
# 20 frames of 19 MiB: bounded in all (a ZMQ socket's MAXMSGSIZE bounds one frame: 400 MiB)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    fetch_nixl_metadata("127.0.0.1", many, 0, tp_size=1, expected_hash="h" * 64, timeout_s=20)
except NixlAnswerTooLarge as e:
    pass
else:
    raise AssertionError("380 MiB in 20 frames were taken")
many_grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
assert many_grew < 48 << 10, many_grew
# a listener that answers nothing is still a timeout, not a refused frame
try:
    fetch_nixl_metadata("127.0.0.1", idle, 0, tp_size=1, expected_hash="h" * 64, timeout_s=0.5)
except SideChannelTimeout as e:
    assert not isinstance(e, NixlAnswerTooLarge) and "no handshake answer in 0.5 s" in str(e)

# gap (e): a host name whose lookup hangs (getaddrinfo takes no timeout) fails by the fetch's
# deadline, and a numeric address is never looked up; the lookup left running is bounded
import socket
real_gai = socket.getaddrinfo
def gai(host, port, *a, flags=0, **k):
    if host == "hangs.example" and not flags & socket.AI_NUMERICHOST:
        time.sleep(8)  # a DNS server that answers nothing (glibc: 5 s a try)
    return real_gai(host, port, *a, flags=flags, **k)
socket.getaddrinfo = gai
t0 = time.monotonic()
try:
    fetch_nixl_metadata("hangs.example", genuine, 0, tp_size=1, expected_hash="h" * 64,
                        timeout_s=0.5)
except SideChannelTimeout as e:
    assert "resolving 'hangs.example': no answer by the deadline" in str(e), e
else:
    raise AssertionError("resolved")
assert time.monotonic() - t0 < 1.5, time.monotonic() - t0
assert fetch_nixl_metadata("127.0.0.1", genuine, 0, tp_size=1, expected_hash="h" * 64) == got
socket.getaddrinfo = real_gai

# item 7: a request claiming tp_size 2 for this TP 1 prefill, through the connector's own
# NixlPrefills: refused from rank 0's block lengths, rank 1 never asked for
from kvplan_nixl.serving.settings import Settings
w = SimpleNamespace(lock=threading.Lock(), hs_timeout=5.0, lease=30.0, rank=0, cuda=False,
                    ep=SimpleNamespace(spec=EngineSpec.from_dict(dspec)),
                    c=Settings("dec", "127.0.0.1", 5700, 1))  # no stock_prefills: any address
prefills = NixlPrefills(w, "h" * 64, "CPU_ATTN")
load = SimpleNamespace(engine=meta["engine_id"], host="127.0.0.1", port=genuine, remote_tp=2)
st = prefills.start(load)
deadline = time.monotonic() + 30
while st.pending:
    assert time.monotonic() < deadline, st
    time.sleep(0.01)
    st = prefills.state(load)
assert st.failed and "NixlMetadataError: tp_size 2 (the request's)" in st.reason, st
prefills.close()
# vLLM's listener still serves: asked for rank 1, its thread would have died (KeyError)
again = fetch_nixl_metadata("127.0.0.1", genuine, 0, tp_size=1, expected_hash="h" * 64,
                            timeout_s=5)
assert again == got

# where rank 0 cannot tell the sizes apart (an MLA latent, fewer KV heads than ranks), only the
# configuration can: stock_prefills giving the address TP 1 refuses a claim of 2 before any
# dial (tests/test_restarts.py reads a genuine TP 2 prefill so configured)
from kvplan_nixl.serving.handshakes import AddressRefused
w.c = Settings("dec", "127.0.0.1", 5700, 1,
               extra={"stock_prefills": [f"127.0.0.1:{genuine}/tp1"]})
prefills = NixlPrefills(w, "h" * 64, "CPU_ATTN")
try:
    prefills.start(load)
    raise AssertionError("a tp_size of 2 was taken for a prefill configured TP 1")
except AddressRefused as e:
    assert "stock_prefills says it runs TP 1, the request's tp_size is 2" in str(e), e
    assert "nothing was dialled" in str(e), e
assert prefills.state(load) is None  # no handshake was started
prefills.close()
listeners.stdin.close()
listeners.wait(30)
print(f"refused 256 MiB in {took:.3f} s, maxrss +{grew} KiB; 20 x 19 MiB: +{many_grew} KiB; ok")
"""


def test_stock_listener_answers_are_capped_and_tp_size_checked_first(vllm_python):
    """Item 4: vLLM's own listener serving a 256 MiB frame makes the fetch raise
    NixlAnswerTooLarge (naming the 4 MiB cap) at once, its memory not grown by the frame
    (before: 511 MiB held, then refused); 20 frames of 19 MiB likewise, none held (a ZMQ
    socket with MAXMSGSIZE held all 400 MiB). Gap (e): 5 MiB, which the 20 MiB cap of before
    took, is refused as well; a host name whose lookup hangs fails by the fetch's deadline
    (before: the lookup's own timeouts, 8 s here). Item 7: a request's tp_size 2 for
    a TP 1 prefill fails its handshake on rank 0's metadata, and the listener, never asked for
    rank 1, still answers."""
    import json
    import os
    import subprocess

    from tests.vllm_pool import REPO, free_base_port

    dspec, (meta,), _ = _stock(num_blocks=9)  # a prefill with the decode's block count
    meta = dict(meta, engine_id="stock-p", agent_metadata=None)
    # the genuine listener, the 256 MiB one, one nobody serves, frames, the 5 MiB one
    base = free_base_port(5)
    script = f"LISTENERS = {LISTENERS!r}\n" + FETCH_LIMITS
    r = subprocess.run([str(vllm_python), "-c", script,
                        json.dumps([base, base + 1, base + 2, base + 3, base + 4,
                                    dspec.to_dict(), meta])],
                       capture_output=True, text=True, timeout=300, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
    print(r.stdout.strip().splitlines()[-1])


# -- item 8: a stock prefill's read refused before posting is told <id>:n ---------------------

UNPOSTED = r"""
import time
from types import SimpleNamespace
from kvplan import RequestError
from kvplan.adapters.vllm import TransferGroups
from kvplan_nixl import Endpoint
from kvplan_nixl._nixl import make_agent
from kvplan_nixl.serving.pulls import Pulls
from kvplan_nixl.serving.transfer_params import Peer
from tests import oracle
from tests.nixl_util import attn, spec

class Bare:  # one rank of a stock prefill, to NIXL: an agent, its memory, its notifications
    def __init__(self, name, buf):
        self.buf, self.got = buf, []
        self.agent = make_agent(name, ("UCX",), False)
        self.descs = self.agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        self.agent.register_memory(self.descs)
    def progress(self):
        for msgs in self.agent.get_new_notifs().values():
            self.got += [bytes(m) for m in msgs]
        return 0

class Stats:
    def __init__(self):
        self.counts = {}
    def record(self, key, n=1):
        self.counts[key] = self.counts.get(key, 0) + n
    def record_transfer(self, *a):
        self.record("transfers")

def drain(bares, want, timeout=10.0):  # the decode's agent progressed as its Worker's loop does
    end = time.monotonic() + timeout
    while any(len(b.got) < want for b in bares) and time.monotonic() < end:
        ep.notifications()
        for b in bares:
            b.progress()
        time.sleep(1e-3)

src, dst = spec(2, attn(heads=4)), spec(1, attn(heads=4))  # stock TP 2 -> decode TP 1
sbufs = oracle.source_buffers(src.to_dict(), seed=3)
dbufs = oracle.destination_buffers(dst.to_dict(), seed=4)
bares = [Bare(f"stock-agent-{r}", sbufs[(r, 0)]) for r in range(2)]
ep = Endpoint("decode", dst, 0, {"layers.0.attn": dbufs[(0, 0)]})
for r, b in enumerate(bares):
    ep.connect_foreign("stock", r, src, {"layers.0.attn": (b.buf.ctypes.data, b.buf.nbytes)},
                       b.agent.get_agent_metadata())
groups = TransferGroups(index=(0,), kinds=("full",), block_sizes=(16,), windows=(None,),
                        scratch=(0,))
w = SimpleNamespace(rank=0, ep=ep, groups=groups, whole=False, timeout=10.0, heartbeat=20.0,
                    nixl_heartbeat=5.0, lease_pin=5.0, lease_margin=0.1, stats=Stats(), failed=[],
                    recv_done=set(), engines={}, nixl=SimpleNamespace(forget=lambda engine: None),
                    admitted={}, reporting={})
w.fail = lambda load, why, peers=(): w.failed.append(why)
pulls, tmap, counts = Pulls(w), ep.map("stock"), [1, 1]  # decode rank 0 reads both ranks

def load(req, ids):
    return SimpleNamespace(req_id="d-" + req, remote_req=req, engine="stock", host="127.0.0.1",
                           port=5600, remote_tp=2, remote_ids=[ids], remote_first=[0],
                           local_ids=[[7, 8, 9]], start=0, end=48, parked=True, generation=0,
                           push=False, key="", refused="", peer=Peer.NIXL)

# the prefill handed a block id it does not have: the plan is refused before posting
try:
    pulls.post(load("cmpl-bad", [1, 2, 99]), tmap, counts)
except RequestError as e:
    why = str(e)
else:
    raise AssertionError("posted")
assert "block id 99" in why and not pulls.inflight, why
drain(bares, 1)
assert [b.got for b in bares] == [[b"cmpl-bad:1"], [b"cmpl-bad:1"]], [b.got for b in bares]
# a genuine read still posts, completes and is told once per rank, as before
pulls.post(load("cmpl-ok", [1, 2, 3]), tmap, counts)
end = time.monotonic() + 30
while "d-cmpl-ok" not in w.recv_done:
    assert time.monotonic() < end and not w.failed, (w.failed, pulls.inflight)
    for b in bares:
        b.progress()
    ep.notifications()
    pulls.progress(time.monotonic())
    time.sleep(1e-3)
drain(bares, 3)
for b in bares:
    assert b.got[0] == b"cmpl-bad:1" and b.got.count(b"cmpl-ok:1") == 1, b.got
    assert set(b.got[1:]) <= {b"HB:cmpl-ok", b"cmpl-ok:1"}, b.got
# the decode Worker's own start(): a load its digest refuses, and an aborted one (nothing to
# read), of a prefill this rank has read: told at once too (before: left to the stock lease)
import threading
from kvplan_nixl.vllm.scheduler import KvplanMetadata
from kvplan_nixl.vllm.worker import Worker
wk = Worker.__new__(Worker)  # its state as register() leaves it, around the same endpoint
wk.__dict__.update(rank=0, ep=ep, groups=groups, lock=threading.Lock(), sends=None,
                   answers=None, writes=None, digester=object(), waiting={}, stats=Stats(),
                   engines={"stock": (tmap, counts)}, recv_done=set(), recv_failed=set(),
                   errors=set(), ctl=None, admitted={}, reporting={})
for b in bares:
    b.got.clear()
wk.start(KvplanMetadata(loads=[load("cmpl-dig", [4, 5, 6])]))
drain(bares, 1)
assert [b.got for b in bares] == [[b"cmpl-dig:1"]] * 2, [b.got for b in bares]
assert wk.recv_done == {"d-cmpl-dig"} and wk.errors == {7, 8, 9}, (wk.recv_done, wk.errors)
wk.digester = None
aborted = load("cmpl-ab", [4, 5, 6])
aborted.local_ids, aborted.parked = [], False
wk.start(KvplanMetadata(loads=[aborted]))
drain(bares, 2)
assert [b.got for b in bares] == [[b"cmpl-dig:1", b"cmpl-ab:1"]] * 2, [b.got for b in bares]
ep.close()
print("ok")
"""


def test_a_stock_read_refused_before_posting_frees_the_prefills_blocks(vllm_python):
    """Item 8, at the connector's pull path (``Pulls.post``, what the decode Worker calls once
    the handshake is done) with real NIXL agents as the stock prefill's two ranks: a plan
    refused at posting (a block id the prefill lacks) still tells each rank ``<id>:1``, the
    notification after which vLLM's prefill frees the request's blocks (before: nothing, so
    they waited for its lease); a genuine read after it is told once, as before. Through the
    decode Worker's ``start``: a load the transfer digest refuses and an aborted one (nothing
    to read) of a prefill this rank has read are told at once too."""
    from tests.test_vllm_serving import _in_vllm_venv

    _in_vllm_venv(vllm_python, UNPOSTED)


# -- item 9: a staged OPEN's claimed size is refuted before any planning -----------------------

def _absent(draw, lists):
    """Some positions of each list replaced by ABSENT (a window's or a state's null blocks)."""
    from hypothesis import strategies as st

    from kvplan import ABSENT

    return [[ABSENT if draw(st.integers(0, 4)) == 0 else b for b in g] for g in lists]


def test_plan_nbytes_is_every_plans_bytes_per_peer():
    """:func:`kvplan.request.plan_nbytes` (what the staged server refutes an OPEN with before
    planning) equals the plan's bytes per peer rank for generated pairs: any layouts, K/V
    buffers, allocations, block sizes, TP, windows and state, token ranges inside blocks,
    ``dst_from="start"`` and null blocks on either side; and raises where planning raises."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    import kvplan.strategies as ks
    from kvplan import EngineSpec, KVPlanError, pull_map, push_map
    from kvplan.request import plan_nbytes

    @st.composite
    def cases(draw):
        src_d, dst_d = draw(ks.layout_spec_pairs())
        sb, db, tokens, dst_from = draw(ks.token_requests(src_d, dst_d))
        if draw(st.booleans()):
            tokens, dst_from = None, "zero"
        if draw(st.booleans()):
            sb, db = _absent(draw, sb), _absent(draw, db)
        return src_d, dst_d, sb, db, tokens, dst_from, draw(st.booleans())

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(cases())
    def check(case):
        src_d, dst_d, sb, db, tokens, dst_from, pull = case
        src, dst = EngineSpec.from_dict(src_d), EngineSpec.from_dict(dst_d)
        for r in range((dst if pull else src).num_ranks):
            tmap = pull_map(src, dst, r) if pull else push_map(src, dst, r)
            try:
                plan = tmap.plan(sb, db, tokens=tokens, dst_from=dst_from)
            except KVPlanError as e:
                with pytest.raises(type(e)):
                    plan_nbytes(tmap, sb, db, tokens, dst_from)
                continue
            rows = plan.copies()
            side = rows["src_rank"] if pull else rows["dst_rank"]
            want = {int(p): int(rows["length"][side == p].sum()) for p in tmap.peers}
            got = plan_nbytes(tmap, sb, db, tokens, dst_from)
            assert got == want, (got, want)

    check()


def test_a_staged_open_claiming_the_wrong_size_is_refused_before_planning(monkeypatch):
    """A connected decode's OPEN of 2 x 512 block ids claiming one byte fewer than their plan
    moves (within what the blocks hold, so the older cheap check passes it) is refused with a
    FAIL naming both sizes, and neither planned nor staged on the server; a genuine staged
    pull after it is served and lands the oracle's bytes."""
    import time

    from kvplan import Mode, TransferMap
    from kvplan_nixl.staged import protocol as proto
    from kvplan_nixl.staged import server as staged_server
    from tests.nixl_util import attn, spec
    from tests.test_nixl_staged import SLOT, staged_pair

    src = spec(2, attn(heads=4, nb=512), attn("layers.1.attn", heads=4, nb=512, layout="NHD"))
    dst = spec(1, attn(heads=4, nb=512), attn("layers.1.attn", heads=4, nb=512))
    rng = np.random.default_rng(5)
    sb, db = [rng.permutation(512).tolist()], [rng.permutation(512).tolist()]
    with staged_pair(src, dst) as pr:
        d, p0 = pr.d[0], pr.p[0]
        st = pr.stagers[p0]
        rows = d.map("prefill").plan(sb, db).copies()
        nbytes = int(rows["length"][rows["src_rank"] == 0].sum())
        (msg,) = proto.open_messages("41", Mode.PULL, SLOT, 0, {0: nbytes - 1},
                                     [np.asarray(sb[0])], [np.asarray(db[0])], b"").values()
        planned, staged = [], []
        real_plan, real_stage = TransferMap.plan, staged_server.stage
        monkeypatch.setattr(TransferMap, "plan",
                            lambda self, *a, **k: planned.append(1) or real_plan(self, *a, **k))
        monkeypatch.setattr(staged_server, "stage",
                            lambda *a, **k: staged.append(1) or real_stage(*a, **k))
        sent = []
        monkeypatch.setattr(st.channel, "send", lambda agent, m: sent.append(m) or True)
        t0 = time.process_time()
        st.channel.inbox.append((d.agent_name, msg))
        st.poll()
        took = time.process_time() - t0
        assert planned == [] and staged == [], "the refused OPEN was planned"
        assert [m for m in sent if m.startswith(b"kvs1 FAIL 41 ")] == [
            f"kvs1 FAIL 41 refused: plans disagree: initiator {nbytes - 1} bytes, this side "
            f"{nbytes} bytes for rank 0 (counted before planning)".encode()], sent
        assert st.handles()["serving"] == 0
        monkeypatch.undo()
        t = pr.stagers[d].read(d.map("prefill").plan(sb, db), "prefill", timeout=30)
        t.wait(30, progress=list(pr.stagers.values()))
        pr.check(sb, db)
    print(f"refused in {took * 1e3:.1f} ms of CPU")


# -- item 7 where rank 0 cannot tell the size: an unlisted prefill's unverified claim ---------

#: A stock TP 2 prefill of a 2-KV-head model (a head a rank: rank 0's metadata is the same at
#: TP 2 and TP 4) read by the connector's decode ``Worker`` (tests/restart_peer.py: real NIXL
#: agents, vLLM 0.32's own listener in a process of its own), no ``stock_prefills``.
UNVERIFIED = r"""
from kvplan_nixl.vllm.nixl_peer import fetch_nixl_metadata
from tests.restart_peer import HASH

w, kv = worker("decode", port())
X = port()
p = Prefill("stock", X, "prefill-0", 2, 7, 16)

def outcome(ld):
    before = len(log.lines)
    ok, took = pull(w, ld)
    return ok, took, "\n".join(log.lines[before:])

# claimed TP 4: rank 0 alone is asked for, then the handshake fails by name; before, ranks 1
# to 3 were asked for and vLLM's listener thread died at rank 2 (the prefill answered nobody)
ok, took, why = outcome(load("x4", "prefill-0", X, [2], [22], tp=4))
assert not ok and "NixlTpSizeUnverified: tp_size 4 (the request's)" in why, why
assert "fits TP 2 as well" in why and "ranks 2 to 3 were not asked for" in why, why
assert f"'prefill-0@127.0.0.1:{X}/tp4'" in why and "kv_load_failure_policy" in why, why
for r in range(2):  # the listener still answers each rank it has
    fetch_nixl_metadata("127.0.0.1", X, r, tp_size=2, expected_hash=HASH, timeout_s=5)
# the genuine claim connects at once: the failed claim is not its failure (before, its retry
# would have asked for TP 4 again, for every request, for good)
ld = load("g0", "prefill-0", X, [2, 3], [20, 21], tp=2)
ok, took, why = outcome(ld)
assert ok and read_back(kv, ld, 7, 2), why
# connected as TP 2: a claim of 4 fails by name, nothing asked; a claim of 2 still reads
ok, _, why = outcome(load("x5", "prefill-0", X, [2], [22], tp=4))
assert not ok and "tp_size 4 (the request's): NixlConnector prefill 'prefill-0' at " \
    f"127.0.0.1:{X} is connected as TP 2" in why, why
ld = load("g1", "prefill-0", X, [4, 5], [24, 25], tp=2)
ok, _, why = outcome(ld)
assert ok and read_back(kv, ld, 7, 2), why
w.close()

# listed with /tp2, the same prefill is read at 2 without the check; a claim of 4 is refused
# before anything is dialled
w, kv = worker("decode-2", port(), extra={"stock_prefills": [f"127.0.0.1:{X}/tp2"]})
ok, _, why = outcome(load("y4", "prefill-0", X, [2], [22], tp=4))
assert not ok and "stock_prefills says it runs TP 2, the request's tp_size is 4" in why, why
ld = load("g2", "prefill-0", X, [6, 7], [26, 27], tp=2)
ok, _, why = outcome(ld)
assert ok and read_back(kv, ld, 7, 2), why
w.close()

# gap (c): an empty list refuses every stock prefill, nothing dialled
w, kv = worker("decode-3", port(), extra={"stock_prefills": []})
ok, took, why = outcome(load("z2", "prefill-0", X, [2], [22], tp=2))
assert not ok and "AddressRefused" in why and f"127.0.0.1:{X} is not in " \
    "kv_connector_extra_config['stock_prefills'] (0 address(es))" in why, why
w.close()
p.kill()
print("ok")
"""


def test_an_unverified_tp_claim_asks_for_no_rank_beyond_rank_0(vllm_python):
    """Gap (a') of issue 45 item 7: where rank 0's metadata fits a smaller TP size too (a head
    a rank here; an MLA latent alike), an unlisted stock prefill's claimed ``tp_size`` is
    unverified: the handshake fails with ``NixlTpSizeUnverified`` naming both sizes and the
    ``stock_prefills`` entry that would vouch for it, rank 0 the only rank asked for, and
    vLLM's listener keeps answering; the genuine claim then connects at once and reads right,
    and a claim other than the connected size fails by name. Gap (c): ``stock_prefills: []``
    refuses every stock prefill by name."""
    from tests.test_restarts import DRIVER_SETUP
    from tests.test_vllm_serving import _in_vllm_venv

    _in_vllm_venv(vllm_python, DRIVER_SETUP + UNVERIFIED)


# -- item 8, gap (b): a load failed before its prefill was connected is told once it is -------

#: A stock TP 1 prefill (tests/restart_peer.py: a real NIXL agent, vLLM 0.32's own listener)
#: stopped (SIGSTOP: a starved host) while a request's handshake runs: the load fails, nothing
#: can be told (no NIXL connection yet). Resumed, the next request connects it, and the
#: decode then tells it ``<id>:1`` for the failed one too, once (before: never, so its blocks
#: waited for the prefill's lease).
OWED = r"""
import os, signal
w, kv = worker("decode", port())
X = port()
p = Prefill("stock", X, "prefill-0", 1, 3, 16)
os.kill(p.proc.pid, signal.SIGSTOP)
before = len(log.lines)
ok, _ = pull(w, load("x1", "prefill-0", X, [2, 3], [20, 21]))
why = "\n".join(log.lines[before:])
assert not ok and "SideChannelTimeout" in why, why
os.kill(p.proc.pid, signal.SIGCONT)
time.sleep(5.2)  # the failed handshake is tried again after retry_after_s (5 s)
ld = load("g1", "prefill-0", X, [4, 5], [22, 23])
ok, _ = pull(w, ld)
assert ok and read_back(kv, ld, 3, 1), log.lines[-3:]
end = time.monotonic() + 5
while not {"r-x1:1", "r-g1:1"} <= {m for _, m in p.notifs}:
    assert time.monotonic() < end, p.notifs
    time.sleep(0.01)
    w.results(set())
time.sleep(0.2)
w.results(set())
assert [m for _, m in p.notifs if m.startswith("r-x1:")] == ["r-x1:1"], p.notifs
assert any("told NixlConnector prefill prefill-0, connected since, that 1 request(s)" in m
           for m in log.lines), log.lines[-5:]
p.kill()
w.close()
print("ok")
"""


def test_a_load_failed_before_its_stock_prefill_was_connected_is_told_later(vllm_python):
    """Gap (b) of issue 45 item 8, through the connector's decode ``Worker``: ``<id>:n`` can
    only travel over a NIXL connection, so a load that fails before one exists is kept and its
    prefill told once a later handshake under the same engine, host and port connects it (while
    the prefill's lease still holds the blocks)."""
    from tests.test_restarts import DRIVER_SETUP
    from tests.test_vllm_serving import _in_vllm_venv

    _in_vllm_venv(vllm_python, DRIVER_SETUP + OWED)
