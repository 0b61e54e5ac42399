"""`called_cond`: a conditional kept as TF's functional `If` (run as a function call, not lowered to
Switch/Merge), with `tf.cond`'s results; eagerly, `tf.cond` itself. No cluster."""

import pytest

tf = pytest.importorskip("tensorflow")

from psclient._tf.control_flow import called_cond  # noqa: E402


def test_its_if_is_kept_unlowered_and_gives_tf_conds_results():
    counter = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step(x):
        def rare():  # a branch with a write, as a section's rebuild has
            with tf.control_dependencies([counter.assign_add(1)]):
                return x * 2
        return called_cond(x > 10, rare, lambda: x + 1)

    graph = step.get_concrete_function(tf.TensorSpec([], tf.int64)).graph
    ifs = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
    assert len(ifs) == 1
    assert ifs[0].get_attr("_lower_using_switch_merge") is False
    assert int(step(tf.constant(3, tf.int64))) == 4 and int(counter.numpy()) == 0
    assert int(step(tf.constant(30, tf.int64))) == 60 and int(counter.numpy()) == 1


def test_eagerly_it_is_tf_cond():
    assert int(called_cond(tf.constant(True), lambda: tf.constant(1), lambda: tf.constant(2))) == 1
