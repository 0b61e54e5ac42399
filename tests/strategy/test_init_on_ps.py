"""Initial values are made on the ps task of each variable (or shard), never in the coordinator.

One cluster of 1 worker and 2 ps tasks; the strategy cuts every variable of
two rows or more into 2 shards, so both paths (whole and partitioned) run.
Statistics of big values are computed on the ps (only scalars come back).
"""

import gc

import numpy as np
import psutil
import pytest
import tensorflow as tf

import psclient

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.cluster

ROWS, DIM = 1_000_000, 64  # 256 MB of float32, twice with Adagrad's accumulator


@pytest.fixture(scope="module")
def strategy(one_worker_two_ps):
    s = psclient.ParameterServerStrategy(
        one_worker_two_ps.cluster, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
    yield s
    s.shutdown()


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def _shards(variable):
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return list(value.variables) if hasattr(value, "variables") else [value]


def _on_ps(shard, fn):
    """`fn(shard)` computed on the shard's ps; a small result comes back."""
    with tf.device(shard.device):
        return fn(tf.convert_to_tensor(shard)).numpy()


def _moments(variable):
    """Mean, standard deviation and max |x| of a variable, computed shard by shard on the ps."""
    count = total = squares = 0.0
    largest = 0.0
    for shard in _shards(variable):
        n = float(np.prod(shard.shape))
        count += n
        total += float(_on_ps(shard, tf.reduce_sum))
        squares += float(_on_ps(shard, lambda x: tf.reduce_sum(tf.square(x))))
        largest = max(largest, float(_on_ps(shard, lambda x: tf.reduce_max(tf.abs(x)))))
    mean = total / count
    return mean, (squares / count - mean * mean) ** 0.5, largest


def _dataset(context):
    ids = tf.data.Dataset.random(seed=1).batch(4, drop_remainder=True).map(lambda x: tf.cast(x % ROWS, tf.int32))
    labels = tf.data.Dataset.random(seed=2).map(lambda x: tf.cast(x % 2, tf.float32)[None])
    return tf.data.Dataset.zip((ids, labels)).batch(64).repeat()


def _extremes(variable):
    """(min, max) of a variable, computed shard by shard on the ps."""
    shards = _shards(variable)
    return (min(_on_ps(s, tf.reduce_min) for s in shards), max(_on_ps(s, tf.reduce_max) for s in shards))


@pytest.mark.long
def test_a_big_table_and_its_slots_do_not_grow_the_coordinator(strategy):
    with strategy.scope():  # Keras's own first-use costs, not measured
        keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(10, 4), keras.layers.Dense(1)])
    before = _rss()
    with strategy.scope():
        table = keras.layers.Embedding(ROWS, DIM)
        model = keras.Sequential([keras.Input((4,), dtype="int32"), table, keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
        optimizer = keras.optimizers.Adagrad(0.01)
        optimizer.build(model.trainable_variables)
    growth = _rss() - before
    parameters = 2 * ROWS * DIM * 4
    assert growth <= 0.1 * parameters, f"coordinator grew {growth / 2**20:.0f} MB for {parameters / 2**20:.0f} MB"
    assert sum(strategy.placement()["bytes_per_ps"]) >= parameters
    # Keras's default for Embedding: RandomUniform(-0.05, 0.05), drawn shard by shard.
    shards = _shards(table.embeddings)
    assert len(shards) == 2 and [ps_of(s) for s in shards] in ([0, 1], [1, 0])
    mean, std, largest = _moments(table.embeddings)
    assert abs(mean) < 1e-4 and abs(std - 0.1 / 12 ** 0.5) < 1e-4 and 0.0499 < largest <= np.float32(0.05)
    # Two shards drawn with different seeds, not copies of each other.
    first = [_on_ps(s, lambda x: x[:2]) for s in shards]
    assert not np.array_equal(first[0], first[1])
    accumulator = optimizer._accumulators[0]
    assert [ps_of(s) for s in _shards(accumulator)] == [ps_of(s) for s in shards]
    assert _extremes(accumulator) == (np.float32(0.1), np.float32(0.1))  # Adagrad's initial value, exact

    # fit trains the model and brings nothing of the table to the coordinator.
    with strategy.scope():
        model.compile(optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(from_logits=True))
    history = model.fit(_dataset, epochs=2, steps_per_epoch=10, verbose=0)
    assert all(np.isfinite(history.history["loss"]))
    assert optimizer.iterations.numpy() == 20
    growth = _rss() - before
    assert growth <= 0.1 * parameters, f"after fit: {growth / 2**20:.0f} MB for {parameters / 2**20:.0f} MB"


def ps_of(shard) -> int:
    assert "/job:ps/" in shard.device, shard.device
    return int(shard.device.split("/task:")[1].split("/")[0])


@pytest.mark.parametrize("initializer, check", [
    (keras.initializers.GlorotUniform(seed=3), "uniform"),
    (keras.initializers.HeNormal(seed=3), "truncated"),
    (keras.initializers.LecunNormal(), "truncated"),
])
def test_variance_scaling_shards_use_the_fans_of_the_full_shape(strategy, initializer, check):
    rows, units = 40_000, 128  # 20 MB: over SHARD_BY_SHARD_BYTES, drawn shard by shard
    with strategy.scope():
        layer = keras.layers.Dense(units, kernel_initializer=initializer)
        layer.build((None, rows))
    assert len(_shards(layer.kernel)) == 2
    mean, std, largest = _moments(layer.kernel)
    fan_in, fan_out = rows, units  # of the full shape; a shard's would be rows / 2
    if check == "uniform":
        limit = (6.0 / (fan_in + fan_out)) ** 0.5
        assert 0.99 * limit < largest <= limit * (1 + 1e-6) and std == pytest.approx(limit / 3 ** 0.5, rel=0.01)
    else:
        scale = 2.0 if isinstance(initializer, keras.initializers.HeNormal) else 1.0
        expected = (scale / fan_in) ** 0.5
        assert std == pytest.approx(expected, rel=0.01) and largest <= 2 * expected / 0.8796 + 1e-6
    assert abs(mean) < 0.01 * std


def test_constant_and_zeros_are_exact_on_every_shard(strategy):
    with strategy.scope():
        layer = keras.layers.Dense(
            7, kernel_initializer=keras.initializers.Constant(0.25), bias_initializer="zeros")
        layer.build((None, 9))
    assert len(_shards(layer.kernel)) == 2 and len(_shards(layer.bias)) == 2
    np.testing.assert_array_equal(layer.kernel.numpy(), np.full((9, 7), 0.25, np.float32))
    np.testing.assert_array_equal(layer.bias.numpy(), np.zeros(7, np.float32))


def test_an_initializer_that_is_not_elementwise_is_made_whole_on_the_first_ps_and_sliced(strategy):
    devices = []

    class Recorded(keras.initializers.Initializer):
        def __call__(self, shape, dtype=None):
            devices.append(tf.constant(0.0).device)  # where its ops run
            return keras.initializers.Orthogonal(seed=1)(shape, dtype=dtype)

    with strategy.scope():
        layer = keras.layers.Dense(16, kernel_initializer=Recorded(), use_bias=False)
        layer.build((None, 64))
    shards = _shards(layer.kernel)
    assert len(shards) == 2 and len(devices) == 1 and devices[0] == shards[0].device
    kernel = layer.kernel.numpy()  # small: read whole here
    np.testing.assert_allclose(kernel.T @ kernel, np.eye(16), atol=1e-5)  # orthogonal columns: the full value


def test_plain_variables_with_a_callable_initial_value_are_made_on_their_ps(strategy):
    devices = []

    def ones():
        devices.append(tf.constant(0.0).device)
        return tf.ones([6, 3])

    with strategy.scope():
        described = tf.Variable(ones, shape=[6, 3], dtype=tf.float32)  # shape known: cut first, then made
        undescribed = tf.Variable(ones)  # made on a ps first to learn its shape
        single = tf.Variable(lambda: tf.fill([1, 5], 2.0))  # one row: whole
    assert all("/job:ps/" in d for d in devices) and len(devices) == 2, devices
    for variable in (described, undescribed):
        assert len(_shards(variable)) == 2
        np.testing.assert_array_equal(variable.numpy(), np.ones((6, 3), np.float32))
    assert "/job:ps/" in single.device
    np.testing.assert_array_equal(single.numpy(), np.full((1, 5), 2.0, np.float32))


def test_tfs_partition_protocol_makes_each_shard_on_its_ps(strategy):
    calls = []

    def initial_value(partition_shape=None, partition_offset=None):
        calls.append((tuple(partition_shape), tuple(partition_offset), tf.constant(0.0).device))
        return tf.fill(partition_shape, float(partition_offset[0]))

    with strategy.scope():
        variable = tf.Variable(initial_value, shape=[5, 2], dtype=tf.float32)
    shards = _shards(variable)
    assert [c[:2] for c in calls] == [((3, 2), (0, 0)), ((2, 2), (3, 0))]
    assert [c[2] for c in calls] == [s.device for s in shards]
    np.testing.assert_array_equal(variable.numpy()[:, 0], [0, 0, 0, 3, 3])


def test_a_tensor_initial_value_made_in_a_scheduled_functions_first_trace_is_made_on_the_ps(strategy):
    """`tf.Variable(tf.zeros(...))` at a function's first trace (the pattern `tf.function`'s guide
    shows): the initial value is a tensor of that trace, whose ops are copied out and run on the ps."""
    made = {}

    @tf.function
    def step():
        if not made:
            made["count"] = tf.Variable(tf.zeros([]))  # a scalar: whole
            made["table"] = tf.Variable(tf.random.stateless_uniform([6, 3], seed=[1, 2]))  # 2 shards
        made["count"].assign_add(1.0)
        return made["count"].read_value()

    with strategy.scope():
        assert strategy.schedule(step).result(timeout=120) == 1.0
    assert strategy.schedule(step).result(timeout=120) == 2.0  # made once, at the first trace
    assert "/job:ps/" in made["count"].device
    assert len(_shards(made["table"])) == 2 and all("/job:ps/" in s.device for s in _shards(made["table"]))
    np.testing.assert_array_equal(made["table"].numpy(), tf.random.stateless_uniform([6, 3], seed=[1, 2]).numpy())


def test_an_initial_value_computed_from_a_functions_input_is_refused_naming_the_argument(strategy):
    made = {}

    @tf.function
    def step(x):
        if not made:
            made["doubled"] = tf.Variable(x * 2.0, name="doubled")
        return made["doubled"].read_value()

    with strategy.scope(), pytest.raises(ValueError, match=r"`initial_value` of tf.Variable 'doubled'.*"
                                                           r"inputs or captured values.*lambda"):
        strategy.schedule(step, args=(tf.ones([2]),))
