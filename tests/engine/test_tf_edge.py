"""psclient._tf, the one place that patches TF: its update router, without a cluster."""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

from psclient._tf import updates  # noqa: E402


@pytest.fixture
def restore_router():
    previous = updates.current_router()
    yield
    updates.route_default_updates(previous)


def _update(variable, delta):
    # How Keras's optimizers apply an update outside any tf.distribute strategy.
    return tf.distribute.get_strategy().extended.update(variable, lambda v, d: v.assign_add(d), args=(delta,))


def test_router_sees_each_default_strategy_update_and_runs_it(restore_router):
    seen = []

    def router(colocate_with, fn, args, run):
        seen.append((colocate_with, args))
        return run(args)

    variable = tf.Variable(1.0)
    updates.route_default_updates(router)
    _update(variable, tf.constant(2.0))
    assert float(variable.numpy()) == 3.0
    assert len(seen) == 1 and seen[0][0] is variable
    assert seen[0][1][0] is variable and float(seen[0][1][1].numpy()) == 2.0  # (variable, *args)


def test_router_decides_the_arguments_and_how_often_tf_runs(restore_router):
    def twice_halved(colocate_with, fn, args, run):
        half = tuple(a if a is colocate_with else a / 2 for a in args)
        return (run(half), run(half))

    variable = tf.Variable(0.0)
    updates.route_default_updates(twice_halved)
    _update(variable, tf.constant(4.0))
    assert float(variable.numpy()) == 4.0  # two updates of 2.0


def test_one_patch_however_often_it_is_installed(restore_router):
    from tensorflow.python.distribute import distribute_lib  # the class TF's default strategy uses

    updates.route_default_updates(None)
    method = distribute_lib._DefaultDistributionExtended._update_non_slot  # noqa: SLF001
    updates.route_default_updates(lambda c, fn, args, run: run(args))
    updates.route_default_updates(None)
    assert distribute_lib._DefaultDistributionExtended._update_non_slot is method  # noqa: SLF001
    assert not hasattr(method.__wrapped__, "__wrapped__")  # TF's own beneath, not a second patch
    variable = tf.Variable(1.0)
    _update(variable, tf.constant(1.0))  # no router: TF's own update
    assert float(variable.numpy()) == 2.0


def _partitioned(rows_a, rows_b):
    from psclient._tf.partitioned import PartitionedVariable

    return PartitionedVariable([tf.Variable(rows_a, name="v/part_0"), tf.Variable(rows_b, name="v/part_1")],
                               name="v")


def test_partitioned_variable_reads_whole_and_its_focused_shard():
    from psclient._tf.partitioned import focus, is_partitioned

    variable = _partitioned([[1.0], [2.0]], [[3.0]])
    assert is_partitioned(variable) and not is_partitioned(tf.Variable(1.0))
    assert variable.read_value().numpy().tolist() == [[1.0], [2.0], [3.0]]
    assert variable.layout == ((3, 1), (2, 1))
    with focus(variable.layout, 1):
        assert variable.shape == (1, 1) and variable.full_shape == (3, 1)
        variable.assign_add([[10.0]])  # the focused shard only
    assert variable.focused is None
    assert variable.read_value().numpy().tolist() == [[1.0], [2.0], [13.0]]


def test_partitioned_variable_gradient_is_one_of_the_full_shape():
    variable = _partitioned([[1.0], [2.0]], [[3.0]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.convert_to_tensor(variable) * [[1.0], [2.0], [3.0]])
    grad = tape.gradient(loss, variable.handle)
    assert grad.numpy().tolist() == [[1.0], [2.0], [3.0]]
