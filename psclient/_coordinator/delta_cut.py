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


def _diff(old_keys, old_rows, keys, rows):
    """(keys new or changed, their rows, keys gone) between two snapshots of one shard (sorted keys, each
    with a last entry no key passes: `ServingTable`'s layout)."""
    old_keys, keys = old_keys.read_value(), keys.read_value()
    old_rows, rows = old_rows.read_value(), rows.read_value()
    old_held, held = tf.size(old_keys, tf.int64) - 1, tf.size(keys, tf.int64) - 1
    now_keys, now_rows, before = keys[:-1], rows[:-1], old_keys[:-1]
    at = tf.searchsorted(old_keys, now_keys, side="left", out_type=tf.int64)
    found = (at < old_held) & tf.equal(tf.gather(old_keys, at), now_keys)
    same = found & tf.reduce_all(tf.equal(tf.gather(old_rows, at), now_rows), axis=1)
    at_now = tf.searchsorted(keys, before, side="left", out_type=tf.int64)
    kept = (at_now < held) & tf.equal(tf.gather(keys, at_now), before)
    return tf.boolean_mask(now_keys, ~same), tf.boolean_mask(now_rows, ~same), tf.boolean_mask(before, ~kept)


def _write(path: str, tensor) -> None:
    tf.io.write_file(path, tf.io.serialize_tensor(tensor))


class DeltaCut:
    """The previous cut of `tables` (`DynamicTable`s), kept on their ps tasks (see the module's docstring)."""

    def __init__(self, tables: list):
        self.tables = list(tables)
        self.previous = [ServingTable.taken_from(table) for table in self.tables]

    def write(self, directory: str, dense: list) -> dict:
        """Write what changed since the previous cut into `directory`; return the manifest's contents.

        `dense`: (name, tf.Variable) pairs, written whole. The caller makes
        this a cut (no step in flight).
        """
        taken = [ServingTable.taken_from(table) for table in self.tables]
        entries = []
        for i, (table, old, new) in enumerate(zip(self.tables, self.previous, taken)):
            changed, removed = [], []
            for k, shard in enumerate(table.shards):
                with _placed(shard.device):
                    keys, rows, gone = _diff(old.keys[k], old.rows[k], new.keys[k], new.rows[k])
                    for part, tensor in (("keys", keys), ("rows", rows), ("removed", gone)):
                        _write(os.path.join(directory, f"t{i}_s{k}_{part}"), tensor)
                    counts = tf.stack([tf.size(keys), tf.size(gone)])
                changed_count, removed_count = (int(c) for c in counts.numpy())
                changed.append(changed_count)
                removed.append(removed_count)
            entries.append({"name": table.name, "dim": table.dim, "shards": len(table.shards),
                            "changed": changed, "removed": removed})
        names = []
        for j, (name, variable) in enumerate(dense):
            with _placed(getattr(variable, "device", None)):
                _write(os.path.join(directory, f"d{j}"), tf.identity(variable))
            names.append({"name": name, "dtype": variable.dtype.name})
        self.previous = taken  # the previous cut's copies on the ps are freed with it
        return {"tables": entries, "dense": names}
