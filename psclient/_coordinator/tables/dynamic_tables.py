"""Dynamic embedding tables: rows kept by key on the ps tasks.

A `DynamicTable` holds one "shard" on each of its ps tasks (or one local shard without a
cluster). With a `capacity`, a shard is a `DenseShard` (`psclient._coordinator.tables.dense_shard`:
rows and slots in preallocated variables beside a key -> row index). Without one, the rows
need storage that grows: the shard (`hash_shard.HashShard`) holds `tf.lookup.experimental.MutableHashTable`s:

  values   key -> row (float32[dim]), for admitted keys
  slots    one table per optimizer slot, key -> float32[dim]
  counters key -> (sightings, step last seen), for every key tracked

and three int64 variables: the shard's clock (training lookups that reached
it), admissions and evictions. Keys go to shard `mix64(key) % shards`.
Everything here is TensorFlow ops placed with `tf.device` on the shard's ps: called from a
function that runs on a worker, the lookup, the admission, the optimizer's arithmetic and the
eviction scan run on the ps and only the looked-up rows (and their gradients) cross. A bounded table's training
lookup only reads; its admission runs with the optimizer's update, together
with the other bounded tables of the step (`psclient._coordinator.tables.fused_admission`). Why these storages, and what
was measured: docs/dynamic_embeddings.md. The rules of admission and
eviction are `psclient._core.dynamic_tables`.

Updates are read-modify-write (lookup, compute, insert) like every asynchronous ps update: two
workers updating the same row at once may lose one of the two updates, as with Keras variables.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Callable

import tensorflow as tf

from psclient._coordinator.tables.dense_shard import DenseShard
from psclient._coordinator.tables.hash_shard import HashShard, export, hash_table
from psclient._coordinator.tables.key_hash import initial_rows, mix64, shard_of
from psclient._coordinator.tables.key_index import SUBSTITUTE_KEY, KeyIndex
from psclient._coordinator.runtime import coordinator_cpu
from psclient._core import dynamic_tables as rules
from psclient._coordinator.ps_state import on_ps
from psclient._core.errors import PSUnavailableError, first_line
from psclient._tf.control_flow import called_cond

__all__ = ["DynamicTable", "initial_rows", "live_tables", "mix64", "shard_of", "stats_on_ps"]

_lock = threading.Lock()
_serials = itertools.count()  # creation order: the joint admission takes the tables' locks in it


def live_tables(strategy) -> list:
    """Every live table of `strategy` on its ps tasks, the newest of a name (see `stats_on_ps`)."""
    return [table for table in strategy.parts.store.tables().values() if table.shards[0].device]


def stats_on_ps(strategy, into: dict | None = None) -> dict[str, list[dict]]:
    """`stats()` of every live table of `strategy` (rows on its ps tasks), by name (the newest of a name).

    Only that strategy's (its variable store tracks them): a table made under an earlier
    strategy (a model still referenced after its shutdown) lives on tasks this one may not reach.
    Nothing is waited for: the ps tasks the recovery holds lost are not read, and a loss the read
    meets is reported to the recovery (`recovering: True` on the shard either way). `into`: filled
    as the shards are read (a caller that stops waiting keeps what was read, `table_stats`).
    """
    into = {} if into is None else into
    lost = strategy.parts.engine.published.ps_down
    for table in live_tables(strategy):
        into[table.name] = entries = []
        for index in range(len(table.shards)):
            entries.append(_shard_stats_or_unavailable(table, index, wait=False, lost=lost))
    return into


def _shard_stats_or_unavailable(table: "DynamicTable", index: int, wait: bool = True,
                                lost: frozenset = frozenset()) -> dict:
    """The shard's stats; for a ps that cannot be read, `available: False` and why.

    A ps that restarted holds none of the table until the recovery restores
    it: the read reports the loss and waits for that (`ps_state.on_ps`; not
    with `wait=False`, nor for a ps in `lost`: `recovering: True`). Only when
    the recovery gives up (or another TF error) is the shard reported
    unavailable: stats() is what one reads to see what happened, it does not raise.
    """
    if index in lost:
        return {"ps": index, "available": False, "recovering": True,
                "error": f"ps:{index} is lost and being recovered (not read)"}
    try:
        return on_ps(table.owner(), lambda: table.shard_stats(index),
                     f"reading the stats of dynamic table {table.name!r}", wait=wait)
    except (tf.errors.OpError, PSUnavailableError) as error:
        entry = {"ps": index, "available": False, "error": f"{type(error).__name__}: {first_line(error)}"}
        if not wait and isinstance(error, PSUnavailableError):
            entry["recovering"] = True  # reported to the recovery, not waited for
        return entry


_local_locks: dict = {}


def _local_lock(device):
    """The lock the bounded tables of this process share without a cluster (see stores.table_lock),
    one per local device name: connecting to a cluster renames this process's devices."""
    with _lock, tf.init_scope():
        here = tf.constant(0).device
        if here not in _local_locks:
            _local_locks[here] = tf.CriticalSection(name="psclient_tables_local")
        return _local_locks[here]


def _placer(device):
    return (lambda: tf.device(device)) if device else contextlib.nullcontext


class DynamicTable:
    """Rows by key over `devices` (ps device strings; [None]: one local shard).

    `init`: see `initial_rows`. `policy`: `psclient._core.dynamic_tables.Policy`. `strategy`: the
    one whose ps tasks `devices` are (None for a local table). `storage`: "dense" or "hash" for a
    table with a capacity (None: the strategy's `dynamic_table_storage`, "dense" without one).
    """

    def __init__(self, name: str, dim: int, devices: list, init: tuple, policy: rules.Policy, strategy=None,
                 storage: str | None = None):
        self.name, self.dim, self.init, self.policy = name, dim, init, policy
        # The strategy whose ps tasks hold the rows (None without one: `devices` is [None]), weakly:
        # a model may outlive it.
        strategy = strategy if devices[0] else None
        self.owner = weakref.ref(strategy) if strategy is not None else (lambda: None)
        self.share = rules.per_ps(policy.capacity, len(devices))
        self.slot_defaults: dict[str, float] = {}
        #: Times shards were made again after their ps was lost: functions traced over the old ones are stale.
        self.renewals = 0
        # Placed here, and saved with the rows: the shards' counters are no model variables.
        store = strategy.parts.store if strategy is not None else None
        # StrategyConfig.dynamic_table_storage (checked there): "hash" keeps a bounded table in hash tables too.
        if storage is None:
            storage = strategy.config.dynamic_table_storage if strategy is not None else "dense"
        #: A context in which variables made are the table's, not model variables (the store's rule).
        self.unmanaged = store.unmanaged if store is not None else contextlib.nullcontext
        with tf.init_scope(), self.unmanaged():
            if self.share is not None and storage == "dense":
                lock_for = store.table_lock if store is not None else _local_lock
                marks = store.mark_writes if store is not None else None
                self.shards = [DenseShard(d, dim, f"{name}_ps{i}", self.share, policy, _placer(d), hash_table, lock_for,
                                          marks) for i, d in enumerate(devices)]
            else:
                marked = store is not None and store.marks_writes
                self.shards = [HashShard(d, dim, f"{name}_ps{i}", marked) for i, d in enumerate(devices)]
        if store is not None:
            store.add_table(self)  # its checkpoints and ps recovery carry the rows
        with _lock:
            self.serial = next(_serials)

    # ---------------------------------------------------------------- slots
    def ensure_slots(self, defaults: dict[str, float]) -> None:
        """Create the optimizer's slot tables (name -> initial value) where missing.

        Called while a training step is traced: inside `schedule()`'s guarded trace, a lost ps
        fails the trace, which is made again once the ps is restored (`ps_state`)."""
        on_ps(self.owner(), lambda: self._ensure_slots(defaults), f"adding slots to dynamic table {self.name!r}")

    def _ensure_slots(self, defaults: dict[str, float]) -> None:
        with tf.init_scope(), self.unmanaged():
            for shard in self.shards:
                if shard.dense:
                    shard.add_slots(defaults)
                    continue
                for slot, value in defaults.items():
                    if slot not in shard.slots:
                        shard.version = object()  # a copy without this slot is stale (checkpoints/hash_copy)
                        with shard.placed():
                            shard.slots[slot] = hash_table(tf.float32, [float(value)] * self.dim)
        self.slot_defaults = {**self.slot_defaults, **defaults}

    def renew(self, lost_ps: set) -> None:
        """Empty tables and counters for the shards on `lost_ps` (their resources died with the task).

        Functions traced before hold the old ones and must be traced again;
        the caller restores the contents from a checkpoint.
        """
        from psclient._coordinator.runtime import ps_index_of

        for shard in self.shards:
            if shard.device and ps_index_of(shard.device) in lost_ps:
                with tf.init_scope(), self.unmanaged():
                    shard.make(self.slot_defaults)
        self.renewals += 1

    # --------------------------------------------------------------- lookup
    def _split(self, keys, values=None):
        """(`values`' entries (default: `keys`) by the shard of their key, their positions)."""
        n, values = len(self.shards), keys if values is None else values
        if n == 1:
            return [values], [tf.range(tf.size(keys))]
        owner = shard_of(keys, n)
        return tf.dynamic_partition(values, owner, n), tf.dynamic_partition(tf.range(tf.size(keys)), owner, n)

    def lookup(self, keys):
        """Rows of unique int64 `keys` as a model in inference reads them (unknown or expired: zeros)."""
        parts, positions = self._split(keys)
        rows = []
        for shard, part in zip(self.shards, parts):
            with shard.placed():
                if shard.dense:
                    rows.append(shard.lookup(part))
                    continue
                found = tf.reshape(shard.values.lookup(part), [-1, self.dim])
                if self.policy.ttl_steps is not None:
                    seen = tf.reshape(shard.counters.lookup(part), [-1, 2])
                    alive = shard.clock.read_value() - seen[:, 1] <= self.policy.ttl_steps
                    # Re-sighted after expiring, a key counts afresh: its old row is no longer its.
                    alive &= seen[:, 0] >= self.policy.min_frequency
                    found = tf.where(alive[:, None], found, tf.zeros_like(found))
                rows.append(found)
        return tf.dynamic_stitch(positions, rows)

    def train_lookup(self, keys, counts):
        """Count, admit and look up unique int64 `keys` (seen `counts` times in the batch).

        Returns the rows (zeros for keys not admitted) and the state that
        `apply` (or, with a capacity, `parts`) needs to update them.
        """
        if self.shards[0].dense:
            return self._peek(keys, counts)
        parts, positions = self._split(keys)
        counts = tf.cast(counts, tf.int64)
        count_parts = self._split_like(counts, keys)
        rows, states = [], []
        for shard, part, seen_now in zip(self.shards, parts, count_parts):
            with shard.placed():
                (found, admitted, fresh), at = self._admit(shard, part, seen_now), None
            rows.append(found)
            states.append((part, admitted, fresh, at))
        return tf.dynamic_stitch(positions, rows), (positions, states)

    def _peek(self, keys, counts):
        """`train_lookup` of a table with a capacity: it only reads (see `DenseShard.peek`); the
        admission, and its check that a batch's keys fit, run with the update (`parts`,
        fused_admission). A new key's first row is drawn here, where the rows are used, once for
        all shards."""
        asked = KeyIndex.asked(keys)
        # Sightings only decide an admission with min_frequency > 1: then they travel with the keys,
        # one tensor per shard (see `DenseShard.peek`); else they do not travel.
        sent = tf.stack([asked, tf.cast(counts, tf.int64)], 1) if self.policy.min_frequency > 1 else asked
        parts, positions = self._split(asked, sent)
        rows, states = [], []
        for shard, part in zip(self.shards, parts):
            with shard.placed():
                read, on_ps, seen_now = shard.peek(part)
            rows.append(read)
            states.append((on_ps, seen_now))
        read = tf.reshape(tf.dynamic_stitch(positions, rows), [-1, self.dim + 1])
        found, code = read[:, :self.dim], tf.bitcast(read[:, self.dim], tf.int32)
        starts = asked != SUBSTITUTE_KEY  # a reserved key reads zeros
        if self.policy.min_frequency > 1:
            starts &= code != -2
        start = tf.where(starts[:, None], initial_rows(asked, self.dim, self.init), tf.zeros_like(found))
        return tf.where((code >= 0)[:, None], found, start), (positions, states)

    def parts(self, state, gradient) -> list:
        """`fused_admission.Part`s of a `train_lookup` with a capacity: each shard's keys, their
        sightings and gradient rows (only a shard's rows travel to its ps)."""
        from psclient._coordinator.tables.fused_admission import Part

        positions, states = state
        return [Part(self.serial, self.name, shard, keys, seen, tf.gather(gradient, position), self.init)
                for shard, position, (keys, seen) in zip(self.shards, positions, states)]

    def _split_like(self, values, keys):
        n = len(self.shards)
        return [values] if n == 1 else tf.dynamic_partition(values, shard_of(keys, n), n)

    def _admit(self, shard, keys, seen_now):
        policy = self.policy
        # One read: `assign_add`'s result is read again at each use, and another worker's step can
        # move the clock between two reads (the TTL test and the step recorded would differ).
        clock = tf.convert_to_tensor(shard.clock.assign_add(1))
        keys = tf.reshape(keys, [-1])
        tracked = tf.reshape(shard.counters.lookup(keys), [-1, 2])
        count, last = tracked[:, 0], tracked[:, 1]
        if policy.ttl_steps is not None:
            count = tf.where(clock - last > policy.ttl_steps, tf.zeros_like(count), count)
        total = count + seen_now
        admitted = total >= policy.min_frequency
        fresh = admitted & (count < policy.min_frequency)
        with tf.control_dependencies([self._check_batch(tf.reduce_sum(tf.cast(admitted, tf.int32)))]):
            write = shard.counters.insert(keys, tf.stack([total, tf.fill(tf.shape(total), clock)], axis=1))
        new_keys = tf.boolean_mask(keys, fresh)
        with tf.control_dependencies([write]):
            admit = shard.values.insert(new_keys, initial_rows(new_keys, self.dim, self.init))
            shard.admissions.assign_add(tf.reduce_sum(tf.cast(fresh, tf.int64)))
        with tf.control_dependencies([admit] + shard.mark(keys, [write, admit])):
            found = tf.reshape(shard.values.lookup(keys), [-1, self.dim])
        return tf.where(admitted[:, None], found, tf.zeros_like(found)), admitted, fresh

    def _check_batch(self, brought):
        """A batch's own rows on one ps task (`brought`, int32) must fit in its share, or they would
        evict each other."""
        if self.share is None:
            return tf.no_op()
        # tf.Assert with int32 and string data only: a single op, no conditional around it.
        return tf.debugging.Assert(brought <= self.share, [
            f"Invalid value for argument `capacity` of DynamicEmbedding {self.name!r}. Received: "
            f"capacity={self.policy.capacity} ({self.share} rows per ps task). Expected at least the distinct "
            "admitted keys one batch brings to one ps task; this batch brought", brought])

    # --------------------------------------------------------------- update
    def apply(self, state, gradient, rule: Callable) -> list:
        """Update the admitted rows of a `train_lookup` of a table without a capacity with `gradient`
        (one row per key), on their ps (a bounded table's: `parts`, fused_admission).

        `rule(rows, gradient, slots) -> (rows, slots)`, `slots` a dict of the
        slot tables' values for those rows (a freshly admitted row's slots
        start from their initial values). Then the shard is scanned for
        evictions when the policy says so. Returns the ops.
        """
        positions, states = state
        ops = []
        for shard, position, (keys, admitted, fresh, at) in zip(self.shards, positions, states):
            grad = tf.gather(gradient, position)  # this shard's rows only travel to it
            with shard.placed():
                # Rows another worker's scan evicted since the lookup are not
                # written back (that would leave rows without counters).
                admitted = admitted & (tf.reshape(shard.counters.lookup(keys), [-1, 2])[:, 0] > 0)
                keys_a = tf.boolean_mask(keys, admitted)
                grad = tf.reshape(tf.boolean_mask(grad, admitted), [-1, self.dim])
                fresh_a = tf.boolean_mask(fresh, admitted)[:, None]
                rows = tf.reshape(shard.values.lookup(keys_a), [-1, self.dim])
                slots = {}
                for slot, table in shard.slots.items():
                    start = tf.fill(tf.shape(grad), tf.constant(self.slot_defaults[slot], tf.float32))
                    slots[slot] = tf.where(fresh_a, start, table.lookup(keys_a))
                rows, slots = rule(rows, grad, slots)
                writes = [shard.values.insert(keys_a, rows)]
                writes += [shard.slots[slot].insert(keys_a, value) for slot, value in slots.items()]
                writes += shard.mark(keys_a, writes)
                with tf.control_dependencies(writes):
                    # Only where a scan can remove counters (ttl_steps or a capacity): without one
                    # every row keeps its counter, and the step is spared the clearing's ops. Side by
                    # side with the scan: they may run in either order (each keeps a row with its
                    # counter), and chained they lengthened a step's path on the ps.
                    if self.policy.ttl_steps is not None or self.share is not None:
                        ops += shard.clear_orphans(keys)
                    ops.append(self._maybe_evict(shard))
        return ops

    def _maybe_evict(self, shard):
        policy, share = self.policy, self.share
        due = tf.constant(False)
        if share is not None:
            due = due | (shard.values.size() > share) | (shard.counters.size() - shard.values.size() > share)
        every = rules.scan_every(policy.ttl_steps)
        if every is not None:
            due = due | (shard.clock.read_value() % every == 0)
        return called_cond(due, lambda: shard.evict(policy, share), lambda: tf.constant(0, tf.int64))

    def scan(self) -> int:
        """Run the eviction scan on every shard now (training runs it when due); return rows evicted."""
        return on_ps(self.owner(), self._scan, f"scanning dynamic table {self.name!r}")

    def _scan(self) -> int:
        before = sum(int(shard.evictions.read_value()) for shard in self.shards)
        for shard in self.shards:
            with shard.placed():
                shard.scan() if shard.dense else shard.evict(self.policy, self.share)
        return sum(int(shard.evictions.read_value()) for shard in self.shards) - before

    # ------------------------------------------------------------ state out
    def stats(self) -> list[dict]:
        """Per shard: rows, keys tracked (rows and keys counting towards admission), admissions, evictions,
        clock, and for a table with a capacity the bytes its storage holds. A lost ps is waited for
        (`_shard_stats_or_unavailable`); one the recovery gave up on gives `{"ps": k, "available": False, ...}`."""
        return [_shard_stats_or_unavailable(self, index) for index in range(len(self.shards))]

    def shard_stats(self, index: int) -> dict:
        """One shard's `stats()` entry (read on its ps: a bounded table's in one traced call)."""
        shard = self.shards[index]
        with shard.placed():
            values = shard.stats_values().numpy().tolist() if shard.dense else [int(v) for v in (
                shard.values.size(), shard.counters.size(), shard.admissions.read_value(),
                shard.evictions.read_value(), shard.clock.read_value())]
        names = ("rows", "tracked_keys", "admissions", "evictions", "clock", "table_bytes")
        return {"ps": index if shard.device else None, **dict(zip(names, values))}

    def export_shard(self, index: int) -> dict:
        """One shard's whole state as numpy arrays: keys, rows, slots, counters and clocks.

        Runs on the shard's ps; only the result crosses to the caller.
        """
        return on_ps(self.owner(), lambda: self._export_shard(index), f"exporting dynamic table {self.name!r}")

    def _export_shard(self, index: int) -> dict:
        import numpy as np
        shard = self.shards[index]
        with shard.placed():
            if shard.dense:
                keys, tracked, row_keys, rows, slots = shard.saved()
            else:
                keys, tracked = export(shard.counters)
                row_keys, rows = export(shard.values)
                slots = {name: table.lookup(row_keys) for name, table in shard.slots.items()}
        return {
            "keys": keys.numpy(), "counters": tracked.numpy(), "row_keys": row_keys.numpy(),
            "rows": rows.numpy(), "slots": {k: v.numpy() for k, v in slots.items()},
            "clock": np.int64(shard.clock.numpy()), "admissions": np.int64(shard.admissions.numpy()),
            "evictions": np.int64(shard.evictions.numpy()),
        }

    def import_shards(self, states: list[dict]) -> None:
        """Replace the table's contents with exported shards (any number: keys are split again).

        Clocks: the largest exported one on every shard (so no key looks
        older than it was); admissions and evictions: summed onto shard 0.
        Made again whole after a ps loss (each shard's contents are replaced).
        """
        on_ps(self.owner(), lambda: self._import_shards(states), f"importing dynamic table {self.name!r}")

    def _import_shards(self, states: list[dict]) -> None:
        import numpy as np
        def cat(name, width=None):
            parts = [s[name] for s in states]
            return np.concatenate(parts) if parts else np.zeros((0,) if width is None else (0, width))

        keys, counters = cat("keys"), cat("counters", 2).astype("int64")
        row_keys, rows = cat("row_keys"), cat("rows", self.dim).astype("float32")
        slot_names = set().union(*(s["slots"] for s in states)) if states else set()
        slots = {n: np.concatenate([s["slots"][n] for s in states]).astype("float32") for n in slot_names}
        clock = max((int(s["clock"]) for s in states), default=0)
        n = len(self.shards)
        owner = shard_of(tf.constant(keys, tf.int64), n).numpy() if n > 1 else np.zeros(len(keys), int)
        row_owner = shard_of(tf.constant(row_keys, tf.int64), n).numpy() if n > 1 else np.zeros(len(row_keys), int)
        for index, shard in enumerate(self.shards):
            mine, mine_rows = owner == index, row_owner == index
            total = {f: sum(int(s[f]) for s in states) if index == 0 else 0 for f in ("admissions", "evictions")}
            with tf.device(coordinator_cpu()):  # made here: under the ps's device TF copies them holding the GIL
                keys_in, counters_in = tf.constant(keys[mine], tf.int64), tf.constant(counters[mine], tf.int64)
                row_keys_in, rows_in = tf.constant(row_keys[mine_rows], tf.int64), tf.constant(rows[mine_rows])
                slots_in = {n: tf.constant(v[mine_rows]) for n, v in slots.items() if n in shard.slots}
                clock_in = tf.constant(clock, tf.int64)
                admissions, evictions = (tf.constant(total[f], tf.int64) for f in ("admissions", "evictions"))
            with shard.placed():
                shard.replace(keys_in, counters_in, row_keys_in, rows_in, slots_in, clock_in, admissions, evictions)
