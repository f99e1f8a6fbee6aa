"""The transfer digest in ``KvplanConnector`` (``kv_connector_extra_config["digest"]``;
docs/vllm.md, "Transfer digest"): both halves of a push, checked before the decode's first
token (a pull's: :mod:`kvplan_nixl.serving.pull_digest_io`).

It rides on the push protocol because that is where both sides already know the runs: the
prefill rank plans the write (its push map) and adds to its ``PUSHED`` message, which NIXL
delivers once the write completed, the digest of the bytes it wrote to each decode rank
(:class:`kvplan_nixl.digest.Digester`, over its own buffers) and the block lists it planned
from; each decode rank plans the same request with its pull map from those lists and its own
blocks, digests what it received from each writer, and fails the request into
``kv_load_failure_policy`` on any difference. A pull is checked the other way round (the
decode reads one-sided, so the prefill learns the decode's blocks only when asked:
:mod:`kvplan_nixl.serving.pull_digest_io`). A layer-wise push is written whole after the forward
instead, since the digest is of the finished KV.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvplan import KVPlanError
from kvplan_nixl.digest import Digester
from kvplan_nixl.serving.pushes import PUSHED
from kvplan_nixl.serving.spans import span

if TYPE_CHECKING:
    from kvplan import EngineSpec, TransferPlan
    from kvplan_nixl.serving.loads import Load
    from kvplan_nixl.serving.pushes import PushSend
    from kvplan_nixl.serving.rank import Rank
    from kvplan_nixl.serving.settings import Settings

logger = logging.getLogger(__name__)

def digester(settings: Settings, spec: EngineSpec, rank: int, buffers: Mapping[str, Any],
             cuda: bool) -> Digester | None:
    """This rank's :class:`Digester` over the buffers it registers, or None with the digest
    off; a ValueError naming the key where it cannot run (KV caches on a GPU)."""
    if not settings.digest():
        return None
    if cuda:
        raise ValueError("kv_connector_extra_config['digest'] reads the KV caches in host "
                         "memory; this engine's are on CUDA: turn the digest off")
    return Digester(spec, rank, buffers)


def sign(d: Digester | None, plan: TransferPlan, send: PushSend, message: bytes) -> bytes:
    """A prefill rank's ``PUSHED`` ``message`` with the digest of what ``plan`` writes to each
    decode rank and the lists it was planned from (``message`` as it is with the digest off).
    Called before the write is posted: the request finished, its KV no longer changes."""
    if d is None:
        return message
    t0 = time.perf_counter()
    fields = json.loads(message[len(PUSHED):])
    sent = d.digests(plan, "src")
    fields["digest"] = {str(r): x.hex() for r, x in sent.items()}
    logger.info("kvplan: push req=%s digest of %d bytes to decode rank(s) %s in %.4f s",
                send.req_id, plan.nbytes, sorted(sent), time.perf_counter() - t0)
    fields["src"] = {"ids": [list(g) for g in send.ids], "first": list(send.first)}
    return PUSHED + json.dumps(fields, separators=(",", ":")).encode()


def check(w: Rank, load: Load, got: Mapping[int, Mapping[str, Any]]) -> str | None:
    """A decode rank's check of a push that every writer announced (``got``: each writer's
    ``PUSHED`` fields): None when each writer's digest matches the bytes received, else why
    not. Plans the request as the writers did (their lists, this rank's blocks)."""
    lists = [f.get("src") for f in got.values()]
    if any(x != lists[0] for x in lists) or not isinstance(lists[0], dict):
        return ("transfer digest: the prefill ranks sent no source lists, or different ones "
                f"(is kv_connector_extra_config['digest'] on at {load.engine} too?)")
    me, t0 = str(w.rank), time.perf_counter()
    try:
        src = w.groups.remote(lists[0]["ids"], lists[0]["first"])
        dst = w.groups.local(load.local_ids)
        start, end = span(w.groups, w.whole, load.start, load.end, src, dst)
        plan = w.ep.map(load.engine).plan(src, dst, tokens=(start, end))
        w.digester.verify(plan, {p: f.get("digest", {}).get(me) for p, f in got.items()})
    except (KVPlanError, ValueError, TypeError, KeyError, AttributeError) as e:  # bad fields
        return f"transfer digest: {type(e).__name__}: {e}"
    logger.info("kvplan: push req=%s rank=%d digest verified: %d bytes from prefill rank(s) "
                "%s in %.4f s", load.req_id, w.rank, plan.nbytes, sorted(got),
                time.perf_counter() - t0)
    return None
