"""Delta versions written by the ps tasks: what changed in the dynamic tables and embedding-like variables.

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

Dense variables: an embedding-like one (rank 2, at least `ROW_DIFF_MIN_ROWS`
rows over its shards, a partitioned `keras.layers.Embedding` say) is diffed
per row the same way: its previous cut's value is kept on its ps (per shard),
and one traced call per shard, on its ps, finds the rows that differ
(`tf.reduce_any(tf.not_equal(old, new), axis=1)`) and writes their indices
(local to the shard) and the rows; when that would be no smaller than the
shard (most rows changed: a dense layer's kernel), it writes the shard whole
instead. Smaller dense variables are written whole, each from its own device
(a partitioned one as its shards, each from its ps). The kept copy costs each
ps the bytes of its row-diffed shards (two copies while a delta is taken and
written): the read at a cut copies a variable read sparsely, as an embedding
is (TF's copy-on-read mode), and any other is copied by the next update that
finds the read still held (copy-on-write), so a kept read is a copy either way.

A ps lost since the base cut (its variables' handles renewed, its tables made
again: `lost()`) took the kept copies with it: this `DeltaCut` can write no
right delta any more, and the chain goes on with a full version
(`ServingExport`). The layout and the manifest are `psclient._core.serving_deltas`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, NamedTuple

import tensorflow as tf

from psclient._coordinator.serving.serving_table import ServingTable
from psclient._coordinator.variables.sharding import ROW_DIFF_MIN_ROWS
from psclient._tf.context import coordinator_cpu

__all__ = ["ROW_DIFF_MIN_ROWS", "CutLost", "DeltaCut"]


class CutLost(RuntimeError):
    """A ps lost since the base cut took its copies of that cut with it: the next version must be full."""


def _placed(device):
    return tf.device(device) if device else contextlib.nullcontext()


def _table_differ():
    """The traced function that diffs one shard of a dynamic table on its ps.

    Made (and traced) for each `DeltaCut`, not once per process: a function is registered on the
    remote tasks the coordinator is connected to when it is traced, so one traced before this
    cluster was connected (a local model's deltas earlier in the process) is unknown to its ps
    tasks ("... is neither a type of a primitive operation nor a name of a function registered")."""
    return tf.function(_diff_and_write, input_signature=[
        tf.TensorSpec([None], tf.int64), tf.TensorSpec([None, None], tf.float32),
        tf.TensorSpec([None], tf.int64), tf.TensorSpec([None, None], tf.float32), tf.TensorSpec([], tf.string)])


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


def _row_differ(dtype: tf.DType):
    """The function that diffs one shard of a row-diffed variable of `dtype` on its ps (made and traced
    for each `DeltaCut`, as `_table_differ`'s is)."""

    @tf.function(input_signature=[tf.TensorSpec([None, None], dtype), tf.TensorSpec([None, None], dtype),
                                  tf.TensorSpec([], tf.string)])
    def diff_rows_and_write(old, new, prefix):
        """Write the rows of `new` that differ from `old` (`prefix`_idx: their int64 indices in the shard,
        `prefix`_rows: the rows), or, when that is no smaller, the shard whole (`prefix`); return
        [rows changed, 1 if written as rows else 0]."""
        indices = tf.where(tf.reduce_any(tf.not_equal(old, new), axis=1))[:, 0]
        count = tf.size(indices, tf.int64)
        shape = tf.shape(new, out_type=tf.int64)
        item = dtype.size
        by_rows = count * (shape[1] * item + 8) < shape[0] * shape[1] * item

        def rows():
            writes = [tf.io.write_file(prefix + "_idx", tf.io.serialize_tensor(indices)),
                      tf.io.write_file(prefix + "_rows", tf.io.serialize_tensor(tf.gather(new, indices)))]
            with tf.control_dependencies(writes):
                return tf.constant(1, tf.int64)

        def whole():
            with tf.control_dependencies([tf.io.write_file(prefix, tf.io.serialize_tensor(new))]):
                return tf.constant(0, tf.int64)

        return tf.stack([count, tf.cond(by_rows, rows, whole)])

    return diff_rows_and_write


class _File(NamedTuple):
    """One dense variable or shard a delta writes: its file name, the tf.Variable, whether it is diffed
    per row, and the variable's index in `DeltaCut.dense`."""

    name: str
    variable: tf.Variable
    rows: bool
    owner: int


def _row_diffed(variable) -> bool:
    parts = variable if isinstance(variable, list) else [variable]
    shape = parts[0].shape
    return shape.rank == 2 and sum(int(part.shape[0]) for part in parts) >= ROW_DIFF_MIN_ROWS


def _flat(dense: list) -> list:
    """A `_File` for each variable of `dense` ((name, a tf.Variable or the list of a partitioned
    variable's shards) pairs): d<j>, or d<j>_p<i> for shard i."""
    files = []
    for j, (_, variable) in enumerate(dense):
        rows = _row_diffed(variable)
        if isinstance(variable, list):
            files += [_File(f"d{j}_p{i}", part, rows, j) for i, part in enumerate(variable)]
        else:
            files.append(_File(f"d{j}", variable, rows, j))
    return files


def _readers(files: list) -> list:
    """Per device, (device, the files' positions, a function reading those variables there): one call
    per ps copies its dense variables at a cut, and the copies stay on that ps."""
    by_device: dict = {}
    for position, file in enumerate(files):
        by_device.setdefault(file.variable.device, []).append(position)
    readers = []
    for device, positions in by_device.items():
        read = _reader([files[position].variable for position in positions])
        with _placed(device):
            read.get_concrete_function()  # traced now, not in a cut's pause
        readers.append((device, positions, read))
    return readers


def _reader(variables: list):
    @tf.function
    def read():
        return [tf.identity(variable.read_value()) for variable in variables]

    return read


def _described(name: str, variable, files: list, counts: dict) -> dict:
    """The manifest's entry of a dense variable; `files`: its `_File`s, `counts`: (rows changed, written
    as rows) per row-diffed file name."""
    entry = {"name": name, "dtype": (variable[0] if isinstance(variable, list) else variable).dtype.name}
    if isinstance(variable, list):
        entry["parts"] = [part.name for part in variable]
    if not files[0].rows:
        entry["form"] = "whole"
        return entry
    entry.update(form="rows", shard_rows=[int(file.variable.shape[0]) for file in files],
                 changed=[counts[file.name][0] for file in files],
                 written=["rows" if counts[file.name][1] else "whole" for file in files])
    return entry


class Cut(NamedTuple):
    """What `DeltaCut.take` copied at a cut, on the ps tasks: each table's `ServingTable`, and the dense
    variables' values (file name, tensor on its ps)."""

    tables: list
    dense: list


class DeltaCut:
    """The previous cut of `tables` (`DynamicTable`s) and of the embedding-like variables of `dense`, kept
    on their ps tasks (see the module's docstring).

    `dense`: (name, tf.Variable or a partitioned variable's shards) pairs: diffed per row, or written
    whole in each delta. `take()` copies a cut on the ps tasks (what training must pause for);
    `write(cut, directory)` then diffs and writes it there, while training goes on; cuts are written
    in the order taken.
    """

    def __init__(self, tables: list, dense: list):
        self.tables, self.dense = list(tables), list(dense)
        self._files = _flat(self.dense)
        # What a lost ps renews (`lost()`): the variables' handles, the tables' shards.
        self._handles = [file.variable.handle for file in self._files]
        self._renewals = [table.renewals for table in self.tables]
        # Traced now, with the full version this cut belongs to, rather than in a delta's pause.
        self._readers = _readers(self._files)
        self._diff_table = _table_differ()
        self._diff_table.get_concrete_function()
        self._diff_rows = {}  # by dtype
        for file in self._files:
            if file.rows and file.variable.dtype not in self._diff_rows:
                self._diff_rows[file.variable.dtype] = _row_differ(file.variable.dtype)
                self._diff_rows[file.variable.dtype].get_concrete_function()
        self._snapshots = [{} for _ in self.tables]  # each table's traced snapshot functions, kept
        self.previous = self._take_tables()
        # The row-diffed variables' previous values, on their ps.
        self._kept = {position: value for position, value in self._read_dense().items() if self._files[position].rows}

    def lost(self) -> bool:
        """Whether a ps was lost (and its variables or tables made again) since this `DeltaCut` was made:
        the copies it kept there are gone, and so are the handles its functions captured."""
        return (any(file.variable.handle is not handle for file, handle in zip(self._files, self._handles))
                or any(table.renewals != renewals for table, renewals in zip(self.tables, self._renewals)))

    def take(self) -> Cut:
        """Copy the tables' live rows and the dense variables now, each on its ps. The caller makes this
        a cut (no step in flight). `CutLost` if a ps was lost since this `DeltaCut` was made."""
        if self.lost():
            raise CutLost("A ps task was lost since the previous full version: its copies of the cut are gone.")
        values = self._read_dense()
        return Cut(self._take_tables(), [(self._files[position].name, value) for position, value in values.items()])

    def _read_dense(self) -> dict:
        values = {}
        for device, positions, read in self._readers:
            with _placed(device):
                for position, value in zip(positions, read()):
                    values[position] = value
        return dict(sorted(values.items()))

    def _take_tables(self) -> list:
        return [ServingTable.taken_from(table, functions)
                for table, functions in zip(self.tables, self._snapshots)]

    def write(self, cut: Cut, directory: str, after_part: Callable[[str], None] | None = None) -> dict:
        """Write what changed between the previous cut and `cut` into `directory` (from the ps tasks);
        `cut` becomes the previous one. Returns the manifest's contents.

        `after_part(device)`: called after each part is written by `device` (a ps task), before the
        next (a test's seam: a fault landing in the middle of a delta). `CutLost` if a ps was lost
        since this `DeltaCut` was made (the delta may mix incarnations: it must not be published)."""
        after_part = after_part or (lambda device: None)
        entries = []
        for i, (table, old, new) in enumerate(zip(self.tables, self.previous, cut.tables)):
            counts = []
            for k, shard in enumerate(table.shards):
                # Made here, outside the ps's device: a Python value converted under a task's
                # device is copied there holding the GIL (a hung ps would freeze the coordinator).
                prefix = _path(directory, f"t{i}_s{k}_")
                with _placed(shard.device):
                    counts.append(self._diff_table(old.keys[k].read_value(), old.rows[k].read_value(),
                                                  new.keys[k].read_value(), new.rows[k].read_value(), prefix))
                after_part(shard.device)
            counts = [[int(c) for c in count.numpy()] for count in counts]
            entries.append({"name": table.name, "dim": table.dim, "shards": len(table.shards),
                            "changed": [c[0] for c in counts], "removed": [c[1] for c in counts]})
        row_counts = {}
        for position, (name, value) in enumerate(cut.dense):
            file = self._files[position]
            path = _path(directory, name)
            with _placed(value.device):
                if file.rows:
                    row_counts[name] = self._diff_rows[value.dtype](self._kept[position], value, path)
                else:
                    tf.io.write_file(path, tf.io.serialize_tensor(value))
            after_part(value.device)
        row_counts = {name: [int(c) for c in count.numpy()] for name, count in row_counts.items()}
        if self.lost():
            raise CutLost("A ps task was lost while the delta was written: it may mix the task's incarnations.")
        self.previous = cut.tables  # the previous cut's copies on the ps are freed with it
        self._kept = {position: value for position, (_, value) in enumerate(cut.dense) if self._files[position].rows}
        dense = [_described(name, variable, [file for file in self._files if file.owner == j], row_counts)
                 for j, (name, variable) in enumerate(self.dense)]
        return {"tables": entries, "dense": dense}


def _path(directory: str, name: str):
    """`directory`/`name` as a string tensor on the coordinator (see `write`)."""
    with tf.device(coordinator_cpu()):
        return tf.constant(os.path.join(directory, name))
