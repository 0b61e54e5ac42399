"""`psclient.ModelCheckpoint(delta_every=N)` across a ps loss (LocalCluster: 2 workers, 2 ps).

The model's only large state is a DynamicEmbedding: each ps holds a table shard and no row-diffed
variable, so the table's renewal alone tells the callback's delta store that the export it kept on
the lost ps died with it. The strategy restores the ps from its own checkpoint; the callback's next
save is then full (a new chain), not a delta diffed against the dead export, and the chain goes on.
"""

import os

import numpy as np
import pytest

import psclient

keras = pytest.importorskip("keras")
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600), pytest.mark.usefixtures("restore_shared_clusters")]

DIM, IDS, STEPS = 8, 4, 4


def build(strategy, name, seed):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        inputs = keras.Input((IDS,), dtype="int64")
        table = psclient.layers.DynamicEmbedding(DIM, capacity=1024, name=name)
        outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(table(inputs)))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adagrad(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, table


def rows_by_key(layer):
    out = {}
    for shard in layer.export_state():
        for i, key in enumerate(shard["row_keys"].tolist()):
            out[key] = (shard["rows"][i].tolist(), {s: v[i].tolist() for s, v in shard["slots"].items()})
    return out


def test_the_first_save_after_a_ps_loss_is_full_and_the_chain_goes_on(two_workers_two_ps, tmp_path):
    cluster = two_workers_two_ps
    rng = np.random.default_rng(8)
    x = rng.integers(0, 400, (16 * STEPS, IDS)).astype("int64")
    y = rng.integers(0, 3, (16 * STEPS,)).astype("int32")
    strategy = psclient.ParameterServerStrategy(cluster.cluster, checkpoint_dir=str(tmp_path / "strategy"),
                                                hang_timeout=30.0)
    try:
        model, table = build(strategy, "loss_ids", seed=1)
        saver = psclient.ModelCheckpoint(tmp_path / "ckpts", save_freq=STEPS, delta_every=5)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[saver])  # ckpt-1, ckpt-1.delta-1
        strategy.save_checkpoint()  # what ps recovery restores ps 1 from

        cluster.kill("ps", 1)
        cluster.restart("ps", 1, timeout=300)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[saver])  # recovers ps 1 first
        assert strategy.stats()["ps"][1]["recoveries"] >= 1
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[saver])
        assert [os.path.basename(p) for p in saver.saved] == [
            "ckpt-1", "ckpt-1.delta-1", "ckpt-2", "ckpt-2.delta-1"]
        want_rows, want_dense = rows_by_key(table), [np.array(w.numpy()) for w in model.weights]

        fresh, fresh_table = build(strategy, "loss_ids_2", seed=7)
        restored = psclient.ModelCheckpoint(tmp_path / "ckpts").restore(fresh)
        assert restored["deltas"] == saver.saved[3:]
        assert rows_by_key(fresh_table) == want_rows
        for got, want in zip([np.array(w.numpy()) for w in fresh.weights], want_dense):
            np.testing.assert_array_equal(got, want)
    finally:
        strategy.shutdown()
