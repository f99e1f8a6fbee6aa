"""``Endpoint.notify``: a message with no transfer, between real agents (UCX over loopback)."""

from __future__ import annotations

import pytest

from kvplan_nixl import ArgumentError, NotConnectedError
from tests.nixl_util import attn, notifications, pair, spec


def test_notify_reaches_the_named_ranks_only():
    with pair(spec(1, attn(heads=4)), spec(2, attn(heads=4))) as pr:
        pr.connect("pull")  # each decode rank connected the prefill's one rank
        pr.d[1].notify("prefill", 0, b"from decode 1")
        pr.d[0].notify("prefill", [0], "from decode 0")
        got = notifications(pr.endpoints, 2)  # a sender must progress to send
        assert sorted((n.engine, n.rank, n.message) for _, n in got) == [
            ("decode", 0, b"from decode 0"), ("decode", 1, b"from decode 1")]
        assert notifications(pr.endpoints, 1, timeout=0.2) == []  # nothing more


def test_notify_with_a_secret_is_sealed_and_verified():
    with pair(spec(1, attn()), spec(1, attn()), secret="s3") as pr:
        pr.connect("push")
        pr.p[0].notify("decode", (0,), b"written")
        (_, n), = notifications(pr.endpoints, 1)
        assert (n.engine, n.rank, n.message) == ("prefill", 0, b"written")
        assert pr.d[0].stats()["forged"] == 0


def test_notify_refuses_unconnected_ranks_reserved_prefixes_and_non_bytes():
    with pair(spec(2, attn(heads=4)), spec(1, attn(heads=4))) as pr:
        with pytest.raises(NotConnectedError, match=r"ranks \[0\] of engine 'prefill' are not"):
            pr.d[0].notify("prefill", 0, b"x")
        pr.d[0].connect(pr.p[0].metadata(), mode="pull")
        with pytest.raises(NotConnectedError, match=r"ranks \[1\].*connected: \[0\]"):
            pr.d[0].notify("prefill", [0, 1], b"x")  # nothing sent at all
        with pytest.raises(ArgumentError, match="reserved"):
            pr.d[0].notify("prefill", 0, b"kvs1 OPEN 1")
        for bad in (None, 7, [1, 2]):
            with pytest.raises(ArgumentError):
                pr.d[0].notify("prefill", 0, bad)
        with pytest.raises(ArgumentError, match="ranks must be ints"):
            pr.d[0].notify("prefill", ["0"], b"x")
        assert notifications(pr.endpoints, 1, timeout=0.2) == []
