"""Keras 3 support, installed when `strategy.scope()` is first entered.

Two things, both class-level, idempotent and inert for variables and models
that do not live on a psclient strategy's ps tasks:

1. Atomic increments. Keras 3 implements `Variable.assign_add(v)` as
   `assign(self + v)`: a read, then a write. In one process that is harmless;
   with several workers updating the same ps variable at once, increments are
   lost (measured: an optimizer's `iterations` counted 36 of 41 steps; metric
   totals lose updates the same way). `tf.Variable.assign_add` is one atomic
   op on the ps, so psclient routes Keras's TF-backend variables to it. The
   arithmetic is identical; only the race goes. Optimizer weight updates
   already use `tf.Variable.assign_sub` directly.
2. `model.fit/evaluate/predict` on the cluster (`_keras_trainer`).

Keras's other backends keep their variables outside TensorFlow, where no ps
task can hold them: with Keras imported under another backend, entering the
scope is an error rather than a silent local run.
"""

from __future__ import annotations

import sys
import threading

__all__ = ["make_keras_increments_atomic", "check_keras_backend"]

_lock = threading.Lock()
_done = False


def check_keras_backend() -> bool:
    """Whether Keras 3 is usable here; raise if the user's Keras has another backend.

    Returns False (nothing to patch) when Keras 3 is not installed, or when it
    was not imported by the user and its configured backend is not TensorFlow
    (then only raw `tf.Variable`s are in play).
    """
    user_imported = "keras" in sys.modules
    try:
        import keras
        from keras.src.backend import backend
    except ImportError:  # no Keras 3
        return False
    name = backend()
    if name == "tensorflow":
        return True
    if not user_imported:
        return False
    raise RuntimeError(
        f"psclient's Keras support needs Keras's TensorFlow backend. Received: "
        f"keras.backend.backend()={name!r} (Keras {keras.__version__}). Expected 'tensorflow': "
        "set the environment variable KERAS_BACKEND=tensorflow before importing keras. "
        "Other backends keep variables outside TensorFlow, where no ps task can hold them."
    )


def make_keras_increments_atomic() -> None:
    """Install psclient's Keras 3 support once (the name is the scope's hook)."""
    global _done
    with _lock:
        if _done:
            return
        if not check_keras_backend():
            return
        try:
            from keras.src.backend.common.stateless_scope import in_stateless_scope
            from keras.src.backend.tensorflow.core import Variable
        except ImportError:  # a Keras layout this version does not know
            return
        import tensorflow as tf

        plain_add, plain_sub = Variable.assign_add, Variable.assign_sub

        def atomic(plain, method_name):
            def update(self, value):
                tf_variable = getattr(self, "_value", None)
                if tf_variable is None or not isinstance(tf_variable, tf.Variable) or in_stateless_scope():
                    return plain(self, value)
                return getattr(tf_variable, method_name)(tf.cast(value, tf_variable.dtype))

            update.__name__ = method_name
            update.__doc__ = f"Atomic `{method_name}` on the underlying tf.Variable (patched by psclient)."
            return update

        Variable.assign_add = atomic(plain_add, "assign_add")
        Variable.assign_sub = atomic(plain_sub, "assign_sub")

        from psclient import _keras_trainer

        _keras_trainer.install()
        _done = True
