"""The worker half of ``KvplanConnector``, one per TP rank: the endpoint, the side channel
(metadata and hold control), the progress thread, and the rank's parts that move requests
(engine-neutral, in :mod:`kvplan_nixl.serving`): pulls (:mod:`~kvplan_nixl.serving.pulls`),
pushes to wait for and to write (:mod:`~kvplan_nixl.serving.push_io`).

Never serving freed KV (docs/vllm.md, "Holds, CONFIRM and heartbeats"): a prefill rank holds
each request under the generation its scheduler chose (:class:`kvplan_nixl.serving.holds.Holds`) and
reports the send finished only once the hold ended; a decode rank renews the holds it reads
while its pull is in flight, and reports the pull finished only after every prefill rank it
read confirmed the hold was live throughout, or granted it a LEASE that covers the read
(docs/vllm.md, "Reporting inside a lease": then the CONFIRM follows the report). Nothing
that talks to another engine runs on the engine step: handshakes on
:class:`kvplan_nixl.serving.handshakes.Handshakes`' threads, LEASE, RENEW, CONFIRM, RETURN
and RELEASE on a small pool of their own.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

import kvplan
from kvplan.adapters.vllm import TransferGroups, spec_from_vllm, vllm_buffers, whole_pages
from kvplan_nixl.errors import NixlError, NotConnectedError
from kvplan_nixl.serving import push_digests
from kvplan_nixl.serving import sidechannel as sc
from kvplan_nixl.serving.addresses import is_loopback
from kvplan_nixl.serving.control import Control, Sends
from kvplan_nixl.serving.handshakes import (
    FAILED,
    AddressConflict,
    AddressRefused,
    Handshakes,
    HandshakeState,
    identity,
)
from kvplan_nixl.serving.locks import FairLock
from kvplan_nixl.serving.pull_digest_io import Answers
from kvplan_nixl.serving.pulls import Pulls, tell_unposted
from kvplan_nixl.serving.push_io import Receives, Writes
from kvplan_nixl.serving.restarts import Restarts
from kvplan_nixl.serving.spans import lacking
from kvplan_nixl.serving.transfer_params import Peer
from kvplan_nixl.vllm.nixl_peer import NixlPrefills, stock_backend
from kvplan_nixl.vllm.stats import KvplanStats
from kvplan_nixl.vllm.versions import advertised, check_peer, local_version, stock_hashes

if TYPE_CHECKING:
    from kvplan_nixl.serving.loads import Load
    from kvplan_nixl.serving.settings import Settings
    from kvplan_nixl.vllm.scheduler import KvplanMetadata

# a child of vLLM's logger, so that its handlers and level apply
logger = init_logger("vllm.kvplan_nixl")


class Worker:
    """The worker half, one per TP rank: endpoint, side channel, progress thread, pulls."""

    def __init__(self, settings: Settings, vllm_config: Any) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.c = c = settings
        self.vllm_config = vllm_config
        self.rank = get_tensor_model_parallel_rank()
        self.secret = c.extra.get("secret")
        self.vllm_version = local_version()  # advertised; a peer's checked at handshake
        self.check_peer = check_peer(self.vllm_version)  # (serving.rank.Rank.check_peer)
        self.timeout = c.seconds("transfer_timeout_s", 30.0)
        self.hs_timeout = c.seconds("handshake_timeout_s", 5.0)
        self.lease = c.seconds("lease_s", 120.0)
        self.layer_wait = c.seconds("layerwise_wait_s", 1.0, zero=True)
        self.heartbeat = c.seconds("heartbeat_s", self.lease / 3)
        self.nixl_heartbeat = c.nixl_heartbeat()  # a NixlConnector prefill's: its lease / 6
        self.lease_pin, self.lease_margin = c.leases(self.lease)  # reporting inside a lease
        if self.heartbeat > self.lease / 3:
            raise ValueError(
                f"kv_connector_extra_config['heartbeat_s'] = {self.heartbeat:g} is above "
                f"lease_s / 3 = {self.lease / 3:g}: one lost heartbeat would let the prefill's "
                "lease run out under a live pull; lower heartbeat_s or raise lease_s")
        self.backends = c.backends()
        # every Endpoint call: it is used by one thread at a time; fair, so that the step,
        # which takes it again at once, never starves a handshake's connect or the progress
        # loop on a loaded machine (kvplan_nixl.serving.locks)
        self.lock = FairLock()
        self.ep = None
        self.sends: Sends | None = None  # prefill: the holds and the side channel
        self.stop = threading.Event()
        self.hs: Handshakes | None = None
        self.nixl: NixlPrefills | None = None  # decode: NixlConnector prefills' handshakes
        self.receives: Receives | None = None  # decode: pushes to wait for
        self.writes: Writes | None = None  # prefill: pushes to write
        self.answers: Answers | None = None  # prefill: pull digest questions
        self.cuda = False  # the KV caches are CUDA tensors (register)
        # RENEW / CONFIRM / RELEASE: each bounded by handshake_timeout_s, never on the step
        self.ctl = Control(self.secret, self.hs_timeout)
        self.engines: dict[str, tuple[Any, list[int]]] = {}  # prefill engine -> map, counts
        self.waiting: dict[str, tuple[Load, float]] = {}  # handshake pending -> deadline
        self.owed: dict[tuple[str, str, int], list[tuple[Load, bool, float]]] = {}  # _owe_stock
        self.restarts = Restarts(self)  # prefills restarted in place: connected afresh
        self.pulls = Pulls(self)
        self.recv_done: set[str] = set()
        # the timeline of each pull (stats.MARKS): when the worker got a load (until it is
        # reported), the marks of a loaded pull up to its CONFIRM (until get_finished)
        self.admitted: dict[str, float] = {}
        self.reporting: dict[str, tuple[float, ...]] = {}
        self.recv_failed: set[str] = set()
        self.errors: set[int] = set()
        self.stats = KvplanStats()
        self.digester = None  # the transfer digest's (register), None when it is off
        self._reported: dict[str, int] = {}  # cumulative counters already in self.stats

    # -- start-up ----------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: Any) -> None:
        from kvplan_nixl import Endpoint

        cfg = self.vllm_config
        # every layer its own backend and the head count of the model that owns it: an
        # EAGLE-3 draft's attention layer sits in the MLA target's KV-cache group
        backend, heads = _layer_backends(cfg, kv_caches), _layer_heads(cfg, kv_caches)
        spec = spec_from_vllm(
            kv_caches, kv_cache_config, tp_size=self.c.tp_size, backend=backend,
            total_num_kv_heads=heads,
            dcp_size=cfg.parallel_config.decode_context_parallel_size,
            dcp_interleave=getattr(cfg.parallel_config, "cp_kv_cache_interleave_size", 1),
            mamba_n_groups=_mamba_n_groups(cfg), conv_layout=_conv_layout())
        self.groups = TransferGroups.from_config(kv_cache_config)
        # CPU_ATTN keeps each (block, head) page in its kernel's order: move whole blocks only
        # (a request's blocks move for every layer at once, so one such layer decides)
        self.whole = whole_pages(backend)
        bufs: dict[str, Any] = dict(vllm_buffers(kv_caches, spec, self.rank))
        first = next(iter(kv_caches.values()))
        self.cuda = first.device.type == "cuda"
        if self.cuda:  # NIXL needs the device: flat views of the buffers
            bufs = {k: _flat(kv_caches, a, n) for k, (a, n) in bufs.items()}
        self.digester = push_digests.digester(self.c, spec, self.rank, bufs, self.cuda)
        # the vLLM version, signed with the layout: a peer of another version checks the
        # pair at handshake (kvplan_nixl/vllm/versions.py: a rolling upgrade)
        self.ep = Endpoint(self.c.engine_id, spec, self.rank, bufs, secret=self.secret,
                           backends=self.backends, app=advertised(self.vllm_version))
        kinds = ",".join(sorted({r.kind.value for r in spec.regions}))
        logger.info("kvplan: rank %d registered %d regions (%s; backend %s, layouts %s, "
                    "groups %s, %d buffers)", self.rank, len(spec.regions), kinds,
                    _backend_counts(backend, spec),
                    ",".join(sorted({r.layout_name for r in spec.regions if not r.is_state})),
                    "+".join(self.groups.kinds), len(spec.buffers))
        port = self.c.rank_port(self.rank)
        try:  # a taken port: PortInUseError names it and the key to change
            self.sends = Sends(self.c.listen_host, port,
                               sc.server_identity(self.c.engine_id, self.rank),
                               self.ep.metadata(), secret=self.secret, lease=self.lease)
        except BaseException:
            self.ep.close()
            raise
        logger.info("kvplan: rank %d side channel on %s:%d, advertised as %s (base %d, dp rank "
                    "%d)", self.rank, self.c.listen_host, port, self.c.host, self.c.port,
                    self.c.dp_rank)
        # without a secret a kvplan prefill's metadata is unsigned: its address is its
        # identity, as a stock prefill's (serving/handshakes.py, "Restarts and identity")
        self.hs = Handshakes(self._hs_connect, lock=self.lock, timeout=self.hs_timeout,
                             identify=identity(self.secret, self.check_peer),
                             retry_after_s=min(5.0, self.lease),
                             warn=lambda m: logger.warning("kvplan: pull %s", m),
                             pin=self.secret is None)
        # a stock prefill's hash names its vLLM version: every listed version's is accepted
        self.nixl = NixlPrefills(self, stock_hashes(cfg, stock_backend(cfg)), stock_backend(cfg))
        self.receives, self.writes = Receives(self), Writes(self)
        self.answers = Answers(self, self.writes.hs)  # decodes connected as a push does
        self.ep.on_peer_gone(self.restarts.gone)
        threading.Thread(target=self._progress_loop, daemon=True,
                         name="kvplan-progress").start()

    def _progress_loop(self) -> None:
        """Progress the agent when vLLM does not step (an idle prefill must still serve reads);
        poll pulls in flight, start those whose handshake completed, send heartbeats."""
        while not self.stop.wait(0.002):
            with self.lock:
                if self.ep is None or self.ep.closed:
                    return
                try:
                    self._progress()
                except Exception:  # logged, never kills the thread
                    logger.exception("kvplan: progress failed")

    def _progress(self) -> None:
        now = time.monotonic()
        # push mode's words (the envelope drops forged ones: num_side_channel_dropped); any
        # other is drained so that a stray one cannot pile up
        for n in self.ep.notifications():
            try:  # one message that raises never takes the rest of its batch with it
                taken = self.writes.notice(n, now) or self.receives.notice(n, now) \
                    or self.answers.notice(n, now) or self.pulls.notice(n, now)
            except Exception:
                logger.exception("kvplan: dropped a notification from %s rank %d", n.engine,
                                 n.rank)
                continue
            if not taken:
                logger.debug("kvplan: ignored a notification from %s rank %d", n.engine,
                             n.rank)
        self.writes.progress(now)
        self.receives.progress(now)
        self.answers.progress(now)
        if self.waiting:
            _poll_waiting(self, now)
        self.pulls.progress(now)

    # -- decode: handshakes and pulls --------------------------------------------------------

    def start(self, meta: KvplanMetadata) -> None:
        if meta.sends and self.sends is not None:
            self.sends.hold(meta.sends)
        if meta.pulled and self.answers is not None:
            with self.lock:
                self.answers.add(meta.pulled)
        if meta.pushes and self.writes is not None:
            with self.lock:
                self.writes.add(meta.pushes, time.monotonic())
        if meta.beats:
            _beat_queued(self, meta.beats)
        if not meta.loads:
            return
        with self.lock:
            now = time.monotonic()
            for load in meta.loads:
                if load.local_ids and not load.push:
                    self.admitted.setdefault(load.req_id, now)
                if _ended_early(self, load):  # refused, or nothing to read
                    continue
                try:  # the handshake runs on Handshakes' threads, never on this step
                    _hs_start(self, load)
                except (AddressConflict, AddressRefused) as e:  # nothing was dialled
                    self.stats.record("num_failed_handshakes")
                    self.fail(load, f"{type(e).__name__}: {e}")
                    continue
                except Exception as e:
                    self.stats.record("num_failed_handshakes")
                    self.fail(load, f"{type(e).__name__}: {e}{_dialled(load)}")
                    continue
                # bounded: a handshake takes at most a few handshake_timeout_s per rank
                self.waiting[load.req_id] = (load, now + self.timeout)
            _poll_waiting(self, now)

    def _hs_connect(self, engine: str, rank: int, blob: bytes) -> tuple[int, ...]:
        """Handshakes' ``connect`` (under self.lock): connect one prefill rank; the ranks this
        rank's pull map reads, once the first rank's spec is in."""
        self.ep.connect(blob, mode="pull")
        tmap = self.ep.map(engine)
        # rank 0 connects every prefill rank: a push registration goes to each of them
        return tuple(range(tmap.src.tp_size)) if self.rank == 0 else tuple(tmap.peers)

    def post(self, load: Load, connect_by: float) -> None:
        """Start ``load`` (its prefill connected): pull it, or register its push and wait.
        ``connect_by``: the latest its handshake could have completed on any rank."""
        tmap, counts = self._engine(load.engine)
        if load.push:  # the prefill writes: register and wait
            self.receives.register(load, tmap, time.monotonic(), connect_by)
            return
        self.pulls.post(load, tmap, counts)

    def _engine(self, engine: str) -> tuple[Any, list[int]]:
        """The pull map of a connected prefill engine, and how many decode ranks read each of
        its ranks (each CONFIRM carries it)."""
        if engine not in self.engines:
            tmap = self.ep.map(engine)
            self.engines[engine] = (tmap, _readers(tmap, engine, self.whole))
        return self.engines[engine]

    def fail(self, load: Load, why: str, peers: tuple[int, ...] = ()) -> None:
        logger.error("kvplan: %s req=%s from %s failed (%s); its blocks go to vLLM's "
                     "kv_load_failure_policy", "push" if load.push else "pull", load.req_id,
                     load.engine, why)
        # end the holds: rank 0 for every prefill rank, the others for those they read (a
        # push's holds end when its write ends, or at their lease)
        # (a NixlConnector prefill has no hold of ours: it frees them at our notification,
        # or at its own timeout)
        self.admitted.pop(load.req_id, None)
        self.reporting.pop(load.req_id, None)
        if not load.push and not load.refused and load.peer is Peer.KVPLAN:
            self.ctl.release(load, range(load.remote_tp) if self.rank == 0 else peers)
        if not load.parked:
            return
        self.recv_done.add(load.req_id)
        if len(self.groups.kinds) == 1:
            dst = self.groups.local(load.local_ids)
            self.errors.update(int(b) for b in lacking(self.groups, dst, load.start,
                                                         load.end)[0])
        else:  # block ids are per group: vLLM wants the request instead
            self.recv_failed.add(load.req_id)

    # -- results -----------------------------------------------------------------------------

    def results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        with self.lock:
            if self.ep is not None:
                try:  # nothing a peer sent may raise out of vLLM's step
                    self._progress()
                except Exception:
                    logger.exception("kvplan: progress failed")
            sending: set[str] = set()
            if self.sends is not None:  # only ended holds come out: vLLM frees their blocks
                sending, counts = self.sends.finished()
                self.answers.forget(sending)
                self._count("num_kv_expired_reqs", "expired", counts["expired"])
                self._count("num_confirmations_refused", "refused", counts["refused"])
                self._count("num_side_channel_dropped", "dropped",
                            counts["dropped"] + self.ep.ignored_notices)
            self.restarts.reported(self.recv_done)
            if self.owed:
                _pay_stock(self)
            if self.recv_done:
                _timelines(self, time.monotonic())
            out = KVConnectorTransferResults(finished_sending=sending,
                                             finished_recving=self.recv_done,
                                             failed_recving=self.recv_failed)
            self.recv_done, self.recv_failed = set(), set()
            return out

    def _count(self, key: str, name: str, total: int) -> None:
        """Record what a cumulative counter gained since the last report."""
        self.stats.record(key, total - self._reported.get(name, 0))
        self._reported[name] = total

    def take_errors(self) -> set[int]:
        with self.lock:
            out, self.errors = self.errors, set()
            return out

    def take_stats(self) -> KvplanStats | None:
        """The stats since the last call (vLLM's ``get_kv_connector_stats``), None if none."""
        with self.lock:
            return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def close(self) -> None:
        self.stop.set()
        # outside self.lock: their jobs take it to report
        if self.hs is not None:
            self.hs.close()
        if self.nixl is not None:
            self.nixl.close()
        if self.writes is not None:
            self.writes.close()
        if self.answers is not None:
            self.answers.close()
        self.pulls.close()
        self.ctl.close()
        if self.sends is not None:
            self.sends.close()
        with self.lock:
            if self.ep is not None:
                with contextlib.suppress(Exception):
                    self.ep.close()


def _poll_waiting(w: Worker, now: float) -> None:
    """Start the loads whose handshake ended (or fail them); fail those past their deadline;
    a load connecting afresh after a failed attempt is settled by ``w.restarts``."""
    for req_id, (load, deadline) in list(w.waiting.items()):
        st = _hs_state(w, load)
        if st is None:  # forgotten meanwhile, or the pool was full: start again
            try:
                st = _hs_start(w, load)
            except Exception as e:  # bound elsewhere meanwhile, or closed
                st = HandshakeState(FAILED, f"{type(e).__name__}: {e}")
        if st.pending:
            if now > deadline:
                del w.waiting[req_id]
                w.restarts.again.pop(req_id, None)
                w.stats.record("num_failed_handshakes")
                w.fail(load, f"handshake with {load.engine} at {load.host}:"
                                 f"{load.port} not done within {w.timeout:g} s"
                                 f"{_dialled(load, address=False)}")
                _owe_stock(w, load, aborted=False)
            continue
        del w.waiting[req_id]
        if st.failed:
            w.stats.record("num_failed_handshakes")
        failed = w.restarts.settle(load, st, _dialled(load))
        if failed is not None:
            w.fail(load, *failed)
            if st.failed:  # (not a stale one: its id is the old instance's)
                _owe_stock(w, load, aborted=False)
            continue
        try:
            w.post(load, deadline)
        # its peer went, or its blocks are not the map's: it may have restarted in place
        except (NotConnectedError, NixlError, kvplan.RequestError) as e:
            if not w.restarts.connect_again(load, e, (), deadline):
                w.fail(load, f"{type(e).__name__}: {e}")
        except Exception as e:  # a refused pair, bad params
            w.fail(load, f"{type(e).__name__}: {e}")


def _beat_queued(w: Worker, beats: dict[str, list[str]]) -> None:
    """Heartbeat NixlConnector prefills' requests still queued in the scheduler
    (``KvplanMetadata.beats``): ``HB:<ids>`` to the ranks ``w`` reads of each prefill it has
    read before. A prefill not connected yet gets none (NixlConnector's decode would start its
    handshake for it; ours starts when a request of it is scheduled)."""
    with w.lock:
        for engine, ids in beats.items():
            if engine not in w.engines:
                continue
            peers = list(w.engines[engine][0].peers)
            try:
                w.ep.notify(engine, peers, "HB:" + ",".join(ids))
            except Exception as e:  # its lease then runs out as if we were silent
                logger.warning("kvplan: could not heartbeat NixlConnector prefill %s rank(s) "
                               "%s for %d queued request(s): %s: %s", engine, peers, len(ids),
                               type(e).__name__, e)


def _free_stock(w: Worker, load: Load, *, aborted: bool) -> bool:
    """Tell a NixlConnector prefill this rank has read before (``w.engines``) that ``load``
    will not be read, so that it frees the request's blocks now rather than at its lease:
    ``aborted`` (the request never ran; rank 0 alone calls it) every prefill rank
    ``<id>:1``, else (every decode rank refused it) as
    :func:`~kvplan_nixl.serving.pulls.tell_unposted` tells.
    False when the prefill is not connected here (nothing can be sent)."""
    if load.engine not in w.engines:
        if aborted:
            logger.warning("kvplan: req=%s reads nothing from NixlConnector prefill %s, not "
                           "connected here: it frees the request's blocks at its own timeout",
                           load.req_id, load.engine)
        return False
    tmap, counts = w.engines[load.engine]
    if aborted:
        tell_unposted(w, load, (), [0] * len(counts))  # every rank "unread": <id>:1
    else:
        tell_unposted(w, load, tuple(tmap.peers), counts)
    return True


def _ended_early(w: Worker, load: Load) -> bool:
    """End ``load`` before any handshake where it must not or need not read (True then): its
    params were refused (nobody named in them is contacted), a stock prefill's under the
    transfer digest (its KV is never used unchecked), nothing to read (the prefill is let free
    its blocks), a stock request older than its prefill's restart in place
    (:meth:`~kvplan_nixl.serving.restarts.Restarts.stale`)."""
    if load.refused:
        w.fail(load, f"kv_transfer_params refused: {load.refused}")
        return True
    if load.peer is Peer.NIXL and w.digester is not None:
        w.fail(load, "the transfer digest is on, and a NixlConnector prefill cannot digest "
                     "what it served")
        _free_stock(w, load, aborted=False)
        return True
    if not load.local_ids:
        if w.rank == 0 and load.peer is Peer.KVPLAN and not load.push:
            w.ctl.release(load, range(load.remote_tp))  # (a push's: its lease)
        elif w.rank == 0 and load.peer is Peer.NIXL and not _free_stock(w, load, aborted=True):
            _owe_stock(w, load, aborted=True)
        return True
    stale = w.restarts.stale(load)
    if stale is not None:
        w.fail(load, stale)
        return True
    return False


def _owe_stock(w: Worker, load: Load, *, aborted: bool) -> None:
    """A NixlConnector prefill's load failed (or was aborted) before its prefill was connected
    on this rank, so its ``<id>:n`` cannot be sent now (only a NIXL connection carries it):
    keep it for :func:`_pay_stock`, which sends it if a handshake with the same engine, host
    and port connects while the prefill still holds the request's blocks for it. Told at once
    instead where the engine is connected here already (another key's handshake failed).

    Only until the prefill's lease ran out: it last heard a heartbeat at most ``nixl_heartbeat``
    (its lease / 6) before now, so its lease ends no sooner than 5/6 of it from now (less 1 s);
    told after that, vLLM's prefill logs an ERROR for an unrecognized request. At most
    :data:`MAX_OWED` loads are kept (the oldest dropped: its blocks wait for the lease, as
    before)."""
    if load.peer is not Peer.NIXL or load.push or load.refused or not load.remote_req:
        return
    if load.engine in w.engines:
        _free_stock(w, load, aborted=aborted)
        return
    until = time.time() + w.nixl_heartbeat * 5 - 1.0
    w.owed.setdefault((load.engine, load.host, load.port), []).append((load, aborted, until))
    while sum(len(v) for v in w.owed.values()) > MAX_OWED:
        oldest = min(w.owed, key=lambda k: w.owed[k][0][2])
        w.owed[oldest].pop(0)
        if not w.owed[oldest]:
            del w.owed[oldest]


def _pay_stock(w: Worker) -> None:
    """Tell the NixlConnector prefills connected since (a ready handshake under the key the
    load named) what :func:`_owe_stock` kept, as a load refused before posting is told
    (:func:`_free_stock`); drop what is past its use. Each engine step, under ``w.lock``."""
    now = time.time()
    for key in list(w.owed):
        w.owed[key] = live = [e for e in w.owed[key] if e[2] > now]
        st = w.nixl.hs.state(*key) if w.nixl is not None and live else None
        if st is not None and st.ready:
            try:
                w._engine(key[0])
            except Exception as e:  # its map refused: nothing can be told
                logger.warning("kvplan: NixlConnector prefill %s: %d failed load(s) not told "
                               "(%s: %s); its blocks wait for its lease", key[0], len(live),
                               type(e).__name__, e)
                live = []
            for load, aborted, _ in live:
                _free_stock(w, load, aborted=aborted)
            if live:
                logger.info("kvplan: told NixlConnector prefill %s, connected since, that %d "
                            "request(s) whose load failed before will not be read: %s",
                            key[0], len(live), [ld.remote_req for ld, _, _ in live][:8])
            live = []
        if not live:
            del w.owed[key]


#: Failed stock loads a decode rank keeps to tell their prefill once it is connected.
MAX_OWED = 4096


def _timelines(w: Worker, now: float) -> None:
    """The pulls about to be reported (``w.recv_done``) at ``now``: each loaded one's
    timeline recorded (:data:`~kvplan_nixl.vllm.stats.PHASES`) and logged; what is kept of
    every one of them forgotten."""
    for req in w.recv_done:
        w.admitted.pop(req, None)
        marks = w.reporting.pop(req, None)
        if marks is None:  # failed, or a push
            continue
        ph = w.stats.record_timeline((*marks, now))
        logger.info("kvplan: pull req=%s reported after %.2f ms: handshake %.2f, post "
                    "%.2f, read %.2f, confirm %.2f, report %.2f ms", req, ph[-1] * 1e3,
                    *(x * 1e3 for x in ph[:-1]))


def _hs_start(w: Worker, load: Load) -> HandshakeState:
    """Start (or look up) the handshake with ``load``'s prefill: a NixlConnector one's on
    :class:`NixlPrefills`, a kvplan one's on the rank's own :class:`Handshakes`."""
    if load.peer is Peer.NIXL:
        return w.nixl.start(load)
    return w.hs.start(load.engine, load.host, load.port)


def _hs_state(w: Worker, load: Load) -> HandshakeState | None:
    if load.peer is Peer.NIXL:
        return w.nixl.state(load)
    return w.hs.state(load.engine, load.host, load.port)


def _readers(tmap: Any, engine: str, whole: bool) -> list[int]:
    """How many decode ranks read each prefill rank of ``tmap``; refuses unequal block sizes
    where the backend's pages move only whole."""
    src, dst = tmap.src, tmap.dst
    sizes = {(a.block_size, b.block_size) for a, b in zip(src.regions, dst.regions)}
    if whole and any(a != b for a, b in sizes):
        raise ValueError(f"prefill {engine} uses blocks of {sorted(sizes)[0][0]} tokens, this "
                         f"engine {sorted(sizes)[0][1]}: the attention backend's pages move "
                         "only whole, so block sizes must be equal")
    counts = [0] * src.tp_size
    for d in range(dst.tp_size):
        for p in kvplan.pull_map(src, dst, d).peers:
            counts[p] += 1
    return counts


def _dialled(load: Load, address: bool = True) -> str:
    """What a failed handshake's message adds: the address dialled (the prefill advertised
    it), and what a loopback one means (kvplan_nixl.serving.addresses)."""
    out = f"; dialled {load.host}:{load.port}, as the prefill advertised" if address else ""
    if is_loopback(load.host):
        out += ("; a loopback address: a prefill on another host must advertise one this "
                "host reaches (its side_channel_host, side_channel_advertise_host or "
                "VLLM_HOST_IP)")
    return out


#: Backends of state layers (Mamba, GDN, ...): they keep no attention pages.
STATE_BACKENDS = ("MAMBA", "GDN", "LINEAR", "SHORT_CONV", "KDA")


def _layer_backends(cfg: Any, kv_caches: dict) -> dict[str, str | None]:
    """Each registered layer's attention backend name (how the adapter reads its pages), from
    the layer vLLM built (``AttentionLayerBase.get_attn_backend``): a draft's layers have their
    own. State layers' backends keep no attention pages: None for them."""
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(cfg, AttentionLayerBase, list(kv_caches))
    except ImportError:
        layers = {}
    out: dict[str, str | None] = {}
    for name in kv_caches:
        layer = layers.get(name)
        if layer is not None:
            got = layer.get_attn_backend().get_name()
            out[name] = None if any(k in got.upper() for k in STATE_BACKENDS) else got
    unlisted = [name for name in kv_caches if name not in out]
    if unlisted:  # no static forward context (vLLM's own tests): its one choice, said, since
        # a draft's layers may use another backend than the model's
        chosen = _backend_name(cfg)
        logger.warning("kvplan: vLLM lists no attention layer for %d of %d KV caches (first "
                       "%r): their pages are read as backend %s, vLLM's choice for the model",
                       len(unlisted), len(kv_caches), unlisted[0], chosen)
        out.update(dict.fromkeys(unlisted, chosen))
    return out


def _backend_name(cfg: Any) -> str | None:
    """The backend vLLM would choose for attention layers, when it lists no layers."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        names = [b.get_name() for b in get_current_attn_backends(cfg)]
    except Exception:  # vLLM's definition of C then
        return None
    attn = [n for n in names if not any(k in n.upper() for k in STATE_BACKENDS)]
    return attn[0] if attn else None


def _layer_heads(cfg: Any, kv_caches: dict) -> dict[str, int]:
    """Each layer's total KV head count, from the model that owns it: vLLM numbers a draft's
    layers after the target's (``llama_eagle3.py``: ``start_layer_id`` = the target's layer
    count), so ``layers.<i>`` with ``i`` at or past the target's count is the draft's."""
    mc = cfg.model_config
    target, n_target = mc.get_total_num_kv_heads(), mc.get_total_num_hidden_layers()
    spec = getattr(cfg, "speculative_config", None)
    dmc = getattr(spec, "draft_model_config", None) if spec is not None else None
    draft = dmc.get_total_num_kv_heads() if dmc is not None and dmc is not mc else None
    out = {}
    for name in kv_caches:
        m = _LAYER_INDEX.search(name)
        own = draft is not None and m is not None and int(m.group(1)) >= n_target
        out[name] = draft if own else target
    return out


_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def _backend_counts(backend: dict[str, str | None], spec: Any) -> str:
    """The token regions' backend for the start-up log: ``CPU_ATTN``, or where layers differ
    ``AMX_MLA x4 + CPU_ATTN x1``."""
    names = [backend.get(r.name) or "-" for r in spec.regions if not r.is_state]
    kinds = sorted(set(names))
    if len(kinds) <= 1:
        return kinds[0] if kinds else "-"
    return " + ".join(f"{b} x{names.count(b)}" for b in kinds)


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
