"""Which decode requests loaded no KV, seen from the scheduler: so that a recompute after a
failed load (a handshake with an unreachable or wrong address, a failed or unconfirmed pull, a
push that never came) is never a silent HTTP 200.

A worker that fails a load logs why (ERROR, with the address it dialled) and hands the
request's blocks to vLLM's ``kv_load_failure_policy`` (``invalid_block_ids``; with several
KV-cache groups the request itself, ``failed_recving``). vLLM then passes the workers' output
to the scheduler's connector (``update_connector_output``): :class:`LoadOutcomes` matches it
against the loads the scheduler started, and for each failed one logs a WARNING naming the
prefill and the address, counts it once per request whatever the TP (``num_failed_loads``),
and adds ``kvplan_load_failed`` to the request's final ``kv_transfer_params``, which the
OpenAI server returns in its response.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplan_nixl.serving.loads import Load
    from kvplan_nixl.serving.rank import Stats

logger = logging.getLogger(__name__)

#: The key of a decode request's final ``kv_transfer_params`` whose KV load failed.
FAILED_KEY = "kvplan_load_failed"


class LoadOutcomes:
    """The scheduler's record of its parked loads until the workers report them."""

    def __init__(self, policy: str, stats: Stats) -> None:
        self.policy = policy  # vLLM's kv_load_failure_policy: "recompute" or "fail"
        self.pending: dict[str, tuple[Load, frozenset[int]]] = {}
        self.failed: dict[str, dict[str, Any]] = {}
        self.stats = stats  # the scheduler's counts (num_failed_loads), its engine's kind

    def started(self, load: Load) -> None:
        """``load`` (parked: the request waits for it) goes to the workers this step."""
        if load.parked:
            blocks = frozenset(int(b) for g in load.local_ids[:1] for b in g)
            self.pending[load.req_id] = (load, blocks)

    def update(self, out: Any) -> None:
        """The workers' ``KVConnectorOutput`` of a step: loads failed or finished."""
        if not self.pending:
            return
        invalid = out.invalid_block_ids or set()
        failed = out.failed_recving or set()
        done = out.finished_recving or set()
        for req, (load, blocks) in list(self.pending.items()):
            if req in failed or (invalid and not blocks.isdisjoint(invalid)):
                del self.pending[req]
                self._failed(load)
            elif req in done:
                del self.pending[req]

    def _failed(self, load: Load) -> None:
        what = "recomputes its prompt" if self.policy == "recompute" else "fails the request"
        refused = getattr(load, "refused", "")
        if refused:  # its params never named a trusted address: nobody was contacted
            logger.warning("kvplan: decode req=%s loaded no KV: its kv_transfer_params were "
                           "refused (%s); vLLM's kv_load_failure_policy=%s %s", load.req_id,
                           refused, self.policy, what)
            self.stats.record("num_failed_loads")
            self.failed[load.req_id] = {"refused": refused, "policy": self.policy}
            return
        logger.warning("kvplan: decode req=%s loaded no KV from prefill %s at %s:%d (%s mode): "
                       "vLLM's kv_load_failure_policy=%s %s; the worker's error above says "
                       "why", load.req_id, load.engine, load.host, load.port,
                       "push" if load.push else "pull", self.policy, what)
        self.stats.record("num_failed_loads")
        self.failed[load.req_id] = {"remote_engine_id": load.engine, "remote_host": load.host,
                                    "remote_port": load.port, "policy": self.policy}

    def finished(self, req_id: str) -> dict[str, Any] | None:
        """The params a finished decode request adds to its response: ``{FAILED_KEY: ...}``
        if its load failed, else None."""
        self.pending.pop(req_id, None)
        why = self.failed.pop(req_id, None)
        return None if why is None else {FAILED_KEY: why}
