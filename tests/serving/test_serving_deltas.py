"""Delta versions on a real cluster (2 workers, 2 ps): `ServingExport(delta_every_seconds=S)` while
`fit` runs, and `psclient.serving.load` in this process following them.

One model with a `DynamicEmbedding` in each storage (hash tables; a capacity: the dense storage) and
partitioned dense layers, fit
three times with one callback (the chain of deltas goes on from fit to fit): a first fit writes the
full version and deltas; a second brings a key no step saw before, and a thread here waits until the
loader serves its row; a third trains one batch of fresh keys, whose delta is measured against the
rows it touched. The loader's predictions are compared with the cluster model's at the cuts.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import numpy as np
import pytest
from _polling import wait_for

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
import psclient.serving  # noqa: E402
from psclient.layers import DynamicEmbedding  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

S = 1.0  # delta_every_seconds
DIM = 8
NEW_KEY = 777_777  # no step of the first fit sees it
UNSEEN = 10**12  # no step ever sees it
FRESH = np.arange(50_000, 50_000 + 512, dtype="int64").reshape(-1, 2)  # the third fit's keys: 512 new rows


@pytest.fixture(scope="module")
def strategy(two_workers_two_ps):
    # Partitioned dense variables too: a delta carries their shards.
    s = psclient.ParameterServerStrategy(
        two_workers_two_ps.cluster,
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
    yield s
    s.shutdown()


def build():
    ids = keras.Input((2,), dtype="int64", name="ids")
    hashed = DynamicEmbedding(DIM, name="hashed")(ids)
    bounded = DynamicEmbedding(DIM, capacity=4000, name="bounded")(ids)
    flat = keras.layers.Concatenate()([keras.layers.Flatten()(hashed), keras.layers.Flatten()(bounded)])
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(flat)
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(hidden))
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    return model


def data(ids, batch=32):
    y = (ids[:, :1] % 3).astype("float32")
    return tf.data.Dataset.from_tensor_slices((ids, y)).batch(batch)


PROBE = np.array([[3, 5], [NEW_KEY, NEW_KEY], [UNSEEN, UNSEEN], [900, 17], *FRESH[:4]], dtype="int64")


def predictions_match(loader, model):
    served = loader(tf.constant(PROBE)).numpy()
    return float(np.abs(served - model.predict(PROBE, verbose=0)).max())


class _Watch:
    """A thread that calls the loader until NEW_KEY reads a row of its own (not the default row)."""

    def __init__(self, loader):
        self.loader, self.seen_at, self.stop = loader, None, threading.Event()
        self.thread = threading.Thread(target=self._run, name="test-watch")

    def _run(self):
        pair = tf.constant([[NEW_KEY, NEW_KEY], [UNSEEN, UNSEEN]], tf.int64)
        while not self.stop.wait(0.02):
            out = self.loader(pair).numpy()
            if out[0, 0] != out[1, 0]:
                self.seen_at = time.monotonic()
                return


class _StopWhenSeen(keras.callbacks.Callback):
    """Notes when the second fit's first step begins; ends the fit once the row is served (or after 60 s)."""

    def __init__(self, watch):
        super().__init__()
        self.watch, self.began = watch, None

    def on_train_batch_begin(self, batch, logs=None):
        if self.began is None:
            self.began = time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        if self.watch.seen_at is not None or time.monotonic() - self.began > 60:
            self.model.stop_training = True


@pytest.fixture(scope="module")
def run(strategy, tmp_path_factory):
    base = str(tmp_path_factory.mktemp("deltas") / "model")
    with strategy.scope():
        model = build()
    callback = psclient.ServingExport(base, every_seconds=3600, delta_every_seconds=S, keep=2)
    rng = np.random.default_rng(0)
    model.fit(data(rng.integers(0, 1000, (1024, 2))), epochs=1, verbose=0, callbacks=[callback])
    first = {"deltas": list(callback.deltas), "exported": list(callback.exported)}
    loader = psclient.serving.load(base, poll_seconds=0.2)
    try:
        wait_for(lambda: loader.version == callback.chain, 60, "the loader applies the first fit's last delta")
        first["diff"] = predictions_match(loader, model)
        watch = _Watch(loader)
        watch.thread.start()
        stopper = _StopWhenSeen(watch)
        second = rng.integers(0, 1000, (64 * 32 * 50, 2))
        second[:, 1] = NEW_KEY
        try:
            model.fit(data(second).repeat(), epochs=1, steps_per_epoch=64 * 50, verbose=0,
                      callbacks=[callback, stopper])
        finally:
            watch.stop.set()
            watch.thread.join()
        fresh = {"latency": None if watch.seen_at is None else watch.seen_at - stopper.began}
        callback.delta_every_seconds = 3600  # the third fit: one delta, at its end
        before = len(callback.deltas)
        model.fit(data(FRESH, batch=len(FRESH)), epochs=1, verbose=0, callbacks=[callback])
        fresh["deltas"] = callback.deltas[before:]
        wait_for(lambda: loader.version == callback.chain, 60, "the loader applies the last delta")
        fresh["diff"] = predictions_match(loader, model)
        yield {"base": base, "model": model, "callback": callback, "first": first, "fresh": fresh, "loader": loader}
    finally:
        loader.close()



@pytest.mark.long
def test_the_first_fit_wrote_a_full_version_then_deltas_in_order(run):
    first = run["first"]
    assert len(first["exported"]) == 1, first["exported"]
    version = int(os.path.basename(first["exported"][0]))
    assert [d["seq"] for d in first["deltas"]] == list(range(1, len(first["deltas"]) + 1))
    assert all(d["version"] == version for d in first["deltas"])
    # The fit's rows are in its deltas; the one written at its end may hold nothing (seen once in a
    # full suite run: changed 1398, then 0), when the timer's delta came just after the last step.
    assert first["deltas"] and sum(d["changed"] for d in first["deltas"]) > 0
    # TF Serving sees integer directories only: the deltas are not among them.
    assert psclient._core.serving_dirs.versions(run["base"]) == [version]  # noqa: SLF001


def test_the_loader_predicts_what_the_cluster_model_predicts_at_the_cut(run):
    assert run["first"]["diff"] <= 1e-6
    assert run["fresh"]["diff"] <= 1e-6


def test_a_row_trained_now_is_served_within_s_plus_2_seconds(run):
    latency = run["fresh"]["latency"]
    print(f"row served {latency} s after the step that trained it began (S={S})")
    assert latency is not None, "the loader never served the new key's row (60 s)"
    assert latency <= S + 2.0


def test_a_delta_holds_the_touched_rows_and_little_more(run):
    (delta,) = run["fresh"]["deltas"]
    # Two tables, each touched at the 512 fresh keys: nothing else changed since the cut before.
    assert delta["changed"] == 2 * FRESH.size and delta["removed"] == 0
    table_bytes = sum(entry.stat().st_size for entry in os.scandir(delta["path"]) if entry.name.startswith("t"))
    touched = 2 * FRESH.size * (DIM * 4 + 8)
    print(f"delta tables {table_bytes} B for {touched} B of touched rows and keys; whole delta {delta['bytes']} B")
    assert table_bytes <= 1.2 * touched


def test_writing_a_delta_pauses_training_briefly(run):
    seconds = [d["seconds"] for d in run["callback"].deltas]
    joins = [d["join_seconds"] for d in run["callback"].deltas]
    writes = [d["write_seconds"] for d in run["callback"].deltas]
    print(f"training paused per delta: median {np.median(seconds):.3f} s, max {max(seconds):.3f} s "
          f"(waiting for the steps in flight: median {np.median(joins):.3f} s); written meanwhile in "
          f"median {np.median(writes):.3f} s")
    assert np.median(seconds) <= 1.0  # generous: the shared 2-core machine; measured figures in docs/serving.md


def test_a_gap_reloads_the_full_version_and_applies_nothing_out_of_order(run, tmp_path):
    copy = str(tmp_path / "copy")
    shutil.copytree(run["base"], copy)
    version = run["callback"].chain[0]
    chain = os.path.join(copy, "deltas", str(version))
    held = sorted(int(name) for name in os.listdir(chain) if name.isdigit())
    assert len(held) >= 3, held
    os.rename(os.path.join(chain, "2"), os.path.join(copy, "delta-2-aside"))
    with psclient.serving.load(copy, poll_seconds=None) as loader:
        stats = loader.statistics()
        assert loader.version == (version, 1)  # delta 3 and later are not applied past the gap
        assert stats["gaps"] == 1 and stats["loads"] == 2  # the full version was loaded again
        assert not loader.refresh()  # the same gap does not reload again
        os.rename(os.path.join(copy, "delta-2-aside"), os.path.join(chain, "2"))
        assert loader.refresh()
        assert loader.version == (version, held[-1])
        probe = tf.constant(PROBE)
        np.testing.assert_array_equal(loader(probe).numpy(), run["loader"](probe).numpy())
