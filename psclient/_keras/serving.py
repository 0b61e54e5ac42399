"""Keras's SavedModel export, made an export scope (see `psclient._tf.serving`).

`model.export(path)` builds a `keras.export.ExportArchive` and calls its
`write_out`, which traces the serving endpoints and then calls
`tf.saved_model.save`. Wrapped here so that the whole of `write_out` is one
export: a `DynamicEmbedding` traced by it reads a snapshot of its rows in
stock TF variables (`psclient._coordinator.serving_table`), and the same
snapshot is the one saved. `tf.saved_model.save` alone is an export scope
through `psclient._tf.serving.install_save_hook`.

A model's SavedModel holds what serving needs: while an export is in
progress, a Keras model lists neither its optimizer (slots, iterations) nor
its compiled metrics and loss trackers among its saved children, so
`tf.saved_model.save(model)` does not write them (Keras's own `export`
saves only the variables its endpoints use).
"""

from __future__ import annotations

import functools
import threading

from psclient._keras import seam
from psclient._tf.serving import current_export, export_scope, install_save_hook

__all__ = ["install"]

_lock = threading.Lock()
_done = False

#: A Keras model's attributes that are training state, left out of a SavedModel.
TRAINING_ATTRIBUTES = ("optimizer", "_compile_metrics", "_compile_loss", "_loss_tracker", "_metrics")


def install() -> None:
    """Wrap Keras's `write_out` and a model's saved children once (idempotent); install TF's save hook."""
    global _done
    with _lock:
        if _done:
            return
        install_save_hook()
        archive_class = _owner(seam.EXPORT_WRITE_OUT)
        stock_write_out = archive_class.write_out

        @functools.wraps(stock_write_out)
        def write_out(self, *args, **kwargs):
            with export_scope():
                return stock_write_out(self, *args, **kwargs)

        archive_class.write_out = write_out

        layer_class = _owner(seam.TF_LAYER_CHILDREN)
        stock_children = layer_class._trackable_children  # noqa: SLF001 - listed in seam.KERAS_INTERNALS

        @functools.wraps(stock_children)
        def trackable_children(self, save_type="checkpoint", **kwargs):
            children = stock_children(self, save_type, **kwargs)
            if save_type == "savedmodel" and current_export() is not None and hasattr(self, "optimizer"):
                for name in TRAINING_ATTRIBUTES:
                    children.pop(name, None)
            return children

        layer_class._trackable_children = trackable_children  # noqa: SLF001
        _done = True


def _owner(path: str):
    """The class that holds the listed Keras internal `path` (checked present by `seam.resolve`)."""
    seam.resolve(seam.Internal(path, "patched for exports"))
    return seam.resolve(seam.Internal(path.rsplit(".", 1)[0], "patched for exports"))
