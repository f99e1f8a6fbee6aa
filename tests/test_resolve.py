"""Request-named hosts resolved under the caller's deadline (issue 45, gap e):
:mod:`kvplan_nixl.serving.resolve`. ``fetch_nixl_metadata`` uses it (checked through that
function in tests/test_stock_limits.py, in the vLLM venv); here its own rules, with a lookup
that hangs as a DNS server answering nothing makes ``getaddrinfo`` hang."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvplan_nixl.serving import resolve as rs


@pytest.fixture
def lookups(monkeypatch):
    """Lookups of names go through a stand-in: each name's call counted; names in ``hang``
    wait until the test ends; ``fail`` names raise ``gaierror``."""
    state = {"calls": [], "hang": set(), "fail": set(), "release": threading.Event()}

    def lookup(name: str, port: int):
        state["calls"].append(name)
        if name in state["hang"]:
            state["release"].wait(30)
        if name in state["fail"]:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))

    monkeypatch.setattr(rs, "_lookup", lookup)
    monkeypatch.setattr(rs, "_cache", type(rs._cache)())
    yield state
    state["release"].set()
    end = time.monotonic() + 10
    while rs._pending and time.monotonic() < end:  # the hung lookups end with the test
        time.sleep(0.01)


def test_numeric_addresses_are_never_looked_up(lookups):
    for host, want in (("127.0.0.1", "127.0.0.1"), ("::1", "::1"), ("[::1]", "::1")):
        info = rs.resolve(host, 5600, time.monotonic() - 1)  # a deadline already past
        assert info[4][:2] == (want, 5600)
    assert lookups["calls"] == []


def test_a_name_that_hangs_fails_by_the_deadline_and_costs_one_lookup(lookups):
    lookups["hang"].add("hangs.example")
    t0 = time.monotonic()
    with pytest.raises(rs.ResolveTimeout, match=r"resolving 'hangs\.example': no answer by "
                                                r"the deadline"):
        rs.resolve("hangs.example", 5600, t0 + 0.2)
    assert time.monotonic() - t0 < 1.0
    # asked again meanwhile: it waits on the same lookup, not another thread's
    with pytest.raises(rs.ResolveTimeout):
        rs.resolve("hangs.example", 5600, time.monotonic() + 0.05)
    assert lookups["calls"] == ["hangs.example"]


def test_names_that_hang_take_a_bounded_number_of_lookups_then_are_refused(lookups):
    names = [f"h{i}.example" for i in range(rs.IN_FLIGHT)]
    lookups["hang"].update([*names, "one-more.example"])
    for n in names:
        with pytest.raises(rs.ResolveTimeout):
            rs.resolve(n, 1, time.monotonic() + 0.01)
    t0 = time.monotonic()
    with pytest.raises(rs.ResolveBusy, match=f"{rs.IN_FLIGHT} lookups of other names"):
        rs.resolve("one-more.example", 1, time.monotonic() + 5)
    assert time.monotonic() - t0 < 0.5 and "one-more.example" not in lookups["calls"]
    assert rs.resolve("10.0.0.1", 1, time.monotonic())[4][0] == "10.0.0.1"  # still served
    lookups["release"].set()  # the resolver answers at last: names are taken again
    end = time.monotonic() + 5
    while rs._pending:
        assert time.monotonic() < end
        time.sleep(0.01)
    assert rs.resolve("one-more.example", 1, time.monotonic() + 5)[4][1] == 1


def test_answers_are_kept_failures_are_not(lookups):
    assert rs.resolve("p.example", 7, time.monotonic() + 5)[4] == ("127.0.0.1", 7)
    assert rs.resolve("p.example", 7, time.monotonic() + 5)[4] == ("127.0.0.1", 7)
    assert lookups["calls"] == ["p.example"]
    lookups["fail"].add("gone.example")
    for _ in range(2):
        with pytest.raises(rs.ResolveError, match=r"resolving 'gone\.example': .*not known"):
            rs.resolve("gone.example", 7, time.monotonic() + 5)
    assert lookups["calls"].count("gone.example") == 2
