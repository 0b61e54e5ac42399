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

Training pauses only for the copy (`take`, a cut between steps); the diff and
the writes (`write`) run on the ps tasks from the copies while training goes on.

Dense variables are written whole in each delta, each from its own device (a
partitioned variable as its shards, each from its ps).
The layout and the manifest are `psclient._core.serving_deltas`.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import tensorflow as tf

from psclient._coordinator.serving.serving_table import ServingTable
from psclient._tf.context import coordinator_cpu

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


def _flat(dense: list) -> list:
    """(file name, tf.Variable) for each variable of `dense` ((name, a tf.Variable or the list of a
    partitioned variable's shards) pairs): d<j>, or d<j>_p<i> for shard i."""
    files = []
    for j, (_, variable) in enumerate(dense):
        if isinstance(variable, list):
            files += [(f"d{j}_p{i}", part) for i, part in enumerate(variable)]
        else:
            files.append((f"d{j}", variable))
    return files


def _readers(files: list) -> list:
    """Per device, (device, the files' positions, a function reading those variables there): one call
    per ps copies its dense variables at a cut, and the copies stay on that ps."""
    by_device: dict = {}
    for position, (_, variable) in enumerate(files):
        by_device.setdefault(variable.device, []).append(position)
    readers = []
    for device, positions in by_device.items():
        read = _reader([files[position][1] for position in positions])
        with _placed(device):
            read.get_concrete_function()  # traced now, not in a cut's pause
        readers.append((device, positions, read))
    return readers


def _reader(variables: list):
    @tf.function
    def read():
        return [tf.identity(variable.read_value()) for variable in variables]

    return read


def _described(name: str, variable) -> dict:
    if isinstance(variable, list):
        return {"name": name, "dtype": variable[0].dtype.name, "parts": [part.name for part in variable]}
    return {"name": name, "dtype": variable.dtype.name}


class Cut(NamedTuple):
    """What `DeltaCut.take` copied at a cut, on the ps tasks: each table's `ServingTable`, and the dense
    variables' values (file name, tensor on its ps)."""

    tables: list
    dense: list


class DeltaCut:
    """The previous cut of `tables` (`DynamicTable`s), kept on their ps tasks (see the module's docstring).

    `dense`: (name, tf.Variable or a partitioned variable's shards) pairs, written whole in each delta.
    `take()` copies a cut on the ps tasks (what training must pause for); `write(cut, directory)`
    then diffs and writes it there, while training goes on; cuts are written in the order taken.
    """

    def __init__(self, tables: list, dense: list):
        self.tables, self.dense = list(tables), list(dense)
        self._files = _flat(self.dense)
        # Traced now, with the full version this cut belongs to, rather than in a delta's pause.
        self._readers = _readers(self._files)
        _diff_and_write.get_concrete_function()
        self._snapshots = [{} for _ in self.tables]  # each table's traced snapshot functions, kept
        self.previous = self._take_tables()

    def take(self) -> Cut:
        """Copy the tables' live rows and the dense variables now, each on its ps. The caller makes this
        a cut (no step in flight)."""
        values = [None] * len(self._files)
        for device, positions, read in self._readers:
            with _placed(device):
                for position, value in zip(positions, read()):
                    values[position] = (self._files[position][0], value)
        return Cut(self._take_tables(), values)

    def _take_tables(self) -> list:
        return [ServingTable.taken_from(table, functions)
                for table, functions in zip(self.tables, self._snapshots)]

    def write(self, cut: Cut, directory: str) -> dict:
        """Write what changed between the previous cut and `cut` into `directory` (from the ps tasks);
        `cut` becomes the previous one. Returns the manifest's contents."""
        entries = []
        for i, (table, old, new) in enumerate(zip(self.tables, self.previous, cut.tables)):
            counts = []
            for k, shard in enumerate(table.shards):
                # Made here, outside the ps's device: a Python value converted under a task's
                # device is copied there holding the GIL (a hung ps would freeze the coordinator).
                with tf.device(coordinator_cpu()):
                    prefix = tf.constant(os.path.join(directory, f"t{i}_s{k}_"))
                with _placed(shard.device):
                    counts.append(_diff_and_write(old.keys[k].read_value(), old.rows[k].read_value(),
                                                  new.keys[k].read_value(), new.rows[k].read_value(), prefix))
            counts = [[int(c) for c in count.numpy()] for count in counts]
            entries.append({"name": table.name, "dim": table.dim, "shards": len(table.shards),
                            "changed": [c[0] for c in counts], "removed": [c[1] for c in counts]})
        for name, value in cut.dense:
            with tf.device(coordinator_cpu()):
                path = tf.constant(os.path.join(directory, name))  # on the coordinator (see above)
            with _placed(value.device):
                tf.io.write_file(path, tf.io.serialize_tensor(value))
        self.previous = cut.tables  # the previous cut's copies on the ps are freed with it
        return {"tables": entries, "dense": [_described(name, variable) for name, variable in self.dense]}
