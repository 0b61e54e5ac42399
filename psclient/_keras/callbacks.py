"""`BackupAndRestore` whose backups are committed atomically.

Keras 3's `keras.callbacks.BackupAndRestore` works with psclient as it is:
the coordinator reads the weights from the ps tasks to save them and assigns
them back to the ps tasks to restore, and `fit` resumes at the saved epoch.
But it writes its two files in place. A coordinator killed in the middle of
writing leaves a truncated weights file, and the next run fails to load it
(unless `double_checkpoint=True`, which keeps a copy).

This subclass writes each file in a private temporary directory of an
unpredictable name beside it (`psclient._core.files`; the file gets the mode
any new file there gets, like Keras's own) and renames it into place
(`os.replace`, atomic on POSIX), weights first,
then the epoch. A reader therefore sees whole files only; a crash between the
two renames costs one repeated epoch (newer weights, older epoch number), never
a skipped one. Remote paths (`gs://...`) fall back to Keras's own writes.
"""

from __future__ import annotations

import json
import os

import keras
from keras.callbacks import BackupAndRestore as _KerasBackupAndRestore

from psclient._core.files import replaced_atomically
from psclient._keras import sharded_fit

__all__ = ["BackupAndRestore", "StalenessLogger"]


class BackupAndRestore(_KerasBackupAndRestore):
    """`keras.callbacks.BackupAndRestore` with atomic backups; same arguments.

    Use it in `model.fit(callbacks=[...])` exactly like Keras's: at the end of
    each epoch (or every `save_freq` batches) it saves the weights, read from
    the ps tasks, and the epoch; when `fit` starts again, in this or a new
    coordinator process, it restores both and `fit` resumes at that epoch.
    Each backup file is written under a temporary name and renamed into place.

    With `fit` on a `psclient.data.ShardedDataset` it also saves the data
    ledger (`data_ledger.json`: epoch, done shards, positions of those in
    flight); with `save_freq=N` (every N shards) a coordinator killed
    mid-epoch and run again resumes that epoch, skipping the shards done.
    """

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        # fit on a psclient.data.ShardedDataset: resume its epoch where the backup left it.
        feed = sharded_fit.active_feed(self.model)
        if feed is not None and os.path.exists(self._ledger_path):
            with open(self._ledger_path) as f:
                feed.load(json.load(f))  # LedgerMismatchError for other shards: never a silent restart

    @property
    def _ledger_path(self) -> str:
        return os.path.join(self.backup_dir, "data_ledger.json")

    def _save_model(self):
        # The ledger is read first and written last: a crash in between leaves an older
        # ledger beside newer weights, which replays shards; never one that skips any.
        feed = sharded_fit.active_feed(self.model)
        ledger = None if feed is None else json.dumps(feed.state())
        self._save_weights_and_epoch()
        if ledger is not None:
            with replaced_atomically(self._ledger_path) as temp, open(temp, "w") as f:
                f.write(ledger)

    def _save_weights_and_epoch(self):
        if "://" in str(self.backup_dir) or self.double_checkpoint:
            return super()._save_model()  # remote storage, or Keras's own spare copy
        os.makedirs(self.backup_dir, exist_ok=True)
        # Each under its own name in a private temporary directory, then renamed into place.
        with replaced_atomically(self._weights_path) as temp:
            self.model.save_weights(temp, overwrite=True)
        metadata = json.dumps({"epoch": self._current_epoch, "batch": self._last_batch_seen})
        with replaced_atomically(self._training_metadata_path) as temp, open(temp, "w") as f:
            f.write(metadata)


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
