"""model.fit of Keras 3 models whose variables live on the shared cluster's ps task."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(300)

_RNG = np.random.default_rng(0)
X = _RNG.standard_normal((256, 8)).astype("float32")
Y = (X[:, 0] + X[:, 1] > 0).astype("int32")


def make_model(strategy, *, optimizer="adam", metrics=("accuracy",), steps_per_execution=1, **compile_kwargs):
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(2),
        ])
        model.compile(
            optimizer=optimizer() if callable(optimizer) else optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=list(metrics),
            steps_per_execution=steps_per_execution,
            **compile_kwargs,
        )
    return model


def ps_devices(model):
    return {v._value.device for v in model.variables + model.optimizer.variables + model.metrics_variables}


def test_fit_numpy_trains_on_ps_with_validation_and_progress_bar(strategy, capsys):
    model = make_model(strategy)
    history = model.fit(
        X, Y, batch_size=32, epochs=4, validation_data=(X[:64], Y[:64]), verbose=1,
    )
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert all(len(values) == 4 for values in history.history.values())
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert all(np.isfinite(history.history["val_loss"]))
    # Every step ran: one epoch is the 8 batches of the arrays.
    assert int(model.optimizer.iterations.numpy()) == 4 * 8
    assert all(device.startswith("/job:ps/") for device in ps_devices(model))
    out = capsys.readouterr().out
    assert "Epoch 4/4" in out and "8/8" in out and "val_accuracy" in out


def test_metrics_aggregate_every_worker_without_lost_updates(strategy):
    # Learning rate 0: the weights stay put, so every step's loss is the loss
    # of the same fixed batch, whichever worker took it. The loss tracker's
    # count must see every example of every step of both workers.
    batch = 16
    dataset = tf.data.Dataset.from_tensors((X[:batch], Y[:batch])).repeat()
    model = make_model(strategy, optimizer=lambda: keras.optimizers.SGD(learning_rate=0.0))
    steps = 40
    history = model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
    assert float(model._loss_tracker.count.numpy()) == steps * batch
    assert int(model.optimizer.iterations.numpy()) == steps
    done = [w["done"] for w in strategy.stats()["workers"]]
    assert sum(done) >= steps
    expected = model.evaluate(X[:batch], Y[:batch], batch_size=batch, verbose=0, return_dict=True)
    assert history.history["loss"][0] == pytest.approx(expected["loss"], rel=1e-5)
    assert history.history["accuracy"][0] == pytest.approx(expected["accuracy"], rel=1e-6)


# 21 ends each epoch with a single step (the loop-free function), 23 with three.
@pytest.mark.parametrize("steps_per_epoch", [20, 21, 23])
def test_steps_per_execution_runs_exactly_steps_per_epoch(strategy, steps_per_epoch):
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(256).batch(32).repeat()
    model = make_model(strategy, steps_per_execution=10)
    batches = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append((batch, dict(logs)))

    history = model.fit(dataset, epochs=2, steps_per_epoch=steps_per_epoch, verbose=0, callbacks=[Record()])
    # Keras calls once per execution of up to 10 steps; the last one of an
    # epoch runs only what is left, so the count is exact.
    assert int(model.optimizer.iterations.numpy()) == 2 * steps_per_epoch
    calls = -(-steps_per_epoch // 10)
    assert len(batches) == 2 * calls
    assert all(set(logs) == {"loss", "accuracy"} and np.isfinite(logs["loss"]) for _, logs in batches)
    assert len(history.history["loss"]) == 2


def test_dataset_function_gets_each_workers_input_context(strategy):
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.input_pipeline_id, ctx.num_input_pipelines))
        return (
            tf.data.Dataset.from_tensor_slices((X, Y))
            .shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            .batch(16)
        )

    model = make_model(strategy)
    history = model.fit(dataset_fn, epochs=2, steps_per_epoch=10, verbose=0)
    # Traced once (as TF does); the worker's index is a tensor filled in on each worker.
    assert len(contexts) == 1 and tf.is_tensor(contexts[0][0]) and contexts[0][1] == 2
    assert len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations.numpy()) == 20


def test_initial_epoch_validation_freq_and_history(strategy):
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(32)
    validation = tf.data.Dataset.from_tensor_slices((X[:64], Y[:64])).batch(32)
    model = make_model(strategy)
    history = model.fit(
        dataset, epochs=5, initial_epoch=2, validation_data=validation, validation_freq=2, verbose=0,
    )
    assert history.epoch == [2, 3, 4]
    # Epochs are 1-indexed for validation_freq: only epoch 4 (index 3) validates.
    assert len(history.history["val_loss"]) == 1
    assert int(model.optimizer.iterations.numpy()) == 3 * 8


def test_validation_split_of_arrays(strategy):
    model = make_model(strategy)
    history = model.fit(X, Y, batch_size=32, epochs=1, validation_split=0.25, verbose=0)
    # 192 training examples: 6 batches.
    assert int(model.optimizer.iterations.numpy()) == 6
    assert "val_accuracy" in history.history


def test_train_step_override_is_used(strategy):
    class Counting(keras.Sequential):
        def train_step(self, data):
            logs = super().train_step(data)
            logs["custom"] = tf.constant(7.0)
            return logs

    with strategy.scope():
        model = Counting([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(logs.get("custom"))

    history = model.fit(X, Y, batch_size=64, epochs=1, verbose=0, callbacks=[Record()])
    assert seen and all(value == 7.0 for value in seen)
    assert history.history["custom"] == [7.0]


def test_fit_arguments_supported_and_unknown(strategy):
    model = make_model(strategy)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'epoch'"):
        model.fit(X, Y, epoch=2, verbose=0)
    # Every argument of Keras's fit is handled; a few rarely used ones together:
    history = model.fit(X, Y, batch_size=64, epochs=2, verbose=0, shuffle=False, initial_epoch=1,
                        validation_split=0.25, validation_batch_size=32, validation_steps=1, validation_freq=1)
    assert sorted(history.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    assert history.epoch == [1]


def test_fit_again_reuses_its_traces_until_compile(strategy):
    # The body of train_step runs only while a step function is traced.
    class CountingTraces(keras.Sequential):
        traces = 0

        def train_step(self, data):
            type(self).traces += 1
            return super().train_step(data)

    def compile(model):
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=4)

    with strategy.scope():
        model = CountingTraces([keras.Input((8,)), keras.layers.Dense(2)])
        compile(model)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(32).repeat()
    # 9 steps per epoch: two calls of 4 steps (the loop), then one single step (loop-free).
    first = model.fit(dataset, epochs=1, steps_per_epoch=9, verbose=0)
    traced = CountingTraces.traces
    assert traced > 0
    kernel = model.layers[0].kernel.numpy()
    second = model.fit(dataset, epochs=2, steps_per_epoch=9, verbose=0)
    assert CountingTraces.traces == traced, "a second fit() traced its step functions again"
    # The kept functions train this model: every step ran and the weights moved.
    assert int(model.optimizer.iterations.numpy()) == 3 * 9
    assert not np.allclose(model.layers[0].kernel.numpy(), kernel)
    assert len(first.history["loss"]) == 1 and len(second.history["loss"]) == 2
    # compile() makes a new optimizer and loss tracker: the step is traced for them.
    with strategy.scope():
        compile(model)
    model.fit(dataset, epochs=1, steps_per_epoch=9, verbose=0)
    assert CountingTraces.traces > traced
    assert int(model.optimizer.iterations.numpy()) == 9


class TwoOptimizerGan(keras.Model):
    """keras.io's GAN pattern: no call(), compile() overridden with two optimizers, noise from a
    SeedGenerator; the optimizers' slots are made by the train step's first trace."""

    def __init__(self, latent_dim=4):
        super().__init__()
        self.latent_dim = latent_dim
        self.discriminator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, activation="relu"),
                                               keras.layers.Dense(1, activation="sigmoid")])
        self.generator = keras.Sequential([keras.Input((latent_dim,)), keras.layers.Dense(2)])
        self.seed_generator = keras.random.SeedGenerator(7)

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.loss_fn = keras.losses.BinaryCrossentropy()
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real):
        batch = keras.ops.shape(real)[0]
        noise = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
        both = keras.ops.concatenate([self.generator(noise), real], axis=0)
        labels = keras.ops.concatenate([keras.ops.ones((batch, 1)), keras.ops.zeros((batch, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(both))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        noise = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(keras.ops.zeros((batch, 1)), self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def test_a_model_without_call_trains_through_its_own_train_step(strategy):
    # Keras's fit without a strategy never builds a model symbolically: a GAN whose train_step
    # calls its parts, never itself, trains locally. On the cluster its step's first trace builds
    # the optimizers' slots, inside the strategy's variable creator: on the ps.
    real = tf.data.Dataset.from_tensor_slices(_RNG.normal(3.0, 0.5, (256, 2)).astype("float32")).batch(32)
    with strategy.scope():
        gan = TwoOptimizerGan()
        gan.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3))
    kernel = gan.generator.layers[0].kernel.numpy()
    history = gan.fit(real, epochs=2, verbose=0)
    assert sorted(history.history) == ["d_loss", "g_loss"]
    assert all(np.isfinite(history.history["d_loss"])) and len(history.history["g_loss"]) == 2
    # Every step applied both optimizers, to slots that live on the ps.
    assert int(gan.d_optimizer.iterations.numpy()) == int(gan.g_optimizer.iterations.numpy()) == 2 * 8
    built = gan.d_optimizer.variables + gan.g_optimizer.variables
    assert len(built) > 2  # the slots, not only the step counts
    assert all(v._value.device.startswith("/job:ps/") for v in built + gan.variables + gan.metrics_variables)
    assert not np.allclose(gan.generator.layers[0].kernel.numpy(), kernel)
    gan.fit(real, epochs=1, verbose=0)  # again, on the slots made by the first
    assert int(gan.g_optimizer.iterations.numpy()) == 3 * 8


def test_a_model_without_call_or_train_step_fails_as_in_keras(strategy):
    class NoCall(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

    with strategy.scope():
        model = NoCall()
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(RuntimeError, match="Unable to automatically build the model"):
        model.fit(X, Y.astype("float32"), batch_size=32, epochs=1, verbose=0)
