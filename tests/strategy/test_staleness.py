"""Staleness measured, and bounded with `max_staleness`.

The session's shared LocalCluster of 3 workers and 1 ps; each test connects its
own strategy. A straggler is made with `LocalCluster.throttle`, so that stale
updates really happen. What is checked against what: the staleness
statistics against `optimizer.iterations` (every applied update counted once),
the bound against the largest staleness any applied update had.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402

pytestmark = pytest.mark.timeout(300)

WORKERS = 3
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
RNG = np.random.default_rng(0)
X = tf.constant(RNG.standard_normal((32, 16)).astype("float32"))
Y = tf.constant(RNG.integers(0, 4, 32).astype("int32"))


@pytest.fixture(scope="module")
def local(three_workers_one_ps):
    assert three_workers_one_ps.cluster.num_workers == WORKERS
    return three_workers_one_ps


@contextlib.contextmanager
def connected(local, **kwargs):
    strategy = psclient.ParameterServerStrategy(local.cluster, **kwargs)
    try:
        yield strategy
    finally:
        strategy.shutdown()


def model_and_steps(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(4)])
        optimizer = keras.optimizers.Adam(1e-3)

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = LOSS(Y, model(X, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": loss, "rows": tf.shape(X)[0]}

    @tf.function
    def evaluate():
        return LOSS(Y, model(X, training=False))

    return model, optimizer, train_step, evaluate


def run_steps(strategy, fn, count):
    futures = [strategy.schedule(fn) for _ in range(count)]
    strategy.join()
    return [f.result() for f in futures]


def test_staleness_of_every_applied_update_is_reported(local):
    with connected(local, measure_staleness=True) as strategy:
        model, optimizer, train_step, evaluate = model_and_steps(strategy)
        results = run_steps(strategy, train_step, 60)
        # The user's result, untouched by the report the step also returns.
        assert set(results[0]) == {"loss", "rows"} and results[0]["rows"] == 32
        run_steps(strategy, evaluate, 10)  # applies nothing: not counted
        staleness = strategy.stats()["staleness"]
        assert staleness["count"] == staleness["updates"] == 60 == int(optimizer.iterations.numpy())
        assert staleness["dropped"] == 0
        assert sum(w["count"] for w in staleness["per_worker"]) == 60
        done = [w["done"] for w in strategy.stats()["workers"]]
        # Per worker: its own updates (evaluations are done steps but no updates).
        assert all(w["count"] <= d for w, d in zip(staleness["per_worker"], done))
        assert 0 <= staleness["p50"] <= staleness["p99"] <= staleness["max"] < 60
        assert staleness["max_staleness"] is None and staleness["replicas_to_aggregate"] is None
        assert staleness["measured"] is True


def test_asynchronous_training_is_not_measured_by_default(local):
    # Measuring costs CPU per step (docs/staleness.md): opt-in with measure_staleness=True.
    with connected(local) as strategy:
        model, optimizer, train_step, _ = model_and_steps(strategy)
        results = run_steps(strategy, train_step, 5)
        assert set(results[0]) == {"loss", "rows"}
        traced = strategy._tracer._trace(train_step, "train_step", (), {})
        assert isinstance(traced, tf.types.experimental.ConcreteFunction)  # plain: no report, no version read
        staleness = strategy.stats()["staleness"]
        assert staleness["measured"] is False and staleness["count"] == 0
        assert int(optimizer.iterations.numpy()) == 5


def test_evaluation_runs_its_plain_trace(local):
    with connected(local, measure_staleness=True) as strategy:
        _, _, train_step, evaluate = model_and_steps(strategy)
        train_step_future = strategy.schedule(train_step)
        evaluation = strategy.schedule(evaluate)
        strategy.join()
        assert np.isfinite(evaluation.result()) and np.isfinite(train_step_future.result()["loss"])
        traced = {fn: strategy._tracer._trace(fn, fn.__name__, (), {}) for fn in (train_step, evaluate)}
        # The training step is called through psclient's caller (its report stripped);
        # the evaluation is TF's plain concrete function: no version read, no extra output.
        assert hasattr(traced[train_step], "concrete")
        assert isinstance(traced[evaluate], tf.types.experimental.ConcreteFunction)
        captured = [v.name for v in traced[evaluate].variables]
        assert not [name for name in captured if "psclient" in name]


def test_steps_with_per_worker_and_unhashable_arguments_are_measured(local):
    # A per-worker iterator with a list: no trace cached by argument identity,
    # each call looks its trace up (psclient's instrumented one).
    with connected(local, measure_staleness=True) as strategy:
        model, optimizer, _, _ = model_and_steps(strategy)
        dataset = tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(8)
        iterator = iter(strategy.distribute_datasets_from_function(dataset))

        @tf.function
        def step(iterator, scales):
            x, y = next(iterator)
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x * scales[0], training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        losses = [strategy.schedule(step, args=(iterator, [1.0])) for _ in range(6)]
        strategy.join()
        assert all(np.isfinite(f.result()) for f in losses)
        assert strategy.stats()["staleness"]["count"] == 6 == int(optimizer.iterations.numpy())


def test_autograph_still_converts_the_step(local):
    with connected(local, max_staleness=100) as strategy:
        model, optimizer, _, _ = model_and_steps(strategy)

        def python_step(scale):
            with tf.GradientTape() as tape:
                loss = LOSS(Y, model(X * scale, training=True))
            if loss > 0:  # a tensor condition: only AutoGraph makes this a tf.cond
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        # The optimizer's apply is inside AutoGraph's tf.cond: refused (nested).
        with pytest.raises(ValueError, match="max_staleness.*tf.while_loop or tf.cond"):
            strategy.schedule(python_step, args=(1.0,))

        def flat_step(scale):
            with tf.GradientTape() as tape:
                loss = LOSS(Y, model(X * scale, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            for_each = tf.constant(0)
            for _ in tf.range(3):  # AutoGraph turns this into a tf.while_loop
                for_each += 1
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return for_each

        assert strategy.schedule(flat_step, args=(1.0,)).result() == 3
        assert strategy.stats()["staleness"]["updates"] == 1


def test_max_staleness_is_never_exceeded_with_a_straggler(local):
    bound = 1
    with connected(local, max_staleness=bound) as strategy:
        model, optimizer, train_step, _ = model_and_steps(strategy)
        run_steps(strategy, train_step, WORKERS)  # traced and registered everywhere first
        local.throttle("worker", WORKERS - 1, 0.25)
        scheduled = WORKERS
        try:
            # Until some update was too stale (a straggler's, mostly), 1,500 steps at most.
            while scheduled < 1500 and not strategy.stats()["staleness"]["dropped"]:
                run_steps(strategy, train_step, 100)
                scheduled += 100
        finally:
            local.throttle("worker", WORKERS - 1, 1.0)
        staleness = strategy.stats()["staleness"]
        updates = int(optimizer.iterations.numpy())
        print(f"max_staleness={bound}, worker 2 at 0.25, {scheduled} steps:", {k: staleness[k] for k in
              ("count", "p50", "p99", "max", "dropped")}, "dropped:", staleness["dropped_staleness"])
        # Every applied update counted, none staler than the bound; the others dropped.
        assert staleness["count"] == staleness["updates"] == updates
        assert staleness["count"] + staleness["dropped"] == scheduled
        assert staleness["max"] <= bound
        assert staleness["dropped"] > 0 and staleness["dropped_staleness"]["max"] > bound


# ------------------------------------------------------------ bad input
CLUSTER = {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3"]}


@pytest.mark.parametrize("kwargs, message", [
    ({"max_staleness": -1}, r"`max_staleness`\. Received: max_staleness=-1\. Expected an integer >= 0"),
    ({"max_staleness": 1.5}, r"`max_staleness`\. Received: max_staleness=1.5"),
    ({"max_staleness": "2"}, r"`max_staleness`\. Received: max_staleness='2'"),
    ({"max_staleness": True}, r"`max_staleness`\. Received: max_staleness=True"),
    ({"replicas_to_aggregate": 0}, r"`replicas_to_aggregate`\. Received: replicas_to_aggregate=0\. "
                                   r"Expected an integer >= 1"),
    ({"replicas_to_aggregate": 3}, r"`replicas_to_aggregate`\. Received: replicas_to_aggregate=3 with 2 "
                                   r"workers\. Expected an integer between 1 and the number of workers"),
    ({"replicas_to_aggregate": 2.0}, r"`replicas_to_aggregate`\. Received: replicas_to_aggregate=2.0"),
    ({"measure_staleness": "yes"}, r"`measure_staleness`\. Received: measure_staleness='yes'"),
    ({"measure_staleness": False, "max_staleness": 3}, r"`measure_staleness`\. Received: measure_staleness="
                                                       r"False with max_staleness=3"),
    ({"replicas_to_aggregate": 2, "max_staleness": 0}, r"`max_staleness`\. Received: max_staleness=0 "
                                                       r"with replicas_to_aggregate=2\. Expected None"),
])
def test_bad_arguments_name_the_argument(kwargs, message):
    # Checked before anything connects: these addresses serve nothing.
    with pytest.raises(ValueError, match=message):
        psclient.ParameterServerStrategy(CLUSTER, connect_timeout=0.1, **kwargs)


@pytest.mark.long
def test_staleness_logger_puts_the_figures_in_fits_logs(local):
    with connected(local, measure_staleness=True) as strategy:
        with strategy.scope():
            model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4)])
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS)
        dataset = tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(8)
        history = model.fit(dataset, epochs=2, steps_per_epoch=6, verbose=0,
                            callbacks=[psclient.StalenessLogger(strategy)])
        for key in ("staleness_mean", "staleness_p50", "staleness_p99", "staleness_max", "staleness_dropped"):
            assert len(history.history[key]) == 2, (key, history.history)
        counted = strategy.stats()["staleness"]
        assert counted["count"] == 12 == int(model.optimizer.iterations.numpy())
        assert history.history["staleness_max"][-1] == counted["max"]
    with connected(local) as strategy:  # not measured: said at once, not 0s in the logs
        with strategy.scope():
            model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4)])
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS)
        with pytest.raises(ValueError, match="measure_staleness=True"):
            model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(8), epochs=1,
                      steps_per_epoch=2, verbose=0, callbacks=[psclient.StalenessLogger(strategy)])
    with pytest.raises(TypeError, match="Invalid value for argument `strategy`"):
        psclient.StalenessLogger("strategy")
