"""pipeline_depth=2 on a real cluster: every call has run when its future is done.

Above depth 1 calls go through TF's streaming enqueue and return once sent;
psclient waits for each call's answer (psclient/_coordinator/completion.py).
Without that, 300 calls of a function that returned nothing left the variable
they incremented at 74 after join(), and the coordinator crashed at exit.

This module's strategy runs on a LocalCluster of its own: TF keeps one
connection per process and the shared cluster's modules connect at depth 1.
"""

import collections

import pytest
import tensorflow as tf
from _busy_step import busy_counting_step
from _polling import wait_for

import psclient
from psclient._cluster.local import LocalCluster

pytestmark = pytest.mark.cluster

_CALLS = 300


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_workers=2, num_ps=1, start_timeout=300) as local:
        yield local


@pytest.fixture(scope="module")
def strategy(cluster):
    s = psclient.ParameterServerStrategy(cluster.cluster, pipeline_depth=2)
    yield s
    s.shutdown()


def test_functions_without_outputs_have_run_when_join_returns(strategy):
    assert strategy.pipeline_depth == 2
    with strategy.scope():
        v = tf.Variable(0.0)

    @tf.function
    def add_one():
        v.assign_add(1.0)

    for round_ in range(3):
        futures = [strategy.schedule(add_one) for _ in range(_CALLS)]
        strategy.join(timeout=300)
        # Nothing failed, so nothing ran twice: exactly once each, every round.
        assert all(f.done() and f.exception(timeout=0) is None for f in futures)
        assert v.numpy() == _CALLS * (round_ + 1)
    assert sum(w["retried"] for w in strategy.stats()["workers"]) == 0


def test_functions_with_outputs_each_applied_once(strategy):
    with strategy.scope():
        counter = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def count(i):
        counter.assign_add(i)
        return i * 2

    # Not `return counter.assign_add(1)`: its value is a second read of the variable, after
    # the add but not atomic with it (another worker's add can come between).
    futures = [strategy.schedule(count, args=(tf.constant(i, tf.int64),)) for i in range(1, _CALLS + 1)]
    strategy.join(timeout=300)
    # Each future got its own call's output, and each call was applied once.
    assert [int(f.result(0)) for f in futures] == [2 * i for i in range(1, _CALLS + 1)]
    assert counter.numpy() == _CALLS * (_CALLS + 1) // 2


def test_per_worker_iterator_steps_without_outputs(strategy):
    with strategy.scope():
        total = tf.Variable(0, dtype=tf.int64)
        taken = tf.Variable(0, dtype=tf.int64)
    iterator = iter(strategy.distribute_datasets_from_function(lambda ctx: tf.data.Dataset.range(10_000)))

    @tf.function
    def consume(it):
        total.assign_add(next(it))
        taken.assign_add(1)

    for _ in range(100):
        strategy.schedule(consume, args=(iterator,))
    strategy.join(timeout=300)
    assert taken.numpy() == 100
    # Each worker reads its own range(10000) from 0: the sum is that of two prefixes.
    assert total.numpy() <= sum(range(100))


def checked_sum(strategy):
    """A ps variable and a function adding its argument to it, failing on one not positive.

    The addition is ordered after the assertion: unordered, TF runs it although the assertion
    failed (without a cluster always; on one sometimes: `benchmarks/depth_errors.py`)."""
    with strategy.scope():
        v = tf.Variable(0.0)

    @tf.function
    def checked(x):
        with tf.control_dependencies([tf.debugging.assert_positive(x, message="x must be positive")]):
            v.assign_add(x)

    return v, checked


def test_a_killed_worker_work_runs_again_elsewhere(cluster, strategy):
    v, step = busy_counting_step(strategy)
    futures = [strategy.schedule(step) for _ in range(_CALLS)]
    psclient.wait(futures[:20], timeout=120)
    cluster.kill("worker", 1)
    strategy.join(timeout=300)
    assert all(f.done() and not f.cancelled() and f.exception(timeout=0) is None for f in futures)
    stats = strategy.stats()
    assert stats["workers"][1]["up"] is False
    retried = sum(w["retried"] for w in stats["workers"])
    assert retried >= 1
    # At least once: a call cut off by the kill may have applied before it died.
    assert _CALLS <= v.numpy() <= _CALLS + retried
    by_worker = collections.Counter({w: s["done"] for w, s in enumerate(stats["workers"])})
    assert by_worker[0] > 0
    before = v.numpy()
    strategy.schedule(step)
    strategy.join(timeout=300)
    assert v.numpy() == before + 1
    # Back for the tests after it (the function-error tests come last: see `_known_stuck_call`).
    cluster.restart("worker", 1)
    wait_for(lambda: strategy.stats(read_ps=False)["workers"][1]["up"], 120, "worker 1 to rejoin")


def test_an_error_surfaces_at_join_and_the_strategy_goes_on(cluster, strategy):
    v, checked = checked_sum(strategy)

    with pytest.raises(tf.errors.InvalidArgumentError, match="x must be positive"):
        bad = strategy.schedule(checked, args=(tf.constant(-1.0),))
        strategy.join(timeout=300)
    assert isinstance(bad.exception(timeout=0), tf.errors.InvalidArgumentError)
    strategy.join(timeout=300)
    # Later calls on the same dispatcher threads (their executors) still run.
    one = tf.constant(1.0)
    futures = [strategy.schedule(checked, args=(one,)) for _ in range(50)]
    try:
        strategy.join(timeout=120)
    except TimeoutError:
        _known_stuck_call(cluster, strategy)
    assert all(f.exception(timeout=0) is None for f in futures)
    assert v.numpy() == 50.0  # each applied once; the failing call's addition not at all


def _known_stuck_call(cluster, strategy):
    """Seen in about one full suite run in five, in either test of a function's error at depth 2:
    an expected failure, naming the known limit. The stuck call's worker is restarted, which ended
    the call in earlier runs, but not in one on 2026-12-04 (the dispatcher thread stayed in TF's
    call, and the next join and test waited until their timeouts): so these tests come last in
    the module, and nothing waits on the call here."""
    for index, worker in enumerate(strategy.stats(read_ps=False)["workers"]):
        if worker["in_flight"]:
            cluster.restart("worker", index)
    pytest.xfail("known limit (docs/api.md, pipeline_depth): after a function's error at depth 2, "
                 "a call on a healthy worker waited for good in TF's streaming enqueue")


def test_a_function_error_leaves_no_error_behind_on_the_dispatchers_executors(cluster, strategy):
    """At depth 2 a call's error reached the dispatcher before TF's executor had finished the call,
    which then set the error again after psclient cleared it: TF's next wait raised it, printed as
    "Exception ignored in: <function Executor.__del__ ...>" (32 times in 600 failing calls, with
    benchmarks/depth_errors.py), and the executor kept it. With 300 failing calls this failed on the
    parent commit 5 times in 5."""
    import sys

    v, checked = checked_sum(strategy)

    ignored = []
    hook, sys.unraisablehook = sys.unraisablehook, ignored.append
    try:
        for _ in range(300):
            strategy.schedule(checked, args=(tf.constant(-1.0),))
            try:
                strategy.join(timeout=120)
            except tf.errors.InvalidArgumentError as error:
                assert "x must be positive" in str(error)
            except TimeoutError:
                _known_stuck_call(cluster, strategy)
            else:
                pytest.fail("join() raised nothing after a call that failed its assertion")
    finally:
        sys.unraisablehook = hook
    assert [f"{u.exc_type.__name__} in {u.object!r}" for u in ignored] == []
