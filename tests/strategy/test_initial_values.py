"""How a partitioned variable's shards get their initial values, without a cluster.

The cluster side (values made on each ps, the coordinator's memory) is
tests/strategy/test_init_on_ps.py; here the logic, on this process's CPU.
"""

import numpy as np
import pytest
import tensorflow as tf

from psclient._coordinator.variables import initial_values

keras = pytest.importorskip("keras")
from psclient._keras.initializers import shard_function  # noqa: E402

CPU = ["/cpu:0", "/cpu:0"]
FULL = (40_000, 128)  # fans 40,000 and 128; a shard of half the rows would have 20,000


def draw(function, shape=(20_000, 128), index=0):
    return np.asarray(function(shape, index))


def test_glorot_uniform_shards_use_the_full_shapes_limit():
    shard = draw(shard_function(keras.initializers.GlorotUniform(seed=1), FULL, "float32"))
    limit = (6.0 / (FULL[0] + FULL[1])) ** 0.5
    assert shard.shape == (20_000, 128) and shard.dtype == np.float32
    assert 0.99 * limit < np.abs(shard).max() <= limit * (1 + 1e-6)


def test_he_normal_shards_use_the_full_shapes_fan_in():
    shard = draw(shard_function(keras.initializers.HeNormal(seed=1), FULL, "float32"))
    assert shard.std() == pytest.approx((2.0 / FULL[0]) ** 0.5, rel=0.02)


def test_each_shard_of_a_seeded_initializer_has_its_own_values():
    function = shard_function(keras.initializers.RandomNormal(seed=5), FULL, "float32")
    first, second = draw(function, (4, 3), 0), draw(function, (4, 3), 1)
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(first, draw(function, (4, 3), 0))  # seeded: reproducible


def test_constants_are_the_same_for_any_shard():
    function = shard_function(keras.initializers.Constant(0.5), FULL, "float32")
    np.testing.assert_array_equal(draw(function, (3, 2), 1), np.full((3, 2), 0.5, np.float32))
    assert draw(shard_function(keras.initializers.Zeros(), FULL, "float32"), (2, 2)).sum() == 0


@pytest.mark.parametrize("initializer", [
    keras.initializers.Orthogonal(),
    keras.initializers.Identity(),
    keras.initializers.Constant(np.arange(128, dtype="float32")),  # an array: broadcast over the full shape
])
def test_initializers_that_are_not_elementwise_have_no_shard_function(initializer):
    assert shard_function(initializer, FULL, "float32") is None


def test_a_subclass_that_overrides_call_has_no_shard_function():
    class Doubled(keras.initializers.RandomUniform):
        def __call__(self, shape, dtype=None):
            return 2 * super().__call__(shape, dtype)

    assert shard_function(Doubled(), FULL, "float32") is None


def test_a_big_elementwise_variable_is_drawn_shard_by_shard():
    shape = (initial_values.SHARD_BY_SHARD_BYTES // 4, 1)  # exactly the threshold
    calls = []
    spec = initial_values.InitSpec(shape, "float32", lambda s, i: calls.append((s, i)) or tf.zeros(s))
    whole_calls = []
    parts, release = initial_values.shard_values(
        lambda: whole_calls.append(1), spec, shape, [(0, 10), (10, shape[0])], CPU)
    [part() for part in parts]
    release()
    assert calls == [((10, 1), 0), ((shape[0] - 10, 1), 1)] and not whole_calls


def test_a_small_elementwise_variable_is_drawn_whole_and_sliced():
    # Below the threshold: Keras's own values for the full shape, whatever the partitioning.
    spec = initial_values.InitSpec((5, 2), "float32", lambda s, i: pytest.fail("drawn by shard"))
    whole = tf.reshape(tf.range(10.0), (5, 2))
    calls = []
    parts, release = initial_values.shard_values(
        lambda: calls.append(1) or whole, spec, (5, 2), [(0, 3), (3, 5)], CPU)
    values = [part().numpy() for part in parts]
    release()
    assert len(calls) == 1  # made once for every shard
    np.testing.assert_array_equal(np.concatenate(values), whole.numpy())


def test_a_plain_callable_that_ignores_the_partition_protocol_is_made_once_and_sliced():
    calls = []

    def ones(**kwargs):
        calls.append(kwargs)
        return tf.ones((5, 2))

    parts, release = initial_values.shard_values(ones, None, (5, 2), [(0, 3), (3, 5)], CPU)
    shapes = [tuple(part().shape) for part in parts]
    release()
    assert shapes == [(3, 2), (2, 2)] and len(calls) == 1


def test_the_description_is_taken_once_and_dropped_outside_a_scope():
    spec = initial_values.InitSpec((2,), "float32")
    with initial_values.describing(spec):
        assert initial_values.take_pending() is spec
        assert initial_values.take_pending() is None  # a nested variable is not described by it
    with initial_values.describing(spec):
        pass  # created outside any psclient scope: nobody takes it
    assert initial_values.take_pending() is None


def test_keras_variables_describe_themselves_while_they_are_created():
    from psclient._keras import install

    install.install()
    seen = []

    def creator(next_creator, **kwargs):
        seen.append(initial_values.take_pending())
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        variable = keras.Variable(keras.initializers.GlorotUniform(seed=2), shape=(40, 3), dtype="float32")
    assert len(seen) == 1 and seen[0].shape == (40, 3) and seen[0].dtype == "float32"
    assert seen[0].shard is not None
    np.testing.assert_array_equal(variable.numpy(), keras.initializers.GlorotUniform(seed=2)((40, 3)))
