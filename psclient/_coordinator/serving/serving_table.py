"""A dynamic table's rows as a SavedModel serves them: stock TensorFlow, no psclient.

`ServingTable.taken_from(table)` snapshots a `DynamicTable` for an export:
on each ps task (each shard's device), the keys that hold a live row there
(admitted, not evicted, not expired by `ttl_steps` at this moment), sorted,
beside their rows, in two plain `tf.Variable`s made *on that ps* from what it
holds: no row passes through the coordinator, and TF's saver writes each
variable from the task that holds it.

A lookup splits the keys over the shards as training does (`shard_of`), and
in each shard finds a key by binary search over its sorted keys
(`tf.searchsorted`, TF's `LowerBound` op): a key found reads its row, any
other key (never admitted, evicted, expired, still counting towards
`min_frequency`, a reserved key) reads the default row, zeros, as the
layer's inference lookup on the cluster does. Every op is a stock TF op
(`LowerBound`, `GatherV2`, `DynamicPartition`, `DynamicStitch`, bitwise and
comparison ops), so TF Serving or any TF process loads the SavedModel
without psclient.

Why sorted keys and not a `tf.lookup.StaticHashTable`: a static table is
filled at load time from constants held in the SavedModel's graph
(`saved_model.pb`, at most 2 GB, built in the coordinator's memory), where
the sorted keys are a variable, saved and sharded like the rows; a lookup
costs log2(rows) comparisons (24 for 16 million rows on one ps).

Each shard's variables hold one more entry than its rows: a last key
(int64's largest) that no search passes and a last row of zeros, the
default; so an empty shard needs no special case.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from psclient._coordinator.tables.dense_shard import vector
from psclient._coordinator.tables.key_hash import shard_of
from psclient._tf.registrations import RegisteredCall
from psclient._tf.functions import made_per_object

__all__ = ["ServingTable"]

_LAST_KEY = 2**63 - 1


def _live_rows(shard, policy):
    """(keys, rows) a shard serves now, as tensors on its device (the caller places the ops)."""
    counting_again = None
    if shard.dense:
        row_keys, held = shard.live()
        last = vector(shard.last, held)
        rows = shard.gather_rows(shard.rows, held)
    else:
        keys, rows = shard.values.export()
        row_keys, rows = tf.reshape(keys, [-1]), tf.reshape(rows, [-1, shard.dim])
        seen = tf.reshape(shard.counters.lookup(row_keys), [-1, 2])
        last, counting_again = seen[:, 1], seen[:, 0] < policy.min_frequency
    if policy.ttl_steps is not None:
        # What the layer's inference lookup reads now: a row not seen for ttl_steps reads zeros, and
        # so does the old row of a key sighted again after it expired (it counts afresh towards
        # min_frequency: `DynamicTable.lookup`; a bounded shard frees such a row at once).
        alive = shard.clock.read_value() - last <= policy.ttl_steps
        if counting_again is not None:
            alive &= ~counting_again
        row_keys, rows = tf.boolean_mask(row_keys, alive), tf.boolean_mask(rows, alive)
    return row_keys, rows


def _snapshot_function(shard, policy, dim):
    """A shard's live keys sorted, with a last entry no key passes, beside their rows: one traced
    call on the shard's ps. Traced, so that a snapshot costs one round trip rather than an eager op
    at a time (what a delta's pause waits for), and converts no Python value under the ps's
    device (such a copy holds the GIL: a hung ps would stop the coordinator)."""

    @tf.function(autograph=False)
    def snapshot():
        shard_keys, shard_rows = _live_rows(shard, policy)
        order = tf.argsort(shard_keys)
        sorted_keys = tf.concat([tf.gather(shard_keys, order), tf.constant([_LAST_KEY], tf.int64)], 0)
        sorted_rows = tf.concat([tf.gather(shard_rows, order), tf.zeros([1, dim])], 0)
        return sorted_keys, sorted_rows

    return made_per_object(snapshot)  # one per shard and renewal, each traced once


class ServingTable(tf.Module):
    """Per shard of a dynamic table, its keys sorted beside their rows (see the module's docstring).

    `keys[k]`: int64 [rows_k + 1], `rows[k]`: float32 [rows_k + 1, dim]. A
    `tf.Module`: a SavedModel (and Keras's export) tracks its variables.
    """

    def __init__(self, name: str, dim: int, keys: list, rows: list):
        super().__init__(name=name)
        self.dim = dim
        self.keys, self.rows = list(keys), list(rows)

    @classmethod
    def taken_from(cls, table, functions: dict | None = None) -> "ServingTable":
        """Snapshot `table` (a `DynamicTable`) now, each shard on its own device.

        `functions`: the snapshot functions of this table's shards, kept by a
        caller that snapshots it again and again (`DeltaCut`); None: traced now.
        """
        functions = {} if functions is None else functions
        keys, rows = [], []
        with tf.init_scope(), table.unmanaged():  # the table's own placement rule: no model variables
            for index, shard in enumerate(table.shards):
                traced = functions.get(index)
                if traced is None or traced[0] != table.renewals:  # new, or the shard was made again
                    traced = functions[index] = (table.renewals, RegisteredCall(
                        lambda shard=shard: _snapshot_function(shard, table.policy, table.dim)))
                with tf.device(shard.device) if shard.device else contextlib.nullcontext():
                    # An export streams its registrations (`streamed_function_registrations`): the call
                    # can reach the ps before the function does, and is then made again.
                    shard_keys, shard_rows = traced[1]()
                    # Shapes left open so that `psclient.serving` can write a delta's rows into a loaded SavedModel
                    # (a static size would be folded into its functions).
                    keys.append(tf.Variable(shard_keys, trainable=False, name=f"{table.name}_keys_{index}",
                                            shape=tf.TensorShape([None])))
                    rows.append(tf.Variable(shard_rows, trainable=False, name=f"{table.name}_rows_{index}",
                                            shape=tf.TensorShape([None, table.dim])))
        return cls(f"{table.name}_serving", table.dim, keys, rows)

    def size(self) -> int:
        """Rows held, over all shards."""
        return sum(int(tf.shape(keys)[0]) - 1 for keys in self.keys)

    def lookup(self, keys):
        """Rows of unique int64 `keys` [n] -> [n, dim]: a key's row, or zeros (see the module's docstring)."""
        count = len(self.keys)
        if count == 1:
            parts, positions = [keys], [tf.range(tf.size(keys))]
        else:
            owner = shard_of(keys, count)
            parts = tf.dynamic_partition(keys, owner, count)
            positions = tf.dynamic_partition(tf.range(tf.size(keys)), owner, count)
        found = []
        for sorted_keys, rows, part in zip(self.keys, self.rows, parts):
            sorted_keys = sorted_keys.read_value()
            held = tf.size(sorted_keys, tf.int64) - 1  # the last entry is the default
            at = tf.searchsorted(sorted_keys, part, side="left", out_type=tf.int64)  # <= held: the last key is max
            hit = (at < held) & tf.equal(tf.gather(sorted_keys, at), part)
            found.append(tf.gather(rows, tf.where(hit, at, held)))
        return tf.reshape(tf.dynamic_stitch(positions, found), [-1, self.dim])
