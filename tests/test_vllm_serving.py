"""KvplanConnector as a serving team runs it, in real vLLM engines (vLLM 0.32.0's CPU build):
no request is ever generated from KV the prefill no longer holds (holds, CONFIRM, heartbeats),
the stats reach vLLM's log line and Prometheus and add up, and a slow, stopped or hostile side
channel fails its own pulls without stalling the engine. See docs/vllm.md, "Serving".

Three engines from tests/vllm_pool.py (``short``: leases of 3 s, side channel timeouts of 1 s,
stats on): a prefill with 40 KV blocks (``few``: a freed block is soon given to another
request), a decode under ``recompute`` and one under ``fail``. The first tests need no engine.
"""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import struct
import sys
import threading
import time

import pytest

from tests import venv_runner
from tests.vllm_pool import (
    FAILED,
    Engine,
    check_equal,
    free_base_port,
    pd_equals_plain,
    prompt,
    remove_orphan_shm,
    shm_files,
    tails,
)

P, D, DF = "llama-p1-short-few", "llama-d1-short", "llama-d1-short-fail"
LEASE = 3.0
REMOTE = {"do_remote_decode": True}
NOT_CONFIRMED = r"kvplan: pull req=\S+ from \S+ failed \(not confirmed by prefill rank"


# -- without engines (in the vLLM venv: the connector package imports vLLM) -------------------

SETTINGS_CHECK = r"""
import contextlib, re
from kvplan_nixl.errors import ArgumentError
from kvplan_nixl.serving.settings import Settings

class pytest:  # the vLLM venv has no pytest: its raises(), enough for this check
    @staticmethod
    @contextlib.contextmanager
    def raises(cls, match):
        try:
            yield
        except cls as e:
            assert re.search(match, str(e)), str(e)
        else:
            raise AssertionError(f"no {cls.__name__}")

s = [Settings("e", "127.0.0.1", 5700, tp_size=2, dp_rank=dp) for dp in range(3)]
assert [[x.rank_port(r) for r in range(2)] for x in s] == [[5700, 5701], [5702, 5703],
                                                           [5704, 5705]]
with pytest.raises(ArgumentError, match=r"side_channel_port 65535 .* above 65535"):
    Settings("e", "h", 65535, tp_size=2).rank_port(1)
s = Settings("e", "h", 5700, 1, extra={"lease_s": "0", "nixl_backends": "UCX, GDS"})
with pytest.raises(ValueError, match=r"kv_connector_extra_config\['lease_s'\] must be"):
    s.seconds("lease_s", 120)
assert s.seconds("transfer_timeout_s", 30) == 30.0
assert s.backends() == ("UCX", "GDS")
assert Settings("e", "h", 5700, 1).backends() == ("UCX",)
with pytest.raises(ValueError, match="nixl_backends"):
    Settings("e", "h", 5700, 1, extra={"nixl_backends": []}).backends()
print("ok")
"""

ADDRESS_CHECK = r"""
import os
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvplan_nixl.errors import ArgumentError
from kvplan_nixl.vllm import KvplanConnector

def connector(extra):
    cfg = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="KvplanConnector", kv_connector_module_path="kvplan_nixl.vllm",
        kv_role="kv_producer", kv_buffer_device="cpu", engine_id="pre",
        kv_connector_extra_config=extra))
    return KvplanConnector(cfg, KVConnectorRole.SCHEDULER, None)

os.environ.pop("VLLM_HOST_IP", None)
s = connector({"side_channel_host": "0.0.0.0", "side_channel_advertise_host": "10.0.0.1"})
assert (s.settings.listen_host, s.settings.host) == ("0.0.0.0", "10.0.0.1"), s.settings
assert connector({}).settings.listen_host == connector({}).settings.host == "127.0.0.1"
for extra, env, key in [({"side_channel_host": "0.0.0.0"}, None, "'side_channel_host'"),
                        ({}, "::", "$VLLM_HOST_IP"),
                        ({"side_channel_host": "0.0.0.0",
                          "side_channel_advertise_host": "127.0.0.1"}, None,
                         "'side_channel_advertise_host'")]:
    if env:
        os.environ["VLLM_HOST_IP"] = env
    try:
        connector(extra)
    except ArgumentError as e:
        assert key in str(e) and "side_channel_advertise_host" in str(e), str(e)
    else:
        raise AssertionError(f"{extra} {env} accepted")
    os.environ.pop("VLLM_HOST_IP", None)
print("ok")
"""

OUTCOMES_CHECK = r"""
from vllm.v1.outputs import KVConnectorOutput
from kvplan_nixl.serving.loads import Load
from kvplan_nixl.serving.outcomes import LoadOutcomes
from kvplan_nixl.vllm.stats import KvplanStats

def load(req, blocks, parked=True):
    return Load(req_id=req, remote_req="r" + req, engine="pre", host="10.0.0.1", port=5700,
                remote_tp=1, remote_ids=[[1, 2]], remote_first=[0], local_ids=[blocks],
                start=0, end=64, parked=parked)

stats = KvplanStats()
o = LoadOutcomes("recompute", stats)
for x in (load("a", [3, 4]), load("b", [5, 6]), load("c", [7]), load("d", [8], parked=False)):
    o.started(x)
o.update(KVConnectorOutput(finished_recving={"a", "b"}, invalid_block_ids={6}))
o.update(KVConnectorOutput(finished_recving={"c"}, failed_recving={"c"}))
assert o.finished("a") is None                      # loaded: nothing added
assert o.finished("b") == {"kvplan_load_failed": {"remote_engine_id": "pre",
    "remote_host": "10.0.0.1", "remote_port": 5700, "policy": "recompute"}}
assert o.finished("c")["kvplan_load_failed"]["policy"] == "recompute"  # a hybrid's, by id
assert o.finished("b") is None and o.finished("d") is None  # once; an unparked load: never
st = stats.clone_and_reset()  # what the scheduler's take_stats hands vLLM
assert st.data["num_failed_loads"] == [1, 1] and st.reduce()["Num failed loads"] == 2
assert stats.is_empty() and not o.pending
print("ok")
"""

LOGGING_CHECK = r"""
import io, logging
from vllm.logger import _configure_vllm_root_logger
import kvplan_nixl.vllm  # the connector: links the serving modules' loggers under vLLM's
from kvplan_nixl.serving import control, host_pools, pulls

def lines(configure):
    if configure:  # what each engine process does at its start (dictConfig), once or again
        _configure_vllm_root_logger()
    out = io.StringIO()
    logging.getLogger("vllm").handlers[0].setStream(out)
    pulls.logger.info("kvplan: decode req=%s done in %.3f s, confirmed by prefill rank(s) %s",
                      "d-1", 0.25, [0, 1])
    control.logger.debug("kvplan: below vLLM's level, not shown")
    host_pools.logger.warning("kvplan: a job failed")
    return out.getvalue().splitlines()

for configure in (True, True):
    got = lines(configure)
    assert len(got) == 2, got
    assert " INFO " in got[0] and got[0].endswith(
        "kvplan: decode req=d-1 done in 0.250 s, confirmed by prefill rank(s) [0, 1]"), got
    assert " WARNING " in got[1] and got[1].endswith("kvplan: a job failed"), got
# the level is vLLM's at each call: lowered there, the serving modules' debug lines show
logging.getLogger("vllm").setLevel(logging.DEBUG)
logging.getLogger("vllm").handlers[0].setLevel(logging.DEBUG)
assert any(x.endswith("below vLLM's level, not shown") for x in lines(False))
print("ok")
"""

HOLDS_CHECK = r"""
import time
from types import SimpleNamespace
from kvplan_nixl.serving.holds import Verdict, new_generation
from kvplan_nixl.serving.control import Control, Sends

sends = Sends("127.0.0.1", 0, "pre#0", b"md", secret="s", lease=0.5)
ctl = Control("s", timeout=1.0)
port = sends.server.port
load = lambda req, gen: SimpleNamespace(engine="pre", host="127.0.0.1", port=port,
                                        remote_req=req, generation=gen)
g1, g2, g3 = new_generation(), new_generation(), new_generation()
sends.hold([("a", g1), ("b", g2)])
assert sends.finished()[0] == set()                      # held: not freed
assert ctl.send(load("a", g1), 0, "RENEW") is Verdict.YES
assert ctl.send(load("a", g1), 0, "CONFIRM", 2) is Verdict.YES  # 1 of 2 readers
assert sends.finished()[0] == set()
assert ctl.send(load("a", g1), 0, "CONFIRM", 2) is Verdict.YES  # the last reader
assert ctl.send(load("a", g1), 0, "CONFIRM", 2) is Verdict.NO   # ended: never again
time.sleep(0.6)                                          # b's lease runs out
assert ctl.send(load("b", g2), 0, "CONFIRM", 1) is Verdict.NO
done, counts = sends.finished()
assert done == {"a", "b"} and counts["expired"] == 1 and counts["refused"] == 2, counts
bad = Control("other secret", timeout=1.0).send(load("x", g3), 0, "RELEASE")
assert isinstance(bad, str) and "forged" in bad, bad          # counted and dropped
assert isinstance(ctl.send(load("x", g3), 1, "RENEW"), str)    # wrong rank's identity
assert sends.finished()[1]["dropped"] == 1
sends.hold([("c", 5)])                                   # a generation below the floor
assert sends.finished()[0] == {"c"}                      # freed at once, never confirmable
g4 = new_generation()                                    # a LEASE pins the hold:
sends.hold([("d", g4)])
before = time.monotonic()
v, sent = ctl.lease(load("d", g4), 0, 2.0)
assert v is Verdict.YES and before <= sent <= time.monotonic(), (v, sent)
assert ctl.send(load("d", g4), 0, "RELEASE") is Verdict.YES   # deferred under the pin
assert sends.finished()[0] == set()
assert ctl.send(load("d", g4), 0, "RETURN", 1) is Verdict.YES  # the reader returns it
done, counts = sends.finished()
assert done == {"d"} and counts["deferred"] == 1 and counts["leased"] == 1, counts
assert isinstance(Control("other", timeout=1.0).lease(load("d", g4), 0, 2.0)[0], str)
ctl.close(); sends.close()
print("ok")
"""


SCHEDULER_CHECK = r"""
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus
from kvplan_nixl.vllm.scheduler import Scheduler
from kvplan_nixl.serving.settings import Settings

spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                    kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], spec)])
s = Scheduler(Settings("dec", "127.0.0.1", 5700, 1), cfg)
blocks = KVCacheBlocks(([KVCacheBlock(block_id=i) for i in (5, 6, 7)],))
GOOD = {"do_remote_prefill": True, "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "p",
        "remote_request_id": "r-x", "remote_host": "127.0.0.1", "remote_port": 5999,
        "tp_size": 1}

def req(i, params):
    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
    return Request(f"r{i}", list(range(2, 42)), sp, None)

BAD = [("remote_port", "abc"), ("tp_size", "x"), ("remote_block_ids", 5),
       ("tp_size", 10**9), ("remote_port", 70000), ("remote_block_ids", [[1], [2]])]
for i, (k, v) in enumerate(BAD):  # vLLM's order: admission, match, allocation, metadata
    r = req(i, dict(GOOD, **{k: v}))
    s.new_request(r)
    assert s.matched(r, 0) == (40, True), k  # waits: its load fails into the policy
    s.allocated(r, blocks, 40)
    (load,) = s.meta().loads
    assert f"kv_transfer_params[{k!r}]" in load.refused and load.parked, load
    assert load.remote_tp == 0 and load.host == "" and load.local_ids == ((5, 6, 7),), load
    assert s.finished(r, ([5, 6, 7],)) == (False, None) and not s.meta().loads
r = req(90, dict(GOOD, tp_size=10**9))  # aborted before it was scheduled: nothing released
s.new_request(r)
assert s.finished(r, ([],)) == (False, None) and not s.meta().loads
r = req(91, dict(GOOD))  # the genuine one: released on abort, to its one rank
s.new_request(r)
s.finished(r, ([],))
(load,) = s.meta().loads
assert not load.refused and load.remote_tp == 1 and load.port == 5999 and not load.parked
r = req(92, {"do_remote_decode": True, "transfer_mode": "bogus"})  # a prefill: served plain
s.new_request(r)
s.allocated(r, blocks, 0)
r.status = RequestStatus.FINISHED_LENGTH_CAPPED
assert s.finished(r, ([5, 6, 7],)) == (False, None)
assert not s.sources and not s.handovers  # nothing left behind
print("ok")
"""


BEATS_CHECK = r"""
import time
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from kvplan_nixl.vllm.scheduler import Scheduler
from kvplan_nixl.serving.settings import Settings

assert Settings("dec", "127.0.0.1", 5700, 1).nixl_heartbeat() == 5.0  # vLLM's 30 s / 6
spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                    kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], spec)])
s = Scheduler(Settings("dec", "127.0.0.1", 5700, 1, extra={"kv_lease_duration": 1.2}), cfg)
blocks = KVCacheBlocks(([KVCacheBlock(block_id=i) for i in (5, 6, 7)],))
STOCK = {"do_remote_prefill": True, "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "p",
         "remote_host": "127.0.0.1", "remote_port": 5999, "tp_size": 1,
         "transfer_mode": "pull", "remote_num_tokens": 40}

def req(i, **params):
    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": dict(STOCK, **params)})
    return Request(f"r{i}", list(range(2, 42)), sp, None)

a, b = req(1, remote_request_id="p-a"), req(2, remote_request_id="q-b", remote_engine_id="q")
k = req(3, remote_request_id="k", transfer_mode="kvplan")  # a kvplan prefill: its own leases
for r in (a, b, k):
    s.new_request(r)
assert s.meta().beats == {"p": ["p-a"], "q": ["q-b"]}  # queued: beaten at once
assert s.meta().beats == {}  # and not again within kv_lease_duration / 6
time.sleep(0.25)
s.matched(a, 0)
s.allocated(a, blocks, 40)  # scheduled: its read beats from now on, not the scheduler
m = s.meta()
assert m.beats == {"q": ["q-b"]} and [x.req_id for x in m.loads] == ["r1"], m
time.sleep(0.25)
s.finished(b, ([],))  # aborted while queued: no more beats for it
assert s.meta().beats == {}
print("ok")
"""


def _in_vllm_venv(py, script: str) -> None:
    """Run ``script`` by the vLLM venv's interpreter ``py`` (forked from one that imported
    torch and vLLM already: tests/venv_runner.py); it prints ``ok`` at its end."""
    rc, out, err = venv_runner.run(py, script, timeout=300)
    assert rc == 0 and out.strip().endswith("ok"), f"exit status {rc}\n{out}{err}"


def test_ports_by_data_parallel_rank_and_config_keys_checked_by_name(vllm_python):
    _in_vllm_venv(vllm_python, SETTINGS_CHECK)


def test_addresses_that_cannot_work_are_refused_when_the_connector_is_made(vllm_python):
    """The facade reads the bind and advertised addresses (kvplan_nixl.serving.addresses): a
    wildcard or a loopback advertised beside a bind that serves other hosts stops the engine at
    start, naming the key or variable; a wildcard bind with an advertised address is taken."""
    _in_vllm_venv(vllm_python, ADDRESS_CHECK)


def test_failed_loads_are_told_once_per_request(vllm_python):
    """The scheduler learns a load failed from the workers' output (blocks, or the request
    for several groups), adds ``kvplan_load_failed`` to its params once, and counts it."""
    _in_vllm_venv(vllm_python, OUTCOMES_CHECK)


def test_bad_params_fail_their_request_at_the_connectors_scheduler_entry_points(vllm_python):
    """Issue 36, item 1, through the scheduler half with vLLM's own Request and block
    objects: a bad field never raises, the request's load is refused (it fails into the
    policy), nothing is built from its tp_size, host or port."""
    _in_vllm_venv(vllm_python, SCHEDULER_CHECK)


def test_requests_queued_for_a_nixlconnector_prefill_are_heartbeaten(vllm_python):
    """A decode request whose KV a NixlConnector prefill holds is heartbeaten from admission,
    as NixlConnector's own decode does (its lease would otherwise run out while the request
    waits in the queue), every ``kv_lease_duration / 6``, until it is scheduled (its read
    beats then) or aborted; a kvplan prefill's request is not (its lease is kvplan's)."""
    _in_vllm_venv(vllm_python, BEATS_CHECK)


def test_serving_modules_log_through_vllms_logger(vllm_python):
    """The lifecycle's modules log on stdlib loggers (``kvplan_nixl.serving.*``); the
    connector links them under ``vllm.kvplan_nixl``, so their lines show in an engine's log in
    vLLM's format and at its level, as when they lived in ``kvplan_nixl.vllm`` (the engine
    tests grep them), also after vLLM configures its logging again."""
    _in_vllm_venv(vllm_python, LOGGING_CHECK)


def test_prefill_holds_and_decode_control_messages_over_the_side_channel(vllm_python):
    """control.py's two sides: holds end by the last reader's CONFIRM or the lease, only
    ended holds are freed, a refused, forged or misaddressed message changes nothing."""
    _in_vllm_venv(vllm_python, HOLDS_CHECK)


def _fake_engine(name: str, seen: dict, answer, before=None):
    """An HTTP server standing in for an engine: records each POST body in ``seen[name]``,
    calls ``before()`` (if any), answers ``answer`` (a JSON body with status 200, or a
    callable returning ``(status, body)``)."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen[name] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if before is not None:
                before()
            code, body = answer() if callable(answer) else (200, answer)
            out = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a: object) -> None:
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _through_proxy(pre, dec, body: dict, push: dict | None = None) -> dict:
    """``body`` POSTed to examples/pd_proxy.py between the fake engines; its answer."""
    import json
    import urllib.request

    from examples import pd_proxy

    proxy = pd_proxy.serve(f"http://127.0.0.1:{pre.server_address[1]}",
                           f"http://127.0.0.1:{dec.server_address[1]}", port=0, push=push)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{proxy.server_address[1]}"
                                     "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=20) as r:
            return json.loads(r.read())
    finally:
        for srv in (proxy, pre, dec):
            srv.shutdown()
            srv.server_close()


def test_example_proxy_hands_the_prefill_params_to_the_decode():
    """examples/pd_proxy.py against two fake engines: the prefill gets one token and
    do_remote_decode, the decode the client's request with the prefill's params."""
    seen: dict[str, dict] = {}
    params = {"do_remote_prefill": True, "remote_generation": 2**62 + 1}
    pre = _fake_engine("prefill", seen, {"kv_transfer_params": params})
    dec = _fake_engine("decode", seen, {"choices": [{"text": "hi"}]})
    body = {"model": "m", "prompt": "x", "max_tokens": 7, "stream": True}
    assert _through_proxy(pre, dec, body) == {"choices": [{"text": "hi"}]}
    assert seen["prefill"] == dict(body, max_tokens=1, stream=False,
                                   kv_transfer_params={"do_remote_decode": True})
    assert seen["decode"] == dict(body, kv_transfer_params=params)  # 63-bit int intact


def test_example_proxy_in_push_mode_sends_both_legs_under_one_transfer_id():
    """examples/pd_proxy.py with ``push``: the decode leg names the prefill engine (no block
    ids), the prefill leg asks for the push mode, both under one fresh transfer_id."""
    seen: dict[str, dict] = {}
    got_prefill = threading.Event()
    pre = _fake_engine("prefill", seen, {"choices": [{"text": "prefill"}]}, got_prefill.set)
    # the decode answers once the prefill leg came (as a push decode waits for its write)
    dec = _fake_engine("decode", seen, {"choices": [{"text": "decode"}]},
                       lambda: got_prefill.wait(10))
    push = {"engine_id": "prefill-0", "host": "10.0.0.1", "port": 5700, "tp": 2,
            "mode": "layerwise"}
    body = {"model": "m", "prompt": "x", "max_tokens": 7}
    assert _through_proxy(pre, dec, body, push) == {"choices": [{"text": "decode"}]}
    assert got_prefill.is_set()
    tid = seen["decode"]["kv_transfer_params"]["transfer_id"]
    assert len(tid) == 32
    assert seen["decode"] == dict(body, kv_transfer_params={
        "do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_host": "10.0.0.1",
        "remote_port": 5700, "tp_size": 2, "transfer_id": tid})
    assert seen["prefill"] == dict(body, max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "transfer_mode": "layerwise", "transfer_id": tid})


class _Prefill:
    """A prefill's HTTP server (fake) and its rank side channels (real, with a hold table):
    answers one kvplan pull's params for request ``req`` held under a fresh generation."""

    def __init__(self, seen: dict, tp: int = 2, secret: str = "s") -> None:
        from kvplan_nixl.serving import sidechannel as sc
        from kvplan_nixl.serving.holds import Holds, new_generation

        self.req, self.gen = "pre-req-1", new_generation()
        base = free_base_port(tp)  # rank r listens on base + r, as an engine's ranks do
        self.holds = [Holds() for _ in range(tp)]
        self.servers = [sc.SideChannelServer("127.0.0.1", base + r, sc.server_identity("pre", r),
                                             secret=secret, holds=h)
                        for r, h in enumerate(self.holds)]
        for h in self.holds:
            h.hold(self.req, time.monotonic(), 120.0, self.gen)
        self.params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]],
                       "remote_engine_id": "pre", "remote_request_id": self.req,
                       "remote_host": "127.0.0.1", "remote_port": base, "tp_size": tp,
                       "transfer_mode": "kvplan", "remote_generation": str(self.gen)}
        self.http = _fake_engine("prefill", seen, {"kv_transfer_params": self.params})

    def held(self) -> list[bool]:
        out = []
        for srv, h in zip(self.servers, self.holds):
            with srv.lock:
                out.append(self.req in h)
        return out

    def close(self) -> None:
        for srv in self.servers:
            srv.close()
        self.http.shutdown()
        self.http.server_close()


def _post(proxy, body: dict, timeout: float = 20) -> tuple[int, bytes]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{proxy.server_address[1]}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _proxy(pre: _Prefill, decode_url: str, secret: str | None = "s"):
    from examples import pd_proxy

    proxy = pd_proxy.serve(f"http://127.0.0.1:{pre.http.server_address[1]}", decode_url,
                           port=0, secret=secret)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    return proxy


def _wait(cond, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_example_proxy_answers_a_dead_decode_502_and_releases_the_prefill(capfd):
    """The decode down: a 502 naming it (not an empty reply), and every prefill rank's hold
    ended at once by the proxy's RELEASE (it used to stay for lease_s)."""
    import json

    seen: dict[str, dict] = {}
    pre = _Prefill(seen)
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{gone.getsockname()[1]}"
    proxy = _proxy(pre, dead)
    try:
        assert pre.held() == [True, True]
        status, body = _post(proxy, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
        assert status == 502, body
        err = json.loads(body)["error"]
        assert err.startswith(f"decode {dead} failed: ") and "refused" in err, err
        assert pre.held() == [False, False]  # released before the 502 went out
        assert [h.counts["released"] for h in pre.holds] == [1, 1]
        log = capfd.readouterr().err
        assert "pd_proxy: decode unreachable" in log and "RELEASE of prefill req=pre-req-1: " \
            "rank 0 at 127.0.0.1" in log and log.count(": YES") == 2, log
    finally:
        proxy.shutdown()
        proxy.server_close()
        pre.close()


def test_example_proxy_releases_after_a_decode_error_not_after_a_decode_answer():
    """A decode's own HTTP error is relayed as is and releases the prefill's hold; a decode
    that answered leaves it alone (its pull's CONFIRM ends it)."""
    seen: dict[str, dict] = {}
    pre = _Prefill(seen, tp=1)
    answers = [(200, {"choices": []}), (500, {"error": "boom"})]
    dec = _fake_engine("decode", seen, lambda: answers[0])
    proxy = _proxy(pre, f"http://127.0.0.1:{dec.server_address[1]}")
    try:
        assert _post(proxy, {"model": "m", "prompt": "x"}) == (200, b'{"choices": []}')
        assert seen["prefill"]["kv_transfer_params"] == {"do_remote_decode": True}
        assert pre.held() == [True]  # answered: not the proxy's to release
        answers.pop(0)
        assert _post(proxy, {"model": "m", "prompt": "x"}) == (500, b'{"error": "boom"}')
        assert pre.held() == [False]
    finally:
        for srv in (proxy, dec):
            srv.shutdown()
            srv.server_close()
        pre.close()


def test_example_proxy_releases_when_the_client_leaves_mid_stream():
    """The client gone while the decode streams: the proxy stops relaying and releases."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: dict[str, dict] = {}
    pre = _Prefill(seen, tp=1)

    class Decode(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(400):  # a long stream of tokens, 20 s at most
                    self.wfile.write(b"%x\r\n%s\r\n" % (4096, b"t" * 4096))
                    self.wfile.flush()
                    time.sleep(0.05)

        def log_message(self, *a: object) -> None:
            pass
    dec = ThreadingHTTPServer(("127.0.0.1", 0), Decode)
    threading.Thread(target=dec.serve_forever, daemon=True).start()
    proxy = _proxy(pre, f"http://127.0.0.1:{dec.server_address[1]}")
    try:
        body = b'{"model": "m", "prompt": "x", "stream": true}'
        with socket.create_connection(("127.0.0.1", proxy.server_address[1])) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            assert c.recv(64).startswith(b"HTTP/1.1 200")  # the stream started
            assert pre.held() == [True]
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset
        assert _wait(lambda: pre.held() == [False]), "the hold outlived the client"
    finally:
        for srv in (proxy, dec):
            srv.shutdown()
            srv.server_close()
        pre.close()


# -- real engines ------------------------------------------------------------------------------

def _metric(m: dict, name: str, field: str = "value") -> float:
    """A metric's value (counters: vLLM's reader may name them with or without _total)."""
    x = m.get(name) or m.get(name + "_total")
    return 0.0 if x is None else float(x[field])


def _wait_metric(e, name: str, low: float) -> float:
    """``name`` once it reached ``low``: the connector reports its counts on the engine's next
    step, so an idle engine is given one (a 1-token request) while waiting (at most 30 s)."""
    deadline = time.monotonic() + 30
    while (v := _metric(e.metrics(), name)) < low and time.monotonic() < deadline:
        e.generate(prompt(999, 8), 1)
        time.sleep(1.2)  # one stats interval
    return v


def _pull_numbers(line: str) -> tuple[int, int]:
    return int(re.search(r"bytes=(\d+)", line).group(1)), int(re.search(r"runs=(\d+)",
                                                                         line).group(1))


@pytest.mark.engines("llama")
def test_confirmed_pulls_and_stats_add_up(pool):
    p, d = pool.only(P, D)
    m0, pm0 = d.metrics(), p.metrics()
    # each pull is reported inside its LEASE (its CONFIRM, a RETURN, after the report), or
    # after its CONFIRM when the read was seen complete too late (a loaded host)
    done_re = r"kvplan: pull req=\S+ done in .*(confirmed by|inside its lease on) prefill rank"
    leased_re = r"kvplan: pull req=\S+ done in .*inside its lease on prefill rank\(s\) \[0\]"
    done0, leased0 = len(d.log_lines(done_re)), len(d.log_lines(leased_re))
    pulls, pulls_runs = [], []
    for seed in (21, 22):
        t0 = time.monotonic()
        pulls.append(pd_equals_plain(p, d, prompt(seed), f"P -> D, seed {seed}")[-1])
        pulls_runs.append((seed, time.monotonic() - t0))  # prefill leg, decode leg, plain run
    deadline = time.monotonic() + 10
    while len(d.log_lines(done_re + r"\(s\) \[0\]")) < done0 + 2:
        assert time.monotonic() < deadline, f"pulls not confirmed{tails()}"
        time.sleep(0.2)
    leased = len(d.log_lines(leased_re)) - leased0
    assert leased >= 1, f"no pull reported inside its lease{tails()}"
    time.sleep(1.5)  # one stats interval (VLLM_LOG_STATS_INTERVAL=1)
    m1, pm1 = d.metrics(), p.metrics()
    count = "vllm:kvplan_xfer_time_seconds"
    assert _metric(m1, count, "count") - _metric(m0, count, "count") == 2, (m0, m1)
    nbytes, runs = (sum(x) for x in zip(*map(_pull_numbers, pulls)))
    assert nbytes > 0 and runs > 0
    got = _metric(m1, "vllm:kvplan_bytes_transferred", "sum") \
        - _metric(m0, "vllm:kvplan_bytes_transferred", "sum")
    assert got == nbytes, (got, nbytes, pulls)
    got = _metric(m1, "vllm:kvplan_num_runs", "sum") - _metric(m0, "vllm:kvplan_num_runs", "sum")
    assert got == runs, (got, runs, pulls)
    assert _metric(m1, "vllm:kvplan_num_leased_pulls") \
        - _metric(m0, "vllm:kvplan_num_leased_pulls") == leased, (m0, m1)
    for m in (m1, pm1):  # nothing failed, expired or was refused
        for k in ("num_failed_transfers", "num_confirmations_refused", "num_kv_expired_reqs",
                  "num_returns_refused"):
            assert _metric(m, f"vllm:kvplan_{k}") == _metric(m0 if m is m1 else pm0,
                                                             f"vllm:kvplan_{k}"), k
    # each pull's timeline (stats.PHASES): two of every phase, none negative, the phases
    # adding up to the handover, the read inside it (the CONFIRM too, unless the pull was
    # reported inside its lease: then the wait for the LEASE answers, maybe 0); the log's
    # phases add up to its handover, which is below the decode's whole run of the request
    phases = ("handshake", "post", "read", "confirm", "report")
    sums = {k: _metric(m1, f"vllm:kvplan_phase_{k}_seconds", "sum")
            - _metric(m0, f"vllm:kvplan_phase_{k}_seconds", "sum") for k in (*phases, "handover")}
    for k in (*phases, "handover"):
        name = f"vllm:kvplan_phase_{k}_seconds"
        assert _metric(m1, name, "count") - _metric(m0, name, "count") == 2, (k, m1.get(name))
        assert sums[k] >= 0, (k, sums)
    assert abs(sum(sums[k] for k in phases) - sums["handover"]) < 1e-6, sums
    assert sums["read"] > 0 and sums["confirm"] >= 0 and sums["handover"] < 10, sums
    timeline = re.compile(r"kvplan: pull req=\S+ reported after ([\d.]+) ms: handshake ([\d.]+), "
                          r"post ([\d.]+), read ([\d.]+), confirm ([\d.]+), report ([\d.]+) ms")
    logged = [[float(x) for x in timeline.search(ln).groups()]
              for ln in d.log_lines(timeline.pattern)[-2:]]
    assert len(logged) == 2, d.tail()
    for (total, *parts), (_, run) in zip(logged, pulls_runs):
        assert abs(sum(parts) - total) < 0.05 and min(parts) >= 0, (total, parts)
        assert parts[2] > 0 and parts[3] >= 0 and total < run * 1e3, (total, parts, run)
    # vLLM's own log line carries them
    lines = d.log_lines(r"KV Transfer metrics: .*Num successful transfers=[1-9]")
    assert lines and "Num confirmations refused=" in lines[-1], d.tail()
    # the prefill freed both requests on the decode's CONFIRM (RETURN), not by its lease
    assert len(p.log_lines(r"kvplan: prefill req=\S+ released$")) >= 2, p.tail()


@pytest.mark.engines("llama")
def test_lease_ran_out_before_the_pull_and_blocks_reused_is_recomputed(pool):
    p, d = pool.only(P, D)
    ids = prompt(31)
    plain = p.generate(ids, 16)
    a = p.generate(ids, 1, REMOTE)["params"]
    refused0 = _metric(p.metrics(), "vllm:kvplan_num_confirmations_refused")
    time.sleep(LEASE + 1)  # the hold runs out, then the prefill gives its blocks away
    fillers = [p.generate(prompt(32 + i, 700), 1, REMOTE)["params"] for i in range(2)]
    theirs = set().union(*(f["remote_block_ids"][0] for f in fillers))
    reused = set(a["remote_block_ids"][0]) & theirs
    assert reused, f"the prefill did not reuse {a['remote_block_ids']} ({theirs})"
    assert p.log_lines(rf"kvplan: prefill req={re.escape(a['remote_request_id'])} lease of "
                       r"3 s ran out"), p.tail()
    before = len(d.log_lines(NOT_CONFIRMED))
    got = d.generate(ids, 16, dict(a))  # reads the fillers' KV: refused, recomputed
    assert got["error"] is None, got
    check_equal(got, plain, "decode after its prefill's lease ran out (policy recompute)")
    assert len(d.log_lines(NOT_CONFIRMED)) == before + 1, d.tail()
    assert _wait_metric(p, "vllm:kvplan_num_confirmations_refused", refused0 + 1) \
        == refused0 + 1


@pytest.mark.engines("llama")
def test_lease_ran_out_during_the_pull_is_recomputed_and_the_engine_serves_on(pool):
    p, d = pool.only(P, D)
    ids, other = prompt(41), prompt(42)
    plain, plain_other = p.generate(ids, 16), p.generate(other, 16)
    a = p.generate(ids, 1, REMOTE)["params"]
    before, confirmed0 = len(d.log_lines(FAILED)), len(d.log_lines(NOT_CONFIRMED))
    p.signal(signal.SIGSTOP)  # the prefill freezes: no heartbeat answered, no read served
    resume = threading.Timer(LEASE + 2, p.signal, (signal.SIGCONT,))
    resume.start()
    try:
        got, plain2 = d.batch([{"prompt": ids, "max_tokens": 16, "params": dict(a)},
                               {"prompt": other, "max_tokens": 16, "params": None}])
    finally:
        resume.join()
        p.signal(signal.SIGCONT)
    check_equal(got, plain, "decode whose prefill froze past its lease (policy recompute)")
    check_equal(plain2, plain_other, "a plain request beside it")
    # the plain request finished while the prefill was still frozen: nothing waited for its
    # side channel on the engine step
    assert plain2["seconds"] < LEASE + 1, (plain2, got)
    assert len(d.log_lines(FAILED)) == before + 1, d.tail()
    assert len(d.log_lines(NOT_CONFIRMED)) == confirmed0 + 1, d.tail()
    # the prefill serves on, and the next pull from it is confirmed
    pd_equals_plain(p, d, prompt(43), "P -> D after the prefill resumed")


class _Hostile(threading.Thread):
    """A side channel that never answers (``silent``) or, after a valid banner, claims a
    4 GiB metadata blob (``huge``)."""

    def __init__(self, kind: str) -> None:
        super().__init__(daemon=True)
        self.kind, self.conns = kind, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.start()

    def run(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            if self.kind == "huge":
                c.sendall(b"KVPSC1 " + b"ab" * 16 + b" huge%230\n")
                c.recv(16)
                c.sendall(b"\xff\xff\xff\xff")

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.engines("llama")
def test_hostile_side_channels_fail_their_pulls_only(pool):
    p, d = pool.only(P, D)
    ids, other = prompt(51), prompt(52)
    plain, plain_other = p.generate(ids, 16), p.generate(other, 16)
    a = p.generate(ids, 1, REMOTE)["params"]
    silent, huge = _Hostile("silent"), _Hostile("huge")
    failed_loads = _metric(d.metrics(), "vllm:kvplan_num_failed_loads")
    try:
        t0 = time.monotonic()
        res = d.batch([
            {"prompt": ids, "max_tokens": 16,
             "params": dict(a, remote_engine_id="silent", remote_port=silent.port)},
            {"prompt": ids, "max_tokens": 16,
             "params": dict(a, remote_engine_id="huge", remote_port=huge.port)},
            {"prompt": other, "max_tokens": 16, "params": None},
            # finding 9: a prefill that advertised loopback from another host makes the
            # decode dial its own side channel, which answers as itself
            {"prompt": ids, "max_tokens": 16,
             "params": dict(a, remote_engine_id="elsewhere", remote_port=d.port)}])
        took = time.monotonic() - t0
    finally:
        silent.close()
        huge.close()
    check_equal(res[0], plain, "a pull from a silent side channel (recomputed)")
    check_equal(res[1], plain, "a pull from a side channel claiming 4 GiB (recomputed)")
    check_equal(res[2], plain_other, "a plain request beside them")
    check_equal(res[3], plain, "a pull that dialled the decode's own side channel")
    assert res[2]["seconds"] < res[0]["seconds"] and res[2]["seconds"] < 4, res
    assert took < 30, took
    assert d.log_lines(r"from silent failed \(handshake failed: rank 0: SideChannelTimeout"), \
        d.tail()
    assert d.log_lines(r"from huge failed \(handshake failed: rank 0: SideChannelProtocolError"
                       r".*4294967295 bytes, above the limit"), d.tail()
    # never a silent recompute: the cause with the address dialled, a WARNING per request,
    # the response's kv_transfer_params and a count once per request
    assert d.log_lines(rf"from elsewhere failed \(handshake failed: rank 0: SideChannelRejected"
                       rf".*; dialled 127\.0\.0\.1:{d.port}, as the prefill advertised; a "
                       r"loopback address: a prefill on another host must advertise"), d.tail()
    for r, engine, port in ((res[0], "silent", silent.port), (res[1], "huge", huge.port),
                            (res[3], "elsewhere", d.port)):
        assert r["params"] == {"kvplan_load_failed": {
            "remote_engine_id": engine, "remote_host": "127.0.0.1", "remote_port": port,
            "policy": "recompute"}}, r
        rid = re.escape(r["id"])
        assert d.log_lines(rf"WARNING.*kvplan: decode req={rid}\S* loaded no KV from prefill "
                           rf"{engine} at 127\.0\.0\.1:{port} \(pull mode\): vLLM's "
                           r"kv_load_failure_policy=recompute recomputes its prompt"), d.tail()
    assert res[2]["params"] is None, res[2]
    assert _wait_metric(d, "vllm:kvplan_num_failed_loads", failed_loads + 3) == failed_loads + 3


@pytest.mark.engines("llama")
def test_fail_policy_fails_the_request_whose_hold_ended(pool):
    p, d = pool.only(P, DF)
    ids = prompt(61)
    plain = p.generate(ids, 16)
    a = p.generate(ids, 1, REMOTE)["params"]
    time.sleep(LEASE + 1)
    p.generate(prompt(62), 1)  # a step on the prefill: the ended hold is reported and freed
    got = d.generate(ids, 16, dict(a))
    # vLLM fails the request (no tokens from the unconfirmed KV), and decode serves on
    assert got["error"] is not None or got["finish"] not in ("length", "stop"), got
    assert got["tokens"] != plain["tokens"], got
    assert d.log_lines(NOT_CONFIRMED), d.tail()
    pd_equals_plain(p, d, prompt(63), "a confirmed pull under the fail policy")
    assert _wait_metric(d, "vllm:kvplan_num_failed_transfers", 1) >= 1
    assert _wait_metric(p, "vllm:kvplan_num_kv_expired_reqs", 2) >= 2



#: Params an HTTP client may send a decode (issue 36, item 1): each took the engine down
#: (raised out of vLLM's scheduler step) or was used unchecked before.
GENUINE = {"do_remote_prefill": True, "remote_block_ids": [[1, 2, 3]],
           "remote_engine_id": "pre-x", "remote_request_id": "r-x", "remote_host": "127.0.0.1",
           "remote_port": 5999, "tp_size": 1}
HOSTILE = [("remote_port", "abc"), ("tp_size", "x"), ("remote_block_ids", 5),
           ("tp_size", 10**9), ("remote_port", 70000), ("remote_block_ids", [[1, -5]]),
           ("remote_block_ids", [[[[[[1]]]]]]), ("do_remote_prefill", "yes"),
           ("remote_host", "a b"), ("remote_generation", [1])]


@pytest.mark.engines("llama")
def test_hostile_params_fail_their_own_request_and_the_engine_serves_on(pool):
    """Each bad field of a decode's kv_transfer_params fails that request alone, named in the
    log with its value, into kv_load_failure_policy (recomputed under recompute, failed under
    fail), nobody is contacted at the address it names, and the engine serves on."""
    d, df = pool.only(D, DF)
    ids, other = prompt(71), prompt(72)
    plain, plain_other = d.generate(ids, 16), d.generate(other, 16)
    reqs = [{"prompt": ids, "max_tokens": 16, "params": dict(GENUINE, **{k: v})}
            for k, v in HOSTILE]
    res = d.batch([*reqs, {"prompt": other, "max_tokens": 16, "params": None}])
    for (k, v), got in zip(HOSTILE, res, strict=False):
        check_equal(got, plain, f"a decode with kv_transfer_params[{k!r}] = {v!r} (recomputed)")
        assert d.log_lines(rf"decode req=\S+ refused, .*kv_transfer_params\[{k!r}\] = "), \
            f"{k}: {d.tail()}"
    check_equal(res[-1], plain_other, "a plain request beside them")
    assert not d.log_lines(r"could not release req=r-x"), d.tail()  # nobody contacted
    res = df.batch(reqs[:4])
    for (k, _v), got in zip(HOSTILE, res, strict=False):
        assert got["error"] is not None or got["finish"] not in ("length", "stop"), (k, got)
    check_equal(df.generate(other, 16), plain_other, "the fail-policy engine serves on")


@pytest.fixture(scope="module")
def failed_starts(pool):
    """The two engines that must fail at start-up, started together (each start is half a
    minute of one core; there are two): ``taken`` on a side channel port a socket holds,
    ``wildcard`` told to advertise ``0.0.0.0``. Both stopped after the module."""
    pool.only()  # the cores back
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        engines = {
            "taken": Engine("llama-p1-taken", pool.py, pool.model("llama"), pool.workdir,
                            tp=1, cores="0", port=port),
            "wildcard": Engine("llama-p1-wildcard", pool.py, pool.model("llama"),
                               pool.workdir, tp=1, cores="1",
                               extra={"side_channel_host": "0.0.0.0"}),
        }
        try:
            for e in engines.values():  # the taken port held until both have exited
                with pytest.raises(AssertionError, match="exited"):
                    e.wait_ready()
            yield engines, port
        finally:
            for e in engines.values():
                e.stop()


@pytest.mark.engines("llama")
def test_a_taken_port_is_named_with_its_config_key(failed_starts):
    engines, port = failed_starts
    e = engines["taken"]
    assert e.log_lines(rf"PortInUseError: side channel port {port} on 127.0.0.1 is "
                       r"already in use: .*kv_connector_extra_config\['side_channel_"
                       r"port'\]"), e.tail()


@pytest.mark.engines("llama")
def test_a_wildcard_side_channel_address_stops_the_engine_at_start(failed_starts):
    """``side_channel_host: 0.0.0.0`` with nothing advertised: the engine does not start (it
    used to start and advertise 0.0.0.0, failing every pull); the log names the key."""
    e = failed_starts[0]["wildcard"]
    assert e.log_lines(r"ArgumentError: kv_connector_extra_config\['side_channel_host'\] "
                       r"is '0.0.0.0', a wildcard: .*side_channel_advertise_host"), e.tail()


def test_orphan_shm_cleanup_keeps_a_semaphore_only_its_creator_holds():
    """A test run's clean-up beside an engine starting: the engine's fresh semaphore, mapped
    by its creator only (under glibc's temporary name), is held and stays; judged by name it
    was unlinked before the engine's workers opened it, and the engine died at start."""
    import multiprocessing

    before = shm_files()
    lock = multiprocessing.get_context("spawn").Lock()  # as vLLM's engine makes one
    name = "sem." + lock._semlock.name.lstrip("/")
    assert name in shm_files(), (name, shm_files())
    remove_orphan_shm(before)
    assert name in shm_files(), f"{name}, held by this process, was removed"

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
