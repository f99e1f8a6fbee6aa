"""KvplanConnector's stats through vLLM's KV connector stats interface (vLLM 0.32.0,
``vllm/distributed/kv_transfer/kv_connector/v1/metrics.py``), modelled on NixlConnector's
(``kv_connector/v1/nixl/stats.py``): the periodic "KV Transfer metrics: ..." log line and
Prometheus histograms and counters.

How vLLM uses them: each worker's ``get_kv_connector_stats()`` returns the observations of the
last step (:meth:`KvplanStats.clone_and_reset`); vLLM aggregates the workers' (``aggregate``),
ships ``to_dict()`` to the logging process, rebuilds them with the connector class's
``build_kv_connector_stats(data)``, accumulates over the log interval and prints ``reduce()``
unless ``is_empty()``; Prometheus gets the dicts through ``build_prom_metrics(...).observe``.
:class:`KvplanStatsMixin` provides the two class methods; the connector adds
``get_kv_connector_stats``. Every field is a list (one entry per observation, counts as 1s) so
that aggregating is concatenating and the payload stays plain JSON-able data.

Imports vLLM (and numpy); nothing else of kvplan_nixl imports it, and ``import kvplan_nixl``
never loads it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["COUNTS", "MARKS", "PHASES", "SERIES", "KvplanPromMetrics", "KvplanStats",
           "KvplanStatsMixin", "phases"]

#: One entry per successful pull (a decode rank's read of one request).
SERIES = ("transfer_duration", "post_duration", "bytes_transferred", "num_runs",
          "num_descriptors")
#: Event counts (one entry per event, or a count per report).
#: ``num_failed_loads`` is counted by the decode's scheduler, once per request whatever the TP
#: (kvplan_nixl.serving.outcomes); the other failures by each worker rank that saw them.
#: ``num_unconfirmed_pulls``: pulls from a prefill running vLLM's own NixlConnector, used
#: without a CONFIRM (such a prefill holds no lease of ours: docs/vllm.md, "Migrating a fleet").
#: ``num_leased_pulls``: pulls reported inside their LEASE, before their CONFIRM (a RETURN,
#: sent after the report); ``num_returns_refused``: such RETURNs answered other than yes
#: (logged; the read was inside the lease, so nothing was served from freed KV).
#: A pulled request's timeline on a decode rank, one entry per phase per pull reported loaded
#: (seconds, the worker's monotonic clock): between the events of :data:`MARKS`, in order, and
#: ``phase_handover`` from the first to the last (their sum). ``phase_confirm`` is what the
#: report waited for after the read: every CONFIRM's yes, or for a pull reported inside its
#: lease (``num_leased_pulls``) the LEASE answers still missing when the read completed (0
#: when they came first: the CONFIRM then runs after the report, off the critical path). A
#: NixlConnector prefill's pull has no CONFIRM: its ``phase_confirm`` is 0.
PHASES = ("phase_handshake", "phase_post", "phase_read", "phase_confirm", "phase_report",
          "phase_handover")
#: The events a pulled request's timeline is measured between, each where it happens on the
#: decode worker: ``admitted`` (the scheduler's metadata handed the load to the worker,
#: ``start_load_kv``), ``started`` (its prefill connected, the worker starts planning it: the
#: handshake's end as the worker saw it), ``posted`` (``Endpoint.read`` returned), ``read``
#: (a poll saw the read complete), ``confirmed`` (the pull proven read from held blocks: every
#: prefill rank read answered its CONFIRM, or inside a lease the later of ``read`` and its
#: last LEASE answer), ``reported`` (``get_finished`` handed it to the scheduler).
MARKS = ("admitted", "started", "posted", "read", "confirmed", "reported")


def phases(marks: tuple[float, ...] | list[float]) -> tuple[float, ...]:
    """The :data:`PHASES` of one pull from its :data:`MARKS` times (seconds, one clock): the
    gaps between consecutive marks (a mark earlier than the one before it counts as equal to
    it: no phase is negative), then their sum."""
    if len(marks) != len(MARKS):
        raise ValueError(f"a timeline has {len(MARKS)} marks {MARKS}, got {len(marks)}")
    gaps, last = [], float(marks[0])
    for m in marks[1:]:
        m = max(last, float(m))
        gaps.append(m - last)
        last = m
    return (*gaps, last - float(marks[0]))


COUNTS = ("num_failed_transfers", "num_failed_handshakes", "num_kv_expired_reqs",
          "num_confirmations_refused", "num_side_channel_dropped", "num_failed_loads",
          "num_unconfirmed_pulls", "num_leased_pulls", "num_returns_refused")


@dataclass
class KvplanStats(KVConnectorStats):
    """The observations of one interval (``data``: a list per key of :data:`SERIES` and
    :data:`COUNTS`). Record under the connector's lock: the progress thread, the side channel
    and the engine step all report."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:  # rebuilt from a dict: copied (aggregate extends lists in place, and the
            # caller may use its dict again), keys it lacks added
            self.data = {k: list(self.data.get(k, ())) for k in (*SERIES, *PHASES, *COUNTS)} | {
                k: list(v) for k, v in self.data.items() if k not in SERIES + PHASES + COUNTS}

    def reset(self) -> None:
        """Empty every list."""
        self.data = {k: [] for k in (*SERIES, *PHASES, *COUNTS)}

    def record_transfer(self, seconds: float, post_seconds: float, nbytes: int, runs: int,
                        descriptors: int) -> None:
        """A successful (confirmed) pull: its duration (``Transfer.seconds``), the time its
        ``Endpoint.read`` took to post, bytes, plan runs and NIXL descriptors posted."""
        for k, v in zip(SERIES, (float(seconds), float(post_seconds), int(nbytes), int(runs),
                                 int(descriptors))):
            self.data[k].append(v)

    def record_timeline(self, marks: tuple[float, ...] | list[float]) -> tuple[float, ...]:
        """A pull reported loaded: its :data:`PHASES` from its :data:`MARKS` times
        (:func:`phases`), recorded and returned."""
        got = phases(marks)
        for k, v in zip(PHASES, got):
            self.data[k].append(v)
        return got

    def record(self, key: str, n: int = 1) -> None:
        """``n`` events of ``key`` (one of :data:`COUNTS`); nothing for ``n == 0``."""
        if key not in COUNTS:
            raise KeyError(f"{key!r} is not a count of KvplanStats; one of {COUNTS}")
        if n:
            self.data[key].append(int(n))

    def clone_and_reset(self) -> KvplanStats:
        """What was recorded (returned), starting a new interval."""
        old = copy.copy(self)
        self.reset()
        return old

    @property
    def num_successful_transfers(self) -> int:
        """Pulls recorded with :meth:`record_transfer`."""
        return len(self.data["transfer_duration"])

    def is_empty(self) -> bool:
        """Nothing recorded (failures alone are not empty: they must be logged)."""
        return not any(self.data[k] for k in (*SERIES, *PHASES, *COUNTS))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s observations (another worker's, or a later step's) to these."""
        if not other.is_empty():
            for k, v in other.data.items():
                self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The log line's values: successful pulls, mean and p90 times (ms), MB and
        throughput, mean runs and descriptors; the mean and p90 handover (:data:`PHASES`:
        from admission to the report, ms) and the mean wait after the read (``phase_confirm``,
        ms); the counts summed."""
        counts = {
            "Num failed transfers": sum(self.data["num_failed_transfers"])
            + sum(self.data["num_failed_handshakes"]),
            "Num KV expired reqs": sum(self.data["num_kv_expired_reqs"]),
            "Num confirmations refused": sum(self.data["num_confirmations_refused"]),
            "Num side channel dropped": sum(self.data["num_side_channel_dropped"]),
            "Num failed loads": sum(self.data["num_failed_loads"]),
            "Num unconfirmed pulls": sum(self.data["num_unconfirmed_pulls"]),
            "Num leased pulls": sum(self.data["num_leased_pulls"]),
            "Num returns refused": sum(self.data["num_returns_refused"]),
        }
        hand = np.asarray(self.data["phase_handover"], dtype=np.float64)
        conf = np.asarray(self.data["phase_confirm"], dtype=np.float64)
        counts |= {  # reported at get_finished: maybe in another interval than the transfer
            "Avg handover (ms)": round(float(hand.mean()) * 1e3, 3) if len(hand) else 0,
            "P90 handover (ms)": round(float(np.percentile(hand, 90)) * 1e3, 3)
            if len(hand) else 0,
            "Avg confirm (ms)": round(float(conf.mean()) * 1e3, 3) if len(conf) else 0,
        }
        n = self.num_successful_transfers
        if n == 0:
            return {"Num successful transfers": 0, "Avg xfer time (ms)": 0,
                    "P90 xfer time (ms)": 0, "Avg post time (ms)": 0, "Avg MB per transfer": 0,
                    "Throughput (MB/s)": 0, "Avg runs": 0, "Avg number of descriptors": 0,
                    **counts}
        xfer = np.asarray(self.data["transfer_duration"], dtype=np.float64)
        post = np.asarray(self.data["post_duration"], dtype=np.float64)
        mb = np.asarray(self.data["bytes_transferred"], dtype=np.float64) / 2**20
        total_s = float(xfer.sum())
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(float(xfer.mean()) * 1e3, 3),
            "P90 xfer time (ms)": round(float(np.percentile(xfer, 90)) * 1e3, 3),
            "Avg post time (ms)": round(float(post.mean()) * 1e3, 3),
            "Avg MB per transfer": round(float(mb.mean()), 3),
            # a pull faster than the clock's resolution counts no time: no division by 0
            "Throughput (MB/s)": round(float(mb.sum()) / total_s, 3) if total_s > 0 else 0,
            "Avg runs": round(float(np.mean(self.data["num_runs"])), 1),
            "Avg number of descriptors": round(float(np.mean(self.data["num_descriptors"])), 1),
            **counts,
        }


_TIME_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
_PHASE_BUCKETS = [0.0001, 0.0005, *_TIME_BUCKETS]
_COUNT_BUCKETS = [1, 10, 30, 100, 300, 1000, 3000, 10000, 30000, 100000]


class KvplanPromMetrics(KVConnectorPromMetrics):
    """Prometheus metrics of KvplanConnector: histograms ``vllm:kvplan_xfer_time_seconds``,
    ``vllm:kvplan_post_time_seconds``, ``vllm:kvplan_bytes_transferred``,
    ``vllm:kvplan_num_runs``, ``vllm:kvplan_num_descriptors``, a pulled request's timeline
    ``vllm:kvplan_<phase>_seconds`` for each of :data:`PHASES` (e.g.
    ``vllm:kvplan_phase_confirm_seconds``); counters
    ``vllm:kvplan_<count>`` for each of :data:`COUNTS` (``..._num_kv_expired_reqs`` is
    counted on the prefill, ``..._num_confirmations_refused`` too)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        # the metric classes come through metric_types (vLLM passes its own subclasses)
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        hist = {
            "transfer_duration": ("xfer_time_seconds", "duration of a KV pull",
                                  _TIME_BUCKETS[1:]),
            "post_duration": ("post_time_seconds", "time to post a KV pull", _TIME_BUCKETS),
            "bytes_transferred": ("bytes_transferred", "bytes of a KV pull",
                                  [2 ** (10 + i) for i in range(1, 25, 2)]),
            "num_runs": ("num_runs", "planned runs of a KV pull", _COUNT_BUCKETS),
            "num_descriptors": ("num_descriptors", "NIXL descriptors of a KV pull",
                                _COUNT_BUCKETS),
            **{k: (f"{k}_seconds", f"time of a pulled request's {k.removeprefix('phase_')} "
                   "phase", _PHASE_BUCKETS) for k in PHASES},
        }
        self.histograms = {
            k: create_metric_per_engine(self._histogram_cls(
                name=f"vllm:kvplan_{name}", documentation=f"Histogram of the {doc}s "
                "(KvplanConnector).", buckets=buckets, labelnames=labelnames),
                self.per_engine_labelvalues)
            for k, (name, doc, buckets) in hist.items()}
        self.counters = {
            k: create_metric_per_engine(self._counter_cls(
                name=f"vllm:kvplan_{k}", documentation=f"KvplanConnector: {k.replace('_', ' ')}"
                ".", labelnames=labelnames), self.per_engine_labelvalues)
            for k in COUNTS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one interval's data (``KvplanStats.to_dict()``) for engine ``engine_idx``."""
        for k, metric in self.histograms.items():
            for v in transfer_stats_data.get(k, ()):
                metric[engine_idx].observe(v)
        for k, metric in self.counters.items():
            n = sum(transfer_stats_data.get(k, ()))
            if n:
                metric[engine_idx].inc(n)


class KvplanStatsMixin:
    """The two class methods vLLM looks up on the connector class: put it first among
    KvplanConnector's bases (``class KvplanConnector(KvplanStatsMixin, KVConnectorBase_V1)``)."""

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvplanStats:
        """Stats rebuilt from a worker's ``to_dict()`` (empty ones for None)."""
        return KvplanStats(data=data) if data is not None else KvplanStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvplanPromMetrics:
        """This connector's Prometheus metrics."""
        return KvplanPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
