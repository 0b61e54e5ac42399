"""model.fit survives a ps lost between an epoch's last step and Keras's reads of the epoch's logs.

Keras's fit reads the metric variables on the coordinator (the epoch's logs)
and resets them (the next epoch's start); those reads and writes are no
scheduled closure, so the scheduler's recovery does not cover them by itself.
"""

import threading

import numpy as np
import pytest

import psclient

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

_RNG = np.random.default_rng(3)
X = _RNG.standard_normal((128, 8)).astype("float32")
Y = (X[:, 0] - X[:, 1] > 0).astype("int32")
BATCH = 16
STEPS = len(X) // BATCH


@pytest.fixture()
def cluster(local_cluster, restore_shared_clusters):
    """The session's 2 workers + 1 ps; a ps a test killed is restarted after it."""
    return local_cluster


def make_model(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def sharded():
    """The same examples as a psclient.data.ShardedDataset: one Keras step per shard of 32."""
    def make(shard):
        ids = tf.data.Dataset.range(shard.start, shard.end)
        return ids.map(lambda i: (tf.gather(X, i), tf.gather(Y, i))).batch(BATCH)

    return psclient.data.ShardedDataset(psclient.data.range_shards(len(X), 32), make, seed=1)


def fit(model, data, callbacks, epochs):
    if data == "shards":
        return model.fit(sharded(), epochs=epochs, verbose=0, callbacks=callbacks)
    return model.fit(X, Y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=callbacks)


class KillPsAfterLastStep(keras.callbacks.Callback):
    """After epoch 0's last step (every step joined): `kill()`, before Keras reads the epoch's logs."""

    def __init__(self, kill, steps=STEPS):
        super().__init__()
        self.kill = kill
        self.steps = steps
        self.epoch = None
        self.killed = False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 0 and batch == self.steps - 1 and not self.killed:
            self.killed = True
            self.kill()


def test_without_a_checkpoint_dir_fit_raises_ps_unavailable_naming_the_read(cluster):
    strategy = psclient.ParameterServerStrategy(cluster.cluster, hang_timeout=30, connect_timeout=120)
    try:
        model = make_model(strategy)
        killer = KillPsAfterLastStep(lambda: cluster.kill("ps", 0))
        with pytest.raises(psclient.PSUnavailableError, match="metrics of .* on the coordinator failed") as info:
            model.fit(X, Y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[killer])
        assert killer.killed
        assert "checkpoint_dir" in str(info.value)
        assert isinstance(info.value.__cause__, tf.errors.OpError), repr(info.value.__cause__)
    finally:
        strategy.shutdown()
        if not cluster.is_running("ps", 0):
            cluster.restart("ps", 0, timeout=300)  # generous: a loaded machine starts TF slowly


@pytest.mark.long
@pytest.mark.parametrize("data", ["arrays", "shards"])
def test_a_ps_lost_before_the_epochs_logs_are_read_is_recovered_and_fit_goes_on(cluster, tmp_path, data):
    strategy = psclient.ParameterServerStrategy(
        cluster.cluster, checkpoint_dir=str(tmp_path / "ckpt"), hang_timeout=30, connect_timeout=120,
    )
    restarted = threading.Event()
    restart_errors = []

    def restart_ps():
        try:
            cluster.restart("ps", 0, timeout=300)  # generous: a loaded machine starts TF slowly
        except Exception as error:  # noqa: BLE001 - reported by the test's assertion
            restart_errors.append(error)
        finally:
            restarted.set()

    def kill():
        # A checkpoint of this moment, so nothing of epoch 0 is rolled back.
        assert strategy.save_checkpoint() is not None
        cluster.kill("ps", 0)  # SIGKILL; returns once the process is gone
        assert not cluster.is_running("ps", 0)
        threading.Thread(target=restart_ps, name="restart-ps", daemon=True).start()

    try:
        model = make_model(strategy)
        killer = KillPsAfterLastStep(kill)  # callbacks count batches, shards or not: the last is STEPS - 1
        history = fit(model, data, [killer], epochs=3)
        assert killer.killed
        assert restarted.wait(300) and not restart_errors, restart_errors
        assert strategy.stats()["ps"][0]["recoveries"] == 1, strategy.stats()["ps"]
        assert len(history.history["loss"]) == 3 and len(history.history["accuracy"]) == 3
        assert all(np.isfinite(history.history["loss"])), history.history
        # The model trains on after the recovery.
        more = fit(model, data, [], epochs=1)
        assert np.isfinite(more.history["loss"][0])
        assert int(model.optimizer.iterations.numpy()) >= 2 * STEPS
    finally:
        strategy.shutdown()
        restarted.wait(300)
        if not cluster.is_running("ps", 0):
            cluster.restart("ps", 0, timeout=300)
