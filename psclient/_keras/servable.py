"""`psclient.export_servable` and `psclient.ServingExport`: SavedModels in TF Serving's layout.

`export_servable(model, base_dir)` writes the model's SavedModel (Keras's own
`model.export`: a `serve` endpoint and the `serving_default` signature, stock
TF ops only, DynamicEmbedding layers as a lookup of stock TF, no training
state) to `<base_dir>/<version>/` safely (`psclient._core.serving_dirs`: a
hidden temporary directory renamed when complete, one run per `base_dir`,
the newest `keep` versions kept). `ServingExport` calls it from `fit`.
See docs/serving.md.
"""

from __future__ import annotations

import os
import time

import keras

from psclient._core import serving_dirs
from psclient._core.serving_dirs import ServingDirError
from psclient._engine import registry

__all__ = ["ServingDirError", "ServingExport", "export_servable"]


def export_servable(model, base_dir, version=None, keep=5, *, run_id=None, take_over=False) -> str:
    """Write `model`'s SavedModel to `<base_dir>/<version>/` for TF Serving; return that directory.

    Args:
      model: a built Keras model (trained on a psclient cluster or not).
      base_dir: the directory TF Serving's `--model_base_path` names (made if missing).
      version: the version to write, an integer >= 0 that does not exist yet;
        None: one more than the newest in `base_dir` (1 in an empty one).
      keep: after writing, keep only the newest `keep` versions (None: all).
      run_id: the run this export belongs to (a string); None: this process's.
        A `base_dir` written by another run is refused (`ServingDirError`).
      take_over: write (and prune) `base_dir` even if another run wrote it;
        it is this run's from then on.

    The version appears complete or not at all: it is written under a hidden
    name in `base_dir` and renamed to its number when every file is on disk.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"Invalid value for argument `model`. Received: model of type {type(model).__name__}. "
                        "Expected a keras.Model.")
    if not model.built:
        raise ValueError(f"Invalid value for argument `model`. Received: model {model.name!r}, not built. "
                         "Expected a built model (call it, fit it, or give it an Input).")
    base_dir = serving_dirs.check_base_dir(base_dir)
    version = serving_dirs.check_version(version)
    keep = serving_dirs.check_keep(keep)
    run_id = serving_dirs.check_run_id(run_id)
    if not isinstance(take_over, bool):
        raise TypeError(f"Invalid value for argument `take_over`. Received: take_over={take_over!r}. "
                        "Expected True or False.")
    serving_dirs.claim(base_dir, run_id, take_over)
    with serving_dirs.new_version(base_dir, version) as (scratch, version):
        model.export(scratch, format="tf_saved_model", verbose=False)
    serving_dirs.prune(base_dir, keep)
    return os.path.join(base_dir, str(version))


def _positive(name: str, value, kind):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        expected = "an integer >= 1" if kind is int else "a number of seconds > 0"
        raise ValueError(f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected {expected} "
                         "or None.")
    return value


class ServingExport(keras.callbacks.Callback):
    """Export the model being fit with `export_servable`: every `every_epochs` epochs and/or every
    `every_seconds` seconds (checked at each batch's end and each epoch's end).

    With neither given, once per epoch. Before each export it waits for the
    steps in flight (`strategy.join()`), so a version holds no step half applied. `keep`, `run_id` and `take_over` are
    `export_servable`'s; the run id is checked when training begins, so a
    `base_dir` of another run fails `fit` before its first step.
    `exported` lists the directories written, in order.
    """

    def __init__(self, base_dir, every_seconds=None, every_epochs=None, keep=5, *, run_id=None, take_over=False):
        super().__init__()
        self.base_dir = serving_dirs.check_base_dir(base_dir)
        self.every_seconds = _positive("every_seconds", every_seconds, (int, float))
        self.every_epochs = _positive("every_epochs", every_epochs, int)
        if self.every_seconds is None and self.every_epochs is None:
            self.every_epochs = 1
        self.keep = serving_dirs.check_keep(keep)
        self.run_id = serving_dirs.check_run_id(run_id)
        if not isinstance(take_over, bool):
            raise TypeError(f"Invalid value for argument `take_over`. Received: take_over={take_over!r}. "
                            "Expected True or False.")
        self.take_over = take_over  # used when training begins: the directory is this run's after that
        self.exported: list[str] = []
        self._last = time.monotonic()

    def on_train_begin(self, logs=None):
        serving_dirs.claim(self.base_dir, self.run_id, self.take_over)
        self._last = time.monotonic()

    def export_now(self) -> None:
        strategy = registry.current()
        if strategy is not None:
            strategy.join()  # a version is a cut between steps: none in flight on the workers
        # No take_over here: a run that took the directory over since fails the export, as it should.
        self.exported.append(export_servable(self.model, self.base_dir, keep=self.keep, run_id=self.run_id))
        self._last = time.monotonic()

    def due_by_time(self) -> bool:
        return self.every_seconds is not None and time.monotonic() - self._last >= self.every_seconds

    def on_train_batch_end(self, batch, logs=None):
        if self.due_by_time():
            self.export_now()

    def on_epoch_end(self, epoch, logs=None):
        if (self.every_epochs is not None and (epoch + 1) % self.every_epochs == 0) or self.due_by_time():
            self.export_now()
