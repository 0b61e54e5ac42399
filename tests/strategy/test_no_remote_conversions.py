"""psclient never converts a Python value under a task's device.

Such a conversion copies the new tensor to the task while holding the GIL
(`tests/_conversions.py`): a hung task then stops every thread of the
coordinator for as long as it hangs. The health probe's `one + 1` did exactly
that. This test records every such conversion on a real cluster while psclient
probes, takes out and reconnects workers, builds per-worker resources, writes
checkpoints and recovers a lost ps, and fails on the first, with its stack.
"""

import time

import numpy as np
import pytest
from _conversions import RemoteConversions
from _polling import wait_for
from _summing_step import summing_training

import psclient

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

HANG_TIMEOUT = 2.0


@pytest.fixture
def heal(three_workers_one_ps, restore_shared_clusters):
    """The shared 3 workers, 1 ps cluster; afterwards every task it stopped or killed runs again
    (conftest's `restore_shared_clusters`)."""
    return three_workers_one_ps


@pytest.mark.long
def test_probes_reconnects_resources_checkpoints_and_recovery_convert_nothing_on_tasks(heal, tmp_path):
    cluster = heal
    strategy = psclient.ParameterServerStrategy(
        cluster.cluster, hang_timeout=HANG_TIMEOUT, checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=25,
    )
    try:
        dataset_fn, step = summing_training(strategy)

        with RemoteConversions() as seen:
            iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

            def run(count):
                futures = [strategy.schedule(step, args=(iterator,)) for _ in range(count)]
                strategy.join(timeout=120)
                assert all(f.exception() is None for f in futures)

            run(30)  # per-worker iterators, a checkpoint falls due
            strategy.save_checkpoint()

            cluster.stop("worker", 2)  # probes of a hung worker, which is taken out
            wait_for(lambda: not strategy.stats()["workers"][2]["up"], 30 * HANG_TIMEOUT,
                     "the stopped worker to be taken out")
            run(10)
            cluster.resume("worker", 2)  # it answers its probes again and rejoins
            wait_for(lambda: strategy.stats()["workers"][2]["up"], 120, "the resumed worker to rejoin")

            cluster.kill("worker", 1)  # a restarted worker: reconnect, resources made again
            cluster.restart("worker", 1)
            # Until worker 1 has rejoined and run closures again (a forked task is back within a
            # second, before any call noticed it was gone: the first call there finds it restarted).
            rejoins = strategy.stats()["workers"][1]["rejoins"]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and strategy.stats()["workers"][1]["rejoins"] == rejoins:
                run(6)
            assert strategy.stats()["workers"][1]["rejoins"] > rejoins
            done = strategy.stats()["workers"][1]["done"]
            while time.monotonic() < deadline and strategy.stats()["workers"][1]["done"] == done:
                run(6)
            assert strategy.stats()["workers"][1]["done"] > done

            cluster.kill("ps", 0)  # a lost ps: handle checks, restore, retrace, rebuild
            cluster.restart("ps", 0)
            run(10)
            wait_for(lambda: strategy.stats()["ps"][0]["recoveries"] == 1, 120, "the ps to recover")
            run(10)
        assert not seen.found, "Python values converted under a task's device:\n" + seen.report()
    finally:
        strategy.shutdown()


def test_keras_fit_evaluate_and_checkpoints_with_dynamic_embeddings_convert_nothing_on_workers(
        two_workers_two_ps, tmp_path):
    # Workers only: building a model still converts Python values under a ps's
    # device (a DynamicEmbedding's storage, initial values made on the ps:
    # docs/development.md). A hung ps holds that build up anyway; the
    # checkpoint and recovery steps, which also run while training, are
    # checked on every task by the test above.
    import keras

    cluster = two_workers_two_ps
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 5000, size=(256, 4)).astype("int64")
    labels = (keys[:, 0] % 2).astype("float32")
    strategy = psclient.ParameterServerStrategy(cluster.cluster, checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        with RemoteConversions(jobs=("/job:worker",)) as seen:
            with strategy.scope():
                inputs = keras.Input((4,), dtype="int64")
                rows = psclient.layers.DynamicEmbedding(8, capacity=4096)(inputs)
                outputs = keras.layers.Dense(1)(keras.layers.Flatten()(rows))
                model = keras.Model(inputs, outputs)
                model.compile(optimizer=keras.optimizers.Adagrad(0.1),
                              loss=keras.losses.BinaryCrossentropy(from_logits=True))
            model.fit(keys, labels, batch_size=32, epochs=2, verbose=0)
            model.evaluate(keys, labels, batch_size=64, verbose=0)
            strategy.save_checkpoint()
            strategy.stats()
        assert not seen.found, "Python values converted under a task's device:\n" + seen.report()
    finally:
        strategy.shutdown()


@pytest.mark.long
def test_delta_cuts_of_dynamic_tables_convert_nothing_on_any_task(two_workers_two_ps, tmp_path):
    # A delta's cut runs while training pauses and its writes while it goes on: a conversion
    # under a ps's device there would freeze the coordinator on a hung ps. After the model is
    # built (its build still converts: see the test above), nothing does, on ps tasks either.
    import keras

    from psclient._coordinator.serving.delta_cut import DeltaCut
    from psclient._keras.servable import _dense, _dynamic_tables

    rng = np.random.default_rng(1)
    keys = rng.integers(0, 5000, size=(128, 2)).astype("int64")
    strategy = psclient.ParameterServerStrategy(two_workers_two_ps.cluster)
    try:
        with strategy.scope():
            inputs = keras.Input((2,), dtype="int64")
            rows = psclient.layers.DynamicEmbedding(4, capacity=2048)(inputs)
            hashed = psclient.layers.DynamicEmbedding(4)(inputs)  # hash-table storage
            table = keras.layers.Embedding(5000, 4)(inputs)  # diffed per row on its ps
            outputs = keras.layers.Dense(1)(keras.layers.Flatten()(keras.layers.Concatenate()([rows, hashed, table])))
            model = keras.Model(inputs, outputs)
            model.compile(optimizer="adagrad", loss="mse")
        model.fit(keys, keys[:, :1].astype("float32") % 7, batch_size=32, epochs=1, verbose=0)
        cut = DeltaCut(_dynamic_tables(model), _dense(model))  # traces its functions
        with RemoteConversions() as seen:
            for step in range(2):
                taken = cut.take()
                directory = tmp_path / f"delta{step}"
                directory.mkdir()
                manifest = cut.write(taken, str(directory))
        assert not seen.found, "Python values converted under a task's device:\n" + seen.report()
        assert sum(sum(t["changed"]) for t in manifest["tables"]) == 0  # nothing trained between the cuts
        (diffed,) = [entry for entry in manifest["dense"] if entry["form"] == "rows"]
        assert sum(diffed["changed"]) == 0
    finally:
        strategy.shutdown()
