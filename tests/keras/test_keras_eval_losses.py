"""evaluate and fit's validation on the cluster count a model's own losses as Keras does.

Weight regularizers (embeddings, kernel, bias), activity regularizers and a
layer's `add_loss` all add to the loss Keras reports in `evaluate`; on two ps
tasks the cluster's numbers must equal single-process Keras with the same weights.
"""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(300)

_RNG = np.random.default_rng(7)
IDS = _RNG.integers(0, 40, (150, 3)).astype("int32")  # 150: batches of 16 do not divide it
Y = _RNG.standard_normal((150, 1)).astype("float32")
VAL_IDS = _RNG.integers(0, 40, (70, 3)).astype("int32")
VAL_Y = _RNG.standard_normal((70, 1)).astype("float32")


class Penalty(keras.layers.Layer):
    """Adds a loss of its own from its input, as a custom layer may."""

    def call(self, inputs):
        self.add_loss(0.05 * keras.ops.mean(keras.ops.abs(inputs)))
        return inputs


def build():
    ids = keras.Input((3,), dtype="int32")
    vectors = keras.layers.Embedding(40, 4, embeddings_regularizer=keras.regularizers.l2(1e-2))(ids)
    hidden = keras.layers.Dense(
        8, activation="relu",
        kernel_regularizer=keras.regularizers.l2(1e-2),
        bias_regularizer=keras.regularizers.l1(1e-2),
        bias_initializer="ones",  # a bias away from zero, so that its regularizer counts
        activity_regularizer=keras.regularizers.l2(1e-3),
    )(keras.layers.Flatten()(vectors))
    output = keras.layers.Dense(1)(Penalty()(hidden))
    model = keras.Model(ids, output)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mse", "mae"])
    return model


@pytest.fixture(scope="module")
def strategy(two_workers_two_ps):
    from psclient import ParameterServerStrategy

    s = ParameterServerStrategy(two_workers_two_ps.cluster)
    yield s
    s.shutdown()


def _local_copy(model):
    local = build()
    local.set_weights(model.get_weights())
    return local


def _assert_same(got, want):
    assert set(got) == set(want)
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name


def test_fit_validation_and_evaluate_count_every_loss(strategy):
    with strategy.scope():
        model = build()
    assert {v.value.device.split("/task:")[1][:1] for v in model.weights} == {"0", "1"}  # both ps tasks
    history = model.fit(IDS, Y, batch_size=16, epochs=2, verbose=0, validation_data=(VAL_IDS, VAL_Y))
    local = _local_copy(model)  # the weights validation saw: the last epoch's
    want = local.evaluate(VAL_IDS, VAL_Y, batch_size=16, verbose=0, return_dict=True)
    # The model's own losses matter here: Keras's loss is the mse plus them.
    assert want["loss"] - want["mse"] > 0.05
    _assert_same({name[4:]: values[-1] for name, values in history.history.items() if name.startswith("val_")}, want)
    for data, batch_size in (((VAL_IDS, VAL_Y), 16), ((IDS, Y), 7)):
        got = model.evaluate(*data, batch_size=batch_size, verbose=0, return_dict=True)
        _assert_same(got, local.evaluate(*data, batch_size=batch_size, verbose=0, return_dict=True))


def test_evaluate_leaves_the_model_losses_and_weights_alone(strategy):
    with strategy.scope():
        model = build()
    model.fit(IDS, Y, batch_size=32, epochs=1, verbose=0)
    before = [w.copy() for w in model.get_weights()]
    got = model.evaluate(tf.data.Dataset.from_tensor_slices((IDS, Y)).batch(10), verbose=0, return_dict=True)
    _assert_same(got, _local_copy(model).evaluate(IDS, Y, batch_size=10, verbose=0, return_dict=True))
    for after, was in zip(model.get_weights(), before):
        np.testing.assert_array_equal(after, was)
    # Losses collected while evaluating stay in evaluation: none is left on the layers.
    assert all(not layer._losses for layer in model._flatten_layers())
