"""A small model whose `Embedding(4000, 4)` has a shard on each of two ps tasks, and its data: what the
tests of writes beside a hung ps train and save (tests/serving/test_serving_hung_ps.py,
tests/keras/test_callbacks_hung_ps.py)."""

import numpy as np


def two_shard_strategy_and_model(cluster, hang_timeout: float):
    """(strategy, compiled model, ids, labels) on `cluster` (2 ps); nothing fit yet."""
    import keras
    import tensorflow as tf

    import psclient

    strategy = psclient.ParameterServerStrategy(
        cluster, hang_timeout=hang_timeout,
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        inputs = keras.Input((2,), dtype="int64")
        table = keras.layers.Embedding(4000, 4, name="table")(inputs)  # a shard on each ps
        model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(table)))
        model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    x = np.random.default_rng(0).integers(0, 4000, (64, 2))
    return strategy, model, x, (x[:, :1] % 3).astype("float32")
