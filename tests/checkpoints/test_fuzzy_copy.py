"""A checkpoint copies its big sparse-updated variables before the cut, training going on.

The cut then reads again only the rows written since the copy began
(`checkpoints.fuzzy_copy`, `_tf.write_marks`). Checked on a real cluster with
steps that keep running beside each save: every checkpoint must hold exactly
the values of its cut. Each step adds 1 to a counter on ps:0, reads it back
as its number `k`, adds 1 to 64 rows of a table on ps:1 that `k` picks and
counts `k` in a tally beside the table. So a checkpoint must hold the table
its tally makes, row for row, and a tally of as many steps as its counter.
(Two steps running at once can both read the number the later one made: the
add and the read are two ops. The tally, not the counter, says which rows;
each step reads its number once, so its rows and its tally agree.)
"""

import concurrent.futures
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import psclient
from psclient._coordinator.checkpoints import checkpoint_parts, fuzzy_copy, stages
from psclient._tf.write_marks import marks_of
from _polling import wait_for
from _rss import PeakRss

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ROWS, WIDTH, TOUCHED = 600_000, 8, 64  # 19.2 MB: three row chunks of 8 MiB (the checkpoint's)
VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"
MAX_STEPS = 1 << 16  # a step numbered beyond fails its scatter (an error, not a wrong table)


@pytest.fixture(scope="module")
def cluster(two_workers_two_ps):
    return two_workers_two_ps


def rows_of(k: int) -> np.ndarray:
    return (k * 7919 + np.arange(TOUCHED) * 104_729) % ROWS


def expected_table(tally: np.ndarray) -> np.ndarray:
    """The table made by the steps `tally` counts (`tally[k]`: steps that took number k)."""
    table = np.zeros([ROWS, WIDTH], np.float32)
    for k in np.flatnonzero(tally):
        np.add.at(table, rows_of(int(k)), float(tally[k]))
    return table


def build(strategy):
    with strategy.scope():
        with tf.device("/job:ps/task:0"):
            counter = tf.Variable(0, dtype=tf.int64)
        with tf.device("/job:ps/task:1"):
            table = tf.Variable(tf.zeros([ROWS, WIDTH]))
            dense = tf.Variable(tf.zeros([ROWS, WIDTH]))  # written whole by each step
            frozen = tf.Variable(tf.ones([ROWS, WIDTH]))  # never written
            tally = tf.Variable(tf.zeros([MAX_STEPS], tf.int32))  # steps by number

    @tf.function
    def step():
        # One read of the counter: the result of `assign_add` is read again at each use (a
        # ReadVariableOp per use), so the rows and the tally could take different numbers.
        k = tf.convert_to_tensor(counter.assign_add(1))
        rows = (k * 7919 + tf.range(TOUCHED, dtype=tf.int64) * 104_729) % ROWS
        table.scatter_add(tf.IndexedSlices(tf.ones([TOUCHED, WIDTH]), rows))
        tally.scatter_add(tf.IndexedSlices(tf.ones([1], tf.int32), tf.reshape(k, [1])))
        dense.assign_add(tf.fill([ROWS, WIDTH], 1.0))
        return k
    step.tally = tally
    return counter, table, dense, frozen, step


class Training:
    """Schedules `step` from a thread of its own until stopped: steps run beside every save."""

    def __init__(self, strategy, step):
        self._stop = threading.Event()
        self.errors = []

        def run():
            for _ in range(100_000):  # bounded; stopped by the test long before
                if self._stop.is_set():
                    return
                try:
                    strategy.schedule(step).result(timeout=120)
                except Exception as error:  # noqa: BLE001 - the test asserts there was none
                    self.errors.append(error)
                    return
        self._threads = [threading.Thread(target=run, name=f"test-training-{i}") for i in range(2)]
        for thread in self._threads:
            thread.start()

    def stop(self):
        self._stop.set()
        for thread in self._threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in self._threads)


def saves_beside_training(strategy, step, tries=6):
    """Saves while two threads schedule `step`, until a cut read rows again (at most `tries`):
    [(path, copied bytes, rows read again)]."""
    training = Training(strategy, step)
    seen = []
    try:
        for _ in range(tries):
            path = strategy.save_checkpoint()
            stats = strategy.stats()["checkpoints"]
            seen.append((path, stats["last_copied_bytes"], stats["last_rows_read_again"]))
            if stats["last_rows_read_again"]:
                break
    finally:
        training.stop()
    assert not training.errors, training.errors
    return seen


def assert_holds_its_cut(path, cut_off=0):
    """The checkpoint holds whole steps: each step counted on ps 0 is in the tally, the table and the
    dense variable on ps 1. `cut_off` (0 or 1): a step a worker taken out mid-step may have left half
    done (docs/api.md: a closure cut off may already have applied part of its updates). Its counter's
    increment comes first (the rest reads it); its three writes on ps 1 touch different variables, so
    TF orders none of them: any of them may be missing. Seen in full suites: the counter one ahead of
    the tally; the tally one ahead of the dense variable (179 and 180: its 19 MB write was the one under
    way when the worker stopped)."""
    assert cut_off in (0, 1), cut_off
    reader = tf.train.load_checkpoint(path)
    count = int(reader.get_tensor("v000000" + VALUE))
    tally = reader.get_tensor("v000004" + VALUE)
    assert count >= 1 and count - cut_off <= tally.sum() <= count, (path, count, tally.sum(), cut_off)
    dense = reader.get_tensor("v000002" + VALUE)
    assert np.all(dense == dense[0, 0]) and count - cut_off <= dense[0, 0] <= count, (path, count, dense[0, 0])
    assert abs(dense[0, 0] - tally.sum()) <= cut_off, (path, dense[0, 0], tally.sum())
    extra = reader.get_tensor("v000001" + VALUE) - expected_table(tally)
    if not cut_off or not extra.any():
        np.testing.assert_array_equal(extra, 0, err_msg=f"{path}: counter {count}")
        return
    # The half-done step's table write without its tally (+1 on its rows), or its tally without
    # its table write (-1): one step number's rows, nothing else.
    sign = 1.0 if extra.max() > 0 else -1.0
    rows = np.flatnonzero(extra.any(axis=1))
    candidates = [k for k in range(1, count + 1) if np.array_equal(np.sort(rows_of(k)), rows)]
    assert candidates, f"{path}: the table differs from its tally on rows no single step writes: {rows[:8]}"
    np.testing.assert_array_equal(extra[rows], sign, err_msg=f"{path}: more than one half-done step")


def test_each_checkpoint_holds_its_cut_while_steps_write_during_the_copy(cluster, tmp_path):
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                variable_partitioner=None)
    try:
        counter, table, dense, frozen, step = build(strategy)
        assert marks_of(table) is not None and marks_of(dense) is not None and marks_of(counter) is None
        strategy.schedule(step).result(timeout=120)  # the table now scatter-updated (copy-on-read mode)
        seen = saves_beside_training(strategy, step)
        # Only the table was copied before its cut: `dense` is written whole by every step (read
        # whole in the cut), `frozen` never written (its read in the cut shares its buffer).
        assert all(copied == ROWS * WIDTH * 4 for _path, copied, _again in seen), seen
        assert seen[-1][2] > 0, f"no save had a step write during its copy: {seen}"
        for path, _copied, _again in seen:
            assert_holds_its_cut(path)
            assert np.all(tf.train.load_checkpoint(path).get_tensor("v000003" + VALUE) == 1.0)
        restored = strategy.restore()
        assert restored["path"] == seen[-1][0]
        np.testing.assert_array_equal(table.read_value().numpy(), expected_table(step.tally.numpy()))
    finally:
        strategy.shutdown()


def test_a_table_scattered_only_before_the_previous_checkpoint_is_not_copied_in_the_cut(tmp_path):
    """Scattered, checkpointed (copied before its cut), then checkpointed again with no write since:
    TF keeps it in copy-on-read mode, and the cut's read copied it whole in the pause (53 ms for
    1 GB). Now the read shares its buffer: the ps does not grow by the table during that save.
    A scatter after such a cut, while its write holds the read, must not reach the checkpoint.
    Its own cluster, on plain malloc (oneDNN's allocator, TF's default, keeps freed memory and
    reuses it unseen: the copy would not show)."""
    rows = 2_000_000  # 64 MB
    plain_malloc = {"TF_ENABLE_ONEDNN_OPTS": "0", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    with psclient.LocalCluster(num_workers=1, num_ps=1, env=plain_malloc) as cluster:
        saves_after_a_scatter(cluster, rows, tmp_path)


def saves_after_a_scatter(cluster, rows, tmp_path):
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                variable_partitioner=None)
    try:
        with strategy.scope():
            big = tf.Variable(tf.zeros([rows, WIDTH]))

        @tf.function
        def scatter():
            big.scatter_add(tf.IndexedSlices(tf.ones([TOUCHED, WIDTH]), tf.range(TOUCHED, dtype=tf.int64)))

        def first_rows(path):
            return tf.train.load_checkpoint(path).get_tensor("v000000" + VALUE)[:TOUCHED]

        strategy.schedule(scatter).result(timeout=120)
        strategy.save_checkpoint()  # copied before its cut: scattered since made
        with PeakRss(cluster.pid("ps", 0), period=0.002) as peak:
            quiet = strategy.save_checkpoint()  # nothing written since the previous one
        assert peak.growth < rows * WIDTH * 4 / 2, f"the ps grew {peak.growth / 2**20:.1f} MiB during the save"
        assert np.all(first_rows(quiet) == 1.0)
        # The cut shares the buffer; a scatter before the write copies it first (TF), so the write
        # holds the cut's value.
        strategy._recovery.checkpoints.before_write = lambda path: strategy.schedule(scatter).result(timeout=120)  # noqa: SLF001
        try:
            cut_before_the_scatter = strategy.save_checkpoint()
        finally:
            strategy._recovery.checkpoints.before_write = None  # noqa: SLF001
        assert np.all(first_rows(cut_before_the_scatter) == 1.0)
        assert np.all(first_rows(strategy.save_checkpoint()) == 2.0)
        assert np.all(big[:TOUCHED].numpy() == 2.0)
    finally:
        strategy.shutdown()


def test_once_one_ps_fails_its_copy_the_other_ps_stops_copying(cluster, restore_shared_clusters, tmp_path,
                                                               monkeypatch, caplog):
    """ps 1 killed as a checkpoint's copy begins, ps 0 slowed: ps 0's copy stops before its next chunk
    instead of copying the rest of its table (a ps loss's recovery waits on that thread: it took the
    rest of a 1 GB copy, 1.1 s), and the warning names ps 1, not the ps stopped for it."""
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                variable_partitioner=None, hang_timeout=3.0)
    outcomes = []
    copy_in_chunks = stages.copy_in_chunks

    def recording(variable, *args, **kwargs):
        try:
            copy_in_chunks(variable, *args, **kwargs)
            outcomes.append((variable.device, "copied"))
        except stages.CopyStopped:
            outcomes.append((variable.device, "stopped"))
            raise

    try:
        with strategy.scope():
            with tf.device("/job:ps/task:0"):
                big = tf.Variable(tf.zeros([4 * ROWS, WIDTH]))  # 77 MB: ten chunks
            with tf.device("/job:ps/task:1"):
                small = tf.Variable(tf.zeros([ROWS, WIDTH]))

        @tf.function
        def scatter():
            for table in (big, small):
                table.scatter_add(tf.IndexedSlices(tf.ones([TOUCHED, WIDTH]), tf.range(TOUCHED, dtype=tf.int64)))

        strategy.schedule(scatter).result(timeout=120)
        monkeypatch.setattr(stages, "copy_in_chunks", recording)
        cluster.throttle("ps", 0, 0.25)
        cluster.kill("ps", 1)
        with caplog.at_level("WARNING", logger="psclient"):
            prepared = fuzzy_copy.prepare(strategy.parts.store.named(), lambda ps: f"ps {ps}", timeout=60)
        assert prepared is None
        assert [outcome for device, outcome in outcomes if "task:0" in device] == ["stopped"], outcomes
        assert any("ps:1" in r.getMessage() and "could not copy" in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
    finally:
        cluster.throttle("ps", 0, 1.0)
        cluster.restart("ps", 1)
        strategy.shutdown()


def test_a_copy_that_ends_after_the_copy_was_given_up_drops_its_stages(cluster, restore_shared_clusters,
                                                                        tmp_path, monkeypatch):
    """ps 1 hung (SIGSTOP) while a checkpoint's copy runs, and ps 0's copy still under way when the
    copy as a whole is given up (`timeout`): ps 0's copy, ending later, empties its stage itself.
    (It stayed on ps 0 until the next checkpoint's copy: a table's worth of memory.)"""
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                variable_partitioner=None, hang_timeout=3.0)
    ps0_copying, ps0_go = threading.Event(), threading.Event()
    copy_sparse_written = fuzzy_copy._copy_sparse_written  # noqa: SLF001
    emptied = []
    empty = stages.empty

    def slow_on_ps0(slots, stop=None):
        if slots and "task:0" in slots[0][0].variable.device:
            ps0_copying.set()
            assert ps0_go.wait(120), "the test did not let ps 0's copy go on"
            return copy_sparse_written(slots)  # not stopped: it ends after prepare gave up
        return copy_sparse_written(slots, stop)

    def recording(stage):
        emptied.append(stage.device)
        return empty(stage)

    try:
        with strategy.scope():
            with tf.device("/job:ps/task:0"):
                big = tf.Variable(tf.zeros([ROWS, WIDTH]))
            with tf.device("/job:ps/task:1"):
                other = tf.Variable(tf.zeros([ROWS, WIDTH]))

        @tf.function
        def scatter():
            for table in (big, other):
                table.scatter_add(tf.IndexedSlices(tf.ones([TOUCHED, WIDTH]), tf.range(TOUCHED, dtype=tf.int64)))

        strategy.schedule(scatter).result(timeout=120)
        monkeypatch.setattr(fuzzy_copy, "_copy_sparse_written", slow_on_ps0)
        monkeypatch.setattr(stages, "empty", recording)
        cluster.stop("ps", 1)
        try:
            # Given up: ps 1 did not answer (the checkpoint fails with it, no cut taken).
            with pytest.raises(checkpoint_parts.CheckpointWriteError,
                               match=r"ps:\d .*could not copy .*no answer within 3 s"):
                fuzzy_copy.prepare(strategy.parts.store.named(), lambda ps: f"ps {ps}", timeout=3.0)
            assert ps0_copying.is_set() and not emptied, emptied
            ps0_go.set()
            wait_for(lambda: any("task:0" in device for device in emptied), 120,
                     "ps 0's copy, ended after the copy was given up, emptying its stage")
        finally:
            ps0_go.set()
            cluster.resume("ps", 1)
        wait_for(lambda: not checkpoint_parts.late_threads(), 120, "the copy's threads ending once ps 1 answers")
        assert big.numpy()[:TOUCHED].sum() == TOUCHED * WIDTH  # the variable itself untouched
    finally:
        strategy.shutdown()


def test_a_restarted_ps_gets_new_marks_and_its_checkpoints_hold_their_cut(cluster, restore_shared_clusters,
                                                                         tmp_path):
    """ps 1 (the table's) killed and started again: its variables and their marks are made again
    there, every variable goes back to the newest checkpoint (`ps_recovery="all"`: the counter
    on ps 0 with them), and the checkpoints taken beside training afterwards hold their cut."""
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                variable_partitioner=None, ps_recovery="all", hang_timeout=3.0)
    try:
        counter, table, _dense, _frozen, step = build(strategy)
        strategy.schedule(step).result(timeout=120)
        before = saves_beside_training(strategy, step, tries=1)
        cluster.kill("ps", 1)
        cluster.restart("ps", 1)
        assert int(strategy.schedule(step).result(timeout=150)) >= 1  # met the restarted ps, recovered
        assert strategy.stats()["ps"][1]["recoveries"] == 1
        assert step.tally.numpy().sum() == int(counter.numpy())
        np.testing.assert_array_equal(table.numpy(), expected_table(step.tally.numpy()))
        assert not marks_of(table).rows.numpy()[np.setdiff1d(np.arange(ROWS), rows_of(int(counter.numpy())))].any()
        after = saves_beside_training(strategy, step)
        assert after[-1][1] == ROWS * WIDTH * 4 and after[-1][2] > 0, after
        for path, _copied, _again in before + after:
            assert_holds_its_cut(path)
    finally:
        strategy.shutdown()


def test_a_variable_made_while_a_function_is_traced_marks_its_writes(cluster, tmp_path):
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                variable_partitioner=None)
    try:
        made = {}
        with strategy.scope():
            @tf.function
            def make_and_write():
                if "table" not in made:  # made at the first trace (lifted out of it, onto a ps)
                    made["table"] = tf.Variable(lambda: tf.zeros([ROWS, WIDTH]), shape=[ROWS, WIDTH])
                made["table"].scatter_add(tf.IndexedSlices(tf.ones([2, WIDTH]), tf.constant([3, 7])))
                return tf.constant(1)

        strategy.schedule(make_and_write).result(timeout=120)
        assert np.flatnonzero(marks_of(made["table"]).rows.numpy()).tolist() == [3, 7]
        strategy.save_checkpoint()
        assert strategy.stats()["checkpoints"]["last_copied_bytes"] == ROWS * WIDTH * 4
    finally:
        strategy.shutdown()


def test_checkpoint_cut_copy_reads_every_variable_in_the_cut(cluster, tmp_path):
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                variable_partitioner=None, checkpoint_cut="copy")
    try:
        counter, table, _dense, _frozen, step = build(strategy)
        assert marks_of(table) is None  # nothing marked: a step costs no more op
        for _ in range(3):
            strategy.schedule(step)
        path = strategy.save_checkpoint()
        stats = strategy.stats()["checkpoints"]
        assert stats["last_copied_bytes"] == 0 and stats["last_rows_read_again"] == 0
        reader = tf.train.load_checkpoint(path)
        tally = reader.get_tensor("v000004" + VALUE)
        assert tally.sum() == int(reader.get_tensor("v000000" + VALUE))
        np.testing.assert_array_equal(reader.get_tensor("v000001" + VALUE), expected_table(tally))
    finally:
        strategy.shutdown()


def test_a_bad_checkpoint_cut_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"checkpoint_cut.*Received: checkpoint_cut='fuzzy'.*'rows'.*'copy'"):
        psclient.StrategyConfig(checkpoint_cut="fuzzy")


def test_keras_fit_marks_the_rows_adagrad_writes_and_its_checkpoint_restores(cluster, tmp_path):
    """Keras's own update path (Adagrad: scatter_add on the accumulator, scatter_sub on the table, on
    each shard) marks what it writes; a save from a callback mid-fit copies both before its cut."""
    import keras

    rows, width = 300_000, 16  # 19.2 MB, two shards of 9.6 MB (one per ps), each above a row chunk
    # The data first, then the strategy and the model, as published Keras scripts do.
    ids = np.random.default_rng(0).integers(0, rows, size=[256, 4])
    data = tf.data.Dataset.from_tensor_slices((ids, np.ones([256, 1], np.float32))).batch(32).repeat()
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        with strategy.scope():
            model = keras.Sequential([keras.Input([4], dtype="int64"), keras.layers.Embedding(rows, width),
                                      keras.layers.Flatten(), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
        table = model.layers[0].embeddings.value
        shards = table.variables
        assert len(shards) == 2 and all(marks_of(shard) is not None for shard in shards)
        saved = {}

        class SaveMidFit(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 5:
                    saved["path"] = strategy.save_checkpoint()
                    saved["stats"] = strategy.stats()["checkpoints"]

        model.fit(data, epochs=1, steps_per_epoch=12, verbose=0, callbacks=[SaveMidFit()])
        # The table and its accumulator (both partitioned) were copied before the cut.
        assert saved["stats"]["last_copied_bytes"] == 2 * rows * width * 4, saved["stats"]
        marked = np.concatenate([marks_of(shard).rows.numpy() for shard in shards])
        assert marked.any() and not marked[np.setdiff1d(np.arange(rows), ids.ravel())].any()
        reader = tf.train.load_checkpoint(saved["path"])
        name = min(key for key, shape in reader.get_variable_to_shape_map().items()
                   if shape == [rows, width])  # the table: created before its accumulator
        restored = strategy.restore()
        assert restored["path"] == saved["path"]  # the newest: nothing else saved since
        np.testing.assert_array_equal(table.numpy(), reader.get_tensor(name))
    finally:
        strategy.shutdown()


def test_a_cut_made_again_counts_its_rows_read_again_once(cluster, tmp_path, monkeypatch):
    """`on_each_ps` makes a ps's snapshot work again when a call overtakes a function's registration
    (`until_registered`): made twice here, the cut still reports the 10 rows written since the copy
    once (it reported 20)."""
    from psclient._coordinator.checkpoints import checkpoint_snapshot

    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                variable_partitioner=None)
    try:
        _counter, table, _dense, _frozen, step = build(strategy)
        strategy.schedule(step).result(timeout=120)  # scattered: copied before the next cut
        prepare = fuzzy_copy.prepare

        def prepare_then_write(*args, **kwargs):
            prepared = prepare(*args, **kwargs)
            table.scatter_add(tf.IndexedSlices(tf.ones([10, WIDTH]), tf.range(10, dtype=tf.int64)))  # marked
            return prepared

        on_each_ps = checkpoint_snapshot.on_each_ps

        def each_made_twice(work, **kwargs):
            on_each_ps(work, **kwargs)
            return on_each_ps(work, **kwargs)

        monkeypatch.setattr(fuzzy_copy, "prepare", prepare_then_write)
        monkeypatch.setattr(checkpoint_snapshot, "on_each_ps", each_made_twice)
        path = strategy.save_checkpoint()
        stats = strategy.stats()["checkpoints"]
        assert stats["last_copied_bytes"] == ROWS * WIDTH * 4 and stats["last_rows_read_again"] == 10, stats
        want = expected_table(step.tally.numpy())
        want[:10] += 1.0  # the write between the copy and the cut, read again
        np.testing.assert_array_equal(tf.train.load_checkpoint(path).get_tensor("v000001" + VALUE), want)
    finally:
        strategy.shutdown()


def test_a_delta_diffs_the_copied_cut_and_restores_to_it(cluster, tmp_path, monkeypatch):
    """With deltas on, each checkpoint copies the big variables before its cut too, and a delta diffs
    the cut's values so made (the copy with the rows written since read again) against the previous
    cut's. A table partitioned over both ps (two marked shards of 9.6 MB, row-diffed in the deltas),
    one step at a time, and an eager write between each copy and its cut: full + deltas restore the
    table as it was at the newest delta's cut."""
    from _polling import wait_for

    strategy = psclient.ParameterServerStrategy(
        cluster, checkpoint_dir=str(tmp_path / "ckpt"), delta_checkpoint_every=3,
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
    try:
        with strategy.scope():
            table = tf.Variable(tf.zeros([ROWS, WIDTH]))
            count = tf.Variable(tf.constant(0, tf.int64))
        assert all(marks_of(shard) is not None for shard in table.variables)

        @tf.function
        def step():
            k = tf.convert_to_tensor(count.assign_add(1))  # one read (see build)
            rows = (k * 7919 + tf.range(TOUCHED, dtype=tf.int64) * 104_729) % ROWS
            table.scatter_add(tf.IndexedSlices(tf.ones([TOUCHED, WIDTH]), rows))
            return k

        prepare, between = fuzzy_copy.prepare, []

        def prepare_then_write(*args, **kwargs):
            prepared = prepare(*args, **kwargs)
            if prepared is not None:  # copied: written between the copy and the cut
                table.scatter_add(tf.IndexedSlices(tf.ones([10, WIDTH]), tf.range(10, dtype=tf.int64)))
                between.append(prepared.nbytes)
            return prepared

        monkeypatch.setattr(fuzzy_copy, "prepare", prepare_then_write)
        for delta in (1, 2):  # one step at a time: step k takes number k; a delta after 3 steps
            for _ in range(3):
                strategy.schedule(step).result(timeout=120)
            wait_for(lambda: strategy.stats()["checkpoints"]["deltas_written"] >= delta, 120, f"delta {delta}")
        stats = strategy.stats()["checkpoints"]
        assert stats["deltas_written"] == 2 and between and all(n == ROWS * WIDTH * 4 for n in between), between
        assert stats["last_rows_read_again"] >= 10, stats
        want = expected_table(np.bincount(np.arange(1, 7), minlength=7))
        want[:10] += len(between)
        at_the_cut = table.numpy()
        np.testing.assert_array_equal(at_the_cut, want)
        monkeypatch.setattr(fuzzy_copy, "prepare", prepare)
        table.assign(tf.fill([ROWS, WIDTH], -1.0))
        result = strategy.restore()
        assert len(result["deltas"]) == 2, result
        np.testing.assert_array_equal(table.numpy(), at_the_cut)
        assert int(count.numpy()) == 6
    finally:
        strategy.shutdown()


def test_a_worker_hung_during_the_copy_is_taken_out_before_the_copy_ends(cluster, restore_shared_clusters,
                                                                        tmp_path, monkeypatch):
    """The copy before the cut runs on a thread of its own (`psclient._engine.checkpoint_copy`):
    a worker that hangs while it runs is found by its heartbeat and taken out after hang_timeout,
    its closures run elsewhere, not when the copy ends (1.2 s a GB a ps here; minutes for a big
    model: the heartbeat ran on the copy's thread before). And a copy longer than hang_timeout
    that goes on is not given up (it was, the cut then reading everything). The copy is held at
    its start until the worker is out; training goes on meanwhile; the checkpoint holds its cut."""
    copying, release = threading.Event(), threading.Event()
    copy_in_chunks = stages.copy_in_chunks
    held_since = []

    def held(variable, stage, rows, chunk, stop=None):
        """A copy that goes on (it asks `stop` as between chunks) until released."""
        held_since.append(time.monotonic())
        copying.set()
        for _ in range(1200):  # at most 120 s
            if release.wait(0.1):
                break
            if stop():
                raise stages.CopyStopped("stopped while held")
        return copy_in_chunks(variable, stage, rows, chunk, stop)

    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                variable_partitioner=None, hang_timeout=3.0)
    training = None
    try:
        _counter, _table, _dense, _frozen, step = build(strategy)
        strategy.schedule(step).result(timeout=120)  # scattered: copied before the next cut
        monkeypatch.setattr(stages, "copy_in_chunks", held)
        training = Training(strategy, step)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            saved = pool.submit(strategy.save_checkpoint)
            assert copying.wait(120), "the checkpoint's copy did not start"
            assert [t.name for t in threading.enumerate() if t.name == "psclient-checkpoint-copy"]
            cluster.stop("worker", 1)
            wait_for(lambda: not strategy.stats()["workers"][1]["up"], 60, "worker 1 taken out during the copy")
            done = strategy.stats()["workers"][0]["done"]
            wait_for(lambda: strategy.stats()["workers"][0]["done"] > done + 2, 60, "steps on worker 0 during the copy")
            assert not saved.done() and not release.is_set()
            # Held past hang_timeout for certain: the take-out can come a little under hang_timeout
            # after the stop (the heartbeat counts from its last answer), so the copy too (2.96 s once).
            hold_until = held_since[0] + 3.0 + 0.5
            threading.Event().wait(max(0.0, hold_until - time.monotonic()))
            release.set()
            path = saved.result(timeout=120)
        training.stop()
        assert not training.errors, training.errors  # worker 1's closure ran again on worker 0
        stats = strategy.stats()["checkpoints"]
        # Copied whole, though it took longer than hang_timeout: it went on chunk after chunk.
        assert stats["last_copied_bytes"] == ROWS * WIDTH * 4 and stats["last_copy_seconds"] > 3.0, stats
        assert_holds_its_cut(path, cut_off=1)  # the step worker 1 ran when it was stopped
    finally:
        release.set()
        cluster.resume("worker", 1)
        if training is not None:
            training.stop()
        strategy.shutdown()
    assert not [t.name for t in threading.enumerate() if t.name == "psclient-checkpoint-copy"]


def test_a_ps_lost_during_the_copy_stops_it_and_the_checkpoint_copies_again_after_its_recovery(
        cluster, restore_shared_clusters, tmp_path, monkeypatch):
    """ps 1 killed while a checkpoint's copy runs (held, as a long copy): the copy is stopped
    (`StopCopy`) before the ps's recovery renews the variables it reads, and what it copied is
    never used: after the recovery the checkpoint asked for is taken from the renewed variables
    (copied again if scattered since, else read in the cut) and holds its cut (a stage from
    before the loss would hold a step the restored counter and tally do not)."""
    first_copy, release = threading.Event(), threading.Event()
    calls = []
    copy_in_chunks = stages.copy_in_chunks

    def held(variable, stage, rows, chunk, stop=None):
        calls.append("started")
        if len(calls) == 1:  # the first copy: held until it is stopped (at most 120 s)
            first_copy.set()
            for _ in range(1200):
                if stop():
                    calls.append("stopped")
                    raise stages.CopyStopped("stopped while held")
                if release.wait(0.1):
                    break
        return copy_in_chunks(variable, stage, rows, chunk, stop)

    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                variable_partitioner=None, ps_recovery="all", hang_timeout=3.0)
    try:
        counter, table, _dense, _frozen, step = build(strategy)
        strategy.schedule(step).result(timeout=120)
        previous = strategy.save_checkpoint()  # what the lost ps is restored from
        strategy.schedule(step).result(timeout=120)  # scattered since: copied before the next cut
        monkeypatch.setattr(stages, "copy_in_chunks", held)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            saved = pool.submit(strategy.save_checkpoint)
            assert first_copy.wait(120), "the checkpoint's copy did not start"
            cluster.kill("ps", 1)
            cluster.restart("ps", 1)
            # A step meets the restarted ps: the loss is seen, the copy stopped, the ps recovered.
            assert int(strategy.schedule(step).result(timeout=150)) >= 1
            path = saved.result(timeout=150)
        assert calls[:2] == ["started", "stopped"], calls
        assert strategy.stats()["ps"][1]["recoveries"] == 1
        assert path is not None and path != previous
        assert_holds_its_cut(path)
        np.testing.assert_array_equal(table.numpy(), expected_table(step.tally.numpy()))
        assert step.tally.numpy().sum() == int(counter.numpy())
    finally:
        release.set()
        strategy.shutdown()
    assert not [t.name for t in threading.enumerate() if t.name == "psclient-checkpoint-copy"]
