"""A ps SIGKILLed while a delta is being written (issue 35 item 6), and one lost between deltas.

Real cluster (2 workers, 2 ps), real SIGKILL. The kill lands in the middle of the delta's write, not at
a time guessed: the callback's writer calls a hook after each part a ps wrote, and the hook kills ps 1
once ps 0 has written its part of the dynamic table (files of the delta are then on disk, in its hidden
directory). What must hold: the delta never becomes visible (nor its hidden directory stays), the
loader keeps serving the deltas before it, and once the ps is back and recovered the chain starts again
with a full version (the kept cut died with the ps), which the loader loads and then follows with
deltas, predicting what the cluster model predicts. A ps lost and recovered between two deltas (none
being written) also makes the next version a full one.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from _polling import wait_for

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
import psclient.serving  # noqa: E402
from psclient._core import serving_deltas  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

LIMIT = 180.0  # recovery and restarts on a loaded machine
ROWS = 4096
PROBE = np.array([[1, 2], [300, 301], [2048, 4095], [17, 99]], dtype="int64")


def _model():
    ids = keras.Input((2,), dtype="int64")
    rows = psclient.layers.DynamicEmbedding(4, capacity=1024, name="rows")(ids)  # written first, shard by shard
    table = keras.layers.Embedding(ROWS, 4, name="table")(ids)  # partitioned: diffed per row
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(keras.layers.Concatenate()([rows, table])))
    model = keras.Model(ids, outputs)
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    return model


def _fit(model, callback, seed):
    x = np.random.default_rng(seed).integers(0, 400, (128, 2))
    model.fit(x, (x[:, :1] % 3).astype("float32"), batch_size=32, epochs=1, verbose=0, callbacks=[callback])


def _visible(directory):
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit()) if os.path.isdir(directory) else []


def _hidden(directory):
    return [name for name in os.listdir(directory) if name.startswith(".")] if os.path.isdir(directory) else []


def _ps_index(device):
    return int(device.split("/task:")[1].split("/")[0]) if "/job:ps" in device else None


def _served_diff(loader, model):
    return float(np.abs(loader(tf.constant(PROBE)).numpy() - model.predict(PROBE, verbose=0)).max())


@pytest.mark.long
def test_a_ps_killed_while_a_delta_is_written_publishes_nothing_and_the_chain_restarts_whole(
        two_workers_two_ps, restore_shared_clusters, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="psclient._keras.servable")
    cluster = two_workers_two_ps
    base = str(tmp_path / "serving")
    strategy = psclient.ParameterServerStrategy(
        cluster.cluster, checkpoint_dir=str(tmp_path / "ckpt"),
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
    loader = None
    try:
        with strategy.scope():
            model = _model()
        callback = psclient.ServingExport(base, every_seconds=3600, delta_every_seconds=3600)
        _fit(model, callback, 0)  # full version 1
        _fit(model, callback, 1)  # its delta 1
        strategy.save_checkpoint()  # what the ps is restored from
        assert callback.chain == (1, 1) and len(callback.deltas) == 1
        chain_1 = serving_deltas.chain_dir(base, 1)

        seen = {"parts": []}

        def kill_ps_1_after_ps_0_wrote(device):
            seen["parts"].append(_ps_index(device))
            if "on_disk" not in seen and _ps_index(device) == 0:
                (scratch,) = _hidden(chain_1)  # the delta being written
                seen["on_disk"] = sorted(os.listdir(os.path.join(chain_1, scratch)))
                cluster.kill("ps", 1)  # SIGKILL; returns once the process is gone

        callback._chain_state.after_part = kill_ps_1_after_ps_0_wrote  # noqa: SLF001 - the test's seam
        _fit(model, callback, 2)  # ends with delta 2, whose write meets the kill
        callback._chain_state.after_part = None  # noqa: SLF001

        assert seen.get("on_disk"), f"the kill did not land while the delta was written: {seen}"
        assert seen["parts"][0] == 0 and 1 not in seen["parts"], seen  # nothing written by ps 1 after it
        # Never visible, nothing hidden left behind; the deltas before it stay.
        assert _visible(chain_1) == [1] and _hidden(chain_1) == []
        assert [d["seq"] for d in callback.deltas] == [1]
        # The chain stands at the last delta written; the failed one is recorded, not counted.
        assert callback.chain == (1, 1), callback.chain
        assert [(f["version"], f["seq"]) for f in callback.failed_deltas] == [(1, 2)], callback.failed_deltas
        assert any("delta 2 of version 1 failed" in r.getMessage() for r in caplog.records), caplog.text
        loader = psclient.serving.load(base, poll_seconds=None)
        assert loader.version == (1, 1)

        cluster.restart("ps", 1)
        _fit(model, callback, 3)  # waits out the ps's recovery; ends with a full version, not delta 3
        wait_for(lambda: strategy.stats()["ps"][1]["recoveries"] >= 1, LIMIT, "ps 1 to recover")
        assert callback.chain == (2, 0) and _visible(base) == [1, 2] and _visible(chain_1) == [1]
        assert loader.refresh() and loader.version == (2, 0)
        assert _served_diff(loader, model) <= 1e-6

        _fit(model, callback, 4)  # the chain goes on from version 2
        assert callback.chain == (2, 1)
        assert loader.refresh() and loader.version == (2, 1)
        assert _served_diff(loader, model) <= 1e-6

        # A ps lost and back between two deltas: its kept cut is gone, the next version is a full one.
        strategy.save_checkpoint()
        cluster.kill("ps", 0)
        cluster.restart("ps", 0)
        _fit(model, callback, 5)
        wait_for(lambda: strategy.stats()["ps"][0]["recoveries"] >= 1, LIMIT, "ps 0 to recover")
        assert callback.chain == (3, 0), callback.chain
        # Seen before any copy was read: the lost handles, not an error from the restarted ps.
        assert any("lost and recovered since the full version" in r.getMessage() for r in caplog.records), caplog.text
        assert [d["seq"] for d in callback.deltas] == [1, 1]
        assert loader.refresh() and loader.version == (3, 0)
        assert _served_diff(loader, model) <= 1e-6
        _fit(model, callback, 6)
        assert loader.refresh() and loader.version == (3, 1)
        assert _served_diff(loader, model) <= 1e-6
    finally:
        if loader is not None:
            loader.close()
        strategy.shutdown()
