"""Side channel addresses checked at start (kvplan_nixl.serving.addresses): what peers are told to
dial must be dialable from where they run; what cannot work is refused naming its key."""

from __future__ import annotations

import pytest

from kvplan_nixl.errors import ArgumentError
from kvplan_nixl.serving.addresses import is_loopback, is_wildcard, side_channel_addresses

BIND, ADV = "side_channel_host", "side_channel_advertise_host"


@pytest.mark.parametrize(("extra", "env", "want"), [
    ({}, None, ("127.0.0.1", "127.0.0.1")),                     # nothing set: one host
    ({}, "10.0.0.2", ("10.0.0.2", "10.0.0.2")),                 # $VLLM_HOST_IP
    ({BIND: "10.0.0.3"}, "10.0.0.2", ("10.0.0.3", "10.0.0.3")),  # the key wins over the env
    ({BIND: "0.0.0.0", ADV: "10.0.0.3"}, None, ("0.0.0.0", "10.0.0.3")),
    ({BIND: "::", ADV: "fd00::3"}, None, ("::", "fd00::3")),
    ({BIND: "10.0.0.3", ADV: "203.0.113.7"}, None, ("10.0.0.3", "203.0.113.7")),  # NAT
    ({ADV: "prefill-0.svc"}, "0.0.0.0", ("0.0.0.0", "prefill-0.svc")),  # names not resolved
    ({BIND: "::1"}, None, ("::1", "::1")),                       # loopback on both: one host
    ({BIND: "localhost"}, None, ("localhost", "localhost")),
    ({}, "  ", ("127.0.0.1", "127.0.0.1")),                      # a blank variable is unset
])
def test_bind_and_advertised(extra, env, want):
    assert side_channel_addresses(extra, env) == want


@pytest.mark.parametrize(("extra", "env", "named", "value"), [
    ({BIND: "0.0.0.0"}, None, rf"kv_connector_extra_config\['{BIND}'\]", "0.0.0.0"),
    ({BIND: "::"}, None, rf"kv_connector_extra_config\['{BIND}'\]", "::"),
    ({}, "0.0.0.0", r"\$VLLM_HOST_IP", "0.0.0.0"),
    ({BIND: "10.0.0.3", ADV: "0.0.0.0"}, None, rf"kv_connector_extra_config\['{ADV}'\]",
     "0.0.0.0"),
])
def test_a_wildcard_advertised_is_refused_naming_its_key(extra, env, named, value):
    with pytest.raises(ArgumentError, match=rf"^{named} .*is '{value}', a wildcard") as e:
        side_channel_addresses(extra, env)
    msg = str(e.value)
    assert f"kv_connector_extra_config['{ADV}']" in msg  # the way out


@pytest.mark.parametrize(("extra", "env", "named"), [
    ({BIND: "0.0.0.0", ADV: "127.0.0.1"}, None, ADV),    # listens for all, says dial yourself
    ({BIND: "10.0.0.3", ADV: "localhost"}, None, ADV),
    ({ADV: "::1"}, "10.0.0.2", ADV),
])
def test_loopback_advertised_beside_a_bind_that_serves_other_hosts_is_refused(extra, env,
                                                                               named):
    with pytest.raises(ArgumentError, match=rf"kv_connector_extra_config\['{named}'\] is .*"
                                            r"a loopback address, while the side channel "
                                            r"listens on .*which serves other hosts"):
        side_channel_addresses(extra, env)


@pytest.mark.parametrize("bad", ["", " ", "10.0.0.1 10.0.0.2", 5700, ["10.0.0.1"]])
@pytest.mark.parametrize("key", [BIND, ADV])
def test_a_host_that_is_no_address_is_refused_naming_its_key(key, bad):
    with pytest.raises(ArgumentError, match=rf"kv_connector_extra_config\['{key}'\] must be a "
                                            r"host name or IP address, got"):
        side_channel_addresses({key: bad})


def test_address_kinds():
    assert all(map(is_wildcard, ["0.0.0.0", "::", "[::]", ""]))
    assert not any(map(is_wildcard, ["127.0.0.1", "10.0.0.1", "host"]))
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "LOCALHOST",
                                 "a.localhost", "localhost."]))
    assert not any(map(is_loopback, ["0.0.0.0", "10.0.0.1", "::", "localhost-1", "h"]))
