"""A bounded table shard's key -> row index: one open-addressing hash table on the ps.

TF's `DenseHashTable` keeps its entries in two flat arrays (keys int64 and
rows int32: 12 bytes a bucket, buckets a power of two, at most 80% full),
where a `MutableHashTable` allocates a node per key (about 60 to 80 bytes
with its bucket array, measured: docs/dynamic_embeddings.md, "Speed and
memory"). The index is made once with enough buckets for the shard's
rows, so it never grows while the shard stays within them.

Two things of open addressing the index takes care of:

- A removed key leaves a tombstone that lookups walk past and only a
  rebuild clears; under steady eviction they would fill every empty bucket
  and make each lookup of an unknown key scan the whole array. `removed`
  counts them; once they fill half of the buckets no live key holds
  (`worn`), the shard's next scan rebuilds the index from its live keys
  (`rebuild_if_worn`), one pass over the buckets per that many removals.
- Two key values mark empty and removed buckets, and the table refuses
  to look them up; a training step asks for a third value in their place
  (`asked`), which is never inserted. Those three keys (`RESERVED_KEYS`)
  never get a row (they read as absent and are never admitted).
"""

from __future__ import annotations

import tensorflow as tf

from psclient._coordinator.runtime import coordinator_cpu
from psclient._tf.control_flow import called_cond

__all__ = ["KeyIndex", "RESERVED_KEYS", "SUBSTITUTE_KEY", "buckets_for", "find"]

#: Key values the index uses to mark empty and removed buckets: they never get a row of their own.
#: Arbitrary 64-bit constants, so that no natural id (small integers, -1, 0, INT64_MIN as a missing
#: marker) and only a 2**-63 chance of a string's fingerprint falls on them.
EMPTY_KEY = -0x3C6EF372FE94F82B
REMOVED_KEY = -0x3C6EF372FE94F82A
SUBSTITUTE_KEY = -0x3C6EF372FE94F829  # asked for in place of the two above; never inserted
RESERVED_KEYS = (EMPTY_KEY, REMOVED_KEY, SUBSTITUTE_KEY)

_MAX_LOAD = 0.8  # DenseHashTable doubles its buckets past this fill


def buckets_for(rows: int) -> int:
    """The power of two of buckets (at least 4) that holds `rows` keys without the table growing."""
    need = max(4, -(-rows * 5 // 4))  # rows / _MAX_LOAD, rounded up
    return 1 << (need - 1).bit_length()


def find(table, keys, default):
    """`table.lookup(keys)` with its default made where the lookup runs: the table's own default is
    held on the coordinator (see `KeyIndex`), and in a step run on a worker it would travel from
    there to the ps with every lookup."""
    value = tf.constant(default, table.value_dtype)
    return tf.raw_ops.LookupTableFindV2(table_handle=table.resource_handle, keys=keys, default_value=value)


class KeyIndex:
    """key (int64) -> row (int32 stored, int64 returned; -1: none), on the device in effect when made.

    The lookup's default value is held on the coordinator: a function using
    the table captures it when traced, and held on the ps, a trace made
    while that ps is down would fail on it.
    """

    BUCKET_BYTES = 12  # an int64 key and an int32 row

    def __init__(self, rows: int, prefix: str):
        if rows >= 2**31:
            raise ValueError(f"a shard of {rows} rows: rows are indexed as int32, expected fewer than 2**31 per ps")
        with tf.device(coordinator_cpu()):
            default = tf.constant(-1, tf.int32)
        #: The buckets it is made with (more only after a reset with more keys than `rows`).
        self.bucket_count = buckets_for(rows)
        self.table = tf.lookup.experimental.DenseHashTable(
            tf.int64, tf.int32, default, empty_key=EMPTY_KEY, deleted_key=REMOVED_KEY,
            initial_num_buckets=self.bucket_count, name=f"{prefix}_index", checkpoint=False)
        self.removed = tf.Variable(tf.constant(0, tf.int64), trainable=False, name=f"{prefix}_index_removed")
        vector = tf.TensorSpec([None], tf.int64)

        def reset(keys, rows):
            self._reset(keys, rows)

        self._reset_function = tf.function(reset, input_signature=[vector, vector], autograph=False)

    @staticmethod
    def usable(keys):
        """Which `keys` may hold a row (all but `RESERVED_KEYS`)."""
        return (keys != EMPTY_KEY) & (keys != REMOVED_KEY) & (keys != SUBSTITUTE_KEY)

    @staticmethod
    def asked(keys):
        """`keys` as the table may be asked for them: the marker keys it refuses replaced by
        `SUBSTITUTE_KEY`, which is never inserted (so reads as absent)."""
        return tf.where((keys != EMPTY_KEY) & (keys != REMOVED_KEY), keys, tf.constant(SUBSTITUTE_KEY, tf.int64))

    def find(self, asked):
        """The int32 row of each of `asked(keys)` (-1: none): one op on the table's device."""
        return find(self.table, asked, -1)

    def lookup(self, keys):
        return tf.cast(tf.reshape(self.find(self.asked(keys)), [-1]), tf.int64)

    def insert(self, keys, rows):
        """Add keys not in the index (a key already in it past a tombstone would be held twice)."""
        return self.table.insert(keys, tf.cast(rows, tf.int32))

    def remove(self, keys):
        with tf.control_dependencies([self.table.remove(keys)]):
            return self.removed.assign_add(tf.size(keys, tf.int64), read_value=False)

    def size(self):
        return self.table.size()

    def entries(self):
        """(keys, rows) of every key the index holds (a pass over all buckets)."""
        keys, rows = self.table.export()
        keys, rows = tf.reshape(keys, [-1]), tf.cast(tf.reshape(rows, [-1]), tf.int64)
        held = self.usable(keys)
        return tf.boolean_mask(keys, held), tf.boolean_mask(rows, held)

    def buckets(self):
        """The number of buckets (the export hands back the table's own arrays, without a copy)."""
        return tf.shape(self.table.export()[0], tf.int64)[0]

    def reset(self, keys, rows):
        """Hold exactly `keys` -> `rows`: the buckets emptied (tombstones gone), then the keys inserted
        (the table doubles its buckets if they are too few for the keys)."""
        if tf.executing_eagerly():
            return self._reset_function(keys, tf.cast(rows, tf.int64))
        return self._reset(keys, rows)

    def _reset(self, keys, rows):
        # Emptied arrays shaped after the table's own ([buckets, 1] each), of a shape unknown when
        # traced: the import's shape check wants keys of rank 1, its kernel rank 2 (an eager call on
        # a remote ps runs the check on the real shapes, hence `_reset_function`). The import adopts
        # the arrays it is given and drops the table's: a 4-bucket import first drops them, so the
        # emptied full-size arrays are made once the old ones are gone (made before, both were held
        # at once: 12 bytes a bucket more at the peak of every restore and rebuild).
        shape = tf.shape(self.table.export()[0])
        dropped = self._import_emptied(tf.minimum(shape, 4))
        with tf.control_dependencies([dropped]):
            emptied = self._import_emptied(tf.identity(shape))
        with tf.control_dependencies([emptied, self.removed.assign(0, read_value=False)]):
            return self.insert(keys, rows)

    def _import_emptied(self, shape):
        return tf.raw_ops.LookupTableImportV2(
            table_handle=self.table.resource_handle,
            keys=tf.fill(shape, tf.constant(EMPTY_KEY, tf.int64)), values=tf.zeros(shape, tf.int32))

    def worn(self, size=None, buckets=None):
        """Whether removals since the last rebuild could fill half of the buckets no key holds.

        `size`, `buckets`: the index's size and buckets, when the caller knows them already.
        """
        size = self.size() if size is None else size
        buckets = self.buckets() if buckets is None else buckets
        return self.removed.read_value() * 2 >= buckets - size

    def rebuild_if_worn(self, live_keys):
        """Rebuild (see the module's docstring) once tombstones fill half the buckets no key holds.

        `live_keys()`: (keys, rows) of the shard's live rows, read only when rebuilding.
        """
        return called_cond(self.worn(), lambda: self.rebuild(live_keys), lambda: tf.constant(False))

    def rebuild(self, live_keys):
        """Hold exactly the keys `live_keys()` gives, (keys, rows): no tombstones left. Returns True."""
        keys, rows = live_keys()
        with tf.control_dependencies([self.reset(keys, rows)]):
            return tf.constant(True)
