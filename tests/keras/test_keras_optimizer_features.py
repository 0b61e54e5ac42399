"""Keras 3 options a published script may set, on the shared cluster as locally: an optimizer's
`gradient_accumulation_steps` and `global_clipnorm`, a `mixed_bfloat16` policy, and a masked
(`mask_zero=True`) embedding under a bidirectional LSTM."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(300)

_RNG = np.random.default_rng(3)
X = _RNG.standard_normal((64, 8)).astype("float32")
Y = (X[:, 0] - X[:, 2] > 0).astype("int32")


def _dense(optimizer):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _weights(model):
    return [np.array(v.numpy()) for v in model.trainable_variables]


def _one_step(model):
    """One training step (a fit of one batch, joined), on the same batch each time."""
    model.fit(X[:32], Y[:32], batch_size=32, epochs=1, shuffle=False, verbose=0)


@pytest.mark.parametrize("where", ["local", "cluster"])
def test_gradient_accumulation_applies_every_kth_step_as_locally(strategy, where):
    scope = strategy.scope() if where == "cluster" else tf.device("/cpu:0")
    with scope:
        model = _dense(keras.optimizers.SGD(0.5, gradient_accumulation_steps=3))
    start = _weights(model)
    for _ in range(2):
        _one_step(model)
        assert all(np.array_equal(a, b) for a, b in zip(start, _weights(model))), "applied before the 3rd step"
        assert int(model.optimizer.iterations.numpy()) == 0  # Keras counts the updates applied
    _one_step(model)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert any(not np.array_equal(a, b) for a, b in zip(start, _weights(model))), "not applied at the 3rd step"
    if where == "cluster":
        accumulators = [v for v in model.optimizer.variables if "accumulat" in v.path]
        assert accumulators and all("/job:ps/" in v._value.device for v in accumulators)


def test_global_clipnorm_bounds_one_update_on_the_cluster(strategy):
    with strategy.scope():
        model = _dense(keras.optimizers.SGD(1.0, global_clipnorm=1e-3))
    start = _weights(model)
    _one_step(model)
    moved = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(start, _weights(model))))
    assert 0 < moved <= 1e-3 * (1 + 1e-4)


def test_mixed_bfloat16_keeps_float32_variables_on_the_ps_and_trains(strategy):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(2), keras.layers.Activation("softmax", dtype="float32")])
            # A rate that learns X's rule within the fit: with Adam's default 1e-3 the 24 steps
            # moved the loss by less than bfloat16's rounding and it could end above its start.
            model.compile(keras.optimizers.Adam(0.03), "sparse_categorical_crossentropy")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert model.layers[0].compute_dtype == "bfloat16"
    assert all(v.dtype == "float32" and "/job:ps/" in v._value.device for v in model.trainable_variables)
    losses = model.fit(X, Y, batch_size=16, epochs=6, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses
    assert model.predict(X[:4], verbose=0).dtype == np.float32


def test_masked_sequences_predict_alike_whatever_their_padding(strategy):
    """`mask_zero=True`: the padding steps are skipped by the LSTMs, so a sequence padded to 6 and the
    same one padded to 10 predict the same, after training on the cluster as locally."""
    lengths = _RNG.integers(2, 6, size=128)
    sequences = [_RNG.integers(1, 30, size=n) for n in lengths]
    labels = np.array([int(s[0] > 15) for s in sequences])
    with strategy.scope():
        inputs = keras.Input((None,), dtype="int64")
        x = keras.layers.Embedding(30, 8, mask_zero=True)(inputs)
        x = keras.layers.Bidirectional(keras.layers.LSTM(4))(x)
        model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(x))
        model.compile("adam", "binary_crossentropy")
    short = keras.utils.pad_sequences(sequences, maxlen=6, padding="post")
    model.fit(short, labels, batch_size=32, epochs=2, verbose=0)
    long = keras.utils.pad_sequences(sequences, maxlen=10, padding="post")
    np.testing.assert_allclose(model.predict(short[:16], verbose=0), model.predict(long[:16], verbose=0),
                               rtol=1e-5, atol=1e-6)
    assert all("/job:ps/" in v._value.device for v in model.trainable_variables)
