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

from keras.callbacks import BackupAndRestore as _KerasBackupAndRestore

from psclient._core.files import replaced_atomically

__all__ = ["BackupAndRestore"]


class BackupAndRestore(_KerasBackupAndRestore):
    """`keras.callbacks.BackupAndRestore` with atomic backups; same arguments.

    Use it in `model.fit(callbacks=[...])` exactly like Keras's: at the end of
    each epoch (or every `save_freq` batches) it saves the weights, read from
    the ps tasks, and the epoch; when `fit` starts again, in this or a new
    coordinator process, it restores both and `fit` resumes at that epoch.
    Each backup file is written under a temporary name and renamed into place.
    """

    def _save_model(self):
        if "://" in str(self.backup_dir) or self.double_checkpoint:
            return super()._save_model()  # remote storage, or Keras's own spare copy
        os.makedirs(self.backup_dir, exist_ok=True)
        # Each under its own name in a private temporary directory, then renamed into place.
        with replaced_atomically(self._weights_path) as temp:
            self.model.save_weights(temp, overwrite=True)
        metadata = json.dumps({"epoch": self._current_epoch, "batch": self._last_batch_seen})
        with replaced_atomically(self._training_metadata_path) as temp, open(temp, "w") as f:
            f.write(metadata)
