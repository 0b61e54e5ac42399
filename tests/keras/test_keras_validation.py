"""fit's validation on the cluster against Keras in one process: the same batches, so the same val_loss.

The model's output depends on the whole batch (a `tensordot` over the batch,
as a published collaborative-filtering model has), so validating in batches of
another size gives another `val_loss`. Its learning rate is 0: the weights stay
those both models start from, so the cluster's validation history must
equal local Keras's. (Its training loss need not: each worker reads its own
copy of the arrays' batches, so an epoch's steps are not Keras's batches.)
"""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(600)

_RNG = np.random.default_rng(7)
X = _RNG.standard_normal((256, 8)).astype("float32")
Y = (X[:, :1] * 2 + X[:, 1:2]).astype("float32")
XV = _RNG.standard_normal((160, 8)).astype("float32")
YV = (XV[:, :1] * 2 + XV[:, 1:2]).astype("float32")


class BatchDot(keras.layers.Layer):
    """`u . v` summed over the whole batch, added to every example's output."""

    def call(self, inputs):
        out, u, v = inputs
        return out + 0.05 * keras.ops.tensordot(u, v, 2)


def build():
    inputs = keras.Input((8,))
    u, v = keras.layers.Dense(4)(inputs), keras.layers.Dense(4)(inputs)
    model = keras.Model(inputs, BatchDot()([keras.layers.Dense(1)(inputs), u, v]))
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0), loss="mse", metrics=["mae"])
    return model


@pytest.fixture(scope="module")
def models(strategy):
    with strategy.scope():
        on_cluster = build()
    local = build()
    local.set_weights(on_cluster.get_weights())
    return on_cluster, local


def unknown_size():
    """The training data as a dataset whose size TF cannot tell (a filter), in batches of 64."""
    return tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: True).batch(64)


CASES = {
    "validation_data, batch_size=64": dict(batch_size=64, validation_data=(XV, YV)),
    "validation_batch_size=16": dict(batch_size=64, validation_data=(XV, YV), validation_batch_size=16),
    "validation_steps of arrays": dict(batch_size=64, validation_data=(XV, YV), validation_steps=2),
    # The dataset made in the test, after the strategy: what this module checks is validation.
    "validation_steps of a dataset": lambda: dict(
        batch_size=64, validation_data=tf.data.Dataset.from_tensor_slices((XV, YV)).batch(16), validation_steps=3),
    "validation_freq=2": dict(batch_size=32, epochs=4, validation_data=(XV, YV), validation_freq=2),
    "validation_freq=[1, 4]": dict(batch_size=32, epochs=4, validation_data=(XV, YV), validation_freq=[1, 4]),
    "validation_split=0.25": dict(batch_size=64, validation_split=0.25),
    "validation_split, validation_batch_size=48": dict(
        batch_size=64, validation_split=0.25, validation_batch_size=48),
}


@pytest.mark.parametrize("case", list(CASES))
def test_validation_matches_local_keras(models, case):
    on_cluster, local = models
    given = CASES[case]
    arguments = dict(dict(epochs=2, shuffle=False, verbose=0), **(given() if callable(given) else given))
    got = on_cluster.fit(X, Y, **arguments).history
    want = local.fit(X, Y, **arguments).history
    assert sorted(got) == sorted(want) and "val_loss" in want
    for name in ("val_loss", "val_mae"):
        assert len(got[name]) == len(want[name]), (name, got[name], want[name])  # validation_freq's epochs
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)


def test_unknown_size_training_data_validates_in_batches_of_batch_size(models):
    # A dataset of unknown size is cut into shards (its own path through fit), each batch read
    # once per epoch: the training loss matches too. batch_size means nothing to the training
    # dataset but is still validation's default batch size.
    on_cluster, local = models
    got = on_cluster.fit(unknown_size(), batch_size=64, epochs=2, validation_data=(XV, YV), verbose=0).history
    want = local.fit(unknown_size(), batch_size=64, epochs=2, validation_data=(XV, YV), verbose=0).history
    assert sorted(got) == sorted(want)
    for name, values in want.items():
        np.testing.assert_allclose(got[name], values, rtol=1e-5, err_msg=name)


def test_the_batch_size_shows_in_this_models_val_loss(models):
    # What makes the tests above able to fail: 32 (Keras's default) and 64 give other losses.
    _, local = models
    by_size = [local.evaluate(XV, YV, batch_size=size, verbose=0)[0] for size in (32, 64)]
    assert abs(by_size[0] - by_size[1]) > 1e-3 * abs(by_size[1]), by_size


def test_unknown_size_training_data_takes_class_weight_as_keras_does(models):
    # Keras turns class_weight into sample weights on a dataset (psclient refused it before).
    on_cluster, local = models
    labels = (Y > 0).astype("float32")

    def data():
        return tf.data.Dataset.from_tensor_slices((X, labels)).filter(lambda x, y: True).batch(64)

    weights = {0: 1.0, 1: 3.0}
    got = on_cluster.fit(data(), class_weight=weights, epochs=1, verbose=0).history
    want = local.fit(data(), class_weight=weights, epochs=1, verbose=0).history
    unweighted = local.fit(data(), epochs=1, verbose=0).history
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    assert abs(want["loss"][0] - unweighted["loss"][0]) > 1e-3  # the weights count


@pytest.mark.parametrize("training", ["arrays", "unknown size"])
def test_an_endless_validation_dataset_is_refused_when_fit_starts(models, training):
    # The validation data is adapted once, before the first epoch: its error comes before any
    # step is trained (it came after the first epoch, from Keras's own adapter), naming the
    # argument that fixes it.
    on_cluster, _ = models
    endless = tf.data.Dataset.from_tensor_slices((XV, YV)).batch(16).repeat()
    x, y = (X, Y) if training == "arrays" else (unknown_size(), None)
    before = int(on_cluster.optimizer.iterations.numpy())
    with pytest.raises(ValueError, match=r"validation_steps=None with an infinite dataset"):
        on_cluster.fit(x, y, batch_size=64, epochs=1, validation_data=endless, verbose=0)
    assert int(on_cluster.optimizer.iterations.numpy()) == before
    # With validation_steps, the same dataset validates.
    history = on_cluster.fit(x, y, batch_size=64, epochs=1, validation_data=endless, validation_steps=2,
                             verbose=0).history
    assert len(history["val_loss"]) == 1
