"""A scheduled function whose registration was lost on the workers is traced anew and runs.

TF sends a function to the tasks only at its first reference in the process; one whose
registration never arrived (seen once for a function of psclient's own in a seeded chaos plan,
docs/chaos.md, seed 419) failed every later call "not registered". A closure's calls are retried
for a registration still on its way; once those are spent, the dispatcher has the tracer trace
the function anew under a new name (a new generation: `Tracer.renew`) and calls that. Here the
registration is lost for real: the function is removed from every task (TF's `remove_function`).
A `ConcreteFunction` scheduled directly cannot be traced anew: its future fails with TF's error.
A worker's dataset, built again when the worker rejoins, comes from a traced dataset function
too: once its registration is lost, that function is traced anew the same way
(`until_registered`'s `remake`), where every closure given that worker's iterator failed before.
So is a `tf.function` given to `create_per_worker_resource`, whose value is built again at a rejoin
too (made anew from its Python code; before, that worker's value failed at every rebuild).
"""

from __future__ import annotations

import logging

import pytest
from _polling import wait_for

import psclient
from psclient._engine import dispatch
from psclient._tf import registrations

tf = pytest.importorskip("tensorflow")
from tensorflow.python.eager import context  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


@pytest.fixture()
def few_attempts(monkeypatch):
    """Three calls per trace instead of 25 (about 10 s of pauses)."""
    monkeypatch.setattr(dispatch, "_NOT_REGISTERED_ATTEMPTS", 3)
    monkeypatch.setattr(registrations, "ATTEMPTS", 3)


@pytest.fixture()
def lose():
    """`lose(name_part)`: remove every function whose name holds `name_part` from this process and
    every task. Added back (here) when the test ends: TF removes a function again when its last
    reference goes, and one already gone raised there, inside a garbage collection."""
    lost = []

    def remove(name_part: str) -> list[str]:
        names = [name for name in context.context().list_function_names() if name_part in name]
        for name in names:
            lost.append(context.context().get_function_def(name))
            context.context().remove_function(name)
        return names

    yield remove
    for function_def in lost:
        context.context().add_function_def(function_def)


def test_a_scheduled_function_whose_registration_was_lost_is_traced_anew(local_cluster, few_attempts, lose, caplog):
    strategy = psclient.ParameterServerStrategy(local_cluster.cluster)
    try:
        with strategy.scope():
            total = tf.Variable(0.0)

        @tf.function
        def add_lost_once(x):
            total.assign_add(x)
            return total.read_value()

        assert float(strategy.schedule(add_lost_once, (1.0,)).result(timeout=120)) == 1.0
        assert lose("add_lost_once")
        with caplog.at_level(logging.WARNING, logger="psclient"):
            assert float(strategy.schedule(add_lost_once, (1.0,)).result(timeout=120)) == 2.0
        assert "never reached worker" in caplog.text and "traced again under a new name" in caplog.text
        assert float(strategy.schedule(add_lost_once, (1.0,)).result(timeout=120)) == 3.0  # the new trace kept

        concrete = tf.function(lambda x: total.assign_add(x)).get_concrete_function(tf.TensorSpec([], tf.float32))
        strategy.schedule(concrete, (tf.constant(1.0),)).result(timeout=120)
        assert lose(concrete.name.decode() if isinstance(concrete.name, bytes) else concrete.name)
        with pytest.raises(tf.errors.NotFoundError, match="neither a type of a primitive operation"):
            strategy.schedule(concrete, (tf.constant(1.0),)).result(timeout=120)
    finally:
        strategy.shutdown()


@pytest.mark.parametrize("api", ["strategy", "tf_coordinator"])
def test_a_dataset_function_whose_registration_was_lost_is_traced_anew_when_a_worker_rejoins(
        local_cluster, few_attempts, lose, caplog, api):
    strategy = psclient.ParameterServerStrategy(local_cluster.cluster, hang_timeout=3.0)
    try:
        def lost_pipeline_fn(ctx):  # each worker's elements tell its pipeline
            return tf.data.Dataset.from_tensors(tf.cast(ctx.input_pipeline_id, tf.int64)).repeat()

        if api == "strategy":
            iterator = iter(strategy.distribute_datasets_from_function(lost_pipeline_fn))
        else:  # TF's tutorial: a per-worker dataset function without arguments, given to the coordinator
            def lost_pipeline_per_worker_fn():
                return strategy.distribute_datasets_from_function(lost_pipeline_fn)

            coordinator = psclient.ClusterCoordinator(strategy)
            iterator = iter(coordinator.create_per_worker_dataset(lost_pipeline_per_worker_fn))

        @tf.function
        def pipeline_of(iterator):
            return next(iterator)

        first = [strategy.schedule(pipeline_of, args=(iterator,)) for _ in range(20)]
        strategy.join(timeout=120)
        assert {int(f.result()) for f in first} <= {0, 1}
        assert lose("lost_pipeline")
        # The rejoin builds worker 1's dataset again: its function is gone from every task.
        more = _after_worker_1_rejoins(strategy, local_cluster, caplog,
                                       lambda: strategy.schedule(pipeline_of, args=(iterator,)))
        assert 1 in {int(f.result()) for f in more}  # worker 1's own pipeline, from its new dataset
    finally:
        strategy.shutdown()
        if not local_cluster.is_running("worker", 1):
            local_cluster.restart("worker", 1)


def test_a_per_worker_resource_function_whose_registration_was_lost_is_made_anew_when_a_worker_rejoins(
        local_cluster, few_attempts, lose, caplog):
    strategy = psclient.ParameterServerStrategy(local_cluster.cluster, hang_timeout=3.0)
    try:
        @tf.function
        def lost_resource_fn():  # a value held on each worker
            return tf.fill([2], 7.0)

        resource = strategy.create_per_worker_resource(lost_resource_fn)

        @tf.function
        def doubled(value):
            return value * 2.0

        first = [strategy.schedule(doubled, args=(resource,)) for _ in range(20)]
        strategy.join(timeout=120)
        assert all(list(f.result()) == [14.0, 14.0] for f in first)
        assert lose("lost_resource_fn")
        # The rejoin builds worker 1's value again: its function is gone from every task.
        more = _after_worker_1_rejoins(strategy, local_cluster, caplog,
                                       lambda: strategy.schedule(doubled, args=(resource,)))
        assert all(list(f.result()) == [14.0, 14.0] for f in more)
    finally:
        strategy.shutdown()
        if not local_cluster.is_running("worker", 1):
            local_cluster.restart("worker", 1)


def _after_worker_1_rejoins(strategy, local_cluster, caplog, schedule) -> list:
    """Worker 1 killed, taken out, restarted and rejoined (its per-worker values built again), then
    `schedule()` 60 times and joined: the futures, each without an error, worker 1 among those that
    ran them, and psclient's warning that a function of its own was traced again."""
    local_cluster.kill("worker", 1)
    wait_for(lambda: not strategy.stats()["workers"][1]["up"], 120, "worker 1 to be taken out")
    local_cluster.restart("worker", 1)
    with caplog.at_level(logging.WARNING, logger="psclient"):
        wait_for(lambda: strategy.stats()["workers"][1]["up"] and strategy.stats()["workers"][1]["rejoins"] == 1,
                 180, "worker 1 to rejoin")
        done_before = strategy.stats()["workers"][1]["done"]
        more = [schedule() for _ in range(60)]
        strategy.join(timeout=180)
    assert all(f.exception() is None for f in more), [f.exception() for f in more if f.exception()][:1]
    assert "never reached a task" in caplog.text and "tracing it again" in caplog.text
    assert strategy.stats()["workers"][1]["done"] > done_before, "the rejoined worker took no work"
    return more
