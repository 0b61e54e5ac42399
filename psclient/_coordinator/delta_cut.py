"""Delta versions written by the ps tasks: what changed in the dynamic tables since the previous cut.

A `DeltaCut` keeps, for each dynamic table, the snapshot of the previous cut
(`ServingTable.taken_from`: per ps task, the live keys sorted beside their
rows, in variables on that ps). `write(directory)` takes the next cut the same
way and, on each ps task, compares the two (`tf.searchsorted` of one's keys in
the other's, rows compared element by element): the rows that are new or
changed and their keys, and the keys that hold no live row any more (evicted,
expired by `ttl_steps`), are written by that ps (`tf.io.write_file` under its
device), so no row passes through the coordinator; only the counts do. The new
cut then replaces the previous one (whose copy on the ps is freed).

Why a kept snapshot and not the tables' per-row clocks: a diff is exact
whatever changed the rows (training, admission, eviction, expiry, a restore),
in both storages, and writes only rows whose values differ. Its cost: each ps
holds a copy of its live rows between deltas (two while one is written).

Dense variables are written whole in each delta, each from its own device.
The layout and the manifest are `psclient._core.serving_deltas`.
"""

from __future__ import annotations

import contextlib
import os

import tensorflow as tf

from psclient._coordinator.serving_table import ServingTable

__all__ = ["DeltaCut"]


def _placed(device):
    return tf.device(device) if device else contextlib.nullcontext()


@tf.function(input_signature=[tf.TensorSpec([None], tf.int64), tf.TensorSpec([None, None], tf.float32),
                              tf.TensorSpec([None], tf.int64), tf.TensorSpec([None, None], tf.float32),
                              tf.TensorSpec([], tf.string)])
def _diff_and_write(old_keys, old_rows, keys, rows, prefix):
    """Write (keys new or changed, their rows, keys gone) between two snapshots of one shard (sorted keys,
    each with a last entry no key passes: `ServingTable`'s layout) to `prefix` + keys/rows/removed;
    return their counts. One function, so that a delta costs one call per shard, run on its ps."""
    old_held, held = tf.size(old_keys, tf.int64) - 1, tf.size(keys, tf.int64) - 1
    now_keys, now_rows, before = keys[:-1], rows[:-1], old_keys[:-1]
    at = tf.searchsorted(old_keys, now_keys, side="left", out_type=tf.int64)
    found = (at < old_held) & tf.equal(tf.gather(old_keys, at), now_keys)
    same = found & tf.reduce_all(tf.equal(tf.gather(old_rows, at), now_rows), axis=1)
    at_now = tf.searchsorted(keys, before, side="left", out_type=tf.int64)
    kept = (at_now < held) & tf.equal(tf.gather(keys, at_now), before)
    changed, gone = tf.boolean_mask(now_keys, ~same), tf.boolean_mask(before, ~kept)
    for part, tensor in (("keys", changed), ("rows", tf.boolean_mask(now_rows, ~same)), ("removed", gone)):
        tf.io.write_file(prefix + part, tf.io.serialize_tensor(tensor))
    return tf.stack([tf.size(changed), tf.size(gone)])


def _dense_writer(dense: list):
    """A function writing each of `dense` ((name, tf.Variable) pairs) whole, each from its own device,
    to `directory`/d<j>: one call for all of them."""

    @tf.function(input_signature=[tf.TensorSpec([], tf.string)])
    def write(directory):
        for j, (_, variable) in enumerate(dense):
            with _placed(getattr(variable, "device", None)):
                tf.io.write_file(directory + f"/d{j}", tf.io.serialize_tensor(variable.read_value()))
        return tf.constant(0)

    return write


class DeltaCut:
    """The previous cut of `tables` (`DynamicTable`s), kept on their ps tasks (see the module's docstring).

    `dense`: (name, tf.Variable) pairs, written whole in each delta.
    """

    def __init__(self, tables: list, dense: list):
        self.tables, self.dense = list(tables), list(dense)
        self._write_dense = _dense_writer(self.dense) if self.dense else None
        # Traced now, with the full version this cut belongs to, rather than in the first delta's pause.
        _diff_and_write.get_concrete_function()
        if self._write_dense is not None:
            self._write_dense.get_concrete_function()
        self.previous = [ServingTable.taken_from(table) for table in self.tables]

    def write(self, directory: str) -> dict:
        """Write what changed since the previous cut into `directory`; return the manifest's contents.
        The caller makes this a cut (no step in flight)."""
        taken = [ServingTable.taken_from(table) for table in self.tables]
        entries = []
        for i, (table, old, new) in enumerate(zip(self.tables, self.previous, taken)):
            counts = []
            for k, shard in enumerate(table.shards):
                with _placed(shard.device):
                    counts.append(_diff_and_write(old.keys[k].read_value(), old.rows[k].read_value(),
                                                  new.keys[k].read_value(), new.rows[k].read_value(),
                                                  tf.constant(os.path.join(directory, f"t{i}_s{k}_"))))
            counts = [[int(c) for c in count.numpy()] for count in counts]
            entries.append({"name": table.name, "dim": table.dim, "shards": len(table.shards),
                            "changed": [c[0] for c in counts], "removed": [c[1] for c in counts]})
        if self._write_dense is not None:
            self._write_dense(tf.constant(directory))
        self.previous = taken  # the previous cut's copies on the ps are freed with it
        return {"tables": entries,
                "dense": [{"name": name, "dtype": variable.dtype.name} for name, variable in self.dense]}
