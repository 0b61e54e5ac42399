"""Incremental checkpoints: between full ones, each ps writes only the rows that changed.

With `delta_checkpoint_every` / `delta_checkpoint_interval`, the checkpoints
between two full ones are deltas, `ckpt-N.delta-M` (M = 1, 2, ... on the full
checkpoint `ckpt-N`, their base). A delta is taken in a cut like a full one
(`checkpoint_snapshot.take_snapshot`: each ps reads its variables there), and
written in the background by the ps tasks:

- a row-diffed variable (rank 2, at least `ROW_DIFF_MIN_ROWS` rows over its
  shards: a partitioned `keras.layers.Embedding`, and its optimizer's slots,
  which are variables of the same shape) is written per shard as the rows
  that differ from the previous checkpoint's cut and their indices in the
  shard: `<key>/.ATTRIBUTES/VARIABLE_VALUE/delta/<first row>/idx` (int64)
  and `.../rows`; when that would be no smaller than the shard (most rows
  changed: a big dense kernel, Adam's moments), the shard whole under `rows`
  and an empty `idx`. The diff runs on the shard's ps, against that cut's
  values kept there (`_Base`): no row passes through the coordinator;
- every other variable is written whole, under the key a full checkpoint uses;
- the dynamic embedding tables' shards: their changed keys, counters, rows
  and slots, and the keys gone (`table_deltas`), diffed on their ps too;
- the scalars (completed closures, ...) and the layout with the strategy's
  meta (data ledgers), as in a full checkpoint; the layout's `delta` entry
  names the base and the row-diffed shards.

A delta is a TF checkpoint of its own, written under a temporary prefix
(`ckpt-N.delta-M.tmp-*`) and renamed into place, its index last: a delta
counts once `ckpt-N.delta-M.index` exists. The state file never names a delta
(`tf.train.latest_checkpoint` sees only full checkpoints); deltas are pruned
with their base.

Restore: the newest complete full checkpoint, then its deltas in order
(`restore_onto`, `delta_restore`): a whole variable takes the newest delta's
value, a row-diffed one gets each delta's rows scattered into it, a batch of
rows at a time as it is assigned (on its ps; indices are turned into rows of
the full variable, so a restore into other shards works), a table shard
drops the keys changed or gone and takes the changed ones
(`table_deltas.patcher`), the scalars come from the newest delta. It stops
at the first missing or damaged delta (logged) and restores the state of the
one before. Every delta is read and checked before anything is assigned, as
for a full checkpoint, and no ps holds a second copy of its variables.

Memory: each ps keeps, between checkpoints, one copy of its row-diffed shards
and of its table shards' export (the previous cut's; two while a delta is
taken and written). A ps lost
since the base took its copy with it (its variables' handles are new); any
restore also ends the chain: the next checkpoint is then full.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import time
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator.checkpoints import delta_restore as _delta_restore
from psclient._coordinator.checkpoints import table_copy as _table_copy
from psclient._coordinator.checkpoints import table_deltas
from psclient._coordinator.checkpoints.table_deltas import constant as _constant
from psclient._coordinator.checkpoints.checkpoint_parts import (
    CheckpointUnreadable,
    CheckpointWriteError,
    PsTimeout,
    describe_task,
    device_of,
    on_each_ps,
    slots_of,
)
from psclient._coordinator.checkpoints.checkpoint_snapshot import Snapshot, write_snapshot
from psclient._coordinator.variables.sharding import ROW_DIFF_MIN_ROWS
from psclient._core.errors import first_line

__all__ = ["ROW_DIFF_MIN_ROWS", "Deltas"]

log = logging.getLogger("psclient")

@dataclasses.dataclass
class _Base:
    """The cut the next delta is diffed against: the full checkpoint `number`, its `deltas` so far, and
    the row-diffed shards' values of the newest of them, kept on their ps (`kept`: ps -> {(key, spec):
    tensor}), with each variable's handle then (a renewed handle: its ps was lost, the copy with it)."""

    number: int
    deltas: int
    kept: dict
    handles: dict
    #: ps -> {table shard prefix: {field: its export's tensor}} (`table_deltas`).
    tables: dict
    #: key -> the table's `renewals` then (`renewals`).
    renewals: dict


def _first_row(spec: str) -> tuple[int, int | None]:
    """(first row, rows) of a slice spec "R C start,len:-" ((0, None) for a whole variable)."""
    if not spec:
        return 0, None
    start, length = spec.split(" ")[-1].split(":")[0].split(",")
    return int(start), int(length)


def row_slots(variables: dict[str, Any]) -> dict[tuple[str, str], tuple[int, int, Any]]:
    """(key, spec) -> (first row, rows, variable handle) of every row-diffed shard of `variables`."""
    out = {}
    for slots in slots_of(variables).values():
        for slot in slots:
            if len(slot.full_shape) == 2 and slot.full_shape[0] >= ROW_DIFF_MIN_ROWS:
                start, _ = _first_row(slot.spec)
                out[(slot.key, slot.spec)] = (start, int(slot.variable.shape[0]), slot.variable.handle)
    return out


def renewals(tables: dict | None) -> dict[str, int]:
    """key -> `renewals` of each dynamic table: a shard made again on a ps that came back (its kept
    export gone with the old task; no restore of this store told it, e.g. a Keras callback's) counts."""
    return {key: table.renewals for key, table in (tables or {}).items()}


def _changed(old, new):
    """On the ps in force: the indices (int64) of the rows of `new` that differ from `old`, and those rows."""
    differs = tf.reduce_any(tf.not_equal(old, new), axis=_constant(1, tf.int32))
    indices = tf.reshape(tf.where(differs), _constant([-1], tf.int32))
    return indices, tf.gather(new, indices, axis=_constant(0, tf.int32))


def any_delta(path: str) -> bool:
    """Whether a delta of the full checkpoint `path` is in its directory."""
    return bool(tf.io.gfile.glob(path + ".delta-*.index"))


class Deltas:
    """The delta chain of one checkpoint directory: its base, the delta writes, and the restore's replay."""

    def __init__(self, directory: str, describe_ps: Callable[[int], str], hang_timeout: float | None):
        self.directory, self._describe_ps, self._timeout = directory, describe_ps, hang_timeout
        self._base: _Base | None = None
        #: For stats()["checkpoints"].
        self.times: dict = {"last_delta_bytes": None, "last_delta_seconds": None, "last_delta_rows": None,
                            "last_delta_stall_seconds": None, "deltas_written": 0}
        self.last_snapshot_delta = False

    @property
    def since_full(self) -> int:
        """Deltas written on the newest full checkpoint."""
        return 0 if self._base is None else self._base.deltas

    def snapshot_taken(self, times: dict, delta: bool) -> None:
        """A checkpoint's snapshot was taken (`delta`: meant as a delta); `times` is the store's, whose
        `last_stall_seconds` the engine sets once dispatch resumes: the stall of the newest snapshot."""
        if self.last_snapshot_delta:
            self.times["last_delta_stall_seconds"] = times.get("last_stall_seconds")
        self.last_snapshot_delta = delta and self._base is not None

    def stats(self, times: dict) -> dict:
        """stats()["checkpoints"]'s delta entries: deltas on the newest full checkpoint, and the last
        delta's bytes, seconds to write, rows written and stall (dispatch paused for its snapshot)."""
        stall = times.get("last_stall_seconds") if self.last_snapshot_delta else self.times["last_delta_stall_seconds"]
        return {"deltas_since_full": self.since_full, "deltas_written": self.times["deltas_written"],
                "last_delta_bytes": self.times["last_delta_bytes"],
                "last_delta_seconds": self.times["last_delta_seconds"],
                "last_delta_rows": self.times["last_delta_rows"], "last_delta_stall_seconds": stall}

    def forget(self) -> None:
        """No base any more (a restore changed the variables): the next checkpoint is full."""
        self._base = None

    def rebase(self, number: int, pending: Any) -> None:
        """The full checkpoint `number` was written from `pending`: the next delta diffs against its cut."""
        rows = pending.rows or {}
        kept = {ps: {(n, s): v for n, s, v in zip(*part) if (n, s) in rows}
                for ps, part in pending.snapshot.parts.items()}
        # A copied table shard's values were packed (or merged) by the write: the same tensors here,
        # a field in two pieces kept so (sharing its stage, as a 32-wide one's first rows do), joined
        # only for the next delta's diff.
        tables = {ps: table_deltas.kept(part[0], _table_copy.resolved(part[2], split=True))
                  for ps, part in pending.snapshot.parts.items()}
        self._base = _Base(number, 0, kept, {k: handle for k, (_, _, handle) in rows.items()}, tables,
                           dict(pending.renewals or {}))

    def can_diff(self, pending: Any) -> bool:
        """Whether `pending` can be written as a delta: a base of this run, with every row-diffed shard
        kept and its variable not renewed since (a lost ps took its copy with it), nor any table."""
        base = self._base
        if base is None or not pending.delta or base.renewals != (pending.renewals or {}):
            return False
        kept = {k for part in base.kept.values() for k in part}
        # Every table shard kept, with the same fields (a slot the optimizer made since: full).
        tables = all(set(fields) == set(base.tables.get(ps, {}).get(prefix, ()))
                     for ps, part in pending.snapshot.parts.items()
                     for prefix, fields in table_deltas.split(part[0]).items())
        return tables and all(k in kept and base.handles.get(k) is handle
                              for k, (_, _, handle) in pending.rows.items())

    # ------------------------------------------------------------------ write
    def next_path(self) -> str:
        """The path the next delta will have (there is a base)."""
        return os.path.join(self.directory, f"ckpt-{self._base.number}.delta-{self._base.deltas + 1}")

    def write(self, pending: Any, scalars: dict, meta: dict | None, abandoned: Callable[[], bool]) -> str:
        """Write `pending` as the next delta of the base; its path. Raises CheckpointWriteError as a
        full write does (then nothing is under the delta's name, and the base stays as it was)."""
        base = self._base
        started = time.monotonic()
        number, final = base.deltas + 1, self.next_path()
        temp = f"{final}.tmp-{secrets.token_hex(4)}"
        try:
            diffed = on_each_ps({ps: self._differ(ps, pending, base) for ps in pending.snapshot.parts},
                                timeout=self._timeout)
        except (tf.errors.OpError, PsTimeout) as error:
            raise CheckpointWriteError(
                f"{describe_task(getattr(error, '_psclient_ps', None), self._describe_ps)} could not diff its "
                f"rows for checkpoint delta {final}: {first_line(error)}. The delta was not written; the "
                "previous checkpoint stays the newest.") from error
        parts = {ps: out[:3] for ps, out in diffed.items()}
        snapshot = Snapshot(list(pending.snapshot.keys), parts,
                            {ps: sorted(set(names)) for ps, (names, _s, _v) in parts.items()},
                            pending.snapshot.tables, pending.snapshot.seconds)
        shards = {}
        for (key, _spec), (start, rows, _h) in pending.rows.items():
            shards.setdefault(key, []).append([start, rows])
        layout = {**(meta or {}), "delta": {"base": f"ckpt-{base.number}", "number": number,
                                            "rows": {k: sorted(v) for k, v in shards.items()}}}
        try:
            write_snapshot(temp, snapshot, scalars, self._describe_ps, layout, timeout=self._timeout,
                           abandoned=abandoned)
            written = self._publish(temp, final)
        finally:
            for name in tf.io.gfile.glob(temp + ".*"):  # a rename cut short: never a delta
                tf.io.gfile.remove(name)
        base.deltas = number
        for ps, out in diffed.items():
            base.kept.setdefault(ps, {}).update(out[3])
            base.tables[ps] = out[5]
        self.times.update(last_delta_bytes=written, last_delta_seconds=time.monotonic() - started,
                          last_delta_rows=sum(out[4] for out in diffed.values()),
                          deltas_written=self.times["deltas_written"] + 1)
        return final

    def _differ(self, ps: int, pending: Any, base: _Base) -> Callable[[], tuple]:
        names, specs, values = pending.snapshot.parts[ps]
        kept, rows = base.kept.get(ps, {}), pending.rows
        tables = table_deltas.split(names)
        in_tables = {position for fields in tables.values() for position in fields.values()}

        def run():
            out_names, out_specs, out_values, new_kept, changed = [], [], [], {}, 0
            with device_of(ps):
                # A table shard copied before the cut: packed (or merged) now, on this ps.
                values_now = _table_copy.resolved(values)
                for prefix, fields in tables.items():
                    try:
                        old = {field: _table_copy.joined(value) for field, value in base.tables[ps][prefix].items()}
                        more, tensors, count = table_deltas.diff(prefix, fields, old, values_now)
                    except tf.errors.OpError as error:
                        error._psclient_ps = ps
                        raise
                    out_names += more
                    out_specs += [""] * len(more)
                    out_values += tensors
                    changed += count
                for position, (name, spec, value) in enumerate(zip(names, specs, values_now)):
                    if position in in_tables:
                        continue
                    if (name, spec) not in rows:
                        out_names.append(name), out_specs.append(spec), out_values.append(value)
                        continue
                    try:
                        indices, changed_rows = _changed(kept[(name, spec)], value)
                        count = int(indices.shape[0])  # its shape: tf.size would convert here
                        changed += count
                        item = value.dtype.size
                        if count and count * (value.shape[1] * item + 8) >= value.shape.num_elements() * item:
                            indices, changed_rows = _constant([], tf.int64), value  # no smaller: whole
                    except tf.errors.OpError as error:
                        error._psclient_ps = ps
                        raise
                    at = f"{name}/delta/{rows[(name, spec)][0]}"
                    out_names += [at + "/idx", at + "/rows"]
                    out_specs += ["", ""]
                    out_values += [indices, changed_rows]
                    new_kept[(name, spec)] = value
            return out_names, out_specs, out_values, new_kept, changed, table_deltas.kept(names, values_now)
        return run

    @staticmethod
    def _publish(temp: str, final: str) -> int:
        """Rename the delta's files from `temp` to `final`, its index last; its bytes."""
        written = 0
        for name in sorted(tf.io.gfile.glob(temp + ".data-*")):
            written += tf.io.gfile.stat(name).length
            tf.io.gfile.rename(name, final + name[len(temp):], overwrite=True)
        written += tf.io.gfile.stat(temp + ".index").length
        tf.io.gfile.rename(temp + ".index", final + ".index", overwrite=True)
        return written

    # ---------------------------------------------------------------- restore
    def numbers(self, path: str) -> list[int]:
        """M of every complete delta `path.delta-M` (its index present), in order."""
        pattern = re.compile(re.escape(os.path.basename(path)) + r"\.delta-(\d+)\.index$")
        found = [pattern.match(os.path.basename(name)) for name in tf.io.gfile.glob(path + ".delta-*.index")]
        return sorted(int(m.group(1)) for m in found if m)

    def restore_onto(self, path: str, variables: dict[str, Any], tables: dict, only_ps: frozenset | None,
                     completed: int | None, meta: dict) -> tuple:
        """The complete deltas of `path` in order, each read and checked on the ps tasks (nothing
        assigned, nothing kept: `delta_restore`); stops at the first missing or damaged one (logged).
        Returns (the deltas as a `delta_restore.Chain`, completed, meta of the newest, deltas to be
        applied, deltas passed over with their problem)."""
        checked, applied, skipped = [], [], []
        for expected, number in enumerate(self.numbers(path), start=1):
            delta = f"{path}.delta-{number}"
            if number != expected:
                problem = f"{path}.delta-{expected} is missing"
                log.warning("checkpoint delta %s: %s; restored up to the one before", delta, problem)
                skipped.append({"path": delta, "error": problem})
                break
            try:
                one = _delta_restore.check(path, delta, variables, tables, only_ps, self._describe_ps, self._timeout)
            except CheckpointUnreadable as error:
                log.warning("checkpoint delta %s is not usable (%s); restored up to the one before", delta, error)
                skipped.append({"path": delta, "error": str(error)})
                break
            checked.append(one)
            completed, meta = one.completed, one.meta
            applied.append(delta)
        return _delta_restore.Chain(checked), completed, meta, applied, skipped
