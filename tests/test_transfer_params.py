"""kvplan_nixl/serving/transfer_params.py: what an HTTP client puts in ``kv_transfer_params`` is
checked field by field at admission; a bad value is a ParamsError naming the field and the value,
and nothing is built from an unchecked one (issue 36, item 1). The connector's use of it, in vLLM's
scheduler, is tests/test_vllm_serving.py's."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan_nixl import ParamsError
from kvplan_nixl.serving.transfer_params import (
    MAX_BLOCK_IDS,
    MAX_TP,
    Handover,
    Peer,
    Source,
    check_decode,
    check_prefill,
)

PULL = {"do_remote_prefill": True, "do_remote_decode": False,
        "remote_block_ids": [[3, 4, 5]], "remote_block_offsets": [0],
        "remote_engine_id": "pre", "remote_request_id": "cmpl-1-0-abcdef12",
        "remote_host": "10.0.0.7", "remote_port": 5700, "tp_size": 2,
        "remote_num_tokens": 40, "transfer_mode": "kvplan",
        "remote_generation": 1733300000000000001}
PUSH = {"do_remote_prefill": True, "transfer_id": "t-9", "remote_engine_id": "pre",
        "remote_host": "pre.local", "remote_port": 5700, "tp_size": 1}


def test_genuine_pull_and_push_params_are_taken_as_given():
    s = check_decode("d-1", PULL, groups=1)
    assert s == Source("pre", "10.0.0.7", 5700, 2, "cmpl-1-0-abcdef12", ((3, 4, 5),), (0,),
                       1733300000000000001, "", Peer.KVPLAN, 40)
    assert not s.push
    # the generation as a decimal string (a proxy without 63-bit JSON ints), a flat list
    flat = dict(PULL, remote_block_ids=[7, 8], remote_generation="12",
                remote_block_offsets=None)
    assert check_decode("d-1", flat, groups=1).ids == ((7, 8),)
    assert check_decode("d-1", flat, groups=1).generation == 12
    p = check_decode("cmpl-x-0-1234abcd", PUSH, groups=2)
    assert p.push and p.key == "t-9" and p.remote_req == "" and p.first == ()
    no_tid = {k: v for k, v in PUSH.items() if k != "transfer_id"}
    assert check_decode("cmpl-x-0-1234abcd", no_tid, groups=1).key == "cmpl-x-0"
    # two groups (hybrid), ids per group; fields the connector does not read are left alone
    two = dict(PULL, remote_block_ids=[[1, 2], [9]], remote_block_offsets=[0, 5],
               proxy_note={"anything": [1, 2]})
    assert check_decode("d", two, groups=2).first == (0, 5)
    assert check_prefill("p", {"do_remote_decode": True}, "pull") == Handover("pull", None)
    assert check_prefill("p-1-abcdef12", {"do_remote_decode": True, "transfer_mode": "push"},
                         "pull") == Handover("push", "p-1")
    assert check_prefill("p", {"do_remote_decode": True}, "layerwise").mode == "layerwise"


#: What vLLM 0.32's NixlConnector prefill hands (``request_finished`` in ``pull_scheduler.py``)
NIXL = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4, 5]],
        "remote_engine_id": "stock-p", "remote_request_id": "cmpl-2-0-abcdef12",
        "remote_host": "10.0.0.8", "remote_port": 5600, "tp_size": 2, "dcp_size": 1,
        "pp_size": 1, "remote_num_tokens": 70, "remote_blocks_expiry_time": None,
        "transfer_mode": "pull"}


def test_a_nixlconnector_prefill_is_told_by_its_transfer_mode():
    s = check_decode("d-2", NIXL, groups=1)
    assert s == Source("stock-p", "10.0.0.8", 5600, 2, "cmpl-2-0-abcdef12", ((3, 4, 5),), (0,),
                       0, "", Peer.NIXL, 70)
    assert not s.push
    # offsets are derived by the decode, never taken from a stock prefill's params
    assert check_decode("d", dict(NIXL, remote_block_offsets=[9]), groups=1).first == (0,)
    assert check_decode("d", PULL, groups=1).peer is Peer.KVPLAN
    for field, value, words in (("pp_size", 2, "one pipeline stage"),
                                ("dcp_size", 4, "no decode context parallelism"),
                                ("remote_block_ids", None, "must name its blocks"),
                                ("remote_request_id", 5, "printable string")):
        with pytest.raises(ParamsError, match=words) as e:
            check_decode("d", dict(NIXL, **{field: value}), groups=1)
        assert e.value.field == field


# what issue 36 found, and the rest of each field's range: (field, value, words of the rule)
BAD = [
    ("remote_port", "abc", "TCP port"), ("remote_port", 70000, "TCP port"),
    ("remote_port", 0, "TCP port"), ("remote_port", True, "TCP port"),
    ("remote_port", 5700.0, "TCP port"), ("remote_port", 65535, "above 65535"),
    ("tp_size", "x", "tensor parallel size"), ("tp_size", 10**9, "1 to 128"),
    ("tp_size", 0, "1 to 128"), ("tp_size", -1, "1 to 128"), ("tp_size", None, "1 to 128"),
    ("remote_block_ids", 5, "one list of block ids"),
    ("remote_block_ids", "abc", "one list of block ids"),
    ("remote_block_ids", [[1, -2]], "ints 0 to"), ("remote_block_ids", [[1, 2**31]], "ints 0"),
    ("remote_block_ids", [[1, 2**70]], "ints 0"), ("remote_block_ids", [[1.5]], "ints 0"),
    ("remote_block_ids", [["1"]], "ints 0"), ("remote_block_ids", [[[1], [2]]], "ints 0"),
    ("remote_block_ids", [[1], [2]], r"\(1 here\)"), ("remote_block_ids", [[True]], "ints 0"),
    ("remote_block_ids", [[1], 2], "one list"), ("remote_block_ids", [{"a": 1}], "ints 0"),
    ("remote_block_offsets", [0, 0], r"per block id list \(1\)"),
    ("remote_block_offsets", [-1], "block position"), ("remote_block_offsets", 3, "per block"),
    ("remote_engine_id", None, "printable string"), ("remote_engine_id", 7, "printable"),
    ("remote_engine_id", "", "1 to 256"), ("remote_engine_id", "x" * 300, "1 to 256"),
    ("remote_engine_id", "a\nb", "printable"),
    ("remote_request_id", None, "printable"), ("remote_request_id", "r" * 600, "1 to 512"),
    ("remote_host", "", "host name"), ("remote_host", 12, "host name"),
    ("remote_host", "a b", "host name"), ("remote_host", "h\x00", "host name"),
    ("remote_host", "h" * 300, "host name"),
    ("remote_generation", -1, r"2\*\*63"), ("remote_generation", 2**63, r"2\*\*63"),
    ("remote_generation", "12a", "decimal"), ("remote_generation", 1.5, r"2\*\*63"),
    ("remote_num_tokens", "7", "int >= 0"), ("remote_num_tokens", -1, "int >= 0"),
    ("transfer_id", ["a"], "transfer key"),
    ("do_remote_prefill", "yes", "true or false"), ("do_remote_decode", True, "not both"),
]


@pytest.mark.parametrize(("field", "value", "rule"), BAD,
                         ids=[f"{f}={str(v)[:12]}" for f, v, _ in BAD])
def test_each_bad_field_is_named_with_its_value(field, value, rule):
    with pytest.raises(ParamsError, match=rule) as e:
        check_decode("d-1", dict(PULL, **{field: value}), groups=1)
    assert e.value.field == field and f"kv_transfer_params[{field!r}]" in str(e.value)
    assert isinstance(e.value, ValueError)  # what a caller catching ValueError expects


def test_push_params_need_a_transfer_key_and_prefill_modes_are_named():
    with pytest.raises(ParamsError, match="transfer_id"):
        check_decode("d", dict(PUSH, transfer_id="k" * 257), groups=1)
    with pytest.raises(ParamsError, match="transfer_id"):
        check_decode("r" * 300, {k: v for k, v in PUSH.items() if k != "transfer_id"}, 1)
    with pytest.raises(ParamsError, match=r"transfer_mode.*pull, push, layerwise"):
        check_prefill("p", {"do_remote_decode": True, "transfer_mode": "kvplan"}, "pull")
    with pytest.raises(ParamsError, match="transfer_id"):
        check_prefill("p", {"do_remote_decode": True, "transfer_mode": "push",
                            "transfer_id": ""}, "pull")
    with pytest.raises(ParamsError, match="JSON object"):
        check_decode("d", [1, 2], groups=1)


def test_sizes_are_bounded_before_anything_is_built():
    with pytest.raises(ParamsError, match=f"at most {MAX_BLOCK_IDS}"):
        check_decode("d", dict(PULL, remote_block_ids=[[0] * (MAX_BLOCK_IDS + 1)]), 1)
    # deep nesting: refused, never a RecursionError
    deep: list = [1]
    for _ in range(50_000):
        deep = [deep]
    with pytest.raises(ParamsError, match="remote_block_ids"):
        check_decode("d", dict(PULL, remote_block_ids=[deep]), groups=1)
    assert check_decode("d", dict(PULL, tp_size=MAX_TP, remote_port=1000), 1).tp == MAX_TP


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(), c,
                                                                         max_size=4),
                    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(set(PULL) | set(PUSH) | {"remote_block_offsets"})), JSON,
       st.booleans())
def test_any_json_value_in_any_field_is_taken_or_refused_by_name(field, value, push):
    base = PUSH if push else PULL
    params = json.loads(json.dumps(dict(base, **{field: value})))  # what HTTP delivers
    try:
        s = check_decode("d-1", params, groups=1)
    except ParamsError as e:
        # the field it names is the one given wrong, or one this kind of request needs
        assert e.field in params or e.field == "transfer_id" or e.field == "remote_request_id"
        return
    # accepted: every number it will use is in range
    assert 1 <= s.port and s.port + s.tp - 1 <= 65535 and 1 <= s.tp <= MAX_TP
    assert all(0 <= b < 2**31 for g in s.ids or () for b in g)
    assert 0 <= s.generation < 2**63
