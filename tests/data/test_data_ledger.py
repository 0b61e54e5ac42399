"""Sharded data through the ledger on a real cluster: every record once per epoch,
at least once (twice only when replayed) with a worker killed mid-epoch."""

import os
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import psclient

pytestmark = pytest.mark.cluster

N = 240


@pytest.fixture(scope="module")
def cluster():
    # Generous start and connect limits: a loaded machine starts TensorFlow slowly.
    with psclient.LocalCluster(num_workers=2, num_ps=1, start_timeout=300) as local:
        yield local


@pytest.fixture()
def strategy(cluster):
    for index in range(2):  # a worker killed by an earlier test (the kill test runs last: none)
        if not cluster.is_running("worker", index):
            cluster.restart("worker", index, timeout=300)  # generous: a loaded machine starts TF slowly
    strategy = psclient.ParameterServerStrategy(cluster.cluster, hang_timeout=10, connect_timeout=120)
    yield strategy
    strategy.shutdown()


def counting_step(counts, work=0, trained_by=None):
    """A step that counts each record id it trains (on the ps), and takes some time.
    With `trained_by`, it also records which worker (index + 1) trained each id."""

    def step(ids):
        x = tf.random.uniform([256, 256])
        for _ in range(work):
            x = tf.linalg.matmul(x, x) / 256.0
        with tf.control_dependencies([x]):
            counts.scatter_add(tf.IndexedSlices(tf.ones_like(ids), ids))
        if trained_by is not None:
            worker = tf.cast(tf.distribute.coordinator.experimental_get_current_worker_index(), tf.int64)
            trained_by.scatter_update(tf.IndexedSlices(tf.fill(tf.shape(ids), worker + 1), ids))

    return step


def make_dataset(shard):
    return tf.data.Dataset.range(shard.start, shard.end).batch(4)


def test_every_record_exactly_once_per_epoch(strategy):
    with strategy.scope():
        counts = tf.Variable(tf.zeros([N], tf.int64))
    data = psclient.data.ShardedDataset(psclient.data.range_shards(N, 20), make_dataset, seed=3)
    feed = psclient.data.ShardFeed(strategy, data)
    run_shard = feed.shard_function(counting_step(counts))
    for epoch in range(2):
        stats = feed.run_epoch(run_shard, epoch)
        np.testing.assert_array_equal(counts.numpy(), np.full([N], epoch + 1))
        assert stats["done"] == 12 and stats["replayed_records"] == 0
    assert strategy.stats()["replayed_records"] == 0
    assert strategy.stats()["data"]["feeds"][0]["records"] == 2 * N


def test_a_throttled_worker_takes_fewer_shards(strategy, cluster):
    with strategy.scope():
        counts = tf.Variable(tf.zeros([N], tf.int64))
    data = psclient.data.ShardedDataset(psclient.data.range_shards(N, 20), make_dataset)
    feed = psclient.data.ShardFeed(strategy, data)
    run_shard = feed.shard_function(counting_step(counts, work=20))
    feed.run_epoch(run_shard, 0)  # traced and warm on both workers
    before = [w["done"] for w in strategy.stats()["workers"]]
    cluster.throttle("worker", 1, 0.25)
    try:
        stats = feed.run_epoch(run_shard, 1, max_in_flight=2)
    finally:
        cluster.throttle("worker", 1, 1.0)
    done = [w["done"] - b for w, b in zip(strategy.stats()["workers"], before)]
    assert stats["done"] == 12 and sum(done) == 12
    assert done[0] > done[1], done  # late binding: the fast worker took more shards
    np.testing.assert_array_equal(counts.numpy(), np.full([N], 2))


def id_model(counts, **compile_args):
    import keras

    class Counting(keras.Model):
        """Linear regression that also counts, on the ps, how often each record id was trained."""

        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def build(self, input_shape):
            self.dense.build(input_shape)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            x, _ = data
            ids = tf.cast(x[:, 0], tf.int64)
            counts.scatter_add(tf.IndexedSlices(tf.ones_like(ids), ids))
            return super().train_step(data)

    model = Counting()
    model.build((None, 1))
    model.compile("sgd", "mse", metrics=["mae"], **compile_args)
    return model


def id_dataset(shard):
    ids = tf.data.Dataset.range(shard.start, shard.end)
    return ids.map(lambda i: (tf.cast([i], tf.float32), tf.cast([i % 3], tf.float32))).batch(4)


def test_fit_evaluate_predict(strategy):
    with strategy.scope():
        counts = tf.Variable(tf.zeros([N], tf.int64))
        model = id_model(counts)
    data = psclient.data.ShardedDataset(psclient.data.range_shards(N, 40), id_dataset, seed=0)
    history = model.fit(data, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    np.testing.assert_array_equal(counts.numpy(), np.full([N], 2))
    assert int(model.optimizer.iterations.numpy()) == 2 * N // 4
    assert len(model.evaluate(data, verbose=0)) == 2
    assert model.predict(data, verbose=0).shape == (N, 1)
    with pytest.raises(ValueError, match=r"Received: steps_per_epoch=3 with a psclient.data.ShardedDataset"):
        model.fit(data, steps_per_epoch=3, verbose=0)
    # A finite dataset of unknown size (a filter): an epoch ends where the data ends, each batch once.
    before = counts.numpy()
    odd = tf.data.Dataset.range(N).filter(lambda i: i % 2 == 1)
    model.fit(odd.map(lambda i: (tf.cast([i], tf.float32), tf.cast([i % 3], tf.float32))).batch(4), verbose=0)
    np.testing.assert_array_equal(counts.numpy() - before, np.arange(N) % 2)


def test_fit_honours_steps_per_execution(strategy):
    # steps_per_execution=3: Keras calls the train function once per 3 shards, and each shard's
    # loop trains 3 batches between two ledger writes (10 batches a shard: the last iteration short).
    with strategy.scope():
        counts = tf.Variable(tf.zeros([N], tf.int64))
        model = id_model(counts, steps_per_execution=3)
    data = psclient.data.ShardedDataset(psclient.data.range_shards(N, 40), id_dataset)
    seen = []

    class Batches(__import__("keras").callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    model.fit(data, epochs=2, verbose=0, callbacks=[Batches()])
    np.testing.assert_array_equal(counts.numpy(), np.full([N], 2))  # every record once per epoch
    assert int(model.optimizer.iterations.numpy()) == 2 * N // 4
    # 6 shards an epoch, two calls of three; the callbacks count batches (10 a shard): at the first
    # call's end those of the shards finished by then (0 when none is yet: index 0), at the second
    # all 60.
    assert len(seen) == 4 and seen[1] == seen[3] == 59 and all(s in (0, 9, 19, 29) for s in seen[::2]), seen
    feed = psclient.data.ShardFeed(strategy, data)
    with pytest.raises(ValueError, match=r"Received: steps_per_iteration=0\. Expected an integer >= 1"):
        feed.shard_function(counting_step(counts), steps_per_iteration=0)


def test_fit_reads_make_csv_dataset_with_its_default_shuffle_once_per_epoch(strategy, tmp_path):
    import keras

    # CSV files written here (offline), read with make_csv_dataset's defaults: shuffled without
    # a seed, reshuffled per iteration, size unknown (num_epochs=1).
    for part in range(3):
        rows = "".join(f"{i},{i % 5}.0\n" for i in range(part * 40, (part + 1) * 40))
        (tmp_path / f"part-{part}.csv").write_text("id,y\n" + rows)
    with strategy.scope():
        counts = tf.Variable(tf.zeros([120], tf.int64))

        class CsvCounting(keras.Model):
            def __init__(self):
                super().__init__()
                self.dense = keras.layers.Dense(1)

            def call(self, features):
                return self.dense(tf.cast(features["id"], tf.float32)[:, None] / 120.0)

            def train_step(self, data):
                ids = tf.cast(data[0]["id"], tf.int64)
                counts.scatter_add(tf.IndexedSlices(tf.ones_like(ids), ids))
                return super().train_step(data)

        model = CsvCounting()
        model.compile("sgd", "mse")
    data = tf.data.experimental.make_csv_dataset(str(tmp_path / "part-*.csv"), batch_size=4, label_name="y",
                                                 num_epochs=1)
    per_epoch = []

    class EveryEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            per_epoch.append(counts.numpy().copy())

    model.fit(data, epochs=2, verbose=0, callbacks=[EveryEpoch()])
    np.testing.assert_array_equal(per_epoch[0], np.ones([120]))  # each record once in epoch 0
    np.testing.assert_array_equal(per_epoch[1], np.full([120], 2))  # and once more in epoch 1


def test_backup_and_restore_resumes_the_epoch(strategy, tmp_path):
    import json

    import keras

    with strategy.scope():
        counts = tf.Variable(tf.zeros([N], tf.int64))
        model = id_model(counts)
    shards = psclient.data.range_shards(N, 20)

    class Crash(keras.callbacks.Callback):
        calls = 0

        def on_train_batch_end(self, batch, logs=None):  # once per shard (`batch` counts batches)
            self.calls += 1
            if self.calls == 6:
                raise KeyboardInterrupt("the coordinator dies")

    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        model.fit(psclient.data.ShardedDataset(shards, id_dataset, seed=1), epochs=1, verbose=0,
                  callbacks=[psclient.BackupAndRestore(backup, save_freq=1), Crash()])
    with open(f"{backup}/data_ledger.json") as f:
        saved = json.load(f)
    assert saved["epoch"] == 0 and 0 < len(saved["done"]) < len(shards)
    first = counts.numpy().copy()
    # A new run: the same shards, a new ShardedDataset, the backup's ledger.
    model.fit(psclient.data.ShardedDataset(shards, id_dataset, seed=1), epochs=1, verbose=0,
              callbacks=[psclient.BackupAndRestore(backup, save_freq=1)])
    trained = counts.numpy()
    assert trained.min() >= 1, "every record at least once"
    done_ids = np.concatenate([np.arange(shards[s].start, shards[s].end) for s in saved["done"]])
    np.testing.assert_array_equal(trained[done_ids], first[done_ids])  # done shards were skipped
    assert trained.max() <= 2
    # Mismatched shards are refused, not restarted silently.
    os.makedirs(backup, exist_ok=True)  # removed by the finished fit
    with open(f"{backup}/data_ledger.json", "w") as f:
        json.dump(saved, f)
    with pytest.raises(psclient.data.LedgerMismatchError, match="12 shards"):
        model.fit(psclient.data.ShardedDataset(psclient.data.range_shards(N, 40), id_dataset, seed=1),
                  epochs=1, verbose=0, callbacks=[psclient.BackupAndRestore(backup)])


def test_a_killed_worker_replays_only_its_batch_in_flight(strategy, cluster):
    n = 2 * N  # 12 shards: time for both workers to be mid-shard
    with strategy.scope():
        counts = tf.Variable(tf.zeros([n], tf.int64))
        trained_by = tf.Variable(tf.zeros([n], tf.int64))
    data = psclient.data.ShardedDataset(psclient.data.range_shards(n, 40), make_dataset)
    step = counting_step(counts, work=30, trained_by=trained_by)
    killed = threading.Event()
    finished = threading.Event()

    def kill_mid_shard():
        # Worker 1, slowed down so that its shards last, is cut off once it has trained a batch
        # in the middle of a shard (the 2nd to 8th of 10): it is then mid-shard.
        while not finished.is_set():
            by_worker_1 = np.flatnonzero(trained_by.numpy() == 2)
            if by_worker_1.size and 1 <= (by_worker_1.max() % 40) // 4 <= 7:
                cluster.kill("worker", 1)
                killed.set()
                return
            time.sleep(0.01)  # polling the ps, not synchronising

    cluster.throttle("worker", 1, 0.2)
    # The kill must land while worker 1 is mid-shard; on a fast or a loaded machine an
    # epoch can end first (worker 0 took the rest). Then the epoch is run again on a new
    # ledger, with the counts cleared, at most three times: the checks below read the epoch of the kill.
    for _ in range(3):
        counts.assign(tf.zeros([n], tf.int64))
        trained_by.assign(tf.zeros([n], tf.int64))
        feed = psclient.data.ShardFeed(strategy, data)  # a new ledger: its stats are this epoch's
        run_shard = feed.shard_function(step)
        finished.clear()
        killer = threading.Thread(target=kill_mid_shard)
        killer.start()
        try:
            stats = feed.run_epoch(run_shard, 0)
        finally:
            finished.set()
            killer.join()
        if killed.is_set():
            break
    assert killed.is_set(), "three epochs ended before worker 1 was mid-shard"
    trained = counts.numpy()
    assert stats["done"] == n // 40 and stats["records"] == n
    assert trained.min() == 1, "every record at least once"
    twice = int((trained == 2).sum())
    assert trained.max() <= 2 and twice <= 4  # a worker that died: at most the batch in flight
    assert twice <= stats["replayed_records"] <= 8  # counted: the retried attempt's first two batches
    assert sum(w["retried"] for w in strategy.stats()["workers"]) >= 1
    # Whole batches only: 8 (an upper bound: the two batches a hung attempt could still train)
    # when the cut-off attempt had started, 4 when its shard had one batch left then (seen on a
    # quiet machine), 0 when the kill landed between two of worker 1's attempts (seen in CI
    # under load; its position was then exact).
    assert stats["replayed_records"] in (0, 4, 8)
    assert strategy.stats()["replayed_records"] == stats["replayed_records"]
