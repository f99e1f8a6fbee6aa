"""A decode rank of ``KvplanConnector`` and the prefills that run vLLM 0.32's own
NixlConnector: their handshake, fetched the way NixlConnector's decode fetches it
(:func:`fetch_nixl_metadata`), and their ranks connected as foreign peers from it
(:class:`NixlPrefills`). Runs in vLLM's environment: imports vllm and msgspec.

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
pull decode does (``transfer_mode="pull"``). A decode may accept several: a stock prefill of
another vLLM version hashes its own version (:func:`kvplan_nixl.vllm.versions.stock_hashes`
gives the hash of each version it vouches for).

Only ranks the prefill has may be asked for (``tp_size``, ``pp_size``: the prefill's, from its
``kv_transfer_params``): vLLM 0.32's listener looks the rank up unguarded, and a rank it does
not have raises ``KeyError`` in its thread, which ends it: the prefill answers no handshake
after that. So a rank out of range is refused here, before anything is sent.

An answer is capped before it is read: the exchange speaks ZMTP 3.0 itself (a REQ socket's
greeting, NULL mechanism and frames, over a plain TCP socket) so that every frame's length is
read before its body and the answer is bounded in all, :data:`MAX_ANSWER` bytes (what 1,024
regions of vLLM's metadata may take, about 4 MiB) and a few frames: a larger one raises
:class:`NixlAnswerTooLarge` at once, holding none of it. (A ``zmq`` REQ socket's
``ZMQ_MAXMSGSIZE`` bounds each frame alone: a listener answering 20 frames of 19 MiB made it
hold 400 MiB.) The host's name is resolved under the same deadline
(:func:`kvplan_nixl.serving.resolve.resolve`: a request names it, and ``getaddrinfo`` takes no
timeout).
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    NixlAgentMetadata,
    NixlHandshakePayload,
    compute_nixl_compatibility_hash,
)
from vllm.logger import init_logger

import kvplan
from kvplan.adapters.vllm_nixl import (
    NixlMetadataError,
    check_first_rank,
    fewer_ranks_fit,
    prefill_from_nixl,
)
from kvplan.constants import MAX_REGIONS
from kvplan_nixl.errors import ArgumentError, MetadataError
from kvplan_nixl.metadata import nixl_agent_name
from kvplan_nixl.serving.handshakes import (
    FAILED,
    MAX_STATES,
    AddressRefused,
    Handshakes,
    HandshakeState,
)
from kvplan_nixl.serving.resolve import ResolveError, ResolveTimeout, resolve
from kvplan_nixl.serving.sidechannel import (
    SideChannelClosed,
    SideChannelError,
    SideChannelProtocolError,
    SideChannelTimeout,
    server_identity,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvplan_nixl.serving.loads import Load
    from kvplan_nixl.serving.rank import Rank

__all__ = ["MAX_ANSWER", "NixlAnswerTooLarge", "NixlHashMismatch", "NixlPrefills",
           "NixlTpSizeUnverified", "admit", "compat_hash", "fetch_nixl_metadata",
           "stock_backend"]

logger = init_logger("vllm.kvplan_nixl")

#: Bytes a region's share of a stock rank's answer may take: its NIXL memory registration in
#: ``agent_metadata`` (UCX's packed keys) and its columns, name and member names. Measured with
#: vLLM 0.32's own ``NixlAgentMetadata`` and ``NixlHandshakePayload`` around a real NIXL agent
#: (UCX over TCP, DRAM): 1,224 bytes for 2 regions, 9,718 for 64, 143,184 for 1,024 (140 a
#: region, 44 of them the registration); a CUDA agent's keys for several transports and NICs
#: are larger, so 4 KiB, about 29 times that, leaves room for them.
_REGION_BYTES = 4096
#: Largest handshake answer a stock prefill may send, in all (bytes): :data:`MAX_REGIONS` regions
#: (more are refused by :func:`~kvplan.adapters.vllm_nixl.prefill_from_nixl` anyway) of
#: :data:`_REGION_BYTES` each and 64 KiB for the rest (the agent's own address, the engine's
#: fields, the clock frame): 4,259,840 bytes, about 4 MiB. Before it was the project's own side
#: channel's cap, 20 MiB, five times as much to hold for each of up to 32 fetches at once.
MAX_ANSWER = 64 * 1024 + MAX_REGIONS * _REGION_BYTES


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

    Its metadata is not signed, so a stock prefill's identity is its address: each engine id
    is bound to the address first connected (``pin``; a request naming it elsewhere fails,
    :class:`~kvplan_nixl.serving.handshakes.AddressConflict`), and with ``stock_prefills``
    set only those addresses are dialled (:func:`admit`). Ranks whose metadata names one NIXL
    agent twice are refused (one agent serves one rank), and so is a rank whose agent another
    connected rank uses (:meth:`kvplan_nixl.Endpoint.connect_foreign`).
    """

    def __init__(self, rank: Rank, expected: str | Mapping[str, str], backend: str) -> None:
        """``expected``: the compatibility hash, or {hash: the vLLM version that publishes
        it}, of the stock prefills this decode reads
        (:func:`kvplan_nixl.vllm.versions.stock_hashes`)."""
        self.w, self.hash, self.backend = rank, expected, backend
        self.tp: dict[tuple[str, str, int], int] = {}  # the tp_size each handshake asks for
        self.metas: dict[str, dict[int, dict[str, Any]]] = {}  # fetched so far, per engine
        self.hs = Handshakes(self._connect, lock=rank.lock, identify=_identify,
                             timeout=rank.hs_timeout, retry_after_s=min(5.0, rank.lease),
                             warn=lambda m: logger.warning("kvplan: pull %s", m),
                             fetch=self._fetch, pin=True,
                             admit=admit(rank.c.stock_prefills()))
        self.sizes = _sizes(rank.c.stock_prefills())

    def start(self, load: Load) -> HandshakeState:
        """Start (or look up) the handshake ``load`` names; never blocks. Raises
        :class:`~kvplan_nixl.serving.handshakes.AddressRefused` where ``stock_prefills``
        refuses the address, or gives the prefill another TP size than the request claims
        (nothing dialled: vLLM's listener dies when asked for a rank it lacks, and where each
        rank holds the same bytes, an MLA latent or fewer KV heads than ranks, rank 0's
        metadata cannot tell the sizes apart)."""
        key = (load.engine, load.host, load.port)
        size = self.sizes.get((load.host, load.port))
        if size is not None and size != load.remote_tp:
            raise AddressRefused(load.engine, f"{load.host}:{load.port}",
                                 f"stock_prefills says it runs TP {size}, the request's "
                                 f"tp_size is {load.remote_tp}")
        st = self.hs.state(*key)
        if st is not None and st.failed and self.tp.get(key) != load.remote_tp:
            # another claim's failure is not this request's: connect afresh for its claim
            # (before, a request claiming a wrong tp_size failed the handshake, and every
            # retry of it, by a genuine request too, asked again for the wrong size)
            self.hs.drop_failed(*key)
            st = None
        if st is None or st.failed:  # a new handshake (or a retry) asks for this claim's ranks
            if len(self.tp) >= 2 * MAX_STATES:  # a request may name a new key each time
                for k in [k for k in self.tp if self.hs.state(*k) is None]:
                    del self.tp[k]
            self.tp[key] = load.remote_tp
        return self.hs.start(load.engine, load.host, load.port,
                             address=lambda r: (load.host, load.port,
                                                server_identity(load.engine, r)))

    def state(self, load: Load) -> HandshakeState | None:
        """The handshake ``load`` waits for, as it concerns ``load``: one that connected
        (or is connecting) the prefill at another TP size than ``load`` claims fails it by
        name (its read would be planned at the connected size, not the claimed one); one that
        failed for another claim is started afresh for this one (a claim refused is no
        genuine request's failure). Never blocks."""
        key = (load.engine, load.host, load.port)
        st = self.hs.state(*key)
        claim = self.tp.get(key)
        if st is None or st.pending or claim == load.remote_tp:
            return st
        if st.ready:
            return HandshakeState(FAILED, f"tp_size {load.remote_tp} (the request's): "
                                  f"NixlConnector prefill {load.engine!r} at {load.host}:"
                                  f"{load.port} is connected as TP {claim}", st.since)
        try:
            return self.start(load)
        except Exception as e:  # refused meanwhile (nothing dialled), or closed
            return HandshakeState(FAILED, f"{type(e).__name__}: {e}", st.since)

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
            # where rank 0 reads alike at a smaller size (MLA, fewer KV heads than ranks), the
            # claim is unverified: only stock_prefills' /tpN may vouch for ranks beyond it
            fewer = None if (host, port) in self.sizes else fewer_ranks_fit(
                self.w.ep.spec, meta, tp, backend=self.backend)
            if fewer is not None:
                raise NixlTpSizeUnverified(engine, host, port, tp, fewer)
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
        _distinct_agents(engine, [metas[r] for r in range(tp)])
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


def _sizes(allowed: tuple[tuple[str | None, str, int, int | None], ...] | None
           ) -> dict[tuple[str, int], int]:
    """The TP size ``stock_prefills`` gives each address that names one (``/tpN``)."""
    return {(h, p): tp for _, h, p, tp in allowed or () if tp is not None}


def admit(allowed: tuple[tuple[str | None, str, int, int | None], ...] | None
          ) -> Callable[[str, str, int], str | None] | None:
    """Handshakes' ``admit`` for ``stock_prefills`` (``allowed``, as
    :meth:`~kvplan_nixl.serving.settings.Settings.stock_prefills` reads it; None: no check):
    why a request may not make the decode dial ``engine`` at ``host:port``, or None."""
    if allowed is None:
        return None
    places = tuple((e, h, p) for e, h, p, _ in allowed)  # the sizes: NixlPrefills.start

    def check(engine: str, host: str, port: int) -> str | None:
        named = [(e, h, p) for e, h, p in places if e == engine]
        if named and (host, port) not in [(h, p) for _, h, p in named]:
            return (f"stock_prefills binds it to {', '.join(f'{h}:{p}' for _, h, p in named)}"
                    f", not {host}:{port}")
        here = [e for e, h, p in places if (h, p) == (host, port)]
        if not here:
            return (f"{host}:{port} is not in kv_connector_extra_config['stock_prefills'] "
                    f"({len(places)} address(es))")
        if None not in here and engine not in here:
            return f"stock_prefills allows {host}:{port} for engine(s) {sorted(here)} only"
        return None
    return check


def _distinct_agents(engine: str, metas: list[dict[str, Any]]) -> None:
    """Refuse a prefill whose ranks' metadata name one NIXL agent twice: one agent serves one
    rank, so one of them is another rank's metadata (copied, or ranks swapped)."""
    seen: dict[str, int] = {}
    for r, m in enumerate(metas):
        name = nixl_agent_name(bytes(m["agent_metadata"]))
        if name is None:
            raise MetadataError(f"NixlConnector prefill {engine!r} rank {r}: agent_metadata "
                                "is not NIXL agent metadata")
        if name in seen:
            raise MetadataError(f"NixlConnector prefill {engine!r}: ranks {seen[name]} and {r} "
                                f"serve the same NIXL agent {name!r}; one agent serves one "
                                "rank, so one of them is another rank's metadata")
        seen[name] = r


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


class NixlTpSizeUnverified(NixlMetadataError):
    """A request claims ``tp_size`` ranks for the NixlConnector prefill ``engine`` at
    ``host:port``, which ``stock_prefills`` gives no ``/tpN``, and that prefill's rank 0
    metadata fits ``fits`` ranks as well (every rank holds the same bytes at either size: an
    MLA latent, or fewer KV heads than ranks), so nothing the prefill publishes says it has
    ranks ``fits`` to ``tp_size - 1``. Raised after rank 0's fetch, before any other rank is
    asked for: vLLM 0.32's listener thread dies on a rank it lacks, and the prefill then answers
    no handshake (anyone's) until it restarts."""

    def __init__(self, engine: str, host: str, port: int, tp_size: int, fits: int) -> None:
        self.engine, self.tp_size, self.fits = engine, tp_size, fits
        self.address = f"{host}:{port}"
        ranks = f"rank {fits} was" if fits == tp_size - 1 else \
            f"ranks {fits} to {tp_size - 1} were"
        super().__init__(f"tp_size {tp_size} (the request's): NixlConnector prefill {engine!r} "
                         f"at {host}:{port} publishes rank 0 metadata that fits TP {fits} as "
                         "well (every rank holds the same bytes at either size), so its TP "
                         f"size cannot be verified and {ranks} not asked for (vLLM's "
                         "listener thread dies on a rank it lacks); list it in "
                         "kv_connector_extra_config['stock_prefills'] as "
                         f"'{engine}@{host}:{port}/tp{tp_size}' if it runs TP {tp_size}")


class NixlHashMismatch(SideChannelError):
    """The prefill at ``host:port`` publishes another compatibility hash than any the decode
    accepts (``remote``; ``local``: the decode's own): another model, dtype, backend, vLLM
    version or transfer mode, as vLLM's decode refuses it. Its metadata was not decoded.
    ``versions``: the vLLM versions whose hashes the decode accepted (named in the message)."""

    def __init__(self, host: str, port: int, local: str, remote: str,
                 versions: tuple[str, ...] = ()) -> None:
        self.local, self.remote = local, remote
        which = f" (accepted: the hashes of vLLM {', '.join(versions)})" if versions else ""
        super().__init__(f"NixlConnector prefill at {host}:{port}: compatibility hash "
                         f"{remote}, this decode's {local}{which}: the engines are not "
                         "configured alike (model, dtype, KV heads, head size, layers, "
                         "attention backend, cache dtype, vLLM version or transfer mode)",
                         host, port)


class NixlAnswerTooLarge(SideChannelProtocolError):
    """The listener at ``host:port`` answered more than ``limit`` bytes (:data:`MAX_ANSWER`)
    or more frames than a handshake has: refused from the frame headers, before the bodies
    were read. Nothing of it was kept."""

    def __init__(self, host: str, port: int, limit: int) -> None:
        self.limit = limit
        super().__init__(f"NixlConnector prefill at {host}:{port}: its handshake answer was "
                         f"refused unread: above the {limit} byte cap ({limit >> 20} MiB, "
                         "MAX_ANSWER) or more frames than a handshake has", host, port)


def compat_hash(vllm_config: Any, backend_name: str) -> str:
    """The compatibility hash a NixlConnector pull decode with ``vllm_config`` and attention
    backend ``backend_name`` expects, by vLLM's own ``compute_nixl_compatibility_hash``."""
    return compute_nixl_compatibility_hash(vllm_config, backend_name, transfer_mode="pull")


def fetch_nixl_metadata(host: str, port: int, tp_rank: int, *, tp_size: int,
                        expected_hash: str | Mapping[str, str], pp_rank: int = 0,
                        pp_size: int = 1,
                        engine_id: str | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """Prefill TP rank ``tp_rank``'s ``NixlAgentMetadata`` fields (a plain dict, keys its
    field names), asked of the stock NixlConnector side channel at ``host:port``.

    ``tp_size`` and ``pp_size`` are the prefill's (see the module docstring: a rank beyond
    them is refused unsent, :class:`~kvplan_nixl.errors.ArgumentError`). ``expected_hash`` is
    the decode's compatibility hash (:func:`compat_hash`), or ``{hash: vLLM version}`` of
    every hash it accepts, its own first (a rolling upgrade: stock prefills of another vLLM
    version, :mod:`kvplan_nixl.vllm.versions`); ``engine_id``, when given, must be
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
    accepted = {expected_hash: ""} if isinstance(expected_hash, str) else expected_hash
    if payload.compatibility_hash not in accepted:
        raise NixlHashMismatch(host, port, next(iter(accepted), ""),
                               payload.compatibility_hash, tuple(v for v in accepted.values()
                                                                 if v))
    meta = _decode(NixlAgentMetadata, payload.agent_metadata_bytes, where, "NixlAgentMetadata",
                   host, port)
    if engine_id is not None and meta.engine_id != engine_id:
        raise SideChannelProtocolError(f"{where}: serves engine {meta.engine_id!r}, not "
                                       f"{engine_id!r}", host, port)
    return dataclasses.asdict(meta)


def _ask(host: str, port: int, msg: bytes, timeout_s: float) -> list[bytes]:
    """One REQ exchange with vLLM's ROUTER listener under ``timeout_s``, spoken as ZMTP 3.0
    (NULL mechanism) over a plain TCP socket, so that the answer is read frame by frame and
    bounded as it arrives: at most :data:`MAX_ANSWER` bytes and :data:`_MAX_FRAMES` frames in
    all (libzmq's ``ZMQ_MAXMSGSIZE`` bounds one frame, not how many a message has)."""
    deadline = time.monotonic() + timeout_s
    try:  # under the deadline too: a request names the host (getaddrinfo has no timeout)
        addr = resolve(host, port, deadline)
    except ResolveTimeout as e:
        raise SideChannelTimeout(f"NixlConnector prefill at {host}:{port}: {e} (within "
                                 f"{timeout_s:g} s)", host, port) from None
    except ResolveError as e:
        raise SideChannelError(f"NixlConnector prefill at {host}:{port}: {e}", host,
                               port) from None
    zmtp = _Zmtp(host, port, deadline, timeout_s)
    try:
        with zmtp.connect(addr):
            zmtp.send(_GREETING)
            greeting = zmtp.exact(64)
            if greeting[:1] != b"\xff" or greeting[9:10] != b"\x7f" or greeting[10] < 3 \
                    or greeting[12:16] != b"NULL":
                raise SideChannelProtocolError(f"NixlConnector prefill at {host}:{port}: not "
                                               "a ZMTP 3 listener (NULL mechanism)", host, port)
            zmtp.send(_frame(_READY, command=True))
            if not zmtp.frame(command=True)[0].startswith(b"\x05READY"):
                raise SideChannelProtocolError(f"NixlConnector prefill at {host}:{port}: no "
                                               "ZMTP READY", host, port)
            zmtp.send(_frame(b"", more=True) + _frame(msg))  # REQ: an empty delimiter first
            frames, more = [], True
            while more:
                data, more = zmtp.frame()
                frames.append(data)
    except SideChannelError:
        raise
    except (ConnectionResetError, BrokenPipeError) as e:  # as the side channel's client says
        raise SideChannelClosed(f"NixlConnector prefill at {host}:{port}: {e}", host,
                                port) from None
    except OSError as e:  # unreachable, ...: named, as the side channel names them
        raise SideChannelError(f"NixlConnector prefill at {host}:{port}: {e}", host,
                               port) from None
    if frames[:1] != [b""]:
        raise SideChannelProtocolError(f"NixlConnector prefill at {host}:{port}: an answer "
                                       "without REQ's empty delimiter", host, port)
    return frames[1:]


#: ZMTP 3.0's greeting of a client: signature, version 3.0, mechanism NULL, not a server.
_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + \
    b"\x00" * 32
#: The NULL mechanism's READY command of a REQ socket.
_READY = b"\x05READY" + b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"REQ"
#: Most frames an answer may carry (a handshake's: delimiter, payload, clock; a few commands).
_MAX_FRAMES = 8


def _frame(data: bytes, *, more: bool = False, command: bool = False) -> bytes:
    flags = (1 if more else 0) | (4 if command else 0)
    if len(data) > 255:
        return bytes([flags | 2]) + len(data).to_bytes(8, "big") + data
    return bytes([flags, len(data)]) + data


class _Zmtp:
    """Reads and writes of one ZMTP exchange, each bounded by the exchange's deadline; what is
    read is bounded by :data:`MAX_ANSWER` bytes and :data:`_MAX_FRAMES` frames in all."""

    def __init__(self, host: str, port: int, deadline: float, timeout_s: float) -> None:
        self.host, self.port = host, port
        self.deadline, self.timeout_s = deadline, timeout_s
        self.budget, self.frames = MAX_ANSWER, 0

    def connect(self, addr: tuple) -> socket.socket:
        """A connected socket; a refused connection is tried again every 0.1 s until the
        deadline, as a ZMQ socket reconnects (a listener not up yet answers once it is)."""
        while True:
            self.sock = socket.socket(addr[0], socket.SOCK_STREAM)
            try:
                self.io(lambda: self.sock.connect(addr[4]))
                return self.sock
            except ConnectionRefusedError:
                self.sock.close()
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise self.late() from None
                time.sleep(min(0.1, left))
            except BaseException:
                self.sock.close()
                raise

    def io(self, op: Callable[[], Any]) -> Any:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.late()
        self.sock.settimeout(left)
        try:
            return op()
        except TimeoutError:
            raise self.late() from None

    def late(self) -> SideChannelTimeout:
        return SideChannelTimeout(f"NixlConnector prefill at {self.host}:{self.port}: no "
                                  f"handshake answer in {self.timeout_s:g} s", self.host,
                                  self.port)

    def send(self, data: bytes) -> None:
        self.io(lambda: self.sock.sendall(data))

    def exact(self, n: int) -> bytes:
        out = bytearray(n)
        view, at = memoryview(out), 0
        while at < n:
            got = self.io(lambda at=at: self.sock.recv_into(view[at:], min(n - at, 1 << 20)))
            if not got:
                raise SideChannelClosed(f"NixlConnector prefill at {self.host}:{self.port}: "
                                        "closed the connection before its answer", self.host,
                                        self.port)
            at += got
        return bytes(out) if n < 4096 else out

    def frame(self, *, command: bool = False) -> tuple[bytes, bool]:
        """The next frame (a message frame; with ``command``, a command) and whether more
        follow; refused by size before its body is read."""
        self.frames += 1
        if self.frames > _MAX_FRAMES:
            raise NixlAnswerTooLarge(self.host, self.port, MAX_ANSWER)
        flags = self.exact(1)[0]
        size = int.from_bytes(self.exact(8 if flags & 2 else 1), "big")
        if size > self.budget:
            raise NixlAnswerTooLarge(self.host, self.port, MAX_ANSWER)
        self.budget -= size
        data = self.exact(size)
        if bool(flags & 4) != command:
            if flags & 4:  # a command between message frames (none is sent here): skipped
                return self.frame(command=command)
            raise SideChannelProtocolError(f"NixlConnector prefill at {self.host}:"
                                           f"{self.port}: a message frame where a ZMTP "
                                           "command was due", self.host, self.port)
        return data, bool(flags & 1)


def _decode(kind: type, data: bytes, where: str, what: str, host: str, port: int) -> Any:
    try:
        return msgspec.msgpack.Decoder(kind).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SideChannelProtocolError(f"{where}: not a {what} of vLLM's NIXL connector "
                                       f"version this decode runs: {e}", host, port) from e
