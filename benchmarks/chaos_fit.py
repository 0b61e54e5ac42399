"""Chaos plans with Keras `fit` (`benchmarks/chaos.py --seeds ... --fit`): the faults of a plan while
`model.fit` trains, as a user's script does, instead of closures scheduled and joined.

The data are built first, then the model (as published Keras scripts do): seeded int64 ids and
labels of a known rule, `tf.data`, batch 32, repeated. The model: one id per example into a
`DynamicEmbedding(--table-dim, capacity=--table-capacity)` (or, with no capacity, a
`keras.layers.Embedding(10_000, 16)`), `Flatten`, `Dense(64, tanh)`, `Dense(1)`, Adagrad(0.05),
mse. Each batch of the plan is one `fit(epochs=1, steps_per_epoch=--batch)`, run on a thread of
its own and waited for at most --join-timeout. The optimizer's `iterations` (on a ps) counts the
steps that ran, as the closures' counter does.

With --serve-every S every fit also exports the model for serving through the plan's faults: one
`psclient.ServingExport` for the whole plan (a full version every 10 S seconds, a delta every S
seconds), and a loader (`psclient.serving.load`, polling every 0.2 s) in this process from the first
version on. After the plan, one more fit of a single step ends the chain with what training holds;
`Served.check` then compares the loader's version and predictions with the cluster model's.
"""

from __future__ import annotations

import threading
from typing import Any

KEY_SPACE_FOR_EMBEDDING = 10_000


class FitTimeout(TimeoutError):
    """A fit of one batch did not return within the join timeout (counted as a hang)."""


#: Probe ids: 48 the data holds, 16 it never does (unknown keys of a DynamicEmbedding).
PROBE_SEEN, PROBE_UNSEEN = 48, 16
#: The loader's predictions against the cluster model's, most apart (float32 arithmetic of one model).
SERVED_TOLERANCE = 1e-5


class Served:
    """The plan's serving side (--serve-every): the export callback, the loader, and the final check."""

    def __init__(self, base_dir: str, every_s: float, probe):
        import psclient

        self.base_dir = base_dir
        self.callback = psclient.ServingExport(base_dir, every_seconds=10 * every_s, delta_every_seconds=every_s)
        self.probe = probe
        self.loader = None

    def after_fit(self) -> None:
        """Starts the loader once a full version exists (a fit's first export)."""
        import psclient

        if self.loader is None and self.callback.exported:
            self.loader = psclient.serving.load(self.base_dir, poll_seconds=0.2)

    def check(self, model) -> dict:
        """What was exported and served, and whether the loader, brought up to date, predicts what the
        cluster model predicts."""
        import numpy as np

        row = {"full_versions": len(self.callback.exported), "deltas": len(self.callback.deltas),
               "failed_deltas": [f["error"][:200] for f in self.callback.failed_deltas],
               "chain": list(self.callback.chain), "loader_version": None, "max_abs_diff": None}
        if self.loader is None:
            row["matches_model"] = False
            return row
        self.loader.refresh()
        row["loader_version"] = list(self.loader.version)
        row["loader"] = {k: v for k, v in self.loader.statistics().items() if k != "version"}
        served = self.loader(self.probe).numpy()
        row["max_abs_diff"] = float(np.abs(served - model.predict(self.probe, verbose=0)).max())
        row["matches_model"] = (row["loader_version"] == row["chain"]
                                and row["max_abs_diff"] <= SERVED_TOLERANCE)
        return row

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
        self.callback.release()


def build(strategy: Any, table_capacity: int, table_dim: int, seed: int,
          serve_dir: str | None = None, serve_every: float | None = None):
    """(fit(steps, timeout), the tf.Variable that counts the optimizer's steps, Served or None,
    the model)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import psclient

    rng = np.random.default_rng(seed)
    space = 10 * table_capacity if table_capacity else KEY_SPACE_FOR_EMBEDDING
    ids = rng.integers(0, space, size=(8192, 1), dtype=np.int64)
    labels = ((ids % 7) / 7.0).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(32)
    unseen = space + np.arange(PROBE_UNSEEN, dtype=np.int64)[:, None]
    probe = tf.constant(np.concatenate([ids[:PROBE_SEEN], unseen]))

    with strategy.scope():
        inputs = keras.Input([1], dtype="int64")
        if table_capacity:
            embedded = psclient.layers.DynamicEmbedding(table_dim, capacity=table_capacity, name="chaos_table")(inputs)
        else:
            embedded = keras.layers.Embedding(KEY_SPACE_FOR_EMBEDDING, 16)(inputs)
        hidden = keras.layers.Dense(64, activation="tanh")(keras.layers.Flatten()(embedded))
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="mse")
    served = Served(serve_dir, serve_every, probe) if serve_every else None
    callbacks = [served.callback] if served else []

    def fit(steps: int, timeout: float) -> None:
        failure: list[BaseException] = []

        def run() -> None:
            try:
                model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=callbacks)
            except Exception as error:  # noqa: BLE001 - handed to the caller
                failure.append(error)

        thread = threading.Thread(target=run, name="chaos-fit", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise FitTimeout(f"fit of {steps} steps did not return within {timeout:g} s")
        if served is not None:
            served.after_fit()
        if failure:
            raise failure[0]

    return fit, model.optimizer.iterations.value, served, model
