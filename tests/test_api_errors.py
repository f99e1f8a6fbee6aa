"""Every bad argument of the public API raises a ``KVPlanError`` subclass naming the argument.

Table-driven: each public call (the names kvplan and kvplan_nixl export) gets wrong types and
out-of-range values (None, nan, inf, negative, huge ints, wrong case, lists) in each argument,
and must refuse them with a typed error whose message names the argument, before anything is
posted. The bugs of issue 18, point 8, come first, one test each. The executor's calls run on
real endpoints (NIXL over loopback), connected to each other.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

from kvplan import EngineSpec, KVPlanError, RequestError, SpecError, pull_map, push_map, stage
from kvplan_nixl import ArgumentError, BusyError, Endpoint, MetadataError
from kvplan_nixl import metadata as md
from kvplan_nixl.staged import Stager
from tests.nixl_util import attn, mla, pair, spec

SRC = spec(1, attn(heads=4, nb=64, bs=16), mla(nb=64))
DST = spec(1, attn(heads=4, nb=64, bs=16), mla(nb=64))
SLOT = 64 << 10
NAN, INF = math.nan, math.inf
HUGE = 2**70


def refused(fn, *names: str, cls: type[Exception] = KVPlanError) -> Exception:
    """``fn()`` raises ``cls`` (a KVPlanError) whose message names each of ``names``."""
    with pytest.raises(cls) as info:
        fn()
    assert isinstance(info.value, KVPlanError), type(info.value)
    for n in names:
        assert n in str(info.value), (n, str(info.value))
    return info.value


# -- issue 18, point 8: the core ----------------------------------------------------------------


def test_empty_token_range_past_the_lists_is_a_request_error():
    m = pull_map(SRC, DST, 0)
    four = [list(range(4))]
    refused(lambda: m.plan(four, [list(range(8, 12))], tokens=(65, 65)), "tokens 65:65",
            cls=RequestError)
    # an empty range the lists reach is an empty plan (a full prefix-cache hit)
    assert m.plan(four, [list(range(8, 12))], tokens=(64, 64)).nbytes == 0
    assert m.plan([list(range(5))], [list(range(8, 13))], tokens=(65, 65)).nbytes == 0


@pytest.mark.parametrize("bad", [None, 1, 2.5, [None], [1], b"layers.0.attn"])
def test_part_of_not_names_is_a_request_error(bad):
    plan = pull_map(SRC, DST, 0).plan([list(range(4))], [list(range(4))], merge_slots=False)
    refused(lambda: plan.part(bad), "regions" if not isinstance(bad, list) else repr(bad[0]),
            cls=RequestError)


def test_spec_with_a_non_string_key_is_a_spec_error():
    d = SRC.to_dict()
    region = dict(d["regions"][0])
    region[1] = 2
    refused(lambda: EngineSpec.from_dict(dict(d, regions=[region, d["regions"][1]])),
            "keys must be strings", "int 1", cls=SpecError)
    refused(lambda: EngineSpec.from_dict({**d, 7: 1}), "keys must be strings", cls=SpecError)


@pytest.mark.parametrize("where", ["regions", "name", "parts", "tp_size"])
def test_spec_nested_100000_deep_is_a_spec_error(where):
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    d = SRC.to_dict()
    if where in ("regions", "tp_size"):
        d[where] = deep
    else:
        d["regions"] = [dict(d["regions"][0], **{where: deep})]
    refused(lambda: EngineSpec.from_dict(d), "nested deeper than", where, cls=SpecError)


# -- issue 18, point 8: the executor ------------------------------------------------------------


@pytest.fixture(scope="module")
def eps():
    """decode (pull, with a Stager) and prefill (push back, with a Stager), connected."""
    with pair(SRC, DST) as pr:
        p, d = pr.p[0], pr.d[0]
        sp = Stager(p, pool_bytes=2 * SLOT, slot_bytes=SLOT)
        sd = Stager(d, pool_bytes=2 * SLOT, slot_bytes=SLOT)
        try:
            d.connect(p.metadata(), mode="pull")
            p.connect(d.metadata(), mode="push")
            plan = d.map("prefill").plan([list(range(4))], [list(range(4, 8))],
                                         merge_slots=False)
            yield p, d, sp, sd, plan
        finally:
            sd.close()
            sp.close()


def test_connect_mode_1_names_mode(eps):
    p, d, *_ = eps
    refused(lambda: d.connect(p.metadata(), mode=1), "mode", "1", cls=ArgumentError)
    refused(lambda: d.connect(p.metadata(), mode="PULL"), "mode", "'PULL'", cls=ArgumentError)


def test_stager_post_how_auto_upper_case_names_how(eps):
    _, _, _, sd, plan = eps
    refused(lambda: sd.post(plan, "prefill", how="AUTO"), "how", "'AUTO'", cls=ArgumentError)
    assert sd.handles()["requests"] == 0


@pytest.mark.parametrize("kw,names", [
    ({"timeout": NAN}, ("timeout", "nan")),
    ({"timeout": INF}, ("timeout", "inf")),
    ({"timeout": -1}, ("timeout", "-1")),
    ({"timeout": "1"}, ("timeout", "'1'")),
    ({"notify": [1, 2]}, ("notify", "bytes or str", "[1, 2]")),
    ({"notify": 7}, ("notify", "bytes or str")),
])
def test_staged_and_direct_reads_refuse_bad_timeout_and_notify(eps, kw, names):
    _, d, _, sd, plan = eps
    for call in (sd.read, d.read, lambda *a, **k: sd.post(*a, how="staged", **k)):
        refused(lambda call=call: call(plan, "prefill", **kw), *names, cls=ArgumentError)
    assert sd.handles()["requests"] == 0 and d.handles()["transfers"] == 0


def test_a_str_notify_is_sent_as_its_utf8_bytes(eps):
    p, _, sp, sd, plan = eps
    t = sd.read(plan, "prefill", notify="abc", timeout=30)
    t.wait(progress=[sp])
    got = []
    for _ in range(2000):
        sp.poll()
        got += p.notifications()
        if got:
            break
    assert [n.message for n in got] == [b"abc"]


@pytest.mark.parametrize("kw,names", [
    ({"slot_bytes": 1000}, ("slot_bytes", "1000")),
    ({"slot_bytes": None}, ("slot_bytes", "None")),
    ({"pool_bytes": -4096}, ("pool_bytes", "-4096")),
    ({"pool_bytes": 2.0**20}, ("pool_bytes", "float")),
    ({"window": 0}, ("window", "0")),
    ({"window": NAN}, ("window", "nan")),
    ({"cpu_threads": 0}, ("cpu_threads", "0")),
    ({"overlap": "yes"}, ("overlap", "'yes'")),
])
def test_stager_arguments_name_the_argument(kw, names):
    refused(lambda: Stager(None, **kw), *names, cls=ArgumentError)


def test_calibrate_with_every_slot_busy_is_a_busy_error(eps):
    _, _, _, sd, _ = eps
    taken = [sd.pool.free.popleft() for _ in range(len(sd.pool.free))]
    try:
        refused(lambda: sd.calibrate("prefill", timeout=1), "every staging slot", "2 of 2",
                cls=BusyError)
    finally:
        for s in taken:
            sd.pool.release(s)


def _forged(blob: bytes, **changes) -> bytes:
    """``blob`` (an unsigned Endpoint.metadata()) re-encoded with its PeerInfo changed."""
    return md.encode(attrs.evolve(md.decode(blob), **changes))


def test_metadata_base_2_63_is_a_metadata_error(eps):
    p, d, *_ = eps
    info = md.decode(p.metadata())
    bases = tuple(2**63 if n else 0 for n in info.nbytes)
    refused(lambda: d.connect(_forged(p.metadata(), bases=bases)), "base 9223372036854775808",
            "2**63", cls=MetadataError)


def test_metadata_two_buffers_at_one_base_is_a_metadata_error(eps):
    p, d, *_ = eps
    info = md.decode(p.metadata())
    bases = tuple(info.bases[0] if n else 0 for n in info.nbytes)
    assert len(set(info.bases)) == 2 and len(set(bases)) == 1
    refused(lambda: d.connect(_forged(p.metadata(), bases=bases)), "overlapping addresses",
            "layers.0.attn", "draft.0.mla", cls=MetadataError)


# -- the sweep: every public call, every argument ---------------------------------------------

BAD_NUMBERS = [None, NAN, INF, -1, HUGE, "3", [1], True]


@pytest.mark.parametrize("field", ["tp_size", "pp_size", "dcp_size"])
@pytest.mark.parametrize("bad", BAD_NUMBERS)
def test_engine_spec_numbers(field, bad):
    refused(lambda: EngineSpec.from_dict({**SRC.to_dict(), field: bad}), field, cls=SpecError)


@pytest.mark.parametrize("field,bads", [
    ("num_blocks", BAD_NUMBERS),
    ("block_size", BAD_NUMBERS),
    ("num_kv_heads", BAD_NUMBERS),
    ("head_dim", BAD_NUMBERS),
    ("group", BAD_NUMBERS),
    ("window", [NAN, INF, -1, 0, "3", [1], True]),  # a huge window is no window
    ("dtype", [None, "BFLOAT16", 2, ["bfloat16"]]),
    ("kind", [None, "ATTENTION", 1, ["attention"]]),
    ("layout", [None, "hnd", 1, ["HND"]]),
    ("kv", [None, "SPLIT", 1, ["split"]]),
    ("name", [None, 1, ["x"], ""]),
])
def test_region_fields(field, bads):
    d = SRC.to_dict()
    for bad in bads:
        region = dict(d["regions"][0], **{field: bad})
        refused(lambda region=region: EngineSpec.from_dict(dict(d, regions=[region])), field,
                cls=SpecError)


@pytest.mark.parametrize("make", [pull_map, push_map])
def test_maps(make):
    for bad in BAD_NUMBERS:
        refused(lambda bad=bad: make(SRC, DST, bad), "rank")
    for bad in (None, SRC.to_dict(), "spec"):
        refused(lambda bad=bad: make(bad, DST, 0), "EngineSpec")
        refused(lambda bad=bad: make(SRC, bad, 0), "EngineSpec")


def test_plan_arguments():
    m = pull_map(SRC, DST, 0)
    ok = [list(range(4))]
    for bad in (None, 3, [None], [[NAN]], [[-2]], [[HUGE]], [["1"]], [[1.5]], [ok[0], ok[0]]):
        refused(lambda bad=bad: m.plan(bad, ok), "source", cls=RequestError)
        refused(lambda bad=bad: m.plan(ok, bad), "destination", cls=RequestError)
    for bad in (None, 5, (NAN, 2), (0, INF), (-1, 4), (3, 1), (0, HUGE), ("0", "4"), [0]):
        if bad is None:
            continue  # no range: the whole lists
        refused(lambda bad=bad: m.plan(ok, ok, tokens=bad), "tokens", cls=RequestError)
    for bad in (None, "ZERO", 0, ["zero"]):
        refused(lambda bad=bad: m.plan(ok, ok, tokens=(0, 4), dst_from=bad), "dst_from",
                cls=RequestError)


def test_stage_chunk_bytes():
    plan = pull_map(SRC, DST, 0).plan([list(range(4))], [list(range(4))])
    for bad in (None, NAN, INF, -1, 0, "4096", [4096], True, 4096.0):
        refused(lambda bad=bad: stage(plan, bad), "chunk_bytes", cls=RequestError)
    refused(lambda: stage(None, 4096), "plan")


@pytest.mark.parametrize("kw,name", [
    ({"engine": None}, "engine"), ({"engine": ""}, "engine"), ({"engine": 1}, "engine"),
    ({"rank": None}, "rank"), ({"rank": -1}, "rank"), ({"rank": HUGE}, "rank"),
    ({"rank": 1.0}, "rank"), ({"rank": True}, "rank"),
    ({"spec": None}, "spec"), ({"spec": "x"}, "spec"), ({"spec": [1]}, "spec"),
    ({"num_threads": -1}, "num_threads"), ({"num_threads": NAN}, "num_threads"),
    ({"num_threads": None}, "num_threads"),
    ({"secret": 5}, "secret"), ({"secret": [1]}, "secret"),
    ({"backends": "UCX"}, "backends"), ({"backends": [None]}, "backends"),
    ({"buffers": None}, "buffers"), ({"buffers": 5}, "buffers"),
])
def test_endpoint_constructor(kw, name):
    bufs = [np.zeros(SRC.rank_region_nbytes(i), np.uint8) for i in range(len(SRC.regions))]
    args = {"engine": "prefill", "spec": SRC, "rank": 0, "buffers": bufs, **kw}
    refused(lambda: Endpoint(args.pop("engine"), args.pop("spec"), args.pop("rank"),
                             args.pop("buffers"), **args), name)


def test_endpoint_methods(eps):
    p, d, _, _, plan = eps
    for bad in (None, 1, "PULL", ["pull"]):
        refused(lambda bad=bad: d.map("prefill", bad), "mode", cls=ArgumentError)
    for bad in (None, 1, "", ["prefill"]):
        refused(lambda bad=bad: d.map(bad), "remote", cls=ArgumentError)
        refused(lambda bad=bad: d.read(plan, bad), "remote", cls=ArgumentError)
        refused(lambda bad=bad: d.disconnect(bad, 0), "remote", cls=ArgumentError)
    for bad in (None, -1, HUGE, "0", 0.0):
        refused(lambda bad=bad: d.disconnect("prefill", bad), "rank")
    for bad in (None, 5, "metadata", [1]):
        refused(lambda bad=bad: d.connect(bad), "metadata")
    for bad in (None, "plan", 5):
        refused(lambda bad=bad: d.read(bad, "prefill"), "plan", cls=ArgumentError)
        refused(lambda bad=bad: d.request(bad, "prefill"), "plan", cls=ArgumentError)
    for kw, name in (({"timeout": NAN}, "timeout"), ({"notify": [1, 2]}, "notify")):
        refused(lambda kw=kw: d.request(plan, "prefill", **kw), name, cls=ArgumentError)
        refused(lambda kw=kw: p.write(plan, "decode", **kw), name, cls=ArgumentError)
    assert d.handles()["transfers"] == 0 and p.handles()["transfers"] == 0


def test_waits_refuse_a_nan_timeout_and_keep_the_transfer(eps):
    p, d, sp, sd, plan = eps
    for t in (d.read(plan, "prefill", timeout=30), sd.read(plan, "prefill", timeout=30),
              sd.post(plan, "prefill", how="direct", timeout=30)):
        for bad in (NAN, -1, INF, "1", [1]):
            refused(lambda t=t, bad=bad: t.wait(bad), "timeout", cls=ArgumentError)
        t.wait(progress=[sp])  # the refusal changed nothing: the transfer completes
        assert t.ok
    for bad in (5, None, [object()]):
        for t in (d.read(plan, "prefill", timeout=30), sd.read(plan, "prefill", timeout=30)):
            refused(lambda t=t, bad=bad: t.wait(5, progress=bad), "progress", cls=ArgumentError)
            t.wait(progress=[sp])
        refused(lambda bad=bad: sd.calibrate("prefill", progress=bad), "progress",
                cls=ArgumentError)
    r = d.request(plan, "prefill", timeout=30)
    for bad in (None, 1, [None], ["nope"]):
        refused(lambda bad=bad: r.post(bad), "region")
    refused(lambda: r.post(["layers.0.attn"], notify=[1, 2]), "notify", cls=ArgumentError)
    r.post(["layers.0.attn"])
    r.post(["draft.0.mla"])
    r.end()
    refused(lambda: r.wait(NAN), "timeout", cls=ArgumentError)
    r.wait(progress=[p])
    assert r.ok


def test_stager_methods(eps):
    _, _, _, sd, plan = eps
    for bad in (None, 1, "", ["prefill"]):
        refused(lambda bad=bad: sd.calibrate(bad), "remote", cls=ArgumentError)
        refused(lambda bad=bad: sd.post(plan, bad), "remote", cls=ArgumentError)
    for bad in (None, NAN, INF, -1, "2", [2]):
        refused(lambda bad=bad: sd.calibrate("prefill", timeout=bad), "timeout",
                cls=ArgumentError)
    for bad in (NAN, INF, -1, "2"):
        refused(lambda bad=bad: sd.serve(lambda: True, timeout=bad), "timeout",
                cls=ArgumentError)
    for bad in (None, True, "stop"):
        refused(lambda bad=bad: sd.serve(bad, timeout=0), "until", cls=ArgumentError)
    for bad in (None, "auto ", 1, ["auto"]):
        refused(lambda bad=bad: sd.post(plan, "prefill", how=bad), "how", cls=ArgumentError)
    for bad in (None, "plan"):
        refused(lambda bad=bad: sd.staged_peers(bad, "prefill"), "plan", cls=ArgumentError)
        refused(lambda bad=bad: sd.prefer(bad, "prefill"), "plan", cls=ArgumentError)
        refused(lambda bad=bad: sd.post(bad, "prefill"), "plan", cls=ArgumentError)
        refused(lambda bad=bad: sd.read(bad, "prefill"), "plan", cls=ArgumentError)
    assert sd.handles()["requests"] == 0 and sd.handles()["slots_in_use"] == 0
