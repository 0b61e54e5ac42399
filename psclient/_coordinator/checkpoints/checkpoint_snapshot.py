"""A checkpoint in two steps: a snapshot taken in a cut, written while training goes on.

`take_snapshot` runs while no closure runs (dispatch paused): each ps reads
its variables and exports its table shards *there*
(`variable.read_value()` under the ps's device). What comes back are handles
of tensors on that ps; nothing is copied to the coordinator. TF's resource
variables copy on write: an update to a variable whose buffer a read still
holds copies the buffer first (`PrepareToUpdateVariable`), so the held
reads are the values of the cut and cost memory only for what training
updates before they are written. A variable updated by sparse ops
(`ResourceScatter*`, Keras's embedding updates) is in TF's copy-on-read
mode instead: its read is a copy, made on the ps during the cut.

`write_snapshot` then has each ps write its tensors (SaveV2 there, one
thread per ps: `checkpoint_parts.on_each_ps`), merges the parts and
returns; `checkpoint.Checkpoints` commits the state file last. Parts go to a
scratch directory (`.psclient-save-*`) that the merge empties: a write given
up on (a ps that did not answer within hang_timeout, `PsTimeout`) is never
merged, and its scratch directory is removed once the last thread still
writing into it returns.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import secrets
import threading
import time
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator import runtime as _runtime
from psclient._coordinator.checkpoints import checkpoint_pieces as _pieces
from psclient._coordinator.checkpoints import fuzzy_copy as _fuzzy
from psclient._coordinator.checkpoints import table_copy as _table_copy
from psclient._coordinator.checkpoints import table_checkpoint
from psclient._coordinator.checkpoints.checkpoint_parts import (
    GRAPH_KEY,
    LAYOUT_KEY,
    LOCAL,
    VALUE_SUFFIX,
    CheckpointWriteError,
    describe_task,
    device_of,
    object_graph,
    on_each_ps,
    part_prefix,
    PsTimeout,
    slots_of,
)
from psclient._core.errors import first_line
from psclient._tf import checkpoints as _checkpoints

__all__ = ["Snapshot", "take_snapshot", "write_snapshot"]

log = logging.getLogger("psclient")


class Snapshot:
    """What each ps will write of one checkpoint, taken in a cut (no closure running).

    `parts`: ps -> (names, specs, tensors), the tensors held on that ps (a
    variable's `read_value()` there, a table shard's export): written later,
    while training goes on, without reading any variable again.
    """

    __slots__ = ("keys", "parts", "layout_parts", "tables", "seconds", "prepared")

    def __init__(self, keys: list[str], parts: dict[int, tuple], layout_parts: dict[int, list[str]],
                 tables: dict | None, seconds: float, prepared: _fuzzy.Prepared | None = None):
        self.keys, self.parts, self.layout_parts, self.tables = keys, parts, layout_parts, tables
        self.seconds = seconds
        #: The copies its big variables took before the cut (None: all read in the cut): their
        #: stages, read in the cut (`fuzzy_copy.cut`), released by the write; the rows read again.
        self.prepared = prepared


def take_snapshot(variables: dict[str, Any], describe_ps: Callable[[int], str],
                  tables: dict | None = None, timeout: float | None = None,
                  prepared: _fuzzy.Prepared | None = None) -> Snapshot:
    """Read every variable (and export every table shard) on its own ps, all ps at once.

    Run it in a cut: the snapshot holds exactly the values of that moment.
    A variable's read is its buffer, shared until the next update copies it
    (TF's resource variables copy on write; one updated by scatter ops reads
    as a copy): the snapshot costs memory only for what changes before it is
    written. Raises CheckpointWriteError naming a ps that cannot be read
    (or does not answer within `timeout` seconds).
    """
    started = time.monotonic()
    by_ps = slots_of(variables)
    table_work = table_checkpoint.save_work(tables or {}, prepared)
    table_names = table_checkpoint.names_by_ps(tables or {})
    tasks = sorted(set(by_ps) | set(table_work))

    def take(ps: int) -> Callable[[], tuple]:
        slots = by_ps.get(ps, [])

        def run():
            if prepared is not None:
                # Counted afresh: `on_each_ps` makes this work again when a call overtakes the
                # registration of a function it traced, and its first counts would stay.
                prepared.read_again.pop(ps, None)
            with device_of(ps):
                try:
                    values = _read(ps, slots, prepared)  # read there: stays on this ps
                    names, specs = [s.key for s in slots], [s.spec for s in slots]
                    if ps in table_work:  # exported on this ps, written with its variables
                        more, tensors = table_work[ps]()
                        names, specs, values = names + more, specs + [""] * len(more), values + tensors
                except tf.errors.OpError as error:
                    error._psclient_ps = ps
                    raise
            return names, specs, values
        return run

    try:
        parts = on_each_ps({ps: take(ps) for ps in tasks}, timeout=timeout)
    except (tf.errors.OpError, PsTimeout) as error:
        ps = getattr(error, "_psclient_ps", None)
        raise CheckpointWriteError(
            f"{describe_task(ps, describe_ps)} could not take its snapshot of a checkpoint: {first_line(error)}. "
            "No checkpoint was written; the previous one stays the newest.") from error
    layout_parts = {ps: sorted({s.key for s in by_ps.get(ps, [])} | set(table_names.get(ps, []))) for ps in tasks}
    return Snapshot(list(variables), parts, layout_parts,
                    table_checkpoint.layout_of(tables) if tables else None, time.monotonic() - started, prepared)


def _read(ps: int, slots: list, prepared: _fuzzy.Prepared | None) -> list:
    """Each slot's value on `ps` (the device in force), in order: a read of the variable, or, for one
    copied before the cut, its copy with the rows written since read again."""
    copies = [prepared.take(ps, slot) if prepared is not None else None for slot in slots]
    patched = iter(_fuzzy.cut(prepared, ps, [copy for copy in copies if copy is not None]))
    return [slot.variable.read_value() if copy is None else next(patched) for slot, copy in zip(slots, copies)]


def write_snapshot(prefix: str, snapshot: Snapshot, scalars: dict[str, Any], describe_ps: Callable[[int], str],
                   meta: dict | None = None, timeout: float | None = None,
                   abandoned: Callable[[], bool] = lambda: False) -> None:
    """Write `snapshot` as checkpoint `prefix`, each ps its own part (SaveV2 there, of the
    tensors it holds); `scalars` (key -> numpy scalar) in the coordinator's part, with
    the layout (`meta` added to it). Returns when `prefix.index` names every part.

    Raises CheckpointWriteError naming the ps task and its file if one could not write,
    or did not finish within `timeout` seconds; nothing is then under `prefix` (the
    scratch directory is removed, by the last thread to leave it). `abandoned()`
    true: a caller gave up on this write, which then merges nothing.
    """
    tasks = sorted(snapshot.parts)
    count = len(tasks) + 1
    directory = os.path.dirname(prefix)
    scratch = os.path.join(directory, f".psclient-save-{os.path.basename(prefix)}-{secrets.token_hex(8)}")
    final_names = {ps: f"{os.path.basename(prefix)}.data-{i:05d}-of-{count:05d}" for i, ps in enumerate(tasks)}
    layout = {"format": 2, **(meta or {}), "parts": [
        {"task": f"ps:{ps}" if ps != LOCAL else "coordinator", "file": final_names[ps],
         "keys": snapshot.layout_parts[ps]} for ps in tasks]}
    if snapshot.tables:
        layout["tables"] = snapshot.tables
    written: dict[int, list] = {}  # ps -> (name, shape, dtype) of each value it wrote whole

    def write(ps: int) -> Callable[[], None]:
        def run():
            with device_of(ps):
                try:
                    names, specs, values = snapshot.parts[ps]
                    # A copied table's keys, rows and slots, packed now (`table_copy`), on this ps; a
                    # packed field in two pieces written as two slices of its key (no copy of it).
                    values = _table_copy.resolved(values, split=True)
                    written[ps] = [(name, v.shape.as_list(), v.dtype) for name, v in zip(names, values)]
                    names, specs, values = _table_copy.as_slices(names, specs, values)
                    # A big value in row chunks (sharing its buffer): a restore reads it a range at a time.
                    names, specs, values, _ = _pieces.save_chunked(names, specs, values)
                    _checkpoints.save(part_prefix(scratch, tasks.index(ps), count), names, specs, values)
                except tf.errors.OpError as error:
                    error._psclient_ps = ps
                    raise
        return run

    try:
        tf.io.gfile.makedirs(scratch)
    except tf.errors.OpError as error:
        raise CheckpointWriteError(
            f"the coordinator could not make the scratch directory {scratch} of checkpoint {prefix}: "
            f"{first_line(error)}. The checkpoint was not written; the previous one stays the newest.") from error
    scratch_owner = _ScratchOwner(scratch)
    try:
        try:
            on_each_ps({ps: write(ps) for ps in tasks}, timeout=timeout, on_late=scratch_owner.late)
        except (tf.errors.OpError, PsTimeout) as error:
            ps = getattr(error, "_psclient_ps", None)
            where = describe_task(ps, describe_ps)
            raise CheckpointWriteError(
                f"{where} could not write its part of checkpoint {prefix} "
                f"(in {scratch}, to become {final_names.get(ps, 'its data file')}): {first_line(error)}. "
                "The checkpoint was not written; the previous one stays the newest. Every ps task "
                "must be able to write to checkpoint_dir (a directory shared by every ps and the "
                "coordinator)."
            ) from error
        if abandoned():
            raise CheckpointWriteError(f"checkpoint {prefix} was given up while its parts were written: "
                                       "not merged; the previous one stays the newest.")
        layout["row_chunks"] = {"bytes": _pieces.READ_BATCH_BYTES, "keys": _readable_in_ranges(written)}
        names = [key + VALUE_SUFFIX for key in scalars] + [LAYOUT_KEY, GRAPH_KEY]
        with tf.device(_runtime.coordinator_cpu()):
            values = [tf.constant(v) for v in scalars.values()]
            values += [tf.constant(json.dumps(layout)), tf.constant(object_graph(snapshot.keys, list(scalars)))]
            own = part_prefix(scratch, len(tasks), count)
            _checkpoints.save(own, names, [""] * len(names), values)
            # Renames each part's data file to `prefix.data-i-of-count`, then writes the merged index.
            _checkpoints.merge([part_prefix(scratch, i, count) for i in range(count)], prefix)
    finally:
        scratch_owner.release()


def _readable_in_ranges(written: dict[int, list]) -> list[str]:
    """The keys whose every saved slice holds at most `READ_BATCH_BYTES` once `save_chunked` cut them
    (`written`: ps -> (name, shape, dtype) of each value): a range of their rows reads at the cost
    of the range (`checkpoint_pieces`)."""
    keys, whole = set(), set()
    for values in written.values():
        for name, shape, dtype in values:
            big = _pieces.slot_bytes_of(shape, dtype) > _pieces.READ_BATCH_BYTES
            (whole if big and _pieces.chunk_rows(shape, dtype) is None else keys).add(name)
    return sorted(keys - whole)


class _ScratchOwner:
    """Removes a save's scratch directory once the save and every call left writing in it ended."""

    def __init__(self, scratch: str):
        self._scratch, self._lock, self._users = scratch, threading.Lock(), 1

    def late(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._users += 1
        future.add_done_callback(lambda _f: self.release())

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users:
                return
        try:
            if tf.io.gfile.exists(self._scratch):
                tf.io.gfile.rmtree(self._scratch)  # a failed save's parts: never read
        except tf.errors.OpError as error:  # the directory went away (e.g. a test's tmp): nothing to keep
            log.warning("could not remove %s: %s", self._scratch, first_line(error))
