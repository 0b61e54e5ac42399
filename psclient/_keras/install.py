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

import functools
import inspect
import sys
import threading

from psclient._keras import eval as _keras_eval
from psclient._keras.trainer import TrainFunction, cluster_strategy, prepare_model

__all__ = ["check_keras_backend", "install"]

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


def install() -> None:
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

        _install_trainer_patches()
        _done = True


def _install_trainer_patches() -> None:
    """Patch `keras.src.backend.tensorflow.trainer.TensorFlowTrainer`; idempotent."""
    if True:  # called under _lock by install()
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

        for name, make in (
            ("fit", _patched_fit),
            ("evaluate", _patched_evaluate),
            ("predict", _patched_predict),
            ("_get_metrics_result_or_logs", _patched_metrics_result_or_logs),
        ):
            stock = getattr(TensorFlowTrainer, name)
            patched = make(stock)
            functools.update_wrapper(patched, stock)
            patched.__psclient_stock__ = stock
            setattr(TensorFlowTrainer, name, patched)


def _bind(stock, model, args, kwargs) -> dict:
    bound = inspect.signature(stock).bind(model, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    extra = arguments.pop("kwargs", {})
    arguments.update(extra)
    return arguments


def _patched_fit(stock):
    def fit(self, *args, **kwargs):
        strategy = cluster_strategy(self, "fit")
        if strategy is None:
            return stock(self, *args, **kwargs)
        return _fit(stock, self, strategy, _bind(stock, self, args, kwargs))

    return fit


def _fit(stock, model, strategy, a: dict):
    from keras.src.trainers.data_adapters import array_slicing

    from psclient._keras import data as _keras_data

    model._assert_compile_called("fit")
    x, y, sample_weight = a["x"], a["y"], a["sample_weight"]
    validation_data = a["validation_data"]
    if a["validation_split"] and validation_data is None:
        # Keras splits arrays inside fit; the split must happen before psclient
        # turns x into per-worker datasets.
        (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
            (x, y, sample_weight), validation_split=a["validation_split"]
        )
    if _keras_data.is_dataset_fn(validation_data):
        # One finite data set, split between closures by evaluate().
        validation_data, _ = _keras_data.finite_dataset(validation_data, None, None, None, None)
    adapter, steps_per_epoch = _keras_data.training_data(
        strategy, x, y, sample_weight, a["batch_size"], a["shuffle"], a["class_weight"], a["steps_per_epoch"]
    )
    prepare_model(model, strategy, adapter.element_spec, "fit")
    previous = model.train_function
    train_function = TrainFunction(model, strategy, steps_per_epoch)
    # Keras's fit calls make_train_function(), which keeps a train function
    # already set: this one, for the duration of this fit.
    model.train_function = train_function
    ok = False
    try:
        history = stock(
            model, x=adapter, batch_size=None, epochs=a["epochs"], verbose=a["verbose"],
            callbacks=a["callbacks"], validation_data=validation_data, shuffle=False,
            initial_epoch=a["initial_epoch"], steps_per_epoch=steps_per_epoch,
            validation_steps=a["validation_steps"], validation_batch_size=a["validation_batch_size"],
            validation_freq=a["validation_freq"],
        )
        ok = True
        return history
    finally:
        if not ok:
            train_function.abandon()
        model.train_function = previous


def _patched_metrics_result_or_logs(stock):
    # Keras calls this at the end of every epoch (and after a stop) to read
    # the epoch's logs from the metric variables: the moment to join.
    def _get_metrics_result_or_logs(self, logs):
        train_function = getattr(self, "train_function", None)
        if isinstance(train_function, TrainFunction):
            logs = train_function.finish(logs)
        return stock(self, logs)

    return _get_metrics_result_or_logs


def _patched_evaluate(stock):
    def evaluate(self, *args, **kwargs):
        strategy = cluster_strategy(self, "evaluate")
        if strategy is None:
            return stock(self, *args, **kwargs)
        a = _bind(stock, self, args, kwargs)
        a.pop("_use_cached_eval_dataset", None)  # fit's validation passes the data itself too
        if a:
            unknown = set(a) - set(inspect.signature(_keras_eval.evaluate).parameters)
            if unknown:
                raise ValueError(f"Arguments not recognized: {sorted(unknown)}")
        return _keras_eval.evaluate(self, strategy, **a)

    return evaluate


def _patched_predict(stock):
    def predict(self, *args, **kwargs):
        strategy = cluster_strategy(self, "predict")
        if strategy is None:
            return stock(self, *args, **kwargs)
        return _keras_eval.predict(self, strategy, **_bind(stock, self, args, kwargs))

    return predict
