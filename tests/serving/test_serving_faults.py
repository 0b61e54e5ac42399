"""A ps killed in the middle of an export leaves no version visible, the export raises at once (well
within `hang_timeout`) a `PSUnavailableError` naming the ps, and the next export after its recovery is
whole (issue 35 item 6, issue 36 item 5). Real cluster: 2 workers, 2 ps.

(SIGSTOP, a hung ps, is tests/serving/test_serving_hung_ps.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from _polling import wait_for

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

HANG_TIMEOUT = 10.0
LIMIT = 180.0  # recovery and restarts on a loaded machine


def _model():
    inputs = keras.Input((2,), dtype="int64")
    rows = psclient.layers.DynamicEmbedding(4, capacity=512, name="rows")(inputs)
    table = keras.layers.Embedding(4000, 4, name="table")(inputs)
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(keras.layers.Concatenate()([rows, table])))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    return model


def _versions(base_dir):
    return sorted(name for name in os.listdir(base_dir) if name.isdigit())


def _hidden(base_dir):
    return sorted(name for name in os.listdir(base_dir) if name.startswith(".psclient-version"))


@pytest.mark.long
def test_a_ps_killed_during_an_export_leaves_no_version_and_the_next_export_is_whole(
        two_workers_two_ps, restore_shared_clusters, tmp_path):
    cluster = two_workers_two_ps
    rng = np.random.default_rng(0)
    x = rng.integers(0, 300, (256, 2))
    y = (x[:, :1] % 3).astype("float32")
    base_dir = str(tmp_path / "serving")
    strategy = psclient.ParameterServerStrategy(
        cluster.cluster, checkpoint_dir=str(tmp_path / "ckpt"), hang_timeout=HANG_TIMEOUT,
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
    try:
        with strategy.scope():
            model = _model()
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        strategy.save_checkpoint()

        # Kill ps 1 as soon as the export's hidden directory exists (before anything is written).
        outcome = {}

        def export():
            try:
                outcome["path"] = psclient.export_servable(model, base_dir)
            except Exception as error:  # noqa: BLE001 - whatever it raises is checked below
                outcome["error"] = error
            outcome["ended"] = time.monotonic()

        thread = threading.Thread(target=export, name="export-under-test")
        os.makedirs(base_dir, exist_ok=True)
        thread.start()
        try:
            wait_for(lambda: _hidden(base_dir) or not thread.is_alive(), LIMIT, "the export to begin")
            killed = time.monotonic()
            cluster.kill("ps", 1)
        finally:
            thread.join(LIMIT)
        assert not thread.is_alive(), "the export did not end within the limit after its ps was killed"
        # A reader never sees half a version: none at all, and nothing hidden left behind.
        assert "error" in outcome, f"the export wrote {outcome.get('path')} although ps 1 was killed"
        assert _versions(base_dir) == [] and _hidden(base_dir) == []
        error, seconds = outcome["error"], outcome["ended"] - killed
        print(f"export raised {seconds:.2f} s after ps 1 was killed (hang_timeout={HANG_TIMEOUT:g} s): {error!r}")
        assert isinstance(error, psclient.PSUnavailableError), outcome
        assert error.task == "ps:1" and error.address == cluster.cluster.address("ps", 1), error
        assert "ps:1" in str(error) and isinstance(error.__cause__, tf.errors.OpError)
        assert seconds < 3 * HANG_TIMEOUT  # a killed ps fails its calls at once; probes wait hang_timeout at most

        cluster.restart("ps", 1)
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # waits out the ps's recovery
        wait_for(lambda: strategy.stats()["ps"][1]["recoveries"] >= 1, LIMIT, "ps 1 to recover")
        want = model.predict(x[:16], verbose=0)
        path = psclient.export_servable(model, base_dir)
        assert _versions(base_dir) == ["1"] and _hidden(base_dir) == []
    finally:
        strategy.shutdown()

    # The version loads whole in a process without psclient and predicts what the cluster did.
    script = (
        "import sys, json, numpy as np, tensorflow as tf\n"
        "served = tf.saved_model.load(sys.argv[1])\n"
        "x = np.array(json.loads(sys.argv[2]), dtype='int64')\n"
        "print(json.dumps(served.serve(tf.constant(x)).numpy().tolist()))\n"
    )
    import json

    result = subprocess.run([sys.executable, "-c", script, path, json.dumps(x[:16].tolist())],
                            capture_output=True, text=True, timeout=LIMIT, check=True)
    got = np.array(json.loads(result.stdout.strip().splitlines()[-1]))
    assert np.max(np.abs(got - want)) <= 1e-6
