"""A dense table shard restored in row ranges, written in place: a ps holds about one range beyond it.

Restored whole (`table_checkpoint`'s other path), a shard's saved state
(keys, counters, rows, every slot) is read at once and the grown arrays the
shard's variables get are built from it before they are assigned: the ps
then holds the shard two to three times. Here, for a restore into as many
ps tasks as saved it (each shard reads its own saved shard) of a shard in
dense storage (`DenseShard`) whose rows and slots hold more than one range
(a smaller one, `fits_one_range`, is restored whole: three calls on its ps
instead of 18, which cost 26 small tables over 1 s a restore):

- the keys, counters, the keys that have a row and the clocks are read whole
  (8 to 16 bytes a key), the keys with a row first, then the others, and the
  shard takes them (`DenseShard.replace_row_keys`, `replace_counters`: key
  index, free rows, counters; its row and slot variables keep their buffers,
  of the share's shape);
- the rows and each slot are read a range of rows at a time (RestoreV2 of a
  slice: `checkpoint_pieces.rows_spec`) and each range is assigned into
  its rows of the variable on the ps (a sliced assign), then the rows past
  the restored ones get their initial value, a range at a time.

Restored into another number of ps tasks (`SplitPlan`), a dense shard bigger
than one range reads every saved shard the same way, one at a time: its keys
with a row whole (the owned ones kept, with their positions as int32, and a
sample of them), then its tracked keys, then its counters, each whole (the
owned ones kept, those with a row first when the sample says they were saved
so), then, field by field, its rows and slots a range at a time,
each range's owned rows gathered and written in place after those of the
saved shards before it: where the whole path (`table_checkpoint._restored_state`
then `DenseShard.replace`) puts them. A shard that would get more rows than its
share (the whole path evicts down to it) or a restore with deltas goes the
whole way.

A range is the checkpoint's own row chunk (`checkpoint_pieces.save_chunked`:
a range then reads at its own cost) or smaller (`range_bytes`); a value saved
whole (rows of a width not a multiple of 64 bytes, or at most one chunk) is
one range, unless `range_bytes` asks for smaller ones (each of which then
reads the whole saved value: a range reads every saved slice it overlaps).

The check (`check`) reads the same values, the keys' and clocks' one at a
time, the ranges as the restore reads them, and drops each at once, before any
shard is assigned (`table_checkpoint.read`): a damaged value leaves every
table as it was. A restore with deltas (`table_deltas.Changes`) writes the
saved rows each delta left alone, a range at a time (each range read whole, its
kept rows gathered), then each delta's changed rows, the tracked keys merged
whole as the whole path merges them (`table_deltas.merge`): the rows land where
the whole path puts them. A delta that holds other slots than the checkpoint
sends the shard to the whole path (`table_checkpoint.assign`).
Every op here runs on the shard's ps with its Python values made on the coordinator
(`coordinator_constant`) or traced: nothing is converted there (tests/_conversions.py).
"""

from __future__ import annotations

import functools

import tensorflow as tf

from psclient._coordinator.checkpoints.checkpoint_pieces import (
    READ_BATCH_BYTES,
    assign_rows,
    chunk_bytes,
    chunk_rows,
    chunked_keys,
    coordinator_constant,
    rows_spec,
)
from psclient._coordinator.checkpoints.table_deltas import merge
from psclient._tf import checkpoints as _checkpoints
from psclient._tf import write_marks as _write_marks

__all__ = ["Plan", "SMALL_FIELDS", "SplitPlan", "fits_one_range"]

#: The fields read whole (the keys' and the clocks'), in `table_checkpoint._FIELDS`'s order.
SMALL_FIELDS = ("keys", "counters", "row_keys", "clock", "admissions", "evictions")
#: A shard's scalars, which a delta holds whole.
_SCALARS = SMALL_FIELDS[3:]
#: The tracked keys' fields and the scalars, of a saved shard and of a delta (`_merged_counters`).
_COUNTED_FIELDS = ("keys", "counters", *_SCALARS)
_DELTA_COUNTED_FIELDS = ("keys", "counters", "removed", *_SCALARS)


def fits_one_range(share: int, dim: int, slots, range_bytes: int | None = None) -> bool:
    """Whether a dense shard's rows and `slots` at its `share` hold at most one range's bytes
    (`range_bytes`, else `READ_BATCH_BYTES`): such a shard is restored whole (`table_checkpoint`),
    in three calls on its ps (one to check, two to write) instead of 18 for rows and one slot, at a
    cost beyond its tables bounded by the range size (about twice: its saved state and the grown
    arrays built from it), not by the table."""
    limit = READ_BATCH_BYTES if range_bytes is None else range_bytes
    return share * dim * 4 * (1 + len(slots)) <= limit


class Plan:
    """How saved shard `part` of table `key` (`slots`: its saved slots) is read in ranges from `path`.

    `layout`: the checkpoint's (`row_chunks` says which values were saved in row
    chunks, and their size). `range_bytes`: at most this many bytes a range
    (None: the checkpoint's chunks; a value saved whole is then one range).
    """

    def __init__(self, path: str, key: str, part: int, slots: list[str], dim: int, layout: dict | None,
                 range_bytes: int | None = None):
        if range_bytes is not None and range_bytes < 1:
            raise ValueError(f"Invalid value for argument `range_bytes`. Received: range_bytes={range_bytes}. "
                             "Expected a positive number of bytes, or None (the checkpoint's row chunks).")
        self.path, self.dim, self.range_bytes = path, dim, range_bytes
        self.prefix = f"{key}/ps{part}"
        #: field ("rows" or a slot's name) -> its key in the checkpoint
        self.fields = {"rows": f"{self.prefix}/rows", **{s: f"{self.prefix}/slot/{s}" for s in slots}}
        self._chunked, self._chunk_bytes = chunked_keys(layout), chunk_bytes(layout)

    def check_small(self, row_keys_seen=None) -> int:
        """Read the keys, counters, keys with a row and the clocks on the device in force, one at a
        time, each dropped at once (read together, with `SplitPlan`'s hashing of the keys with a row
        beside them, they made a ps's peak of a re-split restore): raises tf.errors.OpError if one
        cannot be read. `row_keys_seen(row_keys)` is called with the keys with a row before they
        are dropped. Returns the rows saved."""
        count = 0
        for field in SMALL_FIELDS:
            value = self._read([f"{self.prefix}/{field}"])[0]
            if field == "row_keys":
                count = int(value.shape[0])
                if row_keys_seen is not None:
                    row_keys_seen(value)
            del value
        return count

    def _read(self, names: list[str]) -> list:
        """Int64 values `names`, read whole on the device in force."""
        return _checkpoints.restore(self.path, names, [""] * len(names), [tf.int64] * len(names))

    def ranges(self, field: str, count: int) -> list[tuple[int, int]]:
        """[start, stop) of each range `field`'s `count` saved rows are read in."""
        row_bytes = 4 * self.dim
        rows = count or 1
        if self.fields[field] in self._chunked:
            rows = chunk_rows([count, self.dim], tf.float32, self._chunk_bytes) or count or 1
        if self.range_bytes is not None:
            rows = min(rows, max(1, self.range_bytes // row_bytes))
        return [(start, min(count, start + rows)) for start in range(0, count, rows)]

    def read_range(self, field: str, count: int, start: int, stop: int):
        """Rows [start, stop) of `field` (saved with `count` rows), read on the device in force.
        A saved value of another row count fails (RestoreV2 checks the spec's full shape)."""
        spec = rows_spec([count, self.dim], start, stop - start)
        return _checkpoints.restore(self.path, [self.fields[field]], [spec], [tf.float32])[0]

    def check(self) -> int:
        """Read every value (the rows and slots a range at a time), each dropped at once: raises
        tf.errors.OpError if one cannot be read. Returns the rows saved."""
        count = self.check_small()
        self.check_ranges(count)
        return count

    def check_ranges(self, count: int) -> None:
        """Read the rows and slots (saved with `count` rows) a range at a time, each dropped at once."""
        for field in self.fields:
            for start, stop in self.ranges(field, count):
                self.read_range(field, count, start, stop)  # dropped at once: only whether it reads counts

    def assign(self, shard, deltas: list | tuple = ()) -> int | None:
        """Read the shard's saved state again and write it into `shard` (a DenseShard), under its
        device: the rows and slots a range at a time, in place, then each of `deltas`' changed rows
        (`table_deltas.Changes`, in order). None (nothing written): more rows than the shard's share
        holds, or a delta that holds other slots than the checkpoint (the caller restores it whole,
        applying the deltas there). Returns the rows."""
        saved_slots = sorted(f for f in self.fields if f != "rows")
        if any(sorted(d.slots) != saved_slots for d in deltas):
            return None
        row_keys = self._read([f"{self.prefix}/row_keys"])[0]
        count = int(row_keys.shape[0])
        # origin[i]: where row i's values come from: saved row origin[i] (< count), else changed row
        # origin[i] - bases[j] of delta j (bases[j] <= origin[i] < bases[j + 1]); ascending (`_with_deltas`).
        row_keys, origin, bases = _with_deltas(row_keys, count, deltas)
        n, variables = int(row_keys.shape[0]), _rows_keyed(shard, row_keys, self.dim)
        if variables is None:
            return None
        del row_keys  # before the counters are read: a ps holds one of them at a time
        # The tracked keys merged whole with each delta's, as the whole path does (8 to 16 bytes a key).
        small = dict(zip(_COUNTED_FIELDS, _merged_counters(
            coordinator_constant(self.path, tf.string),
            coordinator_constant([f"{self.prefix}/{f}" for f in _COUNTED_FIELDS], tf.string),
            [coordinator_constant(delta.delta, tf.string) for delta in deltas],
            [coordinator_constant(delta.names(_DELTA_COUNTED_FIELDS), tf.string) for delta in deltas])))
        shard.replace_counters(small["keys"], small["counters"], coordinator_constant(n, tf.int64),
                               small["clock"], small["admissions"], small["evictions"])
        del small
        defaults = {"rows": 0.0, **shard.slot_defaults}
        for field, variable in variables.items():
            saved = self.ranges(field, count) if field in self.fields else []
            cuts = _positions(origin, [start for start, _ in saved] + [count]) if saved else []
            for (start, stop), at, end in zip(saved, cuts, cuts[1:]):
                value = self.read_range(field, count, start, stop)
                if end - at != stop - start:  # some of these rows changed or left in a delta: the others
                    value = _gather(value, origin, at, end, start)
                if end > at:
                    assign_rows(variable, at, end, value)
                del value
            if field in self.fields and deltas:
                cuts = _positions(origin, bases)
                name = "rows" if field == "rows" else f"slot/{field}"
                for delta, base, at, end in zip(deltas, bases, cuts, cuts[1:]):
                    if end > at:
                        assign_rows(variable, at, end, _gather(delta.read([name])[name], origin, at, end, base))
            _fill_rest(variable, n if field in self.fields else 0, shard.share, self.dim, defaults[field],
                       self.range_bytes)
        return n


class SplitPlan:
    """Shard `index` of `num_shards` restored from every saved shard of table `key` (`count` of them,
    `slots` their slots) in ranges, from `path`: a restore into another number of ps tasks.

    Each saved shard's keys, counters and keys with a row are read whole (8 to 16
    bytes a key); its rows and slots a range at a time (`Plan`), and of each range
    the rows this shard owns (`shard_of(key, num_shards) == index`, the rule
    `table_checkpoint._restored_state` keeps rows by) are written into its
    variables in place, where the whole path puts them: saved shard by saved
    shard, each in its saved order. `layout`, `range_bytes`: as `Plan`'s.
    """

    def __init__(self, path: str, key: str, count: int, index: int, num_shards: int, slots: list[str], dim: int,
                 layout: dict | None, range_bytes: int | None = None):
        self.parts = [Plan(path, key, part, slots, dim, layout, range_bytes) for part in range(count)]
        self.index, self.num_shards, self.dim, self.range_bytes = index, num_shards, dim, range_bytes
        self.fields = self.parts[0].fields  # the same fields in every saved shard (`fields[...]` is part 0's key)

    def _owned_rows(self, row_keys) -> tuple:
        # The positions as int32 where they fit: they are held through the whole restore.
        dtype = tf.int32 if int(row_keys.shape[0]) < 2**31 else tf.int64
        return _owned_rows(row_keys, coordinator_constant(self.num_shards, tf.int64),
                           coordinator_constant(self.index, tf.int32), dtype)

    def check(self) -> int:
        """Read every saved shard's values (its rows and slots a range at a time), each dropped at once:
        raises tf.errors.OpError if one cannot be read. Returns the rows this shard will hold."""
        owned = []
        for plan in self.parts:
            count = plan.check_small(lambda row_keys: owned.append(int(self._owned_rows(row_keys)[0].shape[0])))
            plan.check_ranges(count)
        return sum(owned)

    def assign(self, shard, deltas: list | tuple = ()) -> int | None:
        """Read the saved shards again and write the rows, slots and keys `shard` (a DenseShard) owns
        of them into it, under its device. None (nothing written): more rows than its share holds
        (the whole path evicts down to it), or `deltas` (the whole path applies them to the merged
        state). Returns the rows."""
        if deltas:
            return None
        # picks[p]: the positions (ascending) of saved shard p's rows this shard owns; one saved shard's
        # keys read at a time, the owned ones kept.
        # samples[p]: a sample of its keys with a row, for the order check of its tracked keys (`_head_size`).
        counts, picks, kept, samples = [], [], [], []
        for plan in self.parts:
            row_keys = plan._read([f"{plan.prefix}/row_keys"])[0]
            counts.append(int(row_keys.shape[0]))
            owned, pick, sample = self._owned_rows(row_keys)
            picks.append(pick)
            kept.append(owned)
            samples.append(sample)
            del row_keys, owned
        kept = _joined(kept)
        n, variables = int(kept.shape[0]), _rows_keyed(shard, kept, self.dim)
        if variables is None:
            return None
        del kept  # before the counters are read: a ps holds one of them at a time
        # Each saved shard's tracked keys read, the owned kept, one saved shard at a time: its keys with
        # a row first (heads), in the rows' order, the others after (tails), so that the shard takes
        # them as it takes its own saved keys (`DenseShard._replace_counters`: no lookup, fewer copies).
        # The keys first, then the counters (twice the keys' bytes), each dropped before the next
        # read: read together, with the keys with a row, they made a ps's peak of the whole restore.
        # Whether they were saved in that order is told from a sample of the keys with a row, not
        # by reading those again beside the keys (with the keys' hashing, that made a ps's peak).
        # (Read and masked in one traced call instead, the keys were still held at the counters'
        # read: 1.23x.)
        where = (coordinator_constant(self.num_shards, tf.int64), coordinator_constant(self.index, tf.int32))
        fields = ("keys", *_SCALARS)
        heads, tails, scalars = [], [], []
        for plan, count, sample in zip(self.parts, counts, samples):
            got = dict(zip(fields, plan._read([f"{plan.prefix}/{f}" for f in fields])))
            split = _head_size(got["keys"], sample, coordinator_constant(count, tf.int64))
            head_keys, tail_keys, mine = _owned_keys(got["keys"], split, *where)
            scalars.append([got[f] for f in _SCALARS])
            del got
            counters = plan._read([f"{plan.prefix}/counters"])[0]
            head_counters, tail_counters = _owned_counters(counters, mine, split)
            heads.append((head_keys, head_counters))
            tails.append((tail_keys, tail_counters))
            del counters, mine
        keys, counters, clock, admissions, evictions = _merged_keys(heads + tails, scalars, where[1])
        del heads, tails
        shard.replace_counters(keys, counters, coordinator_constant(n, tf.int64), clock, admissions, evictions)
        del keys, counters, samples
        defaults = {"rows": 0.0, **shard.slot_defaults}
        for field, variable in variables.items():
            at_row = 0  # where saved shard p's owned rows begin: after those of the shards before it
            for plan, count, pick in zip(self.parts, counts, picks):
                ranges = plan.ranges(field, count) if field in self.fields else []
                cuts = _positions(pick, [start for start, _ in ranges] + [count]) if ranges else []
                for (start, stop), at, end in zip(ranges, cuts, cuts[1:]):
                    if end == at:
                        continue  # none of these rows is this shard's: not read
                    value = plan.read_range(field, count, start, stop)
                    if end - at != stop - start:
                        value = _gather(value, pick, at, end, start)
                    assign_rows(variable, at_row + at, at_row + end, value)
                    del value
                at_row += int(pick.shape[0])
            _fill_rest(variable, n if field in self.fields else 0, shard.share, self.dim, defaults[field],
                       self.range_bytes)
        return n


# Traced, as `DenseShard`'s sections, so that no Python value is converted under the ps's device.
@functools.partial(tf.function, autograph=False, reduce_retracing=True)
def _merged_counters(path, names, delta_paths: list, delta_names: list):
    """(keys, counters, clock, admissions, evictions) of a saved shard (`names`: theirs in checkpoint
    `path`) with each delta's tracked keys merged in turn (`table_deltas.merge`; `delta_names[j]`:
    its `_DELTA_COUNTED_FIELDS` in checkpoint `delta_paths[j]`) and the newest scalars. Read and merged
    in one call: each array is dropped as soon as the next is made from it (made eagerly, the saved
    keys and counters were held through every merge, each merge's beside them: a ps's peak of a
    restore with deltas)."""
    keys, counters, *scalars = tf.raw_ops.RestoreV2(prefix=path, tensor_names=names, shape_and_slices=[""] * 5,
                                                    dtypes=[tf.int64] * 5)
    for delta_path, delta_fields in zip(delta_paths, delta_names):
        got = tf.raw_ops.RestoreV2(prefix=delta_path, tensor_names=delta_fields, shape_and_slices=[""] * 6,
                                   dtypes=[tf.int64] * 6)
        keys, (counters,) = merge(keys, [counters], got[0], [got[1]], got[2])
        scalars = got[3:]
    return (keys, counters, *scalars)


@functools.partial(tf.function, autograph=False, reduce_retracing=True)
def _owned_rows(row_keys, num_shards, index, dtype):
    """(the keys with a row of one saved shard that shard `index` of `num_shards` owns, their
    positions in it, ascending, as `dtype`; a sample of `row_keys`, `_row_sample`)."""
    from psclient._coordinator.tables.key_hash import shard_of  # tables imports this module

    pick = tf.cast(tf.reshape(tf.where(tf.equal(shard_of(row_keys, num_shards), index)), [-1]), dtype)
    return tf.gather(row_keys, pick), pick, _row_sample(row_keys)


def _row_sample(row_keys):
    """About 1,024 of `row_keys`, evenly spaced, and the last one (in a traced function)."""
    stride = tf.maximum(tf.size(row_keys) // 1024, 1)
    return tf.concat([row_keys[::stride], row_keys[-1:]], 0)


@functools.partial(tf.function, autograph=False, reduce_retracing=True)
def _joined(values: list):
    """`values` one after the other (along their first axis)."""
    return tf.concat(values, 0)


@functools.partial(tf.function, autograph=False, reduce_retracing=True)
def _head_size(keys, sample, count):
    """How many of one saved shard's tracked `keys` come first as its `count` keys with a row
    (`sample`: theirs, `_row_sample`): saved as a dense shard saves them (its keys with a row
    first, in their order), `count`; saved in another order (a hash table's), 0.

    Told from the sample, so a guess; any answer is sound: the shard checks the order of the keys
    it is given against its keys with a row and looks each key up where they differ
    (`DenseShard._replace_counters`)."""
    def sampled_alike():
        return tf.reduce_all(tf.equal(_row_sample(keys[:count]), sample))

    in_order = tf.cond(tf.size(keys, tf.int64) >= count, sampled_alike, lambda: tf.constant(False))
    return tf.where(in_order, count, 0)


@functools.partial(tf.function, autograph=False, reduce_retracing=True)
def _owned_keys(keys, split, num_shards, index):
    """(head keys, tail keys, owned): the tracked keys of one saved shard that shard `index` of
    `num_shards` owns, those with a row in the head (`keys[:split]`, `_head_size`), the others in
    the tail. `owned`: which of `keys` are the shard's, for `_owned_counters`."""
    from psclient._coordinator.tables.key_hash import shard_of  # tables imports this module

    owned = tf.equal(shard_of(keys, num_shards), index)
    return tf.boolean_mask(keys[:split], owned[:split]), tf.boolean_mask(keys[split:], owned[split:]), owned


@functools.partial(tf.function, autograph=False, reduce_retracing=True)
def _owned_counters(counters, owned, split):
    """(head counters, tail counters): the counters of the keys `_owned_keys` kept, split as it split them."""
    counters = tf.reshape(counters, [-1, 2])
    return tf.boolean_mask(counters[:split], owned[:split]), tf.boolean_mask(counters[split:], owned[split:])


@functools.partial(tf.function, autograph=False, reduce_retracing=True)
def _merged_keys(pieces: list, scalars: list, index):
    """(keys, counters, clock, admissions, evictions) of the shard: the owned keys' `pieces` ((keys,
    counters) each) in turn; the largest saved clock, the admissions and evictions summed on shard 0
    (0 elsewhere), as `table_checkpoint._restored_state` gives them. `scalars`: per saved shard, its
    (clock, admissions, evictions)."""
    clocks, admissions, evictions = zip(*scalars)
    first, zero = tf.equal(index, 0), tf.constant(0, tf.int64)
    return (tf.concat([keys for keys, _ in pieces], 0), tf.concat([counters for _, counters in pieces], 0),
            tf.reduce_max(tf.stack(clocks)), tf.where(first, tf.add_n(admissions), zero),
            tf.where(first, tf.add_n(evictions), zero))


def _fill_rest(variable, start: int, share: int, dim: int, value: float, range_bytes: int | None) -> None:
    """Rows [start, share) of `variable` (the rows past the restored ones, or every row of a slot not in
    the checkpoint: free rows) set to `value`, as the whole path sets them, a range at a time; then
    the variable out of copy-on-read mode (`assign_rows`)."""
    step = max(1, (range_bytes or READ_BATCH_BYTES) // (4 * dim))
    for at in range(start, share, step):
        stop = min(share, at + step)
        assign_rows(variable, at, stop, _filled(stop - at, dim, value))
    tf.raw_ops.DisableCopyOnRead(resource=variable.handle)


def _with_deltas(row_keys, count: int, deltas) -> tuple:
    """(the keys with a row after `deltas`, origin, bases), on the device in force: the saved keys
    without those each delta changed or removed, then that delta's changed keys (`table_deltas.merge`,
    the whole path's order). origin[i]: saved row origin[i], or changed row origin[i] - bases[j] of
    delta j, bases[j] <= origin[i] < bases[j + 1] (one base per delta and the end). The saved rows
    kept come first, in their order, then each delta's in order: ascending. Without deltas: the saved
    keys, origin None (row i is saved row i), no bases."""
    if not deltas:
        return row_keys, None, []
    origin, bases, base = _count_from(0, count), [], count
    for delta in deltas:
        got = delta.read(["row_keys", "row_removed"])
        changed = int(got["row_keys"].shape[0])
        row_keys, (origin,) = merge(row_keys, [origin], got["row_keys"], [_count_from(base, changed)],
                                     got["row_removed"])
        bases.append(base)
        base += changed
    return row_keys, origin, [*bases, base]


def _count_from(start: int, count: int):
    """int64 [start, start + count), made on the device in force from the coordinator's constants."""
    return tf.range(coordinator_constant(start, tf.int64), coordinator_constant(start + count, tf.int64),
                    coordinator_constant(1, tf.int64))


def _positions(origin, values: list[int]) -> list[int]:
    """For each of `values`, the first position in `origin` (ascending) holding it or more: one call
    on the ps, its answer read here. `origin` None (row i is saved row i): `values` themselves."""
    if origin is None:
        return list(values)
    row = coordinator_constant([1, -1], tf.int32)
    at = tf.raw_ops.LowerBound(sorted_inputs=tf.reshape(origin, row),
                               values=coordinator_constant([values], origin.dtype), out_type=tf.int64)
    return [int(v) for v in at.numpy().reshape(-1)]


def _gather(value, origin, at: int, end: int, first: int):
    """The rows of `value` (rows `first`, `first` + 1, ... of their source) that rows [at, end) take."""
    taken = tf.slice(origin, coordinator_constant([at], tf.int64), coordinator_constant([end - at], tf.int64))
    return tf.gather(value, taken - coordinator_constant(first, origin.dtype), axis=coordinator_constant(0, tf.int32))


def _rows_keyed(shard, row_keys, dim: int) -> dict | None:
    """The shard's row and slot variables by field, once its storage is fitted to its share and its
    rows [0, n) are keyed by `row_keys` (their values left to the caller); None, with nothing
    changed, if `row_keys` are more than its share (the whole path evicts down to it)."""
    if int(row_keys.shape[0]) > shard.share:
        return None
    variables = {"rows": shard.rows, **shard.slots}
    with _write_marks.unmarked():  # a restore: counted in `restores` (`replace_row_keys`, next)
        _fit_storage(list(variables.values()), shard.share, dim)
    shard.replace_row_keys(row_keys)
    return variables


@functools.partial(tf.function, autograph=False, reduce_retracing=True)
def _fit_storage(variables: list, rows: int, dim: int):
    """Each of `variables` (float32, rank 2) with a buffer of [rows, dim]: kept where it has that
    shape, else dropped, then one of it made (uninitialized: the caller writes every row), never
    two at once. Traced: its Python values are constants of the function, not converted on the ps."""
    for var in variables:
        def renew(var=var):
            with tf.control_dependencies([var.assign(tf.zeros([0, dim]), read_value=False)]):
                empty = tf.raw_ops.Empty(shape=tf.constant([rows, dim], tf.int32), dtype=tf.float32, init=False)
            with tf.control_dependencies([var.assign(empty, read_value=False)]):
                return tf.constant(True)

        # VariableShape, not tf.shape: that reads the variable, which copies it in copy-on-read mode.
        shape = tf.raw_ops.VariableShape(input=var.handle, out_type=tf.int64)
        tf.cond(tf.reduce_all(tf.equal(shape, tf.constant([rows, dim], tf.int64))), lambda: tf.constant(False), renew)


def _filled(rows: int, dim: int, value: float):
    """A [rows, dim] float32 tensor of `value`, made on the device in force from the coordinator's constants."""
    return tf.raw_ops.Fill(dims=coordinator_constant([rows, dim], tf.int64),
                           value=coordinator_constant(value, tf.float32))

