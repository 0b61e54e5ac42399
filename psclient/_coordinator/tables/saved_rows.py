"""What a bounded table shard saves of its rows: the keys with a row, their counters and where they are.

Shared by a shard's save in the cut (`dense_shard.DenseShard.saved`) and the
packing of a copy after it (`checkpoints.table_copy`), so both write the same.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["keys_and_counters", "live_rows", "saved_keys"]


def saved_keys(row_key, last, waiting_keys, waiting, min_frequency: int):
    """A shard's saved (keys, counters, row_keys) from its `row_key` and `last` values and the export
    of its keys still counting (`pending`), and `held`: the storage row of each of `row_keys`, in
    order (what its rows and slots are packed by). The keys with a row first, in their rows' order."""
    row_keys, held = live_rows(row_key, last)
    return (*keys_and_counters(row_keys, tf.gather(last, held), waiting_keys, waiting, min_frequency), row_keys, held)


def keys_and_counters(row_keys, last, waiting_keys, waiting, min_frequency: int):
    """(keys, counters): `row_keys` (each with its `last` step) then the keys waiting. With none
    waiting (always with min_frequency=1), the keys are `row_keys` itself, not a copy (a save's peak)."""
    # [min_frequency, last] pairs made in one buffer (a fill beside it would take half as much again)
    counters = tf.pad(tf.reshape(last, [-1, 1]), [[0, 0], [1, 0]], constant_values=tf.constant(min_frequency, tf.int64))
    waiting_keys, waiting = tf.reshape(waiting_keys, [-1]), tf.reshape(waiting, [-1, 2])
    return tf.cond(tf.size(waiting_keys) > 0,
                   lambda: (tf.concat([row_keys, waiting_keys], 0), tf.concat([counters, waiting], 0)),
                   lambda: (tf.identity(row_keys), tf.identity(counters)))


def live_rows(row_keys, last):
    """(keys, rows) of the rows that hold a key, from a shard's `row_key` and `last` values."""
    held = tf.reshape(tf.where(last >= 0), [-1])
    return tf.gather(row_keys, held), held
