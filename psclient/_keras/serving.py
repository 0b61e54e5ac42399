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

The model is traced once per `write_out` (Keras alone traces it three times,
four with a `DynamicEmbedding`; tests/serving/test_export_traces.py counts):

- Keras lists the variables its endpoints use from a first trace, and TF's
  save traces them again in its save context (the function cache keys a
  trace by that context). Here the first trace is made in a save context
  with the options TF's save will use: TF's save finds it in the cache, and
  it is the trace saved.
- Keras walks the model for lookup tables, reading every attribute; the TF
  layer's `_default_save_signature` makes and traces a new `tf.function` at
  each read, for a signature Keras's export does not save. It reads None
  during `write_out` on this thread.
- A `DynamicEmbedding` takes its rows' snapshot (`serving_table`) at its
  first trace in an export, creating variables, and TF traces a function
  that created variables again. The snapshots are taken before the first
  trace instead (`_take_snapshots`), for `write_out` and for
  `tf.saved_model.save(model)` (whose trace of the default signature was
  made twice so).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

from psclient._keras import seam
from psclient._tf.partitioned import is_partitioned
from psclient._tf.serving import current_export, export_scope, install_save_hook, save_context_of

__all__ = ["install"]

_lock = threading.Lock()
_done = False
# During a write_out on this thread: .variables, the archive's Keras variables; .options, its SaveOptions.
_held = threading.local()

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

        write_out_signature = inspect.signature(stock_write_out)

        @functools.wraps(stock_write_out)
        def write_out(self, *args, **kwargs):
            options = write_out_signature.bind(self, *args, **kwargs).arguments.get("options")
            with export_scope(), _variables_held_by(self.variables, options):
                _take_snapshots(self.variables)
                return stock_write_out(self, *args, **kwargs)

        archive_class.write_out = write_out

        archive_module = seam.resolve(seam.Internal(seam.EXPORT_ARCHIVE_MODULE, "patched for exports"))
        stock_list = archive_module._list_variables_used_by_fns  # noqa: SLF001 - listed in seam.KERAS_INTERNALS

        @functools.wraps(stock_list)
        def list_variables_used_by_fns(fns):
            keras_variables = getattr(_held, "variables", None)
            if keras_variables is None:  # not in a write_out (another Keras export format)
                return stock_list(fns)
            # Traced in the save context TF's save then enters, with the same options: the function
            # cache keys a trace by that context (its variable policy), so TF's save finds this trace
            # instead of tracing the model again, and it is the trace saved.
            with save_context_of(_held.options):
                trainable, non_trainable = stock_list(fns)
                holder = _holder(keras_variables)  # a partitioned variable's stand-in is that of the save context
            trainable = _as_held(trainable, holder)
            in_trainable = {id(variable) for variable in trainable}
            return trainable, [v for v in _as_held(non_trainable, holder) if id(v) not in in_trainable]

        archive_module._list_variables_used_by_fns = list_variables_used_by_fns  # noqa: SLF001

        layer_class = _owner(seam.TF_LAYER_CHILDREN)
        stock_children = layer_class._trackable_children  # noqa: SLF001 - listed in seam.KERAS_INTERNALS

        @functools.wraps(stock_children)
        def trackable_children(self, save_type="checkpoint", **kwargs):
            exporting = save_type == "savedmodel" and current_export() is not None and hasattr(self, "optimizer")
            if exporting:
                # Before the stock children read (and trace) the model's default signature
                # (`tf.saved_model.save(model)`).
                _take_snapshots(self.variables)
            children = stock_children(self, save_type, **kwargs)
            if exporting:
                for name in TRAINING_ATTRIBUTES:
                    children.pop(name, None)
            return children

        layer_class._trackable_children = trackable_children  # noqa: SLF001

        stock_signature = seam.resolve(seam.Internal(seam.TF_LAYER_DEFAULT_SIGNATURE, "patched for exports"))
        if isinstance(stock_signature, property):  # a property in Keras 3.10-3.15; else left alone (one more trace)

            def default_save_signature(self):
                if getattr(_held, "variables", None) is not None:
                    return None  # in a write_out on this thread: its signatures are its endpoints'
                return stock_signature.fget(self)

            layer_class._default_save_signature = property(  # noqa: SLF001 - listed in seam.KERAS_INTERNALS
                default_save_signature, doc=stock_signature.__doc__)
        _done = True


@contextlib.contextmanager
def _variables_held_by(keras_variables, options):
    """While in force on this thread, Keras's list of the variables an export's endpoints use names the
    Keras variable that holds each one (of `keras_variables`) instead of the tf.Variable or shard inside,
    and is made from a trace in a save context of `options` (the write_out's SaveOptions, or None).

    `track(model)` lists the model's Keras variables (the archive's
    `variables`), and `write_out` lists again, under `_all_variables`, the
    tf.Variables its endpoints captured when traced: in TF's save context
    (`save_context_of`), what each Keras variable exports (for a partitioned
    variable TF's one full-shape stand-in, written one slice per ps by
    `psclient._tf.partitioned`); outside it, a partitioned variable's shards.
    TF's saver writes each list's objects, so every variable was written
    twice (a partitioned one whole and as shards, which nothing read).
    Named as their Keras variable, both lists hold the same object (one
    node, one checkpoint key); the snapshot variables of a dynamic table,
    held by no Keras variable, stay as they are.
    """
    outer = getattr(_held, "variables", None), getattr(_held, "options", None)
    _held.variables, _held.options = list(keras_variables), options
    try:
        yield
    finally:
        _held.variables, _held.options = outer


def _holder(keras_variables) -> dict:
    """id of a tf.Variable -> the Keras variable (of `keras_variables`) holding it: its value, or a
    partitioned value's shards and what stands for them here (in TF's save context, one full-shape
    stand-in: TF's `ShardedVariable.variables` there)."""
    holder = {}
    for variable in keras_variables:
        value = seam.internal(variable, "_value") if hasattr(variable, "_value") else variable
        for held in ([*value.shards, *value.variables] if is_partitioned(value) else [value]):
            holder[id(held)] = variable
    return holder


def _take_snapshots(keras_variables) -> None:
    """Have each `DynamicEmbedding` whose anchor weight is among `keras_variables` take the export's
    snapshot of its rows now (in an export scope), eagerly: taken at the layer's first trace, its
    variables would be created by that trace, and TF traces a function that created variables again."""
    layers = {}
    for variable in keras_variables:
        reference = getattr(variable, "_psclient_dynamic_layer", None)  # set on a DynamicEmbedding's anchor
        layer = reference() if reference is not None else None
        if layer is not None:
            layers[id(layer)] = layer
    for layer in layers.values():
        layer.serving_table()


def _as_held(variables: list, holder: dict) -> list:
    """`variables` with each one a Keras variable holds replaced by that Keras variable, each once."""
    kept, seen = [], set()
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
