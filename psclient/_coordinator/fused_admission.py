"""One admission and one update per ps task for all the bounded tables a training step touched.

A `DynamicEmbedding` layer's admission and update cost hundreds of ops per
ps task, whatever the number of keys, and a ps runs a step's ops at a few
microseconds each: 26 layers, one per feature, spent most of a step there
(docs/dynamic_embeddings.md, "Speed and memory"). So a training step's
forward pass only reads rows (`DenseShard.peek`: a row's key not yet held
reads the row its admission will start it from), and when the optimizer
applies the gradient, the shards of one ps task that are alike (same share,
width, policy, initializer and slots) are admitted and updated together:

- each table keeps its own variables, key index and counters, so
  checkpoints, stats and recovery see no difference; the shards of one ps
  task share one lock (`stores.table_lock`), which a step's section holds;
- what only reads and computes (which keys hold rows, which rows the LRU
  frees, where new rows go, the optimizer's arithmetic) runs once on the
  shards' counters stacked [shards, share]; what touches a table's own
  resources (index lookups and inserts, the writes) is a few ops per table.

The rules are those of `DenseShard._admit` (and `psclient._core.dynamic_tables`),
per shard: least recently used rows go first (ties: the smaller key), down
to the share minus the headroom; the batch's own rows are never victims.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator.dense_shard import _NEWEST, in_turn, live_rows, scan_when_due, vector
from psclient._coordinator.key_hash import initial_rows
from psclient._core import dynamic_tables as rules

__all__ = ["Part", "apply_parts"]


@dataclasses.dataclass
class Part:
    """One shard's share of a step: its keys (unique, on the ps), their sightings and gradient rows."""

    order: int  # the table's serial: locks are taken in this order
    name: str
    shard: Any
    keys: Any
    seen: Any
    gradient: Any
    init: tuple  # the table's initializer (see `initial_rows`)


def apply_parts(parts: list[Part], rule: Callable) -> list:
    """Admit and update `parts` (from any tables and ps tasks), one locked section per group of alike shards."""
    groups: dict = {}
    for part in sorted(_one_per_shard(parts), key=lambda p: p.order):
        shard = part.shard
        alike = (shard.device, shard.share, shard.dim, shard.policy, tuple(sorted(shard.slots)), part.init[0])
        groups.setdefault(alike, []).append(part)
    ops = []
    for group in groups.values():
        with group[0].shard.placed():
            done = in_turn(lambda group=group: _locked(group, rule), [p.keys for p in group])
        if group[0].shard.policy.ttl_steps is not None or group[0].shard.policy.min_frequency > 1:
            for part in group:  # expiry and keys still counting are the scan's (run_due_scans)
                scan_when_due(part.shard, [done])
        ops.append(done)
    return ops


def _one_per_shard(parts: list[Part]) -> list[Part]:
    """A layer called more than once in a step (one table for two inputs) gave a shard several parts:
    one part per shard, its keys unique, their sightings and gradients summed."""
    by_shard: dict = {}
    for part in parts:
        by_shard.setdefault(id(part.shard), []).append(part)
    merged = []
    for same in by_shard.values():
        if len(same) == 1:
            merged.append(same[0])
            continue
        with same[0].shard.placed():
            keys, index = tf.unique(tf.concat([tf.reshape(p.keys, [-1]) for p in same], 0))
            n = tf.size(keys)
            seen = tf.math.unsorted_segment_sum(tf.concat([tf.reshape(p.seen, [-1]) for p in same], 0), index, n)
            gradient = tf.math.unsorted_segment_sum(tf.concat([p.gradient for p in same], 0), index, n)
        merged.append(dataclasses.replace(same[0], keys=keys, seen=seen, gradient=gradient))
    return merged


def _locked(group: list[Part], rule: Callable):
    lock = group[0].shard.lock  # the shards of one ps task share it (stores.table_lock)
    assert all(part.shard.lock is lock for part in group), "shards of one group under different locks"
    return lock.execute(lambda: _admit_and_update(group, rule), exclusive_resource_access=False)


def _least_recent_rows(keys, last, member, k):
    """Per row of [G, S] `last`: a mask of its `k[g]` least recently seen members (ties: the smaller key)."""
    masked = tf.where(member, last, tf.constant(_NEWEST, tf.int64))
    width = tf.shape(last)[1]
    top_k = tf.cast(tf.clip_by_value(tf.reduce_max(k), 1, tf.cast(width, tf.int64)), tf.int32)
    newest_first = tf.math.top_k(tf.bitwise.invert(masked), k=top_k, sorted=True).values
    # The k-th smallest step of each row (none for k == 0).
    at = tf.maximum(tf.cast(k, tf.int32) - 1, 0)
    threshold = tf.bitwise.invert(tf.gather(newest_first, at[:, None], batch_dims=1)[:, 0])
    threshold = tf.where(k > 0, threshold, tf.constant(-_NEWEST, tf.int64))
    below = member & (last < threshold[:, None])
    tie = member & (last == threshold[:, None])
    needed = k - tf.reduce_sum(tf.cast(below, tf.int64), 1)
    tie_keys = tf.where(tie, keys, tf.constant(_NEWEST, tf.int64))
    smallest = tf.math.top_k(tf.bitwise.invert(tie_keys), sorted=True,
                             k=tf.cast(tf.clip_by_value(tf.reduce_max(needed), 1, tf.cast(width, tf.int64)), tf.int32)).values
    upto = tf.bitwise.invert(tf.gather(smallest, tf.maximum(tf.cast(needed, tf.int32) - 1, 0)[:, None],
                                       batch_dims=1)[:, 0])
    upto = tf.where(needed > 0, upto, tf.constant(-_NEWEST, tf.int64))
    return below | (tie & (keys <= upto[:, None]) & (needed[:, None] > 0))


def _admit_and_update(group: list[Part], rule: Callable):
    shards = [part.shard for part in group]
    first = shards[0]
    policy, share, dim = first.policy, first.share, first.dim
    count = len(group)
    sizes = [tf.size(part.keys) for part in group]
    keys = tf.concat([tf.reshape(part.keys, [-1]) for part in group], 0)
    seen = tf.concat([tf.reshape(part.seen, [-1]) for part in group], 0)
    seg = tf.repeat(tf.range(count, dtype=tf.int64), tf.stack(sizes))
    clock = tf.stack([shard.clock.assign_add(1) for shard in shards])
    clock_k = tf.gather(clock, seg)

    usable = first.index.usable(keys)
    asked = tf.split(tf.where(usable, keys, tf.zeros_like(keys)), sizes)
    at = tf.concat([tf.cast(tf.reshape(shard.index.table.lookup(k), [-1]), tf.int64)
                    for shard, k in zip(shards, asked)], 0)
    at = tf.where(usable, at, -1)
    last = tf.concat([vector(shard.last) for shard in shards], 0)  # [G * S]
    held_keys = tf.concat([vector(shard.row_key) for shard in shards], 0)
    offset = seg * share
    flat = offset + tf.maximum(at, 0)
    have = (at >= 0) & (tf.gather(held_keys, flat) == keys) & (tf.gather(last, flat) >= 0)
    removals = [[] for _ in shards]
    if policy.ttl_steps is not None:  # an expired row is freed; its key is admitted afresh
        stale = have & (clock_k - tf.gather(last, flat) > policy.ttl_steps)
        last = tf.tensor_scatter_nd_update(last, tf.boolean_mask(flat, stale)[:, None],
                                           tf.fill(tf.shape(tf.boolean_mask(flat, stale)), tf.constant(-1, tf.int64)))
        for g, gone in enumerate(tf.dynamic_partition(keys, tf.cast(seg, tf.int32) * tf.cast(stale, tf.int32)
                                                      + tf.cast(~stale, tf.int32) * count, count + 1)[:count]):
            removals[g].append(gone)
        have &= ~stale
    minimum = policy.min_frequency
    if minimum > 1:
        waiting = tf.concat([tf.reshape(shard.pending.lookup(k), [-1, 2]) for shard, k in
                             zip(shards, tf.split(keys, sizes))], 0)
        counted = waiting[:, 0]
        if policy.ttl_steps is not None:
            counted = tf.where(clock_k - waiting[:, 1] > policy.ttl_steps, tf.zeros_like(counted), counted)
        total = tf.where(have, tf.constant(minimum, tf.int64), counted + seen)
        admitted = (total >= minimum) & usable
    else:
        admitted = usable
    fresh = admitted & ~have
    seg32 = tf.cast(seg, tf.int32)
    admitted_per_shard = tf.math.unsorted_segment_sum(tf.cast(admitted, tf.int64), seg32, count)
    need = tf.math.unsorted_segment_sum(tf.cast(fresh, tf.int64), seg32, count)
    checks = [tf.debugging.Assert(tf.reduce_all(admitted_per_shard <= share), [
        f"Invalid value for argument `capacity` of DynamicEmbedding {group[0].name!r} (or of another table "
        f"on its ps, of {[part.name for part in group]}): {share} rows per ps task. Expected at least the "
        "distinct admitted keys one batch brings to one ps task; this batch brought",
        tf.cast(tf.reduce_max(admitted_per_shard), tf.int32)])]
    if minimum > 1:
        counting = ~admitted
        for g, (shard, g_keys, g_total, g_count, g_fresh) in enumerate(zip(
                shards, tf.split(keys, sizes), tf.split(total, sizes), tf.split(counting, sizes),
                tf.split(fresh, sizes))):
            g_clock = tf.fill(tf.shape(tf.boolean_mask(g_total, g_count)), clock[g])
            checks.append(shard.pending.insert(tf.boolean_mask(g_keys, g_count),
                                               tf.stack([tf.boolean_mask(g_total, g_count), g_clock], 1)))
            checks.append(shard.pending.remove(tf.boolean_mask(g_keys, g_fresh)))

    # The batch's rows are seen now: never this step's victims.
    kept = tf.boolean_mask(flat, have)
    last = tf.tensor_scatter_nd_update(last, kept[:, None], tf.boolean_mask(clock_k, have))
    last2d = tf.reshape(last, [count, share])
    keys2d = tf.reshape(held_keys, [count, share])
    held = tf.reduce_sum(tf.cast(last2d >= 0, tf.int64), 1)
    excess = tf.maximum(held + need - share, 0)
    excess = tf.where(excess > 0, held + need - (share - rules.headroom(share)), excess)

    def evict():
        member = (last2d >= 0) & (last2d != clock[:, None])
        k = tf.minimum(excess, tf.reduce_sum(tf.cast(member, tf.int64), 1))
        return _least_recent_rows(keys2d, last2d, member, k)

    gone = tf.cond(tf.reduce_any(excess > 0), evict, lambda: tf.zeros_like(last2d, tf.bool))
    victims = tf.reshape(tf.where(tf.reshape(gone, [-1])), [-1])
    victim_seg = tf.cast(victims // share, tf.int32)
    evicted = tf.math.unsorted_segment_sum(tf.ones_like(victims), victim_seg, count)
    for g, gone_keys in enumerate(tf.dynamic_partition(tf.gather(held_keys, victims), victim_seg, count)):
        removals[g].append(gone_keys)
    last = tf.tensor_scatter_nd_update(last, victims[:, None], tf.fill(tf.shape(victims), tf.constant(-1, tf.int64)))

    # New rows: the first `need` free rows of each shard, in the order of its fresh keys.
    free = tf.reshape(last, [count, share]) < 0
    rank = tf.cumsum(tf.cast(free, tf.int64), axis=1)
    places = tf.reshape(tf.where(tf.reshape(free & (rank <= need[:, None]), [-1])), [-1])
    new_keys = tf.boolean_mask(keys, fresh)
    new_seg = tf.boolean_mask(seg32, fresh)
    last = tf.tensor_scatter_nd_update(last, places[:, None], tf.gather(clock, new_seg))
    held_keys = tf.tensor_scatter_nd_update(held_keys, places[:, None], new_keys)
    positions = tf.scatter_nd(tf.where(fresh), places, tf.shape(keys, tf.int64))
    at = tf.where(have, flat, tf.where(fresh, positions, -1))  # flat rows of the admitted keys

    writes = list(checks)
    last2d, keys2d = tf.reshape(last, [count, share]), tf.reshape(held_keys, [count, share])
    local_places = places - tf.cast(new_seg, tf.int64) * share
    new_parts = tf.dynamic_partition(new_keys, new_seg, count)
    place_parts = tf.dynamic_partition(local_places, new_seg, count)
    # The new rows of every table at once, each key drawn with its own table's initializer.
    kind = group[0].init[0]
    a, b, seed = (tf.gather(tf.constant([part.init[i] for part in group], dtype), new_seg)
                  for i, dtype in ((1, tf.float64), (2, tf.float64), (3, tf.int64)))
    start_parts = tf.dynamic_partition(initial_rows(new_keys, dim, (kind, a, b, seed)), new_seg, count)
    for g, (shard, part) in enumerate(zip(shards, group)):
        gone = tf.concat(removals[g], 0) if removals[g] else None
        if gone is not None:
            writes.append(shard.index.remove(gone))
        with tf.control_dependencies(writes[-1:] if gone is not None else []):
            writes.append(shard.index.insert(new_parts[g], place_parts[g]))
        writes.append(shard.last.assign(last2d[g], read_value=False))
        writes.append(shard.row_key.assign(keys2d[g], read_value=False))
        writes.append(shard.rows.scatter_update(tf.IndexedSlices(start_parts[g], place_parts[g])))
        for name, var in shard.slots.items():
            fill = tf.fill(tf.stack([tf.size(place_parts[g]), dim]), tf.constant(shard.slot_defaults[name], tf.float32))
            writes.append(var.scatter_update(tf.IndexedSlices(fill, place_parts[g])))
        writes.append(shard.admissions.assign_add(need[g], read_value=False))
        writes.append(shard.evictions.assign_add(evicted[g], read_value=False))

    with tf.control_dependencies(writes):
        valid = at >= 0
        rows_at = tf.dynamic_partition(tf.boolean_mask(at - seg * share, valid), tf.boolean_mask(seg32, valid), count)
        gradient = tf.reshape(tf.boolean_mask(tf.concat([part.gradient for part in group], 0), valid), [-1, dim])
        rows = tf.concat([tf.reshape(tf.gather(shard.rows, r), [-1, dim]) for shard, r in zip(shards, rows_at)], 0)
        slots = {name: tf.concat([tf.reshape(tf.gather(shard.slots[name], r), [-1, dim])
                                  for shard, r in zip(shards, rows_at)], 0) for name in first.slots}
        rows, slots = rule(rows, gradient, slots)
        counts = [tf.size(r) for r in rows_at]
        updates = []
        for shard, r, new_rows, *new_slots in zip(shards, rows_at, tf.split(rows, counts),
                                                   *(tf.split(slots[name], counts) for name in first.slots)):
            updates.append(shard.rows.scatter_update(tf.IndexedSlices(new_rows, r)))
            updates += [shard.slots[name].scatter_update(tf.IndexedSlices(value, r))
                        for name, value in zip(first.slots, new_slots)]
    with tf.control_dependencies(updates):
        rebuilt = [shard.index.rebuild_if_worn(lambda g=g, shard=shard: live_rows(keys2d[g], last2d[g]))
                   for g, shard in enumerate(shards)]
    with tf.control_dependencies(rebuilt):
        return tf.identity(clock[0])
