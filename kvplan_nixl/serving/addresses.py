"""Which side channel addresses can work: the one an engine listens on (its *bind* address) and
the one it tells its peers to dial (its *advertised* address), checked when the engine starts.

An engine advertises its address in every prefill response (``remote_host``) and every push
registration; a peer on another host dials it. Two choices cannot work and are refused here,
naming the key they came from:

- a **wildcard** advertised (``0.0.0.0``, ``::``): fine to listen on, never a place to dial;
- a **loopback** address advertised by an engine that listens on a wildcard or on a host
  address: listening there says it serves other hosts, and each of them would dial itself.

Loopback advertised by an engine that also listens on loopback is a one-host deployment and
accepted: nothing off the host can reach that side channel anyway. Whether a peer really is on
the same host is only known when it dials; a decode that fails so reports it (a WARNING naming
the address and a ``num_failed_handshakes`` count, :mod:`kvplan_nixl.vllm.worker`). Names are
not resolved here (a peer may resolve them differently), except ``localhost``.

No vLLM import: the connector's facade calls :func:`side_channel_addresses` with its extra
config and ``$VLLM_HOST_IP``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

from kvplan_nixl.errors import ArgumentError

__all__ = ["ADVERTISE_KEY", "BIND_KEY", "DEFAULT_HOST", "is_loopback", "is_wildcard",
           "side_channel_addresses"]

#: The extra config key of the address the side channel listens on.
BIND_KEY = "side_channel_host"
#: The extra config key of the address peers are told to dial, when it differs (NAT, a
#: container's port mapping, a wildcard bind).
ADVERTISE_KEY = "side_channel_advertise_host"
#: Where the side channel listens when neither the key nor ``$VLLM_HOST_IP`` says: one host.
DEFAULT_HOST = "127.0.0.1"


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def is_wildcard(host: str) -> bool:
    """True for an address that means "every interface" (``0.0.0.0``, ``::``) or none."""
    ip = _ip(host)
    return not host.strip() or (ip is not None and ip.is_unspecified)


def is_loopback(host: str) -> bool:
    """True for a loopback address (``127.0.0.0/8``, ``::1``) or the name ``localhost``."""
    ip = _ip(host)
    if ip is not None:
        return ip.is_loopback
    name = host.lower().rstrip(".")
    return name == "localhost" or name.endswith(".localhost")


def _host(extra: Mapping[str, Any], key: str) -> str | None:
    v = extra.get(key)
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip() or any(c.isspace() for c in v):
        raise ArgumentError(f"kv_connector_extra_config[{key!r}] must be a host name or IP "
                            f"address, got {v!r}")
    return v


def side_channel_addresses(extra: Mapping[str, Any],
                           vllm_host_ip: str | None = None) -> tuple[str, str]:
    """``(bind, advertised)`` for an engine's side channel, refusing what cannot work.

    ``bind`` is ``extra["side_channel_host"]``, else ``vllm_host_ip`` (``$VLLM_HOST_IP``), else
    127.0.0.1; ``advertised`` is ``extra["side_channel_advertise_host"]``, else ``bind``. An
    :class:`~kvplan_nixl.errors.ArgumentError` names the key (or variable) to change when the
    advertised address is a wildcard, or loopback while ``bind`` is not (the module
    docstring says why)."""
    bind_from = f"kv_connector_extra_config[{BIND_KEY!r}]"
    bind = _host(extra, BIND_KEY)
    if bind is None and vllm_host_ip and vllm_host_ip.strip():
        bind, bind_from = vllm_host_ip.strip(), f"$VLLM_HOST_IP (no {BIND_KEY!r} set)"
    bind = bind or DEFAULT_HOST
    advertised = _host(extra, ADVERTISE_KEY)
    adv_from = f"kv_connector_extra_config[{ADVERTISE_KEY!r}]"
    if advertised is None:
        advertised, adv_from = bind, bind_from
    if is_wildcard(advertised):
        raise ArgumentError(
            f"{adv_from} is {advertised!r}, a wildcard: the side channel may listen on it, but "
            f"peers are told to dial it and cannot; set kv_connector_extra_config"
            f"[{ADVERTISE_KEY!r}] to this host's address that the other engines reach (or "
            f"{BIND_KEY!r} to that address instead of the wildcard)")
    if is_loopback(advertised) and not is_loopback(bind):
        raise ArgumentError(
            f"{adv_from} is {advertised!r}, a loopback address, while the side channel "
            f"listens on {bind!r} ({bind_from}), which serves other hosts: each of them would "
            f"dial itself; set kv_connector_extra_config[{ADVERTISE_KEY!r}] to this host's "
            f"address that the other engines reach (loopback is for one host only, with "
            f"{BIND_KEY!r} on loopback too)")
    return bind, advertised
