"""State a cluster model uses that was made outside `strategy.scope()`, moved onto the ps tasks.

Published Keras examples adapt a `Normalization` (or build a lookup layer)
before the model exists, and some compile a model again, outside any scope,
once it is trained. In local Keras both simply run. On the cluster such a
variable lives in the coordinator while the model's others live on the ps
tasks: each Keras variable of that kind gets a ps variable holding its current
value (made in the strategy's scope, so placed as any other) as the
`tf.Variable` inside it, with one warning per model naming what moved. Every
reference to the Keras variable (the layer's attribute, the optimizer's list,
a saved file) keeps working; it just reads and writes the ps copy from then on.
"""

from __future__ import annotations

import warnings
import weakref

import tensorflow as tf

from psclient._coordinator import runtime as _runtime
from psclient._keras import seam

__all__ = ["local_variables", "move_to_ps"]

_warned: weakref.WeakSet = weakref.WeakSet()


def _tf_variable(variable):
    return variable if isinstance(variable, tf.Variable) else seam.internal(variable, "_value")


def local_variables(variables) -> list:
    """The variables of `variables` whose tf.Variable is not on a ps task."""
    return [v for v in variables if _runtime.ps_index_of(getattr(_tf_variable(v), "device", None)) is None]


def move_to_ps(model, strategy, variables, method: str) -> None:
    """Give every local Keras variable of `variables` a ps copy of its value, warning once per model.

    A bare `tf.Variable` (no Keras variable around it to repoint) cannot be
    moved: that is an error naming it and what to do.
    """
    local = local_variables(variables)
    if not local:
        return
    bare = [v for v in local if isinstance(v, tf.Variable)]
    if bare:
        names = ", ".join(repr(v.name) for v in bare[:5])
        raise ValueError(
            f"Cannot run model.{method}() for {model.name!r} on the cluster: the tf.Variable(s) "
            f"{names} were made outside strategy.scope() and live in this process; psclient can "
            "move a Keras variable onto a ps task but not a bare tf.Variable. Expected it made "
            "inside `with strategy.scope():` (or wrapped in a keras.Variable)."
        )
    with strategy.scope():
        for variable in local:
            old = _tf_variable(variable)
            # Made in the strategy's scope: its variable creator places it on a ps task.
            moved = tf.Variable(
                old.read_value(), dtype=old.dtype, trainable=old.trainable, name=old.name.split(":")[0],
                aggregation=old.aggregation, synchronization=old.synchronization,
            )
            variable._value = moved  # noqa: SLF001 - KERAS_INTERNALS: the Variable's tf.Variable
    if model not in _warned:
        _warned.add(model)
        names = ", ".join(repr(getattr(v, "path", v.name)) for v in local[:5])
        more = f" and {len(local) - 5} more" if len(local) > 5 else ""
        warnings.warn(
            f"model.{method}() for {model.name!r}: variables {names}{more} were created outside "
            "strategy.scope() (a preprocessing layer adapted before the model, or compile() called "
            "outside the scope); their values were copied onto the ps tasks, where the model's "
            "other variables live, and the model uses those copies from now on. Create them inside "
            "`with strategy.scope():` to skip the copy.",
            stacklevel=4,
        )
