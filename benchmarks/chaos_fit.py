"""Chaos plans with Keras `fit` (`benchmarks/chaos.py --seeds ... --fit`): the faults of a plan while
`model.fit` trains, as a user's script does, instead of closures scheduled and joined.

The data are built first, then the model (as published Keras scripts do): seeded int64 ids and
labels of a known rule, `tf.data`, batch 32, repeated. The model: one id per example into a
`DynamicEmbedding(--table-dim, capacity=--table-capacity)` (or, with no capacity, a
`keras.layers.Embedding(10_000, 16)`), `Flatten`, `Dense(64, tanh)`, `Dense(1)`, Adagrad(0.05),
mse. Each batch of the plan is one `fit(epochs=1, steps_per_epoch=--batch)`, run on a thread of
its own and waited for at most --join-timeout. The optimizer's `iterations` (on a ps) counts the
steps that ran, as the closures' counter does.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

KEY_SPACE_FOR_EMBEDDING = 10_000


class FitTimeout(TimeoutError):
    """A fit of one batch did not return within the join timeout (counted as a hang)."""


def build(strategy: Any, table_capacity: int, table_dim: int, seed: int) -> tuple[Callable[[int, float], None], Any]:
    """(fit(steps, timeout), the tf.Variable that counts the optimizer's steps)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import psclient

    rng = np.random.default_rng(seed)
    space = 10 * table_capacity if table_capacity else KEY_SPACE_FOR_EMBEDDING
    ids = rng.integers(0, space, size=(8192, 1), dtype=np.int64)
    labels = ((ids % 7) / 7.0).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(32)

    with strategy.scope():
        inputs = keras.Input([1], dtype="int64")
        if table_capacity:
            embedded = psclient.layers.DynamicEmbedding(table_dim, capacity=table_capacity, name="chaos_table")(inputs)
        else:
            embedded = keras.layers.Embedding(KEY_SPACE_FOR_EMBEDDING, 16)(inputs)
        hidden = keras.layers.Dense(64, activation="tanh")(keras.layers.Flatten()(embedded))
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="mse")

    def fit(steps: int, timeout: float) -> None:
        failure: list[BaseException] = []

        def run() -> None:
            try:
                model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
            except Exception as error:  # noqa: BLE001 - handed to the caller
                failure.append(error)

        thread = threading.Thread(target=run, name="chaos-fit", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise FitTimeout(f"fit of {steps} steps did not return within {timeout:g} s")
        if failure:
            raise failure[0]

    return fit, model.optimizer.iterations.value
