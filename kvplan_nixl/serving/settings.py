"""What both halves of ``KvplanConnector`` read from the engine's config, read once by the
facade: the engine's identity, its side channel and the connector's extra config keys."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvplan_nixl.serving.holds import MAX_PIN_S
from kvplan_nixl.serving.sidechannel import side_channel_port
from kvplan_nixl.serving.transfer_params import MODES


@dataclass(frozen=True)
class Settings:
    """One engine's connector settings (see the package docstring for the extra keys)."""

    engine_id: str
    host: str  # the side channel's advertised host: what peers dial (kvplan_nixl.serving.addresses)
    port: int  # the side channel's base port (``side_channel_port``)
    tp_size: int
    extra: dict[str, Any] = field(default_factory=dict)
    dp_rank: int = 0  # vLLM's data_parallel_index: each DP rank has tp_size ports of its own
    bind_host: str = ""  # where the side channel listens, when not ``host`` (a wildcard, NAT)

    @property
    def listen_host(self) -> str:
        """The address the side channel listens on: ``bind_host``, else ``host``."""
        return self.bind_host or self.host

    def rank_port(self, tp_rank: int) -> int:
        """The side channel port of TP rank ``tp_rank`` of this engine's DP rank:
        ``port + dp_rank * tp_size + tp_rank``."""
        return side_channel_port(self.port, tp_rank, self.tp_size, self.dp_rank)

    def seconds(self, key: str, default: float, *, zero: bool = False) -> float:
        """``extra[key]`` as a finite number of seconds > 0 (>= 0 with ``zero``; ``default``
        when absent); a ValueError naming the key otherwise."""
        v = self.extra.get(key, default)
        bound = ">= 0" if zero else "> 0"
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ValueError(f"kv_connector_extra_config[{key!r}] must be a number of seconds "
                             f"{bound}, got {v!r}")
        try:
            s = float(v)
        except ValueError:
            s = math.nan
        if not (math.isfinite(s) and (s >= 0 if zero else s > 0)):
            raise ValueError(f"kv_connector_extra_config[{key!r}] must be a number of seconds "
                             f"{bound}, got {v!r}")
        return s

    def nixl_heartbeat(self) -> float:
        """How often a NixlConnector prefill's requests are heartbeaten (queued, or read):
        ``extra["kv_lease_duration"] / 6``, as NixlConnector's own decode does with that key
        (default 30 s, so every 5 s). Set it as on the stock prefill, whose lease it is."""
        return self.seconds("kv_lease_duration", 30.0) / 6

    def leases(self, lease: float) -> tuple[float, float]:
        """``(lease_pin_s, lease_margin_s)`` for reporting inside a lease (docs/vllm.md): the
        pin each LEASE asks (0: no LEASE) and how long before the pin's end a read must be seen
        complete to be reported at once. The pin defaults to ``min(5, lease)``, ``lease``
        being this engine's ``lease_s``: a LEASE then keeps a hold no longer than a RENEW at
        the same moment would; a ``lease_s`` too short to leave the margin means no LEASE."""
        margin = self.seconds("lease_margin_s", 0.1, zero=True)
        pin = self.seconds("lease_pin_s", min(5.0, lease), zero=True)
        if "lease_pin_s" not in self.extra and pin <= margin:
            pin = 0.0
        if pin and not margin < pin <= MAX_PIN_S:
            raise ValueError(f"kv_connector_extra_config['lease_pin_s'] = {pin:g} must be 0 "
                             f"(no leases) or above lease_margin_s = {margin:g} and at most "
                             f"{MAX_PIN_S:g}")
        return pin, margin

    def mode(self) -> str:
        """``extra["mode"]``: how a prefill hands its KV to a decode by default, ``"pull"``
        (the decode reads it; the default), ``"push"`` (the prefill writes it into blocks the
        decode registered, once the request finished) or ``"layerwise"`` (push, each layer
        written as soon as the forward computed it); a request's
        ``kv_transfer_params["transfer_mode"]`` overrides it."""
        v = self.extra.get("mode", "pull")
        if v not in MODES:
            raise ValueError(f"kv_connector_extra_config['mode'] must be one of "
                             f"{', '.join(map(repr, MODES))}, got {v!r}")
        return v

    def digest(self) -> bool:
        """``extra["digest"]``: check every push and pull with a transfer digest (true / false,
        default false; :mod:`.push_digests`, :mod:`.pull_digest_io`)."""
        v = self.extra.get("digest", False)
        if not isinstance(v, bool):
            raise ValueError(f"kv_connector_extra_config['digest'] must be true or false, got "
                             f"{v!r}")
        return v

    def stock_prefills(self) -> tuple[tuple[str | None, str, int, int | None], ...] | None:
        """``extra["stock_prefills"]``: the side channels of the NixlConnector prefills this
        decode may dial, a list (or comma-separated string) of ``"host:port"`` (any engine id
        there) or ``"engine_id@host:port"`` (that engine id only, and only there), either
        followed by ``/tpN`` (the prefill runs TP N: a request claiming another ``tp_size``
        is refused before anything is dialled), as ``(engine or None, host, port, N or
        None)``; None when the key is absent (any address, each engine id bound to the first
        one it connected at: docs/vllm.md, "Who a request may make the decode dial"). Hosts
        are compared as written, so write them as the prefills'
        ``VLLM_NIXL_SIDE_CHANNEL_HOST`` says them."""
        v = self.extra.get("stock_prefills")
        if v is None:
            return None
        items = v.split(",") if isinstance(v, str) else v
        bad = ValueError("kv_connector_extra_config['stock_prefills'] must be a list of "
                         "\"host:port\" or \"engine_id@host:port\" strings (port 1 to 65535), "
                         f"each optionally ending \"/tpN\" (N >= 1), got {v!r}")
        if not isinstance(items, (list, tuple)):
            raise bad
        out = []
        for item in items:
            if not isinstance(item, str):
                raise bad
            where, slash, tp = item.strip().partition("/")
            if slash and not (tp.startswith("tp") and tp[2:].isdigit() and int(tp[2:]) >= 1):
                raise bad
            engine, _, where = where.rpartition("@")
            host, _, port = where.rpartition(":")
            host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
            if not host or not port.isdigit() or not 0 < int(port) < 65536 or (
                    "@" in item and not engine):
                raise bad
            out.append((engine or None, host, int(port), int(tp[2:]) if slash else None))
        sizes: dict[tuple[str, int], int] = {}
        for _, host, port, tp in out:  # one prefill an address: one TP size
            if tp is not None and sizes.setdefault((host, port), tp) != tp:
                raise ValueError(f"kv_connector_extra_config['stock_prefills'] gives {host}:"
                                 f"{port} two TP sizes, {sizes[host, port]} and {tp}")
        return tuple(out)

    def backends(self) -> tuple[str, ...]:
        """``extra["nixl_backends"]``: NIXL backends the endpoint creates (a list, or a
        comma-separated string; default UCX)."""
        v = self.extra.get("nixl_backends", ("UCX",))
        names = v.split(",") if isinstance(v, str) else v
        if not isinstance(names, (list, tuple)) or not names or not all(
                isinstance(n, str) and n.strip() for n in names):
            raise ValueError("kv_connector_extra_config['nixl_backends'] must be a non-empty "
                             f"list of NIXL backend names (e.g. [\"UCX\"]), got {v!r}")
        return tuple(n.strip() for n in names)
