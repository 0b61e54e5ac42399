"""`model.evaluate` and `model.predict` on a cluster, visiting every batch exactly once.

The data (finite, deterministic) is cut into a few contiguous ranges of
batches, a small multiple of the number of workers. Each range is one
scheduled closure that rebuilds the dataset on its worker from its serialized
graph and runs `test_step` / `predict_step` over its batches, returning only
values: predictions, or the metric *states* accumulated from the reset state
in a Keras `StatelessScope`, never writing the metric variables on the ps.
When a worker dies, the scheduler runs the closure again elsewhere, and
because a future resolves only once, the partial work of the dead worker is
never merged: exact visitation.

The coordinator merges metric states by adding each range's change from the
reset state. That is exact for every metric whose state is a sum (Keras's
Mean/Sum family, accuracies, loss trackers, confusion-matrix metrics such as
Precision, Recall and AUC); a metric with another kind of state (a running
maximum, a last value) is merged wrongly and needs Keras's own evaluate.
"""

from __future__ import annotations

import concurrent.futures
import weakref

from psclient._coordinator.per_worker import deserialize_dataset, serialize_dataset
from psclient._keras import data as _keras_data
from psclient._keras import seam
from psclient._keras.trainer import prepare_model, result_or_first_error

__all__ = ["SHARDS_PER_WORKER", "evaluate", "predict"]

#: Ranges per worker: more balances load and re-runs less after a failure;
#: fewer re-reads less data (each range skips to its start).
SHARDS_PER_WORKER = 4

# Traced functions per model: weak, so a model and its functions die together.
_functions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def evaluate(
    model, strategy, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
    steps=None, callbacks=None, return_dict=False,
):
    import numpy as np
    import tensorflow as tf
    from keras.src.utils.python_utils import pythonify_logs

    model._assert_compile_called("evaluate")
    dataset, num_batches = _keras_data.finite_dataset(x, y, sample_weight, batch_size, steps)
    prepare_model(model, strategy, dataset.element_spec, "evaluate")
    callbacks = _callback_list(model, callbacks, verbose, num_batches)
    model.stop_evaluating = False
    callbacks.on_test_begin()
    model.reset_metrics()
    variables = model.metrics_variables
    initial = tuple(np.asarray(v.numpy()) for v in variables)
    merged = [value.copy() for value in initial]
    function = _evaluate_function(model, dataset.element_spec, variables)
    # Tensors made here, on the coordinator: a NumPy argument would be
    # converted under the worker's device, and fail there if the worker died.
    initial_tensors = tuple(tf.constant(value) for value in initial)
    logs, done = {}, 0
    ranges = _run_ranges(strategy, function, dataset, num_batches, (initial_tensors,), model, "stop_evaluating")
    for (start, count), state in ranges:
        callbacks.on_test_batch_begin(done)
        for i, value in enumerate(state):
            merged[i] = merged[i] + (value - initial[i])
        done += count
        logs = _results(model, variables, merged)
        callbacks.on_test_batch_end(done - 1, logs)
    # Leave the merged state in the metric variables, as Keras's evaluate does.
    for variable, value in zip(variables, merged):
        variable.assign(value)
    logs = pythonify_logs(_results(model, variables, merged))
    callbacks.on_test_end(logs)
    return logs if return_dict else model._flatten_metrics_in_order(logs)


def predict(model, strategy, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    import numpy as np
    import tensorflow as tf

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
    return keras.callbacks.CallbackList(
        callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1, steps=num_batches, model=model
    )


def _ranges(num_batches: int, num_workers: int) -> list[tuple[int, int]]:
    """Contiguous (start, count) ranges covering every batch once, sizes within one."""
    pieces = max(1, min(num_batches, SHARDS_PER_WORKER * num_workers))
    base, extra = divmod(num_batches, pieces)
    ranges, start = [], 0
    for i in range(pieces):
        count = base + (i < extra)
        if count:
            ranges.append((start, count))
        start += count
    return ranges


def _run_ranges(strategy, function, dataset, num_batches, extra_args, model, stop_flag):
    """Schedule one closure per range; yield ((start, count), result) as each finishes."""
    import tensorflow as tf

    graph = serialize_dataset(dataset)
    futures = {}
    for start, count in _ranges(num_batches, strategy.num_workers):
        args = (graph, tf.constant(start, tf.int64), tf.constant(count, tf.int32), *extra_args)
        futures[strategy.schedule(function, args=args)] = (start, count)
    pending = set(futures)

    def cancel_pending():
        for future in pending:
            future.cancel()

    try:
        for future in concurrent.futures.as_completed(futures):
            pending.discard(future)
            yield futures[future], result_or_first_error(strategy, future, cancel_pending)
            if getattr(model, stop_flag):  # set to False by evaluate/predict, maybe True by a callback
                break
    finally:
        for future in pending:
            future.cancel()
        if pending:
            concurrent.futures.wait(pending)


def _cached(model, key, build):
    per_model = _functions.setdefault(model, {})
    if key not in per_model:
        per_model[key] = build()
    return per_model[key]


def _evaluate_function(model, element_spec, variables):
    key = ("evaluate", repr(element_spec), tuple(id(v) for v in variables))
    return _cached(model, key, lambda: _build_evaluate(weakref.ref(model), element_spec, variables))


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
    import tensorflow as tf

    scope_class = _evaluation_scope()

    def evaluate_range(graph, start, count, state):
        iterator = iter(deserialize_dataset(graph, element_spec).skip(start).take(tf.cast(count, tf.int64)))

        def body(i, state):
            # Metric updates land in the scope, not in the ps variables.
            with scope_class(state_mapping=list(zip(variables, state)), collect_losses=True) as scope:
                model_ref().test_step(iterator.get_next())
            updated = tuple(tf.cast(scope.get_current_value(v), value.dtype) for v, value in zip(variables, state))
            return i + 1, updated

        _, state = tf.while_loop(lambda i, _: i < count, body, (tf.constant(0), tuple(state)))
        return state

    return tf.function(evaluate_range, autograph=False)


def _predict_function(model, element_spec):
    return _cached(model, ("predict", repr(element_spec)), lambda: _build_predict(weakref.ref(model), element_spec))


def _build_predict(model_ref, element_spec):
    import tensorflow as tf

    def predict_range(graph, start, count):
        iterator = iter(deserialize_dataset(graph, element_spec).skip(start).take(tf.cast(count, tf.int64)))
        first = model_ref().predict_step(iterator.get_next())
        arrays = tf.nest.map_structure(
            lambda t: tf.TensorArray(
                t.dtype, size=count, infer_shape=False,
                element_shape=tf.TensorShape([None]).concatenate(t.shape[1:]),
            ).write(0, t),
            first,
        )

        def body(i, arrays):
            outputs = model_ref().predict_step(iterator.get_next())
            return i + 1, tf.nest.map_structure(lambda a, t: a.write(i, t), arrays, outputs)

        _, arrays = tf.while_loop(lambda i, _: i < count, body, (tf.constant(1), arrays))
        return tf.nest.map_structure(lambda a: a.concat(), arrays)

    return tf.function(predict_range, autograph=False)


def _results(model, variables, values):
    """The model's metric results for the metric state `values`, computed here."""
    import tensorflow as tf
    from keras.src.backend.common.stateless_scope import StatelessScope

    mapping = [(v, tf.convert_to_tensor(value)) for v, value in zip(variables, values)]
    with StatelessScope(state_mapping=mapping):
        return model.get_metrics_result()
