"""BatchNormalization's moving statistics on the ps: no update lost to a concurrent worker.

Every batch is the same fixed batch, each column's values 5 +/- 0.5: every
step's batch mean is exactly 5 and its variance exactly 0.25, so after N
steps (the optimizer's `iterations`, which counts atomically) the moving
statistics have a closed form. A lost update leaves the mean below it and the
variance above it. An update computed from a value another worker has moved
on from since (tf_keras's semantics, and psclient's) overshoots a little
towards the target instead: the bound on that side is the same recursion
with every update computed from a read `STALE` updates old. With `renorm=True`,
`moving_variance` is not an average but `relu(moving_stddev**2 - epsilon)`:
checked against the stddev left on the ps, in a fit and in two interleaved
calls whose order is fixed.
"""

from concurrent.futures import ThreadPoolExecutor

import inspect

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(300)

MOMENTUM = 0.99
STEPS = 200
#: Reads at most this many updates old: 2 workers, one step each in flight.
STALE = 3
SIGNS = np.array([1, -1] * 4, "float32")
X = (5.0 + 0.5 * SIGNS[:, None] * np.ones((1, 4), "float32")).astype("float32")  # 8 rows, 4 columns
Y = np.zeros((8, 1), "float32")


def moving_average(start, target, steps, stale=0):
    """`steps` updates `m -= (1 - momentum) * (m_read - target)`, each `m_read` `stale` updates old."""
    history = [start]
    for step in range(steps):
        read = history[max(0, step - stale)]
        history.append(history[-1] - (1 - MOMENTUM) * (read - target))
    return history[-1]


#: Keras added BatchNormalization(renorm=...) after 3.10 (the oldest Keras psclient supports).
HAS_RENORM = "renorm" in inspect.signature(keras.layers.BatchNormalization).parameters
needs_renorm = pytest.mark.skipif(not HAS_RENORM, reason=f"Keras {keras.__version__}'s BatchNormalization "
                                  "has no renorm argument")


@pytest.mark.parametrize("renorm", [False, pytest.param(True, marks=needs_renorm)], ids=["plain", "renorm"])
def test_moving_statistics_count_every_update_of_both_workers(strategy, renorm):
    with strategy.scope():
        layer = keras.layers.BatchNormalization(momentum=MOMENTUM, **({"renorm": True} if renorm else {}))
        model = keras.Sequential([keras.Input((4,)), layer, keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0), loss="mse")
    assert layer.moving_mean.value.device.startswith("/job:ps/")
    dataset = tf.data.Dataset.from_tensors((X, Y)).repeat()
    done_before = [w["done"] for w in strategy.stats()["workers"]]
    model.fit(dataset, epochs=1, steps_per_epoch=STEPS, verbose=0)
    steps = int(model.optimizer.iterations.numpy())
    assert steps == STEPS
    done = [w["done"] - before for w, before in zip(strategy.stats()["workers"], done_before)]
    assert min(done) > 0, done  # both workers updated them

    mean = layer.moving_mean.numpy()
    exact = moving_average(0.0, 5.0, steps)  # 5 - 5 * 0.99**N
    assert exact == pytest.approx(5 - 5 * MOMENTUM**steps)
    stale = moving_average(0.0, 5.0, steps, STALE)
    np.testing.assert_array_less(exact - 1e-4, mean)  # below: updates were lost
    np.testing.assert_array_less(mean, stale + 1e-4)

    variance = layer.moving_variance.numpy()
    if renorm:
        # moving_stddev is the average (a delta each update), of sqrt(0.25 + epsilon) from 1.
        target = np.sqrt(0.25 + layer.epsilon)
        stddev = layer.moving_stddev.numpy()
        np.testing.assert_array_less(moving_average(1.0, target, steps, STALE) - 1e-4, stddev)
        np.testing.assert_array_less(stddev, moving_average(1.0, target, steps) + 1e-4)  # above: lost
        # moving_variance is assigned relu(s**2 - epsilon) of the stddev its writer read
        # after its own stddev update: exact, except that the last writer's read can miss
        # the other worker's updates landing before its variance write. s falls here, so a
        # missed update leaves the variance above, by about 2 * s * (1 - momentum) * (s -
        # target) each; bounded as the reads are (at most STALE updates).
        derived = np.maximum(stddev * stddev - layer.epsilon, 0.0)
        one_update = 2 * stddev * (1 - MOMENTUM) * (stddev - target)
        np.testing.assert_array_less(derived - 1e-6, variance)
        np.testing.assert_array_less(variance, derived + STALE * one_update + 1e-6)
    else:
        low, high = moving_average(1.0, 0.25, steps, STALE), moving_average(1.0, 0.25, steps)
        np.testing.assert_array_less(low - 1e-4, variance)
        np.testing.assert_array_less(variance, high + 1e-4)  # above: updates were lost


def test_local_keras_is_untouched():
    # Outside the strategy's scope, Keras's own call and arithmetic.
    layer = keras.layers.BatchNormalization(momentum=MOMENTUM)
    for _ in range(3):
        layer(X, training=True)
    np.testing.assert_allclose(layer.moving_mean.numpy(), moving_average(0.0, 5.0, 3), rtol=1e-6)
    layer(X, training=False)
    np.testing.assert_allclose(layer.moving_mean.numpy(), moving_average(0.0, 5.0, 3), rtol=1e-6)


class CountingBatchNormalization(keras.layers.BatchNormalization):
    """Assigns one more variable of its own inside BatchNormalization's call."""

    def build(self, input_shape):
        super().build(input_shape)
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def _moments(self, inputs, mask):
        self.calls.assign(self.calls + 1.0)
        return super()._moments(inputs, mask)


def test_one_call_on_the_ps_equals_local_keras(strategy):
    # Eager, from the coordinator: outputs and statistics as Keras's own, and a
    # subclass's assign inside the call is written, not held back.
    local = CountingBatchNormalization(momentum=MOMENTUM)
    with strategy.scope():
        remote = CountingBatchNormalization(momentum=MOMENTUM)
        remote.build(X.shape)
    assert remote.moving_variance.value.device.startswith("/job:ps/")
    inputs = X * np.arange(1, 5, dtype="float32")
    for _ in range(2):
        np.testing.assert_allclose(remote(inputs, training=True), local(inputs, training=True), rtol=1e-6)
    for name in ("moving_mean", "moving_variance", "calls"):
        np.testing.assert_allclose(getattr(remote, name).numpy(), getattr(local, name).numpy(), rtol=1e-6)
    assert remote.calls.numpy() == 2.0


class InterleavingBatchNormalization(keras.layers.BatchNormalization):
    """Runs `between` once, in another thread, inside its next training call: after the
    call's reads of the statistics, before its writes."""

    between = None

    def _moments(self, inputs, mask):
        between, self.between = self.between, None
        if between is not None:
            with ThreadPoolExecutor(1) as pool:
                pool.submit(between).result()
        return super()._moments(inputs, mask)


@needs_renorm
def test_renorm_moving_variance_is_derived_from_the_stddev_on_the_ps(strategy):
    # Two "workers" on one layer, deterministically interleaved: B's whole step lands
    # between A's reads and A's writes. Both stddev updates count (each a delta from
    # the stddev its worker read), and moving_variance is relu(s**2 - epsilon) of the
    # stddev they leave, which A writes last. As a delta from A's read of the variance it
    # would be off by about 2 * (A's stddev change) * (B's), here about 0.5.
    momentum = 0.5
    with strategy.scope():
        layer = InterleavingBatchNormalization(momentum=momentum, renorm=True)
        layer.build(X.shape)
    assert layer.moving_variance.value.device.startswith("/job:ps/")
    eps = layer.epsilon
    b_inputs = 5.0 + 3.0 * SIGNS[:, None] * np.ones((1, 4), "float32")  # variance 9
    b_outputs = []
    layer.between = lambda: b_outputs.append(layer(b_inputs, training=True))
    layer(X, training=True)  # variance 0.25
    assert len(b_outputs) == 1

    # Both read the initial stddev, 1.
    a_change = (1 - momentum) * (np.sqrt(0.25 + eps) - 1.0)
    b_change = (1 - momentum) * (np.sqrt(9.0 + eps) - 1.0)
    stddev = 1.0 + a_change + b_change
    np.testing.assert_allclose(layer.moving_stddev.numpy(), np.full(4, stddev), rtol=1e-6)
    np.testing.assert_allclose(layer.moving_variance.numpy(), np.full(4, stddev * stddev - eps), rtol=1e-6)
    # And the means (deltas) both count too.
    np.testing.assert_allclose(layer.moving_mean.numpy(), np.full(4, 2 * (1 - momentum) * 5.0), rtol=1e-6)
