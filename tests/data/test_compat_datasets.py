"""TF's ClusterCoordinator contract for datasets and per-worker values, on psclient.

Written from TF's documented behaviour (the `ClusterCoordinator`,
`create_per_worker_dataset` and `experimental_get_current_worker_index`
docs): code written for TF's coordinator runs through `psclient.ClusterCoordinator`
unchanged, or meets a clear error that docs/tf_compatibility.md lists.
The last tests kill and restart a worker of the shared cluster; they leave
every task running.
"""

import numpy as np
import pytest
import tensorflow as tf
from _polling import wait_for

import psclient

pytestmark = pytest.mark.cluster

NUM_WORKERS = 2


def worker_index():
    return tf.distribute.coordinator.experimental_get_current_worker_index()


@tf.function
def take_with_index(iterator):
    return next(iterator), worker_index()


def run_steps(coordinator, fn, args, count):
    futures = [coordinator.schedule(fn, args=args) for _ in range(count)]
    coordinator.join()
    return [f.result() for f in futures]


def check_sharded(results):
    """Every element came from the shard of the worker that read it; both workers read."""
    assert all(int(value) % NUM_WORKERS == int(index) for value, index in results), results
    assert {int(index) for _, index in results} == set(range(NUM_WORKERS))


@pytest.fixture(scope="module")
def coordinator(strategy):
    return psclient.ClusterCoordinator(strategy)


# ------------------------------------------------------- 1. the worker's index
def test_worker_index_shards_a_dataset_fn_as_in_tf_docs(coordinator, strategy):
    def dataset_fn(context):
        return tf.data.Dataset.range(1000).shard(num_shards=NUM_WORKERS, index=worker_index()).repeat()

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    check_sharded(run_steps(coordinator, take_with_index, (iterator,), 30))


def test_worker_index_in_a_dataset_fn_of_no_arguments(coordinator):
    def dataset_fn():
        return tf.data.Dataset.range(1000).shard(NUM_WORKERS, worker_index()).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    check_sharded(run_steps(coordinator, take_with_index, (iterator,), 30))


def test_worker_index_in_a_scheduled_function_and_in_resources(coordinator):
    @tf.function
    def where():
        return worker_index()

    indices = {int(v) for v in run_steps(coordinator, where, (), 30)}
    assert indices == set(range(NUM_WORKERS))

    @tf.function
    def make_counter():
        return worker_index() * 100

    made = coordinator.create_per_worker_resources(make_counter)
    assert [int(made.value(w)) for w in range(NUM_WORKERS)] == [0, 100]


def test_worker_index_outside_a_worker_raises_as_in_tf():
    with pytest.raises(RuntimeError, match="worker index"):
        worker_index()


def test_input_context_id_shards_and_the_function_is_traced_once(strategy):
    calls = []

    def dataset_fn(ctx):
        calls.append((ctx.num_input_pipelines, ctx.input_pipeline_id))
        return tf.data.Dataset.range(1000).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).repeat()

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    check_sharded(run_steps(strategy, take_with_index, (iterator,), 30))
    assert len(calls) == 1
    assert calls[0][0] == NUM_WORKERS and tf.is_tensor(calls[0][1])


def test_dataset_fn_needing_a_python_int_is_called_per_worker(strategy):
    files = [f"shard-{i}" for i in range(6)]
    calls = []

    def dataset_fn(ctx):
        calls.append(ctx.input_pipeline_id)
        mine = files[ctx.input_pipeline_id::ctx.num_input_pipelines]  # a Python int is needed here
        return tf.data.Dataset.from_tensor_slices(mine).repeat()

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    # A first trace stopped at the slicing (the index was a tensor); then one call per worker.
    assert sorted(c for c in calls if isinstance(c, int)) == [0, 1]
    results = run_steps(strategy, take_with_index, (iterator,), 20)
    assert all(int(name.decode().split("-")[1]) % 2 == int(index) for name, index in results)


# ----------------------------------------------------------- 2. traced once
def test_dataset_fn_and_its_map_function_are_traced_once(coordinator, strategy):
    traced = {"dataset_fn": 0, "map": 0, "per_worker_dataset_fn": 0}

    def add_one(x):
        traced["map"] += 1
        return x + 1

    def dataset_fn(ctx):
        traced["dataset_fn"] += 1
        return tf.data.Dataset.range(100).map(add_one).repeat()

    @tf.function
    def per_worker_dataset_fn():
        traced["per_worker_dataset_fn"] += 1
        return strategy.distribute_datasets_from_function(dataset_fn)

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    values = run_steps(coordinator, take_with_index, (iterator,), 10)
    assert {int(i) for _, i in values} == set(range(NUM_WORKERS))
    assert traced == {"dataset_fn": 1, "map": 1, "per_worker_dataset_fn": 1}


def test_worker_fn_traced_once_when_its_concrete_function_was_made_first(coordinator, strategy):
    # psclient traces a scheduled function in the strategy's cross-replica
    # context (as TF's schedule() traces inside the strategy's scope), which is
    # part of tf.function's cache key: a concrete function made inside
    # scope() is the one schedule() uses.
    traced = {"per_worker_dataset_fn": 0, "worker_fn": 0}

    def per_worker_dataset_fn():
        traced["per_worker_dataset_fn"] += 1
        return tf.data.Dataset.range(10).repeat()

    @tf.function
    def worker_fn(iterator):
        traced["worker_fn"] += 1
        return next(iterator)

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    with strategy.scope():
        concrete = worker_fn.get_concrete_function(iterator)
    assert concrete.structured_outputs.dtype == tf.int64
    results = run_steps(coordinator, worker_fn, (iterator,), 10)
    assert all(0 <= int(r) < 10 for r in results)
    assert traced == {"per_worker_dataset_fn": 1, "worker_fn": 1}


def test_experimental_distribute_dataset_in_a_per_worker_dataset_fn(coordinator, strategy):
    @tf.function
    def per_worker_dataset_fn():
        return strategy.experimental_distribute_dataset(tf.data.Dataset.range(1, 11).batch(4))

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    first = coordinator.fetch(coordinator.schedule(take_with_index, args=(iterator,)))
    assert first[0].tolist() == [1, 2, 3, 4]


def test_dataset_calls_inside_other_tf_functions_are_refused(strategy):
    @tf.function
    def inside():
        return strategy.distribute_datasets_from_function(lambda ctx: tf.data.Dataset.range(3))

    with pytest.raises(RuntimeError, match="inside a tf.function"):
        inside.get_concrete_function()


# --------------------------------------------------------- 3. no variables
def test_variable_in_dataset_fn_is_refused_with_value_error(coordinator, strategy):
    def dataset_fn():
        tf.Variable(1.0)
        return tf.data.Dataset.range(3)

    with pytest.raises(ValueError, match="Creating variables in `dataset_fn`"):
        coordinator.create_per_worker_dataset(dataset_fn)

    def dataset_fn_with_context(ctx):
        tf.Variable(1.0)
        return tf.data.Dataset.range(3)

    with strategy.scope(), pytest.raises(ValueError, match="Creating variables in `dataset_fn`"):
        strategy.distribute_datasets_from_function(dataset_fn_with_context)


# -------------------------------------------- 4. element_spec, build(), type spec
def test_element_spec_build_and_iterator_type_spec(coordinator):
    def dataset_fn():
        return tf.data.Dataset.from_tensor_slices(
            {"x": np.arange(8, dtype="float32").reshape(4, 2), "y": np.arange(4)}
        ).batch(2)

    per_worker = coordinator.create_per_worker_dataset(dataset_fn)
    expected = {"x": tf.TensorSpec([None, 2], tf.float32), "y": tf.TensorSpec([None], tf.int64)}
    assert per_worker.element_spec == expected

    built = per_worker.build()

    @tf.function
    def total(dataset):
        return dataset.reduce(tf.constant(0, tf.int64), lambda acc, e: acc + tf.reduce_sum(e["y"]))

    assert [int(v) for v in run_steps(coordinator, total, (built,), 4)] == [6] * 4

    iterator = iter(per_worker)
    assert iterator.element_spec == expected

    @tf.function
    def first_x(it):
        return next(it)["x"]

    concrete = first_x.get_concrete_function(iterator)
    assert concrete.structured_input_signature[0][0] == tf.data.IteratorSpec(expected)
    assert concrete.structured_outputs.shape.as_list() == [None, 2]
    assert coordinator.fetch(coordinator.schedule(first_x, args=(iterator,))).tolist() == [[0, 1], [2, 3]]


def test_iterators_know_on_each_worker_whether_their_dataset_never_ends(coordinator, strategy):
    # What the dispatcher asks after an "End of sequence": from a dataset that
    # never ends, that is an iterator broken by a cancelled call (made again);
    # from one that ends, the data's end.
    from psclient._coordinator.stores import PerWorkerRegistry

    endless = iter(coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.range(10).repeat().batch(2)))
    finite = iter(coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.range(10).batch(2)))
    registry = PerWorkerRegistry()
    for worker in range(NUM_WORKERS):
        assert endless.endless(worker) and not finite.endless(worker)
        assert registry.endless((endless,), {}, worker)
        assert not registry.endless((endless,), {"more": finite}, worker)
        assert not registry.endless((1,), {}, worker)  # no iterator: nothing to make again


# ----------------------------------------- 5. dataset captured from the coordinator
def test_dataset_from_the_coordinator_captured_by_dataset_fn_is_a_clear_error(coordinator, strategy):
    made_here = tf.data.Dataset.range(5)

    def dataset_fn():
        return made_here.map(lambda x: x * 2)

    with pytest.raises(ValueError, match="made on the coordinator") as raised:
        coordinator.create_per_worker_dataset(dataset_fn)
    assert "pass the dataset itself" in str(raised.value)
    with pytest.raises(ValueError, match="made on the coordinator"):
        strategy.distribute_datasets_from_function(lambda ctx: made_here.repeat())
    # The way out the error names: the dataset itself is rebuilt on every worker.
    iterator = iter(coordinator.create_per_worker_dataset(made_here.map(lambda x: x * 2).repeat()))
    assert {int(v) for v, _ in run_steps(coordinator, take_with_index, (iterator,), 12)} <= {0, 2, 4, 6, 8}


# ------------------------------------------------- 6. per-worker build errors
def test_error_in_a_per_worker_resource_is_an_input_error_at_join(coordinator, strategy):
    from tensorflow.python.distribute.coordinator.cluster_coordinator import ClosureInputError

    with strategy.scope():
        ran = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def broken_resource():
        tf.debugging.assert_equal(1, 2, message="resource cannot be made")
        return tf.constant(1)

    resource = coordinator.create_per_worker_resources(broken_resource)  # no error yet, as in TF

    @tf.function
    def use(value):
        ran.assign_add(1)
        return value + 1

    future = coordinator.schedule(use, args=(resource,))
    with pytest.raises(ClosureInputError, match="broken_resource") as raised:
        coordinator.join()
    assert isinstance(raised.value.original_exception, tf.errors.InvalidArgumentError)
    assert isinstance(future.exception(timeout=60), ClosureInputError)
    # The errored input is not used again: later closures fail the same way, unrun. The first of
    # them can fail before the next is scheduled; then, as in TF, that schedule() raises its error.
    again = []
    with pytest.raises(ClosureInputError):
        for _ in range(4):
            again.append(coordinator.schedule(use, args=(resource,)))
        coordinator.join()
    assert again
    # (psclient cancels the closures still queued when the first error is raised.)
    assert all(f.cancelled() or isinstance(f.exception(timeout=60), ClosureInputError) for f in again)
    assert int(ran.numpy()) == 0


def test_error_building_a_dataset_on_the_workers_is_an_input_error(coordinator):
    from tensorflow.python.distribute.coordinator.cluster_coordinator import ClosureInputError

    def dataset_fn():
        return tf.data.Dataset.from_tensors(tf.io.read_file("/nonexistent/psclient/file")).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    coordinator.schedule(take_with_index, args=(iterator,))
    with pytest.raises(ClosureInputError, match="NotFoundError"):
        coordinator.join()


def test_python_error_in_a_resource_function_raises_at_creation(coordinator):
    def broken():
        raise KeyError("bug in the resource function")

    with pytest.raises(KeyError, match="bug in the resource function"):
        coordinator.create_per_worker_resources(broken)


# ----------------------- 7. created while a worker is down: built when it is back
def shard_fn():
    return tf.data.Dataset.range(100_000).shard(NUM_WORKERS, worker_index()).repeat()


def take_out_worker_1(coordinator, strategy, probe_fn):
    """Schedule until the dead worker 1 has been taken out (an idle dead worker is
    only noticed when a closure sent to it fails)."""
    for _ in range(60):
        if not strategy.stats()["workers"][1]["up"]:
            return
        run_steps(coordinator, probe_fn, (), 4)
    pytest.fail("worker 1 was not taken out after 240 closures")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", ["dataset_fn", "dataset"])
@pytest.mark.parametrize("when", ["before_detection", "after_detection"])
def test_per_worker_dataset_created_while_a_worker_is_down(local_cluster, coordinator, strategy, source, when):
    @tf.function
    def where():
        return worker_index()

    # Both workers connected and working before one dies.
    assert {int(v) for v in run_steps(coordinator, where, (), 20)} == set(range(NUM_WORKERS))
    try:
        local_cluster.kill("worker", 1)
        if when == "after_detection":
            take_out_worker_1(coordinator, strategy, where)
        if source == "dataset_fn":
            per_worker = coordinator.create_per_worker_dataset(shard_fn)
        else:
            per_worker = coordinator.create_per_worker_dataset(tf.data.Dataset.range(7, 100_000).repeat())
        iterator = iter(per_worker)
        table = coordinator.create_per_worker_resources(lambda: tf.constant(5, tf.int64))
        # Nothing raised, and the datasets were not built on the dead worker (an eager
        # constant "on" it, like `table`, fails only when used, so it is not checked).
        assert not per_worker.built(1) and not iterator.built(1)

        @tf.function
        def step(it, t):
            return next(it) + t - 5, worker_index()

        before = run_steps(coordinator, step, (iterator, table), 10)
        assert {int(i) for _, i in before} == {0}
        take_out_worker_1(coordinator, strategy, where)
        rejoins = strategy.stats()["workers"][1]["rejoins"]
        local_cluster.restart("worker", 1)
        wait_for(lambda: strategy.stats()["workers"][1]["rejoins"] > rejoins, 90, "worker 1 to rejoin")

        assert all(v.built(1) for v in (per_worker, iterator, table))  # rebuilt at its rejoin
        after = run_steps(coordinator, step, (iterator, table), 40)
        on_1 = [int(v) for v, i in after if int(i) == 1]
        assert on_1, "the restarted worker read nothing from its iterator"
        if source == "dataset_fn":
            assert all(v % NUM_WORKERS == 1 for v in on_1)  # its own shard, built on it
        else:
            assert on_1[0] == 7  # a fresh clone of the dataset, read from its start
    finally:
        if not local_cluster.is_running("worker", 1):
            local_cluster.restart("worker", 1)
        serve_on_both_workers(coordinator, where)


def serve_on_both_workers(coordinator, probe_fn):
    """Schedule until both workers run closures (a worker restarted unnoticed is
    taken out by its first failed closure, then rejoins)."""
    seen = set()
    for _ in range(40):
        seen |= {int(v) for v in run_steps(coordinator, probe_fn, (), 6)}
        if seen == set(range(NUM_WORKERS)):
            return
    pytest.fail(f"after 240 closures only workers {sorted(seen)} ran any")
