"""Synchronous training with backup workers: `replicas_to_aggregate`.

One LocalCluster of 3 workers and 2 ps tasks for the module (2 ps so that
partitioned variables and their accumulators are split over both); each test
connects its own strategy, some of them to only 2 of the 3 workers.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
from psclient._cluster.local import LocalCluster  # noqa: E402
from tests._polling import wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def local():
    with LocalCluster(num_workers=3, num_ps=2) as cluster:
        yield cluster


@contextlib.contextmanager
def connected(local, workers=3, **kwargs):
    jobs = dict(local.cluster.jobs, worker=local.cluster.jobs["worker"][:workers])
    strategy = psclient.ParameterServerStrategy(psclient.Cluster(jobs), **kwargs)
    try:
        yield strategy
    finally:
        strategy.shutdown()


def make_model():
    # An embedding (its gradient is a tf.IndexedSlices) and a dense layer.
    return keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(40, 8),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(4),
    ])


def batches(count, seed=0):
    rng = np.random.default_rng(seed)
    xs = rng.integers(0, 40, (count, 16, 6)).astype("int32")
    ys = rng.integers(0, 4, (count, 16)).astype("int32")
    return tf.constant(xs), tf.constant(ys)


def train_step_on_worker_batch(model, optimizer, xs, ys):
    @tf.function
    def train_step():
        # Each worker its own fixed batch.
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        x, y = tf.gather(xs, worker), tf.gather(ys, worker)
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step


# Adam's first step is lr * g / (|g| + epsilon): with Keras's default 1e-7, an embedding row whose
# gradient is terms that almost cancel (|g| ~ 1e-8, a few ulps of 1e-9 off in another summation
# order) moves by a visibly different amount (1.4e-6 seen in CI). 1e-3 bounds the step's change to
# lr * 1e-9 / 1e-3, so the comparison below tells a wrong aggregation from rounding. Measured on 20
# of these models, one gradient scaled by 1 + 1e-7: weights up to 6.8e-7 apart with 1e-7, 3.7e-9 with 1e-3.
ADAM_EPSILON = 1e-3


@pytest.mark.parametrize("partitioner", [None, "fixed"])
def test_k_equals_n_applies_one_step_on_the_mean_gradient(local, partitioner):
    variable_partitioner = None if partitioner is None else \
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)
    with connected(local, workers=2, replicas_to_aggregate=2, variable_partitioner=variable_partitioner) as strategy:
        with strategy.scope():
            model = make_model()
            optimizer = keras.optimizers.Adam(0.01, epsilon=ADAM_EPSILON)
        if partitioner is not None:
            assert any(v.get("part") for v in strategy.placement()["variables"])
        initial = [w.copy() for w in model.get_weights()]
        xs, ys = batches(2)
        train_step = train_step_on_worker_batch(model, optimizer, xs, ys)
        futures = [strategy.schedule(train_step) for _ in range(2)]
        strategy.join()
        assert all(np.isfinite(f.result()) for f in futures)
        after = model.get_weights()
        iterations = int(optimizer.iterations.numpy())
        staleness = strategy.stats()["staleness"]

    # The same step locally: both gradients on the same weights, their mean, one Adam step.
    local_model = make_model()
    local_model.set_weights(initial)
    local_optimizer = keras.optimizers.Adam(0.01, epsilon=ADAM_EPSILON)
    grads = []
    for worker in range(2):
        with tf.GradientTape() as tape:
            loss = LOSS(ys[worker], local_model(xs[worker], training=True))
        grads.append([tf.convert_to_tensor(g) for g in tape.gradient(loss, local_model.trainable_variables)])
    mean = [(a + b) / 2 for a, b in zip(*grads)]
    local_optimizer.apply_gradients(zip(mean, local_model.trainable_variables))
    # float32 sums in another order (accumulator, then / k): a few ulps of the gradient's terms,
    # which ADAM_EPSILON keeps from growing into more than 1e-8 of a weight.
    for got, want, before in zip(after, local_model.get_weights(), initial):
        assert not np.allclose(got, before)  # it moved...
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # ...as one local step
    assert iterations == 1  # one update, not one per worker
    assert staleness["updates"] == 1 and staleness["count"] == 2 and staleness["dropped"] == 0
    assert [w["count"] for w in staleness["per_worker"]] == [1, 1]


def plain_steps(strategy):
    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.Adam(0.01)
    xs, ys = batches(3)
    return optimizer, train_step_on_worker_batch(model, optimizer, xs, ys)


def run_steps(strategy, fn, count):
    futures = [strategy.schedule(fn) for _ in range(count)]
    strategy.join()
    return futures


def check_counts(staleness, k, updates):
    # Each update took exactly k accepted gradients; fewer than k wait for the next.
    assert staleness["updates"] == updates
    assert 0 <= staleness["count"] - k * updates < k
    assert staleness["max"] == 0  # accepted gradients are all of the current step


def test_k_of_n_keeps_training_with_a_worker_stopped(local):
    with connected(local, replicas_to_aggregate=2, hang_timeout=5.0) as strategy:
        optimizer, train_step = plain_steps(strategy)
        run_steps(strategy, train_step, 3)
        before = int(optimizer.iterations.numpy())
        local.stop("worker", 2)
        try:
            futures = [strategy.schedule(train_step) for _ in range(40)]
            # Progress while worker 2 is stopped (its one step, if it took one,
            # waits for the heartbeat to take it out and runs elsewhere).
            wait_for(lambda: int(optimizer.iterations.numpy()) >= before + 10, 60,
                     "10 updates with worker 2 stopped")
        finally:
            local.resume("worker", 2)
        strategy.join()
        assert all(np.isfinite(f.result()) for f in futures)
        staleness = strategy.stats()["staleness"]
        check_counts(staleness, 2, int(optimizer.iterations.numpy()))


@pytest.mark.long
def test_stale_gradients_of_a_straggler_are_dropped_and_counted(local):
    with connected(local, replicas_to_aggregate=2) as strategy:
        optimizer, train_step = plain_steps(strategy)
        run_steps(strategy, train_step, 3)

        def straggler_dropped():
            return strategy.stats()["staleness"]["per_worker"][2]["dropped"]

        before = straggler_dropped()  # with 2 of 3, a third gradient can be late anyway
        local.throttle("worker", 2, 0.25)
        scheduled = 3
        try:
            while scheduled < 1500 and straggler_dropped() == before:
                run_steps(strategy, train_step, 60)
                scheduled += 60
        finally:
            local.throttle("worker", 2, 1.0)
        staleness = strategy.stats()["staleness"]
        print(f"replicas_to_aggregate=2 of 3, worker 2 at 0.25, {scheduled} steps:",
              {key: staleness[key] for key in ("count", "updates", "dropped")},
              "worker 2:", staleness["per_worker"][2], staleness["sync"])
        assert straggler_dropped() > before and staleness["dropped_staleness"]["max"] >= 1
        assert staleness["count"] + staleness["dropped"] == scheduled
        check_counts(staleness, 2, int(optimizer.iterations.numpy()))


@pytest.mark.long
def test_synchronous_training_goes_on_through_a_ps_restart(local, tmp_path):
    # Version, lock and accumulators live on the ps: made again after ps 0 is rebuilt.
    with connected(local, workers=2, replicas_to_aggregate=2, checkpoint_dir=str(tmp_path)) as strategy:
        optimizer, train_step = plain_steps(strategy)
        run_steps(strategy, train_step, 10)
        local.kill("ps", 0)
        local.restart("ps", 0)
        futures = run_steps(strategy, train_step, 20)
        assert all(np.isfinite(f.result()) for f in futures)
        assert strategy.stats()["ps"][0]["recoveries"] == 1
        staleness = strategy.stats()["staleness"]
        assert staleness["updates"] >= 10  # 5 before, 10 after (the restored ones rolled back)
        assert int(optimizer.iterations.numpy()) >= 10


def test_keras_fit_runs_synchronously_with_the_same_model_code(local):
    with connected(local, replicas_to_aggregate=3) as strategy:
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.Adam(0.02), loss=LOSS, metrics=["accuracy"])
        rng = np.random.default_rng(0)
        x = rng.standard_normal((512, 8)).astype("float32")
        y = (x[:, 0] + x[:, 1] > 0).astype("int32")
        history = model.fit(x, y, batch_size=32, epochs=3, steps_per_epoch=12, verbose=0)
        staleness = strategy.stats()["staleness"]
        check_counts(staleness, 3, int(model.optimizer.iterations.numpy()))
        assert staleness["count"] + staleness["dropped"] == 36
        assert history.history["loss"][-1] < history.history["loss"][0]

        with strategy.scope():
            model.compile(optimizer=keras.optimizers.Adam(0.02), loss=LOSS, steps_per_execution=2)
        with pytest.raises(ValueError, match="replicas_to_aggregate.*tf.while_loop or tf.cond"):
            model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=4, verbose=0)


def test_unsupported_forms_are_refused_naming_the_argument(local):
    with connected(local, replicas_to_aggregate=2) as strategy:
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            optimizer = keras.optimizers.SGD(0.1)
            optimizer.build(model.trainable_variables)
        x = tf.ones((8, 4))

        def grads():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            return tape.gradient(loss, model.trainable_variables)

        @tf.function
        def applies_twice():
            optimizer.apply_gradients(zip(grads(), model.trainable_variables))
            optimizer.apply_gradients(zip(grads(), model.trainable_variables))

        with pytest.raises(ValueError, match=r"`replicas_to_aggregate`.*applies gradients twice"):
            strategy.schedule(applies_twice)

        @tf.function
        def raw_update():
            kernel = model.trainable_variables[0].value
            tf.distribute.get_strategy().extended.update(kernel, lambda v, g: v.assign_sub(g), args=(grads()[0],))

        with pytest.raises(ValueError, match=r"`replicas_to_aggregate`.*extended.update outside"):
            strategy.schedule(raw_update)

        @tf.function
        def one_apply():
            optimizer.apply_gradients(zip(grads(), model.trainable_variables))
            return tf.constant(1)

        concrete = one_apply.get_concrete_function()  # traced by the user: psclient cannot follow it
        with pytest.raises(ValueError, match=r"`fn` of schedule\(.*\) with replicas_to_aggregate=2"):
            strategy.schedule(concrete)
        # Evaluation functions need nothing of this.
        assert strategy.schedule(tf.function(lambda: tf.reduce_sum(model(x)))).result() is not None
