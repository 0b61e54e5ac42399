"""The strategy's own checkpoints of the ps variables.

Each ps task writes its own variables (and its shards of partitioned ones)
as its own data file, all ps at once; the coordinator then merges the small
index files and writes its own tiny part (see `checkpoint_parts`). No copy
of the model is ever in the coordinator's memory, and no value passes
through it, on save or restore.

A checkpoint counts once the state file `checkpoint` names it. That file is
written last, after every part is complete and merged under `ckpt-N`, and
replaced atomically (`psclient._core.files`): readers that go through it
(`tf.train.latest_checkpoint`, psclient's SidecarEvaluator) never see half of
one. A ps that dies during a save leaves its part in a scratch directory
that is removed, so the previous checkpoint stays the newest. The newest
`keep` are kept.

A save is two steps: `snapshot` in a cut (dispatch paused, nothing
running: each ps holds the values of that moment, `checkpoint_snapshot`;
the big sparse-updated variables and table shards copied by `prepare` before
it, training going on, re-read only where written since: `fuzzy_copy`,
`table_copy`), then `write`. The strategy writes on this store's own thread
(`write_in_background`, `checkpoint_writer`), one write at a time, while
training goes on; `close()` joins it, and a restore waits for it. Every call
on a ps waits at most `hang_timeout`: a hung ps fails the save
(CheckpointWriteError) or the restore (PSUnavailableError), naming it.

Each variable created in `strategy.scope()` is saved under a key made from its
creation index (`v000012`), so the same training script, run again, finds its
variables again in the same order; its name and shape are checked on restore.
The checkpoint also records how many scheduled functions had completed when
it was taken, so a rollback can say how many steps it undid.

No checkpoint call may wait on a worker: a hung one would stall the
coordinator. TF's own saver, given variables on several tasks, traces a new
function at every save (registered on every task, hung ones too) and ends with
a sync of every task. Here each part is written with eager ops that involve
only one ps and the coordinator. The file format is TF's usual object-based
checkpoint, the keys those of `tf.train.Checkpoint(v000000=..., ...)`;
checkpoints written by earlier psclient versions (one data file, written by
the coordinator) restore the same way.

Checkpoints are user data: checkpoints already in the directory when the
strategy starts belong to another run. This one neither writes beside them
(it would prune them) nor restores them into its variables until
the user adopts them with `restore()`, or says to start over with
`overwrite_checkpoints=True` (then they are never read, and are pruned as
this run's are written). A restore reads and checks every value (names,
shapes, dtypes, checksums), each ps its own, before assigning any, and
falls back from a missing or damaged newest checkpoint to the newest
complete one.

With `deltas`, checkpoints between full ones may be deltas `ckpt-N.delta-M`
(`checkpoint_deltas`): only what changed since the previous checkpoint. A
restore then applies the full checkpoint's complete deltas in order.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator.checkpoints import checkpoint_deltas as _deltas
from psclient._coordinator.checkpoints import checkpoint_files as _files
from psclient._coordinator.checkpoints import checkpoint_parts as _parts
from psclient._coordinator.checkpoints import checkpoint_snapshot as _snapshot
from psclient._coordinator.checkpoints import fuzzy_copy as _fuzzy
from psclient._coordinator.checkpoints import table_checkpoint, table_deltas
from psclient._coordinator.checkpoints.checkpoint_parts import CheckpointUnreadable
from psclient._coordinator.checkpoints.checkpoint_writer import BackgroundWriter, PendingSave
from psclient._core.errors import PSUnavailableError, first_line, hung_ps_of

__all__ = ["CheckpointUnreadable", "Checkpoints", "check_directory", "variable_key"]

log = logging.getLogger("psclient")

_COMPLETED_KEY = "psclient_completed"
_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"
_BY_CREATION = ("creation order: create the same variables, in the same order, as the run that wrote "
                "the checkpoint")


def variable_key(index: int) -> str:
    return f"v{index:06d}"


def check_directory(directory: str | os.PathLike) -> str:
    """`checkpoint_dir` as a str; raises before anything connects if it cannot be a directory.

    A local path is made absolute: the ps tasks write into it too, and their
    working directory is not the coordinator's.
    """
    path = os.fspath(directory)
    if "://" not in path:
        path = os.path.abspath(path)
    if tf.io.gfile.exists(path) and not tf.io.gfile.isdir(path):
        raise ValueError(
            f"Invalid value for argument `checkpoint_dir`. Received: checkpoint_dir={path!r}, "
            "which is a file, not a directory. Expected a directory (existing or to be created)."
        )
    return path


class Checkpoints:
    """Save and restore a set of ps variables in one directory, each ps its own part.

    `describe_ps(ps)` names a ps task in messages (its address).
    """

    def __init__(self, directory: str, *, keep: int, overwrite: bool = False,
                 describe_ps: Callable[[int], str] = lambda ps: f"ps:{ps}", matched_by: str = _BY_CREATION,
                 hang_timeout: float | None = None, deltas: bool = False):
        self.directory = check_directory(directory)
        # `deltas`: checkpoints between full ones may be deltas (`checkpoint_deltas`); each full one then
        # keeps its row-diffed shards' values on their ps as the next delta's base.
        self._deltas = _deltas.Deltas(self.directory, describe_ps, hang_timeout) if deltas else None
        # How long a save or restore waits on a ps (None: for good); see checkpoint_parts.on_each_ps.
        self._hang_timeout = hang_timeout
        self._writer = BackgroundWriter(self.write)
        self._commit_lock = threading.Lock()
        self._closing = False
        self._prepared: _fuzzy.Prepared | None = None  # the next cut's copies (`prepare`)
        #: Tests' hook into the write, the snapshot taken and dispatch resumed: called with
        #: the checkpoint's path on the thread that writes it, before any ps writes.
        self.before_write: Callable[[str], None] | None = None
        #: For stats() and metrics: seconds spent saving, and the newest checkpoint's seconds and bytes.
        self.times: dict = {"seconds_total": 0.0, "last_seconds": None, "last_bytes": None}
        self._matched_by = matched_by
        self.keep = keep
        self._describe_ps = describe_ps
        tf.io.gfile.makedirs(self.directory)  # local paths and TF filesystems (gs://, ...)
        existing = _files.numbers(self.directory)
        state = _files.state_numbers(self.directory)
        # What another run left here, until restore() adopts it (None: nothing, or adopted).
        self.foreign: str | None = self._describe(existing, state) if existing or state else None
        # Checkpoints numbered below this are another run's: never read without restore().
        self._first_own = max(existing | state, default=0) + 1
        self._overwrite = overwrite and self.foreign is not None
        if self._overwrite:
            log.warning("checkpoint_dir %s: overwrite_checkpoints=True: starting over; the %s are "
                        "never restored and are deleted as this run's checkpoints are written",
                        self.directory, self.foreign)
            self.foreign = None

    def check_reachable(self, num_ps: int) -> None:
        """Raise CheckpointDirError unless every ps can write here and the coordinator sees it."""
        _parts.probe_writable(self.directory, num_ps, self._describe_ps)

    def latest(self) -> str | None:
        """This run's newest checkpoint (written or adopted by restore()), or None."""
        path = tf.train.latest_checkpoint(self.directory)
        if path is None or self.foreign is not None or (_files.number(path) or 0) < self._first_own:
            return None
        return path

    def check_writable(self) -> None:
        """Raise FileExistsError if the directory holds another run's checkpoints not adopted."""
        if self.foreign is None:
            return
        raise FileExistsError(
            f"checkpoint_dir {self.directory!r} holds the checkpoints of another run "
            f"({self.foreign}); this strategy will not write beside them (they would be "
            "pruned). Either resume from them: call strategy.restore() after creating the "
            "variables, before scheduling; or start over: pass "
            "ParameterServerStrategy(..., overwrite_checkpoints=True) (they are then deleted "
            "as new checkpoints are written); or use another checkpoint_dir."
        )

    def save(self, variables: dict[str, Any], completed: int | None, scalars: dict | None = None,
             meta: dict | None = None, tables: dict | None = None, delta: bool = False) -> str:
        """Write one checkpoint of `variables` (key -> tf.Variable on a ps); return its path.

        `scalars` (name -> int) are saved beside, under `name/.ATTRIBUTES/VARIABLE_VALUE`;
        `meta` (JSON-able) joins the checkpoint's layout (`psclient_layout`).
        `tables` (key -> DynamicTable): each ps saves its shards (`table_checkpoint`).
        `delta`: as `snapshot`'s. Raises CheckpointWriteError naming the ps task that could
        not write its part. `snapshot` then `write`, at once, on this thread.
        """
        return self.write(self.snapshot(variables, completed, scalars, meta, tables, delta))

    @property
    def deltas_since_full(self) -> int | None:
        """Deltas written on the newest full checkpoint; None without `deltas`."""
        return None if self._deltas is None else self._deltas.since_full

    def snapshot(self, variables: dict[str, Any], completed: int | None, scalars: dict | None = None,
                 meta: dict | None = None, tables: dict | None = None, delta: bool = False) -> PendingSave:
        """Take a checkpoint in a cut (nothing running): each ps holds a snapshot of its
        variables and table shards, written later by `write` / `write_in_background`.
        `delta`: written as a delta of the newest full checkpoint when there is a base for one."""
        import numpy as np

        self.check_writable()  # another run's files: neither written beside nor pruned
        extra = {name: np.int64(value) for name, value in (scalars or {}).items()}
        if completed is not None:
            extra[_COMPLETED_KEY] = np.int64(completed)
        prepared, self._prepared = self._prepared, None
        snapshot = _snapshot.take_snapshot(variables, self._describe_ps, tables, timeout=self._hang_timeout,
                                           prepared=prepared)
        self.times["last_snapshot_seconds"] = snapshot.seconds
        pending = PendingSave(snapshot, completed, extra, meta)
        if self._deltas is not None:
            pending.delta, pending.rows, pending.renewals = delta, _deltas.row_slots(variables), _deltas.renewals(tables)
            self._deltas.snapshot_taken(self.times, delta)
        return pending

    def prepare(self, variables: dict[str, Any], tables: dict | None = None,
                stop: Callable[[], bool] | None = None) -> Any:
        """Before a cut, training going on (`_engine.checkpoint_copy`): copies of the big sparse-written
        variables and tables' shards (`fuzzy_copy`), for `use_prepared`; the cut reads their rows written since."""
        return _fuzzy.prepare(variables, self._describe_ps, self._hang_timeout, tables, stop)

    def use_prepared(self, prepared: Any) -> None:
        """The next `snapshot` takes these copies (None: it reads every variable whole)."""
        self._prepared = prepared
        self.times.update(last_copy_seconds=prepared.seconds if prepared else None,
                          last_copied_bytes=prepared.nbytes if prepared else 0)

    def discard_prepared(self) -> None:
        """The cut `prepare` was for is not taken (its copies are freed)."""
        self._prepared = None

    def write(self, pending: PendingSave) -> str:
        """Write the snapshot `pending` as the next `ckpt-N`, commit it (the state file last); its path.

        Raises CheckpointWriteError naming a ps that could not write its part, or
        did not within hang_timeout (the previous checkpoint stays the newest).
        """
        self.check_writable()
        with self._commit_lock:  # one write names and commits at a time (a Keras callback may save too)
            if self._deltas is not None and self._deltas.can_diff(pending):
                if self.before_write is not None:
                    self.before_write(self._deltas.next_path())
                with self._releasing(pending.snapshot.prepared):
                    pending.path = self._deltas.write(pending, pending.scalars, pending.meta, lambda: self._closing)
                return pending.path
            number = self._next_number()
            pending.path = path = os.path.join(self.directory, f"ckpt-{number}")
            started = time.monotonic()
            if self.before_write is not None:
                self.before_write(path)
            with self._releasing(pending.snapshot.prepared):
                _snapshot.write_snapshot(path, pending.snapshot, pending.scalars, self._describe_ps, pending.meta,
                                         timeout=self._hang_timeout, abandoned=lambda: self._closing)
            self._commit(number)
            if self._deltas is not None:
                self._deltas.rebase(number, pending)
        seconds = time.monotonic() - started
        written = sum(tf.io.gfile.stat(f).length for f in tf.io.gfile.glob(path + ".*"))  # index and data files
        self.times.update(seconds_total=self.times["seconds_total"] + seconds, last_seconds=seconds,
                          last_bytes=written)
        return path

    @contextlib.contextmanager
    def _releasing(self, prepared: Any):
        """Around a write of a snapshot whose cut used `prepared` copies: once written (or given up),
        their stages go, a ps the write waited `hang_timeout` for not waited on again; then the rows
        the cut read again are counted."""
        hung = None
        try:
            yield
        except _parts.CheckpointWriteError as error:
            hung = hung_ps_of(error)
            raise
        finally:
            if prepared is not None:
                prepared.release(self._hang_timeout, hung=hung)
        self.times["last_rows_read_again"] = prepared.rows_read_again() if prepared is not None else 0

    def write_in_background(self, pending: PendingSave, on_done: Callable) -> None:
        """`write(pending)` on the writer thread, training going on; `on_done(pending, path, error)`
        hears the outcome there (`checkpoint_writer.BackgroundWriter`)."""
        self._writer.submit(pending, on_done)

    def close(self, timeout: float | None = None) -> bool:
        """Join the background write in flight (False if it still runs after `timeout`)."""
        done = self._writer.close(timeout)
        if not done:
            self._closing = True  # it merges nothing once its parts are written
        return done

    def stats(self) -> dict:
        """For stats(): "checkpoint", the saves' times and bytes; "checkpoints", what the last
        one cost: how long dispatch was paused (`last_stall_seconds`), of which waiting
        for the closures running then to end (`last_drain_seconds`: they went on training)
        and the snapshot (`last_snapshot_seconds`); before the pause, the big variables' copy
        (`last_copy_seconds`, `last_copied_bytes`) and the rows the cut read again of them
        (`last_rows_read_again`); its background write's seconds; errors."""
        writer = self._writer
        saves = {key: self.times[key] for key in ("seconds_total", "last_seconds", "last_bytes")}
        return {"checkpoint": saves, "checkpoints": {
            "last_stall_seconds": self.times.get("last_stall_seconds"),
            "last_drain_seconds": self.times.get("last_drain_seconds"),
            "last_snapshot_seconds": self.times.get("last_snapshot_seconds"),
            **{key: self.times.get(key) for key in ("last_copy_seconds", "last_copied_bytes", "last_rows_read_again")},
            "last_write_seconds": writer.last_write_seconds, "writing": writer.writing,
            "background_writes": writer.writes, "write_errors": writer.write_errors,
            "last_write_error": writer.last_error,
            **(self._deltas.stats(self.times) if self._deltas is not None else {})}}

    def restore(self, variables: dict[str, Any], *, adopt: bool = False, tables: dict | None = None,
                only_ps: frozenset | None = None) -> dict | None:
        """Assign every variable its value in the newest complete checkpoint.

        `adopt` (the user's restore()): every checkpoint in the directory may
        be read, and from then on this run writes beside them. Otherwise only
        this run's own. `tables` (key -> DynamicTable) are restored with them,
        into any number of ps tasks (see `table_checkpoint`). `only_ps` (a
        part-only ps recovery): only what those ps tasks hold (variables,
        shards, table shards) is read and assigned; the rest keeps its values.

        Returns {"path", "completed_closures", "skipped", "meta", "restored"}
        (`skipped`: newer checkpoints passed over, with what was wrong; `meta`:
        what `save(meta=...)` stored; `restored`: {"variables": {ps: n},
        "rows": {ps: n}}, what each ps got back; `deltas`, with deltas on or
        any in the directory: those of `path` applied after it, in order), or None if there is no
        checkpoint. Every value is read (each ps reads its own) and checked
        before any is assigned: raises ValueError naming the checkpoint and the
        variables that do not match (missing, other shape or dtype),
        CheckpointUnreadable naming each checkpoint tried, the ps task, the
        variables, the file and the error when none is complete.
        """
        self._writer.wait_idle()  # a write in flight ends first (bounded: hang_timeout per ps call)
        try:
            return self._restore(variables, adopt, tables, only_ps)
        except _parts.PsTimeout as error:
            ps = error._psclient_ps
            raise PSUnavailableError(
                f"restore: ps:{ps} ({self._describe_ps(ps)}) did not answer within hang_timeout="
                f"{self._hang_timeout:g} s (hung?); nothing more was read or assigned there. Variables "
                "already assigned on other ps keep their restored values: restore again once it answers.",
                task=f"ps:{ps}", address=self._describe_ps(ps)) from error

    def _restore(self, variables: dict[str, Any], adopt: bool, tables: dict | None,
                 only_ps: frozenset | None) -> dict | None:
        floor = 0 if adopt else (None if self.foreign is not None else self._first_own)
        candidates = [] if floor is None else sorted(
            (n for n in self._all_numbers() if n >= floor), reverse=True)
        if not candidates:
            if adopt:
                self.foreign = None
            return None
        skipped = []
        for number in candidates:
            path = os.path.join(self.directory, f"ckpt-{number}")
            try:
                values, completed, table_states, meta = self._read(path, variables, tables or {}, only_ps)
            except CheckpointUnreadable as error:
                log.warning("checkpoint %s is not usable: %s", path, error)
                skipped.append({"path": path, "error": str(error)})
                continue
            applied, patch, table_patches = None, None, []
            if self._deltas is not None or _deltas.any_delta(path):  # newest full + its deltas in order
                # Each delta checked now; applied to each batch as the second pass reads and assigns it.
                chain, completed, meta, applied, bad = self._deltas_for_read().restore_onto(
                    path, variables, tables or {}, only_ps, completed, meta)
                skipped += bad
                chain.route(values)
                patch = chain.patch if chain.deltas else None
                table_patches = [table_deltas.patcher(d.path, tables, d.tables) for d in chain.deltas if tables]
            if self._deltas is not None:
                # The variables change now: the next checkpoint is full. Dropped first: the base's copies
                # may share the variables' buffers, which a sliced assign would then copy whole.
                self._deltas.forget()
            on_each_ps = functools.partial(_parts.on_each_ps, timeout=self._hang_timeout)
            _parts.assign_on_ps(values, timeout=self._hang_timeout, patch=patch)
            rows = table_checkpoint.assign(table_states, on_each_ps, table_patches)
            if adopt:
                self.foreign, self._first_own = None, 0
            if skipped:
                log.warning("restored %s, the newest complete checkpoint; passed over %s",
                            path, ", ".join(s["path"] for s in skipped))
            restored = {"variables": {ps: len(part) for ps, part in values.items()}, "rows": rows}
            return {"path": path, "completed_closures": completed, "skipped": skipped, "meta": meta,
                    "restored": restored, **({"deltas": applied} if applied is not None else {})}
        raise CheckpointUnreadable(
            f"No checkpoint in {self.directory} could be read, so no variable was restored: "
            + "; ".join(f"{s['path']}: {s['error']}" for s in skipped)
        )

    # ---------------------------------------------------------------- private
    def _commit(self, number: int) -> None:
        """Name checkpoint `number` in the state file (atomically), then prune beyond `keep`."""
        own = sorted(n for n in _files.state_numbers(self.directory) | {number}
                     if tf.io.gfile.exists(os.path.join(self.directory, f"ckpt-{n}.index")))
        if self._overwrite:  # another run's, to be replaced: pruned with this run's
            own = sorted(set(own) | {n for n in _files.numbers(self.directory) if n < self._first_own})
        kept, dropped = own[-self.keep:], own[:-self.keep]
        _files.write_state(self.directory, kept)
        for old in dropped:
            _files.delete(self.directory, old)

    def _describe(self, existing: set[int], state: set[int]) -> str:
        numbers = existing | state
        if not numbers:
            return "a checkpoint state file"
        newest = os.path.join(self.directory, f"ckpt-{max(numbers)}")
        completed = self._completed_in(newest)
        return (f"{len(numbers)} checkpoint(s), the newest {newest}"
                + (f" after {completed} completed closures" if completed is not None else ""))

    @staticmethod
    def _completed_in(path: str) -> int | None:
        try:
            return int(tf.train.load_checkpoint(path).get_tensor(_COMPLETED_KEY + _VALUE))
        except (tf.errors.OpError, ValueError, IndexError):  # unreadable, or not a psclient checkpoint
            return None

    def _read(self, path: str, variables: dict[str, Any], tables: dict[str, Any],
              only_ps: frozenset | None = None) -> tuple[dict, int | None, dict, dict]:
        """Every variable's value and table shard in `path` (held by `only_ps`, when given),
        read on its ps and checked (names, shapes, dtypes, data), and the meta `save` stored."""
        try:
            reader = tf.train.load_checkpoint(path)  # the index only (small), on the coordinator
            shapes = reader.get_variable_to_shape_map()
            dtypes = reader.get_variable_to_dtype_map()
        except (tf.errors.OpError, ValueError) as error:
            raise CheckpointUnreadable(f"{_index_problem(path)}: {first_line(error)}") from error
        self._check_matches(variables, path, shapes, dtypes, self._matched_by)
        layout, completed = None, None
        try:
            if _parts.LAYOUT_KEY in shapes:
                layout = json.loads(reader.get_tensor(_parts.LAYOUT_KEY))
            if _COMPLETED_KEY + _VALUE in shapes:
                completed = int(reader.get_tensor(_COMPLETED_KEY + _VALUE))
        except (tf.errors.OpError, ValueError, IndexError) as error:
            raise CheckpointUnreadable(
                f"the coordinator's part of it cannot be read: {first_line(error)}") from error
        if tables:
            problems = table_checkpoint.check(tables, (layout or {}).get("tables", {}))
            if problems:
                raise ValueError(f"The checkpoint {path} does not match the dynamic embedding tables: "
                                 f"{'; '.join(problems)}. Nothing was restored.")
        values = _parts.read_on_ps(path, variables, dtypes, layout, self._describe_ps, only_ps,
                                   timeout=self._hang_timeout)
        meta = {k: v for k, v in (layout or {}).items() if k not in ("format", "parts", "tables", "row_chunks")}
        return values, completed, self._read_tables(path, tables, layout, only_ps), meta

    def _read_tables(self, path: str, tables: dict[str, Any], layout: dict | None,
                     only_ps: frozenset | None = None) -> dict:
        if not tables:
            return {}
        work = table_checkpoint.read(path, tables, layout["tables"], layout)
        if only_ps is not None:
            work = {ps: read for ps, read in work.items() if ps in only_ps}
        try:
            return _parts.on_each_ps(work, timeout=self._hang_timeout)
        except tf.errors.OpError as error:
            what = getattr(error, "_psclient_table", "a dynamic table")
            raise CheckpointUnreadable(
                f"the shards of {what} cannot be read from {path} (corrupt or truncated data file?): "
                f"{first_line(error)}") from error

    def _deltas_for_read(self) -> "_deltas.Deltas":
        return self._deltas or _deltas.Deltas(self.directory, self._describe_ps, self._hang_timeout)

    def _next_number(self) -> int:
        """One past the highest `ckpt-N` in the directory or its state file: no save overwrites another."""
        return max(self._all_numbers() | {0}) + 1

    def _all_numbers(self) -> set[int]:
        return _files.numbers(self.directory) | _files.state_numbers(self.directory)

    @staticmethod
    def _check_matches(variables: dict[str, Any], path: str, shapes: dict, dtypes: dict, matched_by: str) -> None:
        problems = []
        for key, variable in variables.items():
            name = key + _VALUE
            if name not in shapes:
                problems.append(f"{key} ({variable.name}, shape {variable.shape.as_list()}) is not in it")
            elif list(shapes[name]) != variable.shape.as_list():
                problems.append(
                    f"{key} ({variable.name}) has shape {list(shapes[name])} there but "
                    f"{variable.shape.as_list()} here"
                )
            elif dtypes[name] != variable.dtype:
                problems.append(
                    f"{key} ({variable.name}) has dtype {dtypes[name].name} there but "
                    f"{variable.dtype.name} here"
                )
        if problems:
            raise ValueError(
                f"The checkpoint {path} does not match the variables created in "
                f"strategy.scope(): {'; '.join(problems[:10])}"
                + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else "")
                + f". Nothing was restored. Variables are matched by {matched_by}, or use "
                "another checkpoint_dir."
            )


def _index_problem(path: str) -> str:
    return f"its index file {path}.index is {'unreadable' if tf.io.gfile.exists(path + '.index') else 'missing'}"
