"""TF's ClusterCoordinator contract, run through `psclient.ClusterCoordinator`.

Written from the documented behaviour of `tf.distribute.coordinator.
ClusterCoordinator` and TF's `ParameterServerStrategy` (their docstrings in
TF's cluster_coordinator.py and parameter_server_strategy_v2.py): one
coordinator per strategy, RemoteValue inputs refused, errors cleared once
raised, cross-replica context in scope, run/reduce inside scheduled functions,
per-worker variables, partitioned embedding lookups. The error rule's pure
part is tested on the scheduler alone first, without a cluster.
"""

import concurrent.futures
import logging
import threading

import numpy as np
import pytest

from psclient._core.future import Future
from psclient._core.scheduler import Closure, Scheduler


def _closure(name):
    return Closure(lambda: None, (), {}, Future(name))


# ------------------------------------------------------- the error rule, pure
def test_raising_an_error_clears_the_errors_of_closures_that_were_running():
    """TF: schedule/join/done raise one error and clear those collected so far."""
    s = Scheduler(num_workers=2)
    a, b, queued = _closure("a"), _closure("b"), _closure("queued")
    for c in (a, b, queued):
        s.submit(c)
    assert s.take(0, timeout=0) is a
    assert s.take(1, timeout=0) is b
    s.failed(0, a, ValueError("a failed"), retry=False)
    assert queued.future.cancelled()

    raised = []

    def schedule_more():
        try:
            s.submit(_closure("next"))
        except ValueError as error:
            raised.append(error)

    # schedule() waits for `b` (still running) before it raises...
    t = threading.Thread(target=schedule_more)
    t.start()
    t.join(0.2)
    assert t.is_alive(), "submit() raised while a closure was still running"
    s.failed(1, b, ValueError("b failed too"), retry=False)
    t.join(10)
    assert not t.is_alive()
    assert [str(e) for e in raised] == ["a failed"]
    # ...and b's error was cleared with a's: the next join() raises nothing.
    assert s.join(timeout=5) is True
    assert isinstance(b.future.exception(timeout=0), ValueError)


def test_a_retry_while_an_error_is_pending_is_cancelled_not_run_again():
    s = Scheduler(num_workers=2)
    a, b = _closure("a"), _closure("b")
    s.submit(a)
    s.submit(b)
    s.take(0, timeout=0)
    s.take(1, timeout=0)
    s.failed(0, a, RuntimeError("boom"), retry=False)
    s.failed(1, b, ConnectionError("transient"), retry=True)
    with pytest.raises(concurrent.futures.CancelledError):
        b.future.result(timeout=0)
    assert s.take(1, timeout=0) is None
    with pytest.raises(RuntimeError, match="boom"):
        s.done()
    assert s.done() is True


def test_a_lost_workers_closures_are_cancelled_while_an_error_is_pending():
    s = Scheduler(num_workers=2)
    a, b = _closure("a"), _closure("b")
    s.submit(a)
    s.submit(b)
    s.take(0, timeout=0)
    s.take(1, timeout=0)
    s.failed(0, a, RuntimeError("boom"), retry=False)
    assert s.worker_lost(1) == []
    assert b.future.exception(timeout=0) is not None or b.future.cancelled()
    with pytest.raises(RuntimeError, match="boom"):
        s.join(timeout=5)
    assert s.join(timeout=5) is True


# ------------------------------------------------------------- on a cluster
tf = pytest.importorskip("tensorflow")
import psclient  # noqa: E402


@pytest.mark.cluster
def test_a_strategy_has_one_coordinator(strategy):
    first = psclient.ClusterCoordinator(strategy)
    assert psclient.ClusterCoordinator(strategy) is first
    assert psclient.ClusterCoordinator(strategy=strategy) is first
    assert first.strategy is strategy


@pytest.mark.cluster
def test_a_future_as_an_input_of_schedule_is_refused_at_once(strategy):
    coordinator = psclient.ClusterCoordinator(strategy)

    @tf.function
    def one():
        return tf.constant(1)

    @tf.function
    def plus_one(x):
        return x + 1

    first = coordinator.schedule(one)
    for kwargs in ({"args": (first,)}, {"kwargs": {"x": first}}, {"args": ([first],)}):
        with pytest.raises(ValueError, match=r"result of an earlier schedule\(\)"):
            coordinator.schedule(plus_one, **kwargs)
    coordinator.join()
    assert coordinator.schedule(plus_one, args=(first.result(),)).result(timeout=120) == 2


@pytest.mark.cluster
def test_an_error_raised_by_schedule_is_not_raised_again_by_join(strategy):
    coordinator = psclient.ClusterCoordinator(strategy)

    @tf.function
    def fails(x):
        tf.debugging.assert_equal(x, 2, message="deliberate failure")
        return x

    @tf.function
    def ok():
        return tf.constant(7)

    failing = [coordinator.schedule(fails, args=(tf.constant(1),)) for _ in range(6)]
    # The first failure is raised by a schedule(), done() or join(); only once.
    raised = 0
    with pytest.raises(tf.errors.InvalidArgumentError, match="deliberate failure"):
        try:
            for _ in range(2000):
                coordinator.schedule(ok)
                coordinator.done()
        finally:
            raised += 1
    coordinator.join()  # the other failures were cleared with the first
    assert coordinator.done() is True
    for future in failing:
        assert future.done()
    assert coordinator.schedule(ok).result(timeout=120) == 7
    coordinator.join()
    assert raised == 1


@pytest.mark.cluster
def test_cross_replica_context_in_scope_and_run_reduce_in_a_scheduled_function(strategy, caplog):
    coordinator = psclient.ClusterCoordinator(strategy)
    assert not tf.distribute.in_cross_replica_context()
    contexts = []
    with strategy.scope():
        assert tf.distribute.in_cross_replica_context()
        assert tf.distribute.get_replica_context() is None
        v = tf.Variable(1.0)
        counter = tf.Variable(0.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        summed = tf.Variable(1.0, aggregation=tf.VariableAggregation.SUM)

        @tf.function
        def step(x):
            contexts.append(("step", tf.distribute.in_cross_replica_context()))

            def replica_fn(x):
                contexts.append(("replica", tf.distribute.in_cross_replica_context()))
                ctx = tf.distribute.get_replica_context()
                summed.assign(tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32))
                counter.assign_add(x)
                return x + v, x - v

            per_replica = strategy.run(replica_fn, args=(x,))
            return strategy.reduce("SUM", per_replica, axis=None)

        with caplog.at_level(logging.WARNING, logger="psclient"):
            inside = coordinator.schedule(step, args=(tf.constant(3.0),))
            assert inside.fetch() == (4.0, 2.0)
    assert not tf.distribute.in_cross_replica_context()
    outside = coordinator.schedule(step, args=(tf.constant(3.0),))
    assert coordinator.fetch(outside) == (4.0, 2.0)
    coordinator.join()
    # One replica per call: ONLY_FIRST_REPLICA and SUM aggregate one value each.
    assert counter.numpy() == 6.0
    assert summed.numpy() == strategy.num_replicas_in_sync == 1
    assert ("step", True) in contexts and ("replica", False) in contexts
    assert ("replica", True) not in contexts
    # Traced by schedule(): no warning about running on the coordinator.
    assert not [r for r in caplog.records if "without using `ClusterCoordinator.schedule`" in r.message]


@pytest.mark.cluster
def test_run_and_reduce_outside_schedule_warn_as_tf_does(strategy, caplog):
    with caplog.at_level(logging.WARNING, logger="psclient"):
        result = strategy.run(lambda x: x * 2, args=(tf.constant(2.0),))
        reduced = strategy.reduce(tf.distribute.ReduceOp.MEAN, result, axis=None)
    assert reduced.numpy() == 4.0
    warnings = [r.message for r in caplog.records if "without using `ClusterCoordinator.schedule`" in r.message]
    assert len(warnings) == 2 and "run()" in warnings[0] and "reduce()" in warnings[1]
    with pytest.raises(ValueError, match="reduce_op"):
        strategy.reduce("MAX", reduced)


@pytest.mark.cluster
def test_run_inside_scope_on_the_coordinator_is_a_replica_context(strategy):
    with strategy.scope():
        inside = strategy.run(lambda: tf.distribute.in_cross_replica_context())
        assert tf.distribute.in_cross_replica_context()
    assert inside is False
