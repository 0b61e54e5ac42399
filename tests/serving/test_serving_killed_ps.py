"""A ps SIGKILLed during `export_servable`: the export raises at once (well within `hang_timeout`),
with a `PSUnavailableError` naming the ps, and no version is visible. Real cluster: 2 workers, 2 ps.

(SIGSTOP, a hung ps, is tests/serving/test_serving_hung_ps.py; the next export after the killed ps's
recovery, tests/serving/test_serving_faults.py.)
"""

from __future__ import annotations

import os
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
LIMIT = 180.0  # waits for the export to begin and end, on a loaded machine


def _model():
    inputs = keras.Input((2,), dtype="int64")
    rows = psclient.layers.DynamicEmbedding(4, capacity=512, name="rows")(inputs)
    table = keras.layers.Embedding(4000, 4, name="table")(inputs)
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(keras.layers.Concatenate()([rows, table])))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    return model


def _listing(base_dir):
    return sorted(name for name in os.listdir(base_dir) if name.isdigit() or name.startswith(".psclient-version"))


def test_a_ps_killed_during_an_export_is_named_within_hang_timeout(two_workers_two_ps, restore_shared_clusters,
                                                                   tmp_path):
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
            # Killed as soon as the export's hidden directory exists: its writes on ps 1 fail.
            wait_for(lambda: _listing(base_dir) or not thread.is_alive(), LIMIT, "the export to begin")
            killed = time.monotonic()
            cluster.kill("ps", 1)
        finally:
            thread.join(LIMIT)
        assert not thread.is_alive(), "the export did not end within the limit after its ps was killed"
        error = outcome.get("error")
        seconds = outcome["ended"] - killed
        print(f"export raised {seconds:.2f} s after ps 1 was killed (hang_timeout={HANG_TIMEOUT:g} s): {error!r}")
        assert isinstance(error, psclient.PSUnavailableError), outcome
        assert error.task == "ps:1" and error.address == cluster.cluster.address("ps", 1), error
        assert "ps:1" in str(error) and isinstance(error.__cause__, tf.errors.OpError)
        assert seconds < 3 * HANG_TIMEOUT  # a killed ps fails its calls at once; probes wait hang_timeout at most
        assert _listing(base_dir) == []  # no version, nothing hidden left
    finally:
        if not cluster.is_running("ps", 1):
            cluster.restart("ps", 1)
        strategy.shutdown()
