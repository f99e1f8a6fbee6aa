"""Engines without engines, for tests/test_restarts.py: the connector's real ``Worker`` around
real NIXL agents, in vLLM's venv (it imports vLLM; no pytest there).

A tiny dense model (:data:`LAYERS` layers, :data:`HEADS` KV heads of :data:`HEAD`, blocks of
:data:`BLOCK`, float32, CPU_ATTN, layout LBHNC, one KV-cache tensor holding every layer as
vLLM 0.32 allocates it) is laid out by :func:`kv_caches`; every value is a function of
(seed, rank, layer, block, position) (:func:`expected`), so a reader checks what it read
without asking the writer.

Run as a script it is a prefill in a process of its own (restarted by killing it):

- ``stock PORT ENGINE TP SEED NUM_BLOCKS``: a NixlConnector prefill as vLLM 0.32 serves one:
  ``TP`` NIXL agents named as vLLM names them (``uuid4``), each rank's buffer registered, its
  ``NixlAgentMetadata`` built as ``register_kv_caches`` builds it for this layout, served by
  vLLM's own listener (``_nixl_handshake_listener``) on ``PORT``. Prints ``ready`` and then
  each notification a decode sends, ``notif RANK MESSAGE``.
- ``kvplan PORT ENGINE SEED NUM_BLOCKS``: a TP1 ``KvplanConnector`` prefill: the connector's
  own ``Worker`` (endpoint, side channel, holds). Prints ``ready``; on stdin ``hold REQ``
  holds a request and prints ``gen REQ GENERATION``; ``close`` closes the worker gracefully
  (its close notices leave) and exits.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from types import SimpleNamespace

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from kvplan_nixl.serving.transfer_params import Peer

LAYERS, HEADS, HEAD, BLOCK = 2, 2, 8, 4
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
HASH = "restart-test-compat-hash"  # both sides' compatibility hash (patched in: no model)
SECRET = "restart-test-secret"


def expected(seed: int, rank: int, layer: int, block: int, heads: int) -> torch.Tensor:
    """The values of one block of one layer on ``rank`` of an engine written with ``seed``:
    [heads, BLOCK, 2 * HEAD] float32."""
    base = seed * 1e6 + rank * 1e5 + layer * 1e4 + block * 10
    n = heads * BLOCK * 2 * HEAD
    return (base + torch.arange(n, dtype=torch.float64) / n).float().view(heads, BLOCK,
                                                                          2 * HEAD)


def kv_caches(heads: int, num_blocks: int, seed: int | None = None,
              rank: int = 0) -> tuple[dict, KVCacheConfig, torch.Tensor]:
    """(kv_caches, kv_cache_config, raw) of one rank holding ``heads`` KV heads: one tensor,
    layer-major (LBHNC), filled with :func:`expected` for ``seed`` (zeros without)."""
    page = heads * BLOCK * 2 * HEAD
    raw = torch.zeros(LAYERS * num_blocks * page, dtype=torch.float32)
    kv = {}
    for i, name in enumerate(NAMES):
        t = raw[i * num_blocks * page:(i + 1) * num_blocks * page].view(num_blocks, heads,
                                                                         BLOCK, 2 * HEAD)
        if seed is not None:
            for b in range(num_blocks):
                t[b] = expected(seed, rank, i, b, heads)
        kv[name] = t
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD,
                             dtype=torch.float32)
    es = 4
    kt = KVCacheTensor(size=raw.numel() * es, layers=NAMES, layer_stride=num_blocks * page * es,
                       block_stride=page * es, offset=0)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[kt],
                        kv_cache_groups=[KVCacheGroupSpec(NAMES, spec,
                                                          enable_kv_transfer=True)])
    return kv, cfg, raw


def worker(engine: str, port: int, *, extra: dict | None = None, num_blocks: int = 32):
    """A decode (or prefill) ``Worker`` of ``KvplanConnector``, TP1, registered over
    :func:`kv_caches` (zeros): the connector's own code; only what reads a model from vLLM's
    config is given here (backend, heads, compatibility hash). Returns (worker, kv_caches)."""
    import vllm.distributed.parallel_state as ps

    from kvplan_nixl.serving.settings import Settings
    from kvplan_nixl.vllm import worker as wk

    ps.get_tensor_model_parallel_rank = lambda: 0
    wk.stock_hashes = lambda cfg, backend: {HASH: "0.32.0"}
    wk.stock_backend = lambda cfg: "CPU_ATTN"
    wk._layer_backends = lambda cfg, kv: dict.fromkeys(kv, "CPU_ATTN")
    wk._layer_heads = lambda cfg, kv: dict.fromkeys(kv, HEADS)
    wk._mamba_n_groups = lambda cfg: None
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=1,
                                                          cp_kv_cache_interleave_size=1))
    settings = Settings(engine, "127.0.0.1", port, tp_size=1,
                        extra={"secret": SECRET, "transfer_timeout_s": 10,
                               "handshake_timeout_s": 2, "lease_s": 30,
                               "kv_lease_duration": 30, **(extra or {})})
    w = wk.Worker(settings, cfg)
    kv, kcfg, _ = kv_caches(HEADS, num_blocks)
    w.register(kv, kcfg)
    return w, kv


def stock_metadata(engine: str, agent, raw: torch.Tensor, num_blocks: int, heads: int):
    """``NixlAgentMetadata`` of one rank, as vLLM 0.32's ``register_kv_caches`` fills it for
    :func:`kv_caches`' layout: one region per layer, its page a block."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

    page = heads * BLOCK * 2 * HEAD * 4
    bases = [raw.data_ptr() + i * num_blocks * page for i in range(LAYERS)]
    return NixlAgentMetadata(
        engine_id=engine, agent_metadata=agent.get_agent_metadata(),
        kv_caches_base_addr=bases, device_id=0, num_blocks=num_blocks,
        block_lens=[page] * LAYERS, block_strides=[page] * LAYERS, kv_cache_layout="LBHNC",
        block_size=BLOCK, ssm_sizes=(0, 0), attn_backend_name="CPU_ATTN",
        physical_blocks_per_logical_kv_block=1, region_num_blocks=[num_blocks] * LAYERS,
        region_group_ids=[0] * LAYERS, region_names=list(NAMES))


def serve_stock(port: int, engine: str, tp: int, seed: int, num_blocks: int) -> None:
    """The ``stock`` role (module docstring)."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
        NixlBaseConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlHandshakePayload,
    )

    from kvplan_nixl._nixl import make_agent

    heads = HEADS // tp
    agents, raws, data = [], [], {}
    enc = msgspec.msgpack.Encoder()
    for r in range(tp):
        agent = make_agent(str(uuid.uuid4()), ("UCX",), False, False, 0)
        _, _, raw = kv_caches(heads, num_blocks, seed, r)
        agent.register_memory([(raw.data_ptr(), raw.numel() * 4, 0, "")], "DRAM")
        meta = stock_metadata(engine, agent, raw, num_blocks, heads)
        data[(0, r)] = enc.encode(NixlHandshakePayload(HASH, enc.encode(meta)))
        agents.append(agent)
        raws.append(raw)
    ready, stop = threading.Event(), threading.Event()
    threading.Thread(target=NixlBaseConnectorScheduler._nixl_handshake_listener,
                     args=(data, ready, stop, "127.0.0.1", port), daemon=True).start()
    ready.wait()
    print("ready", flush=True)
    while True:  # a target must be progressed; what decodes tell it is printed
        for r, agent in enumerate(agents):
            for msgs in agent.get_new_notifs().values():
                for m in msgs:
                    print(f"notif {r} {m.decode()}", flush=True)
        time.sleep(0.002)


def serve_kvplan(port: int, engine: str, seed: int, num_blocks: int) -> None:
    """The ``kvplan`` role (module docstring)."""
    from kvplan_nixl.serving.holds import new_generation
    from kvplan_nixl.vllm.scheduler import KvplanMetadata

    w, kv = worker(engine, port, num_blocks=num_blocks)
    for i, name in enumerate(NAMES):
        for b in range(num_blocks):
            kv[name][b] = expected(seed, 0, i, b, HEADS)
    print("ready", flush=True)
    for line in sys.stdin:
        op, *args = line.split()
        if op == "hold":
            gen = new_generation()
            w.start(KvplanMetadata(sends=[(args[0], gen)]))
            print(f"gen {args[0]} {gen}", flush=True)
        elif op == "close":
            w.close()
            print("closed", flush=True)
            return


if __name__ == "__main__":
    role, port, engine, *rest = sys.argv[1:]
    if role == "stock":
        serve_stock(int(port), engine, *map(int, rest))
    else:
        serve_kvplan(int(port), engine, *map(int, rest))


# -- the decode's side, for the test's driver ------------------------------------------------


class Prefill:
    """A prefill process of this module (``role`` and its arguments), its lines read on a
    thread: ``ready``, notifications, generations."""

    def __init__(self, *args: object) -> None:
        import os
        import queue
        import subprocess

        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen([sys.executable, __file__, *map(str, args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, cwd=repo,
                                     env=dict(os.environ, PYTHONPATH=repo))
        self.lines: queue.Queue = queue.Queue()
        self.notifs: list[tuple[int, str]] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.wait("ready")

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("notif "):
                _, r, msg = line.rstrip("\n").split(" ", 2)
                self.notifs.append((int(r), msg))
            else:
                self.lines.put(line.strip())

    def wait(self, prefix: str, timeout: float = 120) -> str:
        """The next line starting with ``prefix`` (NIXL's own log lines skipped)."""
        end = time.monotonic() + timeout
        while not (line := self.lines.get(timeout=max(0.01, end - time.monotonic()))
                   ).startswith(prefix):
            pass
        return line

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def load(req: str, engine: str, port: int, remote: list[int], local: list[int], *,
         tp: int = 1, peer: Peer = Peer.NIXL, generation: int = 0):
    """A decode request's ``Load``, as the connector's scheduler makes it from the params a
    prefill of ``engine`` (side channel ``port``) handed: its blocks ``remote`` into this
    decode's ``local``, every token of them."""
    from kvplan_nixl.serving.loads import Load

    return Load(req_id=req, remote_req="r-" + req, engine=engine, host="127.0.0.1", port=port,
                remote_tp=tp, remote_ids=[list(remote)], remote_first=[0],
                local_ids=[list(local)], start=0, end=len(local) * BLOCK, parked=True,
                generation=generation, peer=peer)


def pull(w, ld, timeout: float = 30) -> tuple[bool, float]:
    """Run ``ld`` on decode worker ``w`` as vLLM's steps do (start, then results each step):
    whether it loaded (reported done, no block invalid), and the seconds it took."""
    from kvplan_nixl.vllm.scheduler import KvplanMetadata

    t0 = time.monotonic()
    w.start(KvplanMetadata(loads=[ld]))
    while time.monotonic() - t0 < timeout:
        out = w.results(set())
        if ld.req_id in out.finished_recving:
            bad = w.take_errors() & set(ld.local_ids[0])
            return not bad and ld.req_id not in out.failed_recving, time.monotonic() - t0
        time.sleep(0.005)
    raise AssertionError(f"{ld.req_id}: not reported in {timeout} s")


def read_back(kv: dict, ld, seed: int, tp: int) -> bool:
    """Whether the decode's blocks of ``ld`` hold what the prefill written with ``seed``
    (``tp`` ranks, each holding ``HEADS / tp`` heads) had in its blocks."""
    for i, name in enumerate(NAMES):
        for rb, lb in zip(ld.remote_ids[0], ld.local_ids[0]):
            want = torch.cat([expected(seed, r, i, rb, HEADS // tp) for r in range(tp)])
            if not torch.equal(kv[name][lb], want):
                return False
    return True
