"""A hung ps (SIGSTOPped) during a checkpoint or a restore: bounded waits, on a real cluster.

The save or restore gives up after hang_timeout with an error naming the ps;
the previous checkpoint stays the newest (a write given up on is never merged,
its scratch directory removed once the ps answers); after SIGCONT training and
the next checkpoint work, and no thread is left behind.
"""

import glob
import threading
import time

import pytest
import tensorflow as tf
from _polling import wait_for

import psclient
from psclient._coordinator.checkpoints.checkpoint_parts import CheckpointWriteError, late_threads
from psclient._core.errors import PSUnavailableError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

HANG_TIMEOUT = 3.0
#: Beyond hang_timeout: a loaded machine's scheduling, the error's way back to the caller.
SLACK_S = 20.0


@pytest.fixture
def cluster(one_worker_two_ps, restore_shared_clusters):
    """The shared 1 worker + 2 ps; every task runs again after the test (SIGCONT)."""
    return one_worker_two_ps


def build(strategy):
    with strategy.scope():
        with tf.device("/job:ps/task:0"):
            counter = tf.Variable(0.0)
        with tf.device("/job:ps/task:1"):
            table = tf.Variable(tf.zeros([10_000, 8]))

    @tf.function
    def step():
        counter.assign_add(1.0)
        table.assign_add(tf.ones([10_000, 8]))
    return counter, table, step


def timed(call):
    started = time.monotonic()
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test looks at it
        return error, time.monotonic() - started
    return None, time.monotonic() - started


def check_back_to_normal(strategy, cluster, directory, step, counter, previous):
    cluster.resume("ps", 1)
    wait_for(lambda: not late_threads(), 60, "the calls left waiting on ps:1 to return")
    wait_for(lambda: not glob.glob(str(directory / ".psclient-*")), 30, "the abandoned scratch directory removed")
    assert tf.train.latest_checkpoint(str(directory)) == previous
    strategy.schedule(step).result(timeout=60)
    path = strategy.save_checkpoint()
    assert path != previous and tf.train.latest_checkpoint(str(directory)) == path
    assert float(tf.train.load_checkpoint(path).get_tensor("v000000/.ATTRIBUTES/VARIABLE_VALUE")) == float(
        counter.read_value())


@pytest.mark.parametrize("when", ["snapshot", "write"])
def test_a_ps_stopped_during_a_save_fails_it_within_hang_timeout_naming_the_ps(cluster, tmp_path, when):
    directory = tmp_path / "ckpt"
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(directory), hang_timeout=HANG_TIMEOUT)
    try:
        counter, _table, step = build(strategy)
        strategy.schedule(step).result(timeout=60)
        previous = tf.train.latest_checkpoint(str(directory))
        assert previous is not None
        if when == "snapshot":
            cluster.stop("ps", 1)
        else:  # after the cut: each ps writes its part while training goes on
            strategy._recovery.checkpoints.before_write = lambda path: cluster.stop("ps", 1)  # noqa: SLF001
        error, waited = timed(strategy.save_checkpoint)
        strategy._recovery.checkpoints.before_write = None  # noqa: SLF001
        assert isinstance(error, CheckpointWriteError), error
        assert "ps:1" in str(error) and "within 3 s" in str(error), error
        assert waited < HANG_TIMEOUT + SLACK_S
        assert tf.train.latest_checkpoint(str(directory)) == previous
        assert strategy.stats()["checkpoints"]["writing"] is False
        check_back_to_normal(strategy, cluster, directory, step, counter, previous)
    finally:
        cluster.resume("ps", 1)
        strategy.shutdown()
    assert not late_threads()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("psclient-ckpt")]


def test_a_restore_with_a_stopped_ps_fails_within_hang_timeout_naming_the_ps(cluster, tmp_path):
    directory = tmp_path / "ckpt"
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(directory), hang_timeout=HANG_TIMEOUT)
    try:
        counter, _table, step = build(strategy)
        strategy.schedule(step).result(timeout=60)
        previous = strategy.save_checkpoint()
        cluster.stop("ps", 1)
        error, waited = timed(strategy.restore)
        assert isinstance(error, PSUnavailableError), error
        assert error.task == "ps:1" and "hang_timeout=3" in str(error), error
        assert waited < HANG_TIMEOUT + SLACK_S
        cluster.resume("ps", 1)
        wait_for(lambda: not late_threads(), 60, "the reads left waiting on ps:1 to return")
        assert strategy.restore()["path"] == previous
        check_back_to_normal(strategy, cluster, directory, step, counter, previous)
    finally:
        cluster.resume("ps", 1)
        strategy.shutdown()
    assert not late_threads()
