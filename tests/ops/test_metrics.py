"""Prometheus metrics: the families a strategy's stats make, and a real Prometheus scraping a training run.

The scrape test starts Debian's `prometheus` (`.ci/run` installs it) on
loopback with a scrape interval of 1 s, points it at a strategy's
`metrics_port`, and asks its HTTP API what it stored: the finished closures
rise, and a worker SIGKILLed mid-run shows as down. Where no `prometheus`
binary can be found the test is skipped, with the reason printed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import weakref
from types import SimpleNamespace

import portpicker
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from psclient import StrategyConfig
from psclient._core.staleness import StalenessStats
from psclient._core.worker_stats import WorkerStats
from psclient._core.metrics import MetricsServer, families


def _stats(**extra) -> dict:
    worker = WorkerStats()
    for seconds in (0.004, 0.02, 0.3):
        worker.record_latency(seconds)
    worker.done, worker.retried = 3, 1
    down = WorkerStats(up=False, failures=2, rejoins=1)
    staleness = StalenessStats(2)
    for value in (0, 1, 5):
        staleness.applied(0, value)
    stats = {
        "scheduled": 5, "queue_depth": 1,
        "workers": [worker.summary(in_flight=1), down.summary(in_flight=0)],
        "ps": [{"failures": 1, "recoveries": 1, "last_recovery_s": 0.5, "rolled_back_closures": 7, "up": True}],
        "checkpoints_written": 2, "staleness": staleness.summary(),
        "checkpoint": {"seconds_total": 1.5, "last_seconds": 0.5, "last_bytes": 4096},
        "checkpoints": {"last_stall_seconds": 0.03},
        "data": {"feeds": [{"shards": 8, "done": 3}]},
        "cluster_view": {"changes": 4, "slow_changes": 1, "longest_s": 12.0, "changing_for_s": 31.5,
                         "changing_tasks": ["ps:0", "worker:0"]},
        "dynamic_embeddings": {"user": [{"ps": 0, "rows": 10, "admissions": 12, "evictions": 2},
                                        {"ps": 1, "available": False, "error": "AbortedError"}]},
    }
    stats.update(extra)
    return stats


def _scraped(stats: dict) -> dict:
    """{(sample name, labels as a sorted tuple): value} of the text a scrape of `stats` returns."""
    return _samples(families(stats))


def _samples(found: list) -> dict:
    """{(sample name, labels as a sorted tuple): value} of the text a scrape of `found` returns."""
    registry = CollectorRegistry(auto_describe=False)

    class Once:
        def collect(self):
            return found

    registry.register(Once())
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_families_follow_prometheus_naming_and_carry_the_counts():
    samples = _scraped(_stats())
    assert samples[("psclient_closures_scheduled_total", ())] == 5
    assert samples[("psclient_closures_finished_total", (("task", "worker:0"),))] == 3
    assert samples[("psclient_closures_retried_total", (("task", "worker:0"),))] == 1
    assert samples[("psclient_worker_up", (("task", "worker:0"),))] == 1
    assert samples[("psclient_worker_up", (("task", "worker:1"),))] == 0
    assert samples[("psclient_ps_up", (("task", "ps:0"),))] == 1
    assert samples[("psclient_recoveries_total", (("kind", "worker"),))] == 1
    assert samples[("psclient_recoveries_total", (("kind", "ps"),))] == 1
    assert samples[("psclient_ps_rolled_back_closures_total", (("task", "ps:0"),))] == 7
    assert samples[("psclient_closure_latency_seconds_count", ())] == 3
    assert samples[("psclient_closure_latency_seconds_bucket", (("le", "0.005"),))] == 1
    assert samples[("psclient_closure_latency_seconds_bucket", (("le", "+Inf"),))] == 3
    assert samples[("psclient_closure_latency_seconds_sum", ())] == pytest.approx(0.324)
    assert samples[("psclient_update_staleness_bucket", (("le", "1.0"),))] == 2
    assert samples[("psclient_update_staleness_count", ())] == 3
    assert samples[("psclient_checkpoint_seconds_total", ())] == 1.5
    assert samples[("psclient_checkpoint_last_bytes", ())] == 4096
    assert samples[("psclient_checkpoint_last_stall_seconds", ())] == 0.03
    assert samples[("psclient_data_shards_pending", (("feed", "0"),))] == 5
    assert samples[("psclient_cluster_view_changes_total", ())] == 4
    assert samples[("psclient_cluster_view_change_seconds", ())] == 31.5  # no step runs meanwhile
    assert samples[("psclient_embedding_rows", (("layer", "user"), ("task", "ps:0")))] == 10
    assert samples[("psclient_embedding_admissions_total", (("layer", "user"), ("task", "ps:0")))] == 12
    # A ps that cannot be read now is left out, not reported as empty.
    assert ("psclient_embedding_rows", (("layer", "user"), ("task", "ps:1"))) not in samples
    for name, _labels in samples:
        assert name.startswith("psclient_"), name


def test_metrics_server_serves_its_families_and_the_process_memory_and_closes():
    server = MetricsServer(0, lambda: families(_stats()), host="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as response:
            text = response.read().decode()
        assert "psclient_closures_finished_total" in text
        assert "process_resident_memory_bytes" in text
    finally:
        server.close()
        server.close()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5)


@pytest.mark.parametrize("port", [-1, 70000, "9100", 1.5, True])
def test_a_bad_metrics_port_is_refused_naming_it(port):
    with pytest.raises(ValueError, match=r"metrics_port.*Received: metrics_port="):
        StrategyConfig(metrics_port=port)


# ---------------------------------------------------------------- a scrape beside a hung ps


class _Table:
    """A DynamicEmbedding table whose ps answers the read of its counts once `gate` opens."""

    name = "user"
    shards = [SimpleNamespace(device="/job:ps/replica:0/task:0/device:CPU:0")]

    def __init__(self):
        self.gate = threading.Event()
        self.reads = 0

    @staticmethod
    def owner():
        return None  # no strategy: the read runs as it is (`ps_state.on_ps`)

    def shard_stats(self, index):
        self.reads += 1
        self.gate.wait(60)
        return {"ps": index, "rows": 10, "admissions": 12, "evictions": 2}


class _Strategy:
    """What a scrape reads of a strategy: `closed`, `stats(read_ps=False)` and its tables."""

    closed = False

    def __init__(self, table: _Table, ps_up: bool = True):
        self.parts = SimpleNamespace(store=SimpleNamespace(tables=lambda: {"table/0000": table}),
                                     engine=SimpleNamespace(published=SimpleNamespace(ps_down=frozenset())))
        self.ps_up = ps_up

    def stats(self, *, read_ps=True):
        assert read_ps is False  # the tables are the scrape's own read
        stats = _stats()
        stats["ps"][0]["up"] = self.ps_up
        stats.pop("dynamic_embeddings")
        return stats


TABLE_STATS_THREAD = "psclient-table-stats"
ROWS = ("psclient_embedding_rows", (("layer", "user"), ("task", "ps:0")))
WAITING = ("psclient_embedding_stats_waiting", ())


def test_a_scrape_reads_the_tables_counts_when_the_ps_answers():
    from psclient._coordinator.scrapes import ScrapeSource

    table = _Table()
    table.gate.set()
    strategy = _Strategy(table)
    source = ScrapeSource(weakref.ref(strategy))
    samples = _samples(source())
    assert samples[ROWS] == 10 and samples[WAITING] == 0
    source.close()
    strategy.closed = True
    assert source() == []


def test_a_scrape_beside_a_hung_ps_is_served_without_the_tables_and_reads_them_once():
    """A hung ps answers the tables' read only when it resumes: the scrape used to wait as long
    (the coordinator's target down past Prometheus's timeout, one more waiting thread a scrape)."""
    from psclient._coordinator.scrapes import ScrapeSource

    table = _Table()
    strategy = _Strategy(table)
    source = ScrapeSource(weakref.ref(strategy), wait_s=0.05)
    try:
        for _scrape in range(3):
            samples = _samples(source())
            assert samples[WAITING] == 1 and ROWS not in samples
            assert samples[("psclient_worker_up", (("task", "worker:0"),))] == 1  # the rest is served
        assert table.reads == 1  # one read waits on the ps, not one per scrape
        assert [t.name for t in threading.enumerate()].count(TABLE_STATS_THREAD) == 1
    finally:
        table.gate.set()  # the ps answers
        source.close()
    assert not any(t.name == TABLE_STATS_THREAD for t in threading.enumerate())
    samples = _samples(source())
    assert samples[ROWS] == 10 and samples[WAITING] == 0 and table.reads == 2
    source.close()


def test_a_scrape_while_a_ps_is_lost_does_not_read_the_tables():
    from psclient._coordinator.scrapes import ScrapeSource

    table = _Table()
    strategy = _Strategy(table, ps_up=False)
    source = ScrapeSource(weakref.ref(strategy), wait_s=0.05)
    samples = _samples(source())
    assert table.reads == 0 and WAITING not in samples and ROWS not in samples
    assert samples[("psclient_ps_up", (("task", "ps:0"),))] == 0


# ---------------------------------------------------------------- real Prometheus

PROMETHEUS = shutil.which("prometheus")


class Prometheus:
    """A Prometheus server on loopback scraping `targets` every second; its owner stops it."""

    def __init__(self, targets: list[str], directory):
        self.port = portpicker.pick_unused_port()
        config = directory / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{"job_name": "psclient", "static_configs": [{"targets": targets}]}],
        }))
        self.process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )

    def query(self, expression: str) -> list:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())["data"]["result"]

    def value(self, expression: str) -> float | None:
        try:
            result = self.query(expression)
        except OSError:  # not listening yet
            return None
        return float(result[0]["value"][1]) if result else None

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)


def _wait_value(prometheus: Prometheus, expression: str, accept, limit: float, what: str) -> float:
    deadline = time.monotonic() + limit
    value = None
    while time.monotonic() < deadline:
        value = prometheus.value(expression)
        if value is not None and accept(value):
            return value
        if prometheus.process.poll() is not None:
            pytest.fail(f"prometheus exited: {prometheus.process.stderr.read().decode()[-2000:]}")
        time.sleep(0.25)  # polling an external server's query API, bounded by `limit`
    pytest.fail(f"{what}: {expression} was {value} after {limit} s")


@pytest.mark.cluster
@pytest.mark.timeout(300)
@pytest.mark.skipif(PROMETHEUS is None, reason="no `prometheus` binary (Debian's package `prometheus`; "
                                               ".ci/run installs it where apt-get can)")
def test_a_real_prometheus_scrapes_a_training_run_and_sees_a_killed_worker_down(three_workers_one_ps, tmp_path):
    import tensorflow as tf

    import psclient

    cluster = three_workers_one_ps
    strategy = psclient.ParameterServerStrategy(cluster.cluster, metrics_port=0, hang_timeout=5)
    prometheus = Prometheus([f"127.0.0.1:{strategy.metrics_port}"], tmp_path)
    stop = threading.Event()
    errors: list = []
    try:
        with strategy.scope():
            count = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def step():
            count.assign_add(1)
            return count.read_value()

        def train():  # closures keep finishing while the test reads Prometheus
            try:
                while not stop.is_set():
                    for _ in range(20):
                        strategy.schedule(step)
                    strategy.join(timeout=120)
            except Exception as error:  # noqa: BLE001 - reported by the test below
                errors.append(error)

        trainer = threading.Thread(target=train, name="test-trainer")
        trainer.start()
        finished = "sum(psclient_closures_finished_total)"
        first = _wait_value(prometheus, finished, lambda v: v > 0, 120, "closures finished, scraped")
        _wait_value(prometheus, finished, lambda v: v > first, 60, "finished closures rising")
        assert _wait_value(prometheus, 'psclient_worker_up{task="worker:1"}', lambda v: v == 1, 60,
                           "worker 1 up") == 1

        views = _wait_value(prometheus, "psclient_cluster_view_changes_total", lambda v: v >= 1, 60,
                            "this coordinator's connect counted")
        cluster.kill("worker", 1)
        _wait_value(prometheus, 'psclient_worker_up{task="worker:1"}', lambda v: v == 0, 120,
                    "the killed worker down")
        _wait_value(prometheus, "psclient_cluster_view_changes_total", lambda v: v > views, 120,
                    "the reconnect without the killed worker counted")
        assert _wait_value(prometheus, 'sum(psclient_worker_up)', lambda v: v == 2, 60, "two workers up") == 2
        assert _wait_value(prometheus, 'psclient_worker_failures_total{task="worker:1"}', lambda v: v >= 1, 60,
                           "the failure counted") >= 1
        assert prometheus.value("process_resident_memory_bytes") > 0
        stop.set()
        trainer.join(180)
        assert not trainer.is_alive() and not errors, errors
    finally:
        stop.set()
        prometheus.close()
        strategy.shutdown()
        cluster.restart("worker", 1)


@pytest.mark.cluster
@pytest.mark.timeout(300)
@pytest.mark.skipif(PROMETHEUS is None, reason="no `prometheus` binary (Debian's package `prometheus`; "
                                               ".ci/run installs it where apt-get can)")
def test_a_real_prometheus_keeps_scraping_the_coordinator_while_a_ps_hangs(three_workers_one_ps, tmp_path):
    """The ps holding a DynamicEmbedding table SIGSTOPped: each scrape read the table's counts and
    waited for the ps past the scrape timeout, so the coordinator's target went down. Now the
    scrapes go on (without the table's families, `psclient_embedding_stats_waiting` 1)."""
    import keras
    import numpy as np
    from _stopped import stopped

    import psclient
    from psclient.layers import DynamicEmbedding

    cluster = three_workers_one_ps
    strategy = psclient.ParameterServerStrategy(cluster.cluster, metrics_port=0, hang_timeout=5)
    prometheus = None
    try:
        with strategy.scope():
            keys = keras.Input((), dtype="int64")
            model = keras.Model(keys, keras.layers.Dense(1)(DynamicEmbedding(4, capacity=1000, name="ids")(keys)))
            model.compile(optimizer="sgd", loss="mse")
        model.fit(np.arange(128, dtype="int64"), np.ones(128, "float32"), batch_size=32, verbose=0)
        prometheus = Prometheus([f"127.0.0.1:{strategy.metrics_port}"], tmp_path)
        rows = 'sum(psclient_embedding_rows{layer="ids"})'
        before = _wait_value(prometheus, rows, lambda v: v > 0, 120, "the table's rows, scraped")
        with stopped(cluster, "ps", 0, watchdog_s=120):
            _wait_value(prometheus, "psclient_embedding_stats_waiting", lambda v: v == 1, 60,
                        "the scrape waiting for the hung ps's counts")
            # Three scrapes in a row (one a second) served while the ps hangs, and none failed.
            _wait_value(prometheus, "sum_over_time(psclient_embedding_stats_waiting[4s])", lambda v: v >= 3, 60,
                        "scrapes served while the ps hangs")
            assert prometheus.value('min_over_time(up{job="psclient"}[4s])') == 1
        _wait_value(prometheus, "psclient_embedding_stats_waiting", lambda v: v == 0, 60, "the counts read again")
        assert _wait_value(prometheus, rows, lambda v: v > 0, 60, "the table's rows, again") == before
    finally:
        if prometheus is not None:
            prometheus.close()
        strategy.shutdown()


def test_evaluator_families_carry_the_newest_evaluation():
    from psclient._sidecar.evaluator import SidecarReport

    from psclient._core.metrics import evaluator_families

    report = SidecarReport([], ["ckpt-1"], [], stop_reason="")
    report.evaluations += [{"checkpoint": "ckpt-2", "step": 20, "metrics": {"loss": 0.5}, "time": 100.0},
                           {"checkpoint": "ckpt-3", "step": 30, "metrics": {"loss": 0.25, "accuracy": 0.9},
                            "time": 200.0}]
    registry = CollectorRegistry(auto_describe=False)

    class Once:
        def collect(self):
            return evaluator_families(report)

    registry.register(Once())
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert samples[("psclient_evaluations_total", ())] == 2
    assert samples[("psclient_evaluations_skipped_total", ())] == 1
    assert samples[("psclient_evaluated_step", ())] == 30
    assert samples[("psclient_evaluation_metric", (("name", "accuracy"),))] == 0.9
    assert samples[("psclient_evaluation_metric", (("name", "loss"),))] == 0.25


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_psclient_serve_metrics_port_serves_the_tasks_memory(tmp_path):
    import sys

    ports = [portpicker.pick_unused_port() for _ in range(4)]
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps({"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"],
                                        "worker": [f"127.0.0.1:{ports[3]}"]}))
    task = subprocess.Popen([sys.executable, "-m", "psclient", "serve", "--job", "ps", "--index", "0",
                             "--cluster", str(cluster_file), "--metrics-port", str(ports[2])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, text = time.monotonic() + 120, None
        while time.monotonic() < deadline and task.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ports[2]}/metrics", timeout=5) as response:
                    text = response.read().decode()
                break
            except OSError:
                time.sleep(0.25)  # polling the starting task's port, bounded by the deadline
        assert text is not None, f"no metrics served: {task.stderr.read().decode()[-2000:] if task.poll() else ''}"
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples[("psclient_task_info", (("job", "ps"), ("task", "ps:0")))] == 1
        assert samples[("process_resident_memory_bytes", ())] > 10 * 2**20
    finally:
        task.terminate()
        task.wait(60)
