"""``KvplanConnector``: a vLLM V1 KV connector whose transfers are planned by kvplan and moved
by kvplan_nixl (see docs/vllm.md).

Load it with::

    KVTransferConfig(kv_connector="KvplanConnector", kv_connector_module_path="kvplan_nixl.vllm",
                     kv_role="kv_both", kv_buffer_device="cpu",
                     kv_connector_extra_config={"secret": "...", "side_channel_port": 5700})

This is the only module of the project that imports vLLM (written against vLLM 0.32.0's
``vllm/distributed/kv_transfer/kv_connector/v1/base.py``); ``import kvplan_nixl`` never loads it.

The request flow is NixlConnector's, so a proxy needs no change: a prefill request carries
``kv_transfer_params={"do_remote_decode": True}`` and returns ``do_remote_prefill``,
``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
``remote_port``, ``tp_size``, ``remote_num_tokens``; the decode request carries those and pulls
the KV before its first step.

- **Spec**: each worker derives its rank's :class:`kvplan.EngineSpec` from the tensors vLLM
  registers (:func:`kvplan.adapters.vllm.spec_from_vllm`), so nothing is described by hand.
- **Handshake**: each prefill worker rank serves its signed ``Endpoint.metadata()`` on a small
  TCP side channel, ``remote_port + tp_rank``; a decode rank connects the prefill ranks its
  pull map names (``Endpoint.connect``: kvplan refuses an incompatible pair there).
- **Per request**: ``map.plan(remote blocks, local blocks, tokens=(held, prompt),
  dst_from="start")`` moves exactly the positions decode lacks; ``Endpoint.read`` posts it
  with a notification and a deadline (``transfer_timeout_s``).
- **Freeing**: the notification names the request and how many decode ranks read each
  prefill rank; a prefill rank reports the request's send finished when the last one arrived
  (prefill ranks no decode rank reads get a ``RELEASE`` on the side channel), or when its
  lease (``lease_s``) ran out.
- **Failures**: a transfer that fails or misses its deadline, or a prefill engine that cannot
  be reached, reports the request's blocks through ``get_block_ids_with_load_errors`` (one
  KV-cache group; with several, the request through ``failed_recving``); vLLM's
  ``kv_load_failure_policy`` then recomputes them or fails the request.

Extra config keys: ``secret`` (str, signs the metadata; the same on every engine),
``side_channel_host`` (default ``$VLLM_HOST_IP`` or 127.0.0.1), ``side_channel_port`` (base
port, default 5700), ``transfer_timeout_s`` (default 30), ``handshake_timeout_s`` (default 5),
``lease_s`` (default 120).
"""

from __future__ import annotations

import contextlib
import os
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.logger import init_logger

import kvplan
from kvplan.adapters.vllm import spec_from_vllm, vllm_buffers, whole_pages

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# a child of vLLM's logger, so that its handlers and level apply
logger = init_logger("vllm.kvplan_nixl")

#: Prefix of the notifications this connector sends (``kvplan|<request>|<counts>``).
NOTIFY_PREFIX = b"kvplan|"


@dataclass
class Load:
    """One decode request's pull: what the scheduler decided, for every worker rank."""

    req_id: str
    remote_req: str
    engine: str
    host: str
    port: int
    remote_tp: int
    remote_ids: list[int]
    local_ids: list[int]  # the blocks decode lacks, from the one holding position `start`
    start: int  # positions decode already holds (a prefix-cache hit)
    end: int  # the prompt's length
    parked: bool  # the request waits for this load (False: only release the prefill's blocks)


@dataclass
class KvplanMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: pulls to start and prefill sends to watch."""

    loads: list[Load] = field(default_factory=list)
    sends: list[str] = field(default_factory=list)


class KvplanConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector on kvplan + kvplan_nixl (the module docstring says how)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        extra = dict(cfg.kv_connector_extra_config or {})
        self.engine_id = str(cfg.engine_id)
        self.host = str(extra.get("side_channel_host")
                        or os.environ.get("VLLM_HOST_IP") or "127.0.0.1")
        self.port = int(extra.get("side_channel_port", 5700))
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("KvplanConnector: pipeline parallelism is not supported yet")
        self._scheduler = _Scheduler(self) if role == KVConnectorRole.SCHEDULER else None
        self._worker = _Worker(self, vllm_config, extra) if role == KVConnectorRole.WORKER \
            else None

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """A decode request with remote prefill params loads every prompt position it lacks."""
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Record the pull into the blocks vLLM just allocated."""
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's pulls and newly finished prefill sends, for every worker."""
        return self._scheduler.meta()

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A finished prefill keeps its blocks for decode and returns the params to pull them."""
        return self._scheduler.finished(request, block_ids)

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Derive this rank's spec from the tensors, register them, serve the metadata."""
        self._worker.register(kv_caches, self._kv_cache_config)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Post this step's pulls (non-blocking)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvplanMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads complete before the request is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing to save: decode pulls from the prefill's own blocks."""

    def wait_for_save(self) -> None:
        """Nothing to save."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(prefill sends released, decode pulls finished) since the last call."""
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending, r.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Sends released, pulls finished (failed ones too), pulls failed."""
        return self._worker.results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local blocks of pulls that failed since the last call (to recompute)."""
        return self._worker.take_errors()

    def shutdown(self) -> None:
        """Stop the side channel and the progress thread, release every NIXL handle."""
        if self._worker is not None:
            self._worker.close()


class _Scheduler:
    """The scheduler half: which requests pull, into which blocks, and the returned params."""

    def __init__(self, conn: KvplanConnector) -> None:
        self.c = conn
        self.block_size = conn._kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size \
            if conn._kv_cache_config is not None else None
        self.loads: dict[str, Load] = {}
        self.sends: list[str] = []

    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        p = request.kv_transfer_params
        if p and p.get("do_remote_prefill") and p.get("remote_block_ids") is not None:
            count = len(request.prompt_token_ids or ()) - num_computed
            if count > 0:
                return count, True
        return 0, False

    def allocated(self, request: Any, blocks: Any, num_external: int) -> None:
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill"):
            return
        p["do_remote_prefill"] = False  # one pull per request
        held = sum(b.block_hash is not None and not b.is_null for b in blocks.blocks[0])
        local = blocks.get_unhashed_block_ids_all_groups()[0] if num_external > 0 else []
        self.loads[request.request_id] = _load(request.request_id, p, list(local),
                                               held * self.block_size,
                                               len(request.prompt_token_ids or ()),
                                               num_external > 0)

    def meta(self) -> KvplanMetadata:
        m = KvplanMetadata(loads=list(self.loads.values()), sends=self.sends)
        self.loads, self.sends = {}, []
        return m

    def finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        from vllm.v1.request import RequestStatus

        p = request.kv_transfer_params
        if not p:
            return False, None
        if p.get("do_remote_prefill"):  # never scheduled (aborted): free the prefill's blocks
            p["do_remote_prefill"] = False
            self.loads[request.request_id] = _load(request.request_id, p, [], 0, 0, False)
            return False, None
        if not p.get("do_remote_decode") or request.status not in (
                RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        delay = len(block_ids) > 0
        if delay:
            self.sends.append(request.request_id)
        return delay, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [list(block_ids)], "remote_engine_id": self.c.engine_id,
            "remote_request_id": request.request_id, "remote_host": self.c.host,
            "remote_port": self.c.port, "tp_size": self.c.tp_size,
            "remote_num_tokens": request.num_computed_tokens, "transfer_mode": "kvplan",
        }


def _load(req_id: str, p: dict, local: list[int], start: int, end: int, parked: bool) -> Load:
    ids = p.get("remote_block_ids") or [[]]
    if ids and not isinstance(ids[0], (list, tuple)):  # one group given flat
        ids = [ids]
    return Load(req_id=req_id, remote_req=str(p.get("remote_request_id")),
                engine=str(p.get("remote_engine_id")), host=str(p.get("remote_host")),
                port=int(p.get("remote_port") or 0), remote_tp=int(p.get("tp_size") or 1),
                remote_ids=list(ids[0]), local_ids=local,
                start=start, end=end, parked=parked)


class _Worker:
    """The worker half, one per TP rank: endpoint, side channel, progress thread, pulls."""

    def __init__(self, conn: KvplanConnector, vllm_config: Any, extra: dict) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.c = conn
        self.vllm_config = vllm_config
        self.rank = get_tensor_model_parallel_rank()
        self.secret = extra.get("secret")
        self.timeout = float(extra.get("transfer_timeout_s", 30.0))
        self.hs_timeout = float(extra.get("handshake_timeout_s", 5.0))
        self.lease = float(extra.get("lease_s", 120.0))
        self.lock = threading.Lock()  # every Endpoint call: it is used by one thread at a time
        self.ep = None
        self.md = b""
        self.server: socketserver.TCPServer | None = None
        self.stop = threading.Event()
        self.engines: dict[str, tuple[Any, list[int]]] = {}  # prefill engine -> map, counts
        self.inflight: dict[str, tuple[Any, Load]] = {}
        self.recv_done: set[str] = set()
        self.recv_failed: set[str] = set()
        self.errors: set[int] = set()
        self.got: dict[str, int] = {}  # prefill: notifications per request
        self.released: set[str] = set()
        self.watch: dict[str, float] = {}  # prefill sends vLLM waits for -> lease deadline

    # -- start-up ----------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: Any) -> None:
        from kvplan_nixl import Endpoint

        cfg = self.vllm_config
        backend = _backend_name(cfg)
        spec = spec_from_vllm(
            kv_caches, kv_cache_config, tp_size=self.c.tp_size, backend=backend,
            total_num_kv_heads=cfg.model_config.get_total_num_kv_heads(),
            dcp_size=cfg.parallel_config.decode_context_parallel_size,
            dcp_interleave=getattr(cfg.parallel_config, "cp_kv_cache_interleave_size", 1))
        self.groups = spec.num_groups
        # CPU_ATTN keeps each (block, head) page in its kernel's order: move whole blocks only
        self.whole = whole_pages(backend)
        bufs: dict[str, Any] = dict(vllm_buffers(kv_caches, spec, self.rank))
        first = next(iter(kv_caches.values()))
        if first.device.type == "cuda":  # NIXL needs the device: flat views of the buffers
            bufs = {k: _flat(kv_caches, a, n) for k, (a, n) in bufs.items()}
        self.ep = Endpoint(self.c.engine_id, spec, self.rank, bufs, secret=self.secret)
        self.md = self.ep.metadata()
        r = spec.regions[0]
        logger.info("kvplan: rank %d registered %d regions (backend %s, layout %s, block %d, "
                    "%s, %d buffers)", self.rank, len(spec.regions), backend, r.layout_name,
                    r.block_size, r.dtype, len(spec.buffers))
        self._serve()
        threading.Thread(target=self._progress_loop, daemon=True,
                         name="kvplan-progress").start()

    def _serve(self) -> None:
        worker = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(4096).decode(errors="replace").strip()
                if line == "MD":
                    self.wfile.write(struct.pack("!I", len(worker.md)) + worker.md)
                elif line.startswith("RELEASE "):
                    req = line.split(" ", 1)[1]
                    with worker.lock:
                        worker.released.add(req)
                    logger.info("kvplan: prefill req=%s released on the side channel", req)
                    self.wfile.write(b"OK\n")

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        port = self.c.port + self.rank
        self.server = Server((self.c.host, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True,
                         name="kvplan-side-channel").start()

    def _progress_loop(self) -> None:
        """Progress the agent when vLLM does not step (an idle prefill must still serve reads
        and receive notifications); poll pulls in flight."""
        while not self.stop.wait(0.002):
            with self.lock:
                if self.ep is None or self.ep.closed:
                    return
                try:
                    self._progress()
                except Exception:  # logged, never kills the thread
                    logger.exception("kvplan: progress failed")

    def _progress(self) -> None:
        for n in self.ep.notifications():
            if not n.message.startswith(NOTIFY_PREFIX):
                continue
            _, req, counts = n.message.decode().split("|")
            need = int(counts.split(",")[self.rank])
            self.got[req] = self.got.get(req, 0) + 1
            if self.got[req] >= need:
                del self.got[req]
                self.released.add(req)
                logger.info("kvplan: prefill req=%s released by its %d reader(s)", req, need)
        for req_id, (t, load) in list(self.inflight.items()):
            t.poll()
            if not t.done:
                continue
            del self.inflight[req_id]
            if t.ok:
                logger.info("kvplan: pull req=%s done in %.4f s", req_id, t.seconds or 0.0)
                self.recv_done.add(req_id)
            else:
                self._fail(load, str(t.error()))

    # -- decode: pulls -----------------------------------------------------------------------

    def start(self, meta: KvplanMetadata) -> None:
        with self.lock:
            now = time.monotonic()
            for req in meta.sends:
                self.watch[req] = now + self.lease
            for load in meta.loads:
                try:
                    self._pull(load)
                except Exception as e:  # unreachable prefill, refused pair, bad params
                    self._fail(load, f"{type(e).__name__}: {e}")

    def _pull(self, load: Load) -> None:
        if not load.local_ids:  # nothing to read: just let the prefill free its blocks
            if self.rank == 0:
                self._release_all(load)
            return
        tmap, counts = self._connect(load)
        start, end = load.start, load.end
        if self.whole:  # every block the decode lacks, whole (what the prefill wrote past the
            bs = tmap.dst.regions[0].block_size  # prompt is overwritten as decode generates)
            start = start // bs * bs
            end = min(start + len(load.local_ids) * bs, len(load.remote_ids) * bs)
        plan = tmap.plan([load.remote_ids], [load.local_ids], tokens=(start, end),
                         dst_from="start")
        msg = NOTIFY_PREFIX + f"{load.remote_req}|{','.join(map(str, counts))}".encode()
        t = self.ep.read(plan, load.engine, notify=msg, timeout=self.timeout)
        logger.info("kvplan: pull req=%s remote=%s rank=%d blocks=%d tokens=[%d,%d) bytes=%d "
                    "runs=%d peers=%s prompt=%d", load.req_id, load.remote_req, self.rank,
                    len(load.local_ids), start, end, plan.nbytes, len(plan),
                    list(tmap.peers), load.end)
        if self.rank == 0 and 0 in counts:  # prefill ranks nobody reads: release them now
            for p, n in enumerate(counts):
                if n == 0:
                    self._release(load, p)
        self.inflight[load.req_id] = (t, load)

    def _connect(self, load: Load) -> tuple[Any, list[int]]:
        """The pull map for ``load``'s prefill engine, connecting its ranks on first use;
        and how many decode ranks read each prefill rank (carried in the notification)."""
        if load.engine in self.engines:
            return self.engines[load.engine]
        peer = self.ep.connect(self._fetch(load.host, load.port), mode="pull")
        tmap = self.ep.map(load.engine)
        for p in tmap.peers:
            if p != peer.rank:
                self.ep.connect(self._fetch(load.host, load.port + p), mode="pull")
        src, dst = tmap.src, tmap.dst
        sizes = {(a.block_size, b.block_size) for a, b in zip(src.regions, dst.regions)}
        if self.whole and any(a != b for a, b in sizes):
            raise ValueError(f"prefill {load.engine} uses blocks of {sorted(sizes)[0][0]} "
                             f"tokens, this engine {sorted(sizes)[0][1]}: the attention "
                             "backend's pages move only whole, so block sizes must be equal")
        counts = [0] * src.tp_size
        for d in range(dst.tp_size):
            for p in kvplan.pull_map(src, dst, d).peers:
                counts[p] += 1
        self.engines[load.engine] = (tmap, counts)
        return tmap, counts

    def _fetch(self, host: str, port: int) -> bytes:
        with socket.create_connection((host, port), timeout=self.hs_timeout) as s:
            s.sendall(b"MD\n")
            f = s.makefile("rb")
            (n,) = struct.unpack("!I", f.read(4))
            blob = f.read(n)
            if len(blob) != n:
                raise ConnectionError(f"side channel {host}:{port} sent {len(blob)} of {n} bytes")
            return blob

    def _release(self, load: Load, p: int) -> None:
        try:
            with socket.create_connection((load.host, load.port + p),
                                          timeout=self.hs_timeout) as s:
                s.sendall(f"RELEASE {load.remote_req}\n".encode())
                s.recv(16)
        except OSError as e:  # the prefill's lease frees the blocks anyway
            logger.warning("kvplan: could not release req=%s on prefill rank %d: %s",
                           load.remote_req, p, e)

    def _release_all(self, load: Load) -> None:
        for p in range(load.remote_tp):
            self._release(load, p)

    def _fail(self, load: Load, why: str) -> None:
        logger.error("kvplan: pull req=%s from %s failed (%s); %d block(s) reported for vLLM's "
                     "kv_load_failure_policy", load.req_id, load.engine, why,
                     len(load.local_ids))
        if not load.parked:
            return
        self.recv_done.add(load.req_id)
        if self.groups == 1:
            self.errors.update(load.local_ids)
        else:  # block ids are per group: vLLM wants the request instead
            self.recv_failed.add(load.req_id)
        if self.rank == 0:
            self._release_all(load)

    # -- results -----------------------------------------------------------------------------

    def results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        with self.lock:
            if self.ep is not None:
                self._progress()
            now = time.monotonic()
            sending = {r for r in self.watch if r in self.released or self.watch[r] < now}
            for r in sending:
                if r not in self.released:
                    logger.warning("kvplan: prefill req=%s lease of %.0f s ran out", r,
                                   self.lease)
                del self.watch[r]
                self.released.discard(r)
            out = KVConnectorTransferResults(finished_sending=sending,
                                             finished_recving=self.recv_done,
                                             failed_recving=self.recv_failed)
            self.recv_done, self.recv_failed = set(), set()
            return out

    def take_errors(self) -> set[int]:
        with self.lock:
            out, self.errors = self.errors, set()
            return out

    def close(self) -> None:
        self.stop.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        with self.lock:
            if self.ep is not None:
                with contextlib.suppress(Exception):
                    self.ep.close()


def _backend_name(cfg: Any) -> str | None:
    """The attention backend's name (how the adapter reads a page's content)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        return get_current_attn_backends(cfg)[0].get_name()
    except Exception:  # vLLM's definition of C then
        return None


def _flat(kv_caches: dict, addr: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` at ``addr``: the layer tensor starting there, seen
    as one dense run (on its device)."""
    t = next(x for x in kv_caches.values() if x.data_ptr() == addr)
    return torch.as_strided(t, (nbytes // t.element_size(),), (1,)).view(torch.uint8)
