"""A small training set-up two cluster tests share (a test helper).

`summing_training(strategy)`: a float `total` on the ps, a `dataset_fn` of
the numbers 0-63 sharded per input pipeline in batches of 4, repeated, and a
`step(iterator)` that adds a batch to the total and returns it: enough for
per-worker iterators (resources a restarted worker must make again) and
variables a ps recovery restores.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["summing_training"]


def summing_training(strategy):
    """(dataset_fn, step) on `strategy` (see the module's docstring; `step` holds the total)."""
    with strategy.scope():
        total = tf.Variable(0.0)
    data = np.arange(64, dtype="float32")

    def dataset_fn(ctx):
        return tf.data.Dataset.from_tensor_slices(data).shard(
            ctx.num_input_pipelines, ctx.input_pipeline_id).repeat().batch(4)

    @tf.function
    def step(iterator):
        total.assign_add(tf.reduce_sum(next(iterator)))
        return total.read_value()

    return dataset_fn, step
