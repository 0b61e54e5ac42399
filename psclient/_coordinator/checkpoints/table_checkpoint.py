"""Dynamic embedding tables in the strategy's checkpoints: each ps saves and restores its own shards.

A table's shard on ps `p` is exported on `p` (keys, counters, rows, slots,
clock, admissions, evictions) and written in `p`'s own part of the
checkpoint, in the same SaveV2 call as its variables
(`checkpoint_parts.save_parts`): no byte of a table passes through the
coordinator. Keys, for a table saved under `table/0000` (the strategy's:
creation order, as variables) or `model_table/0000` (Keras callbacks: the
layer's position among the model's DynamicEmbedding layers):

    table/0000/ps1/keys        int64[k]      every key tracked on ps 1
    table/0000/ps1/counters    int64[k, 2]   (sightings, step last seen)
    table/0000/ps1/row_keys    int64[r]      the keys that have a row
    table/0000/ps1/rows        float32[r, dim]
    table/0000/ps1/slot/<name> float32[r, dim]
    table/0000/ps1/clock, .../admissions, .../evictions   int64 scalars

The checkpoint's layout (`psclient_layout`) lists each table under `tables`:
name, dim, shards, slot initial values.

Restore: each ps reads (RestoreV2 there) what each of its shards will hold,
one shard at a time, and drops it (`read`: a check); only when every ps has
read everything (variables and deltas too) does any ps read each shard's
state again, apply the deltas' changes to it (`table_deltas.patcher`) and
replace the shard's contents with it, one shard at a time (`assign`): a
checkpoint that cannot be read leaves the tables as they were, and a ps
holds at most one shard's state beyond its tables. A dense shard restored
from its own saved shard, bigger than one range, is read and written in row
ranges instead, in place (`table_ranges`), each delta's changed rows after
the saved rows it left alone: its ps holds about one range, the shard's keys
and a delta's changes beyond its tables (a shard within one range is restored
whole: fewer calls, and at most about its own small size twice beyond its
tables). Restored into another number of ps tasks, each ps reads every
saved shard and keeps the keys it owns (`shard_of(key, num_ps)`); the clock
becomes the largest saved one, admissions and evictions are summed on ps 0.
A dense shard bigger than one range reads them in row ranges too
(`table_ranges.SplitPlan`: each saved shard's keys whole, its rows and slots
a range at a time, the owned rows written in place), unless it gets more rows
than its share or there are deltas: then whole, as above.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator.checkpoints import hash_copy as _hash_copy
from psclient._coordinator.checkpoints import table_copy as _table_copy
from psclient._coordinator.checkpoints import table_ranges
from psclient._coordinator.checkpoints.checkpoint_pieces import LOCAL, task_of as _task
from psclient._tf import checkpoints as _checkpoints

__all__ = ["LOCAL", "assign", "check", "layout_of", "names_by_ps", "read", "read_local", "save_work"]

_FIELDS = ("keys", "counters", "row_keys", "rows", "clock", "admissions", "evictions")


def _dtypes(dim_slots: int) -> list:
    return [tf.int64, tf.int64, tf.int64, tf.float32, tf.int64, tf.int64, tf.int64] + [tf.float32] * dim_slots


def _names(key: str, shard: int, slots: list[str]) -> list[str]:
    return [f"{key}/ps{shard}/{field}" for field in _FIELDS] + [f"{key}/ps{shard}/slot/{s}" for s in slots]


def layout_of(tables: dict[str, Any]) -> dict:
    """What the checkpoint's layout records of each table (key -> name, dim, shards, slots)."""
    return {key: {"name": table.name, "dim": table.dim, "shards": len(table.shards),
                  "slots": dict(sorted(table.slot_defaults.items()))} for key, table in tables.items()}


def names_by_ps(tables: dict[str, Any]) -> dict[int, list[str]]:
    """ps -> the keys its part holds of `tables`."""
    out: dict[int, list[str]] = {}
    for key, table in tables.items():
        for index, shard in enumerate(table.shards):
            out.setdefault(_task(shard), []).extend(_names(key, index, sorted(shard.slots)))
    return out


def save_work(tables: dict[str, Any], prepared: Any = None) -> dict[int, Callable[[], tuple[list[str], list]]]:
    """ps -> a function, run under that ps's device in a checkpoint's cut, giving (names, tensors on
    that ps) of its shards: those copied before the cut (`prepared`, a `fuzzy_copy.Prepared`:
    `table_copy`, their rows and slots `table_copy.Compacted` until the write), the other dense
    ones by one call of the ps's prepared save (`ps_saves.PsSave`), else each on its own
    (`_shard_tensors`); nothing is traced here when one was prepared."""
    from psclient._coordinator.tables import ps_saves  # tables imports this module (dynamic_tables)

    work = {_task(entries[0][3]): entries for entries in ps_saves.by_device(tables).values()}

    def on(ps, entries):
        def run():
            names = [name for key, index, _table, shard in entries for name in _names(key, index, sorted(shard.slots))]
            copies = {id(shard): copy for _key, _index, _table, shard in entries
                      if prepared is not None and (copy := prepared.take_table(ps, shard)) is not None}
            ps_save = ps_saves.current([shard for _key, _index, _table, shard in entries if shard.dense])
            done = ps_save() if ps_save is not None else {}  # its shards (usually all of them): one call
            tensors = []
            for _key, _index, table, shard in entries:
                copy, own = copies.get(id(shard)), done.get(id(shard))
                if copy is not None:
                    saved, count = (_hash_copy.cut if isinstance(copy, _hash_copy.HashCopy) else _table_copy.cut)(copy)
                    prepared.read_again.setdefault(ps, []).append(count)
                    tensors += saved
                else:
                    tensors += own if own is not None else _shard_tensors(table, shard)
            return names, tensors
        return run

    return {ps: on(ps, entries) for ps, entries in work.items()}


def _shard_tensors(table, shard) -> list:
    """One shard's saved tensors (in `_names`'s order), under its device: without a prepared save."""
    from psclient._coordinator.tables import ps_saves

    slots = sorted(shard.slots)
    if shard.dense and shard.fresh:
        return ps_saves.fresh_tensors(shard)  # empty since made: its empty tensors, no call
    if shard.dense:
        return shard.saved_tensors()  # one traced call, the per-ps save's tensors (`ps_saves.saved_tensors`)
    keys, counters = shard.counters.export()
    row_keys, rows = shard.values.export()  # keys [n]: reshaped (traced) in _saved_fields
    return _saved_fields(keys, counters, row_keys, rows, shard.clock.read_value(), shard.admissions.read_value(),
                         shard.evictions.read_value(), [shard.slots[s].lookup(row_keys) for s in slots], table.dim)


def check(tables: dict[str, Any], saved: dict) -> list[str]:
    """What keeps `tables` from being restored from a checkpoint whose layout lists `saved`."""
    problems = []
    for key, table in tables.items():
        entry = saved.get(key)
        if entry is None:
            problems.append(f"dynamic table {key} ({table.name!r}) is not in it")
        elif int(entry["dim"]) != table.dim:
            problems.append(f"dynamic table {key} ({table.name!r}) has rows of {entry['dim']} there "
                            f"but {table.dim} here")
    return problems


def read(path: str, tables: dict[str, Any], saved: dict, layout: dict | None = None,
         range_bytes: int | None = None) -> dict[int, Callable[[], list]]:
    """ps -> a function checking, on that ps, that the state each of its shards will hold reads
    (each read, then dropped): [(table, shard, checked)], which `assign` reads again.

    A dense shard is read in row ranges (`table_ranges`: `Plan` from its own saved shard, as many
    ps as saved; `SplitPlan` from every saved shard, another number of ps; `layout`, the
    checkpoint's, says how its values were saved; `range_bytes`: at most that many bytes a range,
    None: the checkpoint's row chunks), unless its rows and slots fit in one range
    (`table_ranges.fits_one_range`): then whole, one RestoreV2 to check and two calls to assign,
    as any shard restored from its own saved shard."""
    work: dict[int, list] = {}
    for key, table in tables.items():
        for index, shard in enumerate(table.shards):
            work.setdefault(_task(shard), []).append((key, index, table, shard))

    def state_of(key, index, table):
        entry = saved[key]
        count, slots, n = int(entry["shards"]), sorted(entry["slots"]), len(table.shards)
        parts = [index] if count == n else list(range(count))
        values = []
        for part in parts:
            names = _names(key, part, slots)
            values.append(_checkpoints.restore(path, names, [""] * len(names), _dtypes(len(slots))))
        if count == n:  # its own saved shard as it was: RestoreV2 gave it in the state's shapes
            return {**_as_state(values[0], slots), "slot_defaults": entry["slots"]}
        fields = {f: [v[i] for v in values] for i, f in enumerate(_FIELDS)}
        fields.update({s: [v[len(_FIELDS) + i] for v in values] for i, s in enumerate(slots)})
        return {**_restored_state(fields, tuple(slots), table.dim, n, index), "slot_defaults": entry["slots"]}

    def on(entries):
        def run():
            out = []
            for key, index, table, shard in entries:
                read_state = functools.partial(state_of, key, index, table)
                entry, plan = saved[key], None
                slots = sorted(entry["slots"])
                small = shard.dense and table_ranges.fits_one_range(  # its rows and every slot it will hold
                    shard.share, table.dim, {*slots, *shard.slots}, range_bytes)
                count = int(entry["shards"])
                if shard.dense and count == len(table.shards) and not small:
                    plan = table_ranges.Plan(path, key, index, slots, table.dim, layout, range_bytes)
                elif shard.dense and not small:  # another number of ps: each saved shard read in ranges
                    plan = table_ranges.SplitPlan(path, key, count, index, len(table.shards), slots, table.dim,
                                                  layout, range_bytes)
                with shard.placed():
                    try:
                        # Each range, or the state itself, dropped at once.
                        rows = plan.check() if plan is not None else int(read_state()["row_keys"].shape[0])
                    except tf.errors.OpError as error:
                        error._psclient_table = f"{key} ({table.name!r})"
                        raise
                out.append((table, shard, {"read": read_state, "ranges": plan, "rows": rows,
                                           "slot_defaults": saved[key]["slots"], "table": f"{key} ({table.name!r})"}))
            return out
        return run

    return {ps: on(entries) for ps, entries in work.items()}


# Traced (one call on the ps each) because, run eagerly under a ps's device, each Python value in
# these ops (a shape, an axis, `shard_of`'s constants) is converted *there*, and TF copies it to the
# ps inside the conversion holding the GIL: a ps hung then would stop every thread of the
# coordinator (tests/_conversions.py). Shared by every table: traced once per form.
@functools.partial(tf.function, autograph=False, reduce_retracing=True)
def _saved_fields(keys, counters, row_keys, rows, clock, admissions, evictions, slot_rows, dim):
    """A hash-table shard's saved tensors from its exports, in `_names`'s order and the checkpoint's
    shapes (`ps_saves.in_saved_order`, as a dense shard's)."""
    from psclient._coordinator.tables.ps_saves import in_saved_order  # tables imports this module

    return in_saved_order(keys, counters, row_keys, rows, clock, admissions, evictions, slot_rows, dim)


def _as_state(saved: list, slots: list[str]) -> dict:
    """One saved shard's tensors (`_names`'s order, `slots` its slots) as the state `assign` writes
    (`_restored_state`'s form): no op, so no call on the ps."""
    fields = dict(zip(_FIELDS, saved))
    return {**fields, "slots": dict(zip(slots, saved[len(_FIELDS):]))}


@functools.partial(tf.function, autograph=False, reduce_retracing=True)
def _restored_state(fields, slots, dim, num_shards, index):
    """A shard's state from the saved parts in `fields` (field -> one tensor per part): the keys
    shard `index` of `num_shards` owns of them all (the one part as it is: `index` None)."""
    from psclient._coordinator.tables.dynamic_tables import shard_of  # dynamic_tables imports this module

    keys, counters = tf.concat(fields["keys"], 0), tf.reshape(tf.concat(fields["counters"], 0), [-1, 2])
    row_keys = tf.concat(fields["row_keys"], 0)
    rows = tf.reshape(tf.concat(fields["rows"], 0), [-1, dim])
    slot_rows = {s: tf.reshape(tf.concat(fields[s], 0), [-1, dim]) for s in slots}
    if index is None:
        clock, admissions, evictions = fields["clock"][0], fields["admissions"][0], fields["evictions"][0]
    else:  # re-split: keep the keys this ps owns now
        mine, mine_rows = shard_of(keys, num_shards) == index, shard_of(row_keys, num_shards) == index
        keys, counters = tf.boolean_mask(keys, mine), tf.boolean_mask(counters, mine)
        rows, slot_rows = tf.boolean_mask(rows, mine_rows), {
            s: tf.boolean_mask(v, mine_rows) for s, v in slot_rows.items()}
        row_keys = tf.boolean_mask(row_keys, mine_rows)
        clock = tf.reduce_max(tf.stack(fields["clock"]))
        zero = tf.constant(0, tf.int64)
        admissions = tf.add_n(fields["admissions"]) if index == 0 else zero
        evictions = tf.add_n(fields["evictions"]) if index == 0 else zero
    return {"keys": keys, "counters": counters, "row_keys": row_keys, "rows": rows, "slots": slot_rows,
            "clock": clock, "admissions": admissions, "evictions": evictions}


def assign(states: dict[int, list], on_each_ps: Callable, patches: list | tuple = ()) -> dict[int, int]:
    """Read again each shard's state that `read` checked, apply `patches` to it in order (each
    `patch(table, shard, state) -> state`: a checkpoint's deltas, `table_deltas.patcher`), and
    replace the shard's contents with it, one shard at a time on each ps (all ps at once): a ps
    holds one shard's state beyond its tables. A shard `read` planned in row ranges is written a
    range at a time in place instead (`table_ranges`), then each delta's changed rows
    (`table_deltas.Patcher.changes`): its ps holds about one range beyond its tables, the shard's
    keys and a delta's changes. Returns ps -> the rows its shards got back."""
    for entries in states.values():
        for table, _shard, checked in entries:
            table.ensure_slots(checked["slot_defaults"])  # a fresh process: the optimizer made none yet

    def on(entries):
        def run():
            rows = 0
            for table, shard, checked in entries:
                with shard.placed():
                    # Each delta's changes of this shard, read apart to write it in place (None:
                    # a patch that only applies to a whole state, or another number of ps).
                    changes = [getattr(patch, "changes", lambda *_: None)(table, shard) for patch in patches]
                    if checked["ranges"] is not None and None not in changes:
                        try:
                            got = checked["ranges"].assign(shard, changes)
                        except tf.errors.OpError as error:
                            error._psclient_table = checked["table"]
                            raise
                        if got is not None:
                            rows += got
                            continue
                    try:
                        state = checked["read"]()
                        for patch in patches:
                            state = patch(table, shard, state)
                    except tf.errors.OpError as error:
                        error._psclient_table = checked["table"]
                        raise
                    _replace(shard, state)
                    rows += int(state["row_keys"].shape[0])
                    del state  # before the next shard's is read
            return rows
        return run

    return on_each_ps({ps: on(entries) for ps, entries in states.items()})


def _replace(shard, state: dict) -> None:
    """`shard`'s contents replaced with `state` (under the shard's device)."""
    shard.replace(state["keys"], state["counters"], state["row_keys"], state["rows"],
                  state["slots"], state["clock"], state["admissions"], state["evictions"])


def read_local(reader, key: str, entry: dict) -> list[dict]:
    """A saved table's shards as numpy arrays (`DynamicTable.import_shards` takes them), read here.

    For the sidecar evaluator, whose model lives in its own process.
    """
    slots = sorted(entry["slots"])
    out = []
    for part in range(int(entry["shards"])):
        names = dict(zip([*_FIELDS, *slots], _names(key, part, slots)))
        state = {field: reader.get_tensor(names[field]) for field in _FIELDS}
        state["slots"] = {s: reader.get_tensor(names[s]) for s in slots}
        out.append(state)
    return out
