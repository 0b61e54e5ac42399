"""Placement on a real cluster with two ps tasks, with Keras 3 models and optimizers."""

import numpy as np
import pytest
import tensorflow as tf

import psclient

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def strategy(one_worker_two_ps):
    # Whole variables, said explicitly: this module tests placing them
    # (partitioned ones are tests/strategy/test_partitioned.py's).
    s = psclient.ParameterServerStrategy(one_worker_two_ps.cluster, variable_partitioner=None)
    yield s
    s.shutdown()


def ps_of(variable):
    device = (variable.value if hasattr(variable, "value") and not isinstance(variable, tf.Variable) else variable).device
    assert "/job:ps/" in device, device
    return int(device.split("/task:")[1].split("/")[0])


def test_keras_model_and_adam_slots_balanced_and_colocated(strategy):
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
             keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)]
        )
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)

    report = strategy.placement()
    loads = report["bytes_per_ps"]
    largest = max(v["nbytes"] for v in report["variables"])
    # Greedy by bytes: the two ps tasks differ by at most one variable's size.
    assert max(loads) - min(loads) <= largest, loads
    # Kernels are not all on one task (what round robin does to kernel/bias pairs).
    kernels = [ps_of(v.value) for v in model.trainable_variables if "kernel" in v.path]
    assert len(set(kernels)) == 2, kernels
    # Every slot sits on the ps of the variable it belongs to.
    for var, m, v in zip(model.trainable_variables, optimizer._momentums, optimizer._velocities):
        assert ps_of(m.value) == ps_of(var.value) == ps_of(v.value), var.path


def test_explicit_ps_device_is_honoured(strategy):
    with strategy.scope():
        with tf.device("/job:ps/task:1"):
            pinned = tf.Variable(tf.zeros([1000]), name="pinned")
    assert ps_of(pinned) == 1
    entry = [v for v in strategy.placement()["variables"] if v["name"] == "pinned:0"][0]
    assert entry["reason"] == "requested" and entry["ps_index"] == 1


def test_keras_training_step_on_worker_updates_ps_variables(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = [strategy.schedule(step, args=(x, y)).result(60) for _ in range(30)]
    assert losses[-1] < 0.1 * losses[0]
    assert int(optimizer.iterations.numpy()) == 30
