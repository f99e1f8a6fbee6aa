"""A decode rank of ``KvplanConnector`` and the prefills that run vLLM 0.32's own
NixlConnector: their handshake, fetched the way NixlConnector's decode fetches it
(:func:`fetch_nixl_metadata`), and their ranks connected as foreign peers from it
(:class:`NixlPrefills`). Runs in vLLM's environment: imports vllm, zmq, msgspec.

vLLM 0.32's NixlConnector serves every prefill rank's handshake from one ZMQ ``ROUTER`` in its
scheduler process (``_nixl_handshake_listener`` in ``nixl/base_scheduler.py``), on **one port
per engine** (``VLLM_NIXL_SIDE_CHANNEL_PORT`` plus the data parallel index), not one per TP
rank: the request names the rank. The exchange (``_nixl_handshake`` in ``base_worker.py``)::

    REQ -> msgpack((b"get_meta_msg", pp_rank, tp_rank))
    REQ <- [msgpack(NixlHandshakePayload(compatibility_hash, agent_metadata_bytes)),
            msgpack(the prefill's time.perf_counter())]

and the decode checks ``compatibility_hash`` against its own before it decodes
``agent_metadata_bytes`` as ``NixlAgentMetadata``. :func:`fetch_nixl_metadata` does the same
and returns the metadata's fields as the mapping
:func:`kvplan.adapters.vllm_nixl.prefill_from_nixl` takes.

The expected hash is an argument, not computed here: vLLM's hash
(``compute_nixl_compatibility_hash``) is a function of the *decode's* ``VllmConfig`` (model
path, dtype, KV heads, head size, layers, cache dtype, hybrid manager, speculative config, vLLM
and connector versions, transfer mode) and its attention backend, which only the decode engine
holds; :func:`compat_hash` computes it from them with vLLM's own function, as NixlConnector's
pull decode does (``transfer_mode="pull"``).

Only ranks the prefill has may be asked for (``tp_size``, ``pp_size``: the prefill's, from its
``kv_transfer_params``): vLLM 0.32's listener looks the rank up unguarded, and a rank it does
not have raises ``KeyError`` in its thread, which ends it: the prefill answers no handshake
after that. So a rank out of range is refused here, before anything is sent.

An answer is capped before it is read: the socket's ``ZMQ_MAXMSGSIZE`` is :data:`MAX_ANSWER`
(the project's own side channel's metadata cap, ``MAX_METADATA``), so libzmq refuses a larger
frame from its length header, before allocating it, and drops the connection; the fetch sees
that (a socket monitor: disconnected, and no reconnect scheduled, as after a protocol error;
a listener that closed the connection is dialled again) and raises :class:`NixlAnswerTooLarge`
at once instead of waiting out its deadline.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    NixlAgentMetadata,
    NixlHandshakePayload,
    compute_nixl_compatibility_hash,
)
from vllm.logger import init_logger
from vllm.utils.network_utils import make_zmq_path
from zmq.utils.monitor import recv_monitor_message

import kvplan
from kvplan.adapters.vllm_nixl import check_first_rank, prefill_from_nixl
from kvplan_nixl.errors import ArgumentError
from kvplan_nixl.serving.handshakes import Handshakes, HandshakeState
from kvplan_nixl.serving.sidechannel import (
    MAX_METADATA,
    SideChannelError,
    SideChannelProtocolError,
    SideChannelTimeout,
    server_identity,
)

if TYPE_CHECKING:
    from kvplan_nixl.vllm.rank import Rank
    from kvplan_nixl.vllm.scheduler import Load

__all__ = ["MAX_ANSWER", "NixlAnswerTooLarge", "NixlHashMismatch", "NixlPrefills",
           "compat_hash", "fetch_nixl_metadata", "stock_backend"]

logger = init_logger("vllm.kvplan_nixl")

#: Largest frame a stock prefill's handshake answer may carry (bytes): the project's own side
#: channel's metadata cap (20 MiB). vLLM's own metadata is a few KiB per rank (a region is
#: three ints); a model of thousands of layers stays far below it.
MAX_ANSWER = MAX_METADATA
#: Seconds after a dropped connection within which libzmq schedules its reconnect when the
#: peer closed it (it does so at once); none by then: the drop was a refused frame.
_RETRY_S = 0.2


class NixlPrefills:
    """One decode rank's handshakes with NixlConnector prefills, on a
    :class:`~kvplan_nixl.serving.handshakes.Handshakes` of their own (its pool, timeouts,
    retries and per-address state, keyed by what the request names).

    A handshake asks the prefill's one side channel for rank 0's metadata, checks the
    ``tp_size`` of the request that started it against it
    (:func:`kvplan.adapters.vllm_nixl.check_first_rank`: a rank's block lengths are its share
    of the model's heads), then asks for every other rank's: the prefill's spec needs all of
    them (:func:`kvplan.adapters.vllm_nixl.prefill_from_nixl` checks they agree and match
    this engine's model exactly, or refuses naming what). Then the ranks this rank reads
    (every rank, on rank 0: it tells the ranks nobody reads that they may free) are connected
    as foreign peers (:meth:`kvplan_nixl.Endpoint.connect_foreign`), and the engine's pull
    map and readers per rank are recorded in ``rank.engines`` as a kvplan prefill's are.
    """

    def __init__(self, rank: Rank, expected_hash: str, backend: str) -> None:
        self.w, self.hash, self.backend = rank, expected_hash, backend
        self.tp: dict[tuple[str, str, int], int] = {}  # the tp_size each handshake asks for
        self.metas: dict[str, dict[int, dict[str, Any]]] = {}  # fetched so far, per engine
        self.hs = Handshakes(self._connect, lock=rank.lock, identify=_identify,
                             timeout=rank.hs_timeout, retry_after_s=min(5.0, rank.lease),
                             warn=lambda m: logger.warning("kvplan: pull %s", m),
                             fetch=self._fetch)

    def start(self, load: Load) -> HandshakeState:
        """Start (or look up) the handshake ``load`` names; never blocks."""
        key = (load.engine, load.host, load.port)
        if self.hs.state(*key) is None:  # a new handshake asks for this request's ranks
            self.tp[key] = load.remote_tp
        return self.hs.start(load.engine, load.host, load.port,
                             address=lambda r: (load.host, load.port,
                                                server_identity(load.engine, r)))

    def state(self, load: Load) -> HandshakeState | None:
        return self.hs.state(load.engine, load.host, load.port)

    def forget(self, engine: str) -> None:
        self.hs.forget(engine)

    def close(self) -> None:
        self.hs.close()

    def _fetch(self, host: str, port: int, *, timeout: float, identity: str) -> bytes:
        """Handshakes' fetch: the rank ``identity`` names, from the prefill's one port."""
        engine, _, rank = identity.rpartition("#")
        tp = self.tp[engine, host, port]
        meta = fetch_nixl_metadata(host, port, int(rank), tp_size=tp, expected_hash=self.hash,
                                   engine_id=engine, timeout_s=timeout)
        if rank == "0":  # the request's tp_size, against rank 0's own block lengths: before
            # any other rank is asked for (vLLM's listener dies on a rank it lacks)
            check_first_rank(self.w.ep.spec, meta, tp, backend=self.backend)
        return msgspec.msgpack.encode((int(rank), tp, meta))

    def _connect(self, engine: str, rank: int, blob: bytes) -> tuple[int, ...]:
        """Handshakes' connect (under the rank's lock): keep rank ``rank``'s metadata; once
        every rank's is in, describe the prefill and connect the ranks this rank needs."""
        w = self.w
        _, tp, meta = msgspec.msgpack.decode(blob)
        if rank == 0:  # a handshake starts at rank 0: nothing of an earlier one is kept
            self.metas[engine] = {}
        metas = self.metas.setdefault(engine, {})
        metas[rank] = meta
        missing = tuple(r for r in range(tp) if r not in metas)
        if missing:
            return missing
        del self.metas[engine]
        prefill = prefill_from_nixl(w.ep.spec, [metas[r] for r in range(tp)],
                                    backend=self.backend)
        tmap = kvplan.pull_map(prefill.spec, w.ep.spec, w.rank)
        memory = {b: "VRAM" for b in prefill.spec.buffers} if w.cuda else None
        for r in range(tp) if w.rank == 0 else tmap.peers:
            w.ep.connect_foreign(engine, r, prefill.spec, prefill.buffers[r],
                                 bytes(metas[r]["agent_metadata"]), memory=memory,
                                 device=prefill.device_ids[r])
        logger.info("kvplan: prefill engine %s runs vLLM's NixlConnector (tp %d, backend %s, "
                    "layout %s): rank %d reads its rank(s) %s; its reads are not confirmed "
                    "(it holds no lease of ours: docs/vllm.md, \"Migrating a fleet\")",
                    engine, tp, prefill.backend, metas[0]["kv_cache_layout"], w.rank,
                    list(tmap.peers))
        return ()


def _identify(blob: bytes) -> tuple[str, int]:
    """Handshakes' identify: the engine the fetched metadata names and the rank asked for
    (NixlConnector's metadata is not signed and does not say its rank)."""
    rank, _, meta = msgspec.msgpack.decode(blob)
    return meta["engine_id"], rank


def stock_backend(vllm_config: Any) -> str:
    """The attention backend name NixlConnector publishes and hashes for this engine: its first
    layer's (``NixlBaseConnectorWorker.backend_name``)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    return get_current_attn_backends(vllm_config)[0].get_name()


class NixlHashMismatch(SideChannelError):
    """The prefill at ``host:port`` publishes another compatibility hash than the decode's
    (``remote`` and ``local``): another model, dtype, backend, vLLM version or transfer mode,
    as vLLM's decode refuses it. Its metadata was not decoded."""

    def __init__(self, host: str, port: int, local: str, remote: str) -> None:
        self.local, self.remote = local, remote
        super().__init__(f"NixlConnector prefill at {host}:{port}: compatibility hash "
                         f"{remote}, this decode's {local}: the engines are not configured "
                         "alike (model, dtype, KV heads, head size, layers, attention backend, "
                         "cache dtype, vLLM version or transfer mode)", host, port)


class NixlAnswerTooLarge(SideChannelProtocolError):
    """The listener at ``host:port`` answered a frame above ``limit`` bytes (:data:`MAX_ANSWER`),
    or bytes that are not ZMTP: libzmq refused it from its length header, unread
    (``ZMQ_MAXMSGSIZE``), and dropped the connection. Nothing of it was kept."""

    def __init__(self, host: str, port: int, limit: int) -> None:
        self.limit = limit
        super().__init__(f"NixlConnector prefill at {host}:{port}: its handshake answer was "
                         f"refused unread: a frame above the {limit} byte cap "
                         f"({limit >> 20} MiB, MAX_ANSWER), or not ZMTP", host, port)


def compat_hash(vllm_config: Any, backend_name: str) -> str:
    """The compatibility hash a NixlConnector pull decode with ``vllm_config`` and attention
    backend ``backend_name`` expects, by vLLM's own ``compute_nixl_compatibility_hash``."""
    return compute_nixl_compatibility_hash(vllm_config, backend_name, transfer_mode="pull")


def fetch_nixl_metadata(host: str, port: int, tp_rank: int, *, tp_size: int,
                        expected_hash: str, pp_rank: int = 0, pp_size: int = 1,
                        engine_id: str | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """Prefill TP rank ``tp_rank``'s ``NixlAgentMetadata`` fields (a plain dict, keys its
    field names), asked of the stock NixlConnector side channel at ``host:port``.

    ``tp_size`` and ``pp_size`` are the prefill's (see the module docstring: a rank beyond
    them is refused unsent, :class:`~kvplan_nixl.errors.ArgumentError`). ``expected_hash`` is
    the decode's compatibility hash (:func:`compat_hash`); ``engine_id``, when given, must be
    the one the metadata names. The whole exchange runs under ``timeout_s``.

    Raises :class:`~kvplan_nixl.serving.sidechannel.SideChannelTimeout` (no answer in time),
    :class:`NixlAnswerTooLarge` (a frame above :data:`MAX_ANSWER`, refused unread),
    :class:`NixlHashMismatch`, :class:`~kvplan_nixl.serving.sidechannel.SideChannelProtocolError`
    (an answer that is not a NixlConnector handshake of this version, or another engine's),
    each naming ``host:port``.
    """
    for name, rank, size in (("tp_rank", tp_rank, tp_size), ("pp_rank", pp_rank, pp_size)):
        if not 0 <= rank < size:
            raise ArgumentError(f"{name} {rank}: the prefill at {host}:{port} has ranks 0 to "
                                f"{size - 1}; vLLM's listener thread dies on a rank it lacks")
    if not timeout_s > 0:
        raise ArgumentError(f"timeout_s {timeout_s}: must be positive")
    reply = _ask(host, port, msgspec.msgpack.encode((GET_META_MSG, pp_rank, tp_rank)),
                 timeout_s)
    where = f"NixlConnector prefill at {host}:{port} (pp rank {pp_rank}, tp rank {tp_rank})"
    if len(reply) != 2:
        raise SideChannelProtocolError(f"{where}: answered {len(reply)} frames, a handshake "
                                       "is 2 (payload, clock)", host, port)
    payload = _decode(NixlHandshakePayload, reply[0], where, "NixlHandshakePayload", host,
                      port)
    if payload.compatibility_hash != expected_hash:
        raise NixlHashMismatch(host, port, expected_hash, payload.compatibility_hash)
    meta = _decode(NixlAgentMetadata, payload.agent_metadata_bytes, where, "NixlAgentMetadata",
                   host, port)
    if engine_id is not None and meta.engine_id != engine_id:
        raise SideChannelProtocolError(f"{where}: serves engine {meta.engine_id!r}, not "
                                       f"{engine_id!r}", host, port)
    return dataclasses.asdict(meta)


def _ask(host: str, port: int, msg: bytes, timeout_s: float) -> list[bytes]:
    """One REQ/REP exchange under ``timeout_s``, its answer's frames capped at
    :data:`MAX_ANSWER` before they are read; the socket never lingers after."""
    ms = max(1, int(timeout_s * 1000))
    deadline = time.monotonic() + timeout_s
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        # LINGER 0: an unanswered request must not keep the process alive at exit
        for opt, val in ((zmq.LINGER, 0), (zmq.SNDTIMEO, ms), (zmq.MAXMSGSIZE, MAX_ANSWER)):
            sock.setsockopt(opt, val)
        # a frame above MAXMSGSIZE is a protocol error: libzmq drops the connection and, unlike
        # after a peer's close, schedules no reconnect (no CONNECT_RETRIED follows)
        mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        sock.connect(make_zmq_path("tcp", host, port))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        try:
            sock.send(msg)
            dropped: float | None = None  # when the connection dropped with no retry after
            while (left := deadline - time.monotonic()) > 0:
                if dropped is not None:
                    left = min(left, dropped + _RETRY_S - time.monotonic())
                ready = dict(poller.poll(max(1, int(left * 1000))))
                if sock in ready:
                    return sock.recv_multipart(zmq.NOBLOCK)
                while mon.poll(0):
                    event = recv_monitor_message(mon)["event"]
                    dropped = time.monotonic() if event == zmq.EVENT_DISCONNECTED else None
                if dropped is not None and time.monotonic() >= dropped + _RETRY_S:
                    raise NixlAnswerTooLarge(host, port, MAX_ANSWER)
        except zmq.Again:
            pass
        raise SideChannelTimeout(f"NixlConnector prefill at {host}:{port}: no handshake "
                                 f"answer in {timeout_s:g} s", host, port)
    finally:
        ctx.destroy(linger=0)


def _decode(kind: type, data: bytes, where: str, what: str, host: str, port: int) -> Any:
    try:
        return msgspec.msgpack.Decoder(kind).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SideChannelProtocolError(f"{where}: not a {what} of vLLM's NIXL connector "
                                       f"version this decode runs: {e}", host, port) from e
