"""Prometheus metrics: what `stats()` already counts, in Prometheus's text format. No TensorFlow.

Nothing is counted twice and the dispatch path pays nothing: a collector
reads a snapshot of the strategy's counts at each scrape (`families(stats)`
turns one into metric families) and `MetricsServer` serves them with
`prometheus-client`'s own HTTP server, beside its process collector
(`process_resident_memory_bytes`, `process_cpu_seconds_total`). Names follow
Prometheus's guide: the prefix `psclient_`, base units (seconds, bytes),
`_total` on counters, few labels (`task`, `layer`; never a closure).
docs/metrics.md lists them.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from psclient._core.staleness import STALENESS_BUCKETS
from psclient._core.worker_stats import LATENCY_BUCKETS

__all__ = ["MetricsServer", "evaluator_families", "families", "task_families"]

log = logging.getLogger("psclient")


def families(stats: dict) -> list:
    """The metric families of one `stats()` snapshot of a strategy (pure)."""
    workers = [(f"worker:{i}", w) for i, w in enumerate(stats["workers"]) if not w.get("retired")]
    ps = [(f"ps:{i}", p) for i, p in enumerate(stats["ps"])]
    out = [
        _counter("closures_scheduled", "Functions scheduled (schedule(), Keras steps).", stats["scheduled"]),
        _gauge("closures_queued", "Scheduled functions waiting for a worker.", stats["queue_depth"]),
        _per_task(CounterMetricFamily, "closures_finished", "Functions that finished on the worker.",
                  workers, "done"),
        _per_task(CounterMetricFamily, "closures_failed", "Functions whose error reached their future.",
                  workers, "failed"),
        _per_task(CounterMetricFamily, "closures_retried", "Function runs cut off by a failure and run again.",
                  workers, "retried"),
        _per_task(GaugeMetricFamily, "closures_in_flight", "Functions running on the worker now.",
                  workers, "in_flight"),
        _per_task(GaugeMetricFamily, "worker_up", "1 while the worker takes work, 0 while it is out.",
                  [(t, {"up": int(w["up"])}) for t, w in workers], "up"),
        _per_task(GaugeMetricFamily, "ps_up", "1 while the ps task holds its variables, 0 while it is lost.",
                  [(t, {"up": int(p.get("up", True))}) for t, p in ps], "up"),
        _per_task(CounterMetricFamily, "worker_failures", "Times the worker was taken out (died, hung, cut off).",
                  workers, "failures"),
        _per_task(CounterMetricFamily, "ps_failures", "Times the ps task was lost.", ps, "failures"),
        _per_task(CounterMetricFamily, "ps_rolled_back_closures",
                  "Completed functions whose updates a ps recovery rolled back.", ps, "rolled_back_closures"),
        _recoveries(workers, ps),
        _latency(stats["workers"]),
        _staleness(stats["staleness"]),
        _counter("checkpoints_written", "Strategy checkpoints written.", stats["checkpoints_written"]),
    ]
    out += _checkpoint_times(stats.get("checkpoint", {}))
    out += _view_changes(stats.get("cluster_view"))
    if (stall := (stats.get("checkpoints") or {}).get("last_stall_seconds")) is not None:
        out.append(_gauge("checkpoint_last_stall_seconds",
                          "Seconds dispatch was paused for the newest checkpoint's cut.", stall))
    out += _data_ledgers(stats.get("data", {}).get("feeds", []))
    out += _dynamic_tables(stats.get("dynamic_embeddings", {}))
    if "embedding_stats_waiting" in stats:  # a scrape's (psclient._coordinator.scrapes)
        out.append(_gauge("embedding_stats_waiting",
                          "1 while the read of the DynamicEmbedding tables' counts waits on a ps that did not "
                          "answer within 0.5 s (a hung ps): the embedding families are left out.",
                          int(stats["embedding_stats_waiting"])))
    return out


def task_families(job: str, index: int) -> list:
    """A task server's own family (`psclient serve --metrics-port`): which task it is. Its memory
    and CPU come from the process collector every `MetricsServer` serves."""
    info = GaugeMetricFamily(_name("task_info"), "1: this process serves this task of the cluster.",
                             labels=["job", "task"])
    info.add_metric([job, f"{job}:{index}"], 1)
    return [info]


def evaluator_families(report: Any) -> list:
    """The sidecar evaluator's families (`psclient evaluate --metrics-port`), from its live report."""
    evaluations = list(report.evaluations)
    out = [
        _counter("evaluations", "Checkpoints evaluated.", len(evaluations)),
        _counter("evaluations_skipped", "Checkpoints passed over for a newer one.", len(report.skipped)),
        _counter("checkpoints_unreadable", "Checkpoints that could not be read.", len(report.unreadable)),
    ]
    if evaluations:
        newest = evaluations[-1]
        out.append(_gauge("evaluated_step", "Training step of the newest checkpoint evaluated.", newest["step"]))
        out.append(_gauge("evaluation_timestamp_seconds", "When the newest evaluation ended (Unix time).",
                          newest["time"]))
        metric = GaugeMetricFamily(_name("evaluation_metric"), "The newest evaluation's metrics, by name.",
                                   labels=["name"])
        for name, value in newest["metrics"].items():
            metric.add_metric([name], value)
        out.append(metric)
    return out


class MetricsServer:
    """Serves `collect()`'s families and the process's own on `port` until `close()`.

    `collect()` returns a list of families; it is called on the server's
    thread at each scrape, so it must not block for long. Owned by whoever
    starts it: `close()` stops and joins its thread (idempotent).
    """

    def __init__(self, port: int, collect: Callable[[], Iterable], *, host: str = "0.0.0.0"):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(collect))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and CPU seconds
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port

    def close(self) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        server.shutdown()
        server.server_close()
        self._thread.join(10)


class _Collector:
    def __init__(self, collect: Callable[[], Iterable]):
        self._collect = collect

    def collect(self):
        return list(self._collect())

    def describe(self):  # no fixed description: families depend on the run
        return []


def _name(short: str) -> str:
    return "psclient_" + short


def _counter(short: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(_name(short), documentation, value=value)


def _gauge(short: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(_name(short), documentation, value=value)


def _per_task(kind, short: str, documentation: str, tasks: list, key: str, labels=("task",)):
    family = kind(_name(short), documentation, labels=list(labels))
    for task, values in tasks:
        value = values.get(key)
        if value is not None:
            family.add_metric([task], value)
    return family


def _recoveries(workers: list, ps: list) -> CounterMetricFamily:
    family = CounterMetricFamily(_name("recoveries"), "Recoveries completed, by kind of task.", labels=["kind"])
    family.add_metric(["worker"], sum(w["rejoins"] for _, w in workers))
    family.add_metric(["ps"], sum(p["recoveries"] for _, p in ps))
    return family


def _buckets(bounds: tuple, cumulative: list) -> list:
    return [(_bound_text(b), count) for b, count in zip(bounds, cumulative)]


def _bound_text(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def _latency(workers: list) -> HistogramMetricFamily:
    """Seconds from a function's dispatch to its result, all workers together."""
    counts = [0] * len(LATENCY_BUCKETS)
    total = 0.0
    for w in workers:
        histogram = w.get("latency_histogram")
        if histogram:
            counts = [a + b for a, b in zip(counts, histogram["cumulative"])]
            total += histogram["sum"]
    family = HistogramMetricFamily(_name("closure_latency_seconds"),
                                   "Seconds from a function's dispatch to its result on a worker.")
    family.add_metric([], _buckets(LATENCY_BUCKETS, counts), sum_value=total)
    return family


def _staleness(staleness: dict) -> HistogramMetricFamily:
    histogram = staleness.get("histogram") or {"cumulative": [0] * len(STALENESS_BUCKETS), "sum": 0}
    family = HistogramMetricFamily(
        _name("update_staleness"),
        "Updates applied between a step's read of the model and its own update (measured steps only).")
    family.add_metric([], _buckets(STALENESS_BUCKETS, histogram["cumulative"]), sum_value=histogram["sum"])
    return family


def _checkpoint_times(checkpoint: dict) -> list:
    if not checkpoint:
        return []
    out = [_counter("checkpoint_seconds", "Seconds spent writing strategy checkpoints.",
                    checkpoint.get("seconds_total", 0.0))]
    if checkpoint.get("last_seconds") is not None:
        out.append(_gauge("checkpoint_last_duration_seconds", "Seconds the newest checkpoint took to write.",
                          checkpoint["last_seconds"]))
    if checkpoint.get("last_bytes") is not None:
        out.append(_gauge("checkpoint_last_bytes", "Bytes of the newest checkpoint's files.",
                          checkpoint["last_bytes"]))
    return out


def _view_changes(view: dict | None) -> list:
    """Changes of TF's view of the cluster (`psclient._core.view_changes`): none runs a step while under way."""
    if view is None:
        return []
    return [_counter("cluster_view_changes", "Changes of TensorFlow's view of the cluster (connects, reconnects) "
                     "that ended.", view["changes"]),
            _gauge("cluster_view_change_seconds", "Seconds the change of TensorFlow's view of the cluster under "
                   "way has waited (0: none); no step runs meanwhile.", view["changing_for_s"])]


def _data_ledgers(feeds: list) -> list:
    """Shards of each `psclient.data` feed (labelled by its order of creation), this epoch."""
    done = GaugeMetricFamily(_name("data_shards_done"), "Shards of a psclient.data feed trained this epoch.",
                             labels=["feed"])
    pending = GaugeMetricFamily(_name("data_shards_pending"),
                                "Shards of a psclient.data feed not yet trained this epoch.", labels=["feed"])
    for index, feed in enumerate(feeds):
        done.add_metric([str(index)], feed["done"])
        pending.add_metric([str(index)], feed["shards"] - feed["done"])
    return [done, pending]


def _dynamic_tables(tables: dict[str, Any]) -> list:
    rows = GaugeMetricFamily(_name("embedding_rows"), "Rows a DynamicEmbedding table holds on a ps task.",
                             labels=["layer", "task"])
    admissions = CounterMetricFamily(_name("embedding_admissions"), "Keys given a row on a ps task.",
                                     labels=["layer", "task"])
    evictions = CounterMetricFamily(_name("embedding_evictions"), "Rows freed on a ps task (LRU, age, restore).",
                                    labels=["layer", "task"])
    for layer, shards in tables.items():
        for shard in shards:
            if not shard.get("available", True) or shard.get("ps") is None:
                continue
            task = f"ps:{shard['ps']}"
            for family, key in ((rows, "rows"), (admissions, "admissions"), (evictions, "evictions")):
                if shard.get(key) is not None:
                    family.add_metric([layer, task], shard[key])
    return [rows, admissions, evictions]
