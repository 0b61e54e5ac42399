"""Keras callbacks in a model.fit on the cluster, and resuming a killed coordinator."""

import csv
import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from _paths import ROOT

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from psclient._keras.callbacks import BackupAndRestore  # noqa: E402

pytestmark = pytest.mark.timeout(300)

_RNG = np.random.default_rng(3)
X = _RNG.standard_normal((128, 4)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


def make_model(strategy, lr=0.05):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        model.compile(
            optimizer=keras.optimizers.SGD(learning_rate=lr),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def fit(model, epochs=2, **kwargs):
    return model.fit(X, Y, batch_size=32, epochs=epochs, verbose=0, **kwargs)


def test_model_checkpoint_and_csv_logger(strategy, tmp_path):
    model = make_model(strategy)
    callbacks = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt-{epoch}.keras")),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "best.weights.h5"), monitor="val_loss",
                                        save_best_only=True, save_weights_only=True),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
    ]
    fit(model, epochs=2, validation_data=(X[:32], Y[:32]), callbacks=callbacks)
    assert (tmp_path / "ckpt-1.keras").exists() and (tmp_path / "best.weights.h5").exists()
    # The last checkpoint, saved by the coordinator, holds the ps values.
    restored = keras.saving.load_model(str(tmp_path / "ckpt-2.keras"))
    for got, want in zip(restored.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["epoch"] for row in rows] == ["0", "1"]
    assert all(np.isfinite(float(row["loss"])) and "val_accuracy" in row for row in rows)


def test_tensorboard(strategy, tmp_path):
    pytest.importorskip("tensorboard", reason="keras.callbacks.TensorBoard needs the tensorboard package")
    model = make_model(strategy)
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path / "tb"), histogram_freq=1, update_freq="batch")
    fit(model, epochs=2, validation_data=(X[:32], Y[:32]), callbacks=[board])
    events = [os.path.join(d, n) for d, _, files in os.walk(tmp_path / "tb") for n in files if "tfevents" in n]
    assert {os.path.basename(os.path.dirname(e)) for e in events} >= {"train", "validation"}
    assert all(os.path.getsize(e) > 0 for e in events)


def test_learning_rate_scheduler_and_reduce_lr_on_plateau(strategy):
    model = make_model(strategy)
    fit(model, epochs=3, callbacks=[keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.01 * (epoch + 1))])
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.03)

    model = make_model(strategy, lr=0.08)
    # A min_delta no epoch can reach: after the first epoch, every epoch is a plateau.
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9)
    fit(model, epochs=3, callbacks=[plateau])
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.02)


def test_early_stopping_restores_best_weights(strategy):
    model = make_model(strategy)
    snapshots = []

    class Snapshot(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            snapshots.append(self.model.get_weights())

    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=1e9, restore_best_weights=True)
    history = fit(model, epochs=10, callbacks=[Snapshot(), stop])
    assert history.epoch == [0, 1]  # the first epoch is the best one "by 1e9"
    for got, want in zip(model.get_weights(), snapshots[0]):
        np.testing.assert_array_equal(got, want)


def test_batch_level_hooks_get_real_logs_and_can_stop_training(strategy):
    model = make_model(strategy)
    events = []

    class Hooks(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            events.append(("epoch_begin", epoch))

        def on_train_batch_begin(self, batch, logs=None):
            events.append(("batch_begin", batch))

        def on_train_batch_end(self, batch, logs=None):
            events.append(("batch_end", batch, sorted(logs), float(logs["loss"])))
            if self.params["epochs"] == 3 and batch == 2 and len([e for e in events if e[0] == "epoch_begin"]) == 2:
                self.model.stop_training = True

    history = fit(model, epochs=3, callbacks=[Hooks()])
    ends = [e for e in events if e[0] == "batch_end"]
    # Epoch 0: 4 batches; epoch 1 stops after its batch 2.
    assert [e[1] for e in ends] == [0, 1, 2, 3, 0, 1, 2]
    assert all(e[2] == ["accuracy", "loss"] and np.isfinite(e[3]) for e in ends)
    assert len(history.history["loss"]) == 2
    # The stop joined the steps in flight: exactly the 7 steps that were asked for ran.
    assert int(model.optimizer.iterations.numpy()) == 7


@pytest.mark.parametrize("as_list", [True, False], ids=["list", "CallbackList"])
def test_stop_mid_epoch_gives_the_exact_logs_of_every_step_run(strategy, as_list):
    # steps_per_execution=1 and many steps: several are still in flight when
    # the callback stops; the epoch's logs must include every one of them.
    model = make_model(strategy)

    class StopAtBatch5(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                self.model.stop_training = True

    callbacks = [StopAtBatch5()]
    if not as_list:
        history_callback = keras.callbacks.History()
        callbacks = keras.callbacks.CallbackList([*callbacks, history_callback], model=model)
    history = model.fit(X, Y, batch_size=4, epochs=2, verbose=0, callbacks=callbacks)
    if not as_list:
        history = history_callback
    assert int(model.optimizer.iterations.numpy()) == 6
    # The metric variables after fit hold what the epoch's logs were read from.
    final = {name: float(value) for name, value in model.get_metrics_result().items()}
    assert len(history.history["loss"]) == 1
    assert history.history["loss"][0] == pytest.approx(final["loss"], rel=1e-6)
    assert history.history["accuracy"][0] == pytest.approx(final["accuracy"], rel=1e-6)


@pytest.mark.parametrize("callback_class", [keras.callbacks.BackupAndRestore, BackupAndRestore])
def test_backup_and_restore_resumes_after_an_interrupted_fit(strategy, tmp_path, callback_class):
    model = make_model(strategy)

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    backup = callback_class(backup_dir=str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(model, epochs=4, callbacks=[backup, Interrupt()])
    saved = model.get_weights()
    assert json.loads((tmp_path / "backup" / "training_metadata.json").read_text())["epoch"] == 2
    if callback_class is BackupAndRestore:  # no temporary left; readable like any new file (was 0600)
        umask = os.umask(0o022)
        os.umask(umask)
        modes = {n: stat.S_IMODE(os.stat(tmp_path / "backup" / n).st_mode) for n in os.listdir(tmp_path / "backup")}
        assert set(modes.values()) == {0o666 & ~umask}
        # A sharded checkpoint (one data file per ps and the coordinator's), the newest only.
        assert {n for n in modes if not n.startswith("ckpt-2.data-")} == {
            "checkpoint", "ckpt-2.index", "training_metadata.json"}, sorted(modes)

    model = make_model(strategy)  # fresh weights: the backup must restore them
    history = fit(model, epochs=4, callbacks=[callback_class(backup_dir=str(tmp_path / "backup"))])
    assert history.epoch == [2, 3]
    assert int(model.optimizer.iterations.numpy()) == 4 * 4  # restored 8 + 2 epochs of 4
    assert not (tmp_path / "backup").exists() or not os.listdir(tmp_path / "backup")
    assert not np.array_equal(saved[0], model.get_weights()[0])


_TRAIN_SCRIPT = r"""
import json, os, sys
import numpy as np
import keras
import psclient

jobs, backup_dir, die_at = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
strategy = psclient.ParameterServerStrategy(psclient.Cluster({"worker": jobs["worker"], "ps": jobs["ps"]}))
rng = np.random.default_rng(0)
x = rng.standard_normal((128, 4)).astype("float32"); y = (x[:, 0] > 0).astype("int32")
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

class Die(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == die_at:
            os._exit(17)  # a coordinator that dies without any cleanup

from psclient._keras.callbacks import BackupAndRestore
history = model.fit(x, y, batch_size=32, epochs=5, verbose=0, callbacks=[BackupAndRestore(backup_dir), Die()])
print(json.dumps({"epochs": history.epoch, "iterations": int(model.optimizer.iterations.numpy())}), flush=True)
os._exit(0)
"""


@pytest.mark.timeout(600)
def test_backup_and_restore_resumes_in_a_new_coordinator_process(local_cluster, tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    jobs = json.dumps(local_cluster.cluster.jobs)
    backup = str(tmp_path / "backup")
    run = lambda die_at: subprocess.run(  # noqa: E731
        [sys.executable, "-c", _TRAIN_SCRIPT, jobs, backup, str(die_at)],
        capture_output=True, text=True, timeout=280, env=env,
    )
    first = run(3)
    assert first.returncode == 17, first.stderr[-3000:]
    assert json.loads((tmp_path / "backup" / "training_metadata.json").read_text())["epoch"] == 3
    assert not [name for name in os.listdir(backup) if name.startswith(".")]  # no temporary left
    second = run(-1)
    assert second.returncode == 0, second.stderr[-3000:]
    result = json.loads(second.stdout.strip().splitlines()[-1])
    assert result == {"epochs": [3, 4], "iterations": 5 * 4}


def test_model_checkpoint_writes_sharded_checkpoints_the_sidecar_evaluates(strategy, tmp_path):
    import psclient

    model = make_model(strategy)
    saver = psclient.ModelCheckpoint(tmp_path / "ckpts", max_to_keep=2)
    fit(model, epochs=3, callbacks=[saver])
    assert [os.path.basename(p) for p in saver.saved] == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert tf.train.latest_checkpoint(str(tmp_path / "ckpts")) == saver.saved[-1]
    assert not os.path.exists(saver.saved[0] + ".index")  # pruned: max_to_keep=2
    psclient.write_final_marker(tmp_path / "ckpts", saver.saved[-1])

    local = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    local.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(32)
    report = psclient.SidecarEvaluator(local, data, tmp_path / "ckpts", poll_interval=0.05, idle_timeout=30).start()
    (evaluation,) = report.evaluations
    assert evaluation["step"] == 3 * 4  # the optimizer's iterations, saved as `step`
    for got, want in zip(local.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_model_checkpoint_refuses_a_local_model(strategy, tmp_path):
    import psclient

    local = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    local.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="psclient.ModelCheckpoint writes the checkpoints of a model on the ps"):
        with pytest.warns(UserWarning, match="trains 'sequential"):
            fit(local, epochs=1, callbacks=[psclient.ModelCheckpoint(tmp_path / "ckpts")])
    with pytest.raises(ValueError, match="Received: save_freq=0"):
        psclient.ModelCheckpoint(tmp_path / "ckpts", save_freq=0)
