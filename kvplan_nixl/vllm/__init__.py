"""``KvplanConnector``: a vLLM V1 KV connector whose transfers are planned by kvplan and moved
by kvplan_nixl (see docs/vllm.md).

Load it with::

    KVTransferConfig(kv_connector="KvplanConnector", kv_connector_module_path="kvplan_nixl.vllm",
                     kv_role="kv_both", kv_buffer_device="cpu",
                     kv_connector_extra_config={"secret": "...", "side_channel_port": 5700})

This package is the only part of the project that imports vLLM (written against vLLM 0.32.0's
``vllm/distributed/kv_transfer/kv_connector/v1/base.py``); ``import kvplan_nixl`` never loads
it. The facade here forwards vLLM's calls to the scheduler half (:mod:`.scheduler`) or the
worker half (:mod:`.worker`).

The request flow is NixlConnector's, so a proxy needs no change: a prefill request carries
``kv_transfer_params={"do_remote_decode": True}`` and returns ``do_remote_prefill``,
``remote_block_ids`` (one list per KV-cache group), ``remote_block_offsets``,
``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``, ``tp_size``,
``remote_num_tokens``; the decode request carries those and pulls the KV before its first
step.

- **Mixed fleets**: a decode reads from a prefill that runs vLLM's own NixlConnector too, told
  by its params (``"transfer_mode": "pull"``): its handshake and notifications are
  NixlConnector's, its reads planned by kvplan, without the freed-KV guarantee below
  (:mod:`.nixl_peer`; docs/vllm.md, "Migrating a fleet").
- **Hybrid models**: the connector supports vLLM's hybrid KV cache manager (``SupportsHMA``):
  block ids per KV-cache group end to end, attention (full and sliding window) and Mamba-family
  state groups (see :mod:`.scheduler`).
- **Spec**: each worker derives its rank's :class:`kvplan.EngineSpec` from the tensors vLLM
  registers (:func:`kvplan.adapters.vllm.spec_from_vllm`), so nothing is described by hand.
- **Handshake**: each prefill worker rank serves its signed ``Endpoint.metadata()`` on a
  small TCP side channel (:mod:`kvplan_nixl.serving.sidechannel`), ``remote_port + tp_rank``;
  a decode rank connects the prefill ranks its pull map names (``Endpoint.connect``: kvplan
  refuses an incompatible pair there) on background threads
  (:mod:`kvplan_nixl.serving.handshakes`): a request's load starts once its prefill is
  connected.
- **Per request**: ``map.plan(remote lists, local lists, tokens=(held, end))`` over every
  group moves exactly the positions decode lacks (and a state group's running slot);
  ``Endpoint.read`` posts it with a deadline (``transfer_timeout_s``).
- **Never serving freed KV**: the prefill holds each request under a generation
  (``remote_generation``, :mod:`kvplan_nixl.serving.holds`) and frees its blocks only once the hold
  ended; the decode renews the hold while its pull is in flight (RENEW every
  ``heartbeat_s``) and reports the pull finished only once every prefill rank it read
  answered its CONFIRM yes (the hold was live throughout). Ranks nobody reads get a
  ``RELEASE``; a dead decode's holds end ``lease_s`` after its last heartbeat.
- **Failures**: a transfer that fails, misses its deadline or is not confirmed, or a prefill
  engine that cannot be reached, reports the request's blocks through
  ``get_block_ids_with_load_errors`` (one KV-cache group; with several, the request through
  ``failed_recving``); vLLM's ``kv_load_failure_policy`` then recomputes them or fails the
  request.
- **Push mode** (``mode``: ``"push"`` or ``"layerwise"``, or a prefill request's
  ``transfer_mode``; :mod:`kvplan_nixl.serving.pushes`, :mod:`kvplan_nixl.serving.push_io`):
  the decode request comes first, naming its prefill engine; the decode registers its blocks
  with every prefill rank, and the prefill writes the KV into them with its push map (after
  the request finished, or layer-wise from ``save_kv_layer`` during the forward, state
  regions from ``wait_for_save``). A decode rank proceeds once every prefill rank that
  writes it said the write completed; a failed write, a dead prefill or ``push_timeout_s``
  plus a grace goes to ``kv_load_failure_policy``.
- **Stats**: ``get_kv_connector_stats`` (:mod:`kvplan_nixl.vllm.stats`): vLLM's periodic
  "KV Transfer metrics" log line and ``vllm:kvplan_*`` Prometheus metrics.

Extra config keys: ``secret`` (str, signs the metadata and every side channel message; the
same on every engine), ``side_channel_host`` (where the side channel listens; default
``$VLLM_HOST_IP`` or 127.0.0.1), ``side_channel_advertise_host`` (what peers dial; default
``side_channel_host``; a wildcard, or loopback beside a non-loopback bind, is refused at
start: :mod:`kvplan_nixl.serving.addresses`), ``side_channel_port`` (base port, default
5700: rank ``r`` of DP rank ``dp`` listens on ``base + dp * tp_size + r``),
``transfer_timeout_s`` (default 30), ``handshake_timeout_s`` (default 5), ``lease_s``
(default 120), ``heartbeat_s`` (default ``lease_s / 3``), ``kv_lease_duration`` (default
30: the lease of prefills running vLLM's NixlConnector, whose requests are heartbeaten every
``kv_lease_duration / 6``), ``nixl_backends`` (default ``["UCX"]``), ``mode`` (``"pull"``,
``"push"`` or ``"layerwise"``; default ``"pull"``), ``push_timeout_s`` (default 60),
``digest`` (default false: a transfer digest checks every push and pull,
:mod:`kvplan_nixl.serving.push_digests`, :mod:`kvplan_nixl.serving.pull_digest_io`),
``layerwise_wait_s`` (default 1; 0: never). See docs/vllm.md.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvplan_nixl.serving.addresses import side_channel_addresses
from kvplan_nixl.serving.settings import Settings
from kvplan_nixl.vllm import layer_hooks
from kvplan_nixl.vllm.scheduler import KvplanMetadata, Scheduler
from kvplan_nixl.vllm.stats import KvplanStats, KvplanStatsMixin
from kvplan_nixl.vllm.worker import Worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvplanConnector", "KvplanMetadata"]

#: The engine-neutral modules' loggers (``logging.getLogger(__name__)`` in each).
SERVING_LOGGER = "kvplan_nixl.serving"
#: The connector's own logger: vLLM's ``init_logger("vllm.kvplan_nixl")``, a child of "vllm".
VLLM_LOGGER = "vllm.kvplan_nixl"


def _serving_logs_as_vllm() -> None:
    """Make :mod:`kvplan_nixl.serving`'s log lines vLLM's, as they were when those modules
    lived here and logged on ``vllm.kvplan_nixl``.

    Why (vllm/logger.py, 0.32): vLLM's logging config (``DEFAULT_LOGGING_CONFIG``, applied by
    ``dictConfig`` in each engine process) gives a handler, a format and a level to the
    ``vllm`` logger alone, with ``propagate: False``; ``init_logger(name)`` is only
    ``logging.getLogger(name)`` with ``*_once`` methods added. A logger outside the ``vllm``
    tree (``kvplan_nixl.serving.pulls``) reaches the root logger instead, which has no handler
    there: its INFO lines (``done in X s, confirmed by prefill rank(s)``, ``inside its lease``)
    would be dropped, its warnings printed bare (``logging.lastResort``). So the
    ``kvplan_nixl.serving`` logger is made a child of ``vllm.kvplan_nixl``: its records take
    vLLM's level and handlers at every call (also after vLLM configures logging again, and
    whatever a ``VLLM_LOGGING_CONFIG_PATH`` file sets on ``vllm`` or ``vllm.kvplan_nixl``).
    ``kvplan_nixl`` is made first, so that logging never inserts a logger between the two
    later (``logging.Manager`` does when an ancestor name is created after its children)."""
    logging.getLogger("kvplan_nixl")
    logging.getLogger(SERVING_LOGGER).parent = logging.getLogger(VLLM_LOGGER)


_serving_logs_as_vllm()


class KvplanConnector(KvplanStatsMixin, KVConnectorBase_V1, SupportsHMA):
    """vLLM V1 KV connector on kvplan + kvplan_nixl (the module docstring says how); its
    stats (:class:`kvplan_nixl.vllm.stats.KvplanStats`) go to vLLM's log line and
    Prometheus."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        extra = dict(cfg.kv_connector_extra_config or {})
        par = vllm_config.parallel_config
        # data_parallel_index: vLLM's DP rank, not overridden for dense models (NixlConnector
        # offsets its port by it too)
        dp = getattr(par, "data_parallel_index", None)
        dp = par.data_parallel_rank if dp is None else dp
        port = extra.get("side_channel_port", 5700)
        if isinstance(port, bool) or not isinstance(port, (int, str)) \
                or not str(port).isdigit() or not 0 < int(port) < 65536:
            raise ValueError("kv_connector_extra_config['side_channel_port'] must be a port "
                             f"number (the base: rank ports are base + dp_rank * tp_size + "
                             f"tp_rank), got {port!r}")
        # a wildcard or loopback address that peers on other hosts would dial: refused here
        bind, advertised = side_channel_addresses(extra, os.environ.get("VLLM_HOST_IP"))
        self.settings = Settings(
            engine_id=str(cfg.engine_id), host=advertised, bind_host=bind,
            port=int(port), tp_size=par.tensor_parallel_size, extra=extra, dp_rank=int(dp))
        self.settings.rank_port(self.settings.tp_size - 1)  # every rank's port fits: fail now
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("KvplanConnector: pipeline parallelism is not supported yet")
        self._scheduler = Scheduler(self.settings, kv_cache_config,
                                    str(cfg.kv_load_failure_policy),
                                    max_model_len=getattr(vllm_config.model_config,
                                                          "max_model_len", None)) \
            if role == KVConnectorRole.SCHEDULER else None
        self._worker = Worker(self.settings, vllm_config) \
            if role == KVConnectorRole.WORKER else None

    # -- scheduler side ----------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """A prefill request of a model with state stops one prompt token short."""
        self._scheduler.new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """A decode request with remote prefill params loads every prompt position it lacks."""
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Record the pull into the blocks vLLM just allocated (every group's)."""
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's pulls, newly finished prefill sends and pushes, and the layer-wise
        pushes whose prompt this step computes, for every worker."""
        return self._scheduler.meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' results of a step: which decode loads failed (their response and the
        ``num_failed_loads`` count say so: :mod:`kvplan_nixl.serving.outcomes`)."""
        if self._scheduler is not None:
            self._scheduler.outcomes.update(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """One KV-cache group (the hybrid manager off): as :meth:`request_finished_all_groups`."""
        return self._scheduler.finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """A finished prefill keeps its blocks for decode and returns the params to pull them,
        one block list per KV-cache group."""
        return self._scheduler.finished(request, tuple(block_ids))

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Derive this rank's spec from the tensors, register them, serve the metadata."""
        self._worker.register(kv_caches, self._kv_cache_config)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take the step's metadata and open its layer-wise pushes: vLLM 0.32 binds it before
        the forward but calls :meth:`start_load_kv` after it (unless a load is synchronous:
        ``_get_kv_connector_output`` in ``v1/worker/kv_connector_model_runner_mixin.py``)."""
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KvplanMetadata) and connector_metadata.layered:
            layer_hooks.begin(self._worker, connector_metadata.layered)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Post this step's pulls (non-blocking)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvplanMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads complete before the request is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Layer-wise push: post the writes of ``layer_name``'s region (the forward has just
        written its KV) for this step's layer-wise requests; nothing otherwise."""
        layer_hooks.save(self._worker, layer_name)

    def wait_for_save(self) -> None:
        """Layer-wise push: post what no layer hook posted (state regions, after the forward's
        last update) and close the step's layer-wise writes; they complete in the
        background, their blocks held until they end."""
        layer_hooks.end(self._worker)

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

    def get_kv_connector_stats(self) -> KvplanStats | None:
        """This worker's pulls, failures, expired leases, refused confirmations and dropped
        side channel messages since the last call (vLLM's log line and Prometheus)."""
        if self._worker is None:  # the scheduler's: decode requests whose load failed
            return self._scheduler.take_stats() if self._scheduler else None
        return self._worker.take_stats()

    def shutdown(self) -> None:
        """Stop the side channel and the progress thread, release every NIXL handle."""
        if self._worker is not None:
            self._worker.close()
