"""Checkpoints that do not stop training, on a real cluster.

A checkpoint is taken in a cut (no closure running): each ps keeps a snapshot
of its variables, dispatch resumes, and the snapshot is written in the
background. The write is held open here with the checkpoint store's
`before_write` hook (no sleeps): closures complete meanwhile, and the
checkpoint holds exactly the values of the cut, dense and sparse-updated
variables alike. A write that fails reaches `save_checkpoint()`'s caller.
"""

import os
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import psclient
from psclient._coordinator.checkpoints.checkpoint_parts import CheckpointWriteError, late_threads

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

ROWS = 50_000
VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"


@pytest.fixture(scope="module")
def cluster(one_worker_two_ps):
    return one_worker_two_ps


def build(strategy):
    """A counter and a table on ps:0 (the table updated by scatter ops: TF's copy-on-read mode),
    a dense variable on ps:1; each step adds 1 to all three."""
    with strategy.scope():
        with tf.device("/job:ps/task:0"):
            counter = tf.Variable(0.0)
            sparse = tf.Variable(tf.zeros([ROWS, 8]))
        with tf.device("/job:ps/task:1"):
            dense = tf.Variable(tf.zeros([ROWS, 8]))

    @tf.function
    def step():
        counter.assign_add(1.0)
        dense.assign_add(tf.ones([ROWS, 8]))
        sparse.scatter_add(tf.IndexedSlices(tf.ones([2, 8]), tf.constant([0, ROWS - 1])))
    return counter, sparse, dense, step


class HeldWrite:
    """`before_write` hook: tells when a write starts (the snapshot taken), holds it until released."""

    def __init__(self, on_enter=None):
        self.entered, self.release = threading.Event(), threading.Event()
        self._on_enter = on_enter

    def __call__(self, path):
        if self.entered.is_set():
            return  # later writes (the test's next checkpoints) go through
        if self._on_enter is not None:
            self._on_enter(path)
        self.entered.set()
        started = time.monotonic()
        assert self.release.wait(60), "the test never released the write"
        self.held_s = time.monotonic() - started


def save_in_thread(strategy):
    outcome = {}

    def save():
        try:
            outcome["path"] = strategy.save_checkpoint()
        except Exception as error:  # noqa: BLE001 - the test looks at it
            outcome["error"] = error
    thread = threading.Thread(target=save, name="test-save")
    thread.start()
    return thread, outcome


def test_training_goes_on_while_a_checkpoint_is_written_and_it_holds_the_cut(cluster, tmp_path):
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        counter, sparse, dense, step = build(strategy)
        strategy.schedule(step).result(timeout=60)  # (checkpoints the new variables first)
        held = HeldWrite()
        strategy._recovery.checkpoints.before_write = held  # noqa: SLF001 - the test's hook
        for _ in range(10):
            strategy.schedule(step)
        saver, outcome = save_in_thread(strategy)
        assert held.entered.wait(60), "the checkpoint's write never started"
        # The snapshot is taken and dispatch resumed: closures complete while the write is held.
        assert strategy.stats()["checkpoints"]["writing"]
        futures = [strategy.schedule(step) for _ in range(10)]
        for future in futures:
            future.result(timeout=60)
        assert strategy.stats()["checkpoints"]["writing"] and saver.is_alive() and not outcome
        held.release.set()
        saver.join(60)
        path = outcome["path"]

        reader = tf.train.load_checkpoint(path)
        cut = float(reader.get_tensor("v000000" + VALUE))
        assert cut == reader.get_tensor("psclient_completed" + VALUE) >= 1
        now = float(counter.read_value())
        assert now >= cut + 10, (now, cut)  # the 10 steps ran after the cut
        # The live table took every update after the cut: the snapshot shared its buffer (out of
        # TF's copy-on-read mode) and the first scatter after the cut copied it before writing.
        assert float(sparse.read_value()[0, 0]) == now == float(sparse.read_value()[ROWS - 1, 7])
        # Exactly the cut's values, though training changed every variable after it.
        np.testing.assert_array_equal(reader.get_tensor("v000001" + VALUE)[[0, ROWS - 1]], cut)
        assert float(reader.get_tensor("v000001" + VALUE)[1:-1].max()) == 0.0
        assert np.all(reader.get_tensor("v000002" + VALUE) == cut)
        restored = strategy.restore()
        assert restored["path"] == path
        assert float(counter.read_value()) == cut
        assert float(tf.reduce_max(dense.read_value())) == cut == float(tf.reduce_min(dense.read_value()))
        assert float(sparse.read_value()[ROWS - 1, 3]) == cut

        checkpoints = strategy.stats()["checkpoints"]
        assert not checkpoints["writing"] and checkpoints["write_errors"] == 0
        # The write's time counts the test's hold; the pause (the cut and the snapshot) is apart from it.
        assert checkpoints["last_write_seconds"] >= held.held_s
        assert checkpoints["last_stall_seconds"] >= checkpoints["last_snapshot_seconds"] > 0.0
        assert strategy.stats()["checkpoints_written"] == 2
    finally:
        strategy.shutdown()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("psclient-ckpt")]


def test_a_failed_background_write_reaches_the_caller_and_the_previous_checkpoint_stays(cluster, tmp_path):
    directory = tmp_path / "ckpt"
    moved = tmp_path / "moved-away"
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(directory))

    def break_directory(path):
        # The directory is replaced by a file after the snapshot: nothing can be written there.
        os.rename(directory, moved)
        directory.write_text("not a directory")
    try:
        counter, _sparse, _dense, step = build(strategy)
        strategy.schedule(step).result(timeout=60)
        previous = tf.train.latest_checkpoint(str(directory))
        held = HeldWrite(on_enter=break_directory)
        held.release.set()
        strategy._recovery.checkpoints.before_write = held  # noqa: SLF001 - the test's hook
        with pytest.raises(CheckpointWriteError, match="scratch directory"):
            strategy.save_checkpoint()
        stats = strategy.stats()["checkpoints"]
        assert stats["write_errors"] == 1 and "CheckpointWriteError" in stats["last_write_error"]
        os.remove(directory)
        os.rename(moved, directory)
        assert tf.train.latest_checkpoint(str(directory)) == previous
        strategy.schedule(step).result(timeout=60)  # training went on
        path = strategy.save_checkpoint()
        assert path != previous and tf.train.latest_checkpoint(str(directory)) == path
        assert float(tf.train.load_checkpoint(path).get_tensor("v000000" + VALUE)) == float(counter.read_value())
    finally:
        strategy.shutdown()
    assert not late_threads()
