"""A click model with two DynamicEmbedding features under `fit` loses a worker, then a ps, mid-epoch.

On the session's shared 2-worker, 2-ps cluster (every task runs again when
the test ends). The ids outnumber the tables' capacity, so rows are evicted
and admitted all along. fit must finish every epoch, the tables stay
consistent (a row per key, within capacity), and the trained model's export,
served without a cluster, predicts what the cluster predicts.
"""

import threading

import numpy as np
import pytest

import psclient

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900),
              pytest.mark.usefixtures("restore_shared_clusters")]

CAPACITY = 120
BATCH = 32


def stream(seed, n=512):
    """A user id (0..999) and an item id (0..1999): both far more than CAPACITY; clicks from the item."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, 1000, n), 10**9 + rng.integers(0, 2000, n)], axis=1).astype("int64")
    return ids, ((ids[:, 1] % 3) == 0).astype("float32")[:, None]


def make_model():
    from psclient.layers import DynamicEmbedding

    ids = keras.Input((2,), dtype="int64")
    user = DynamicEmbedding(4, capacity=CAPACITY, name="fault_user")(ids[:, 0])
    item = DynamicEmbedding(4, capacity=CAPACITY, min_frequency=2, name="fault_item")(ids[:, 1])
    logit = keras.layers.Dense(1)(keras.layers.Concatenate()([user, item]))
    model = keras.Model(ids, logit)
    model.compile(optimizer=keras.optimizers.Adagrad(0.3), loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


class KillMidEpoch(keras.callbacks.Callback):
    """At (epoch, batch): SIGKILL the task, restart it in a thread (as a cluster manager would)."""

    def __init__(self, local, plan):
        super().__init__()
        self.local, self.plan = local, dict(plan)
        self.epoch, self.killed, self.restarts, self.errors = None, [], [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        task = self.plan.pop((self.epoch, batch), None)
        if task is None:
            return
        self.local.kill(*task)  # returns once the process is gone
        self.killed.append(task)

        def restart():
            try:
                self.local.restart(*task, timeout=300)  # generous: a loaded machine starts TF slowly
            except Exception as error:  # noqa: BLE001 - reported by the test's assertion
                self.errors.append(error)

        thread = threading.Thread(target=restart, name=f"restart-{task[0]}-{task[1]}", daemon=True)
        thread.start()
        self.restarts.append(thread)


@pytest.mark.long
def test_fit_loses_a_worker_then_a_ps_and_its_export_predicts_as_the_cluster(two_workers_two_ps, tmp_path):
    local = two_workers_two_ps
    x, y = stream(0)
    strategy = psclient.ParameterServerStrategy(local.cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                hang_timeout=60, connect_timeout=300)
    killer = KillMidEpoch(local, {(0, 6): ("worker", 0), (1, 8): ("ps", 1)})  # of 16 steps an epoch
    try:
        with strategy.scope():
            model = make_model()
        history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[killer])
        for thread in killer.restarts:
            thread.join(timeout=300)
        assert killer.killed == [("worker", 0), ("ps", 1)] and not killer.errors, killer.errors
        assert len(history.history["loss"]) == 2 and np.all(np.isfinite(history.history["loss"])), history.history
        stats = strategy.stats()
        assert stats["workers"][0]["failures"] >= 1, stats["workers"]  # the worker's loss was seen
        assert stats["ps"][1]["recoveries"] >= 1, stats["ps"]
        more = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # trains on after both losses
        assert np.isfinite(more.history["loss"][0])

        tables = strategy.stats()["dynamic_embeddings"]
        for name in ("fault_user", "fault_item"):
            entries = tables[name]
            assert all(entry.get("available", True) for entry in entries), entries
            assert 0 < sum(entry["rows"] for entry in entries) <= CAPACITY, entries
            for shard in model.get_layer(name).table.shards:  # one key per row, the index agrees
                keys, rows = (t.numpy() for t in shard.index.entries())
                assert len(set(rows.tolist())) == len(rows)
                np.testing.assert_array_equal(shard.row_key.numpy()[rows], keys)

        probe = np.concatenate([x[:64], [[-5, -6]]])  # seen pairs, and a pair no step saw
        on_cluster = model.predict(probe, batch_size=BATCH, verbose=0)
        model.save(tmp_path / "clicks.keras")
    finally:
        strategy.shutdown()
    served = keras.models.load_model(tmp_path / "clicks.keras")  # no strategy: local tables
    np.testing.assert_allclose(served.predict(probe, verbose=0), on_cluster, rtol=1e-5, atol=1e-6)
