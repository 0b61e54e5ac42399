"""Traced graphs are collected once their function is gone, with the functions they registered.

Three process-wide holders kept every training step traced in a coordinator alive, with all the
functions it registered in TF's eager context (16 DynamicEmbedding runs: 400-1,100 functions, and
each later connect to a cluster slowed with their number): TF's gradient registry, which keeps a
graph-mode `tf.custom_gradient`'s function (and through its closure the graph) for good, whether
psclient's own (a DynamicEmbedding's) or TF's in the replica context's `all_reduce` that Keras's
optimizer calls on every step's gradients (a step traced again at each ps recovery stayed alive);
and the last section's output that `in_turn` kept per graph. In one process, without a cluster.
"""

import gc
import weakref

import pytest

tf = pytest.importorskip("tensorflow")

from psclient._coordinator.tables.dense_shard import in_turn  # noqa: E402
from psclient._tf.gradients import custom_gradient  # noqa: E402


@custom_gradient
def _scaled(x):
    return tf.identity(x), lambda upstream: 3.0 * upstream  # a gradient the ops alone would not give


def _functions_in_context() -> set:
    from tensorflow.python.eager import context  # noqa: PLC0415 (tests may read TF's internals)
    gc.collect()
    return set(context.context().list_function_names())


def _traced(step):
    """`step`'s graph (weakly) after one call, and the function itself."""
    function = tf.function(step)
    function(tf.constant([1.0, 2.0]))
    graph = function.get_concrete_function(tf.TensorSpec([2], tf.float32)).graph
    return function, weakref.ref(graph)


def test_a_custom_gradient_traced_in_a_tape_and_symbolically_is_right():
    def by_tape(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(_scaled(x) * x)
        return tape.gradient(y, x)

    def by_registry(x):  # tf.gradients finds the op's gradient in the registry, by its name
        return tf.gradients(tf.reduce_sum(_scaled(x) * x), x)[0]

    x = tf.constant([1.0, 2.0])
    expected = [3.0 * 1.0 + 1.0, 3.0 * 2.0 + 2.0]  # d/dx (s(x) * x) = s'(x) x + s(x), s' = 3
    assert tf.function(by_tape)(x).numpy().tolist() == expected
    assert tf.function(by_registry)(x).numpy().tolist() == expected


def test_a_graph_with_a_custom_gradient_is_collected_and_its_registration_dropped():
    from tensorflow.python.framework import ops  # noqa: PLC0415

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(tf.cond(x[0] > 0, lambda: _scaled(x), lambda: x))  # a nested function
        return tape.gradient(y, x)

    registered = set(ops._gradient_registry._registry)
    baseline = _functions_in_context()
    function, graph = _traced(step)
    names = set(ops._gradient_registry._registry) - registered
    assert names and _functions_in_context() - baseline
    del function
    gc.collect()
    assert graph() is None
    assert not names & set(ops._gradient_registry._registry)
    # None of its own left (a step an earlier test in this process traced may be let go meanwhile:
    # the count alone can fall below the baseline).
    assert not _functions_in_context() - baseline


def test_a_graph_of_sections_run_in_turn_is_collected():
    counter = tf.Variable(0.0)

    def step(x):
        first = in_turn(lambda: counter.assign_add(x[0]), lock=counter)
        return in_turn(lambda: counter.assign_add(x[1]), lock=counter), first

    function, graph = _traced(step)
    ops = graph().get_operations()
    second = [op for op in ops if op.type == "AssignAddVariableOp"][1]
    assert second.control_inputs  # the second section waits for the first, in the graph
    del function, ops, second
    gc.collect()
    assert graph() is None


def _reduced_in_replica_context(context_of):
    def step(x):
        with context_of():
            with tf.GradientTape() as tape:
                tape.watch(x)
                summed = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, [x * x])[0]
                mean = tf.distribute.get_replica_context().all_reduce("MEAN", {"m": x})["m"]
                y = tf.reduce_sum(summed + mean)
            return y, tape.gradient(y, x)

    return step


def test_keras_optimizers_all_reduce_in_psclients_replica_context_registers_nothing_and_is_collected():
    """Keras's optimizer sums the step's gradients with the replica context's `all_reduce`: TF's
    registers a custom gradient per trace, which kept every traced training step alive."""
    from tensorflow.python.framework import ops  # noqa: PLC0415

    from psclient._tf.context import replica_context

    step = _reduced_in_replica_context(replica_context)
    registered = set(ops._gradient_registry._registry)
    function, graph = _traced(step)
    y, gradient = function(tf.constant([1.0, 2.0]))
    assert float(y) == 1.0 + 4.0 + 1.0 + 2.0  # over one replica a sum and a mean are the values
    assert gradient.numpy().tolist() == [2.0 * 1.0 + 1.0, 2.0 * 2.0 + 1.0]
    assert set(ops._gradient_registry._registry) == registered
    del function
    gc.collect()
    assert graph() is None


def test_tfs_own_replica_context_still_registers_a_gradient_per_trace():
    # Why psclient's context reduces by itself (a TF that stops doing this should fail here).
    from tensorflow.python.framework import ops  # noqa: PLC0415

    def tfs_context():
        return tf.distribute.ReplicaContext(tf.distribute.get_strategy(), replica_id_in_sync_group=0)

    registered = set(ops._gradient_registry._registry)
    function, _graph = _traced(_reduced_in_replica_context(tfs_context))
    assert float(function(tf.constant([1.0, 2.0]))[0]) == 8.0
    assert set(ops._gradient_registry._registry) - registered
