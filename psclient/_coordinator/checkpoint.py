"""The strategy's own checkpoints of the ps variables.

Written with TF's `tf.train.CheckpointManager`, which already commits a
checkpoint the way a reader needs: the data and index files of `ckpt-N` are
complete before the `checkpoint` state file names them, and that file is
replaced atomically. Readers that go through the state file
(`tf.train.latest_checkpoint`, psclient's SidecarEvaluator) never see half of
one. The manager keeps the newest `keep`.

Each variable created in `strategy.scope()` is saved under a key made from its
creation index (`v000012`), so the same training script, run again, finds its
variables again in the same order; its name and shape are checked on restore.
The checkpoint also records how many scheduled functions had completed when
it was taken, so a rollback can say how many steps it undid.

No checkpoint call may wait on a worker: a hung one would stall the
coordinator. TF's own saver, given variables on several tasks, traces a new
function at every save (registered on every task, hung ones too) and ends with
a sync of every task. So each ps variable has a mirror variable on the
coordinator: a save copies ps -> mirror with eager ops (which involve only the
ps and the coordinator), then TF writes the mirrors, all on one task, without
tracing (and without the sync of every task, see runtime.connect); a restore reads into the mirrors and assigns them to the ps
variables. The file format is TF's usual object-based checkpoint, the keys
those of `tf.train.Checkpoint(v000000=..., ...)`. The mirrors cost one copy of
the variables in the coordinator's memory.

Checkpoints are user data: checkpoints already in the directory when the
strategy starts belong to another run. This one neither writes beside them
(its manager would prune them) nor restores them into its variables until
the user adopts them with `restore()`, or says to start over with
`overwrite_checkpoints=True` (then they are never read, and are pruned as
this run's are written). A restore reads and checks every value (names,
shapes, dtypes, checksums) before assigning any, and falls back from a
missing or damaged newest checkpoint to the newest complete one.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from psclient._coordinator import runtime as _runtime

__all__ = ["CheckpointUnreadable", "Checkpoints", "check_directory", "variable_key"]

log = logging.getLogger("psclient")

_COMPLETED_KEY = "psclient_completed"
_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"
_STATE_FILE = "checkpoint"


def variable_key(index: int) -> str:
    return f"v{index:06d}"


class CheckpointUnreadable(ValueError):
    """No complete checkpoint could be read: each one tried is named with what was wrong."""


def check_directory(directory: str | os.PathLike) -> str:
    """`checkpoint_dir` as a str; raises before anything connects if it cannot be a directory."""
    import tensorflow as tf

    path = os.fspath(directory)
    if tf.io.gfile.exists(path) and not tf.io.gfile.isdir(path):
        raise ValueError(
            f"Invalid value for argument `checkpoint_dir`. Received: checkpoint_dir={path!r}, "
            "which is a file, not a directory. Expected a directory (existing or to be created)."
        )
    return path


class Checkpoints:
    """Save and restore a set of ps variables in one directory."""

    def __init__(self, directory: str, *, keep: int, overwrite: bool = False):
        import tensorflow as tf

        self.directory = check_directory(directory)
        self.keep = keep
        tf.io.gfile.makedirs(self.directory)  # local paths and TF filesystems (gs://, ...)
        self._manager = None
        self._keys: tuple[str, ...] | None = None
        self._completed = None
        self._mirrors: dict[str, Any] = {}
        existing = self._numbers()
        state = self._state_numbers()
        # What another run left here, until restore() adopts it (None: nothing, or adopted).
        self.foreign: str | None = self._describe(existing, state) if existing or state else None
        # Checkpoints numbered below this are another run's: never read without restore().
        self._first_own = max(existing | state, default=0) + 1
        if self.foreign is not None and overwrite:
            log.warning("checkpoint_dir %s: overwrite_checkpoints=True: starting over; the %s are "
                        "never restored and are deleted as this run's checkpoints are written",
                        self.directory, self.foreign)
            self.foreign = None

    def latest(self) -> str | None:
        """This run's newest checkpoint (written or adopted by restore()), or None."""
        import tensorflow as tf

        path = tf.train.latest_checkpoint(self.directory)
        if path is None or self.foreign is not None or (_number(path) or 0) < self._first_own:
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

    def save(self, variables: dict[str, Any], completed: int) -> str:
        """Write one checkpoint of `variables` (key -> tf.Variable); return its path."""
        import tensorflow as tf

        self.check_writable()  # before the manager exists: it would prune another run's files
        manager = self._manager_for(variables)
        with tf.device(_runtime.coordinator_cpu()):
            for key, variable in variables.items():
                self._mirrors[key].assign(variable.read_value())  # read on its ps, copied here
            self._completed.assign(completed)
            return manager.save(checkpoint_number=self._next_number())

    def restore(self, variables: dict[str, Any], *, adopt: bool = False) -> dict | None:
        """Assign every variable its value in the newest complete checkpoint.

        `adopt` (the user's restore()): every checkpoint in the directory may
        be read, and from then on this run writes beside them. Otherwise only
        this run's own.

        Returns {"path", "completed_closures", "skipped"} (`skipped`: newer
        checkpoints passed over, with what was wrong), or None if there is no
        checkpoint. Every value is read and checked before any is assigned:
        raises ValueError naming the checkpoint and the variables that do not
        match (missing, other shape or dtype), CheckpointUnreadable naming
        each checkpoint tried, the variable and the error when none is complete.
        """
        floor = 0 if adopt else (None if self.foreign is not None else self._first_own)
        candidates = [] if floor is None else sorted(
            (n for n in self._numbers() | self._state_numbers() if n >= floor), reverse=True)
        if not candidates:
            if adopt:
                self.foreign = None
            return None
        skipped = []
        for number in candidates:
            path = os.path.join(self.directory, f"ckpt-{number}")
            try:
                values, completed = self._read(path, variables)
            except CheckpointUnreadable as error:
                log.warning("checkpoint %s is not usable: %s", path, error)
                skipped.append({"path": path, "error": str(error)})
                continue
            self._assign(variables, values)
            if adopt:
                self.foreign, self._first_own = None, 0
            if skipped:
                log.warning("restored %s, the newest complete checkpoint; passed over %s",
                            path, ", ".join(s["path"] for s in skipped))
            return {"path": path, "completed_closures": completed, "skipped": skipped}
        raise CheckpointUnreadable(
            f"No checkpoint in {self.directory} could be read, so no variable was restored: "
            + "; ".join(f"{s['path']}: {s['error']}" for s in skipped)
        )

    # ---------------------------------------------------------------- private
    def _numbers(self) -> set[int]:
        """N of every `ckpt-N` in the directory (index or data file)."""
        import tensorflow as tf

        numbers = set()
        for name in tf.io.gfile.listdir(self.directory):
            stem, _, ext = name.partition(".")
            if ext.startswith(("index", "data")) and (number := _number(stem)) is not None:
                numbers.add(number)
        return numbers

    def _state_numbers(self) -> set[int]:
        """N of every `ckpt-N` the state file names (some may be missing)."""
        import tensorflow as tf

        if not tf.io.gfile.exists(os.path.join(self.directory, _STATE_FILE)):
            return set()
        try:
            state = tf.train.get_checkpoint_state(self.directory)
        except tf.errors.OpError as error:  # a damaged state file: the files themselves count
            log.warning("checkpoint_dir %s: the state file is unreadable (%s)", self.directory, error)
            return set()
        paths = [] if state is None else [state.model_checkpoint_path, *state.all_model_checkpoint_paths]
        return {n for p in paths if (n := _number(os.path.basename(p))) is not None}

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
        import tensorflow as tf

        try:
            return int(tf.train.load_checkpoint(path).get_tensor(_COMPLETED_KEY + _VALUE))
        except (tf.errors.OpError, ValueError, IndexError):  # unreadable, or not a psclient checkpoint
            return None

    def _read(self, path: str, variables: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        """Every variable's value in `path`, checked: names, shapes, dtypes, then the data."""
        import tensorflow as tf

        try:
            reader = tf.train.load_checkpoint(path)
            shapes = reader.get_variable_to_shape_map()
            dtypes = reader.get_variable_to_dtype_map()
        except (tf.errors.OpError, ValueError) as error:
            raise CheckpointUnreadable(f"{_index_problem(path)}: {_first_line(error)}") from error
        self._check_matches(variables, path, shapes, dtypes)
        values = {}
        for key, variable in variables.items():
            try:
                values[key] = reader.get_tensor(key + _VALUE)
            except (tf.errors.OpError, ValueError, IndexError) as error:  # checksum; IndexError: truncated
                raise CheckpointUnreadable(
                    f"the value of {key} ({variable.name}) cannot be read (corrupt or truncated "
                    f"data file?): {_first_line(error)}") from error
        completed = None
        if _COMPLETED_KEY + _VALUE in shapes:
            try:
                completed = int(reader.get_tensor(_COMPLETED_KEY + _VALUE))
            except (tf.errors.OpError, ValueError, IndexError) as error:
                raise CheckpointUnreadable(
                    f"its completed-closures count cannot be read: {_first_line(error)}") from error
        return values, completed

    def _assign(self, variables: dict[str, Any], values: dict[str, Any]) -> None:
        import tensorflow as tf

        for key, variable in variables.items():
            with tf.device(_runtime.coordinator_cpu()):
                value = tf.constant(values[key], dtype=variable.dtype)
            variable.assign(value)  # eager: one assign on the variable's ps

    def _next_number(self) -> int:
        """One past the highest `ckpt-N` in the directory: no save overwrites another.

        TF numbers by the root object's save counter, which starts again at 1
        for a new root (the variables grew, or a new run in the same directory).
        """
        return max(self._numbers() | {0}) + 1

    def _manager_for(self, variables: dict[str, Any]):
        import tensorflow as tf

        keys = tuple(variables)
        if self._manager is None or keys != self._keys:
            # The set of variables grew (or shrank): a new root object, same
            # directory and numbering (the manager reads the state file).
            with tf.device(_runtime.coordinator_cpu()):
                if self._completed is None:
                    self._completed = tf.Variable(0, dtype=tf.int64, trainable=False)
                for key, variable in variables.items():
                    mirror = self._mirrors.get(key)
                    if mirror is None or mirror.shape != variable.shape or mirror.dtype != variable.dtype:
                        self._mirrors[key] = tf.Variable(
                            tf.zeros(variable.shape, variable.dtype), trainable=False)
                for key in set(self._mirrors) - set(variables):
                    del self._mirrors[key]
                root = tf.train.Checkpoint(
                    **{key: self._mirrors[key] for key in keys}, **{_COMPLETED_KEY: self._completed})
                root.save_counter  # noqa: B018 - created here, on the coordinator, not on a ps
            self._manager = tf.train.CheckpointManager(root, self.directory, max_to_keep=self.keep)
            self._keys = keys
        return self._manager

    @staticmethod
    def _check_matches(variables: dict[str, Any], path: str, shapes: dict, dtypes: dict) -> None:
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
                + ". Nothing was restored. Variables are matched by creation order: create the "
                "same variables, in the same order, as the run that wrote the checkpoint, or use "
                "another checkpoint_dir."
            )


def _number(name: str) -> int | None:
    """N of `ckpt-N` (a file stem or a checkpoint prefix), else None."""
    prefix, _, number = os.path.basename(name).rpartition("-")
    return int(number) if prefix == "ckpt" and number.isdigit() else None


def _index_problem(path: str) -> str:
    import tensorflow as tf

    if not tf.io.gfile.exists(path + ".index"):
        return f"its index file {path}.index is missing"
    return f"its index file {path}.index is unreadable"


def _first_line(error: BaseException) -> str:
    text = str(getattr(error, "message", None) or error)
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__
