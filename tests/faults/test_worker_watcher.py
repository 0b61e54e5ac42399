"""`WorkerWatcher` and `kubernetes_workers` without a cluster: a fake strategy, a fake Kubernetes API."""

import gc
import importlib.util
import json
import logging
import threading
import types

import pytest

from psclient._cluster.k8s import K8sJob
from psclient._cluster.k8s_watch import kubernetes_workers, worker_labels
from psclient._cluster.spec import Cluster
from psclient._engine.watch import WorkerWatcher
from psclient._core.errors import ClusterConfigError, StrategyClosedError, TaskUnreachableError

PS = ["10.0.0.9:2222"]


class FakeStrategy:
    """What the watcher uses of a strategy: cluster.ps, workers, closed, add/remove_worker."""

    def __init__(self, workers):
        self.slots = list(workers)
        self.retired = set()
        self.cluster = types.SimpleNamespace(ps=tuple(PS))
        self.closed = False
        self.calls = []
        self.unreachable = set()

    @property
    def workers(self):
        return {i: a for i, a in enumerate(self.slots) if i not in self.retired}

    def add_worker(self, address):
        if self.closed:
            raise StrategyClosedError("closed")
        self.calls.append(("add", address))
        if address in self.unreachable:
            raise TaskUnreachableError(f"nothing accepted a connection at {address}")
        if address in self.slots:
            self.retired.discard(self.slots.index(address))
            return self.slots.index(address)
        self.slots.append(address)
        return len(self.slots) - 1

    def remove_worker(self, index, drain=True):
        self.calls.append(("remove", index, drain))
        self.retired.add(index)


def write(path, workers, ps=PS, tf_config=True):
    jobs = {"worker": workers, "ps": ps, "chief": ["10.0.0.1:2222"]}
    path.write_text(json.dumps({"cluster": jobs, "task": {"type": "chief", "index": 0}} if tf_config else jobs))


def test_workers_that_appear_are_added_first_then_those_that_vanish_removed(tmp_path):
    path = tmp_path / "cluster.json"
    write(path, ["w0:1", "w1:1"])
    strategy = FakeStrategy(["w0:1", "w1:1"])
    watcher = WorkerWatcher(strategy, path, drain=False)
    assert watcher.poll() == {"added": [], "removed": [], "error": None}
    assert strategy.calls == []
    write(path, ["w1:1", "w2:1", "w3:1"], tf_config=False)  # the jobs alone are accepted too
    assert watcher.poll() == {"added": [2, 3], "removed": [0], "error": None}
    assert strategy.calls == [("add", "w2:1"), ("add", "w3:1"), ("remove", 0, False)]
    assert [(kind, index, address) for _, kind, index, address in watcher.changes] == [
        ("added", 2, "w2:1"), ("added", 3, "w3:1"), ("removed", 0, "w0:1")]
    write(path, ["w1:1", "w2:1", "w3:1", "w0:1"])  # an address that left comes back: its slot
    assert watcher.poll()["added"] == [0]


@pytest.mark.parametrize("content, message", [
    ("{\"cluster\": {\"worker\": [\"w0:1\"", "is not valid JSON"),
    ("[1, 2]", "Expected a JSON object"),
    (json.dumps({"cluster": {"worker": ["w0"], "ps": PS}}), "Invalid address for task worker:0"),
    (json.dumps({"cluster": {"worker": ["w9:1"], "ps": ["other:1"]}}), "ps tasks cannot change"),
    (None, "Cannot read cluster file"),
])
def test_bad_content_is_logged_once_and_the_workers_stay(tmp_path, caplog, content, message):
    path = tmp_path / "cluster.json"
    strategy = FakeStrategy(["w0:1", "w1:1"])
    watcher = WorkerWatcher(strategy, path)
    if content is not None:
        path.write_text(content)
    with caplog.at_level(logging.ERROR, logger="psclient"):
        first, second = watcher.poll(), watcher.poll()
    assert message in first["error"] and str(path) in first["error"]
    assert second["error"] == first["error"] == watcher.last_error
    assert strategy.calls == [] and strategy.workers == {0: "w0:1", 1: "w1:1"}
    logged = [r.getMessage() for r in caplog.records if "worker watcher" in r.getMessage()]
    assert len(logged) == 1 and message in logged[0] and "the workers stay as they are" in logged[0]
    write(path, ["w0:1", "w1:1", "w2:1"])  # fixed: applied, and the error cleared
    assert watcher.poll() == {"added": [2], "removed": [], "error": None}
    assert watcher.last_error is None


def test_an_add_that_fails_is_tried_again_at_the_next_poll(tmp_path):
    path = tmp_path / "cluster.json"
    write(path, ["w0:1", "w1:1"])
    strategy = FakeStrategy(["w0:1"])
    strategy.unreachable.add("w1:1")
    watcher = WorkerWatcher(strategy, path)
    result = watcher.poll()
    assert result["added"] == [] and "adding w1:1: nothing accepted a connection" in result["error"]
    strategy.unreachable.clear()
    assert watcher.poll() == {"added": [1], "removed": [], "error": None}


def test_a_callable_source_and_its_failures():
    answers = [["a:1", "b:1"], RuntimeError("API down"), ["b:1"], [], ["b:1", "b:1"], [7]]

    def source():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    strategy = FakeStrategy(["a:1"])
    watcher = WorkerWatcher(strategy, source)
    assert watcher.poll()["added"] == [1]
    assert "failed: RuntimeError: API down" in watcher.poll()["error"]
    assert watcher.poll()["removed"] == [0]
    assert "names no worker" in watcher.poll()["error"]
    assert "Expected distinct 'host:port' strings" in watcher.poll()["error"]
    assert "Expected distinct 'host:port' strings" in watcher.poll()["error"]
    assert strategy.workers == {1: "b:1"}


def test_the_thread_polls_until_stopped_and_ends_with_the_strategy(tmp_path):
    path = tmp_path / "cluster.json"
    write(path, ["w0:1"])
    strategy = FakeStrategy(["w0:1"])
    polled = threading.Event()
    watcher = WorkerWatcher(strategy, path, interval=0.01)
    original = watcher.poll

    def poll():
        result = original()
        if result["added"]:
            polled.set()
        return result

    watcher.poll = poll  # before the thread starts: every poll it makes is seen
    with watcher:
        write(path, ["w0:1", "w1:1"])
        assert polled.wait(10)
        assert watcher.running
        with pytest.raises(RuntimeError, match="started already"):
            watcher.start()
    assert not watcher.running
    # A strategy shut down ends the thread by itself.
    watcher = WorkerWatcher(strategy, path, interval=0.01).start()
    strategy.closed = True
    assert watcher.join(10)
    # So does a strategy collected (the thread holds it weakly).
    other = FakeStrategy(["w0:1"])
    watcher = WorkerWatcher(other, path, interval=0.01).start()
    del other
    gc.collect()
    assert watcher.join(10)


def test_bad_arguments():
    strategy = FakeStrategy(["w0:1"])
    with pytest.raises(TypeError, match="`source`"):
        WorkerWatcher(strategy, 42)
    with pytest.raises(ValueError, match="`interval`"):
        WorkerWatcher(strategy, "x.json", interval=0)
    with pytest.raises(TypeError, match="`drain`"):
        WorkerWatcher(strategy, "x.json", drain="no")


def test_cluster_from_file_names_the_file(tmp_path):
    path = tmp_path / "c.json"
    write(path, ["w0:1"])
    assert Cluster.from_file(path).workers == ("w0:1",)
    write(path, ["w0:1"], tf_config=False)
    assert Cluster.from_file(str(path)).ps == tuple(PS)
    path.write_text("nope")
    with pytest.raises(ClusterConfigError, match="c.json.*not valid JSON"):
        Cluster.from_file(path)


# ------------------------------------------------------------- Kubernetes
def pod(name, phase="Running", ready=True, deleting=False):
    conditions = [types.SimpleNamespace(type="Ready", status="True" if ready else "False")]
    return types.SimpleNamespace(
        metadata=types.SimpleNamespace(name=name, deletion_timestamp="now" if deleting else None),
        status=types.SimpleNamespace(phase=phase, conditions=conditions))


class FakeCoreV1Api:
    def __init__(self, pods):
        self.pods = pods
        self.asked = []

    def list_namespaced_pod(self, namespace, label_selector):
        self.asked.append((namespace, label_selector))
        return types.SimpleNamespace(items=list(self.pods))


def test_kubernetes_workers_lists_the_ready_worker_pods_by_their_stable_names():
    api = FakeCoreV1Api([
        pod("mnist-worker-10"), pod("mnist-worker-2"), pod("mnist-worker-0"),
        pod("mnist-worker-3", phase="Pending"), pod("mnist-worker-4", ready=False),
        pod("mnist-worker-5", deleting=True),
    ])
    source = kubernetes_workers("mnist", namespace="training", port=2223, api=api)
    assert source() == ["mnist-worker-0.mnist:2223", "mnist-worker-2.mnist:2223", "mnist-worker-10.mnist:2223"]
    namespace, selector = api.asked[0]
    assert namespace == "training"
    assert dict(item.split("=") for item in selector.split(",")) == worker_labels("mnist")
    # The names and labels `psclient k8s` gives the same job.
    job = K8sJob(name="mnist", image="img:1", command=["python", "train.py"], workers=2, ps=1, port=2223)
    assert worker_labels("mnist") == job.labels("worker")
    assert source()[0] == f"{job.host('worker', 0)}:2223"
    # A WorkerWatcher takes it as its source.
    strategy = FakeStrategy(["mnist-worker-0.mnist:2223"])
    assert WorkerWatcher(strategy, source).poll()["added"] == [1, 2]


def test_kubernetes_workers_bad_arguments_and_missing_package():
    with pytest.raises(ValueError, match="`name`"):
        kubernetes_workers("", api=FakeCoreV1Api([]))
    with pytest.raises(ValueError, match="`port`"):
        kubernetes_workers("job", port=0, api=FakeCoreV1Api([]))
    if importlib.util.find_spec("kubernetes") is not None:
        pytest.skip("the kubernetes package is installed: the missing-package error cannot be shown")
    with pytest.raises(ImportError, match="pip install kubernetes"):
        kubernetes_workers("job")
