"""Which fit steps' logs are copied to the coordinator (issue 37).

fit copies the first step's logs; when their keys are the model's metrics' (Keras then takes the
epoch's logs from the metric variables on the ps) and no callback reads batch logs, the other
steps' logs stay on the workers. Copies are counted by the strategy's dispatcher.
"""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
from psclient._keras.trainer import reads_batch_logs  # noqa: E402

pytestmark = pytest.mark.timeout(300)

_RNG = np.random.default_rng(37)
X = _RNG.standard_normal((64, 8)).astype("float32")
Y = (X[:, 0] + X[:, 1] > 0).astype("int32")
STEPS = 10


def make_model(strategy, learning_rate, *, model_class=keras.Sequential, steps_per_execution=1):
    keras.utils.set_random_seed(37)  # the same initial weights for each model
    with strategy.scope():
        model = model_class([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(learning_rate), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=steps_per_execution)
    return model


def data(one_batch=False):
    if one_batch:  # every step the same batch, whichever worker's iterator it comes from
        return tf.data.Dataset.from_tensors((X[:16], Y[:16])).repeat()
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(16).repeat()


def copies(strategy) -> int:
    # The dispatcher's count of calls whose outputs were copied (not in strategy.stats()).
    return strategy._dispatcher.results_copied


class BatchLosses(keras.callbacks.Callback):
    """Reads every batch's logs."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(logs["loss"])


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_fit_copies_only_its_first_steps_logs_and_epochs_hold_the_metrics(strategy, steps_per_execution):
    model = make_model(strategy, 0.01, steps_per_execution=steps_per_execution)
    before = copies(strategy)
    history = model.fit(data(), epochs=3, steps_per_epoch=STEPS, verbose=0)
    assert copies(strategy) - before == 1, "fit copied more than its first step's logs"
    assert int(model.optimizer.iterations.numpy()) == 3 * STEPS
    # The epoch's logs are the metric variables' (what they hold now, for the last epoch),
    # not the first step's logs returned for the later steps.
    held = model.get_metrics_result()
    assert sorted(history.history) == ["accuracy", "loss"]
    for key in ("loss", "accuracy"):
        assert history.history[key][-1] == pytest.approx(held[key], rel=1e-6)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_epoch_logs_equal_those_of_the_same_fit_with_every_step_copied(strategy):
    # Learning rate 0 and one batch: every step sees the same weights and data, so both fits'
    # epochs average the same losses whichever worker ran which step. The second reads batch
    # logs: all copied.
    left, copied = make_model(strategy, 0.0), make_model(strategy, 0.0)
    for left_weight, copied_weight in zip(left.get_weights(), copied.get_weights()):
        np.testing.assert_array_equal(left_weight, copied_weight)
    before = copies(strategy)
    left_history = left.fit(data(one_batch=True), epochs=2, steps_per_epoch=STEPS, verbose=0)
    assert copies(strategy) - before == 1
    reader = BatchLosses()
    before = copies(strategy)
    copied_history = copied.fit(data(one_batch=True), epochs=2, steps_per_epoch=STEPS, verbose=0,
                                callbacks=[reader])
    assert copies(strategy) - before == 2 * STEPS
    assert len(reader.losses) == 2 * STEPS
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(left_history.history[key], copied_history.history[key], rtol=1e-6)


def test_a_callback_reading_batch_logs_gets_each_steps_real_logs(strategy):
    model = make_model(strategy, 0.05)
    reader = BatchLosses()
    before = copies(strategy)
    history = model.fit(data(), epochs=2, steps_per_epoch=STEPS, verbose=0, callbacks=[reader])
    assert copies(strategy) - before == 2 * STEPS
    assert len(reader.losses) == 2 * STEPS and all(np.isfinite(reader.losses))
    # The logs of the newest finished step, copied: a few steps behind, so a value may repeat
    # while no step finished, but at most `max(4, 2 * workers)` are in flight and each epoch's
    # first and last calls wait, so each epoch sees at least 3 values (left on the workers: 1).
    assert len(set(reader.losses)) >= 4, f"batch logs did not change from step to step: {reader.losses}"
    assert history.history["loss"][-1] == pytest.approx(model.get_metrics_result()["loss"], rel=1e-6)


class WithCustomLogs(keras.Sequential):
    """Returns a log that is no metric's: Keras's epoch logs are then the last step's."""

    def train_step(self, data):
        logs = super().train_step(data)
        logs["custom"] = tf.constant(7.0)
        return logs


def test_custom_train_step_logs_are_copied_every_step(strategy):
    model = make_model(strategy, 0.01, model_class=WithCustomLogs)
    before = copies(strategy)
    history = model.fit(data(), epochs=2, steps_per_epoch=STEPS, verbose=0)
    assert copies(strategy) - before == 2 * STEPS
    assert history.history["custom"] == [7.0, 7.0]
    assert all(np.isfinite(history.history["loss"]))


class FailsAtStep(keras.Sequential):
    """Raises inside its step once the optimizer has taken `limit` steps."""

    limit = 5

    def train_step(self, data):
        tf.debugging.assert_less(self.optimizer.iterations, tf.constant(self.limit, tf.int64),
                                 message="step limit reached")
        return super().train_step(data)


def test_an_error_in_a_step_whose_logs_are_not_copied_raises_from_fit(strategy):
    model = make_model(strategy, 0.01, model_class=FailsAtStep)
    before = copies(strategy)
    with pytest.raises(tf.errors.InvalidArgumentError, match="step limit reached"):
        model.fit(data(), epochs=2, steps_per_epoch=STEPS, verbose=0)
    assert copies(strategy) - before == 1  # the failing steps were among those left on the workers
    strategy.join()  # the error was raised once, by fit: the strategy goes on
    # The check and the increment are not atomic: each worker may pass it once more.
    assert FailsAtStep.limit <= int(model.optimizer.iterations.numpy()) <= FailsAtStep.limit + strategy.num_workers


def test_which_callbacks_read_batch_logs(tmp_path):
    def reads(*callbacks, verbose=0):
        return reads_batch_logs(keras.callbacks.CallbackList(
            list(callbacks), add_history=True, add_progbar=verbose != 0, verbose=verbose, epochs=1, steps=1))

    class OnBatchEnd(keras.callbacks.Callback):
        def on_batch_end(self, batch, logs=None):
            pass

    quiet = [keras.callbacks.TensorBoard(str(tmp_path / "tb"), update_freq="epoch"),
             psclient.ModelCheckpoint(str(tmp_path / "ckpt"), save_freq=2),
             psclient.BackupAndRestore(str(tmp_path / "backup"), save_freq=2),
             keras.callbacks.EarlyStopping(), keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
             keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: None),
             keras.callbacks.BackupAndRestore(str(tmp_path / "keras-backup"), save_freq=2),
             psclient.ServingExport(str(tmp_path / "serving"), every_seconds=60)]
    assert not reads(*quiet)
    assert not reads(*quiet, verbose=2)  # a progress bar per epoch only
    assert reads(verbose=1)  # a progress bar per batch shows the batch's logs
    assert reads(verbose="auto")
    assert reads(keras.callbacks.TensorBoard(str(tmp_path / "tb"), update_freq="batch"))
    assert reads(OnBatchEnd())
    assert reads(BatchLosses())
    assert reads(keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"), save_freq=2))
    assert reads(keras.callbacks.TerminateOnNaN())
    assert reads(keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None))
