"""A small model whose `Embedding(4000, 4)` has a shard on each of two ps tasks, and its data: what the
tests of writes beside a hung ps train and save (tests/serving/test_serving_hung_ps.py,
tests/keras/test_callbacks_hung_ps.py)."""

import threading

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


def fit_with_a_ps_stopped(cluster, model, x, y, ps: int, callbacks: list, given_up, limit: float) -> None:
    """`model.fit(x, y, epochs=3, callbacks)` on a thread, ps `ps` SIGSTOPped at the first epoch's end
    (before `callbacks`), resumed once `given_up()` holds (the callbacks' writes given up on it); fails
    if that does not come within `limit` s, or fit does not end after the resume, or raised."""
    import keras
    from _polling import wait_for

    class StopPs(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                cluster.stop("ps", ps)

    outcome = {}

    def fit():
        try:
            model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[StopPs(), *callbacks])
        except Exception as error:  # noqa: BLE001 - checked below
            outcome["error"] = error

    fitting = threading.Thread(target=fit, name="fit-under-test")
    fitting.start()
    try:
        wait_for(lambda: given_up() or not fitting.is_alive(), limit,
                 f"the writes at the first epoch's end to be given up on ps:{ps}")
    finally:
        cluster.resume("ps", ps)
        fitting.join(limit)
    assert not fitting.is_alive(), f"fit did not end after ps:{ps} was resumed"
    assert "error" not in outcome, repr(outcome.get("error"))
