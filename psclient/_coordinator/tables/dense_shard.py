"""A bounded dynamic table's shard: rows and slots in preallocated variables on the ps.

For a table with `capacity`, each ps task holds `share = ceil(capacity /
num_ps)` rows in

  rows     tf.Variable float32[share, dim]   (and one per optimizer slot)
  row_key  int64[share]  the key a row holds
  last     int64[share]  the step a row's key was last seen (-1: a free row)
  free     int32[share]  a stack of the free rows, its first `free_count` entries valid
  index    key -> row, an open-addressing table (`psclient._coordinator.tables.key_index`)
  pending  MutableHashTable key -> (sightings, last seen) of keys still
           counting towards admission (empty with min_frequency=1)

so a row costs its payload, 20 bytes (its key, step and free-stack entry) and 12 bytes per
index bucket (1.25 to 2.5 buckets a row), instead of three hash-table nodes
(docs/dynamic_embeddings.md, "Design"). A key's sightings are kept only
while it counts towards admission: once it holds a row they decide nothing
(eviction goes by recency), and a saved row reads `min_frequency` of them.
Eviction is a selection over the dense `last` and removal from one table;
a freed row goes onto the free stack, from which admissions take rows, so
a step that evicts nothing costs in proportion to its keys, not to the share.

A training step's forward pass only reads (`peek`); the admission runs with
the optimizer's update, for all alike tables of the step at once
(`psclient._coordinator.tables.fused_admission`), under a `tf.CriticalSection` on
the ps that its shards share: two workers' steps admitting keys on one ps
at once must not take the same free row. The eviction a full shard needs
runs inside it, before the new rows are placed, with the same victims as
`psclient._core.dynamic_tables`' rules. Scans (`scan`) handle expiry, keys
still counting and index rebuilds for tables with `ttl_steps` or
`min_frequency > 1` (in the same section, when due: `scan_held`), and restores.
"""

from __future__ import annotations

import functools
import weakref

import tensorflow as tf

from psclient._coordinator.tables import shard_restore
from psclient._coordinator.tables.key_index import KeyIndex, find
from psclient._coordinator.tables.least_recent import least_recent
from psclient._coordinator.tables.ps_saves import empty_fields, saved_tensors
from psclient._coordinator.tables.saved_rows import live_rows, saved_keys
from psclient._core import dynamic_tables as rules
from psclient._tf import write_marks as _write_marks
from psclient._tf.context import locked
from psclient._tf.executors import streamed_function_registrations
from psclient._tf.registrations import RegisteredCall
from psclient._tf.functions import made_per_object

__all__ = ["DenseShard", "vector"]

_READS = frozenset({"saved", "saved_tensors", "stats"})  # `_on_ps` sections that only read (any other may write)

# Per traced graph and lock (one a ps task: `stores.table_lock`), the output of its last critical
# section. Each section starts only after every input it uses arrived, and after the previous one
# under the same lock ended: it then runs to its end without waiting on anything, so no step holds
# a lock while it waits for another (locks taken as soon as the step started, before their
# sections' inputs, deadlocked two workers' steps over three tables). Sections under the locks of
# different ps tasks run side by side (chained across them, each ps's section waited for the
# other's, and a control edge crossed between the ps tasks every step). Outputs are held weakly: a
# tensor holds its graph, so a strong value kept every traced graph and its functions in TF's eager
# context for the life of the process (each later connect to the cluster slowed with their number).
_last_section: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def in_turn(section, inputs=(), lock=None):
    """Run `section()` (which takes `lock`) after `inputs` and the graph's previous section under `lock`."""
    if tf.executing_eagerly():
        return section()
    graph = tf.compat.v1.get_default_graph()
    last = _last_section.setdefault(graph, {})
    previous = last.get(id(lock))
    before = [t for t in (previous and previous(), *inputs) if t is not None]
    with tf.control_dependencies(before):
        out = section()
    last[id(lock)] = weakref.ref(tf.nest.flatten(out)[0])
    return out


def vector(variable, at=None):
    """A 1-D variable's values (at `at`), of known rank (its shape is unknown: see `DenseShard._variable`)."""
    value = variable.read_value() if at is None else tf.gather(variable, at)
    return tf.reshape(value, [-1])


def _grow(value, size, fill):
    """`value` padded with `fill` along the first axis to `size` entries."""
    pad = tf.fill(tf.concat([[size - tf.shape(value, tf.int64)[0]], tf.shape(value, tf.int64)[1:]], 0),
                  tf.constant(fill, value.dtype))
    return tf.concat([value, pad], 0)


@functools.partial(tf.function, autograph=False)
def _slot_start(rows, dim: int, value: float):
    """A new slot's value for the shard whose row variable is `rows`: `value` in each of its rows.
    Traced, for the reason `DenseShard._on_ps` gives."""
    return tf.fill(tf.stack([tf.shape(rows, tf.int64)[0], dim]), tf.constant(value, tf.float32))


class DenseShard:
    """One ps task's part of a table with a capacity (see the module's docstring)."""

    dense = True

    def __init__(self, device: str | None, dim: int, prefix: str, share: int, policy: rules.Policy,
                 placed, table_factory, lock_for, mark_writes=None):
        self.device, self.dim, self.prefix, self.share, self.policy = device, dim, prefix, share, policy
        self.placed, self._table, self._lock_for = placed, table_factory, lock_for
        # The store's `mark_writes(variable, shape, force)`: a big shard's storage copied before a cut.
        self._mark_writes = mark_writes or (lambda variable, shape, force=False: False)
        self.restores = 0  #: restores and imports (`shard_restore.run`): unmarked writes (checkpoints/table_copy)
        self.slots: dict = {}
        self.slot_defaults: dict[str, float] = {}
        self._traced: dict = {}
        self.make({})

    def _variable(self, value, name):
        # Of unknown shape, so a restore can hold more rows than the share. Unknown rank, not
        # [None, dim]: a worker given a handle with an unknown dimension aborts (TF 2.21's
        # DeserializeRemoteTensorHandle checks every dimension >= 0).
        return tf.Variable(value, trainable=False, name=f"{self.prefix}_{name}", shape=tf.TensorShape(None))

    _vector = staticmethod(vector)

    def gather_rows(self, variable, at):
        """`variable`'s rows at `at` (a row matrix or a slot of this shard), `dim` wide."""
        return tf.reshape(tf.gather(variable, at), [-1, self.dim])

    def make(self, slot_defaults: dict[str, float]) -> None:
        """New, empty storage on the shard's device (at first, and after its ps was lost)."""
        self._traced.clear()  # traced over the old storage
        self.version = object()  # a per-ps save over the old storage is stale (ps_saves)
        with self.placed():
            size = self.share
            self.rows = self._variable(tf.zeros([size, self.dim]), "rows")
            self.row_key = self._variable(tf.zeros([size], tf.int64), "row_key")
            self.last = self._variable(tf.fill([size], tf.constant(-1, tf.int64)), "last")
            #: Whether its rows, slots, `row_key` and `last` have write marks (`psclient._tf.write_marks`).
            self.marked = self._mark_writes(self.rows, [size, self.dim])
            if self.marked:  # copied with the rows, whatever their own size
                self._mark_writes(self.row_key, [size], force=True)
                self._mark_writes(self.last, [size], force=True)
            # Popped from the end: rows 0, 1, 2... are taken first.
            self.free = self._variable(tf.range(size - 1, -1, -1, dtype=tf.int32), "free")
            self.free_count = tf.Variable(tf.constant(size, tf.int64), trainable=False,
                                          name=f"{self.prefix}_free_count")
            self.index = KeyIndex(size, self.prefix)
            self.pending = self._table(tf.int64, [0, -1])
            self.clock = tf.Variable(tf.constant(0, tf.int64), trainable=False, name=f"{self.prefix}_clock")
            self.admissions = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                          name=f"{self.prefix}_admissions")
            self.evictions = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                         name=f"{self.prefix}_evictions")
            # Shared by the bounded tables' shards on this device: a step admits into them at once.
            self.lock = self._lock_for(self.device)
            self.slots = {}
            self.empty_fields = empty_fields(self.dim)  # what a cut saves while `fresh`: made here, not there
        self.add_slots(slot_defaults)
        self.fresh = True  #: nothing written since made (cleared by add_slots and writes through `_on_ps`)

    def add_slots(self, defaults: dict[str, float]) -> None:
        self.fresh = False  # an optimizer asks for its slots before it first updates the rows
        self.slot_defaults = {**self.slot_defaults, **{k: float(v) for k, v in defaults.items()}}
        missing = {slot: value for slot, value in defaults.items() if slot not in self.slots}
        if not missing:
            return  # no read of the ps: every trace of a training step asks (docs/fault_tolerance.md)
        self._traced.clear()  # traced without these slots
        self.version = object()  # a per-ps save without them is stale (ps_saves)
        with self.placed():
            for slot, value in missing.items():
                self.slots[slot] = self._variable(_slot_start(self.rows, self.dim, float(value)), f"slot_{slot}")
                if self.marked:
                    self._mark_writes(self.slots[slot], [self.share, self.dim])
        # Nothing traced here: a cut saves the ps's shards with one function made later (`ps_saves.prepare`).

    # ---------------------------------------------------------------- reads
    def _rows_of(self, keys):
        """(row of each key or -1, that row clamped to >= 0), checking the row still holds the key."""
        at = self.index.lookup(keys)
        safe = tf.maximum(at, 0)
        held = (at >= 0) & (self._vector(self.row_key, safe) == keys) & (self._vector(self.last, safe) >= 0)
        return tf.where(held, at, -1), safe

    def lookup(self, keys):
        """Rows of `keys` (zeros where none), under the lock: an index rebuild (empty, then refilled)
        must not be seen half done by a lookup outside training."""
        return in_turn(lambda: locked(self.lock, lambda: self._lookup(keys)), (keys,), self.lock)

    def _lookup(self, keys):
        at, safe = self._rows_of(keys)
        alive = at >= 0
        if self.policy.ttl_steps is not None:
            alive &= self.clock.read_value() - self._vector(self.last, safe) <= self.policy.ttl_steps
        found = self.gather_rows(self.rows, safe)
        return tf.where(alive[:, None], found, tf.zeros_like(found))

    def peek(self, sent):
        """What a training step's forward pass reads for the keys `sent` to this ps: `KeyIndex.asked`
        keys [n], or with `min_frequency > 1` [n, 2] those keys and their sightings in the batch,
        stacked on the worker (each tensor a step sends between tasks costs a rendezvous; the
        policy then adds none). Returns (rows, keys, sightings or None): the keys and sightings as
        the ps received them, for the update (`fused_admission.Part`), which then receives nothing
        more from the worker but the gradient. Read only: rows [n, dim + 1], each key's row and,
        bitcast to float32 in the last column, its code

          >= 0  the key holds a row: the row is its
          -1    its update will admit it: it reads the row it will start from (drawn by the caller)
          -2    it is still counting towards admission (`min_frequency`): it reads zeros

        (one tensor: each tensor a step sends from a ps to a worker costs more than the ops on
        it). Few ops on the ps, as a step runs one per table and ps. The admission runs with the
        update (`psclient._coordinator.tables.fused_admission`). Without the lock: during another step's
        rebuild of the key index a held key can read as new (its forward pass then sees its first
        row; the update still reaches its row), and a row another step just freed and gave to a
        new key can be read once, like any read racing an asynchronous update.
        """
        asked, seen_now = tf.unstack(sent, axis=1) if self.policy.min_frequency > 1 else (sent, None)
        policy, ttl = self.policy, self.policy.ttl_steps
        at = self.index.find(asked)
        safe = tf.maximum(at, 0)
        found = self.gather_rows(self.rows, safe)
        code = at
        if ttl is not None or policy.min_frequency > 1:
            # Written for few ops (a step runs these for every table on the ps): the clock read
            # once, the counters unstacked in one op, scalars broadcast by the `where`s.
            step = self.clock.read_value() + 1 if ttl is not None else None  # the step's clock
            alive = at >= 0
            if ttl is not None:
                alive &= step - self._vector(self.last, safe) <= ttl
            if policy.min_frequency > 1:
                count, seen_at = tf.unstack(tf.reshape(find(self.pending, asked, [0, -1]), [-1, 2]), axis=1)
                if ttl is not None:
                    count = tf.where(step - seen_at > ttl, tf.constant(0, tf.int64), count)
                waits = tf.where(count + seen_now >= policy.min_frequency, -1, -2)
            else:
                waits = tf.constant(-1)
            code = tf.where(alive, at, waits)
        return tf.concat([found, tf.bitcast(code, tf.float32)[:, None]], 1), asked, seen_now

    # ------------------------------------------------------------ admission
    def live(self):
        """(keys, rows) of the rows that hold a key."""
        return live_rows(self._vector(self.row_key), self._vector(self.last))

    def _remove_rows(self, members, k, count_rows):
        """Free the `k` least recently used rows among `members(last)` (all of them where k is None)."""
        last = self._vector(self.last)
        member = members(last)
        keys = self._vector(self.row_key)
        if k is None:
            gone = member
        else:
            k = tf.minimum(k, tf.reduce_sum(tf.cast(member, tf.int64)))
            gone = least_recent(keys, last, member, k, entries=self.share)
        victims = tf.reshape(tf.where(gone), [-1])
        with tf.control_dependencies(self.free_rows(tf.gather(keys, victims), victims, count_rows)):
            return tf.size(victims, tf.int64)

    def free_rows(self, keys, rows, count_rows=True) -> list:
        """Ops that free `rows` (int64), which held `keys`: out of the index, marked free, onto the
        free stack (and counted as evictions)."""
        n = tf.size(rows, tf.int64)
        ops = [self.index.remove(keys),
               self.last.scatter_update(tf.IndexedSlices(tf.fill([n], tf.constant(-1, tf.int64)), rows)),
               self.push_free(rows)]
        if count_rows:
            ops.append(self.evictions.assign_add(n, read_value=False))
        return ops

    def push_free(self, rows):
        """Put freed `rows` (int64) on the free stack."""
        count = self.free_count.read_value()
        at = count + tf.range(tf.size(rows, tf.int64))
        with tf.control_dependencies([self.free.scatter_update(tf.IndexedSlices(tf.cast(rows, tf.int32), at))]):
            return self.free_count.assign_add(tf.size(rows, tf.int64), read_value=False)

    def pop_free(self, n):
        """(the `n` rows taken from the free stack (int64), the op that takes them)."""
        count = self.free_count.read_value()
        rows = tf.cast(self._vector(self.free, tf.range(count - n, count)), tf.int64)
        with tf.control_dependencies([rows]):
            return rows, self.free_count.assign_sub(n, read_value=False)

    # ---------------------------------------------------------------- scan
    def scan(self):
        """Expired rows and keys, and rows or counting keys over the share, removed (under the lock)."""
        return locked(self.lock, self._scan)

    def _scan(self):
        policy, share = self.policy, self.share
        clock = self.clock.read_value()
        done = []
        if policy.ttl_steps is not None:
            done.append(self._remove_rows(lambda last: (last >= 0) & (clock - last > policy.ttl_steps),
                                          None, count_rows=True))
        with tf.control_dependencies(done):
            held = tf.reduce_sum(tf.cast(self._vector(self.last) >= 0, tf.int64))
            excess = tf.where(held > share, held - (share - rules.headroom(share)), 0)
            done.append(self._remove_rows(lambda last: last >= 0, excess, count_rows=True))
        keys, waiting = self.pending.export()
        keys, waiting = tf.reshape(keys, [-1]), tf.reshape(waiting, [-1, 2])
        gone = tf.zeros(tf.shape(keys), tf.bool)
        if policy.ttl_steps is not None:
            gone = clock - waiting[:, 1] > policy.ttl_steps
        size = tf.reduce_sum(tf.cast(~gone, tf.int64))
        excess = tf.where(size > share, size - (share - rules.headroom(share)), 0)
        gone |= least_recent(keys, waiting[:, 1], ~gone, excess)
        done.append(self.pending.remove(tf.boolean_mask(keys, gone)))
        with tf.control_dependencies(done):
            rebuilt = self.index.rebuild_if_worn(self.live)
        with tf.control_dependencies([rebuilt]):
            return self.evictions.read_value()

    def scan_held(self):
        """`scan` for a caller that holds the lock already (the fused admission's section); True."""
        with tf.control_dependencies([self._scan()]):
            return tf.constant(True)

    # ------------------------------------------------------------ state out
    def sizes(self):
        """(rows, keys tracked)."""
        rows = self.index.size()
        return rows, rows + self.pending.size()

    def stats_values(self):
        """[rows, keys tracked, admissions, evictions, clock, storage bytes], int64; eagerly one call (`_on_ps`)."""
        if tf.executing_eagerly():
            return self._on_ps("stats", self._stats_values)()
        return self._stats_values()

    def _stats_values(self):
        rows, tracked = self.sizes()
        return tf.stack([tf.cast(value, tf.int64) for value in (
            rows, tracked, self.admissions.read_value(), self.evictions.read_value(), self.clock.read_value(),
            self.storage_bytes())])

    def storage_bytes(self):
        """Bytes the shard's rows, slots, per-row counters and key index hold (keys still counting
        towards admission are in a hash table of their own, not counted)."""
        def size(variable):  # VariableShape, not tf.shape: that reads the variable, a copy in copy-on-read mode
            return tf.reduce_prod(tf.raw_ops.VariableShape(input=variable.handle, out_type=tf.int64))

        floats = size(self.rows) + sum(size(var) for var in self.slots.values())
        counters = size(self.row_key) + size(self.last)
        return 4 * floats + 8 * counters + 4 * size(self.free) + self.index.BUCKET_BYTES * self.index.buckets()

    def _on_ps(self, name: str, section):
        """`section` as one traced call for the eager callers (checkpoints, exports; a restore's writes
        go through `shard_restore`, one trace per form of shard, the same way). Run eagerly under the
        shard's device, each Python value in its ops (a shape, a fill value) would be converted *there*,
        and TF copies it to the ps inside the conversion holding the GIL: a ps hung then stops every
        thread of the coordinator (tests/_conversions.py). Traced, they are constants of the function."""
        self.fresh = self.fresh and name in _READS  # any other section may write (a restore, an import)
        traced = self._traced.get(name)
        if traced is None:
            call = RegisteredCall(lambda: made_per_object(tf.function(section, autograph=False,
                                                                      reduce_retracing=True)))

            def traced():
                # Its first call traces it. Its registration on every task, waited for with the GIL held, stopped
                # the coordinator while a worker hung (3.9 s in a chaos plan): streamed (see `RegisteredCall`).
                with streamed_function_registrations():
                    return call()

            self._traced[name] = traced
        return traced

    def saved(self):
        """(keys, counters, row_keys, rows, {slot: rows}) of the shard, as tensors on its device."""
        return self._on_ps("saved", self._saved)() if tf.executing_eagerly() else self._saved()

    def saved_tensors(self) -> list:
        """The shard's saved tensors in the checkpoint's order and shapes (`ps_saves.saved_tensors`), on
        its device: eagerly one traced call (a cut without a prepared per-ps save)."""
        return self._on_ps("saved_tensors", lambda: saved_tensors(self))()

    def trace_saved_tensors(self) -> None:
        """Make `saved_tensors`' call once (traced, instantiated on the ps) outside any cut, if not yet."""
        if "saved_tensors" not in self._traced:
            with self.placed():
                self.saved_tensors()

    def _saved(self):
        waiting_keys, waiting = self.pending.export()
        keys, counters, row_keys, held = saved_keys(self._vector(self.row_key), self._vector(self.last),
                                                    waiting_keys, waiting, self.policy.min_frequency)
        slots = {name: self.gather_rows(var, held) for name, var in self.slots.items()}
        return keys, counters, row_keys, self.gather_rows(self.rows, held), slots

    def replace(self, keys, counters, row_keys, rows, slots, clock, admissions, evictions) -> None:
        """Hold these (a restore or an import; eagerly). Restored into fewer ps tasks, a shard can get
        more rows than its share: the scan then evicts by the usual rules and the rows left are packed
        into the share (the fused admission wants every shard of a table at its share)."""
        shard_restore.run(self, "_replace", keys, counters, row_keys, rows, slots, clock, admissions, evictions)
        if int(row_keys.shape[0]) > self.share:
            with _write_marks.unmarked():  # a restore's part: counted in `restores` (shard_restore.run)
                self._on_ps("repack", self._repack)()

    def _repack(self):
        self.scan()
        keys, counters, row_keys, rows, slots = self._saved()
        self._replace(keys, counters, row_keys, rows, slots, self.clock.read_value(),
                      self.admissions.read_value(), self.evictions.read_value())

    def replace_row_keys(self, row_keys) -> None:
        """A restore in place, first step (at most `share` rows, into row and slot variables of the
        share's shape: `table_ranges`; eagerly): rows [0, n) hold `row_keys`, values left to the caller."""
        shard_restore.run(self, "_replace_row_keys", row_keys)

    def replace_counters(self, keys, counters, rows, clock, admissions, evictions) -> None:
        """The second step (after `replace_row_keys` of `rows` keys): the tracked keys' counters and the clocks."""
        shard_restore.run(self, "_replace_counters", keys, counters, rows, clock, admissions, evictions)

    def _replace(self, keys, counters, row_keys, rows, slots, clock, admissions, evictions) -> None:
        n = tf.size(row_keys, tf.int64)
        size = tf.maximum(n, self.share)
        self._replace_keys(keys, counters, row_keys, clock, admissions, evictions, size)
        self.rows.assign(_grow(tf.reshape(rows, [-1, self.dim]), size, 0.0), read_value=False)
        for name, var in self.slots.items():
            value = slots.get(name)
            if value is None:
                value = tf.fill(tf.stack([n, self.dim]), tf.constant(self.slot_defaults[name], tf.float32))
            var.assign(_grow(tf.reshape(value, [-1, self.dim]), size, self.slot_defaults[name]), read_value=False)

    def _replace_keys(self, keys, counters, row_keys, clock, admissions, evictions, size) -> None:
        """All `_replace` holds but the rows and slots (storage of `size` rows)."""
        self._replace_row_keys(row_keys, size)
        self._replace_counters(keys, counters, tf.size(row_keys, tf.int64), clock, admissions, evictions, size)

    def _replace_row_keys(self, row_keys, size=None) -> None:
        size = self.share if size is None else size  # None: in place, at the share
        self.index.reset(row_keys, tf.range(tf.size(row_keys)))  # int32, as the index holds them: no cast's copy
        with tf.control_dependencies([self.row_key.assign(_grow(row_keys, size, 0), read_value=False)]):
            # Out of copy-on-read mode (training's scatters put it there): `_replace_counters`'s read of
            # it, next, shares its buffer instead of copying it (8 bytes a row more at a restore's peak).
            tf.raw_ops.DisableCopyOnRead(resource=self.row_key.handle)

    def _replace_counters(self, keys, counters, n, clock, admissions, evictions, size=None) -> None:
        # None: in place, at the share (a tensor in `shard_restore`'s trace, an int in `_repack`'s).
        size = tf.convert_to_tensor(self.share, tf.int64) if size is None else size
        old, _ = self.pending.export()
        self.pending.remove(tf.reshape(old, [-1]))
        counters = tf.reshape(counters, [-1, 2])

        def found():  # in any order: each key's row looked up (a row without counters: 0)
            at = self.index.lookup(keys)
            is_row = at >= 0
            last = tf.tensor_scatter_nd_update(tf.zeros([n], tf.int64), tf.boolean_mask(at, is_row)[:, None],
                                               tf.boolean_mask(counters[:, 1], is_row))
            return last, tf.boolean_mask(keys, ~is_row), tf.boolean_mask(counters, ~is_row)

        # As `_saved` orders them (the keys with a row first, in the rows' order): no lookup, fewer copies.
        head = keys[:n]
        in_order = tf.reduce_all(tf.equal(head, self._vector(self.row_key)[:tf.size(head)]))
        in_order &= tf.size(head, tf.int64) == n
        last, waiting_keys, waiting = tf.cond(in_order, lambda: (counters[:n, 1], keys[n:], counters[n:]), found)
        last = _grow(last, size, -1)
        self.last.assign(last, read_value=False)
        free = tf.cast(tf.reverse(tf.reshape(tf.where(last < 0), [-1]), [0]), tf.int32)  # lowest rows on top
        self.free.assign(_grow(free, size, 0), read_value=False)
        self.free_count.assign(tf.size(free, tf.int64), read_value=False)
        self.pending.insert(waiting_keys, waiting)
        self.clock.assign(clock, read_value=False)
        self.admissions.assign(admissions, read_value=False)
        self.evictions.assign(evictions, read_value=False)
