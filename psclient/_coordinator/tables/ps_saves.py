"""A checkpoint's cut of the bounded tables: one traced call per ps for all its dense shards.

A strategy checkpoint stops dispatch while each ps takes its snapshot
(`checkpoints/checkpoint_snapshot.py`). Saved one shard at a time, a ps
answered about five round trips per shard (the shard's save, its clock,
admissions and evictions, the reshapes), one after another: 26 tables on 2
ps tasks paused training 0.49-0.58 s a save, 0.13 s now (docs/dynamic_embeddings.md). Here,
each ps's dense shards are saved by one concrete function, `PsSave`, whose
outputs are every tensor the checkpoint names for them
(`table_checkpoint._names`'s order), counters and clock included: the cut
makes one call per ps, all ps at once.

The function is traced, and called once so that the ps instantiates it,
*before* any cut: `prepare(tables)` runs where the optimizer makes the
tables' slots, while a training step is traced (`psclient._keras.optimizer_apply`),
never in a cut, where tracing would register a function on every task with
dispatch stopped (a registration waits for every task and holds the GIL: a
task that hangs then stops every thread of the coordinator). It covers every
table of the strategy. A shard made again (its ps lost: `DenseShard.make`)
or given new slots gets a new `version`: a `PsSave` holding an old one is
stale and not called (`current`), and the cut saves that ps's shards one by
one (`table_checkpoint.save_work`) until the next traced step prepares a new
one. A valid one that lacks some shards (a table made since) saves the
shards it has; the others are saved one by one.

A shard with nothing written since it was made (`DenseShard.fresh`: no
optimizer slots asked for, no restore) is empty: the cut takes the empty
tensors it made then, on its ps (`fresh_tensors`), without a call.
That is the checkpoint `schedule()` takes before a model's first step is
traced (new variables), before the optimizer made any slot.
"""

from __future__ import annotations

from typing import Any, Iterable

import tensorflow as tf

from psclient._coordinator import runtime as _runtime

__all__ = ["PsSave", "by_device", "current", "empty_fields", "fresh_tensors", "in_saved_order", "prepare",
           "saved_tensors"]


def by_device(tables: dict[str, Any]) -> dict[Any, list[tuple]]:
    """device -> [(key, index, table, shard)] of `tables`' shards, in the checkpoint's order."""
    out: dict[Any, list[tuple]] = {}
    for key, table in tables.items():
        for index, shard in enumerate(table.shards):
            out.setdefault(shard.device, []).append((key, index, table, shard))
    return out


def in_saved_order(keys, counters, row_keys, rows, clock, admissions, evictions, slot_rows: list, dim: int) -> list:
    """In a traced function: a shard's saved tensors in the checkpoint's order
    (`table_checkpoint._names`: keys, counters, row_keys, rows, clock, admissions, evictions, then
    `slot_rows`, its slots' rows by slot name) and shapes. The one place that order is built, for
    every storage and path (a per-ps save, a shard saved on its own)."""
    return ([tf.reshape(keys, [-1]), tf.reshape(counters, [-1, 2]), tf.reshape(row_keys, [-1]),
             tf.reshape(rows, [-1, dim]), clock, admissions, evictions]
            + [tf.reshape(value, [-1, dim]) for value in slot_rows])


def saved_tensors(shard) -> list:
    """In a traced function: a dense shard's saved tensors (`in_saved_order`)."""
    keys, counters, row_keys, rows, slot_rows = shard.saved()  # its ops, in the caller's trace
    return in_saved_order(keys, counters, row_keys, rows, shard.clock.read_value(), shard.admissions.read_value(),
                          shard.evictions.read_value(), [slot_rows[s] for s in sorted(shard.slots)], shard.dim)


def empty_fields(dim: int) -> list:
    """A fresh shard's saved tensors without slots, then one empty slot value: made (on the shard's
    device, by `DenseShard.make`) outside any cut, taken by a cut without a call (`fresh_tensors`)."""
    # Made on the coordinator and copied: made under the ps's device, each shape would be converted
    # there, holding the GIL while TF copies it (tests/_conversions.py).
    with tf.device(_runtime.coordinator_cpu()):
        made = [tf.zeros([0], tf.int64), tf.zeros([0, 2], tf.int64), tf.zeros([0, dim]), tf.constant(0, tf.int64)]
    ids, pairs, rows, zero = [tf.identity(value) for value in made]
    return [ids, pairs, ids, rows, zero, zero, zero, rows]


def fresh_tensors(shard) -> list:
    """A `fresh` dense shard's saved tensors (`saved_tensors`' order): empty, on its ps since made."""
    fields = shard.empty_fields
    return fields[:7] + [fields[7]] * len(shard.slots)


class PsSave:
    """One ps's dense shards saved by one concrete function (see the module's docstring)."""

    def __init__(self, shards: list):
        self.shards = list(shards)
        self.versions = [shard.version for shard in shards]
        self.counts = [7 + len(shard.slots) for shard in shards]  # tensors per shard (`saved_tensors`)

        def save_all():
            out = []
            for shard in shards:
                out += saved_tensors(shard)
            return out

        with shards[0].placed():
            # Concrete: a call from the cut (another context) would not find a trace made here.
            self.function = tf.function(save_all, autograph=False).get_concrete_function()
            # The ps instantiates it now, not in the first cut. Its registration is streamed (made
            # inside a trace): this call can overtake it, and is then made again.
            _runtime.until_registered(self.function)

    def valid(self) -> bool:
        """Whether each of its shards is as it was traced (same storage and slots)."""
        return all(shard.version is version for shard, version in zip(self.shards, self.versions))

    def __call__(self) -> dict[int, list]:
        """id(shard) -> that shard's saved tensors, on the ps: one call."""
        flat, out, at = self.function(), {}, 0
        for shard, count in zip(self.shards, self.counts):
            out[id(shard)] = flat[at:at + count]
            at += count
        return out


def current(shards: list) -> PsSave | None:
    """A `PsSave` prepared for these dense shards (one ps's) that is still valid, or None. It may not
    cover them all (a table made since: `save_work` saves the others one by one)."""
    for shard in shards:
        candidate = getattr(shard, "ps_save", None)
        if candidate is not None and candidate.valid():
            return candidate
    return None


def prepare(tables: Iterable[Any]) -> None:
    """Make (trace and instantiate) the `PsSave` of each ps of the strategies owning `tables`, for
    every table of theirs, where the one there is not current. Outside any cut: called while a
    training step is traced, once the optimizer made the tables' slots. Made with or without a
    `checkpoint_dir`: Keras's checkpoint callbacks (`psclient.ModelCheckpoint`, `BackupAndRestore`)
    save the tables through the same cut."""
    from psclient._coordinator.ps_state import on_ps

    strategies = {}
    for table in tables:
        strategy = table.owner()
        if strategy is not None:
            strategies[id(strategy)] = strategy
    for strategy in strategies.values():
        on_ps(strategy, lambda strategy=strategy: _prepare(strategy.parts.store.tables()),
              "preparing the dynamic tables' checkpoint saves")


def _prepare(tables: dict[str, Any]) -> None:
    with tf.init_scope():
        for entries in by_device(tables).values():
            # A shard with write marks is copied before the cut and compacted after it
            # (checkpoints/table_copy); where it is not (its first checkpoint, one after a restore),
            # the cut saves it by its own call, traced here.
            for _key, _index, _table, shard in entries:
                if shard.dense and shard.marked:
                    shard.trace_saved_tensors()
            shards = [shard for _key, _index, _table, shard in entries if shard.dense and not shard.marked]
            prepared = current(shards)
            if not shards or (prepared is not None and all(getattr(s, "ps_save", None) is prepared for s in shards)):
                continue  # each shard here saved by one valid function already
            ps_save = PsSave(shards)  # each shard's rows are its own `dim` wide: no list beside them
            for shard in shards:
                shard.ps_save = ps_save
