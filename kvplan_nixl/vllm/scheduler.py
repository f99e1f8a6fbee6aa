"""The scheduler half of ``KvplanConnector``: which requests pull, into which blocks of which
KV-cache group, and the params a finished prefill hands its decode.

Block lists are per KV-cache group end to end (vLLM's hybrid manager): a prefill hands each
group's list as vLLM 0.32's NixlConnector does (full attention whole, a sliding window its
tail, a state group its running-state slot), plus where each list starts
(``remote_block_offsets``); the decode turns both sides' lists into kvplan's with
:class:`kvplan.adapters.vllm.TransferGroups`. With a state group (Mamba, GDN) the prefill
computes all but the last prompt token and the decode computes that one itself, so that the
state it continues from is the state after ``n - 1`` tokens (as NixlConnector does:
``_prefill_backoff`` in ``kv_connector/v1/nixl/base_scheduler.py``).

Push mode (:mod:`kvplan_nixl.pushes`): a decode request whose params name a prefill engine but
carry no ``remote_block_ids`` waits for that prefill to write its blocks (a :class:`Load` with
``push``); a prefill request pushes when its params say ``"transfer_mode": "push"`` (or
``"layerwise"``), or the engine's ``mode`` does: its finished blocks go to the workers as a
:class:`kvplan_nixl.pushes.PushSend`, held as a pull's are. Layer-wise, the step that computes
a request's whole prompt (its first step: a chunked prompt is pushed whole after it finished)
also sends the workers its blocks before the forward (``KvplanMetadata.layered``), so that
each layer can be written as soon as the forward has computed it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.logger import init_logger

from kvplan.adapters.vllm import TransferGroups
from kvplan_nixl.holds import new_generation
from kvplan_nixl.pushes import PushSend, transfer_key
from kvplan_nixl.vllm.outcomes import LoadOutcomes

if TYPE_CHECKING:
    from kvplan_nixl.vllm.settings import Settings

logger = init_logger("vllm.kvplan_nixl")


@dataclass
class Load:
    """One decode request's pull: what the scheduler decided, for every worker rank."""

    req_id: str
    remote_req: str
    engine: str
    host: str
    port: int  # the side channel port of the prefill's TP rank 0 (rank r: port + r)
    remote_tp: int
    remote_ids: list[list[int]]  # per transfer group, as the prefill handed them
    remote_first: list[int]  # block position of each remote list's first element
    local_ids: list[list[int]]  # per transfer group, every block of the request from position 0
    start: int  # positions decode already holds (a prefix-cache hit)
    end: int  # positions to hold after the pull (the prompt, less the token decode computes)
    parked: bool  # the request waits for this load (False: only release the prefill's blocks)
    generation: int = 0  # the prefill's hold generation (``remote_generation``; 0: none)
    push: bool = False  # the prefill writes (push mode): wait for it instead of reading
    key: str = ""  # push: the transfer key the prefill matches (kvplan_nixl.pushes)


@dataclass
class KvplanMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: loads to start (pulls, and pushes to wait for),
    prefill sends to hold as ``(request, generation)``, those of them to push, and the
    requests whose prompt this step computes that push layer-wise (their ``generation`` is 0:
    the hold's comes with their finished send)."""

    loads: list[Load] = field(default_factory=list)
    sends: list[tuple[str, int]] = field(default_factory=list)
    pushes: list[PushSend] = field(default_factory=list)
    layered: list[PushSend] = field(default_factory=list)


class Scheduler:
    """The scheduler half: which requests pull, into which blocks, and the returned params."""

    def __init__(self, settings: Settings, kv_cache_config: Any,
                 policy: str = "fail") -> None:
        self.c = settings
        # which parked loads failed (policy: vLLM's kv_load_failure_policy)
        self.outcomes = LoadOutcomes(policy)
        cfg = kv_cache_config
        self.groups = TransferGroups.from_config(cfg) if cfg is not None else None
        # tokens the decode computes itself: one with a state group (see the module docstring)
        self.backoff = 1 if self.groups is not None and self.groups.has_state else 0
        self.loads: dict[str, Load] = {}
        self.sends: list[tuple[str, int]] = []
        self.pushes: list[PushSend] = []
        self.mode = settings.mode()
        self.prefilling: dict[str, Any] = {}  # layer-wise requests allocated, not scheduled yet
        self.layered: set[str] = set()  # layer-wise requests written from their forward

    def new_request(self, request: Any) -> None:
        """A prefill request of a model with state stops one prompt token short."""
        p = request.kv_transfer_params
        if (not self.backoff or not p or not p.get("do_remote_decode")
                or p.get("_kvplan_short") or request.num_prompt_tokens <= self.backoff
                or request.prompt_token_ids is None):
            return
        # vLLM keeps the prompt in two lists: both lose the last token
        del request.prompt_token_ids[-self.backoff:]
        del request._all_token_ids[-self.backoff:]
        request.num_prompt_tokens -= self.backoff
        p["_kvplan_short"] = True  # once, even if the request is preempted and rescheduled

    def _end(self, request: Any) -> int:
        """Prompt positions the decode loads: all but the ones it computes itself."""
        n = len(request.prompt_token_ids or ())
        return n - self.backoff if n > self.backoff else n

    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        p = request.kv_transfer_params
        if p and p.get("do_remote_prefill") and (p.get("remote_block_ids") is not None
                                                 or _is_push(p)):
            count = self._end(request) - num_computed
            if count > 0:
                return count, True
        return 0, False

    def allocated(self, request: Any, blocks: Any, num_external: int) -> None:
        p = request.kv_transfer_params
        if p and p.get("do_remote_decode") and p.get("transfer_mode", self.mode) == "layerwise":
            self.prefilling[request.request_id] = request  # meta() sees its first step
        if not p or not p.get("do_remote_prefill"):
            return
        p["do_remote_prefill"] = False  # one pull per request
        end = self._end(request)
        local = [list(g) for g in blocks.get_block_ids()] if num_external > 0 else []
        load = _load(request.request_id, p, local, end - num_external, end, num_external > 0)
        self.loads[request.request_id] = load
        self.outcomes.started(load)

    def meta(self, scheduled: Any = None) -> KvplanMetadata:
        """This step's metadata; ``scheduled`` (vLLM's ``SchedulerOutput``) names the layer-wise
        requests whose whole prompt this step computes."""
        layered = []
        for nr in getattr(scheduled, "scheduled_new_reqs", ()) if self.prefilling else ():
            request = self.prefilling.pop(nr.req_id, None)
            if request is None:
                continue
            n = scheduled.num_scheduled_tokens.get(nr.req_id, 0)
            key = transfer_key(nr.req_id, request.kv_transfer_params)
            if key is None or nr.num_computed_tokens + n < request.num_prompt_tokens:
                continue  # chunked: pushed whole once it finished
            handed, first = self.groups.handed(nr.block_ids)
            layered.append(PushSend(nr.req_id, 0, key, tuple(map(tuple, handed)),
                                    tuple(first)))
            self.layered.add(nr.req_id)
        self.prefilling.clear()  # allocated this step, so scheduled this step (or never)
        m = KvplanMetadata(loads=list(self.loads.values()), sends=self.sends,
                           pushes=self.pushes, layered=layered)
        self.loads, self.sends, self.pushes = {}, [], []
        return m

    def finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        from vllm.v1.request import RequestStatus

        p = request.kv_transfer_params
        if not p:
            return False, None
        if p.get("do_remote_prefill"):  # never scheduled (aborted): free the prefill's blocks
            p["do_remote_prefill"] = False
            self.loads[request.request_id] = _load(request.request_id, p, [], 0, 0, False)
            return False, None
        outcome = self.outcomes.finished(request.request_id)
        if outcome is not None:  # a decode whose load failed: its response says so
            return False, outcome
        layered = request.request_id in self.layered
        self.layered.discard(request.request_id)
        if not p.get("do_remote_decode") or request.status not in (
                RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            if layered:  # aborted after its forward posted writes: held until they end
                gen = new_generation()
                self.sends.append((request.request_id, gen))
                self.pushes.append(PushSend(request.request_id, gen, "", (), ()))
                return True, None
            return False, None
        delay = layered or any(len(g) > 0 for g in block_ids)
        # the hold's generation: a decode's CONFIRM names it, so a hold that ended (and its
        # blocks, freed and maybe reused) is never mistaken for this one (kvplan_nixl.holds)
        gen = new_generation()
        if delay:
            self.sends.append((request.request_id, gen))
        handed, first = self.groups.handed(block_ids)
        mode = p.get("transfer_mode", self.mode)
        if mode in ("push", "layerwise"):
            key = transfer_key(request.request_id, p)
            if key is None:  # its decode waits in vain: its deadline recomputes it
                logger.error("kvplan: prefill req=%s cannot push: bad transfer_id %r",
                             request.request_id, p.get("transfer_id"))
            elif delay:
                self.pushes.append(PushSend(request.request_id, gen, key,
                                            tuple(map(tuple, handed)), tuple(first)))
            # nothing to pull: the decode waits for the write
            return delay, {"do_remote_prefill": False, "do_remote_decode": False,
                           "transfer_mode": mode, "transfer_id": key,
                           "remote_engine_id": self.c.engine_id,
                           "remote_request_id": request.request_id,
                           "remote_num_tokens": request.num_computed_tokens}
        return delay, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": handed, "remote_block_offsets": first,
            "remote_engine_id": self.c.engine_id,
            "remote_request_id": request.request_id, "remote_host": self.c.host,
            "remote_port": self.c.rank_port(0), "tp_size": self.c.tp_size,
            "remote_num_tokens": request.num_computed_tokens, "transfer_mode": "kvplan",
            "remote_generation": gen,
        }


def _is_push(p: dict) -> bool:
    """A decode request's params of push mode: a prefill engine named, no blocks to read."""
    return p.get("remote_block_ids") is None and p.get("remote_engine_id") is not None


def _load(req_id: str, p: dict, local: list[list[int]], start: int, end: int,
          parked: bool) -> Load:
    push = _is_push(p)
    ids = p.get("remote_block_ids") or [[]]
    if ids and not isinstance(ids[0], (list, tuple)):  # one group given flat
        ids = [ids]
    first = p.get("remote_block_offsets") or [0] * len(ids)
    return Load(req_id=req_id, remote_req=str(p.get("remote_request_id")),
                engine=str(p.get("remote_engine_id")), host=str(p.get("remote_host")),
                port=int(p.get("remote_port") or 0), remote_tp=int(p.get("tp_size") or 1),
                remote_ids=[list(g) for g in ids], remote_first=[int(x) for x in first],
                local_ids=local, start=start, end=end, parked=parked,
                generation=_int(p.get("remote_generation")), push=push,
                key=(transfer_key(req_id, p) or "") if push else "")


def _int(v: Any) -> int:
    """A generation from the params: 0 (never held, so never confirmed) if absent or bad. A
    decimal string is taken too (a proxy that cannot carry 63-bit JSON integers)."""
    if isinstance(v, str) and v.isascii() and v.isdigit() and len(v) <= 19:
        v = int(v)
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63 else 0
