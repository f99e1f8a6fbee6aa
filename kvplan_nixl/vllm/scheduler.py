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

Admission (:meth:`Scheduler.new_request`, vLLM's ``on_new_request``) checks every field of a
request's ``kv_transfer_params`` once (:mod:`kvplan_nixl.serving.transfer_params`: an HTTP client
chooses them); the rest of this module reads only what passed. A decode request whose params
were refused still waits for a load, which its workers fail at once without contacting
anyone, so that vLLM's ``kv_load_failure_policy`` decides (recompute it or fail it) and no
exception leaves the scheduler's step; a prefill request whose params were refused is served
as a plain request.

Push mode (:mod:`kvplan_nixl.serving.pushes`): a decode request whose params name a prefill engine
but carry no ``remote_block_ids`` waits for that prefill to write its blocks (a :class:`Load` with
``push``); a prefill request pushes when its params say ``"transfer_mode": "push"`` (or
``"layerwise"``), or the engine's ``mode`` does: its finished blocks go to the workers as a
:class:`kvplan_nixl.serving.pushes.PushSend`, held as a pull's are. Layer-wise, the step that
computes a request's whole prompt (its first step: a chunked prompt is pushed whole after it
finished) also sends the workers its blocks before the forward (``KvplanMetadata.layered``), so that
each layer can be written as soon as the forward has computed it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.logger import init_logger

from kvplan.adapters.vllm import TransferGroups
from kvplan_nixl.errors import ParamsError
from kvplan_nixl.serving.holds import new_generation
from kvplan_nixl.serving.loads import Load
from kvplan_nixl.serving.outcomes import LoadOutcomes
from kvplan_nixl.serving.pushes import PushSend
from kvplan_nixl.serving.transfer_params import Handover, Peer, Source, check_decode, check_prefill
from kvplan_nixl.vllm.stats import KvplanStats

if TYPE_CHECKING:
    from kvplan_nixl.serving.settings import Settings

logger = init_logger("vllm.kvplan_nixl")


@dataclass
class KvplanMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: loads to start (pulls, and pushes to wait for),
    prefill sends to hold as ``(request, generation)``, those of them to push, and the
    requests whose prompt this step computes that push layer-wise (their ``generation`` is 0:
    the hold's comes with their finished send); with the transfer digest on, the pull sends'
    lists as handed (``pulled``: the prefill digests its own blocks, never the decode's copy)."""

    loads: list[Load] = field(default_factory=list)
    sends: list[tuple[str, int]] = field(default_factory=list)
    pushes: list[PushSend] = field(default_factory=list)
    layered: list[PushSend] = field(default_factory=list)
    pulled: list[PushSend] = field(default_factory=list)
    #: NixlConnector prefills' requests admitted here and not yet scheduled, by prefill
    #: engine (their ``remote_request_id``s): heartbeats, as NixlConnector's decode sends them
    beats: dict[str, list[str]] = field(default_factory=dict)


class Scheduler:
    """The scheduler half: which requests pull, into which blocks, and the returned params."""

    def __init__(self, settings: Settings, kv_cache_config: Any,
                 policy: str = "fail", max_model_len: int | None = None) -> None:
        self.c = settings
        # bounds what a request's params may make the workers pad or derive (transfer_params)
        self.max_model_len = max_model_len
        # which parked loads failed (policy: vLLM's kv_load_failure_policy)
        self.stats = KvplanStats()  # num_failed_loads, counted by outcomes
        self.outcomes = LoadOutcomes(policy, self.stats)
        cfg = kv_cache_config
        self.groups = TransferGroups.from_config(cfg) if cfg is not None else None
        # tokens the decode computes itself: one with a state group (see the module docstring)
        self.backoff = 1 if self.groups is not None and self.groups.has_state else 0
        self.loads: dict[str, Load] = {}
        self.sends: list[tuple[str, int]] = []
        self.pushes: list[PushSend] = []
        # pull sends' handed lists, with the transfer digest on (the prefill digests its own)
        self.pulled: list[PushSend] = []
        self.digest = settings.digest()
        self.mode = settings.mode()
        # what admission found in each request's params (kvplan_nixl.serving.transfer_params), until
        # the request is allocated (a decode's source) or finished (a prefill's handover)
        self.sources: dict[str, Source | ParamsError] = {}
        self.admitted: dict[str, float] = {}  # their admission times (Load.admitted)
        self.handovers: dict[str, Handover] = {}
        self.prefilling: dict[str, Any] = {}  # layer-wise requests allocated, not scheduled yet
        self.layered: set[str] = set()  # layer-wise requests written from their forward
        # how often requests queued for a NixlConnector prefill are heartbeaten: its own
        # decode's interval (``kv_lease_duration / 6``, the key NixlConnector reads)
        self.nixl_beat = settings.nixl_heartbeat()
        self.next_beat = 0.0

    def take_stats(self) -> KvplanStats | None:
        """The counts since the last call (aggregated with the workers' by vLLM), None if
        none."""
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def new_request(self, request: Any) -> None:
        """Admission: check the request's ``kv_transfer_params`` once (a bad field fails the
        request alone: see :meth:`matched`; never an exception out of vLLM's step). A prefill
        request of a model with state stops one prompt token short."""
        p, rid = request.kv_transfer_params, request.request_id
        if not p:
            return
        if not isinstance(p, Mapping) or p.get("do_remote_prefill"):
            self.admitted[rid] = time.time()
            try:
                self.sources[rid] = check_decode(rid, p, self._group_count(),
                                                 max_model_len=self.max_model_len)
            except ParamsError as e:
                logger.error("kvplan: decode req=%s refused, its KV goes to vLLM's "
                             "kv_load_failure_policy: %s", rid, e)
                self.sources[rid] = e
            return
        if not p.get("do_remote_decode"):
            return
        try:
            self.handovers[rid] = check_prefill(rid, p, self.mode)
        except ParamsError as e:  # served as a plain request: nothing held, nothing pushed
            logger.error("kvplan: prefill req=%s is served as a plain request (its KV is not "
                         "handed on): %s", rid, e)
            return
        if (not self.backoff or request.num_prompt_tokens <= self.backoff
                or request.prompt_token_ids is None):
            return
        # vLLM keeps the prompt in two lists: both lose the last token (once: admission runs
        # once per request, a preempted request is not admitted again)
        del request.prompt_token_ids[-self.backoff:]
        del request._all_token_ids[-self.backoff:]
        request.num_prompt_tokens -= self.backoff

    def _group_count(self) -> int | None:
        return None if self.groups is None else len(self.groups.kinds)

    def _end(self, request: Any) -> int:
        """Prompt positions the decode loads: all but the ones it computes itself."""
        n = len(request.prompt_token_ids or ())
        return n - self.backoff if n > self.backoff else n

    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """A decode request loads every prompt position it lacks; one whose params were
        refused too (its load fails at once, so vLLM's ``kv_load_failure_policy`` decides:
        recompute it or fail it)."""
        if request.request_id in self.sources:
            count = self._end(request) - num_computed
            if count > 0:
                return count, True
        return 0, False

    def allocated(self, request: Any, blocks: Any, num_external: int) -> None:
        rid = request.request_id
        hand = self.handovers.get(rid)
        if hand is not None and hand.mode == "layerwise":
            self.prefilling[rid] = request  # meta() sees its first step
        src = self.sources.pop(rid, None)  # one pull per request
        admitted = self.admitted.pop(rid, 0.0)
        if src is None:
            return
        if isinstance(request.kv_transfer_params, dict):
            request.kv_transfer_params["do_remote_prefill"] = False
        end = self._end(request)
        local = (tuple(tuple(g) for g in blocks.get_block_ids()) if num_external > 0
                 else ())
        if isinstance(src, ParamsError):  # nothing to release: the address is not trusted
            if num_external > 0:
                self.loads[rid] = Load(req_id=rid, remote_req="", engine="", host="", port=0,
                                       remote_tp=0, remote_ids=(), remote_first=(),
                                       local_ids=local, start=end - num_external, end=end,
                                       parked=True, refused=str(src))
                self.outcomes.started(self.loads[rid])
            return
        self.loads[rid] = _load(rid, src, local, end - num_external, end, num_external > 0,
                                self.groups, admitted)
        self.outcomes.started(self.loads[rid])

    def meta(self, scheduled: Any = None) -> KvplanMetadata:
        """This step's metadata; ``scheduled`` (vLLM's ``SchedulerOutput``) names the layer-wise
        requests whose whole prompt this step computes."""
        layered = []
        for nr in getattr(scheduled, "scheduled_new_reqs", ()) if self.prefilling else ():
            request = self.prefilling.pop(nr.req_id, None)
            if request is None:
                continue
            n = scheduled.num_scheduled_tokens.get(nr.req_id, 0)
            hand = self.handovers.get(nr.req_id)
            key = None if hand is None else hand.key
            if key is None or nr.num_computed_tokens + n < request.num_prompt_tokens:
                continue  # chunked: pushed whole once it finished
            handed, first = self.groups.handed(nr.block_ids)
            layered.append(PushSend(nr.req_id, 0, key, tuple(map(tuple, handed)),
                                    tuple(first)))
            self.layered.add(nr.req_id)
        self.prefilling.clear()  # allocated this step, so scheduled this step (or never)
        m = KvplanMetadata(loads=list(self.loads.values()), sends=self.sends,
                           pushes=self.pushes, layered=layered, pulled=self.pulled,
                           beats=self._beats(time.monotonic()))
        self.loads, self.sends, self.pushes, self.pulled = {}, [], [], []
        return m

    def _beats(self, now: float) -> dict[str, list[str]]:
        """Every ``nixl_beat`` seconds, the requests still queued here whose KV a NixlConnector
        prefill holds, by engine: NixlConnector's decode heartbeats a request from admission
        (``on_new_request``), so its prefill's lease (``kv_lease_duration``) never runs out
        while the request waits for blocks here. Once allocated, its load's read beats."""
        if now < self.next_beat:
            return {}
        beats: dict[str, list[str]] = {}
        for src in self.sources.values():
            if isinstance(src, Source) and src.peer is Peer.NIXL:
                beats.setdefault(src.engine, []).append(src.remote_req)
        if beats:
            self.next_beat = now + self.nixl_beat
        return beats

    def finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        src = self.sources.pop(rid, None)
        self.admitted.pop(rid, None)
        hand = self.handovers.pop(rid, None)
        if src is not None:  # never scheduled (aborted): free the prefill's blocks
            if isinstance(src, Source):
                self.loads[rid] = _load(rid, src, (), 0, 0, False, self.groups)
            return False, None
        outcome = self.outcomes.finished(rid)
        if outcome is not None:  # a decode whose load failed: its response says so
            return False, outcome
        layered = rid in self.layered
        self.layered.discard(rid)
        if hand is None or request.status not in (
                RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            if layered:  # aborted after its forward posted writes: held until they end
                gen = new_generation()
                self.sends.append((rid, gen))
                self.pushes.append(PushSend(rid, gen, "", (), ()))
                return True, None
            return False, None
        delay = layered or any(len(g) > 0 for g in block_ids)
        # the hold's generation: a decode's CONFIRM names it, so a hold that ended (and its
        # blocks, freed and maybe reused) is never mistaken for this one (kvplan_nixl.serving.holds)
        gen = new_generation()
        if delay:
            self.sends.append((rid, gen))
        handed, first = self.groups.handed(block_ids)
        if hand.key is not None:  # push, layer-wise or not
            if delay:
                self.pushes.append(PushSend(rid, gen, hand.key, tuple(map(tuple, handed)),
                                            tuple(first)))
            # nothing to pull: the decode waits for the write
            return delay, {"do_remote_prefill": False, "do_remote_decode": False,
                           "transfer_mode": hand.mode, "transfer_id": hand.key,
                           "remote_engine_id": self.c.engine_id,
                           "remote_request_id": rid,
                           "remote_num_tokens": request.num_computed_tokens}
        if delay and self.digest:  # a pull: the digest is of the lists handed here
            self.pulled.append(PushSend(rid, gen, "", tuple(map(tuple, handed)), tuple(first)))
        return delay, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": handed, "remote_block_offsets": first,
            "remote_engine_id": self.c.engine_id,
            "remote_request_id": rid, "remote_host": self.c.host,
            "remote_port": self.c.rank_port(0), "tp_size": self.c.tp_size,
            "remote_num_tokens": request.num_computed_tokens, "transfer_mode": "kvplan",
            "remote_generation": gen,
        }


def _load(req_id: str, src: Source, local: tuple[tuple[int, ...], ...], start: int, end: int,
          parked: bool, groups: TransferGroups | None, admitted: float = 0.0) -> Load:
    """The load of a decode request whose params were checked (``src``); a NixlConnector
    prefill's list offsets derived from the tokens it computed (it hands none)."""
    ids = src.ids if src.ids is not None else ((),)
    first = src.first or (0,) * len(ids)
    if src.peer is Peer.NIXL and groups is not None:
        first = groups.offsets(ids, src.tokens)
    return Load(req_id=req_id, remote_req=src.remote_req, engine=src.engine, host=src.host,
                port=src.port, remote_tp=src.tp, remote_ids=ids, remote_first=first,
                local_ids=local, start=start, end=end, parked=parked,
                generation=src.generation, push=src.push, key=src.key, peer=src.peer,
                admitted=admitted)
