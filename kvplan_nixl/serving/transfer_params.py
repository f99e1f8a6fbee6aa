"""A request's ``kv_transfer_params``, checked once where ``KvplanConnector``'s scheduler admits
the request (``on_new_request``), before any of it is used.

Whoever can send an HTTP request to an engine chooses these params (a proxy passes them on;
no secret protects them), so every field the connector reads is checked here for its type and
range, and a bad one raises :class:`kvplan_nixl.errors.ParamsError` naming the field, the
value and what is allowed. The connector then fails that request alone (into vLLM's
``kv_load_failure_policy``), never raising out of the scheduler's step, and never builds
anything (a ``range(tp_size)`` of RELEASE messages, a port, a block list) from an unchecked
value.

Two kinds of request carry params: a decode request (``do_remote_prefill``) whose KV comes from
a prefill engine (:func:`check_decode`, :class:`Source`), and a prefill request
(``do_remote_decode``) whose KV goes to a decode (:func:`check_prefill`, :class:`Handover`).
Keys the connector does not read are left alone (a proxy may add its own).

Which connector the prefill runs is read here too (:class:`Peer`): vLLM 0.32's own
NixlConnector hands ``"transfer_mode": "pull"`` (``request_finished`` in
``kv_connector/v1/nixl/pull_scheduler.py``), ``KvplanConnector`` ``"kvplan"``; a NixlConnector
prefill must name its blocks and run one pipeline stage without decode context parallelism
(``pp_size``, ``dcp_size`` 1), the pairs this connector reads exactly.

Nothing here imports vLLM or NIXL, so every rule is tested on its own
(tests/test_transfer_params.py).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplan_nixl.errors import ParamsError
from kvplan_nixl.serving.pushes import MAX_BLOCK_ID, MAX_KEY, block_ids, transfer_key

__all__ = ["MAX_BLOCK_IDS", "MAX_TP", "MODES", "STOCK_ID_PREFIXES", "Handover", "Peer",
           "Source", "check_decode", "check_prefill"]

#: How a prefill hands its KV to a decode (``mode``, and a prefill request's
#: ``transfer_mode``).
MODES = ("pull", "push", "layerwise")



class Peer(enum.Enum):
    """The connector a decode request's prefill runs (:attr:`Source.peer`), which decides how
    the decode reads it and ends its hold."""

    #: ``KvplanConnector``: holds confirmed over the side channel (LEASE, CONFIRM, RELEASE)
    KVPLAN = "kvplan"
    #: vLLM's own NixlConnector (its params say ``"transfer_mode": "pull"``): read as its own
    #: decode reads it, released by NIXL notifications, heartbeaten, never confirmed
    NIXL = "nixl"


#: Largest prefill ``tp_size`` a request may name. Every rank costs a side channel connection
#: (handshake, RELEASE, CONFIRM) and a port (``remote_port + rank``): the bound caps what one
#: request can make this engine do. 128 is above any tensor parallel size vLLM runs one engine
#: at (8 GPUs a node; whole NVL72 racks run TP 72).
MAX_TP = 128

#: Most block ids one request may list over all its KV-cache groups (2**20: a 1M-token prompt
#: in blocks of one token; a genuine list is far shorter).
MAX_BLOCK_IDS = 1 << 20

#: A request id's limit on the side channel (UTF-8 bytes): it is echoed in every message.
MAX_REQUEST_ID = 512

#: Prefixes a NixlConnector prefill's request id may not start with: its notifications carry
#: the id bare, and vLLM 0.32's prefill reads ``HB:...`` as a heartbeat (``_get_new_notifs``
#: in ``nixl/pull_worker.py``), while ``kvs1 `` is the staged executor's reserved prefix
#: (:mod:`kvplan_nixl.reserved`), which an endpoint refuses to send. A ``,`` is refused
#: anywhere in the id: the heartbeat's payload is split at commas.
STOCK_ID_PREFIXES = ("HB:", "kvs1 ")

# a host name or an IP address (IPv6 in brackets or bare, a scope after %)
_HOST = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,253}")


@dataclass(frozen=True)
class Source:
    """Where a decode request's KV comes from: a prefill engine and, for a pull, its blocks.

    ``ids`` are the prefill's block lists per KV-cache group (None: push mode, the prefill
    writes), ``first`` the position of each list's first block, ``generation`` the prefill's
    hold (0: none), ``key`` the transfer key a push is matched by ("" for a pull), ``peer``
    the prefill's connector (a :class:`Peer`), ``tokens`` the tokens it computed
    (``remote_num_tokens``; 0 when not said)."""

    engine: str
    host: str
    port: int  # the prefill's TP rank 0 side channel port; rank r: port + r (fits: checked)
    tp: int
    remote_req: str
    ids: tuple[tuple[int, ...], ...] | None
    first: tuple[int, ...]
    generation: int
    key: str
    peer: Peer = Peer.KVPLAN
    tokens: int = 0

    @property
    def push(self) -> bool:
        """The prefill writes into this request's blocks (no block ids handed)."""
        return self.ids is None


@dataclass(frozen=True)
class Handover:
    """How a prefill request hands its KV on: ``mode`` (one of :data:`MODES`) and, to push,
    the transfer key its decode registered under."""

    mode: str
    key: str | None


def check_decode(request_id: str, params: Any, groups: int | None, *,
                 max_model_len: int | None = None) -> Source:
    """The source of a decode request whose ``params`` say ``do_remote_prefill``;
    :class:`ParamsError` naming the first bad field. ``groups``: this engine's KV-cache group
    count (None: not checked), which the block lists must match. ``max_model_len``: this
    engine's (None: not checked), which bounds ``remote_num_tokens`` and every
    ``remote_block_offsets`` entry (a block holds at least one token), so that no list is
    padded or derived past the longest prompt this engine serves."""
    p = _mapping(params)
    _flags(p)
    engine = _name(p, "remote_engine_id", MAX_KEY)
    host = p.get("remote_host")
    if not isinstance(host, str) or not _HOST.fullmatch(host):
        raise ParamsError("remote_host", host, "must be a host name or IP address "
                          "(1 to 253 letters, digits and . - : % [ ])")
    port = _int(p, "remote_port", 1, 65535, "must be a TCP port (an int, 1 to 65535)")
    tp = _int(p, "tp_size", 1, MAX_TP,
              f"must be the prefill's tensor parallel size (an int, 1 to {MAX_TP})")
    if port + tp - 1 > 65535:
        raise ParamsError("remote_port", port, f"rank {tp - 1}'s port (remote_port + "
                          f"tp_size - 1 = {port + tp - 1}) is above 65535")
    tokens = 0
    if "remote_num_tokens" in p and p["remote_num_tokens"] is not None:
        top = MAX_BLOCK_ID if max_model_len is None else min(MAX_BLOCK_ID, max_model_len)
        tokens = _int(p, "remote_num_tokens", 0, top, f"must be an int >= 0, at most {top}"
                      + ("" if max_model_len is None else " (this engine's max_model_len)"))
    if p.get("transfer_mode") == "pull":  # vLLM's NixlConnector prefill
        return _nixl_source(p, engine, host, port, tp, tokens, groups)
    key = _key(request_id, p)
    raw = p.get("remote_block_ids")
    if raw is None:  # push: the prefill writes; it is matched by the transfer key
        if key is None:
            raise ParamsError("transfer_id", p.get("transfer_id"), _KEY_RULE)
        return Source(engine, host, port, tp, _opt_name(p, "remote_request_id"), None, (),
                      _generation(p), key)
    ids = _lists(raw, groups)
    first = _offsets(p.get("remote_block_offsets"), len(ids), max_model_len)
    return Source(engine, host, port, tp, _name(p, "remote_request_id", MAX_REQUEST_ID),
                  ids, first, _generation(p), "", Peer.KVPLAN, tokens)


def _nixl_source(p: Mapping[str, Any], engine: str, host: str, port: int, tp: int,
                 tokens: int, groups: int | None) -> Source:
    """A NixlConnector prefill's params (pull only): its blocks, one stage, no DCP; its
    lists' offsets are not handed (the scheduler derives them from ``remote_num_tokens``)."""
    for k in ("pp_size", "dcp_size"):
        if p.get(k) not in (None, 1):
            raise ParamsError(k, p[k], "a NixlConnector prefill is read from only at 1 (one "
                              "pipeline stage, no decode context parallelism)")
    if p.get("remote_block_ids") is None:
        raise ParamsError("remote_block_ids", None, "a NixlConnector prefill "
                          "(transfer_mode 'pull') must name its blocks")
    ids = _lists(p["remote_block_ids"], groups)
    return Source(engine, host, port, tp, _stock_id(p), ids, (0,) * len(ids), 0, "", Peer.NIXL,
                  tokens)


def _stock_id(p: Mapping[str, Any]) -> str:
    """A NixlConnector prefill's ``remote_request_id``: one its notifications can carry back
    exactly (``<id>:<n>`` and ``HB:<id>,...``; :data:`STOCK_ID_PREFIXES`)."""
    v = _name(p, "remote_request_id", MAX_REQUEST_ID)
    if "," in v or v.startswith(STOCK_ID_PREFIXES):
        raise ParamsError("remote_request_id", v, "a NixlConnector prefill's request id may "
                          "not contain ',' nor start with 'HB:' or 'kvs1 ': its notifications "
                          "(<id>:<n>, HB:<id>,...) would be read as other requests' "
                          "heartbeats, as a heartbeat, or refused as a reserved message")
    return v


def check_prefill(request_id: str, params: Any, default_mode: str) -> Handover:
    """How a prefill request whose ``params`` say ``do_remote_decode`` hands its KV on;
    :class:`ParamsError` naming the bad field. ``default_mode``: the engine's ``mode``."""
    p = _mapping(params)
    _flags(p)
    mode = p.get("transfer_mode", default_mode)
    if mode not in MODES:
        raise ParamsError("transfer_mode", mode, f"must be one of {', '.join(MODES)}")
    if mode == "pull":
        return Handover(mode, None)
    key = _key(request_id, p)
    if key is None:
        raise ParamsError("transfer_id", p.get("transfer_id"), _KEY_RULE)
    return Handover(mode, key)


# -- the fields ------------------------------------------------------------------------------

_KEY_RULE = (f"a push needs a transfer key: a transfer_id of 1 to {MAX_KEY} characters, or a "
             f"request id of at most {MAX_KEY}")


def _mapping(params: Any) -> Mapping[str, Any]:
    if not isinstance(params, Mapping):
        raise ParamsError("kv_transfer_params", params, "must be a JSON object")
    return params


def _flags(p: Mapping[str, Any]) -> None:
    for k in ("do_remote_prefill", "do_remote_decode"):
        if p.get(k) is not None and not isinstance(p[k], bool):
            raise ParamsError(k, p[k], "must be true or false")
    if p.get("do_remote_prefill") and p.get("do_remote_decode"):
        raise ParamsError("do_remote_decode", True, "a request is a prefill "
                          "(do_remote_decode) or a decode (do_remote_prefill), not both")


def _name(p: Mapping[str, Any], k: str, limit: int) -> str:
    v = p.get(k)
    if not isinstance(v, str) or not 0 < len(v.encode("utf-8", "replace")) <= limit \
            or not v.isprintable():
        raise ParamsError(k, v, f"must be a printable string of 1 to {limit} bytes")
    return v


def _opt_name(p: Mapping[str, Any], k: str) -> str:
    return "" if p.get(k) is None else _name(p, k, MAX_REQUEST_ID)


def _int(p: Mapping[str, Any], k: str, low: int, high: int, rule: str) -> int:
    v = p.get(k)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ParamsError(k, v, rule)
    return v


def _generation(p: Mapping[str, Any]) -> int:
    """``remote_generation``: an int in [0, 2**63), or its decimal string (a proxy that cannot
    carry 63-bit JSON integers); absent: 0 (never held, so never confirmed)."""
    v = p.get("remote_generation")
    if v is None:
        return 0
    if isinstance(v, str) and v.isascii() and v.isdigit() and len(v) <= 19:
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63:
        raise ParamsError("remote_generation", p.get("remote_generation"),
                          "must be an int in [0, 2**63) or its decimal string")
    return v


def _key(request_id: str, p: Mapping[str, Any]) -> str | None:
    tid = p.get("transfer_id")
    if tid is not None and (isinstance(tid, bool) or not isinstance(tid, (str, int))):
        raise ParamsError("transfer_id", tid, _KEY_RULE)
    return transfer_key(request_id, p)


def _lists(raw: Any, groups: int | None) -> tuple[tuple[int, ...], ...]:
    """``remote_block_ids``: one list of block ids per KV-cache group (one group may come
    flat), each id an int in [0, 2**31). Checked per list with numpy: no loop per block."""
    rule = (f"must be one list of block ids (ints 0 to {MAX_BLOCK_ID}) per KV-cache group"
            + (f" ({groups} here)" if groups is not None else ""))
    if not isinstance(raw, (list, tuple)):
        raise ParamsError("remote_block_ids", raw, rule)
    if raw and not isinstance(raw[0], (list, tuple)):  # one group given flat
        raw = [raw]
    if not raw and groups:
        raw = [[] for _ in range(groups)]
    if (groups is not None and len(raw) != groups) or len(raw) > 64 or not all(
            isinstance(g, (list, tuple)) for g in raw):
        raise ParamsError("remote_block_ids", raw, rule)
    if sum(len(g) for g in raw) > MAX_BLOCK_IDS:
        raise ParamsError("remote_block_ids", f"<{sum(len(g) for g in raw)} ids>",
                          f"at most {MAX_BLOCK_IDS} block ids in all")
    return tuple(tuple(_ids(g, "remote_block_ids", rule)) for g in raw)


def _ids(g: Any, field: str, rule: str) -> list[int]:
    ids = block_ids(g)
    if ids is None:
        raise ParamsError(field, g, rule)
    return ids


def _offsets(raw: Any, n: int, max_model_len: int | None) -> tuple[int, ...]:
    """``remote_block_offsets``: the position of each list's first block (absent: 0s), at most
    ``max_model_len`` (the decode pads each list to it: a block holds a token or more, so a
    list starting further holds nothing of a prompt this engine serves)."""
    if raw is None:
        return (0,) * n
    top = MAX_BLOCK_ID if max_model_len is None else min(MAX_BLOCK_ID, max_model_len)
    rule = (f"must be one block position (an int 0 to {top}"
            + ("" if max_model_len is None else ", this engine's max_model_len")
            + f") per block id list ({n})")
    if not isinstance(raw, (list, tuple)) or len(raw) != n:
        raise ParamsError("remote_block_offsets", raw, rule)
    first = tuple(_ids(raw, "remote_block_offsets", rule))
    if any(f > top for f in first):
        raise ParamsError("remote_block_offsets", list(first), rule)
    return first
