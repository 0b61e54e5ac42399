"""Keras's SavedModel export, made an export scope (see `psclient._tf.serving`).

`model.export(path)` builds a `keras.export.ExportArchive` and calls its
`write_out`, which traces the serving endpoints and then calls
`tf.saved_model.save`. Wrapped here so that the whole of `write_out` is one
export: a `DynamicEmbedding` traced by it reads a snapshot of its rows in
stock TF variables (`psclient._coordinator.serving.serving_table`), and the same
snapshot is the one saved. `tf.saved_model.save` alone is an export scope
through `psclient._tf.serving.install_save_hook`.

A model's SavedModel holds what serving needs: while an export is in
progress, a Keras model lists neither its optimizer (slots, iterations) nor
its compiled metrics and loss trackers among its saved children, so
`tf.saved_model.save(model)` does not write them (Keras's own `export`
saves only the variables its endpoints use).

Each variable is saved once, and a partitioned one by the ps tasks: as one
full-shape variable written one slice per shard by the ps that holds it
(`psclient._tf.partitioned`); Keras's export would also save the shards its
endpoints captured (`_variables_held_by`).
"""

from __future__ import annotations

import contextlib
import functools
import threading

from psclient._keras import seam
from psclient._tf.partitioned import is_partitioned
from psclient._tf.serving import current_export, export_scope, install_save_hook

__all__ = ["install"]

_lock = threading.Lock()
_done = False
_held = threading.local()  # .by: id of a tf.Variable -> the Keras variable holding it, during a write_out

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
            with export_scope(), _variables_held_by(self.variables):
                return stock_write_out(self, *args, **kwargs)

        archive_class.write_out = write_out

        archive_module = seam.resolve(seam.Internal(seam.EXPORT_ARCHIVE_MODULE, "patched for exports"))
        stock_list = archive_module._list_variables_used_by_fns  # noqa: SLF001 - listed in seam.KERAS_INTERNALS

        @functools.wraps(stock_list)
        def list_variables_used_by_fns(fns):
            trainable, non_trainable = stock_list(fns)
            trainable = _as_held(trainable)
            in_trainable = {id(variable) for variable in trainable}
            return trainable, [v for v in _as_held(non_trainable) if id(v) not in in_trainable]

        archive_module._list_variables_used_by_fns = list_variables_used_by_fns  # noqa: SLF001

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


@contextlib.contextmanager
def _variables_held_by(keras_variables):
    """While in force on this thread, Keras's list of the variables an export's endpoints use names the
    Keras variable that holds each one (of `keras_variables`) instead of the tf.Variable or shard inside.

    `track(model)` lists the model's Keras variables (the archive's
    `variables`), and `write_out` lists again, under `_all_variables`, the
    tf.Variables its endpoints captured when first traced: for a partitioned
    variable its shards. TF's saver writes each list's objects, so every
    variable was written twice, a partitioned one whole and as shards. In
    the SavedModel the endpoints are traced again inside TF's save context,
    where they capture what each Keras variable exports (for a partitioned
    variable TF's one full-shape stand-in, written one slice per ps by
    `psclient._tf.partitioned`): the shards under `_all_variables` were read
    by nothing. Named as their Keras variable, both lists hold the same
    object (one node, one checkpoint key); the snapshot variables of a
    dynamic table, held by no Keras variable, stay as they are.
    """
    holder = {}
    for variable in keras_variables:
        value = seam.internal(variable, "_value") if hasattr(variable, "_value") else variable
        for held in (value.shards if is_partitioned(value) else [value]):
            holder[id(held)] = variable
    outer, _held.by = getattr(_held, "by", None), holder
    try:
        yield
    finally:
        _held.by = outer


def _as_held(variables: list) -> list:
    """`variables` with each one a Keras variable holds replaced by that Keras variable, each once."""
    holder, kept, seen = getattr(_held, "by", None) or {}, [], set()
    for variable in variables:
        variable = holder.get(id(variable), variable)
        if id(variable) not in seen:
            seen.add(id(variable))
            kept.append(variable)
    return kept


def _owner(path: str):
    """The class that holds the listed Keras internal `path` (checked present by `seam.resolve`)."""
    seam.resolve(seam.Internal(path, "patched for exports"))
    return seam.resolve(seam.Internal(path.rsplit(".", 1)[0], "patched for exports"))
