"""A big value in row chunks: how a save cuts it and a restore reads and assigns it in ranges.

A value above `READ_BATCH_BYTES` is saved as row chunks of at most that size,
each a slice of its key (`save_chunked`; SaveV2 takes several slices of one
key, as TF's saver writes a partitioned variable). RestoreV2 reads a range of
rows by reading each saved slice it overlaps whole, then copying the range
out: a range of a value saved whole costs the whole value. So a restore reads
a slot in ranges (`Piece`) only where the checkpoint's layout lists its key
under `row_chunks`, and each range is assigned where it lives (`assign_rows`,
on the ps): a ps then holds at most
about `READ_BATCH_BYTES` beyond its variables, whatever the size of its slots.

The split that cuts a value shares the value's buffer (no copy) only when a
row is a multiple of `ROW_ALIGN_BYTES`; a value with other rows is saved
whole (a copy of it at save time would cost more than a whole read).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from psclient._coordinator import runtime as _runtime

__all__ = ["LOCAL", "READ_BATCH_BYTES", "ROW_ALIGN_BYTES", "Piece", "assign_rows", "batches", "chunk_bytes", "chunk_rows", "chunked_keys", "first_of",
           "coordinator_constant", "pieces_of", "rows_spec", "save_chunked", "slot_bytes", "slot_bytes_of",
           "task_of"]


#: The most bytes a restore reads at once on a ps (a batch of small slots, or a range of a larger
#: slot's rows); also the largest row chunk a save writes of a big slot (`save_chunked`).
READ_BATCH_BYTES = 8 << 20
#: A split along rows shares its value's buffer (no copy) when a row is a multiple of this many bytes
#: (Eigen's largest alignment, TF's `IsInnerDimsSizeAligned`); other values are saved whole.
ROW_ALIGN_BYTES = 64


def slot_bytes(slot: Any) -> int:
    """The bytes of a Slot (`checkpoint_parts`) or a Piece."""
    if isinstance(slot, Piece):
        return slot.nbytes
    return int(slot.variable.shape.num_elements()) * slot.variable.dtype.size


def slot_bytes_of(shape: list[int], dtype) -> int:
    return _product(shape) * int(dtype.size)


def chunk_rows(shape: list[int], dtype, limit: int | None = None, aligned: bool = True) -> int | None:
    """Rows per chunk a value of `shape` is saved (and read) in, or None: saved whole. `aligned`
    False: also for rows of any size (chunks copied anyway, `fuzzy_copy`, not split off a read)."""
    limit = READ_BATCH_BYTES if limit is None else limit
    if len(shape) < 1 or shape[0] < 2:
        return None
    row = int(dtype.size) * int(_product(shape[1:]))
    if row == 0 or (aligned and row % ROW_ALIGN_BYTES) or row * shape[0] <= limit:
        return None
    return max(1, limit // row)


def _product(dims) -> int:
    out = 1
    for d in dims:
        out *= int(d)
    return out


def rows_spec(full: list[int], first: int, rows: int) -> str:
    """TF's slice spec of rows [first, first + rows) of a tensor of shape `full`."""
    return " ".join(str(d) for d in full) + " " + ":".join([f"{first},{rows}"] + ["-"] * (len(full) - 1))


def first_of(spec: str, shape: list[int]) -> tuple[list[int], int]:
    """(full shape, first row) of a value saved under `spec` ("" : the whole of `shape`)."""
    if not spec:
        return list(shape), 0
    parts = spec.split(" ")
    return [int(d) for d in parts[:-1]], int(parts[-1].split(":")[0].split(",")[0])


def save_chunked(names: list[str], specs: list[str], values: list, limit: int | None = None) -> tuple:
    """(names, specs, values) with each value `chunk_rows` cuts into row chunks, as slices of its key
    (on the device in force: SplitV there, which shares the value's buffer), and the keys chunked."""
    out_names, out_specs, out_values, chunked = [], [], [], set()
    for name, spec, value in zip(names, specs, values):
        shape = value.shape.as_list()
        rows = chunk_rows(shape, value.dtype, limit)
        if rows is None:
            out_names.append(name), out_specs.append(spec), out_values.append(value)
            continue
        full, first = first_of(spec, shape)
        sizes = [rows] * (shape[0] // rows) + ([shape[0] % rows] if shape[0] % rows else [])
        pieces = tf.raw_ops.SplitV(value=value, size_splits=coordinator_constant(sizes, tf.int64),
                                   axis=coordinator_constant(0, tf.int32), num_split=len(sizes))
        at = first
        for size, piece in zip(sizes, pieces):
            out_names.append(name), out_specs.append(rows_spec(full, at, size)), out_values.append(piece)
            at += size
        chunked.add(name)
    return out_names, out_specs, out_values, chunked


#: The "ps" of a table or variable without a cluster: its part is written by this process.
LOCAL = -1


def task_of(shard) -> int:
    """The ps task that holds a table's `shard` (LOCAL: a table without a cluster, in this process)."""
    return _runtime.ps_index_of(shard.device) if shard.device else LOCAL


def coordinator_constant(value, dtype):
    """A constant on the coordinator's CPU: made under a ps's device, TF would copy it there from
    inside the conversion, holding the GIL (`psclient._tf.checkpoints._here`)."""
    with tf.device(_runtime.coordinator_cpu()):
        return tf.constant(value, dtype)


class Piece:
    """Rows [start, stop) of a slot (its own rows), or the whole slot (`stop` None): what a restore
    reads and assigns at once. `spec`: its slice of the saved key."""

    __slots__ = ("slot", "start", "stop", "spec", "nbytes")

    def __init__(self, slot: Any, start: int = 0, stop: int | None = None):
        self.slot, self.start, self.stop = slot, start, stop
        if stop is None:
            self.spec, self.nbytes = slot.spec, slot_bytes(slot)
        else:
            shape = slot.variable.shape.as_list()
            full, first = first_of(slot.spec, shape)
            self.spec = rows_spec(full, first + start, stop - start)
            self.nbytes = (stop - start) * _product(shape[1:]) * slot.variable.dtype.size

    @property
    def key(self) -> str:
        return self.slot.key

    @property
    def first_row(self) -> int:
        """Its first row in the full (unpartitioned) variable."""
        return first_of(self.slot.spec, self.slot.variable.shape.as_list())[1] + self.start

    def assign(self, tensor) -> None:
        """`tensor` into its rows of its variable, on the device in force (its ps)."""
        variable = self.slot.variable
        if self.stop is None:
            variable.assign(tensor, read_value=False)
            return
        assign_rows(variable, self.start, self.stop, tensor)
        if self.stop == int(variable.shape[0]):  # its last range (they are assigned in order)
            # A ranged assign puts the variable in TF's copy-on-read mode (as a scatter does): every
            # read of it would then copy it, a dense one's on each step. Back to sharing its buffer;
            # a scatter update sets the mode again where one updates it.
            tf.raw_ops.DisableCopyOnRead(resource=variable.handle)


def assign_rows(variable, start: int, stop: int, value) -> None:
    """`value` into rows [start, stop) of `variable`, on the device in force (its ps).

    A row is a slice of a rank-2 or higher variable: it is scattered to the
    range's indices, made where the variable lives. TF's sliced assign
    (`ResourceStridedSliceAssign`) copies element by element on one thread:
    measured on this 2-core machine, 8 MiB of 32-wide float32 rows took 5.4 ms
    of wall time and 9.7 ms of CPU that way, 0.55 ms either as a scatter (a
    restore of 512 MB on 4 ps spent 1.3 s in such assigns). A rank-1 variable's
    rows are single elements, which a scatter copies one at a time (5.5 ms): it
    keeps the sliced assign. Either leaves the variable in TF's copy-on-read mode
    (the caller turns it off after its last range).
    """
    rank = variable.shape.rank  # unknown in a traced function: the value's (rank-2 table rows)
    rank = value.shape.rank if rank is None else rank
    if rank >= 2 and variable.dtype != tf.string:
        indices = tf.raw_ops.Range(start=coordinator_constant(start, tf.int64),  # every input a constant:
                                   limit=coordinator_constant(stop, tf.int64),   # tf.range would convert
                                   delta=coordinator_constant(1, tf.int64))      # its delta on the ps
        tf.raw_ops.ResourceScatterUpdate(resource=variable.handle, indices=indices, updates=value)
        return
    tf.raw_ops.ResourceStridedSliceAssign(
        ref=variable.handle, begin=coordinator_constant([start] + [0] * (rank - 1), tf.int64),
        end=coordinator_constant([stop] + [0] * (rank - 1), tf.int64),
        strides=coordinator_constant([1] * rank, tf.int64), value=value,
        end_mask=(1 << rank) - 2)  # every axis but the first whole


def pieces_of(slots: list, chunked: frozenset | set | None, limit: int | None = None) -> list[Piece]:
    """`slots` as Pieces: a slot above `limit` whose key was saved in row chunks (`chunked`) in row
    ranges of at most `limit` bytes (the checkpoint's chunk size: its ranges are the chunks saved
    when the shards are those it was saved from); any other slot whole."""
    out = []
    for slot in slots:
        shape = slot.variable.shape.as_list()
        rows = chunk_rows(shape, slot.variable.dtype, limit) if chunked and slot.key in chunked else None
        if rows is None:
            out.append(Piece(slot))
            continue
        # Ranges from the slot's first row, as `save_chunked` cut it: restored into the shards it was
        # saved from, each range is one chunk saved (read straight into place).
        for start in range(0, shape[0], rows):
            out.append(Piece(slot, start, min(shape[0], start + rows)))
    return out


def batches(slots: list, limit: int | None = None) -> list[list]:
    """`slots` (Slots or Pieces) in order, grouped so that a group holds at most `limit` bytes, or
    one larger one alone."""
    limit = READ_BATCH_BYTES if limit is None else limit
    out: list[list] = []
    size = 0
    for slot in slots:
        n = slot_bytes(slot)
        if out and size + n <= limit:
            out[-1].append(slot)
            size += n
        else:
            out.append([slot])
            size = n
    return out


def chunked_keys(layout: dict | None) -> frozenset:
    """The keys a checkpoint's layout says a range of reads at its own cost (none before this format)."""
    return frozenset(((layout or {}).get("row_chunks") or {}).get("keys", ()))


def chunk_bytes(layout: dict | None) -> int | None:
    """The row chunk size a checkpoint was saved with (None: before this format)."""
    return ((layout or {}).get("row_chunks") or {}).get("bytes")
