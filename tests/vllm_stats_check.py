"""Run by tests/test_vllm_stats.py with the vLLM venv's python: KvplanStats and
KvplanPromMetrics through vLLM 0.32's own code paths (its KVConnectorLogging, which prints
the periodic log line, and prometheus_client's exposition). Prints one JSON line."""

from __future__ import annotations

import json

import prometheus_client
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

from kvplan_nixl.vllm.stats import KvplanStats, KvplanStatsMixin


class Conn(KvplanStatsMixin):
    """Stands for KvplanConnector (the lead adds the mixin to it)."""


def main() -> None:
    # two decode workers, one step each: rank 0 pulled twice, rank 1 once and failed once
    w0, w1 = KvplanStats(), KvplanStats()
    w0.record_transfer(0.010, 0.001, 3 << 20, 8, 16)
    w0.record_transfer(0.030, 0.003, 1 << 20, 4, 8)
    w1.record_transfer(0.020, 0.002, 2 << 20, 6, 12)
    # rank 0's two pulls reported: admitted, started, posted, read, confirmed, reported (s)
    phases = w0.record_timeline((10.0, 10.001, 10.003, 10.013, 10.043, 10.045))
    w0.record_timeline((20.0, 20.0, 20.002, 20.0015, 20.012, 20.013))  # read "before" posted
    try:
        w0.record_timeline((1.0, 2.0))
        short_refused = False
    except ValueError:
        short_refused = True
    w1.record("num_failed_transfers")
    w1.record("num_confirmations_refused", 2)
    out = {"empty_new": KvplanStats().is_empty(), "failures_only_empty": None,
           "phases": phases, "short_timeline_refused": short_refused}
    f = KvplanStats()
    f.record("num_kv_expired_reqs")
    out["failures_only_empty"] = f.is_empty()
    step = w0.clone_and_reset().aggregate(w1.clone_and_reset())  # vLLM's worker aggregation
    out["reset_after_clone"] = w0.is_empty() and w1.is_empty()
    wire = json.loads(json.dumps(step.to_dict()))  # worker -> logger process
    logging = KVConnectorLogging(None)
    logging.connector_cls = Conn  # what KVConnectorFactory resolves from kv_connector
    logging.observe(wire)
    logging.observe(f.to_dict())  # a prefill's expiry in the same interval
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
    out["log"] = lines
    out["reduce"] = Conn.build_kv_connector_stats(wire).reduce()

    class Cfg:
        kv_transfer_config = None

    metric_types = {prometheus_client.Gauge: prometheus_client.Gauge,
                    prometheus_client.Counter: prometheus_client.Counter,
                    prometheus_client.Histogram: prometheus_client.Histogram}
    prom = Conn.build_prom_metrics(Cfg(), metric_types, ["model_name", "engine"],
                                   {0: ["tiny", "0"]})
    prom.observe(wire, 0)
    prom.observe(f.to_dict(), 0)
    text = prometheus_client.generate_latest().decode()
    out["prom"] = [ln for ln in text.splitlines() if ln.startswith("vllm:kvplan_")
                   and ("_count{" in ln or "_sum{" in ln or "_total{" in ln)]
    print("@@stats " + json.dumps(out))


if __name__ == "__main__":
    main()
