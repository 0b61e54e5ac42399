"""Workers that join and leave a running strategy (`add_worker` / `remove_worker`), real processes.

One LocalCluster for the module; it grows with `LocalCluster.add_worker`.
Each test makes its strategy from the workers running then (a removed
worker's process may have been ended), and leaves at least two running.
"""

import collections
import logging
import json
import threading

import numpy as np
import pytest
import tensorflow as tf
from _polling import wait_for

import psclient

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def local():
    with psclient.LocalCluster(num_workers=2, num_ps=1) as cluster:
        yield cluster


def running_cluster(local, at_least=2):
    """The cluster of the workers running now (dead ones restarted until `at_least` run)."""
    workers = [i for i in range(local.cluster.num_workers) if local.is_running("worker", i)]
    for i in range(local.cluster.num_workers):
        if len(workers) >= at_least:
            break
        if i not in workers:
            local.restart("worker", i)
            workers.append(i)
    jobs = local.cluster.jobs
    jobs["worker"] = [local.cluster.address("worker", i) for i in sorted(workers)]
    return psclient.Cluster(jobs)


class Resolutions:
    """How many times each future resolved (done-callbacks run once per resolution)."""

    def __init__(self):
        self.counts = collections.Counter()
        self._lock = threading.Lock()

    def watch(self, future):
        def count(_future):
            with self._lock:
                self.counts[id(future)] += 1

        future.add_done_callback(count)
        return future


def test_bad_arguments_are_refused_with_the_argument_named(local):
    cluster = running_cluster(local)
    strategy = psclient.ParameterServerStrategy(cluster, connect_timeout=2.0)
    try:
        first = strategy.cluster.workers[0]
        cases = [
            (lambda: strategy.add_worker(2222), TypeError, "`address`.*Received: address=2222"),
            (lambda: strategy.add_worker("no-port"), ValueError, "`address`.*no ':port' part"),
            (lambda: strategy.add_worker("127.0.0.1:99999"), ValueError, "`address`.*port '99999'"),
            (lambda: strategy.add_worker(first), ValueError, "`address`.*already the address of worker 0"),
            (lambda: strategy.add_worker(cluster.ps[0]), ValueError, "already the address of task ps:0"),
            (lambda: strategy.remove_worker(7), ValueError, "`index_or_address`.*not a worker of this"),
            (lambda: strategy.remove_worker("127.0.0.1:1"), ValueError, "`index_or_address`.*not a worker"),
            (lambda: strategy.remove_worker(1.0), TypeError, "`index_or_address`.*of type float"),
            (lambda: strategy.remove_worker(True), TypeError, "`index_or_address`.*of type bool"),
            (lambda: strategy.remove_worker(0, drain="yes"), TypeError, "`drain`.*drain='yes'"),
        ]
        for call, error, message in cases:
            with pytest.raises(error, match=message):
                call()
        # Nothing listens at a port just freed: refused within connect_timeout.
        free = f"127.0.0.1:{__import__('portpicker').pick_unused_port()}"
        with pytest.raises(psclient.TaskUnreachableError, match="nothing accepted a connection"):
            strategy.add_worker(free)
        assert strategy.workers == dict(enumerate(cluster.workers))  # nothing changed
        strategy.remove_worker(1)
        with pytest.raises(ValueError, match="the last worker of the strategy"):
            strategy.remove_worker(0)
        with pytest.raises(ValueError, match="not a worker of this strategy"):
            strategy.remove_worker(1)  # removed already
        assert strategy.num_workers == 1 and strategy.cluster.num_workers == 2
    finally:
        strategy.shutdown()
    with pytest.raises(psclient.StrategyClosedError):
        strategy.add_worker(first)


@pytest.mark.long
def test_schedule_loop_while_a_worker_joins_and_others_leave(local):
    cluster = running_cluster(local)
    strategy = psclient.ParameterServerStrategy(cluster, hang_timeout=20.0)
    try:
        with strategy.scope():
            count = tf.Variable(0, dtype=tf.int64)
        handle = count.handle
        # Each worker reads its shard of 0, 1, 2, ...: input_pipeline_id is its index; a
        # worker that joins later reads the shard of its index modulo the pipelines (2).
        per_worker = strategy.distribute_datasets_from_function(
            lambda ctx: tf.data.Dataset.range(10**9).shard(ctx.num_input_pipelines, ctx.input_pipeline_id))
        iterator = iter(per_worker)

        @tf.function
        def step(iterator):
            count.assign_add(1)
            x = tf.random.uniform([64, 64])
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            return next(iterator), worker, tf.reduce_sum(tf.linalg.matmul(x, x))

        seen = Resolutions()
        futures = []
        stop = threading.Event()

        def scheduling():
            while not stop.is_set():
                futures.append(seen.watch(strategy.schedule(step, args=(iterator,))))
                if len(futures) % 20 == 0:
                    psclient.wait(futures[-20:], timeout=60)  # keep the queue short

        # The new task's process starts first: TF's import takes seconds of CPU, which a busy
        # 2-core machine may not give it while the loop runs. It joins the strategy during the loop.
        new = local.add_worker()
        loop = threading.Thread(target=scheduling)
        loop.start()
        try:
            wait_for(lambda: len(futures) >= 40, 60, "scheduling under way")
            index = strategy.add_worker(local.cluster.address("worker", new))
            assert index == 2 and strategy.num_workers == 3
            wait_for(lambda: strategy.stats()["workers"][2]["done"] >= 5, 60, "the new worker to take work")
            # Drain: what runs on worker 0 finishes there; it is then out of TF's view.
            strategy.remove_worker(0, drain=True)
            ended = local.pid("worker", 0)
            local.kill("worker", 0)  # its process may go now
            done_by_0 = strategy.stats()["workers"][0]["done"]
            n = len(futures)
            wait_for(lambda: len(futures) >= n + 40, 60, "more steps after the drain")
        finally:
            stop.set()
            loop.join(120)
        strategy.join(timeout=120)
        assert ended is not None
        stats = strategy.stats()
        assert stats["workers"][0]["retired"] and stats["workers"][0]["done"] == done_by_0
        assert stats["workers"][2]["done"] > 5 and not stats["workers"][2]["retired"]
        # Every future resolved exactly once, with a value; the counter on the ps is exact.
        assert all(f.done() and f.exception() is None for f in futures)
        assert len(seen.counts) == len(futures) and set(seen.counts.values()) == {1}
        assert int(count.numpy()) == len(futures)
        assert count.handle is handle  # the ps variable was never created again
        read = collections.defaultdict(list)
        for f in futures:
            read[int(f.result()[1])].append(int(f.result()[0]))
        assert set(read) == {0, 1, 2}
        for worker, values in read.items():  # each from its own iterator: no element twice
            assert len(set(values)) == len(values)
            assert {v % 2 for v in values} == {worker % 2}

        # No drain: worker 1 leaves while busy; its closures run again on worker 2.
        before = len(futures)
        batch = [seen.watch(strategy.schedule(step, args=(iterator,))) for _ in range(60)]
        wait_for(lambda: strategy.stats()["workers"][1]["in_flight"] > 0, 60, "worker 1 busy")
        strategy.remove_worker(1, drain=False)
        strategy.join(timeout=120)
        handed_back = strategy.stats()["workers"][1]["retried"]
        assert all(f.done() and f.exception() is None for f in batch)
        assert set(seen.counts.values()) == {1} and len(seen.counts) == before + 60
        # A closure handed back may have counted before its call was cancelled: at most once more.
        assert before + 60 <= int(count.numpy()) <= before + 60 + handed_back
        assert strategy.workers == {2: local.cluster.address("worker", new)}
    finally:
        strategy.shutdown()


def test_a_removed_address_added_again_gets_its_slot_and_new_per_worker_values(local):
    cluster = running_cluster(local)
    strategy = psclient.ParameterServerStrategy(cluster)
    try:
        with strategy.scope():
            total = tf.Variable(0, dtype=tf.int64)
        calls = strategy.create_per_worker_resource(lambda: tf.Variable(0, dtype=tf.int64))

        @tf.function
        def step(calls):
            calls.assign_add(1)
            total.assign_add(1)
            return calls.read_value()

        psclient.wait([strategy.schedule(step, args=(calls,)) for _ in range(20)], timeout=120)
        address = strategy.cluster.workers[1]
        strategy.remove_worker(address)
        local_index = local.cluster.workers.index(address)
        local.restart("worker", local_index)  # a new process at the same address
        assert strategy.add_worker(address) == 1
        assert strategy.workers == dict(enumerate(cluster.workers))
        strategy.remove_worker(0)  # only the returning worker takes work now
        results = [strategy.schedule(step, args=(calls,)).result(60) for _ in range(5)]
        # Its per-worker variable was made again on the new process: counting starts over.
        assert results == [1, 2, 3, 4, 5]
        assert int(total.numpy()) == 25
        assert strategy.stats()["workers"][1]["rejoins"] == 0
    finally:
        strategy.shutdown()


def test_keras_fit_goes_on_while_a_worker_joins_and_one_leaves(local):
    keras = pytest.importorskip("keras")
    cluster = running_cluster(local)
    strategy = psclient.ParameterServerStrategy(cluster)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32")
    try:
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(2)])
            model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
        changes = {}
        new = local.add_worker()  # its process starts before fit (see the schedule loop test)

        class Elastic(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch == 0:
                    changes["added"] = strategy.add_worker(local.cluster.address("worker", new))
                elif epoch == 1:
                    changes["removed"] = 0
                    strategy.remove_worker(0, drain=True)

        steps, epochs = 30, 4
        history = model.fit(x, y, batch_size=32, epochs=epochs, steps_per_epoch=steps, verbose=0,
                            callbacks=[Elastic()])
        assert int(model.optimizer.iterations.numpy()) == steps * epochs  # no step lost or doubled
        assert len(history.history["loss"]) == epochs
        assert history.history["loss"][-1] < history.history["loss"][0]
        workers = strategy.stats()["workers"]
        added = changes["added"]
        assert workers[added]["done"] > 0 and workers[0]["retired"]
        assert sorted(strategy.workers) == sorted({*range(cluster.num_workers), added} - {0})
    finally:
        strategy.shutdown()


def test_a_watched_cluster_file_adds_and_removes_workers(local, tmp_path):
    cluster = running_cluster(local)
    strategy = psclient.ParameterServerStrategy(cluster)
    path = tmp_path / "cluster.json"

    def write(workers, text=None):
        jobs = dict(cluster.jobs, worker=workers)
        path.write_text(text if text is not None else json.dumps({"cluster": jobs}))

    try:
        with strategy.scope():
            count = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def step():
            count.assign_add(1)

        write(list(cluster.workers))
        with psclient.WorkerWatcher(strategy, path, interval=0.2) as watcher:
            index = local.add_worker()
            new = local.cluster.address("worker", index)
            write([*cluster.workers, new])  # the operator adds a worker
            wait_for(lambda: new in strategy.workers.values(), 90, "the watcher to add the new worker")
            write(None, text='{"cluster": {"worker": [')  # half-written: logged, nothing changes
            wait_for(lambda: watcher.last_error is not None, 30, "the bad file to be seen")
            assert "is not valid JSON" in watcher.last_error and len(strategy.workers) == cluster.num_workers + 1
            futures = [strategy.schedule(step) for _ in range(30)]
            write([*cluster.workers[1:], new])  # ...and retires worker 0
            wait_for(lambda: cluster.workers[0] not in strategy.workers.values(), 90, "worker 0 to leave")
            strategy.join(timeout=120)
        assert not watcher.running and watcher.last_error is None
        assert [kind for _, kind, _, _ in watcher.changes] == ["added", "removed"]
        assert all(f.exception() is None for f in futures) and int(count.numpy()) == 30
        assert sorted(strategy.workers.values()) == sorted([*cluster.workers[1:], new])
    finally:
        strategy.shutdown()


def test_a_task_started_under_another_index_serves_at_the_index_the_strategy_gives(local, tmp_path):
    import subprocess
    import sys

    import portpicker

    cluster = running_cluster(local)
    address = f"127.0.0.1:{portpicker.pick_unused_port()}"
    own = tmp_path / "own.json"  # a cluster of its own, where it is worker 0
    own.write_text(json.dumps({"worker": [address], "ps": list(cluster.ps), "chief": [cluster.chief]}))
    process = subprocess.Popen([sys.executable, "-m", "psclient", "serve", "--cluster", str(own), "--job", "worker",
                                "--index", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    strategy = psclient.ParameterServerStrategy(cluster, connect_timeout=120.0)
    try:
        with strategy.scope():
            count = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def step():
            count.assign_add(1)
            return tf.distribute.coordinator.experimental_get_current_worker_index()

        index = strategy.add_worker(address)
        assert index == cluster.num_workers
        for worker in list(strategy.workers):
            if worker != index:
                strategy.remove_worker(worker)
        assert [strategy.schedule(step).result(60) for _ in range(3)] == [index] * 3
        assert int(count.numpy()) == 3
    finally:
        strategy.shutdown()
        process.kill()
        process.wait(timeout=60)


def test_removing_workers_below_replicas_to_aggregate_warns(local, caplog):
    jobs = running_cluster(local).jobs
    jobs["worker"] = jobs["worker"][:2]  # earlier tests may have added workers to the LocalCluster
    strategy = psclient.ParameterServerStrategy(psclient.Cluster(jobs), replicas_to_aggregate=2, connect_timeout=60)
    try:
        with caplog.at_level(logging.WARNING, logger="psclient"):
            strategy.remove_worker(1)
        assert strategy.num_workers == 1
        assert any("1 worker(s) left for replicas_to_aggregate=2" in r.getMessage() for r in caplog.records)
    finally:
        strategy.shutdown()
