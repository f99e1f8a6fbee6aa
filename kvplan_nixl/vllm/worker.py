"""The worker half of ``KvplanConnector``, one per TP rank: the endpoint, the side channel that
serves its metadata, the progress thread, and the pulls.

Each pull is one kvplan plan over every KV-cache group: the prefill's handed lists and the
decode's own blocks become kvplan lists (:class:`kvplan.adapters.vllm.TransferGroups`: null
blocks absent, a state group's running slot), ``tokens=(held, end)`` bounds the token
groups, and state slots move whole.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

import kvplan
from kvplan.adapters.vllm import TransferGroups, spec_from_vllm, vllm_buffers, whole_pages

if TYPE_CHECKING:
    from kvplan_nixl.vllm.scheduler import KvplanMetadata, Load
    from kvplan_nixl.vllm.settings import Settings

# a child of vLLM's logger, so that its handlers and level apply
logger = init_logger("vllm.kvplan_nixl")

#: Prefix of the notifications this connector sends (``kvplan|<request>|<counts>``).
NOTIFY_PREFIX = b"kvplan|"


class Worker:
    """The worker half, one per TP rank: endpoint, side channel, progress thread, pulls."""

    def __init__(self, settings: Settings, vllm_config: Any) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.c = settings
        extra = settings.extra
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
            dcp_interleave=getattr(cfg.parallel_config, "cp_kv_cache_interleave_size", 1),
            mamba_n_groups=_mamba_n_groups(cfg), conv_layout=_conv_layout())
        self.groups = TransferGroups.from_config(kv_cache_config)
        # CPU_ATTN keeps each (block, head) page in its kernel's order: move whole blocks only
        self.whole = whole_pages(backend)
        bufs: dict[str, Any] = dict(vllm_buffers(kv_caches, spec, self.rank))
        first = next(iter(kv_caches.values()))
        if first.device.type == "cuda":  # NIXL needs the device: flat views of the buffers
            bufs = {k: _flat(kv_caches, a, n) for k, (a, n) in bufs.items()}
        self.ep = Endpoint(self.c.engine_id, spec, self.rank, bufs, secret=self.secret)
        self.md = self.ep.metadata()
        kinds = ",".join(sorted({r.kind.value for r in spec.regions}))
        logger.info("kvplan: rank %d registered %d regions (%s; backend %s, layouts %s, "
                    "groups %s, %d buffers)", self.rank, len(spec.regions), kinds, backend,
                    ",".join(sorted({r.layout_name for r in spec.regions if not r.is_state})),
                    "+".join(self.groups.kinds), len(spec.buffers))
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

    def _span(self, load: Load, src: list[np.ndarray], dst: list[np.ndarray]) -> tuple[int, int]:
        """The positions to copy: ``[held, end)``, rounded out to whole blocks of the token
        groups where the backend's pages move only whole (what the prefill left past the
        prompt in the last block is overwritten as decode generates)."""
        start, end = load.start, load.end
        if not self.whole:
            return start, end
        token = [g for g, k in enumerate(self.groups.kinds) if k != "state"]
        if not token:
            return start, end
        bs = self.groups.block_sizes[token[0]]
        cover = min(min(len(src[g]), len(dst[g])) * self.groups.block_sizes[g] for g in token)
        return start // bs * bs, max(start // bs * bs, min(-(-end // bs) * bs, cover))

    def _pull(self, load: Load) -> None:
        if not load.local_ids:  # nothing to read: just let the prefill free its blocks
            if self.rank == 0:
                self._release_all(load)
            return
        tmap, counts = self._connect(load)
        src = self.groups.remote(load.remote_ids, load.remote_first)
        dst = self.groups.local(load.local_ids)
        start, end = self._span(load, src, dst)
        plan = tmap.plan(src, dst, tokens=(start, end))
        msg = NOTIFY_PREFIX + f"{load.remote_req}|{','.join(map(str, counts))}".encode()
        t = self.ep.read(plan, load.engine, notify=msg, timeout=self.timeout)
        written = _lacking(self.groups, dst, start, end)
        blocks = max((len(w) for w, k in zip(written, self.groups.kinds) if k != "state"),
                     default=0)
        logger.info("kvplan: pull req=%s remote=%s rank=%d blocks=%d tokens=[%d,%d) bytes=%d "
                    "runs=%d peers=%s prompt=%d groups=%s", load.req_id, load.remote_req,
                    self.rank, blocks, start, end, plan.nbytes, len(plan), list(tmap.peers),
                    load.end, "+".join(self.groups.kinds))
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
        logger.error("kvplan: pull req=%s from %s failed (%s); its blocks go to vLLM's "
                     "kv_load_failure_policy", load.req_id, load.engine, why)
        if not load.parked:
            return
        self.recv_done.add(load.req_id)
        if len(self.groups.kinds) == 1:
            dst = self.groups.local(load.local_ids)
            self.errors.update(int(b) for b in _lacking(self.groups, dst, load.start,
                                                         load.end)[0])
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


def _lacking(groups: TransferGroups, dst: list[np.ndarray], start: int,
             end: int) -> list[np.ndarray]:
    """Per group, the destination blocks the pull writes: those holding positions
    ``[start, end)`` (the slot of a state group), absent ones left out."""
    out = []
    for g, ids in enumerate(dst):
        if groups.kinds[g] == "state":
            out.append(ids)
            continue
        bs = groups.block_sizes[g]
        part = ids[start // bs: -(-end // bs)]
        out.append(part[part != kvplan.ABSENT])
    return out


#: Backends of state layers (Mamba, GDN, ...): they keep no attention pages.
STATE_BACKENDS = ("MAMBA", "GDN", "LINEAR", "SHORT_CONV", "KDA")


def _backend_name(cfg: Any) -> str | None:
    """The attention layers' backend name (how the adapter reads a page's content): the first
    backend vLLM lists that is not a state layer's."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        names = [b.get_name() for b in get_current_attn_backends(cfg)]
    except Exception:  # vLLM's definition of C then
        return None
    attn = [n for n in names if not any(k in n.upper() for k in STATE_BACKENDS)]
    return attn[0] if attn else None


def _mamba_n_groups(cfg: Any) -> int | None:
    """The model's Mamba2 B/C group count (``n_groups``), if it has one."""
    hf = getattr(cfg.model_config, "hf_text_config", None) or cfg.model_config.hf_config
    for key in ("n_groups", "mamba_n_groups", "ngroups"):
        v = getattr(hf, key, None)
        if isinstance(v, int):
            return v
    return None


def _conv_layout() -> str:
    """The engine's Mamba conv-state layout (``VLLM_SSM_CONV_STATE_LAYOUT``, as vLLM reads it)."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        return str(get_conv_state_layout())
    except ImportError:
        return "SD"


def _flat(kv_caches: dict, addr: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` at ``addr``: the layer tensor starting there, seen
    as one dense run (on its device)."""
    t = next(x for x in kv_caches.values() if x.data_ptr() == addr)
    return torch.as_strided(t, (nbytes // t.element_size(),), (1,)).view(torch.uint8)
