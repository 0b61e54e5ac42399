"""One admission and one update per ps task for all the bounded tables a training step touched.

A step's cost on a ps is mostly its ops and the tensors it receives and
sends, not its keys: 26 `DynamicEmbedding` layers, one per feature, each
with its own admission and update, spent most of a step there
(docs/dynamic_embeddings.md, "Speed and memory"). So a training step's
forward pass only reads rows (`DenseShard.peek`), and when the optimizer
applies the gradient, the shards of one ps task that are alike (same share,
width, policy, initializer and slots) are admitted and updated together, in
one section under the ps's table lock (`stores.table_lock`):

- each table keeps its own variables, key index, free stack and counters,
  so checkpoints, stats and recovery see no difference;
- the arithmetic runs once for the group: which keys hold rows, how many
  new rows each shard needs, the first rows of new keys, the optimizer's
  rule; each table's own lookups, pops from its free stack and writes are
  a few ops, on the step's rows only;
- only a shard with fewer free rows than new keys evicts: then the
  last-seen steps of those shards, stacked [short shards, share], go
  through one batched LRU selection (the one pass over whole shards).

The rules are those of `psclient._core.dynamic_tables`, per shard: least
recently used rows go first (ties: the smaller key), down to the share
minus the headroom; the batch's own rows are never victims.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator.tables.dense_shard import in_turn, vector
from psclient._coordinator.tables.key_hash import initial_rows
from psclient._coordinator.tables.key_index import SUBSTITUTE_KEY, find
from psclient._coordinator.tables.least_recent import least_recent_rows
from psclient._core import dynamic_tables as rules
from psclient._tf.control_flow import called_cond
from psclient._tf.context import locked

__all__ = ["Part", "apply_parts"]


@dataclasses.dataclass
class Part:
    """One shard's share of a step: its keys (unique, on the ps), their sightings and gradient rows."""

    order: int  # the table's serial: locks are taken in this order
    name: str
    shard: Any
    keys: Any
    seen: Any  # None where the policy needs no sightings (min_frequency=1)
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
            # Received on the ps before the section: a tensor from the worker used in it would
            # also be sent again, in full, for the lock's wait on the section's inputs.
            group = [dataclasses.replace(p, keys=tf.identity(p.keys), gradient=tf.identity(p.gradient),
                                         seen=None if p.seen is None else tf.identity(p.seen)) for p in group]
            inputs = [t for p in group for t in (p.keys, p.gradient, p.seen) if t is not None]
            done = in_turn(lambda group=group: _locked(group, rule), inputs, group[0].shard.lock)
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
            seen = None if same[0].seen is None else tf.math.unsorted_segment_sum(
                tf.concat([tf.reshape(p.seen, [-1]) for p in same], 0), index, n)
            gradient = tf.math.unsorted_segment_sum(tf.concat([p.gradient for p in same], 0), index, n)
        merged.append(dataclasses.replace(same[0], keys=keys, seen=seen, gradient=gradient))
    return merged


def _locked(group: list[Part], rule: Callable):
    lock = group[0].shard.lock  # the shards of one ps task share it (stores.table_lock)
    assert all(part.shard.lock is lock for part in group), "shards of one group under different locks"
    try:
        return locked(lock, lambda: _admit_and_update(group, rule))  # apart from other ps's sections
    except tf.errors.OpError as error:  # run eagerly, e.g. the capacity check (traced, nothing raises here)
        # Eagerly, the lock is a tensor in `execute`'s frame: a traceback holding that frame would
        # hold the lock, and every later step would wait for it. Raised without it.
        raise error.with_traceback(None) from None


def _free_stale(shards, keys, at, seg, stale):
    """Free the rows of the `stale` keys (expired, not yet scanned) of a group; returns True."""
    stale_at = tf.reshape(tf.where(stale), [-1])
    stale_seg = tf.gather(seg, stale_at)
    gone_keys = tf.dynamic_partition(tf.gather(keys, stale_at), stale_seg, len(shards))
    gone_rows = tf.dynamic_partition(tf.gather(at, stale_at), stale_seg, len(shards))
    ops = []
    for shard, shard_keys, shard_rows in zip(shards, gone_keys, gone_rows):
        ops += shard.free_rows(shard_keys, shard_rows)
    with tf.control_dependencies(ops):
        return tf.constant(True)


def _admit_and_update(group: list[Part], rule: Callable):
    shards = [part.shard for part in group]
    first = shards[0]
    policy, share, dim = first.policy, first.share, first.dim
    count = len(group)
    sizes = [tf.size(part.keys) for part in group]
    keys = tf.concat([tf.reshape(part.keys, [-1]) for part in group], 0)  # asked keys (KeyIndex.asked)
    # Which table of the group each key is for. One table (the common case): all zeros, without
    # tf.repeat's dozen ops on the ps every step.
    seg = tf.zeros(sizes[:1], tf.int32) if count == 1 else tf.repeat(tf.range(count), tf.stack(sizes))
    clock = tf.stack([shard.clock.assign_add(1) for shard in shards])
    clock_k = tf.gather(clock, seg)
    # The keys as computed from this step's clocks, which only the lock's holder reads: so no
    # lookup below has the same inputs as the forward pass's lookup of the same keys, made
    # without the lock, and TF's graph optimizer cannot merge the two (it did: a key admitted by
    # another worker's step in between was admitted a second time).
    keys = tf.where(clock_k >= 0, keys, tf.constant(SUBSTITUTE_KEY, tf.int64))
    key_parts = tf.split(keys, sizes)  # in the order of the shards: so is every mask over them

    # Under the lock the index is exact: a key it finds holds that row.
    at = tf.cast(tf.concat([tf.reshape(shard.index.find(k), [-1]) for shard, k in zip(shards, key_parts)], 0),
                 tf.int64)
    have = at >= 0
    freed = []
    if policy.ttl_steps is not None:  # an expired row is freed; its key is admitted afresh
        last_at = tf.concat([vector(shard.last, tf.maximum(a, 0)) for shard, a in zip(shards, tf.split(at, sizes))], 0)
        stale = have & (clock_k - last_at > policy.ttl_steps)
        # Rare (a key seen again between its expiry and the scan that frees it): the freeing ops,
        # a dozen per shard, run only when some key of the group is stale.
        freed.append(called_cond(tf.reduce_any(stale), lambda: _free_stale(shards, keys, at, seg, stale),
                             lambda: tf.constant(False)))
        have &= ~stale
        at = tf.where(stale, tf.constant(-1, tf.int64), at)
    usable = keys != SUBSTITUTE_KEY  # a reserved key was asked for as this one
    minimum = policy.min_frequency
    if minimum > 1:
        waiting = tf.concat([tf.reshape(find(shard.pending, k, [0, -1]), [-1, 2]) for shard, k in zip(shards, key_parts)], 0)
        counted = waiting[:, 0]
        if policy.ttl_steps is not None:
            counted = tf.where(clock_k - waiting[:, 1] > policy.ttl_steps, tf.zeros_like(counted), counted)
        seen = tf.concat([tf.reshape(part.seen, [-1]) for part in group], 0)
        total = tf.where(have, tf.constant(minimum, tf.int64), counted + seen)
        admitted = (total >= minimum) & usable
    else:
        admitted = usable
    fresh = admitted & ~have
    admitted_per_shard = tf.math.unsorted_segment_sum(tf.cast(admitted, tf.int64), seg, count)
    need = tf.math.unsorted_segment_sum(tf.cast(fresh, tf.int64), seg, count)
    checks = [tf.debugging.Assert(tf.reduce_all(admitted_per_shard <= share), [
        f"Invalid value for argument `capacity` of DynamicEmbedding {_names(group)}. Received: capacity="
        f"{first.policy.capacity} ({share} rows per ps task). Expected at least the distinct admitted keys one "
        "batch brings to one ps task; this batch brought", tf.cast(tf.reduce_max(admitted_per_shard), tf.int32)])]
    # The masks' positions, found once each and gathered from: what tf.boolean_mask gives, without
    # its dozens of ops per call (per shard and step, on the ps).
    fresh_where = tf.where(fresh)
    fresh_at, admitted_at = tf.reshape(fresh_where, [-1]), tf.reshape(tf.where(admitted), [-1])
    new_keys, new_seg = tf.gather(keys, fresh_at), tf.gather(seg, fresh_at)
    new_key_parts = tf.dynamic_partition(new_keys, new_seg, count)
    if minimum > 1:
        # Keys still counting: their sightings and this step's clock, for the whole group at once,
        # then split by shard (one partition); admitted ones leave the table.
        counting_at = tf.reshape(tf.where(~admitted), [-1])
        counting_seg = tf.gather(seg, counting_at)
        counting_keys = tf.dynamic_partition(tf.gather(keys, counting_at), counting_seg, count)
        counting_state = tf.dynamic_partition(
            tf.stack([tf.gather(total, counting_at), tf.gather(clock_k, counting_at)], 1), counting_seg, count)
        for shard, g_keys, g_state, g_new in zip(shards, counting_keys, counting_state, new_key_parts):
            checks.append(shard.pending.insert(g_keys, g_state))
            checks.append(shard.pending.remove(g_new))

    # A shard with fewer free rows than new keys evicts, down to the share minus the headroom.
    with tf.control_dependencies(freed):
        free = tf.stack([shard.free_count.read_value() for shard in shards])
    short = need - free

    def evict():
        # Only the short shards are searched ([M, S], M of the G short; a shard holds exactly its
        # share): the alike shards of a group fill at their own pace, so most evictions involve one
        # of them, and the search over all G (top_k over G x S, with the masks before it) cost up
        # to a tenth of a step's ps CPU at 26 tables, once the tables were full.
        wanted = tf.reshape(tf.where(short > 0), [-1])
        m = tf.size(wanted, tf.int64)
        all_keys = tf.reshape(tf.concat([vector(shard.row_key) for shard in shards], 0), [count, share])
        last2d = tf.gather(tf.reshape(tf.concat([vector(shard.last) for shard in shards], 0), [count, share]), wanted)
        keys2d = tf.gather(all_keys, wanted)
        # Each shard's row in [M, S] (-1: not searched); the batch's rows of those are never this step's victims.
        slot = tf.tensor_scatter_nd_update(tf.fill([count], tf.constant(-1, tf.int64)), wanted[:, None],
                                           tf.range(m))
        held_slot = tf.gather(slot, seg)
        mine = tf.boolean_mask(tf.stack([held_slot, at], 1), have & (held_slot >= 0))
        seen_now = tf.scatter_nd(mine, tf.ones(tf.shape(mine)[:1], tf.int32), tf.stack([m, share])) > 0
        member = (last2d >= 0) & ~seen_now
        excess = tf.gather(share - free + need - (share - rules.headroom(share)), wanted)
        found = least_recent_rows(keys2d, last2d, member,
                                  tf.minimum(excess, tf.reduce_sum(tf.cast(member, tf.int64), 1)))
        gone = tf.scatter_nd(wanted[:, None], tf.cast(found, tf.int8), [count, share]) > 0
        ops = []
        for g, shard in enumerate(shards):
            victims = tf.reshape(tf.where(gone[g]), [-1])
            ops += shard.free_rows(tf.gather(all_keys[g], victims), victims)
        with tf.control_dependencies(ops):
            return tf.constant(True)

    evicted = called_cond(tf.reduce_any(short > 0), evict, lambda: tf.constant(False))

    # New rows: popped from each shard's free stack, in the order of its fresh keys.
    with tf.control_dependencies([evicted, *checks]):
        popped = [shard.pop_free(n) for shard, n in zip(shards, tf.unstack(need))]
    places = [rows for rows, _ in popped]
    at = tf.tensor_scatter_nd_update(at, fresh_where, tf.concat(places, 0))
    admitted_seg = tf.gather(seg, admitted_at)
    rows_at = tf.dynamic_partition(tf.gather(at, admitted_at), admitted_seg, count)  # held and new rows
    # The new rows of every table at once, each key drawn with its own table's initializer.
    kind = group[0].init[0]
    a, b, seed = (tf.gather(tf.constant([part.init[i] for part in group], dtype), new_seg)
                  for i, dtype in ((1, tf.float64), (2, tf.float64), (3, tf.int64)))
    start_parts = tf.dynamic_partition(initial_rows(new_keys, dim, (kind, a, b, seed)), new_seg, count)
    writes = []
    for shard, (place, pop), new, start, rows, step, n in zip(
            shards, popped, new_key_parts, start_parts, rows_at,
            tf.unstack(clock), tf.unstack(need)):
        with tf.control_dependencies([pop]):
            writes.append(shard.index.insert(new, place))
        writes.append(shard.row_key.scatter_update(tf.IndexedSlices(new, place)))
        writes.append(shard.rows.scatter_update(tf.IndexedSlices(start, place)))
        for name, var in shard.slots.items():
            fill = tf.fill(tf.stack([tf.size(place), dim]), tf.constant(shard.slot_defaults[name], tf.float32))
            writes.append(var.scatter_update(tf.IndexedSlices(fill, place)))
        writes.append(shard.last.scatter_update(tf.IndexedSlices(tf.fill(tf.shape(rows), step), rows)))
        writes.append(shard.admissions.assign_add(n, read_value=False))

    with tf.control_dependencies(writes):
        gradient = tf.reshape(tf.gather(tf.concat([part.gradient for part in group], 0), admitted_at), [-1, dim])
        rows = tf.concat([tf.reshape(tf.gather(shard.rows, r), [-1, dim]) for shard, r in zip(shards, rows_at)], 0)
        slots = {name: tf.concat([tf.reshape(tf.gather(shard.slots[name], r), [-1, dim])
                                  for shard, r in zip(shards, rows_at)], 0) for name in first.slots}
        rows, slots = rule(rows, gradient, slots)
        # The slots the rule updates: after a compile with another optimizer, the shards also hold
        # the earlier one's, which stay as they are.
        names = list(slots)
        counts = [tf.size(r) for r in rows_at]
        updates = []
        for shard, r, new_rows, *new_slots in zip(shards, rows_at, tf.split(rows, counts),
                                                   *(tf.split(slots[name], counts) for name in names)):
            updates.append(shard.rows.scatter_update(tf.IndexedSlices(new_rows, r)))
            updates += [shard.slots[name].scatter_update(tf.IndexedSlices(value, r))
                        for name, value in zip(names, new_slots)]
    with tf.control_dependencies(updates):
        return _scan_or_rebuild(shards, clock)


def _names(group: list[Part]) -> str:
    """The table named in a group's error: the one of the group, or all of them (any may have brought the keys)."""
    names = sorted({part.name for part in group})
    return repr(names[0]) if len(names) == 1 else f"{names[0]!r} or another table on its ps task ({', '.join(names)})"


def _scan_due(shards, clock):
    """Which shards of a group a scan is due in after this step (None: the policy needs none).

    What `DenseShard.due` says, from what the section has at hand: every `scan_every(ttl_steps)`
    steps of a shard's clock (`clock`: the group's, this step's), and while more keys count
    towards admission than the share. (Rows over the share only come from a restore, which scans
    at once; a worn index is `_scan_or_rebuild`'s own check.)
    """
    policy, share = shards[0].policy, shards[0].share
    every = rules.scan_every(policy.ttl_steps)
    if every is None and policy.min_frequency == 1:
        return None
    due = tf.zeros(tf.shape(clock), tf.bool)
    if every is not None:
        due |= clock % every == 0
    if policy.min_frequency > 1:
        due |= tf.stack([shard.pending.size() for shard in shards]) > share
    return due


def _scan_or_rebuild(shards, clock):
    """After the update, in the same section: scan each shard that is due (`_scan_due`:
    expiry and keys still counting, with `ttl_steps` or `min_frequency > 1`), rebuild the key index
    of each other one whose tombstones fill half the buckets no key holds (`KeyIndex.worn`; a scan
    rebuilds a worn index itself). One conditional for the group, a shard's own only when it is due.

    (A scan checked in a locked section of its own after the update, one per ps and step, with a
    `due` of each shard read there, made a step of 26 tables with both policies 1.6x the CPU of
    the hashing trick: docs/dynamic_embeddings.md, "The policies' cost".)
    """
    # Each index's worn state from the rows its shard holds and the buckets it was made with (a reset
    # can only have added some: it is then rebuilt early), without reading the index's size.
    worn = tf.stack([shard.index.worn(shard.share - shard.free_count.read_value(), shard.index.bucket_count)
                     for shard in shards])
    scan = _scan_due(shards, clock)  # None: the policy has nothing to scan for
    due = worn if scan is None else worn | scan

    def run():
        done = []
        for g, shard in enumerate(shards):
            def rebuild(shard=shard, g=g):
                return called_cond(worn[g], lambda: shard.index.rebuild(shard.live), lambda: tf.constant(False))
            if scan is None:
                done.append(rebuild())
                continue
            done.append(called_cond(scan[g], shard.scan_held, rebuild))
        return tf.reduce_any(tf.stack(done))

    return called_cond(tf.reduce_any(due), run, lambda: tf.constant(False))
