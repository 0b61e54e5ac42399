"""`ps_recovery` on a real LocalCluster (2 workers, 2 ps): ps 1 is killed and started again
after training went on past a checkpoint.

"part": ps 1's variables and dynamic-table rows come back from the checkpoint, ps 0's
keep every update made since, and training goes on. "all": every variable goes back to the
checkpoint, as before. The pure decisions are tested in tests/checkpoints/test_part_recovery.py.
"""

import time

import numpy as np
import pytest
import tensorflow as tf

import psclient
from _heartbeat import MAX_STALL_S, Heartbeat
from _stopped import stopped

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

STEPS = 10


def trained_past_a_checkpoint(cluster, tmp_path, mode):
    """A strategy whose ps 0 and ps 1 each hold a counter: STEPS steps, a checkpoint, STEPS more."""
    strategy = psclient.ParameterServerStrategy(
        cluster.cluster, checkpoint_dir=tmp_path / "ckpt", hang_timeout=3.0, ps_recovery=mode)
    with strategy.scope():
        with tf.device("/job:ps/task:0"):
            on_ps0 = tf.Variable(0.0, name="on_ps0")
        with tf.device("/job:ps/task:1"):
            on_ps1 = tf.Variable(0.0, name="on_ps1")
            rows_on_ps1 = tf.Variable(tf.zeros([4, 2]), name="rows_on_ps1")

    @tf.function
    def step():
        on_ps0.assign_add(1.0)
        on_ps1.assign_add(1.0)
        rows_on_ps1.assign_add(tf.ones([4, 2]))
        return on_ps0.read_value()

    try:
        assert "/job:ps/replica:0/task:0/" in on_ps0.device and "/job:ps/replica:0/task:1/" in on_ps1.device
        for _ in range(STEPS):
            strategy.schedule(step)
        strategy.join(timeout=120)
        strategy.save_checkpoint()  # both counters at STEPS
        for _ in range(STEPS):
            strategy.schedule(step)
        strategy.join(timeout=120)
        assert on_ps0.numpy() == on_ps1.numpy() == 2 * STEPS
    except BaseException:
        strategy.shutdown()
        raise
    return strategy, step, (on_ps0, on_ps1, rows_on_ps1)


def lose_ps1_and_train_once(cluster, strategy, step):
    """Kill ps 1, start it again, and schedule one step: it meets the restarted ps, which the
    recovery restores; then the step runs again and completes."""
    cluster.kill("ps", 1)
    cluster.restart("ps", 1)
    assert float(strategy.schedule(step).result(timeout=150)) > 0
    strategy.join(timeout=60)


def test_all_rolls_every_variable_back_to_the_checkpoint(two_workers_two_ps, restore_shared_clusters, tmp_path):
    cluster = two_workers_two_ps
    strategy, step, (on_ps0, on_ps1, _) = trained_past_a_checkpoint(cluster, tmp_path, "all")
    try:
        lose_ps1_and_train_once(cluster, strategy, step)
        assert on_ps0.numpy() == on_ps1.numpy() == STEPS + 1
        stats = strategy.stats()["ps"]
        assert stats[1]["recoveries"] == 1 and stats[0]["recoveries"] == 0
        assert stats[1]["rolled_back"]["mode"] == "all" and stats[1]["rolled_back"]["variables"] == 2
        assert stats[0]["rolled_back"]["mode"] == "all" and stats[0]["rolled_back"]["variables"] == 1
        assert stats[0]["rolled_back"]["closures"] == stats[1]["rolled_back"]["closures"] == STEPS
    finally:
        strategy.shutdown()


def test_part_keeps_the_data_ledger_and_mends_its_positions_on_the_restored_ps(
        two_workers_two_ps, restore_shared_clusters, tmp_path):
    cluster = two_workers_two_ps
    strategy = psclient.ParameterServerStrategy(
        cluster.cluster, checkpoint_dir=tmp_path / "ckpt", hang_timeout=3.0, ps_recovery="part")
    try:
        data = psclient.data.ShardedDataset(psclient.data.range_shards(num_records=80, shard_size=10),
                                            lambda shard: tf.data.Dataset.range(shard.start, shard.end).batch(5))
        with strategy.scope():
            with tf.device("/job:ps/task:0"):
                seen_on_ps0 = tf.Variable(0, dtype=tf.int64)
                # Weight on ps 0, so that placement (least bytes) puts the ledger's positions
                # and attempts on ps 1, the one that is lost.
                tf.Variable(tf.zeros([1000]), trainable=False)
            with tf.device("/job:ps/task:1"):
                seen_on_ps1 = tf.Variable(0, dtype=tf.int64)
        feed = psclient.data.ShardFeed(strategy, data)
        assert "/job:ps/replica:0/task:1/" in feed._positions.device  # (placement, not behaviour)

        def step(batch):
            seen_on_ps0.assign_add(tf.size(batch, out_type=tf.int64))
            seen_on_ps1.assign_add(tf.size(batch, out_type=tf.int64))

        run_shard = feed.shard_function(step)

        def run(count):
            works = [feed.hand_out() for _ in range(count)]
            futures = [strategy.schedule(run_shard, args=work.args) for work in works]
            for work, future in zip(works, futures):
                feed.mark_done(work, future.result(timeout=120))

        feed.start_epoch(0)
        run(4)
        strategy.save_checkpoint()  # its ledger: 4 shards done, each at position 2 on ps 1
        run(2)
        cluster.kill("ps", 1)
        cluster.restart("ps", 1)
        touch = tf.function(lambda: seen_on_ps1.read_value())
        assert int(strategy.schedule(touch).result(timeout=150)) == 40  # restored: the checkpoint's
        # The 2 shards done since the checkpoint stay done: their records' updates are on ps 0.
        stats = feed.stats()
        assert stats["done"] == 6 and stats["rolled_back_shards"] == 0 and stats["records"] == 60
        assert int(seen_on_ps0.numpy()) == 60
        # The positions restored on ps 1 (2 batches for each shard done at the checkpoint) were
        # replaced by the ledger's (none in flight: all 0).
        assert feed.positions() == [0] * 8
        # The rest of the epoch: the 2 shards not done, each once.
        rest = list(feed.hand_out_all())
        assert sorted(work.slot for work in rest) == [6, 7]
        futures = [strategy.schedule(run_shard, args=work.args) for work in rest]
        for work, future in zip(rest, futures):
            feed.mark_done(work, future.result(timeout=120))
        assert feed.complete() and feed.stats()["records"] == 80
        assert int(seen_on_ps0.numpy()) == 80 and int(seen_on_ps1.numpy()) == 60
    finally:
        strategy.shutdown()


def shard_rows(state):
    """{key: row} of one shard of `layer.export_state()`."""
    return {key: state["rows"][i].tolist() for i, key in enumerate(state["row_keys"].tolist())}


def shard_state(state):
    """One shard of `layer.export_state()` whole, by key (a restore may put a key in another row):
    rows, each slot's rows, the counts of keys still counting, and the shard's clock and counters."""
    by_key = {key: i for i, key in enumerate(state["row_keys"].tolist())}
    return {
        "rows": shard_rows(state),
        "slots": {name: {key: values[i].tolist() for key, i in by_key.items()}
                  for name, values in state["slots"].items()},
        "counting": {key: state["counters"][i].tolist() for i, key in enumerate(state["keys"].tolist())},
        "clock": int(state["clock"]), "admissions": int(state["admissions"]), "evictions": int(state["evictions"]),
    }


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_part_restores_only_the_lost_ps_and_the_other_keeps_its_updates(
        two_workers_two_ps, restore_shared_clusters, tmp_path, optimizer):
    """With Adagrad the table's shards also hold a slot: ps 1's rows, slot, clock and counters come
    back from the checkpoint together, ps 0's stay as trained; so does `optimizer.iterations`, on
    whichever ps it was placed."""
    keras = pytest.importorskip("keras")
    from _dynamic_coordinator import data, make_model

    cluster = two_workers_two_ps
    x, y = data(1, n=128)
    strategy = psclient.ParameterServerStrategy(
        cluster.cluster, checkpoint_dir=tmp_path / "ckpt", hang_timeout=3.0, ps_recovery="part")
    try:
        with strategy.scope():
            chosen = keras.optimizers.SGD(0.5) if optimizer == "sgd" else keras.optimizers.Adagrad(0.5)
            model, layer = make_model("part_ids", chosen)  # a table shard on each ps
            with tf.device("/job:ps/task:0"):
                on_ps0 = tf.Variable(0, dtype=tf.int64, name="on_ps0")
            with tf.device("/job:ps/task:1"):
                on_ps1 = tf.Variable(0, dtype=tf.int64, name="on_ps1")
        assert "/job:ps/replica:0/task:0/" in on_ps0.device and "/job:ps/replica:0/task:1/" in on_ps1.device

        @tf.function
        def step(ids, labels):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model.loss(labels, model(ids, training=True)))
            model.optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            on_ps0.assign_add(1)
            on_ps1.assign_add(1)
            return loss

        keys = tf.constant(np.unique(x))
        read = tf.function(lambda ids: layer(ids, training=False))

        def train(steps):
            for _ in range(steps):
                strategy.schedule(step, (x, y))
            strategy.join(timeout=120)

        train(STEPS)
        checkpoint = strategy.save_checkpoint()  # after one for new variables (the slots) with Adagrad
        saved = [shard_state(state) for state in layer.export_state()]
        train(STEPS)
        moved = [shard_state(state) for state in layer.export_state()]
        assert len(saved) == 2 and all(saved[ps]["rows"] != moved[ps]["rows"] for ps in (0, 1))  # both moved on
        if optimizer == "adagrad":
            assert all(list(saved[ps]["slots"]) == ["accumulator"] for ps in (0, 1))
            assert all(saved[ps]["slots"] != moved[ps]["slots"] for ps in (0, 1))
        assert all(moved[ps]["clock"] > saved[ps]["clock"] for ps in (0, 1))
        iterations_ps = 0 if "/job:ps/replica:0/task:0/" in model.optimizer.iterations.value.device else 1
        assert int(model.optimizer.iterations.numpy()) == 2 * STEPS
        cluster.kill("ps", 1)
        cluster.restart("ps", 1)
        # A read (no update) meets the restarted ps: it waits for the recovery, then runs again.
        strategy.schedule(read, (keys,)).result(timeout=150)
        # ps 0 kept what the STEPS steps since the checkpoint did; ps 1 went back to the checkpoint.
        assert int(on_ps0.numpy()) == 2 * STEPS and int(on_ps1.numpy()) == STEPS
        after = [shard_state(state) for state in layer.export_state()]
        assert after[0] == moved[0] and after[1] == saved[1]  # rows, slots, clock and counters alike
        assert int(model.optimizer.iterations.numpy()) == (2 * STEPS if iterations_ps == 0 else STEPS)
        stats = strategy.stats()["ps"]
        assert stats[1]["failures"] == 1 and stats[1]["recoveries"] == 1
        report = stats[1]["rolled_back"]
        assert report["mode"] == "part" and report["checkpoint"] == checkpoint
        assert report["rows"] == len(saved[1]["rows"]) > 0 and report["closures"] == STEPS
        # Every variable (or shard) placed on ps 1, and no other.
        assert report["variables"] == sum(v["ps_index"] == 1 for v in strategy.placement()["variables"]) >= 2
        assert stats[1]["rolled_back_closures"] == STEPS
        assert stats[0]["rolled_back"] is None and stats[0]["failures"] == 0  # nothing of ps 0 went back
        train(3)  # training goes on, on both
        assert int(on_ps0.numpy()) == 2 * STEPS + 3 and int(on_ps1.numpy()) == STEPS + 3
        assert shard_rows(layer.export_state()[1]) != saved[1]["rows"]
    finally:
        strategy.shutdown()


def test_part_restores_a_slot_read_in_row_ranges_into_the_restarted_ps(
        two_workers_two_ps, restore_shared_clusters, tmp_path, monkeypatch):
    """The read limit lowered to 16 KiB: ps 1's [1024, 32] variable (128 KiB) is saved in 8 chunks and
    restored in row ranges into the restarted ps, where it holds no value yet (a sliced assign cannot
    set one: it gets a buffer of its shape first)."""
    from psclient._coordinator.checkpoints import checkpoint_pieces

    monkeypatch.setattr(checkpoint_pieces, "READ_BATCH_BYTES", 16 << 10)
    cluster = two_workers_two_ps
    strategy = psclient.ParameterServerStrategy(
        cluster.cluster, checkpoint_dir=tmp_path / "ckpt", hang_timeout=3.0, ps_recovery="part")
    try:
        with strategy.scope():
            with tf.device("/job:ps/task:0"):
                big_on_ps0 = tf.Variable(tf.zeros([1024, 32]))
            with tf.device("/job:ps/task:1"):
                big_on_ps1 = tf.Variable(tf.zeros([1024, 32]))

        @tf.function
        def step():
            big_on_ps0.assign_add(tf.ones([1024, 32]))
            big_on_ps1.assign_add(tf.ones([1024, 32]))
            return tf.reduce_sum(big_on_ps1)

        for _ in range(STEPS):
            strategy.schedule(step)
        strategy.join(timeout=120)
        path = strategy.save_checkpoint()
        layout = tf.train.load_checkpoint(path).get_tensor("psclient_layout").decode()
        assert '"row_chunks": {"bytes": 16384' in layout
        for _ in range(STEPS):
            strategy.schedule(step)
        strategy.join(timeout=120)
        lose_ps1_and_train_once(cluster, strategy, step)
        np.testing.assert_array_equal(big_on_ps1.numpy(), np.full([1024, 32], STEPS + 1.0))  # the checkpoint's
        kept = big_on_ps0.numpy()  # not rolled back; the step that met the loss may have updated it twice
        assert kept.min() == kept.max() >= 2 * STEPS + 1, (kept.min(), kept.max())
        # A restore on a ps that holds its variables: every range assigned in place.
        big_on_ps1.assign(tf.zeros([1024, 32]))
        strategy.restore()
        np.testing.assert_array_equal(big_on_ps1.numpy(), np.full([1024, 32], float(STEPS)))
    finally:
        strategy.shutdown()


def hang_ps0_and_lose_ps1(cluster, strategy, variable_on_ps1):
    """ps 0 SIGSTOPped; meanwhile ps 1 is killed and started again and a step on ps 1 alone meets it.
    Returns the step's future and whether the coordinator took ps 0 for lost too.

    The step runs for the first time during the faults. Its schedule() waited for ps 0 in 7 of
    16 runs here while an earlier test's traced function was freed under it: TF removed that one
    from every task, ps 0 included, waiting with the GIL held (now streamed:
    tests/faults/test_first_run_beside_hung_ps.py). The failed step's probes usually find ps 0
    silent too; when they find ps 1 alone, ps 0 is never taken for lost. ps 0 is resumed once
    ps 1's loss is counted."""

    @tf.function
    def step_on_ps1():
        variable_on_ps1.assign_add(1.0)
        return variable_on_ps1.read_value()

    probes = strategy._recovery.probes
    with Heartbeat() as beat, stopped(cluster, "ps", 0, watchdog_s=150):
        assert probes.stale_ps() == ()  # silent is not restarted
        assert probes.holding((0, 1)) == (1,)
        cluster.kill("ps", 1)
        cluster.restart("ps", 1)
        future = strategy.schedule(step_on_ps1)
        deadline = time.monotonic() + 120
        while strategy.stats(read_ps=False)["ps"][1]["failures"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling stats: no event says "taken for lost"
        stats = strategy.stats(read_ps=False)["ps"]
        assert stats[1]["failures"] >= 1, stats
        stall = beat.longest
    assert stall <= MAX_STALL_S, f"the coordinator stalled {stall:.2f} s while ps 0 hung"
    return future, stats[0]["failures"] >= 1


@pytest.mark.long
def test_a_ps_hung_while_the_other_is_lost_keeps_its_updates(two_workers_two_ps, restore_shared_clusters, tmp_path):
    """ps 0 hung while ps 1 was lost. When both answer again, ps 0 still holds its variables (it
    hung, it was not restarted): only ps 1 is restored from the checkpoint, and ps 0 keeps every
    update made since; if ps 0 was taken for lost too, its report says "kept"."""
    cluster = two_workers_two_ps
    strategy, _, (on_ps0, on_ps1, _) = trained_past_a_checkpoint(cluster, tmp_path, "part")
    try:
        future, ps0_taken_for_lost = hang_ps0_and_lose_ps1(cluster, strategy, on_ps1)
        assert float(future.result(timeout=150)) == STEPS + 1
        strategy.join(timeout=60)
        assert on_ps0.numpy() == 2 * STEPS  # kept: no update since the checkpoint undone
        assert on_ps1.numpy() == STEPS + 1
        stats = strategy.stats()["ps"]
        if ps0_taken_for_lost:
            assert stats[0]["rolled_back"]["mode"] == "kept", stats[0]
        else:
            assert stats[0]["rolled_back"] is None, stats[0]
        assert stats[0]["rolled_back_closures"] == 0, stats[0]
        assert stats[1]["rolled_back"]["mode"] == "part" and stats[1]["rolled_back"]["closures"] == STEPS, stats[1]
    finally:
        strategy.shutdown()

@pytest.mark.long
def test_all_restores_a_hung_ps_too_when_another_lost_its_state(two_workers_two_ps, restore_shared_clusters, tmp_path,
                                                                caplog):
    """The same faults under "all": ps 1 lost its state, so every ps goes back to the checkpoint
    (one version everywhere), ps 0 included although it only hung."""
    cluster = two_workers_two_ps
    strategy, _, (on_ps0, on_ps1, _) = trained_past_a_checkpoint(cluster, tmp_path, "all")
    try:
        future, _ = hang_ps0_and_lose_ps1(cluster, strategy, on_ps1)
        assert float(future.result(timeout=150)) == STEPS + 1
        strategy.join(timeout=60)
        assert on_ps0.numpy() == STEPS  # rolled back with the rest
        assert on_ps1.numpy() == STEPS + 1
        stats = strategy.stats()["ps"]
        assert stats[0]["rolled_back"]["mode"] == stats[1]["rolled_back"]["mode"] == "all", stats
        assert stats[0]["rolled_back_closures"] == stats[1]["rolled_back_closures"] == STEPS, stats
        assert not [r.message for r in caplog.records if "kept theirs" in r.getMessage()]  # the log says so too
    finally:
        strategy.shutdown()
