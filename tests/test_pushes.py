"""Push mode's protocol without engines (:mod:`kvplan_nixl.serving.pushes`): the transfer key, the
messages' encoding and their validation, and the prefill's table matching sends with
registrations in either order, once, within their windows."""

from __future__ import annotations

import pytest

from kvplan_nixl.serving.pushes import (
    MAX_KEY,
    PUSHED,
    PUSHFAIL,
    REGISTER,
    Pusher,
    PushSend,
    Registration,
    parse_done,
    push_done,
    transfer_key,
)


def reg(key: str = "k", ttl: float = 10.0, **kw) -> Registration:
    fields = dict(key=key, decode_req="d-1", engine="dec", host="10.0.0.2", port=5800, tp=2,
                  lists=((4, 5, 6), (9,)), start=32, end=70, ttl=ttl,
                  sent=1.7e9)
    return Registration(**{**fields, **kw})


def send(key: str = "k", req: str = "p-1") -> PushSend:
    return PushSend(req, 7, key, ((1, 2, 3), (8,)), (0, 0))


def test_transfer_key_is_the_transfer_id_else_the_request_id_without_vllms_suffix():
    assert transfer_key("cmpl-abc-1f2e3d4c", {"transfer_id": "t9"}) == "t9"
    assert transfer_key("cmpl-abc-1f2e3d4c", {}) == "cmpl-abc"  # both legs' base id
    assert transfer_key("cmpl-abc-1F2E3D4C", {}) == "cmpl-abc"
    assert transfer_key("cmpl-abc-xyz", {}) == "cmpl-abc-xyz"  # not vLLM's suffix: kept
    assert transfer_key("r", {"transfer_id": 12}) == "12"
    assert transfer_key("r", {"transfer_id": ""}) is None
    assert transfer_key("r", {"transfer_id": "x" * (MAX_KEY + 1)}) is None


def test_registration_round_trips_and_refuses_bad_fields_by_name():
    r = reg()
    msg = r.encode()
    assert msg.startswith(REGISTER) and Registration.decode(msg) == r
    bad = {
        "names": dict(engine=""), "numbers": dict(port=0), "ttl": dict(ttl=0.0),
        "sent time": dict(sent=-1.0),
    }
    for what, kw in bad.items():
        with pytest.raises(ValueError, match=what):
            Registration.decode(reg(**kw).encode())
    with pytest.raises(ValueError, match="numbers"):  # start past end
        Registration.decode(reg(start=80).encode())
    with pytest.raises(ValueError, match="lists"):
        Registration.decode(REGISTER + msg[len(REGISTER):].replace(b"[4,5,6]", b"[4,true]"))
    with pytest.raises(ValueError, match="not JSON"):
        Registration.decode(REGISTER + b"{")
    with pytest.raises(ValueError, match="not a push registration"):
        Registration.decode(b"hello")


def test_done_messages_carry_bytes_per_decode_rank_and_others_are_not_theirs():
    ok, d = parse_done(push_done(PUSHED, "d-1", {0: 100, 1: 50}, {0: 4, 1: 2}))
    assert ok and d["decode_req"] == "d-1" and d["bytes"] == {"0": 100, "1": 50}
    assert d["runs"] == {"0": 4, "1": 2}
    ok, d = parse_done(push_done(PUSHFAIL, "d-1", why="peer gone"))
    assert not ok and d["why"] == "peer gone"
    assert parse_done(b"other") is None
    assert parse_done(REGISTER + b"{}") is None
    with pytest.raises(ValueError, match="not JSON"):
        parse_done(PUSHED + b"{")
    with pytest.raises(ValueError, match="decode_req"):
        parse_done(PUSHED + b'{"decode_req": 3, "bytes": {}, "runs": {}}')


def test_pusher_matches_either_order_once():
    t = Pusher()
    assert t.add_send(send(), now=0.0, lease=5.0) is None
    m = t.add_registration(reg(), now=1.0, age=0.0)
    assert m is not None and m.send == send() and m.reg == reg() and m.valid_until == 11.0
    assert t.add_registration(reg(), now=2.0, age=0.0) is None  # matched once: a second one waits
    t2 = Pusher()
    assert t2.add_registration(reg(ttl=3.0), now=0.0, age=0.0) is None
    m = t2.add_send(send(), now=1.0, lease=5.0)
    assert m is not None and m.valid_until == 3.0
    assert t2.sends == {} and t2.regs == {}


def test_pusher_never_matches_an_expired_registration_and_expires_both_sides():
    t = Pusher()
    t.add_registration(reg("v", ttl=1.0), now=0.0, age=0.0)
    assert t.registration("v", now=0.5) == reg("v", ttl=1.0)  # seen, not taken
    assert t.registration("v", now=1.0) is None and t.registration("w", now=0.0) is None
    assert t.add_send(send("v"), now=0.5, lease=5.0) is not None  # taken by its send
    assert t.registration("v", now=0.5) is None
    t.add_registration(reg("a", ttl=1.0), now=0.0, age=0.0)
    assert t.add_send(send("a"), now=1.0, lease=5.0) is None  # the window closed at 1.0
    t.add_registration(reg("b", ttl=2.0), now=0.0, age=0.0)
    sends, regs = t.expire(now=2.0)
    assert sends == [] and [r.key for r in regs] == ["b"]
    sends, regs = t.expire(now=6.0)
    assert [s.key for s in sends] == ["a"] and regs == []  # its lease: its hold frees it
    assert t.sends == {} and t.regs == {}


def test_a_registration_window_ends_ttl_after_it_was_sent_never_later():
    t = Pusher()
    t.add_send(send("late"), now=0.0, lease=50.0)
    m = t.add_registration(reg("late", ttl=10.0), now=100.0, age=4.0)  # 4 s in transit
    assert m is not None and m.valid_until == 106.0
    t.add_send(send("ahead"), now=0.0, lease=50.0)
    m = t.add_registration(reg("ahead", ttl=10.0), now=100.0, age=-3.0)  # clocks apart
    assert m is not None and m.valid_until == 110.0  # never past ttl from its arrival
    t.add_send(send("dead"), now=0.0, lease=50.0)
    assert t.add_registration(reg("dead", ttl=10.0), now=100.0, age=10.0) is None
    assert "dead" not in t.regs and "dead" in t.sends  # the send waits on for another


def test_two_requests_of_one_key_are_both_refused_never_paired():
    """Issue 36, item 2: two decode requests registering one key (a reused X-Request-Id)
    are both refused, and so is the prefill send of that key that comes later; the same for
    two sends of one key. A registration repeated by its own request is not a collision."""
    t = Pusher()
    a, b = reg("k", decode_req="d-A"), reg("k", decode_req="d-B")
    assert t.add_registration(a, now=0.0, age=0.0) is None
    assert t.add_registration(a, now=0.1, age=0.0) is None and not t.refused  # same request
    assert t.add_registration(b, now=0.2, age=0.0) is None
    assert [x for x, _ in t.refused] == [a, b] and "more than one request" in t.refused[0][1]
    t.refused.clear()
    assert t.add_send(send("k"), now=1.0, lease=5.0) is None  # never written into A or B
    assert [x for x, _ in t.refused] == [send("k")] and t.regs == {} and t.sends == {}
    t.refused.clear()
    t.expire(now=10.3)  # both windows over: the key may be used again
    assert t.add_registration(reg("k", decode_req="d-C"), now=10.3, age=0.0) is None
    assert t.add_send(send("k"), now=10.4, lease=5.0).reg.decode_req == "d-C"
    s2 = PushSend("p-2", 8, "j", ((5,), (6,)), (0, 0))
    assert t.add_send(send("j"), now=11.0, lease=5.0) is None
    assert t.add_send(s2, now=11.5, lease=5.0) is None
    assert [x for x, _ in t.refused] == [send("j"), s2]
    assert t.add_registration(reg("j"), now=12.0, age=0.0) is None  # refused, not paired
    assert t.refused[-1][0] == reg("j") and not t.sends and not t.regs


def test_malformed_push_messages_raise_value_errors_only():
    """Issue 36, item 5: what a peer sends is parsed bounded; deep nesting, a non-integer
    byte count or an oversized message is a ValueError (dropped by the caller), never a
    RecursionError or a crash later."""
    deep = b"[" * 50_000 + b"]" * 50_000
    for msg in (PUSHED + b'{"decode_req":"d","bytes":' + deep + b',"runs":{}}',
                REGISTER + deep, PUSHED + deep):
        with pytest.raises(ValueError, match=r"not JSON|not an object"):
            parse_done(msg) if msg.startswith(PUSHED) else Registration.decode(msg)
    for bytes_ in ('{"0":"12"}', '{"0":1.5}', '{"0":-1}', '{"0":true}', '{"x":1}', '[]'):
        body = b'{"decode_req":"d","bytes":%s,"runs":{}}' % bytes_.encode()
        with pytest.raises(ValueError, match="bytes must map"):
            parse_done(PUSHED + body)
    with pytest.raises(ValueError, match="above"):
        parse_done(PUSHED + b" " * (8 << 20))
    r = reg().encode()
    for lists in (b"[[4,5,6],[[9]]]", b"[[4,5,6],[2147483648]]", b"[[4,5,6],[-1]]",
                  b"[[4,5.0]]", b"[[4],5]", b"5", b"[" + b"[1]," * 65 + b"[1]]"):
        with pytest.raises(ValueError, match="lists must be"):
            Registration.decode(r.replace(b"[[4,5,6],[9]]", lists))
    with pytest.raises(ValueError, match="numbers"):  # rank ports past 65535
        Registration.decode(reg(port=65535, tp=2).encode())
