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
from psclient._coordinator.checkpoints import checkpoint as checkpoint_module
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


def build(strategy, marked=False):
    """A counter on ps:0, a table on ps:1 added to whole by each step; `marked`: a table of 19 MB
    updated by a scatter instead, which a checkpoint copies before its cut (`fuzzy_copy`)."""
    shape = [300_000, 16] if marked else [10_000, 8]
    with strategy.scope():
        with tf.device("/job:ps/task:0"):
            counter = tf.Variable(0.0)
        with tf.device("/job:ps/task:1"):
            table = tf.Variable(tf.zeros(shape))

    @tf.function
    def step():
        counter.assign_add(1.0)
        if marked:
            table.scatter_add(tf.IndexedSlices(tf.ones([2, shape[1]]), tf.constant([0, shape[0] - 1])))
        else:
            table.assign_add(tf.ones(shape))
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


@pytest.mark.parametrize("marked", [False, True], ids=["read-in-the-cut", "copied-before-the-cut"])
@pytest.mark.parametrize("when", ["snapshot", "write"])
def test_a_ps_stopped_during_a_save_fails_it_within_hang_timeout_naming_the_ps(cluster, tmp_path, when, marked,
                                                                              monkeypatch):
    """Stopped before the save (its copy before the cut gives up after hang_timeout, and the
    checkpoint fails with it, no cut taken; without a copy, the cut gives up), or as its write
    starts (the write gives up after hang_timeout; the stages' release then does not wait for that
    ps again). The hung ps is waited on once: before, a copy's give-up was followed by a cut that
    waited as long again, dispatch paused, and a failed cut by a check of the hung ps's handles
    (probe_timeout): a save took 2 x hang_timeout."""
    gave_up, cuts, skipped = [], [], []
    write_snapshot = checkpoint_module._snapshot.write_snapshot  # noqa: SLF001
    take_snapshot = checkpoint_module._snapshot.take_snapshot  # noqa: SLF001

    def cutting(*args, **kwargs):
        cuts.append(time.monotonic())
        return take_snapshot(*args, **kwargs)

    def recording(*args, **kwargs):
        try:
            return write_snapshot(*args, **kwargs)
        except CheckpointWriteError:
            gave_up.append(time.monotonic())
            raise

    monkeypatch.setattr(checkpoint_module._snapshot, "write_snapshot", recording)  # noqa: SLF001
    monkeypatch.setattr(checkpoint_module._snapshot, "take_snapshot", cutting)  # noqa: SLF001
    directory = tmp_path / "ckpt"
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(directory), hang_timeout=HANG_TIMEOUT,
                                                variable_partitioner=None)
    try:
        counter, _table, step = build(strategy, marked)
        strategy.schedule(step).result(timeout=60)
        previous = tf.train.latest_checkpoint(str(directory))
        assert previous is not None
        probes = strategy._recovery.probes  # noqa: SLF001
        stale_ps = probes.stale_ps
        monkeypatch.setattr(probes, "stale_ps",
                            lambda skip=frozenset(): skipped.append(set(skip)) or stale_ps(skip))
        cuts.clear()
        if when == "snapshot":
            cluster.stop("ps", 1)
        else:  # after the cut: each ps writes its part while training goes on
            strategy._recovery.checkpoints.before_write = lambda path: cluster.stop("ps", 1)  # noqa: SLF001
        error, waited = timed(strategy.save_checkpoint)
        returned = time.monotonic()
        strategy._recovery.checkpoints.before_write = None  # noqa: SLF001
        assert isinstance(error, CheckpointWriteError), error
        assert "ps:1" in str(error) and "within 3 s" in str(error), error
        assert waited < HANG_TIMEOUT + SLACK_S
        assert tf.train.latest_checkpoint(str(directory)) == previous
        assert strategy.stats()["checkpoints"]["writing"] is False
        if marked and when == "write":  # the table was copied before the cut, its stage then waited on
            assert strategy.stats()["checkpoints"]["last_copied_bytes"] == 300_000 * 16 * 4
        if when == "write":  # returned without a second hang_timeout for the stopped ps's stages
            assert len(gave_up) == 1 and returned - gave_up[0] < HANG_TIMEOUT, (returned, gave_up)
        if when == "snapshot" and marked:  # the copy gave up: no cut
            assert cuts == [] and "could not copy" in str(error), (cuts, error)
        if when == "snapshot" and not marked:  # the cut gave up: the hung ps is not checked again
            assert len(cuts) == 1 and "could not take its snapshot" in str(error), (cuts, error)
            assert skipped and all(skip == {1} for skip in skipped), skipped
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


def test_shutdown_returns_while_a_ps_still_hangs_and_the_next_strategy_trains(cluster, tmp_path, caplog):
    """A save given up on a SIGSTOPped ps, then `shutdown()` with the ps still stopped: it returns
    (TF's update_server_def, which leaving the cluster calls, would wait on the ps for good: it
    held shutdown until the ps answered) and says why TF's view is kept; once the ps answers, a
    new strategy on the same cluster trains and saves."""
    directory = tmp_path / "ckpt"
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(directory), hang_timeout=HANG_TIMEOUT)
    shut = threading.Event()
    try:
        _counter, _table, step = build(strategy)
        strategy.schedule(step).result(timeout=60)
        cluster.stop("ps", 1)
        error, _ = timed(strategy.save_checkpoint)
        assert isinstance(error, CheckpointWriteError), error
        caplog.set_level("WARNING", logger="psclient")
        closer = threading.Thread(target=lambda: (strategy.shutdown(), shut.set()), name="test-shutdown", daemon=True)
        closer.start()
        # hang_timeout for the running calls, probe_timeout for the ps probe, a loaded machine's slack.
        assert shut.wait(HANG_TIMEOUT + SLACK_S + 30), "shutdown() waited on the stopped ps"
        assert "ps task(s) [1] do not answer" in caplog.text
    finally:
        cluster.resume("ps", 1)
        strategy.shutdown()
    wait_for(lambda: not late_threads(), 60, "the calls left waiting on ps:1 to return")
    again = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "again"), hang_timeout=HANG_TIMEOUT)
    try:
        counter, _table, step = build(again)
        again.schedule(step).result(timeout=60)
        path = again.save_checkpoint()
        assert float(tf.train.load_checkpoint(path).get_tensor("v000000/.ATTRIBUTES/VARIABLE_VALUE")) == float(
            counter.read_value()) == 1.0
    finally:
        again.shutdown()


@pytest.mark.long
def test_a_restore_slower_than_hang_timeout_on_a_ps_that_answers_goes_on(cluster, tmp_path):
    """A ps throttled to 2% of its speed (SIGSTOP/SIGCONT, 10 ms of every 0.5 s) answers every probe
    within about half a second but restores a 256 MB variable for about twice hang_timeout (6.5 s
    here). The restore waits for it; until 2026-12-06 each call on a ps was given up `hang_timeout`
    after it began (this test then failed with "restore: ps:1 ... did not answer within
    hang_timeout=3 s"), and a seeded chaos plan lost a ps for good so, its restore slow on a loaded
    machine. (At 1%, 5 ms of every 0.5 s, the restore's own work took the windows and a probe went
    3 s without an answer: given up, as a ps that answers nothing for hang_timeout is.)"""
    directory = tmp_path / "ckpt"
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(directory), hang_timeout=HANG_TIMEOUT)
    try:
        with strategy.scope(), tf.device("/job:ps/task:1"):
            big = tf.Variable(tf.fill([16_000_000, 4], 1.0))
        path = strategy.save_checkpoint()
        big.assign(tf.zeros_like(big))
        cluster.throttle("ps", 1, 0.02, period=0.5)
        started = time.monotonic()
        restored = strategy.restore()
        took = time.monotonic() - started
        cluster.throttle("ps", 1, 1.0)
        assert restored["path"] == path
        assert float(tf.reduce_min(big.read_value())) == 1.0
        print(f"restore on the throttled ps took {took:.1f} s (hang_timeout {HANG_TIMEOUT} s)")
        assert took > HANG_TIMEOUT, "the restore was not slow enough to show anything: throttle harder"
    finally:
        cluster.throttle("ps", 1, 1.0)
        strategy.shutdown()
    assert not late_threads()
