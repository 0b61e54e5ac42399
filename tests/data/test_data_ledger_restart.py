"""The data ledger across a coordinator SIGKILLed mid-epoch (strategy checkpoints) and a hung
worker (SIGSTOP): records counted on the ps, each at least once, twice only when in flight."""

import signal
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import psclient

from _ledger_restart_child import BATCH, N, SHARD
from _ledger_runs import run_coordinator, write_cluster_file
from _polling import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]


@pytest.fixture()
def cluster(local_cluster, restore_shared_clusters):
    """The session's 2 workers + 1 ps; a task a test killed is restarted after it."""
    return local_cluster


def shards_finished_at_least(count):
    return lambda events: sum(e["event"] == "shard" for e in events) >= count


@pytest.mark.long
def test_a_coordinator_killed_mid_epoch_resumes_the_epoch(cluster, tmp_path):
    cluster_file = tmp_path / "cluster.json"
    write_cluster_file(cluster, cluster_file)
    ckpt = tmp_path / "ckpt"
    num_shards = N // SHARD
    code, first, err = run_coordinator(cluster_file, ckpt, "first", kill_when=shards_finished_at_least(num_shards // 2))
    assert code == -signal.SIGKILL, err
    assert not any(e["event"] == "done" for e in first)

    code, second, err = run_coordinator(cluster_file, ckpt, "again")
    assert code == 0, (second, err)
    restored, done = second[0], second[-1]
    assert restored["event"] == "restored" and done["event"] == "done"
    # The strategy checkpoint carried the ledger: epoch 0 resumed, some shards already done.
    assert restored["ledgers"] == 1 and restored["epoch"] == 0 and restored["resume"] == 0
    assert 0 < len(restored["done"]) < num_shards, restored
    counts = np.array(done["counts"])
    assert counts.min() >= 1, "every record at least once"
    done_ids = np.concatenate([np.arange(s * SHARD, (s + 1) * SHARD) for s in restored["done"]])
    np.testing.assert_array_equal(counts[done_ids], 1)  # the shards done were not trained again
    rerun = [e["slot"] for e in second if e["event"] == "shard"]
    assert not set(rerun) & set(restored["done"]) and len(rerun) == num_shards - len(restored["done"])
    # The counts were restored with the weights, so what the first run trained after its last
    # checkpoint is trained once more, not twice. A record counts twice only if a closure of
    # the killed coordinator was still running on a worker after the restore: at most the two
    # batches of each closure it had in flight (4: two per worker).
    assert counts.max() <= 2 and int((counts == 2).sum()) <= 4 * 2 * BATCH
    assert done["stats"]["done"] == num_shards and done["stats"]["records"] == N

    # The same program over other shards (as many: the ps variables match) is refused, not restarted.
    code, third, err = run_coordinator(cluster_file, ckpt, "other")
    assert code == 0, (third, err)
    assert third[-1]["event"] == "refused" and third[-1]["error"] == "LedgerMismatchError", third
    assert f"Received: a ledger of {num_shards} shards" in third[-1]["message"]


def test_fit_killed_mid_epoch_resumes_the_epoch_after_restore(cluster, tmp_path):
    # model.fit(ShardedDataset) with strategy checkpoints, SIGKILLed mid-epoch; the same script
    # run again calls strategy.restore() and then fit: the epoch goes on where the checkpoint was.
    cluster_file = tmp_path / "cluster.json"
    write_cluster_file(cluster, cluster_file)
    ckpt = tmp_path / "ckpt"
    num_shards = N // SHARD

    def half_done(events):
        return any(e["event"] == "saved" for e in events) and events[-1].get("done", 0) >= num_shards // 2

    code, first, err = run_coordinator(cluster_file, ckpt, "fit-first", kill_when=half_done)
    assert code == -signal.SIGKILL, (first, err)
    assert not any(e["event"] == "done" for e in first)

    code, second, err = run_coordinator(cluster_file, ckpt, "fit-again")
    assert code == 0, (second, err)
    restored, begin, done = second[0], second[1], second[-1]
    assert restored == {"event": "restored", "ledgers": 1}, second[:2]
    assert begin["event"] == "begin" and done["event"] == "done", second
    assert begin["epoch"] == 0 and 0 < len(begin["done"]) < num_shards, begin  # the same epoch resumed
    counts = np.array(done["counts"])
    assert counts.min() >= 1, "every record at least once"
    done_ids = np.concatenate([np.arange(s * SHARD, (s + 1) * SHARD) for s in begin["done"]])
    np.testing.assert_array_equal(counts[done_ids], 1)  # the shards done were not trained again
    # Twice only for the batches a closure of the killed coordinator still trained after the
    # restore: at most two batches of each shard it had in flight (fit keeps 4: two per worker).
    assert counts.max() <= 2 and int((counts == 2).sum()) <= 4 * 2 * BATCH, counts
    assert done["stats"]["done"] == num_shards and done["stats"]["records"] == N


def make_dataset(shard):
    return tf.data.Dataset.range(shard.start, shard.end).batch(BATCH)


@pytest.mark.long
def test_a_hung_worker_gives_its_shard_back_and_trains_at_most_two_batches_of_it_again(cluster):
    strategy = psclient.ParameterServerStrategy(cluster.cluster, hang_timeout=8, connect_timeout=120)
    n = 480
    with strategy.scope():
        counts = tf.Variable(tf.zeros([n], tf.int64))
        trained_by = tf.Variable(tf.zeros([n], tf.int64))
    data = psclient.data.ShardedDataset(psclient.data.range_shards(n, 40), make_dataset)

    def step(ids):
        x = tf.random.uniform([256, 256])
        for _ in range(30):
            x = tf.linalg.matmul(x, x) / 256.0
        with tf.control_dependencies([x]):
            counts.scatter_add(tf.IndexedSlices(tf.ones_like(ids), ids))
        worker = tf.cast(tf.distribute.coordinator.experimental_get_current_worker_index(), tf.int64)
        trained_by.scatter_update(tf.IndexedSlices(tf.fill(tf.shape(ids), worker + 1), ids))

    stopped, finished = threading.Event(), threading.Event()

    def stop_mid_shard():
        while not finished.is_set():
            by_worker_1 = np.flatnonzero(trained_by.numpy() == 2)
            if by_worker_1.size and 1 <= (by_worker_1.max() % 40) // BATCH <= 7:
                cluster.stop("worker", 1)  # SIGSTOP: it keeps its connections, answers nothing
                stopped.set()
                return
            time.sleep(0.01)  # polling the ps, not synchronising

    try:
        cluster.throttle("worker", 1, 0.3)
        for _ in range(3):  # the stop must land mid-shard; an epoch may end first on a loaded machine
            counts.assign(tf.zeros([n], tf.int64))
            trained_by.assign(tf.zeros([n], tf.int64))
            feed = psclient.data.ShardFeed(strategy, data)
            run_shard = feed.shard_function(step)
            finished.clear()
            stopper = threading.Thread(target=stop_mid_shard)
            stopper.start()
            try:
                stats = feed.run_epoch(run_shard, 0)
            finally:
                finished.set()
                stopper.join()
            if stopped.is_set():
                break
        assert stopped.is_set(), "three epochs ended before worker 1 was mid-shard"
        assert stats["done"] == n // 40 and stats["records"] == n
        assert counts.numpy().min() == 1, "every record at least once, with worker 1 hung"
        assert sum(w["retried"] for w in strategy.stats()["workers"]) >= 1
        # Worker 1 wakes up: its closure finishes the batch it was in and, at most, the one it
        # started beside reading the attempt counter; then it sees the newer attempt and stops.
        cluster.throttle("worker", 1, 1.0)
        cluster.resume("worker", 1)
        wait_for(lambda: (lambda w: w["up"] and w["rejoins"] >= 1)(strategy.stats(read_ps=False)["workers"][1]),
                 300, "worker 1 to rejoin after SIGCONT", interval=0.5)
        # It answers again, so its woken closure runs: the epoch is over, so once every dispatcher
        # thread waits for work, none is in a call, the abandoned one included.
        wait_for(lambda: (lambda s: s["waiting_dispatchers"] == s["dispatcher_threads_alive"])(
            strategy.stats(read_ps=False)), 120, "the woken closure of worker 1 to end", interval=0.2)
        trained = counts.numpy()
        twice = int((trained == 2).sum())
        assert trained.max() <= 2 and twice <= 2 * BATCH, trained
        assert twice <= feed.stats()["replayed_records"] <= 2 * BATCH
    finally:
        finished.set()
        if cluster.is_running("worker", 1):
            cluster.resume("worker", 1)
        cluster.throttle("worker", 1, 1.0)
        strategy.shutdown()


def test_a_lost_ps_rolls_the_ledger_back_with_the_variables(cluster, tmp_path):
    # A ps killed mid-epoch and restarted: every variable comes back from the newest checkpoint,
    # the per-record counts included, so the shards finished after that checkpoint must be
    # trained again for every record to be in the epoch's final model at least once.
    strategy = psclient.ParameterServerStrategy(cluster.cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                checkpoint_every=100_000, hang_timeout=30, connect_timeout=120)
    n = 480
    try:
        with strategy.scope():
            counts = tf.Variable(tf.zeros([n], tf.int64))
        data = psclient.data.ShardedDataset(psclient.data.range_shards(n, 40), make_dataset, seed=5)
        feed = psclient.data.ShardFeed(strategy, data)

        def step(ids):
            x = tf.random.uniform([256, 256])
            for _ in range(20):
                x = tf.linalg.matmul(x, x) / 256.0
            with tf.control_dependencies([x]):
                counts.scatter_add(tf.IndexedSlices(tf.ones_like(ids), ids))

        run_shard = feed.shard_function(step)
        finished, saved_at, killed = [], [], threading.Event()

        def kill_and_restart_ps():
            cluster.kill("ps", 0)
            cluster.restart("ps", 0, timeout=300)  # generous: a loaded machine starts TF slowly

        def on_shard_done(item, result):
            finished.append(item.slot)
            if len(finished) == 3:
                saved_at.append(sorted(feed.ledger.state()["done"]))
                strategy.save_checkpoint()  # the checkpoint the ps comes back to: 3 shards done
            if len(finished) == 6 and not killed.is_set():
                killed.set()  # 3 more done since the checkpoint: lost with the ps
                threading.Thread(target=kill_and_restart_ps, daemon=True).start()

        stats = feed.run_epoch(run_shard, 0, on_shard_done=on_shard_done)
        assert killed.is_set()
        assert strategy.stats()["ps"][0]["recoveries"] == 1, strategy.stats()["ps"]
        trained = counts.numpy()
        assert trained.min() >= 1, ("every record at least once in the epoch's final model", trained)
        assert trained.max() <= 2, trained
        assert stats["done"] == n // 40 and stats["rolled_back_shards"] >= 1, stats
        # The shards done at the checkpoint were not trained again.
        done_ids = np.concatenate([np.arange(s * 40, (s + 1) * 40) for s in saved_at[0]])
        np.testing.assert_array_equal(trained[done_ids], 1)
    finally:
        strategy.shutdown()
        if not cluster.is_running("ps", 0):
            cluster.restart("ps", 0, timeout=300)


def test_fit_with_a_lost_ps_trains_every_record_into_the_final_model(cluster, tmp_path):
    # The same through model.fit: the ps killed mid-epoch, three shards after a checkpoint.
    import keras

    from psclient._keras.sharded_fit import active_feed

    strategy = psclient.ParameterServerStrategy(cluster.cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                checkpoint_every=100_000, hang_timeout=30, connect_timeout=120)
    n = 960  # 24 shards: the ps is lost well before the epoch's end
    try:
        with strategy.scope():
            counts = tf.Variable(tf.zeros([n], tf.int64))

            class Counting(keras.Model):
                def __init__(self):
                    super().__init__()
                    self.dense = keras.layers.Dense(1)

                def call(self, x):
                    return self.dense(x)

                def train_step(self, data):
                    ids = tf.cast(data[0][:, 0], tf.int64)
                    x = tf.random.uniform([256, 256])
                    for _ in range(20):
                        x = tf.linalg.matmul(x, x) / 256.0
                    with tf.control_dependencies([x]):
                        counts.scatter_add(tf.IndexedSlices(tf.ones_like(ids), ids))
                    return super().train_step(data)

            model = Counting()
            model.compile("sgd", "mse")

        def id_dataset(shard):
            ids = tf.data.Dataset.range(shard.start, shard.end)
            return ids.map(lambda i: (tf.cast([i], tf.float32), tf.cast([i % 3], tf.float32))).batch(BATCH)

        data = psclient.data.ShardedDataset(psclient.data.range_shards(n, 40), id_dataset, seed=5)
        saved_at, killed, finished = [], threading.Event(), threading.Event()

        def lose_ps(feed):
            # Watches the ledger (coordinator memory, not the ps): a checkpoint once 3 shards are
            # done, the ps killed once 3 more are (mid-epoch: fit's own steps run ahead of the shards).
            while not finished.is_set():
                done = feed.stats()["done"]
                if done >= 3 and not saved_at:
                    saved_at.append(sorted(feed.ledger.state()["done"]))
                    strategy.save_checkpoint()
                elif saved_at and done >= len(saved_at[0]) + 3:
                    killed.set()
                    cluster.kill("ps", 0)
                    cluster.restart("ps", 0, timeout=300)  # generous: a loaded machine starts TF slowly
                    return
                time.sleep(0.01)  # polling the ledger, not synchronising

        class LosePs(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                threading.Thread(target=lose_ps, args=(active_feed(self.model),), daemon=True).start()

            def on_train_end(self, logs=None):
                saved_at.append(active_feed(self.model).stats())

        try:
            model.fit(data, epochs=1, verbose=0, callbacks=[LosePs()])
        finally:
            finished.set()
        assert killed.is_set(), "the epoch ended before the ps was killed"
        assert strategy.stats()["ps"][0]["recoveries"] == 1, strategy.stats()["ps"]
        trained = counts.numpy()
        assert trained.min() >= 1, ("every record at least once in the epoch's final model", trained)
        assert trained.max() <= 2, trained
        stats = saved_at[-1]
        assert stats["done"] == n // 40 and stats["rolled_back_shards"] >= 1, stats
        done_ids = np.concatenate([np.arange(s * 40, (s + 1) * 40) for s in saved_at[0]])
        np.testing.assert_array_equal(trained[done_ids], 1)  # done at the checkpoint: not again
    finally:
        strategy.shutdown()
        if not cluster.is_running("ps", 0):
            cluster.restart("ps", 0, timeout=300)
