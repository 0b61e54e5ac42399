"""`psclient.serving.load` without a cluster: a local model fit with `ServingExport(delta_every_seconds)`,
whose deltas remove rows too (a capacity evicts), followed by the loader's own thread; the thread's
owner stops it; bad arguments named; importing `psclient.serving` starts nothing. The cluster's side:
tests/serving/test_serving_deltas.py."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest
from _paths import ROOT
from _polling import wait_for

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
import psclient.serving  # noqa: E402
from psclient.layers import DynamicEmbedding  # noqa: E402

CAPACITY = 40  # fewer rows than the 200 keys trained: every delta evicts some
PROBE = np.arange(0, 210, dtype="int64").reshape(-1, 2)  # every key trained, evicted or not, and unseen ones



@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("loader") / "model")
    ids = keras.Input((2,), dtype="int64", name="ids")
    rows = DynamicEmbedding(4, capacity=CAPACITY, name="lru")(ids)
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(keras.layers.Flatten()(rows)))
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    callback = psclient.ServingExport(base, every_seconds=3600, delta_every_seconds=0.001)
    x = np.random.default_rng(0).integers(0, 200, (400, 2))
    model.fit(x, (x[:, :1] % 3).astype("float32"), batch_size=20, verbose=0, callbacks=[callback])
    return base, model, callback


def test_the_loader_follows_the_deltas_removed_rows_included(trained):
    base, model, callback = trained
    assert len(callback.deltas) >= 3 and sum(d["removed"] for d in callback.deltas) > 0, callback.deltas
    with psclient.serving.load(base, poll_seconds=0.05) as loader:
        wait_for(lambda: loader.version == callback.chain, 60, "the loader's thread applies every delta")
        served = loader(tf.constant(PROBE)).numpy()
    np.testing.assert_allclose(served, model.predict(PROBE, verbose=0), atol=1e-6, rtol=0)
    assert loader.statistics()["deltas_applied"] == callback.chain[1]


def test_a_full_version_every_n_deltas_and_the_loader_moves_to_it(tmp_path):
    base = str(tmp_path / "model")
    ids = keras.Input((2,), dtype="int64", name="ids")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(DynamicEmbedding(4, name="rows")(ids))))
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    callback = psclient.ServingExport(base, every_seconds=3600, delta_every_seconds=0.001, full_every_deltas=2,
                                      keep=2)
    x = np.random.default_rng(1).integers(0, 200, (200, 2))
    model.fit(x[:20], x[:20, :1].astype("float32"), batch_size=10, verbose=0, callbacks=[callback])
    loader = psclient.serving.load(base, poll_seconds=None)  # follows from the first fit's version
    first = loader.version
    model.fit(x, x[:, :1].astype("float32"), batch_size=10, verbose=0, callbacks=[callback])
    versions = [int(os.path.basename(path)) for path in callback.exported]
    assert len(versions) >= 3 and versions == sorted(versions), versions
    assert all(d["seq"] <= 2 for d in callback.deltas)
    kept = psclient._core.serving_dirs.versions(base)  # noqa: SLF001
    assert kept == versions[-2:]
    chains = [int(name) for name in os.listdir(os.path.join(base, "deltas")) if name.isdigit()]
    assert chains and set(chains) <= set(kept), (chains, kept)  # the deltas of pruned versions went with them
    assert loader.refresh()
    assert loader.version == callback.chain and loader.version[0] > first[0]
    np.testing.assert_allclose(loader(tf.constant(PROBE)).numpy(), model.predict(PROBE, verbose=0), atol=1e-6, rtol=0)


def test_close_joins_the_thread_and_a_dropped_loader_stops_its_own(trained):
    base = trained[0]
    loader = psclient.serving.load(base, poll_seconds=0.05)
    thread = loader._thread  # noqa: SLF001 - the thread under test
    assert thread.is_alive()
    loader.close()
    assert not thread.is_alive()
    loader.close()  # twice: nothing more to do
    dropped = psclient.serving.load(base, poll_seconds=0.05)
    thread = dropped._thread  # noqa: SLF001
    del dropped
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_bad_arguments_are_named(trained, tmp_path):
    with pytest.raises(ValueError, match="Invalid value for argument `poll_seconds`. Received: poll_seconds=0"):
        psclient.serving.load(trained[0], poll_seconds=0)
    with pytest.raises(ValueError, match="Invalid value for argument `endpoint`. Received: endpoint='nope'"):
        psclient.serving.load(trained[0], poll_seconds=None, endpoint="nope")
    with pytest.raises(psclient.ServingDirError, match="holds no full version"):
        psclient.serving.load(tmp_path, poll_seconds=None)


def test_importing_psclient_serving_starts_nothing_and_needs_no_cluster_code():
    # `import psclient` itself imports its pure-Python cluster descriptions and LocalCluster (unstarted),
    # and TensorFlow's import imports Keras, which registers psclient's layer (psclient._keras.registration):
    # neither starts anything.
    code = ("import sys, threading, multiprocessing; import psclient.serving; "
            "bad = sorted(m for m in sys.modules if m.startswith(('psclient._coordinator.strategy', "
            "'psclient._engine.dispatch', 'psclient._engine.recovery', 'psclient._keras.servable', "
            "'psclient._keras.install'))); "
            "import tensorflow as tf; "
            "print(bad, threading.active_count(), len(multiprocessing.active_children()), "
            "all('/job:' not in d.name or '/job:localhost/' in d.name for d in tf.config.list_logical_devices()))")
    root = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ,
                              "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-4:] == ["[]", "1", "0", "True"], out.stdout
