"""Exports in progress on this thread: a SavedModel being written by TF's saver or by Keras's export.

A `DynamicEmbedding` traced for an export must read a snapshot of its rows
made for that export (stock TF variables the SavedModel tracks), not its
tables on the ps tasks, which no SavedModel can hold. The layer cannot tell
such a trace from any other inference trace by itself, so an export is
marked on the thread that runs it:

- `export_scope()`: entered by psclient's `export_servable` and by Keras's
  `ExportArchive.write_out` (wrapped in `psclient._keras.serving`), which
  traces the endpoints *before* it calls `tf.saved_model.save`;
- TF's own `tf.saved_model.save` runs its traces inside
  `save_context.save_context(options)` and then writes the variables'
  checkpoint outside it, both from `save.save_and_return_nodes`; the patches
  here enter `export_scope()` in both (`install_save_hook`): a partitioned
  variable is written as one slice per shard, by the ps that holds it, only
  while an export is in progress (`psclient._tf.partitioned`).

Scopes nest: an export scope inside another (Keras's `write_out` calling
`tf.saved_model.save`) is the same export, with the outer one's token, so
one export takes one snapshot. Callbacks registered with `at_export_end` run
when the outermost scope ends (a layer drops its snapshot then: the rows'
copy on the ps is freed once the saved functions let go of it).

`save_context_of(options)` enters TF's save context ahead of TF's save, so
that a trace made in it is the one TF's save finds (`psclient._keras.serving`).

TF internals used (no public equivalent): `saved_model.save_context`,
`saved_model.save.save_and_return_nodes`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator

import tensorflow as tf
from tensorflow.python.saved_model import save as saved_model_save
from tensorflow.python.saved_model import save_context

from psclient._tf.functions import quiet_saver_retracing

__all__ = ["ExportToken", "at_export_end", "current_export", "export_scope", "install_save_hook", "save_context_of"]

_state = threading.local()  # .token: the export in progress on this thread; .on_end: its callbacks
_hook_lock = threading.Lock()


class ExportToken:
    """One export: compared by identity (a snapshot made for it is reused within it, not after)."""

    __slots__ = ("__weakref__",)


def current_export() -> ExportToken | None:
    """The export in progress on this thread, or None."""
    return getattr(_state, "token", None)


@contextlib.contextmanager
def export_scope() -> Iterator[ExportToken]:
    """Mark an export on this thread (the outer one's token when nested)."""
    outer = current_export()
    if outer is not None:
        yield outer
        return
    _state.token, _state.on_end = token, callbacks = ExportToken(), []
    try:
        yield token
    finally:
        _state.token, _state.on_end = None, []
        for callback in callbacks:
            callback()


def at_export_end(callback: Callable[[], None]) -> None:
    """Call `callback` when the export in progress on this thread ends (at once if none is)."""
    if current_export() is None:
        callback()
    else:
        _state.on_end.append(callback)


def install_save_hook() -> None:
    """Make `tf.saved_model.save` an export scope, from its first trace to its checkpoint's last write.

    TF's save calls `save_context.save_context(options)` and `save_and_return_nodes` by their modules'
    attributes at every save, so wrapping those attributes covers every caller. Idempotent."""
    quiet_saver_retracing()  # TF's saver retraces at every save of a cluster model, by design
    with _hook_lock:
        stock = save_context.save_context
        if getattr(stock, "_psclient_export_scope", False):
            return

        @contextlib.contextmanager
        def save_context_and_export_scope(options):
            with stock(options), export_scope():
                yield

        stock_save = saved_model_save.save_and_return_nodes

        @functools.wraps(stock_save)
        def save_and_return_nodes(*args, **kwargs):
            with export_scope():
                return stock_save(*args, **kwargs)

        save_context_and_export_scope._psclient_export_scope = True
        saved_model_save.save_and_return_nodes = save_and_return_nodes
        save_context.save_context = save_context_and_export_scope


def save_context_of(options):
    """TF's save context with `options` (None: TF's default `SaveOptions`, as `tf.saved_model.save`'s),
    or nothing new when one is in force on this thread already (TF refuses to nest them).

    `tf.function`'s cache keys a trace by the save context (its variable
    policy): a function traced in this context is found, not traced again,
    by a `tf.saved_model.save` given the same options."""
    if save_context.in_save_context():
        return contextlib.nullcontext()
    return save_context.save_context(options or tf.saved_model.SaveOptions())
