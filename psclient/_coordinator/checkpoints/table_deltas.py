"""Dynamic embedding tables in incremental checkpoints: each ps writes what changed in its shards.

A full checkpoint holds each table shard's export (`table_checkpoint`):
tracked keys with their counters, and the keys that have a row with the row
and its optimizer slots. A delta (`checkpoint_deltas`) holds, per shard, under
`<table key>/ps<i>/delta/`:

    keys, counters          the tracked keys that are new or whose counters changed
    removed                 the tracked keys gone (evicted, expired)
    row_keys, rows, slot/<name>   the keys whose row or a slot is new or changed, with them
    row_removed             the keys that hold no row any more

and the shard's clock, admissions and evictions whole (`<table key>/ps<i>/clock`, ...).
The diff runs on the shard's ps, against the previous checkpoint's export kept
there (one copy of the shard's tracked keys and rows per ps: the memory a delta
costs for a table): old keys sorted (TopK), the new ones found among them (LowerBound),
values compared element by element, as the serving deltas do (`serving.delta_cut`).

Restore checks each delta's changes on the ps that will apply them (`check`:
read, then dropped), then, one shard at a time, applies each delta to the
shard's state read from the full checkpoint before it replaces the shard's
contents (`patcher`, `table_checkpoint.assign`): each ps drops the keys
changed or removed (`ListDiff`) and appends the changed ones. Into another
number of ps tasks, every saved shard's changes are read and each ps keeps the
keys it owns, as `table_checkpoint.read` does.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator.checkpoints.checkpoint_pieces import coordinator_constant as constant, task_of
from psclient._tf import checkpoints as _checkpoints

__all__ = ["Changes", "Patcher", "check", "constant", "diff", "kept", "merge", "patcher", "split"]

_FIELD = re.compile(r"^(.+/ps\d+)/(keys|counters|row_keys|rows|clock|admissions|evictions|slot/.+)$")
#: A shard's scalars, saved whole in a delta as in a full checkpoint.
_SCALARS = ("clock", "admissions", "evictions")


def split(names: list[str]) -> dict[str, dict[str, int]]:
    """Table shard prefix (`table/0000/ps1`) -> {field: position in `names`} of a snapshot's table entries."""
    out: dict[str, dict[str, int]] = {}
    for position, name in enumerate(names):
        match = _FIELD.match(name)
        if match:
            out.setdefault(match.group(1), {})[match.group(2)] = position
    return out


def _flat(tensor):
    return tf.reshape(tensor, constant([-1], tf.int32))


def _changed(old_keys, old_values: list, keys, values: list):
    """Positions (int64) in `keys` of the entries new or different from the old ones (`values`: rank 2,
    a row per key), and the old keys gone; on the ps in force, converting no Python value there."""
    removed = tf.raw_ops.ListDiff(x=old_keys, y=keys, out_idx=tf.int64).out
    # Sizes from the tensors' shapes (known here): `tf.size` of an eager tensor is a constant made
    # from its shape under the device in force, a conversion there.
    count, old_count = int(keys.shape[0]), int(old_keys.shape[0])
    if count == 0:
        return constant([], tf.int64), removed
    if old_count == 0:
        return tf.range(constant(0, tf.int64), constant(count, tf.int64), constant(1, tf.int64)), removed
    zero, first, row = constant(0, tf.int32), constant([0], tf.int32), constant([1, -1], tf.int32)
    descending, order = tf.raw_ops.TopKV2(input=old_keys, k=constant(old_count, tf.int32), sorted=True)
    sorted_keys, order = tf.reverse(descending, first), tf.reverse(order, first)
    at = _flat(tf.raw_ops.LowerBound(sorted_inputs=tf.reshape(sorted_keys, row), values=tf.reshape(keys, row),
                                     out_type=tf.int64))
    at = tf.minimum(at, constant(old_count - 1, tf.int64))
    same = tf.equal(tf.gather(sorted_keys, at, axis=zero), keys)
    for old, new in zip(old_values, values):
        was = tf.gather(tf.gather(old, order, axis=zero), at, axis=zero)
        same = tf.logical_and(same, tf.reduce_all(tf.equal(was, new), axis=constant(1, tf.int32)))
    return _flat(tf.where(tf.logical_not(same))), removed


def diff(prefix: str, fields: dict[str, int], old: dict[str, Any], values: list) -> tuple[list, list, int]:
    """On the shard's ps: (names, tensors) of the delta of table shard `prefix` (`fields`: its entries'
    positions in `values`, the new export; `old`: field -> the kept export) and the rows written."""
    new = {field: values[position] for field, position in fields.items()}
    slots = sorted(f for f in fields if f.startswith("slot/"))
    names, tensors = [f"{prefix}/{field}" for field in _SCALARS], [new[field] for field in _SCALARS]
    at, removed = _changed(old["keys"], [old["counters"]], new["keys"], [new["counters"]])
    names += [f"{prefix}/delta/keys", f"{prefix}/delta/counters", f"{prefix}/delta/removed"]
    zero = constant(0, tf.int32)
    tensors += [tf.gather(new["keys"], at, axis=zero), tf.gather(new["counters"], at, axis=zero), removed]
    row_fields = ["rows", *slots]
    at, removed = _changed(old["row_keys"], [old[f] for f in row_fields], new["row_keys"], [new[f] for f in row_fields])
    names += [f"{prefix}/delta/row_keys", f"{prefix}/delta/row_removed"] + [f"{prefix}/delta/{f}" for f in row_fields]
    tensors += [tf.gather(new["row_keys"], at, axis=zero), removed] + [tf.gather(new[f], at, axis=zero)
                                                                        for f in row_fields]
    return names, tensors, int(at.shape[0])


def kept(names: list[str], values: list) -> dict[str, dict[str, Any]]:
    """prefix -> field -> tensor: what a ps keeps of its tables' export as the next delta's base."""
    return {prefix: {field: values[position] for field, position in fields.items()}
            for prefix, fields in split(names).items()}


def merge(keys, values: list, changed_keys, changed: list, removed):
    """`keys`/`values` without the changed or removed keys, then the changed ones (eagerly, or traced)."""
    zero = constant(0, tf.int32) if tf.executing_eagerly() else 0  # traced: a constant of the function
    keep = tf.raw_ops.ListDiff(x=keys, y=tf.concat([changed_keys, removed], zero), out_idx=tf.int64).idx
    return (tf.concat([tf.gather(keys, keep, axis=zero), changed_keys], zero),
            [tf.concat([tf.gather(v, keep, axis=zero), c], zero) for v, c in zip(values, changed)])


def _read(delta: str, key: str, part: int, slots: list[str]) -> dict:
    """The changes the delta holds of saved shard `part` of table `key`, read on the device in force."""
    prefix = f"{key}/ps{part}"
    fields = ["keys", "counters", "removed", "row_keys", "row_removed", "rows"] + [f"slot/{s}" for s in slots]
    dtypes = [tf.int64] * 5 + [tf.float32] * (1 + len(slots))
    got = _checkpoints.restore(delta, [f"{prefix}/delta/{f}" for f in fields], [""] * len(fields), dtypes)
    out = dict(zip(fields, got))
    out.update(zip(_SCALARS, _checkpoints.restore(delta, [f"{prefix}/{f}" for f in _SCALARS], [""] * 3,
                                                  [tf.int64] * 3)))
    return out


def _by_ps(tables: dict[str, Any], only_ps: frozenset | None) -> dict[int, list]:
    """ps -> [(key, table, shard)] of the shards it holds (of `only_ps`, when given)."""
    out: dict[int, list] = {}
    for key, table in tables.items():
        for shard in table.shards:
            ps = task_of(shard)
            if only_ps is None or ps in only_ps:
                out.setdefault(ps, []).append((key, table, shard))
    return out


def _parts_of(table, shard, entry: dict) -> list[int]:
    """The saved shards whose changes `shard` applies: its own, or every one (another number of ps)."""
    count, n = int(entry["shards"]), len(table.shards)
    return [table.shards.index(shard)] if count == n else list(range(count))


def check(delta: str, tables: dict[str, Any], saved: dict, only_ps: frozenset | None, on_each_ps: Callable) -> None:
    """Each ps reads the changes each of its shards will apply (each read, then dropped). Raises
    tf.errors.OpError (`_psclient_table` names the table) if one cannot be read."""
    def on(entries):
        def run():
            for key, table, shard in entries:
                slots = sorted(saved[key]["slots"])
                with shard.placed():
                    try:
                        for part in _parts_of(table, shard, saved[key]):
                            _read(delta, key, part, slots)
                    except tf.errors.OpError as error:
                        error._psclient_table = f"{key} ({table.name!r})"
                        raise
        return run

    on_each_ps({ps: on(entries) for ps, entries in _by_ps(tables, only_ps).items()})


class Changes:
    """What one delta changed of one table shard restored from its own saved shard, read a field at
    a time on the device in force (`table_ranges.Plan.assign`, which writes a shard in place).

    `slots`: the slots the delta holds."""

    def __init__(self, delta: str, prefix: str, slots: list[str]):
        self.delta, self.prefix, self.slots = delta, prefix, slots

    def read(self, fields: list[str]) -> dict:
        """field -> value: a delta field (`keys`, `counters`, `removed`, `row_keys`, `row_removed`,
        `rows`, `slot/<name>`) or a scalar (`clock`, `admissions`, `evictions`)."""
        dtypes = [tf.float32 if f == "rows" or f.startswith("slot/") else tf.int64 for f in fields]
        return dict(zip(fields, _checkpoints.restore(self.delta, self.names(fields), [""] * len(fields), dtypes)))

    def names(self, fields: list[str]) -> list[str]:
        """The keys of `fields` (as `read` takes them) in the delta's checkpoint."""
        return [f"{self.prefix}/{f}" if f in _SCALARS else f"{self.prefix}/delta/{f}" for f in fields]


def patcher(delta: str, tables: dict[str, Any], saved: dict) -> "Patcher":
    """patch(table, shard, state): `state` (`table_checkpoint.read`'s, of that shard) with the
    delta's changes applied, under the shard's device (`Patcher`). Raises tf.errors.OpError if they
    cannot be read."""
    return Patcher(delta, tables, saved)


class Patcher:
    """A delta's changes to the tables' shards: applied to a shard's whole state (a call), or read
    apart for a shard written in place (`changes`)."""

    def __init__(self, delta: str, tables: dict[str, Any], saved: dict):
        self.delta, self.saved = delta, saved
        self._key_of = {id(table): key for key, table in tables.items()}

    def changes(self, table, shard) -> Changes | None:
        """The delta's changes of `shard`'s own saved shard, read a field at a time; None when the
        shard takes changes of several saved shards (restored into another number of ps tasks)."""
        key = self._key_of[id(table)]
        entry = self.saved[key]
        if int(entry["shards"]) != len(table.shards):
            return None
        return Changes(self.delta, f"{key}/ps{table.shards.index(shard)}", sorted(entry["slots"]))

    def __call__(self, table, shard, state) -> dict:
        from psclient._coordinator.tables.dynamic_tables import shard_of  # not at the top: dynamic_tables imports table_checkpoint

        delta, saved = self.delta, self.saved
        key = self._key_of[id(table)]
        entry, n, index = saved[key], len(table.shards), table.shards.index(shard)
        count, slots = int(entry["shards"]), sorted(entry["slots"])
        parts = [_read(delta, key, part, slots) for part in _parts_of(table, shard, entry)]
        got = {f: tf.concat([p[f] for p in parts], constant(0, tf.int32)) for f in parts[0] if f not in _SCALARS}
        if count != n:  # re-split: the changes to the keys this ps owns now
            mine = {by: shard_of(got[by], n) == index for by in ("keys", "removed", "row_keys", "row_removed")}
            owner = {"counters": "keys", "rows": "row_keys", **{f"slot/{s}": "row_keys" for s in slots}}
            got = {f: tf.boolean_mask(v, mine[owner.get(f, f)]) for f, v in got.items()}
        out = dict(state)
        out["keys"], (out["counters"],) = merge(state["keys"], [state["counters"]], got["keys"],
                                                [got["counters"]], got["removed"])
        rows = [got["rows"]] + [got[f"slot/{s}"] for s in slots]
        before = [state["slots"][s] if s in state["slots"] else  # a slot made since: its initial value
                  tf.fill(constant(state["rows"].shape, tf.int32), constant(float(entry["slots"][s]), tf.float32))
                  for s in slots]
        out["row_keys"], merged = merge(state["row_keys"], [state["rows"]] + before,
                                        got["row_keys"], rows, got["row_removed"])
        out["rows"], out["slots"] = merged[0], dict(zip(slots, merged[1:]))
        out["slot_defaults"] = entry["slots"]
        if count == n:
            out.update({f: parts[0][f] for f in _SCALARS})
        else:
            out["clock"] = tf.reduce_max(tf.stack([p["clock"] for p in parts]))
            zero = constant(0, tf.int64)
            out["admissions"] = tf.add_n([p["admissions"] for p in parts]) if index == 0 else zero
            out["evictions"] = tf.add_n([p["evictions"] for p in parts]) if index == 0 else zero
        return out
