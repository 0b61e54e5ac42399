"""Bad input to Keras's fit/evaluate/predict on the cluster: clear errors, or documented behaviour."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(300)

X = np.random.default_rng(4).standard_normal((64, 4)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


def layers():
    return [keras.Input((4,)), keras.layers.Dense(2)]


def compile_(model, **kwargs):
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kwargs)
    return model


@pytest.fixture
def model(strategy):
    with strategy.scope():
        return compile_(keras.Sequential(layers()))


def test_fit_infinite_data_without_steps_per_epoch(model):
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).repeat()
    with pytest.raises(ValueError, match=r"Invalid value for argument `steps_per_epoch`\. Received: steps_per_epoch=None"):
        model.fit(dataset, epochs=1, verbose=0)


def test_fit_dataset_function_without_steps_per_epoch(model):
    with pytest.raises(ValueError, match=r"`steps_per_epoch`.*a dataset function"):
        model.fit(lambda ctx: tf.data.Dataset.from_tensor_slices((X, Y)).batch(8), epochs=1, verbose=0)


def test_evaluate_infinite_data_without_steps(model):
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).repeat()
    with pytest.raises(ValueError, match=r"Invalid value for argument `steps`\. Received: steps=None"):
        model.evaluate(dataset, verbose=0)


def test_dataset_function_with_the_wrong_signature(model):
    def two_args(ctx, extra):
        return tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)

    with pytest.raises(TypeError, match=r"Invalid value for argument `x`\. Received: a function with signature two_args\(ctx, extra\)"):
        model.fit(two_args, epochs=1, steps_per_epoch=2, verbose=0)


def test_dataset_function_that_returns_no_dataset(model):
    with pytest.raises(TypeError, match=r"dataset function returned an object of type tuple\. Expected a tf\.data\.Dataset"):
        model.fit(lambda ctx: (X, Y), epochs=1, steps_per_epoch=2, verbose=0)


def test_a_generators_error_mid_epoch_ends_fit_with_it(model):
    # A generator is read on the coordinator (psclient._keras.host_data): its error is fit's.
    def batches():
        for _ in range(3):
            yield X[:8], Y[:8]
        raise ValueError("corrupt record 3")

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"corrupt record 3"):  # as local Keras raises it
        model.fit(batches(), epochs=1, steps_per_epoch=6, verbose=0)


def test_model_built_outside_scope_compiled_inside_moves_its_weights_to_the_ps(strategy):
    model = keras.Sequential(layers())  # weights created here, in this process
    before = [w.numpy() for w in model.weights]
    with strategy.scope():
        compile_(model)  # optimizer and loss tracker on the ps
    with pytest.warns(UserWarning, match=r"variables 'sequential\w*/dense\w*/kernel', .* created outside strategy\.scope\(\).*copied onto the ps"):
        model.fit(X, Y, epochs=1, steps_per_epoch=1, verbose=0)
    assert all("/job:ps" in w._value.device for w in model.weights)
    assert [w.shape for w in model.weights] == [b.shape for b in before]


def test_model_entirely_outside_scope_trains_locally_with_a_warning(strategy):
    model = compile_(keras.Sequential(layers()))
    with pytest.warns(UserWarning, match=r"trains .* in this process: none of its variables"):
        history = model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    assert len(history.history["loss"]) == 1
    assert not any("/job:ps" in v._value.device for v in model.weights)
    before = strategy.stats()["scheduled"]
    model.evaluate(X, Y, verbose=0)  # stock Keras: nothing scheduled on the cluster
    assert strategy.stats()["scheduled"] == before


def test_run_eagerly(strategy):
    with strategy.scope():
        model = compile_(keras.Sequential(layers()), run_eagerly=True)
    with pytest.raises(ValueError, match=r"Invalid value for argument `run_eagerly` of compile\(\)\. Received: run_eagerly=True"):
        model.fit(X, Y, epochs=1, verbose=0)


def test_keras_backend_other_than_tensorflow(monkeypatch):
    # Keras's other backends (jax, torch, numpy) are not installed here, so
    # the backend Keras reports is faked; the check reads nothing else.
    import keras.src.backend

    from psclient._keras.install import check_keras_backend

    assert check_keras_backend() is True
    monkeypatch.setattr(keras.src.backend, "backend", lambda: "jax")
    with pytest.raises(RuntimeError, match=r"Received: keras\.backend\.backend\(\)='jax'.*KERAS_BACKEND=tensorflow"):
        check_keras_backend()


def test_data_that_does_not_fit_the_model_raises_kerass_own_error(model):
    """A model given data of the wrong width: Keras's own ValueError, as local Keras raises it."""
    wide = np.zeros((64, 6), "float32")
    with pytest.raises(ValueError, match=r"incompatible with the layer"):
        model.fit(wide, Y, epochs=1, batch_size=16, verbose=0)
    local = compile_(keras.Sequential(layers()))
    with pytest.raises(ValueError, match=r"incompatible with the layer"):
        local.fit(wide, Y, epochs=1, batch_size=16, verbose=0)
