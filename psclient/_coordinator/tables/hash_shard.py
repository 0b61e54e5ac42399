"""One ps task's part of a dynamic table without a capacity: `MutableHashTable`s that grow as keys come
(see `psclient._coordinator.tables.dynamic_tables` for what the tables hold, and `dense_shard` for a table
with a capacity). Its eviction scan, and the rule every write keeps with it: a row has a counter.

Everything here is TensorFlow ops placed on the shard's device; traced into a worker's step, they run
on the ps.

In a strategy whose checkpoints copy before the cut (`checkpoints/hash_copy`), a shard also says which
keys each write touched while a copy is under way: `mark(keys, after)` puts them in `touched` once the
write is done, if a copy is under way (read after the write: a write that found none was done before
the copy began). `copies` holds [the number of the last copy begun, the highest number ended]: a copy
is under way while the first is the greater, so an end that reaches a ps late (it hung) never ends a
copy begun after it. Restores and imports (`replace`) are counted in `restores` instead.
"""

from __future__ import annotations

import contextlib
from typing import Any

import tensorflow as tf

from psclient._coordinator.runtime import coordinator_cpu
from psclient._coordinator.tables.least_recent import least_recent
from psclient._core import dynamic_tables as rules

__all__ = ["HashShard", "export", "hash_table"]


def export(table):
    """(keys, values) of every entry of a table (a copy, made on the table's device)."""
    keys, values = table.export()
    if tf.executing_eagerly():  # a vector already; a reshape's [-1] would be converted under the ps's device
        return keys, values
    return tf.reshape(keys, [-1]), values  # traced: the export's keys have no static rank


def hash_table(value_dtype, default: list):
    """A MutableHashTable on the device in effect, whose `default` row is held here, not there.

    A function using the table captures the default by value when it is
    traced: held on the ps, each trace would copy it from there, and a trace
    made while that ps is down (before a recovery) would fail on it.
    """
    with tf.device(coordinator_cpu()):
        default = tf.constant(default, value_dtype)
    return tf.lookup.experimental.MutableHashTable(tf.int64, value_dtype, default, checkpoint=False)


class HashShard:
    """Hash tables of rows, slots and counters, and the clock, admissions and evictions of one ps task."""

    dense = False

    def __init__(self, device: str | None, dim: int, prefix: str, marked: bool = False):
        self.device, self.dim, self.prefix = device, dim, prefix
        #: Whether its writes are marked while a checkpoint copies it (`mark`, checkpoints/hash_copy).
        self.marked = marked
        self.restores = 0  #: restores and imports (`replace`): unmarked writes (checkpoints/hash_copy)
        self.slots: dict[str, Any] = {}
        self.make({})

    def make(self, slot_defaults: dict[str, float]) -> None:
        """New, empty tables and zero counters on the shard's device (at first, and after its ps was lost)."""
        self.version = object()  # a copy or a traced cut over the old tables is stale (checkpoints/hash_copy)
        with self.placed():
            if self.marked:
                with tf.device(coordinator_cpu()):
                    none = tf.constant(0, tf.int64)
                self.touched = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, none, checkpoint=False)
                self.copies = tf.Variable(tf.zeros([2], tf.int64), trainable=False, name=f"{self.prefix}_copies")
            self.copies_begun = 0  # numbers the copies (`checkpoints/hash_copy`)
            self.values = hash_table(tf.float32, [0.0] * self.dim)
            self.counters = hash_table(tf.int64, [0, -1])
            self.clock = tf.Variable(tf.constant(0, tf.int64), trainable=False, name=f"{self.prefix}_clock")
            self.admissions = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                          name=f"{self.prefix}_admissions")
            self.evictions = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                         name=f"{self.prefix}_evictions")
            self.slots = {slot: hash_table(tf.float32, [float(value)] * self.dim)
                          for slot, value in slot_defaults.items()}

    def placed(self):
        return tf.device(self.device) if self.device else contextlib.nullcontext()

    def mark(self, keys, after: list) -> list:
        """In a traced write section: ops that put `keys` in `touched` once the ops `after` (the writes
        of those keys) are done, if a copy is under way (see the module). None unmarked."""
        if not self.marked:
            return []
        keys = tf.reshape(keys, [-1])

        def put():
            with tf.control_dependencies([self.touched.insert(keys, tf.ones_like(keys))]):
                return tf.constant(True)

        with tf.control_dependencies(after):
            begun_and_ended = self.copies.read_value()
        return [tf.cond(begun_and_ended[0] > begun_and_ended[1], put, lambda: tf.constant(False))]

    def replace(self, keys, counters, row_keys, rows, slots: dict, clock, admissions, evictions) -> None:
        """The shard's contents replaced (a restore or an import), run eagerly under the shard's device,
        the inputs made elsewhere: each op here takes tensors and converts no Python value on the ps."""
        self.restores += 1  # unmarked writes: a copy taken before is stale
        for table in (self.values, self.counters, *self.slots.values()):
            held, _ = table.export()  # [n] eagerly: a reshape would convert its shape on the ps
            table.remove(held)
        self.counters.insert(keys, counters)
        self.values.insert(row_keys, rows)
        for slot, value in slots.items():
            self.slots[slot].insert(row_keys, value)
        self.clock.assign(clock, read_value=False)
        self.admissions.assign(admissions, read_value=False)
        self.evictions.assign(evictions, read_value=False)

    def clear_orphans(self, keys) -> list:
        """Remove the rows (and slots) of `keys` whose counters are gone, after a step wrote them.

        Every row has a counter: the scans only walk the counters, so a row without one would never
        expire, and it would be saved and served for good. Another worker's scan can remove a key
        between a step's admission or counter check and its write (the scan chose it from an earlier
        export of the counters); the write then brings the row back alone. The scan removes a key's
        counter before its row (`evict`), so a row written before the scan's counter removal is removed
        by the scan, and one written after it is found here. (This and another worker's admission of
        the same key can cross: its fresh row is removed, its counter kept; the key's row then starts
        from zeros at its next update. No row is left without a counter either way.)
        """
        tracked = tf.reshape(self.counters.lookup(keys), [-1, 2])[:, 0] > 0
        orphans = tf.boolean_mask(keys, ~tracked)
        removals = [self.values.remove(orphans)] + [table.remove(orphans) for table in self.slots.values()]
        return removals + self.mark(orphans, removals)

    def evict(self, policy: rules.Policy, share: int | None):
        """Scan the counters and remove what `choose_evictions` would (same rules, as ops); `share`: the
        shard's part of the table's capacity (None: none). Returns the evictions' count, updated."""
        keys, tracked = export(self.counters)
        tracked = tf.reshape(tracked, [-1, 2])
        count, last = tracked[:, 0], tracked[:, 1]
        gone = tf.zeros(tf.shape(keys), tf.bool)
        if policy.ttl_steps is not None:
            gone = self.clock.read_value() - last > policy.ttl_steps
        if share is not None:
            kept = ~gone
            admitted = count >= policy.min_frequency
            # With min_frequency=1 every tracked key has a row: no group of keys still counting.
            groups = [kept & admitted] + ([kept & ~admitted] if policy.min_frequency > 1 else [])
            for group in groups:
                size = tf.reduce_sum(tf.cast(group, tf.int64))
                excess = tf.where(size > share, size - (share - rules.headroom(share)), 0)
                gone = gone | least_recent(keys, last, group, excess)
        victims = tf.boolean_mask(keys, gone)
        # Counters first: a step that writes a victim's row after this removal finds the counter gone
        # and removes the row itself (`clear_orphans`); one that wrote it before has it removed here.
        with tf.control_dependencies([self.counters.remove(victims)]):
            removals = [self.values.remove(victims)] + [table.remove(victims) for table in self.slots.values()]
        removals += self.mark(victims, removals)
        with tf.control_dependencies(removals):
            # Rows evicted: the victims that had one (the others were still counting).
            evicted = tf.reduce_sum(tf.cast(gone & (count >= policy.min_frequency), tf.int64))
            return self.evictions.assign_add(evicted)
