"""`BackupAndRestore` whose backups are sharded checkpoints, committed atomically.

For a model on the ps tasks, each backup is a checkpoint written by the ps
tasks themselves, each its own part (`psclient._keras.checkpoints`): nothing
of the model passes through the coordinator, so a model larger than the
coordinator's memory can be backed up. The checkpoint counts once its state
file names it (written last, atomically), then the epoch is written beside
it (`training_metadata.json`, atomically as well). A crash between the two
costs one repeated epoch (newer weights, older epoch number), never a
skipped one; a crash during the checkpoint leaves the previous one whole.
With `double_checkpoint=True` the previous checkpoint is kept too, and a
damaged newest one falls back to it.

For a model in this process, it is Keras's own `BackupAndRestore` with each
file written in a private temporary directory of an unpredictable name
beside it (`psclient._core.files`; the file gets the mode any new file there
gets, like Keras's own) and renamed into place (`os.replace`, atomic on
POSIX). Remote paths (`gs://...`) fall back to Keras's own writes there.
"""

from __future__ import annotations

import json
import os

import keras
from keras.callbacks import BackupAndRestore as _KerasBackupAndRestore

import tensorflow as tf

from psclient._coordinator.ps_state import on_ps
from psclient._keras.hung_ps_writes import writes_of
from psclient._core.files import replaced_atomically
from psclient._keras import sharded_fit
from psclient._keras.checkpoints import meta_of, model_tables, model_variables, sharded_checkpoints, step_of
from psclient._tf import checkpoints as _checkpoints

__all__ = ["BackupAndRestore", "StalenessLogger"]


class BackupAndRestore(_KerasBackupAndRestore):
    """`keras.callbacks.BackupAndRestore` with sharded, atomic backups; same arguments.

    Use it in `model.fit(callbacks=[...])` exactly like Keras's: at the end of
    each epoch (or every `save_freq` batches) it saves the weights and the
    epoch; when `fit` starts again, in this or a new coordinator process, it
    restores both and `fit` resumes at that epoch. For a model on the ps
    tasks the weights are a checkpoint each ps writes its own part of (the
    `backup_dir` must be reachable from every ps task); variables are
    matched by their position in the model and its optimizer. The rows of
    its DynamicEmbedding layers are saved by their ps tasks beside them.

    With `fit` on a `psclient.data.ShardedDataset` it also saves the data
    ledger (`data_ledger.json`: epoch, done shards, positions of those in
    flight); with `save_freq=N` (every N shards) a coordinator killed
    mid-epoch and run again resumes that epoch, skipping the shards done.
    """

    #: Keras's batch hook only counts batches for `save_freq`: fit may leave their logs on the workers.
    _psclient_reads_batch_logs = False

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        # fit on a psclient.data.ShardedDataset: resume its epoch where the backup left it.
        feed = sharded_fit.active_feed(self.model)
        if feed is not None and os.path.exists(self.ledger_path):
            with open(self.ledger_path) as f:
                feed.load(json.load(f))  # LedgerMismatchError for other shards: never a silent restart

    @property
    def ledger_path(self) -> str:
        """Where the data ledger of a `psclient.data.ShardedDataset` fit is backed up."""
        return os.path.join(self.backup_dir, "data_ledger.json")

    def sharded_checkpoints(self):
        """The sharded checkpoints of a model on the ps tasks (None for a local model)."""
        if not hasattr(self, "_checkpoints"):
            strategy, checkpoints = sharded_checkpoints(
                self.model, self.backup_dir, 2 if self.double_checkpoint else 1, False, "BackupAndRestore")
            self._strategy = strategy
            self._checkpoints = checkpoints
        return self._checkpoints

    def _load_model(self):
        checkpoints = self.sharded_checkpoints() if self.model.built else None
        if checkpoints is None:
            return super()._load_model()  # a local model (or an unbuilt one: Keras's error)
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with self._strategy.scope():  # its slots on the ps, beside their variables
                optimizer.build(self.model.trainable_variables)
        restored = on_ps(self._strategy, lambda: checkpoints.restore(
            model_variables(self.model), adopt=True, tables=model_tables(self.model)), "restoring a BackupAndRestore")
        if restored is None:
            return
        if tf.io.gfile.exists(self._training_metadata_path):  # absent: killed before the first was written
            with tf.io.gfile.GFile(self._training_metadata_path, "r") as f:
                self.model._initial_epoch = json.loads(f.read())["epoch"]

    @property
    def failed_saves(self) -> list:
        """One dict per backup given up on a ps that hung ({"task", "error", "at"}): training went on,
        the next backup is made at the next epoch's end (or `save_freq` batches) as usual."""
        return writes_of(self, _BACKUP).failures

    def _save_model(self):
        # Through ps faults (psclient._keras.hung_ps_writes): a ps lost is restored first; a backup given
        # up on a hung ps is noted and training goes on (Keras's next save is the next backup).
        writes_of(self, _BACKUP).run(lambda: _backup(self))

    def save_weights_and_epoch(self):
        """Back up the weights, then the epoch (Keras's `_save_model` without the ledger)."""
        checkpoints = self.sharded_checkpoints()
        if checkpoints is None and ("://" in str(self.backup_dir) or self.double_checkpoint):
            return super()._save_model()  # remote storage, or Keras's own spare copy
        remote = "://" in str(self.backup_dir)
        if not remote:
            os.makedirs(self.backup_dir, exist_ok=True)
        if checkpoints is not None:
            on_ps(self._strategy, lambda: checkpoints.save(
                model_variables(self.model), completed=None, scalars=step_of(self.model, self._strategy),
                meta=meta_of(self.model), tables=model_tables(self.model)), "writing a BackupAndRestore")
        else:
            # Each under its own name in a private temporary directory, then renamed into place.
            with replaced_atomically(self._weights_path) as temp:
                self.model.save_weights(temp, overwrite=True)
        metadata = json.dumps({"epoch": self._current_epoch, "batch": self._last_batch_seen})
        if remote:  # TF's filesystems: a checkpoint's own bucket
            _checkpoints.atomic_write(self._training_metadata_path, metadata)
            return
        with replaced_atomically(self._training_metadata_path) as temp, open(temp, "w") as f:
            f.write(metadata)


def _backup(callback) -> None:
    """`BackupAndRestore._save_model`'s backup: the data ledger, the weights and the epoch."""
    # The ledger is read first and written last: a crash in between leaves an older
    # ledger beside newer weights, which replays shards; never one that skips any.
    feed = sharded_fit.active_feed(callback.model)
    callback.sharded_checkpoints()  # sets callback._strategy (None for a local model)
    ledger = None if feed is None else json.dumps(on_ps(
        callback._strategy, feed.state, "reading the data ledger for BackupAndRestore"))
    callback.save_weights_and_epoch()
    if ledger is not None:
        with replaced_atomically(callback.ledger_path) as temp, open(temp, "w") as f:
            f.write(ledger)


_BACKUP = "writing a BackupAndRestore"


class StalenessLogger(keras.callbacks.Callback):
    """Adds the staleness of the updates applied so far to `fit`'s epoch logs.

    `model.fit(..., callbacks=[psclient.StalenessLogger(strategy)])`: at the
    end of each epoch, `staleness_mean`, `staleness_p50`, `staleness_p99`,
    `staleness_max` and `staleness_dropped` (since the strategy started; see
    `strategy.stats()["staleness"]`) join the logs, so the progress bar and
    `History` show them. The strategy must measure staleness
    (`measure_staleness=True`, or `max_staleness`/`replicas_to_aggregate`).
    """

    KEYS = ("mean", "p50", "p99", "max", "dropped")

    def __init__(self, strategy):
        super().__init__()
        if not callable(getattr(strategy, "stats", None)):
            raise TypeError(
                f"Invalid value for argument `strategy`. Received: strategy={strategy!r} of type "
                f"{type(strategy).__name__}. Expected the psclient.ParameterServerStrategy that fits the model.")
        self._strategy = strategy

    def on_train_begin(self, logs=None):
        if not self._strategy.stats()["staleness"]["measured"]:
            raise ValueError(
                "StalenessLogger needs a strategy that measures staleness. Received: a strategy made "
                "without measure_staleness=True, max_staleness or replicas_to_aggregate. Expected "
                "ParameterServerStrategy(cluster, measure_staleness=True) (or one of the other two).")

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        staleness = self._strategy.stats()["staleness"]
        for key in self.KEYS:
            value = staleness.get(key)
            if value is not None:  # None before any update
                logs[f"staleness_{key}"] = float(value)
