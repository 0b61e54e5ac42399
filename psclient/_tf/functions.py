"""tf.functions that psclient makes once per object, a user's tf.function made anew, and TF's warning about
retracing."""

from __future__ import annotations

import logging
import threading
from typing import Any

import tensorflow as tf

__all__ = ["fresh_tf_function", "made_per_object", "quiet_saver_retracing", "traced_per_signature"]

_filter_lock = threading.Lock()


def made_per_object(function: Any) -> Any:
    """`function` (a `tf.function`), one of many made from the same code: one per table shard, made
    again when a ps recovery renews the shard's storage, each traced once by design.

    TF counts traces per code object, not per function, and from the fifth logs "triggered
    tf.function retracing. Tracing is expensive" at every new shard or recovery (101 to 176 such
    lines in a day's chaos plans), which tells a user of a cost that is not there. Turned off for
    `function` with TF's own attribute (its saved-model loader sets it too); where a TF version
    lacks it, nothing changes.
    """
    return _without_retracing_warning(function)


def traced_per_signature(function: Any) -> Any:
    """`function` (a module-level `tf.function`), traced once per kind of argument it is given (a
    variable's dtype and rank) and again for each new cluster a process connects to, by design.

    A process that makes several strategies in turn (a test run, a chaos plan) traces it a few times
    each, and TF logged at every fifth call that tracing is expensive; TF's attribute turns that off
    for it (see `made_per_object`)."""
    return _without_retracing_warning(function)


def fresh_tf_function(function: Any) -> Any:
    """A new `tf.function` of a user's `function`'s Python code and options: its traces get new names,
    which TF registers afresh on every task (the old function's registration can be lost on its way,
    and TF sends a function to the tasks only at its first reference)."""
    return tf.function(
        function.python_function,
        input_signature=function.input_signature,
        autograph=getattr(function, "_autograph", True),
        experimental_autograph_options=getattr(function, "_experimental_autograph_options", None),
        reduce_retracing=getattr(function, "_reduce_retracing", False),
        jit_compile=getattr(function, "_jit_compile", None),
    )


def _without_retracing_warning(function: Any) -> Any:
    if hasattr(function, "_omit_frequent_tracing_warning"):
        function._omit_frequent_tracing_warning = True  # noqa: SLF001 - TF's own attribute, see above
    return function


class _SaverRetracing(logging.Filter):
    """TF's warning of retracing about its own saver's per-save function, and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("triggered tf.function retracing" in message
                    and ("MultiDeviceSaver.save.<locals>" in message or "MultiDeviceSaver.restore.<locals>" in message))


def quiet_saver_retracing() -> None:
    """Drop TF's "triggered tf.function retracing" warning about `MultiDeviceSaver`'s own functions.

    With variables on several tasks, TF's saver makes a new `tf.function` at every eager save and
    restore, by design (its comment: "this will cause a function re-trace on each save"), so the
    fifth `tf.saved_model.save` of a cluster model (a `ServingExport`'s full versions) logged that
    tracing is expensive and how to stop it, which a user cannot act on. TF makes the function
    inside its save, so its `_omit_frequent_tracing_warning` cannot be set; a filter on TF's
    logger drops that one warning (matched by the saver's function names). Idempotent."""
    logger = logging.getLogger("tensorflow")
    with _filter_lock:
        if not any(isinstance(existing, _SaverRetracing) for existing in logger.filters):
            logger.addFilter(_SaverRetracing())
