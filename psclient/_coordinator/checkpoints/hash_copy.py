"""Dynamic tables in hash storage copied before a checkpoint's cut and merged after it.

A table without a `capacity` (or with `dynamic_table_storage="hash"`) keeps
each ps's shard in `MutableHashTable`s (`tables.hash_shard`): rows, each slot,
and counters. Exported in the cut, the pause grew with the table (0.14 s at
450,000 32-wide rows with Adagrad, 0.52 s at 1.8 million, 2 ps:
benchmarks/table_checkpoint.py --storage hash). In a strategy whose
checkpoints copy before the cut, each hash shard says which keys its writes
touch while a copy is under way (`HashShard.mark`). Then, as for big
variables (`fuzzy_copy`) and bounded tables (`table_copy`):

1. `copy_shards`, before dispatch pauses, training going on: a copy begun
   (`HashShard.copies`), `touched` emptied, then the counters and rows
   exported and each slot read at the exported rows' keys (each table as of
   its own moment). Every write after `touched` was emptied puts its keys
   there once it is done.
2. `cut`, in the cut, one call per shard: the touched keys, and for each of
   them its counters, row and slots now, with whether it still has a counter
   and a row (looked up with a default no entry holds: a removed key is
   found missing); the clock and the counts.
3. `Merged`, in the background write, on the ps: the touched keys' entries
   are dropped from the exports (`ListDiff`) and those that still hold one
   appended with their values at the cut, one field at a time, each export
   dropped once merged. `release` ends the copy (`touched` is emptied when
   the next one begins).

So the checkpoint holds what an export in the cut would hold (the same
entries; the touched keys last). A restore or import into the shard
(`HashShard.replace`, counted in `restores`), new slots or new tables (its
ps lost: `HashShard.make`) after the copy make it stale: the cut then
exports that shard as before. Memory on a ps: the exports (what the cut's
export took before), then in the write the merged fields as the exports go
(`Merged`); `touched` holds the keys written during a copy.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator.checkpoints import stages as _stages
from psclient._coordinator.checkpoints.checkpoint_pieces import coordinator_constant
from psclient._coordinator.checkpoints.table_copy import Later
from psclient._tf.registrations import Renewable, until_registered
from psclient._tf.functions import made_per_object

__all__ = ["HashCopy", "Merged", "copy_shards", "cut"]

#: A row no entry holds, as a missing key's row in the cut's lookup: a signalling NaN's bits
#: (arithmetic makes quiet NaNs; a copy keeps the bits).
_NO_ROW_BITS = 0x7FA0_5C1D
#: A missing key's counters in the cut's lookup: no step is numbered so.
_NO_STEP = -(2**63)


class HashCopy:
    """One hash shard's exports, taken before the cut (`copy_shards`): counters' keys and values, rows'
    keys and rows, each slot's rows (by slot name), tensors on its ps."""

    __slots__ = ("shard", "version", "restores", "exports", "nbytes", "number")

    def __init__(self, shard: Any, exports: list, number: int):
        self.shard, self.exports, self.number = shard, exports, number
        self.nbytes = sum(int(t.shape.num_elements()) * t.dtype.size for t in exports)
        self.version, self.restores = shard.version, shard.restores

    def current(self) -> bool:
        """Whether the shard still has the tables copied, written only through marked sections since."""
        return self.shard.version is self.version and self.shard.restores == self.restores

    def release(self) -> None:
        """After the write, on the shard's ps: the copy ends, writes are no longer marked (the exports
        went as they were merged)."""
        if self.current():
            _end(self.shard.copies, coordinator_constant(self.number, tf.int64))


class Merged:
    """A copied shard's keys, counters, row keys, rows and slots as of the cut, merged from its exports
    and the cut's reads in the checkpoint's write (`result`, under its ps's device): one call finds
    where each entry goes, then one call a field copies it there, and that field's export is dropped
    (the ps frees it), so the ps holds the exports and the merged fields at most about 1.5 times the
    exports' bytes at once (all merged at once, 2.5 times: measured)."""

    __slots__ = ("copy", "cut_reads", "_out")

    def __init__(self, copy: HashCopy, cut_reads: list):
        self.copy, self.cut_reads, self._out = copy, cut_reads, None

    def result(self) -> list:
        if self._out is None:
            exports, (touched, counters, rows, slots, tracked, has_row) = self.copy.exports, self.cut_reads
            to_counters, to_rows = _positions(exports[0], exports[2], touched, tracked, has_row)
            out = []
            for field, (at_cut, to) in enumerate([(touched, to_counters), (counters, to_counters), (touched, to_rows),
                                                  (rows, to_rows), *[(slot, to_rows) for slot in slots]]):
                out.append(_stitch(exports[field], at_cut, *to))
                exports[field] = None  # freed on the ps once no call holds it
            self._out, self.cut_reads = out, None
        return self._out


def copy_shards(shards: list, stop: Callable[[], bool] | None = None) -> dict[int, HashCopy]:
    """On the ps in force, training going on: id(shard) -> its copy, for each marked hash shard of
    `shards` (that ps's). `stop`, as `stages.copy_in_chunks`': called before each export (a table's
    export is one op, the finest step there is: a caller that watches for a hung ps counts each call
    as progress); CopyStopped once it is true, every copy it began then ended on the ps."""
    out = {}
    try:
        for shard in [shard for shard in shards if not shard.dense and shard.marked]:
            _check(stop, shard, "its copy began")
            out[id(shard)] = _copy_shard(shard, stop)
    except _stages.CopyStopped:
        for copy in out.values():  # their writes no longer note their keys
            copy.release()
        raise
    return out


def _copy_shard(shard: Any, stop: Callable[[], bool] | None) -> HashCopy:
    shard.copies_begun += 1
    number = coordinator_constant(shard.copies_begun, tf.int64)
    # Begun before `touched` is emptied: see the module.
    # Called again if it overtakes its registration (only then: not run), not the whole copy.
    until_registered(lambda: _begin(shard.copies, shard.touched, number), remake=_begin.renew)
    try:
        _check(stop, shard, "its counters were exported")
        counters = shard.counters.export()  # keys [n] eagerly, values [n, width]
        _check(stop, shard, "its rows were exported")
        keys, rows = shard.values.export()
        slot_rows = []
        for name in sorted(shard.slots):
            _check(stop, shard, f"its slot {name!r} was read")
            slot_rows.append(shard.slots[name].lookup(keys))
    except _stages.CopyStopped:
        until_registered(lambda: _end(shard.copies, number), remake=_end.renew)  # its writes no longer note their keys
        raise
    copy = HashCopy(shard, [*counters, keys, rows, *slot_rows], shard.copies_begun)
    # Traced now, not in the cut or the write (a trace registers a function on every task); the
    # cut's also called, so that the ps makes it now (it only reads).
    touched, counters_now, rows_now, _slots, tracked, has_row = until_registered(
        lambda: _cut_function(shard)(), remake=lambda: _forget_cut(shard))[:-4]
    to = _positions.get_concrete_function(*map(_any_size, [keys, keys, touched, tracked, has_row]))
    for export, at_cut in [(keys, touched), (counters[1], counters_now), (rows, rows_now)]:
        _stitch.get_concrete_function(*map(_any_size, [export, at_cut, *to.outputs[:3]]))
    return copy


def _check(stop: Callable[[], bool] | None, shard: Any, before: str) -> None:
    if stop is not None and stop():
        raise _stages.CopyStopped(f"the copy of {shard.prefix} stopped before {before}")


def _any_size(value) -> tf.TensorSpec:
    return tf.TensorSpec([None] * value.shape.rank, value.dtype)


def cut(copy: HashCopy) -> tuple[list, Any]:
    """In the cut, on the shard's ps: (the shard's saved values in the checkpoint's order, those merged
    in the write `Later`; the count of keys read again, a tensor on the ps)."""
    *reads, clock, admissions, evictions, count = _cut_function(copy.shard)()
    merged = Merged(copy, reads)
    keys, counters, row_keys, rows, *slots = [Later(merged, i) for i in range(len(copy.exports))]
    return [keys, counters, row_keys, rows, clock, admissions, evictions, *slots], count


# Traced: nothing converted under the ps's device (TF would copy a Python value there holding the GIL).
def _begin(copies, touched, number):
    """Copy `number` begun (`HashShard.copies`), then `touched` emptied."""
    begun = tf.raw_ops.ResourceScatterUpdate(resource=copies.handle, indices=tf.constant([0]),
                                             updates=tf.reshape(number, [1]))
    with tf.control_dependencies([begun]):
        keys, _ = touched.export()
    touched.remove(tf.reshape(keys, [-1]))  # run: a stateful op of the function


def _end(copies, number):
    """Copy `number` ended: the highest number ended raised to it (an end of an earlier copy that
    reaches the ps late leaves a later copy under way)."""
    tf.raw_ops.ResourceScatterMax(resource=copies.handle, indices=tf.constant([1]), updates=tf.reshape(number, [1]))


# Made anew (`renew`) should a trace's registration never reach a task (`until_registered`'s `remake`).
_begin = Renewable(_begin, autograph=False)
_end = Renewable(_end, autograph=False)


def _forget_cut(shard: Any) -> None:
    """The shard's cut traced anew at its next use: its trace's registration never reached a task."""
    shard.hash_cut = None


def _cut_function(shard: Any):
    """The traced cut of the shard (made once per version of its tables, kept on the shard)."""
    traced = getattr(shard, "hash_cut", None)
    if traced is None or traced[0] is not shard.version:
        def read_again():
            keys, _ = shard.touched.export()
            keys = tf.reshape(keys, [-1])
            counters = tf.reshape(tf.raw_ops.LookupTableFindV2(
                table_handle=shard.counters.resource_handle, keys=keys,
                default_value=tf.constant([0, _NO_STEP], tf.int64)), [-1, 2])
            no_row = tf.fill([shard.dim], tf.bitcast(tf.constant(_NO_ROW_BITS, tf.int32), tf.float32))
            rows = tf.reshape(tf.raw_ops.LookupTableFindV2(
                table_handle=shard.values.resource_handle, keys=keys, default_value=no_row), [-1, shard.dim])
            slots = [tf.reshape(shard.slots[name].lookup(keys), [-1, shard.dim]) for name in sorted(shard.slots)]
            tracked = counters[:, 1] != _NO_STEP
            has_row = tf.bitcast(rows[:, 0], tf.int32) != _NO_ROW_BITS
            return [keys, counters, rows, slots, tracked, has_row, shard.clock.read_value(),
                    shard.admissions.read_value(), shard.evictions.read_value(), tf.size(keys, out_type=tf.int64)]

        traced = shard.hash_cut = (shard.version, made_per_object(tf.function(read_again, autograph=False)))
    return traced[1]


@tf.function(autograph=False, reduce_retracing=True)
def _positions(counter_keys, row_keys, touched, tracked, has_row):
    """Where each entry goes in the merged fields: ((export's positions, the cut's, size) for the
    counters' fields, the same for the rows'). An export's entries of touched keys, and the cut's of
    keys without a counter (or a row), go to position `size`, one past the end (`_stitch` drops it)."""
    touched = tf.reshape(touched, [-1])

    def plan(keys, present):
        keys = tf.reshape(keys, [-1])
        _, kept = tf.raw_ops.ListDiff(x=keys, y=touched, out_idx=tf.int32)
        is_kept = tf.scatter_nd(tf.reshape(kept, [-1, 1]), tf.ones_like(kept), tf.shape(keys, out_type=tf.int32)) > 0
        count = tf.size(kept)
        size = count + tf.reduce_sum(tf.cast(present, tf.int32))
        exported = tf.where(is_kept, tf.cumsum(tf.cast(is_kept, tf.int32)) - 1, size)
        at_cut = tf.where(present, count + tf.cumsum(tf.cast(present, tf.int32)) - 1, size)
        return exported, at_cut, size

    return plan(counter_keys, tracked), plan(row_keys, has_row)


@tf.function(autograph=False, reduce_retracing=True)
def _stitch(exported, at_cut, to_exported, to_cut, size):
    """One merged field: the export's and the cut's entries put where `_positions` says, in one new
    buffer of exactly `size` entries (`DynamicStitch`). The entries dropped (position `size`) go to
    position 0 instead, and the entry that belongs there is put there again after them (a later list
    wins a position): no longer result is cut to `size`, which TF would copy where an entry is not a
    multiple of 64 bytes (a key, a counter, an 8-wide row)."""
    def merged():
        zero = tf.zeros([1], to_exported.dtype)
        first = tf.concat([tf.gather(exported, tf.reshape(tf.where(tf.equal(to_exported, 0)), [-1])),
                           tf.gather(at_cut, tf.reshape(tf.where(tf.equal(to_cut, 0)), [-1]))], 0)
        return tf.raw_ops.DynamicStitch(
            indices=[tf.where(tf.equal(to_exported, size), zero, to_exported),
                     tf.where(tf.equal(to_cut, size), zero, to_cut), zero],
            data=[exported, at_cut, first])

    def nothing():
        return tf.zeros(tf.concat([[0], tf.shape(exported)[1:]], 0), exported.dtype)

    return tf.cond(size > 0, merged, nothing)
