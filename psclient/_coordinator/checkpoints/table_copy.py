"""Bounded dynamic tables' shards copied before a checkpoint's cut and packed after it.

A bounded DynamicEmbedding shard (`tables.dense_shard`) keeps its rows and
optimizer slots in variables of `share` rows, some of them free, with each
row's key (`row_key`) and last step (`last`: -1 for a free row); a checkpoint
saves only the rows that hold a key, packed in their rows' order, with the
keys and counters. Packed in the cut (a scan of `last`, a gather of every
held row, slot and key), the pause grew with the table: 0.11 s for 1.8
million 32-wide rows with Adagrad on each of 2 ps. A shard above one
checkpoint row chunk, in a strategy whose checkpoints copy before the cut,
has write marks on its rows, slots, `row_key` and `last`
(`psclient._tf.write_marks`; a training step writes them only through the
variables' own methods, in `fused_admission` and `free_rows`). Then, as for
big variables (`fuzzy_copy`):

1. `copy_shards`, before dispatch pauses: the marks are cleared and each of
   those variables is copied into a stage of its shape, a chunk at a time,
   while training goes on.
2. `cut`, in the cut: one call per shard reads again the rows marked since
   into the stages (or copies a variable whole where it was written whole
   since, which training never does), and exports what is not staged: the
   keys still counting towards admission (none with `min_frequency=1`), the
   clock and the counts. Scanning the marks (one byte a row a variable) is
   what still grows with the table.
3. `Packed`, in the background write: one call on the ps finds the held rows
   in the staged `last`, gathers their keys and steps (the counters built
   from them: `saved_rows.keys_and_counters`), and packs each rows or slot
   stage by them in place, a chunk at a time (row j takes row held[j] >= j,
   so a chunk never reads a row an earlier chunk wrote), saved as its first
   rows, read sharing the stage's buffer. TF shares a matrix's first rows
   only where a row is a multiple of 64 bytes (32-wide float32), a vector's
   first entries wherever they end on such a multiple: so a stage with other
   rows (8-wide) is saved as two slices of its key (`Split`), its first rows
   up to such an end through its flat vector, and the few after them copied.
   (Read as a matrix's first rows, 8-wide rows were a copy beside the stages:
   2.52x a table's storage at a save's peak; gathered into a buffer of their
   own, 2.09-2.13x; `docs/dynamic_embeddings.md`.) The keys and steps are
   gathered (16 bytes a row), their stages emptied at once.

A restore or import into the shard (`shard_restore.run`, unmarked writes)
after its copy makes the copy stale (`DenseShard.restores`): the cut then
saves that shard as before, packed there. Memory on a ps: one stage per
copied variable (the rows and slots packed in the cut took as much before),
16 bytes a row for the keys' stages, and while packing the held rows' indices
(8 bytes each), keys (8) and counters (16), and one chunk in flight. A copy that fails empties the stages it made
(`stages.emptied_on_failure`), and the cut's first call at the copy is made
again alone when it overtakes its registration: the whole copy made again had
left the first one's stages whole on the ps for the run (3.26x at a save).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from psclient._coordinator.checkpoints import checkpoint_pieces as _pieces
from psclient._coordinator.checkpoints import stages as _stages
from psclient._coordinator.tables.saved_rows import keys_and_counters
from psclient._tf import write_marks as _write_marks
from psclient._tf.registrations import until_registered
from psclient._tf.functions import made_per_object, traced_per_signature

__all__ = ["Later", "Packed", "Split", "TableCopy", "as_slices", "copy_shards", "cut", "joined", "resolved", "stage_bytes"]

#: The packing's chunk (`_pack`): what the write holds beside the stages, one chunk at a time.
PACK_CHUNK_BYTES = 1 << 20


class TableCopy:
    """One shard's stages (`_storage`'s order), copied before the cut."""

    __slots__ = ("shard", "version", "restores", "stages")

    def __init__(self, shard: Any, stages: list):
        self.shard, self.stages = shard, stages
        self.version, self.restores = shard.version, shard.restores

    def current(self) -> bool:
        """Whether the shard still has the storage copied, written only through marked methods since."""
        return self.shard.version is self.version and self.shard.restores == self.restores

    @property
    def nbytes(self) -> int:
        return stage_bytes(self)

    def release(self) -> None:
        """After the write, on the shard's ps: each stage given an empty value (`stages.empty`)."""
        for stage in self.stages:
            _stages.empty(stage)


class Packed:
    """A copied shard's keys, counters, row keys, rows and slots, packed from its stages in the
    checkpoint's write (`result`: one call on its ps, run under its device)."""

    __slots__ = ("copy", "waiting_keys", "waiting", "_out")

    def __init__(self, copy: TableCopy, waiting_keys: Any, waiting: Any):
        self.copy, self.waiting_keys, self.waiting, self._out = copy, waiting_keys, waiting, None

    def result(self) -> list:
        if self._out is None:
            shard, stages = self.copy.shard, self.copy.stages
            keys, counters, row_keys, values = _pack(stages[:-2], stages[-2], stages[-1], self.waiting_keys,
                                                     self.waiting, shard.policy.min_frequency, _chunk(shard))
            self._out = [keys, counters, row_keys, *(Split(*v) if isinstance(v, (tuple, list)) else v for v in values)]
        return self._out


class Split:
    """A packed field in two pieces (`_split_rows`): its first rows, sharing its stage's buffer, and
    the few rows after them; written as two slices of its key (`as_slices`), read back as one."""

    __slots__ = ("first", "rest")

    def __init__(self, first: Any, rest: Any):
        self.first, self.rest = first, rest

    @property
    def shape(self) -> tf.TensorShape:
        return tf.TensorShape([int(self.first.shape[0]) + int(self.rest.shape[0])] + self.first.shape.as_list()[1:])

    @property
    def dtype(self) -> tf.DType:
        return self.first.dtype

    def joined(self) -> Any:
        """The field as one tensor (a copy), on the device in force."""
        return tf.concat([self.first, self.rest], _pieces.coordinator_constant(0, tf.int32))


def joined(value: Any) -> Any:
    """`value`, or the one tensor a `Split` makes (a copy, on the device in force)."""
    return value.joined() if isinstance(value, Split) else value


def resolved(values: list, split: bool = False) -> list:
    """`values` with each `Later` one made (packed, merged) now: on its ps, under its device; a field
    packed in two pieces joined into one tensor (a copy), unless `split` (then a `Split`)."""
    out = [value.value() if isinstance(value, Later) else value for value in values]
    return out if split else [joined(value) for value in out]


def as_slices(names: list[str], specs: list[str], values: list) -> tuple[list, list, list]:
    """(names, specs, values) with each `Split` (saved whole: spec "") as two slices of its key, or as
    its one piece that has rows (its pieces are 0 rows: the first one)."""
    out_names, out_specs, out_values = [], [], []
    for name, spec, value in zip(names, specs, values):
        if not isinstance(value, Split):
            out_names.append(name), out_specs.append(spec), out_values.append(value)
            continue
        assert spec == "", (name, spec)  # a table's field is saved whole
        full = value.shape.as_list()
        first, rest = int(value.first.shape[0]), int(value.rest.shape[0])
        if not (first and rest):
            out_names.append(name), out_specs.append(""), out_values.append(value.rest if rest else value.first)
            continue
        out_names += [name, name]
        out_specs += [_pieces.rows_spec(full, 0, first), _pieces.rows_spec(full, first, rest)]
        out_values += [value.first, value.rest]
    return out_names, out_specs, out_values


class Later:
    """One saved value of a `Packed` shard: `value()` in the write (made once, then the same tensor)."""

    __slots__ = ("packed", "index")

    def __init__(self, packed: Packed, index: int):
        self.packed, self.index = packed, index

    def value(self) -> Any:
        return self.packed.result()[self.index]


def _storage(shard: Any) -> list:
    """What a copy stages, in this order: the shard's rows, its slots by name, `row_key`, `last`."""
    return [shard.rows] + [shard.slots[name] for name in sorted(shard.slots)] + [shard.row_key, shard.last]


def _shapes(shard: Any) -> list[list[int]]:
    return [[shard.share, shard.dim]] * (1 + len(shard.slots)) + [[shard.share]] * 2


def _copyable(shard: Any) -> bool:
    return shard.dense and shard.marked and not shard.fresh and \
        all(_write_marks.marks_of(v) is not None for v in _storage(shard))


def stage_bytes(copy: TableCopy) -> int:
    return sum(int(stage.shape.num_elements()) * stage.dtype.size for stage in copy.stages)


def copy_shards(shards: list, stop: Callable[[], bool] | None = None) -> dict[int, TableCopy]:
    """On the ps in force, training going on: id(shard) -> its copy, for each of `shards` (that ps's)
    with write marks, written since made, not written whole since its marks were last cleared and of
    its share's shape. Every such shard's marks are cleared first. `stop`: as `stages.copy_in_chunks`'."""
    shards = [shard for shard in shards if _copyable(shard)]
    if not shards:
        return {}
    checks = iter(tf.stack([_written_whole_and_size(_write_marks.marks_of(variable).whole, variable)
                            for shard in shards for variable in _storage(shard)]).numpy().tolist())
    out = {}
    with _stages.emptied_on_failure() as made:
        for shard in shards:
            variables, shapes = _storage(shard), _shapes(shard)
            found = [next(checks) for _ in variables]
            for variable in variables:
                _write_marks.marks_of(variable).reset()
            if any(whole or size != int(np.prod(shape)) for (whole, size), shape in zip(found, shapes)):
                continue  # written whole (a repack), or not at its share: saved in the cut as before
            stages = []
            for variable, shape in zip(variables, shapes):
                stage = _stages.new_stage(shape, variable.dtype)
                made.append(stage)
                chunk = _pieces.chunk_rows(shape, variable.dtype, aligned=False) or shape[0]
                _stages.copy_in_chunks(variable, stage, shape[0], chunk, stop)
                stages.append(stage)
            copy = out[id(shard)] = TableCopy(shard, stages)
            # Traced now, not in the cut or the write (a trace registers a function on every task); the
            # cut's also called once, so that the ps makes it now, not in the first cut. (Harmless: it
            # reads again into the stages the rows marked since the copy, as the cut will.) The call can
            # overtake the registration: called again then, not the whole copy made again.
            until_registered(lambda: _cut_function(shard)(copy.stages),  # noqa: B023 - called here
                             remake=lambda: _forget_cut(shard))  # noqa: B023 - called here
            _pack.get_concrete_function(stages[:-2], stages[-2], stages[-1], tf.TensorSpec([None], tf.int64),
                                        tf.TensorSpec([None, 2], tf.int64), shard.policy.min_frequency,
                                        _chunk(shard))
    return out


def _written_whole_and_size(whole, variable):
    """int64 [the variable's `whole` mark, its number of elements] (VariableShape: not a read, no copy)."""
    size = tf.reduce_prod(tf.raw_ops.VariableShape(input=variable.handle, out_type=tf.int64))
    return tf.stack([tf.cast(whole.read_value(), tf.int64), size])


# Traced: nothing converted under the ps's device. Once per kind of storage variable and cluster.
_written_whole_and_size = traced_per_signature(tf.function(_written_whole_and_size, autograph=False,
                                                           reduce_retracing=True))


def _chunk(shard: Any) -> int:
    """Rows a chunk of the packing moves: 1 MiB of a shard's rows (a write's chunk in flight)."""
    return _pieces.chunk_rows([shard.share, shard.dim], tf.float32, PACK_CHUNK_BYTES, aligned=False) or shard.share


def cut(copy: TableCopy) -> tuple[list, Any]:
    """In the cut, on the shard's ps: (the shard's saved values in the checkpoint's order, those packed
    in the write `Later`; the count of rows read again, a tensor on the ps)."""
    waiting_keys, waiting, clock, admissions, evictions, count = _cut_function(copy.shard)(copy.stages)
    packed = Packed(copy, waiting_keys, waiting)
    keys, counters, row_keys, rows, *slots = [Later(packed, i) for i in range(4 + len(copy.stages) - 3)]
    return [keys, counters, row_keys, rows, clock, admissions, evictions, *slots], count


def _forget_cut(shard: Any) -> None:
    """The shard's cut traced anew at its next use: its trace's registration never reached a task."""
    shard.copy_cut = None


def _cut_function(shard: Any):
    """The traced cut of the shard's copy (made once per storage version, kept on the shard as its
    per-ps save is: `ps_saves`)."""
    traced = getattr(shard, "copy_cut", None)
    if traced is None or traced[0] is not shard.version:
        def staged(stages):
            counts = [_read_again(variable, stage) for variable, stage in zip(_storage(shard), stages)]
            waiting_keys, waiting = shard.pending.export()  # keys still counting towards admission
            return [tf.reshape(waiting_keys, [-1]), tf.reshape(waiting, [-1, 2]), shard.clock.read_value(),
                    shard.admissions.read_value(), shard.evictions.read_value(), tf.add_n(counts)]

        traced = shard.copy_cut = (shard.version, made_per_object(tf.function(staged, autograph=False)))
    return traced[1]


def _read_again(variable: Any, stage: Any) -> Any:
    """In the cut's trace: `stage` made equal to `variable`, by its rows marked since the copy (their
    count), or whole where the variable was written whole since (0)."""
    marks = _write_marks.marks_of(variable)

    def patched():
        indices = tf.reshape(tf.where(marks.rows.read_value() > 0), [-1])
        with tf.control_dependencies([_stages.move_rows(variable, stage, indices)]):
            return tf.size(indices, out_type=tf.int64)

    def whole():
        copied = tf.raw_ops.AssignVariableOp(resource=stage.handle, value=variable.read_value(), validate_shape=False)
        with tf.control_dependencies([copied]):
            return tf.constant(0, tf.int64)

    return tf.cond(marks.whole.read_value() > 0, whole, patched)


@tf.function(autograph=False)
def _pack(float_stages, row_key, last, waiting_keys, waiting, min_frequency: int, chunk: int):
    """From a copied shard's stages (the cut's state): its saved (keys, counters, row_keys, [rows and
    slots]), as `DenseShard.saved` gives them, each the size of what is saved.

    Each rows or slot stage is packed in place (`_compact`), a chunk at a time, and saved as its first
    rows, which must then be read sharing its buffer. TF's Slice shares a matrix's first rows only
    where a row is a multiple of 64 bytes (`ROW_ALIGN_BYTES`: a 32-wide float32 row; an 8-wide one
    would be copied, a second table beside the stages: 2.52x a table's storage at a save's peak),
    but a vector's first entries wherever they end on such a multiple. So a stage with other rows
    gives two pieces (`_split_rows`): its first rows up to such an end, read through its flat
    vector (sharing the buffer), and the few rows after them (fewer than 64 bytes' worth of rows:
    copied), saved as two slices of one key (`Split`). The row keys and steps are gathered (16 bytes
    a row), their stages emptied at once."""
    tf.raw_ops.DisableCopyOnRead(resource=last.handle)  # read sharing its buffer for the scan below
    held = tf.reshape(tf.where(tf.reshape(last.read_value(), [-1]) >= 0), [-1])
    row_keys = _gathered(row_key, held, [])
    held_last = _gathered(last, held, [row_keys])
    keys, counters = keys_and_counters(row_keys, held_last, waiting_keys, waiting, min_frequency)
    values, after = [], [keys, counters]
    for stage in float_stages:  # one after another: one chunk in flight
        with tf.control_dependencies(after):
            value = _compact(stage, held, chunk)
        count = tf.size(held, out_type=tf.int64)
        values.append(_first_rows(value, count) if _aligned(stage) else _split_rows(value, count, stage.shape))
        after = tf.nest.flatten(values[-1])
    return keys, counters, row_keys, values


def _row_bytes(shape, dtype) -> int:
    return int(np.prod(shape[1:])) * dtype.size


def _aligned(stage) -> bool:
    return stage.shape.rank >= 2 and _row_bytes(stage.shape, stage.dtype) % _pieces.ROW_ALIGN_BYTES == 0


def _first_rows(value, count):
    """In `_pack`'s trace: `value`'s first `count` rows (sharing its buffer: rows of 64 bytes)."""
    rank = tf.rank(value)
    return tf.slice(value, tf.zeros([rank], tf.int64), tf.concat([tf.reshape(count, [1]), -tf.ones([rank - 1], tf.int64)], 0))


def _split_rows(value, count, shape) -> tuple:
    """In `_pack`'s trace: (first, rest) of `value`'s first `count` rows (a packed stage read sharing
    its buffer): `first` its rows up to the last whose end is a multiple of `ROW_ALIGN_BYTES`, taken
    as a slice of the flat vector (which TF shares: a matrix's slice it would copy), `rest` the rows
    after them (copied: fewer than `ROW_ALIGN_BYTES` bytes' worth of rows)."""
    row_bytes = _row_bytes(shape, value.dtype)
    multiple = _pieces.ROW_ALIGN_BYTES // math.gcd(row_bytes, _pieces.ROW_ALIGN_BYTES)  # rows a piece ends on
    width = row_bytes // value.dtype.size
    first = count - count % multiple
    flat = tf.reshape(value, [-1])
    row_shape = shape.as_list()[1:]
    return (tf.reshape(tf.slice(flat, tf.zeros([1], tf.int64), tf.reshape(first * width, [1])), [-1] + row_shape),
            tf.reshape(tf.slice(flat, tf.reshape(first * width, [1]), tf.reshape((count - first) * width, [1])),
                       [-1] + row_shape))


def _gathered(stage, held, after: list):
    """In `_pack`'s trace: `stage`'s rows `held` in a new buffer (after `after`), the stage then
    emptied (its buffer goes: nothing else reads it)."""
    with tf.control_dependencies(after):
        taken = tf.raw_ops.ResourceGather(resource=stage.handle, indices=held, dtype=stage.dtype)
    # [0, ...], its first dimension unknown to the trace: the graph checks an assigned value's known
    # shape against the stage's (the eager `stages.empty` is not checked).
    none = tf.size(held, out_type=tf.int32) * 0
    empty_shape = tf.stack([none] + stage.shape.as_list()[1:])
    with tf.control_dependencies([taken]):
        emptied = tf.raw_ops.AssignVariableOp(resource=stage.handle, validate_shape=False,
                                              value=tf.raw_ops.Empty(shape=empty_shape, dtype=stage.dtype))
    with tf.control_dependencies([emptied]):
        return tf.identity(taken)


def _compact(stage, held, chunk: int):
    """In `_pack`'s trace: `stage`'s rows `held` (ascending) moved to its first rows in place, `chunk`
    rows at a time (row j takes row held[j] >= j: no chunk reads a row an earlier one wrote); the
    stage then read whole, sharing its buffer (nothing writes it afterwards: `Prepared.release`
    empties it)."""
    count = tf.size(held, out_type=tf.int64)
    step = tf.constant(chunk, tf.int64)

    def move(start):
        stop = tf.minimum(start + step, count)
        taken = tf.slice(held, tf.reshape(start, [1]), tf.reshape(stop - start, [1]))
        moved = tf.raw_ops.ResourceScatterUpdate(
            resource=stage.handle, indices=tf.range(start, stop),
            updates=tf.raw_ops.ResourceGather(resource=stage.handle, indices=taken, dtype=stage.dtype))
        with tf.control_dependencies([moved]):
            return tf.identity(stop)

    done = tf.while_loop(lambda start: start < count, move, [tf.constant(0, tf.int64)], parallel_iterations=1)
    with tf.control_dependencies([done]):
        tf.raw_ops.DisableCopyOnRead(resource=stage.handle)  # the scatters set copy-on-read: read shares now
    return stage.read_value()
