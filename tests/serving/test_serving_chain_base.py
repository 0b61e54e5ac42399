"""A delta chain's base is the full version's own cut: a step applied between the two is served.

`ServingExport` with deltas writes a full version, then diffs each later cut against a base kept on the
ps tasks. A step can land between the full version and its base even though the callback waits for the
steps in flight: a hung worker taken out (its closure run elsewhere) applies its step when it resumes
(seen on a `LocalCluster`: 1 update more than futures in 8 SIGSTOPs of a worker, docs/api.md, "Semantics"; docs/serving.md,
"Consistency"). Cut after the export, a row that step changed was in the base and not in the full
version, and no delta held it until it was trained again: the loader served it stale (0.67 apart here,
before the change). The base is now cut before the export, and the export serves the base's own
snapshot of each dynamic table (one copy of the rows on the ps tasks, not two).

Without a cluster: the order is the callback's, the same with or without one, and the late step is
made exactly where it can land (right after the export's files are written, before the version is
published), not by a timing guess.
"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
import psclient.serving  # noqa: E402
from psclient._coordinator.serving.serving_table import ServingTable  # noqa: E402
from psclient.layers import DynamicEmbedding  # noqa: E402

LATE = np.array([[500, 1500], [502, 1502]], "int64")  # rows only the late step trains


def build():
    ids = keras.Input((2,), dtype="int64", name="ids")
    dynamic = DynamicEmbedding(8, capacity=1000, name="dynamic")(ids)
    rows = keras.layers.Embedding(2048, 4, name="rows")(ids)  # row-diffed in deltas (>= 1024 rows)
    merged = keras.layers.Concatenate()([keras.layers.Flatten()(dynamic), keras.layers.Flatten()(rows)])
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(merged))
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    return model


def test_a_step_applied_between_the_full_version_and_its_base_is_served(tmp_path, monkeypatch):
    model = build()
    callback = psclient.ServingExport(str(tmp_path / "model"), every_seconds=3600, delta_every_seconds=3600)
    real_export, taken = model.export, []
    real_take = ServingTable.taken_from.__func__

    def counted_take(cls, *args, **kwargs):
        taken.append(args[0])
        return real_take(cls, *args, **kwargs)

    def export_then_a_late_step(*args, **kwargs):
        real_export(*args, **kwargs)
        if len(callback.exported) == 0:  # the first full version's files written, not yet published
            model.train_on_batch(LATE, np.full((len(LATE), 1), 5.0, "float32"))

    monkeypatch.setattr(model, "export", export_then_a_late_step)
    monkeypatch.setattr(ServingTable, "taken_from", classmethod(counted_take))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 100, (64, 2))
    model.fit(x, np.ones((64, 1), "float32"), batch_size=32, verbose=0, callbacks=[callback])
    assert callback.chain == (1, 0)
    # One snapshot of the table for the full version and its base together, not one each.
    assert len(taken) == 1, f"{len(taken)} snapshots of the table for one full version"
    x = rng.integers(100, 200, (64, 2))  # never the late step's rows
    model.fit(x, np.ones((64, 1), "float32"), batch_size=32, verbose=0, callbacks=[callback])
    assert callback.chain == (1, 1) and len(callback.deltas) == 1
    want = model.predict(LATE, verbose=0)
    local_only = model.predict(np.array([[0, 0]], "int64"), verbose=0)
    with psclient.serving.load(str(tmp_path / "model"), poll_seconds=None) as loader:
        assert loader.version == (1, 1)
        served = loader(tf.constant(LATE)).numpy()
        assert np.abs(loader(tf.constant([[0, 0]], tf.int64)).numpy() - local_only).max() <= 1e-5
    assert np.abs(served - want).max() <= 1e-5, f"served {served.ravel()}, the model {want.ravel()}"
