"""`model.evaluate` and `model.predict` on a cluster, visiting every batch exactly once.

The data is read once, here on the coordinator, and cut into contiguous
ranges of batches (`psclient._keras.ranges`, which says why here). Each range
is one scheduled closure that receives the range's batches as a small
serialized dataset and runs `test_step` / `predict_step` over them,
returning only values: predictions, or the metric *states* accumulated from
the reset state in a Keras `StatelessScope`, never writing the metric
variables on the ps. When a worker dies, the scheduler runs the closure
again elsewhere, and because a future resolves only once, the partial work of
the dead worker is never merged: exact visitation.

The coordinator merges metric states by adding each range's change from the
reset state. That is exact for every metric whose state is a sum (Keras's
Mean/Sum family, accuracies, loss trackers, confusion-matrix metrics such as
Precision, Recall and AUC); a metric with another kind of state (a running
maximum, a last value) is merged wrongly and needs Keras's own evaluate.
"""

from __future__ import annotations

import concurrent.futures
import functools
import weakref

import tensorflow as tf

from psclient._coordinator import runtime as _runtime
from psclient._coordinator.data.per_worker import deserialize_dataset
from psclient._keras import data as _keras_data
from psclient._keras import seam
from psclient._keras.ps_reads import guarded
from psclient._keras.ranges import read_ranges
from psclient._keras.trainer import prepare_model, register_callback_kinds, result_or_first_error

__all__ = ["evaluate", "predict"]

# Traced functions per model: weak, so a model and its functions die together.
_functions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def evaluate(
    model, strategy, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
    steps=None, callbacks=None, return_dict=False,
):
    import numpy as np
    from keras.src.backend.common.stateless_scope import StatelessScope
    from keras.src.utils.python_utils import pythonify_logs

    model._assert_compile_called("evaluate")
    dataset, num_batches = _keras_data.finite_dataset(x, y, sample_weight, batch_size, steps)
    prepare_model(model, strategy, dataset.element_spec, "evaluate")
    callbacks = _callback_list(model, callbacks, verbose, num_batches)
    model.stop_evaluating = False
    callbacks.on_test_begin()
    variables = model.metrics_variables

    def reset():
        # Keras's reset_state writes land in a StatelessScope, not on the ps: a round trip to
        # the ps per metric variable saved. `leave` writes the merged state at the end.
        with StatelessScope() as scope:
            model.reset_metrics()
        values = [scope.get_current_value(v) for v in variables]
        # A variable that reset_state left alone keeps the value it has on the ps.
        return tuple(np.asarray((v if value is None else value).numpy()) for v, value in zip(variables, values))

    # On the coordinator, not in a closure: through a ps loss (`psclient._keras.ps_reads`).
    initial = guarded(strategy, reset, f"resetting the metrics of {model.name!r}")
    merged = [value.copy() for value in initial]
    function = _evaluate_function(model, dataset.element_spec, variables)
    # Tensors made here, on the coordinator: a NumPy argument would be
    # converted under the worker's device, and fail there if the worker died.
    initial_tensors = tuple(tf.constant(value) for value in initial)
    logs, done = {}, 0
    ranges = _run_ranges(strategy, function, dataset, num_batches, (initial_tensors,), model, "stop_evaluating")
    listening = bool(callbacks.callbacks)  # logs cost a Keras call: made only for callbacks
    for (start, count), state in ranges:
        callbacks.on_test_batch_begin(done)
        for i, value in enumerate(state):
            merged[i] = merged[i] + (value - initial[i])
        done += count
        logs = _results(model, variables, merged) if listening else {}
        callbacks.on_test_batch_end(done - 1, logs)
    # Leave the merged state in the metric variables, as Keras's evaluate does.
    def leave():
        for variable, value in zip(variables, merged):
            variable.assign(value)

    guarded(strategy, leave, f"writing the evaluated metrics of {model.name!r}")
    logs = pythonify_logs(_results(model, variables, merged))
    callbacks.on_test_end(logs)
    return logs if return_dict else model._flatten_metrics_in_order(logs)


def predict(model, strategy, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    import numpy as np
    dataset, num_batches = _keras_data.finite_dataset(x, None, None, batch_size, steps, with_targets=False)
    prepare_model(model, strategy, dataset.element_spec, "predict")
    callbacks = _callback_list(model, callbacks, verbose, num_batches)
    model.stop_predicting = False
    callbacks.on_predict_begin()
    function = _predict_function(model, dataset.element_spec)
    pieces, done = {}, 0
    for (start, count), outputs in _run_ranges(strategy, function, dataset, num_batches, (), model, "stop_predicting"):
        callbacks.on_predict_batch_begin(done)
        pieces[start] = outputs
        done += count
        callbacks.on_predict_batch_end(done - 1, {"outputs": outputs})
    callbacks.on_predict_end()
    if not pieces:
        raise ValueError("Invalid value for argument `x`: it holds no batches. Expected at least one.")
    ordered = [pieces[start] for start in sorted(pieces)]  # input order: ranges are contiguous
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts, axis=0), *ordered)


# -------------------------------------------------------------------- internals
def _callback_list(model, callbacks, verbose, num_batches):
    import keras

    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks  # fit's, during validation
    register_callback_kinds(callbacks)  # before the list: it calls each callback's set_model
    return keras.callbacks.CallbackList(
        callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1, steps=num_batches, model=model
    )


def _run_ranges(strategy, function, dataset, num_batches, extra_args, model, stop_flag):
    """Read the ranges and schedule one closure each; yield ((start, count), result) as each finishes.

    At most `window` ranges are in flight: enough to keep every worker busy
    while the next ones are read, few enough that the data read ahead of the
    workers stays small.
    """
    window = max(4, 2 * strategy.num_workers)
    futures: dict = {}
    counts: dict = {}

    def cancel_pending():
        for future in futures:
            future.cancel()

    def settle_one():
        done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
        future = next(iter(done))
        where = futures.pop(future)
        return where, result_or_first_error(strategy, future, cancel_pending)

    try:
        for start, count, graph in read_ranges(dataset, num_batches, strategy.num_workers):
            if count not in counts:
                counts[count] = tf.constant(count, tf.int32)
            futures[strategy.schedule(function, args=(graph, counts[count], *extra_args))] = (start, count)
            while len(futures) >= window:
                yield settle_one()
                if getattr(model, stop_flag):  # set to False by evaluate/predict, maybe True by a callback
                    return
        while futures:
            yield settle_one()
            if getattr(model, stop_flag):
                return
    finally:
        cancel_pending()
        if futures:
            concurrent.futures.wait(futures)


def _cached(model, key, build):
    per_model = _functions.setdefault(model, {})
    if key not in per_model:
        per_model[key] = build()
    return per_model[key]


def _evaluate_function(model, element_spec, variables):
    key = ("evaluate", repr(element_spec), tuple(id(v) for v in variables))
    return _cached(model, key, lambda: _build_evaluate(weakref.ref(model), element_spec, variables))


@functools.cache
def _evaluation_scope():
    """A Keras `StatelessScope` for a model on the ps: metric states mapped, weights read live.

    Keras's scope is made for fully functional calls, where every variable is
    mapped (`Layer.stateless_call`); here only the metric variables are, so
    that their updates stay on the worker. Two Keras paths then misbehave:
    weight regularizers ask the scope for their weight's value
    (`Layer._get_regularization_losses`) and get None, and `add_loss` losses
    (activity regularizers, a layer's own losses) are dropped unless the
    scope collects them. This scope answers an unmapped variable with the
    tf.Variable itself, exactly what `Variable.value` reads outside a scope,
    and collects losses, so `test_step` computes Keras's own total loss.
    """
    from keras.src.backend.common.stateless_scope import StatelessScope

    class EvaluationScope(StatelessScope):
        def get_current_value(self, variable):
            value = super().get_current_value(variable)
            return seam.internal(variable, "_value") if value is None else value

    return EvaluationScope


def _build_evaluate(model_ref, element_spec, variables):
    scope_class = _evaluation_scope()

    def evaluate_range(graph, count, state):
        iterator = iter(deserialize_dataset(graph, element_spec))

        def body(i, state):
            # Metric updates land in the scope, not in the ps variables. The replica's context, as
            # Keras's own evaluate runs test_step in (strategy.run), as fit's steps (trainer.py).
            with scope_class(state_mapping=list(zip(variables, state)), collect_losses=True) as scope, \
                    _runtime.replica_context():
                model_ref().test_step(iterator.get_next())
            updated = tuple(tf.cast(scope.get_current_value(v), value.dtype) for v, value in zip(variables, state))
            return i + 1, updated

        _, state = tf.while_loop(lambda i, _: i < count, body, (tf.constant(0), tuple(state)))
        return state

    return tf.function(evaluate_range, autograph=False)


def _predict_function(model, element_spec):
    return _cached(model, ("predict", repr(element_spec)), lambda: _build_predict(weakref.ref(model), element_spec))


def _build_predict(model_ref, element_spec):
    def predict_range(graph, count):
        iterator = iter(deserialize_dataset(graph, element_spec))
        with _runtime.replica_context():  # as Keras's own predict runs predict_step (strategy.run)
            first = model_ref().predict_step(iterator.get_next())
        arrays = tf.nest.map_structure(
            lambda t: tf.TensorArray(
                t.dtype, size=count, infer_shape=False,
                element_shape=tf.TensorShape([None]).concatenate(t.shape[1:]),
            ).write(0, t),
            first,
        )

        def body(i, arrays):
            with _runtime.replica_context():
                outputs = model_ref().predict_step(iterator.get_next())
            return i + 1, tf.nest.map_structure(lambda a, t: a.write(i, t), arrays, outputs)

        _, arrays = tf.while_loop(lambda i, _: i < count, body, (tf.constant(1), arrays))
        return tf.nest.map_structure(lambda a: a.concat(), arrays)

    return tf.function(predict_range, autograph=False)


def _results(model, variables, values):
    """The model's metric results for the metric state `values`, computed here.

    Every op here is local (the state is mapped to the values), so what TF registers on every
    task meanwhile (each new kind of op, e.g. the first `divide_no_nan`) is streamed: waited
    for, a hung worker held the end of evaluate until it answered.
    """
    from keras.src.backend.common.stateless_scope import StatelessScope

    mapping = [(v, tf.convert_to_tensor(value)) for v, value in zip(variables, values)]
    with StatelessScope(state_mapping=mapping), _runtime.streamed_registrations():
        return model.get_metrics_result()
