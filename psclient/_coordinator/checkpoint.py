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
"""

from __future__ import annotations

import logging
import os
from typing import Any

from psclient._coordinator import runtime as _runtime

__all__ = ["Checkpoints", "variable_key"]

log = logging.getLogger("psclient")

_COMPLETED_KEY = "psclient_completed"


def variable_key(index: int) -> str:
    return f"v{index:06d}"


class Checkpoints:
    """Save and restore a set of ps variables in one directory."""

    def __init__(self, directory: str, *, keep: int):
        import tensorflow as tf

        self.directory = os.fspath(directory)
        self.keep = keep
        tf.io.gfile.makedirs(self.directory)  # local paths and TF filesystems (gs://, ...)
        self._manager = None
        self._keys: tuple[str, ...] | None = None
        self._completed = None
        self._mirrors: dict[str, Any] = {}

    def latest(self) -> str | None:
        import tensorflow as tf

        return tf.train.latest_checkpoint(self.directory)

    def save(self, variables: dict[str, Any], completed: int) -> str:
        """Write one checkpoint of `variables` (key -> tf.Variable); return its path."""
        import tensorflow as tf

        manager = self._manager_for(variables)
        with tf.device(_runtime.coordinator_cpu()):
            for key, variable in variables.items():
                self._mirrors[key].assign(variable.read_value())  # read on its ps, copied here
            self._completed.assign(completed)
            return manager.save(checkpoint_number=self._next_number())

    def restore(self, variables: dict[str, Any], path: str | None = None) -> int | None:
        """Assign every variable its value in the newest (or the given) checkpoint.

        Returns the number of completed functions recorded in it, or None if
        there is no checkpoint. Raises ValueError naming the variables that do
        not match (missing, or another shape/dtype), before assigning any.
        """
        path = path or self.latest()
        if path is None:
            return None
        import tensorflow as tf

        self._check_matches(variables, path)
        manager = self._manager_for(variables)
        with tf.device(_runtime.coordinator_cpu()):
            manager.checkpoint.read(path).assert_existing_objects_matched()
        for key, variable in variables.items():
            variable.assign(self._mirrors[key])  # eager: one assign on the variable's ps
        return int(self._completed.numpy())

    # ---------------------------------------------------------------- private
    def _next_number(self) -> int:
        """One past the highest `ckpt-N` in the directory: no save overwrites another.

        TF numbers by the root object's save counter, which starts again at 1
        for a new root (the variables grew, or a new run in the same directory).
        """
        import tensorflow as tf

        numbers = [0]
        for name in tf.io.gfile.listdir(self.directory):
            stem, _, ext = name.partition(".")
            prefix, _, number = stem.rpartition("-")
            if prefix == "ckpt" and number.isdigit() and ext.startswith(("index", "data")):
                numbers.append(int(number))
        return max(numbers) + 1

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

    def _check_matches(self, variables: dict[str, Any], path: str) -> None:
        import tensorflow as tf

        saved = {
            name.split("/")[0]: list(shape)
            for name, shape in tf.train.list_variables(path)
            if name.endswith(".ATTRIBUTES/VARIABLE_VALUE")
        }
        problems = []
        for key, variable in variables.items():
            if key not in saved:
                problems.append(f"{key} ({variable.name}, shape {variable.shape.as_list()}) is not in it")
            elif saved[key] != variable.shape.as_list():
                problems.append(
                    f"{key} ({variable.name}) has shape {saved[key]} there but "
                    f"{variable.shape.as_list()} here"
                )
        if problems:
            raise ValueError(
                f"The checkpoint {path} does not match the variables created in "
                f"strategy.scope(): {'; '.join(problems[:10])}"
                + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else "")
                + ". Variables are matched by creation order: create the same variables, in "
                "the same order, as the run that wrote the checkpoint, or use another "
                "checkpoint_dir."
            )
