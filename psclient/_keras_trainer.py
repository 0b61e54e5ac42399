"""Keras 3's `model.fit/evaluate/predict` on a psclient cluster.

`install()` patches Keras's TF-backend trainer class once. The patches act
only for models whose variables live on the ps tasks of the connected psclient
strategy ("cluster models"); every other model gets Keras's own methods,
untouched.

For a cluster model:
- `fit` is Keras's own loop (epochs, callbacks, progress bar, validation,
  History). psclient hands it a data adapter over per-worker datasets and a
  train function that schedules `steps_per_execution` steps per call on a free
  worker and returns without waiting: the logs it returns are those of the most
  recent finished call, so batch-level callbacks and the progress bar see
  real numbers that lag a few steps behind. At the end of every epoch the
  pending steps are joined and the epoch's logs are read from the metric
  variables, which live on the ps and are updated atomically by every worker,
  so they aggregate all workers exactly.
- `evaluate` and `predict` cannot keep Keras's one-call-per-batch loop and
  still visit every example exactly once when a worker dies mid-way, so they
  split the data into contiguous ranges of batches instead (`_keras_eval`).
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import threading
import warnings
import weakref

from psclient import _runtime

__all__ = ["install", "cluster_strategy", "prepare_model", "TrainFunction"]

log = logging.getLogger("psclient")

_install_lock = threading.Lock()
_installed = False
_warned_local: "weakref.WeakSet" = weakref.WeakSet()


def install() -> None:
    """Patch `keras.src.backend.tensorflow.trainer.TensorFlowTrainer`; idempotent."""
    global _installed
    with _install_lock:
        if _installed:
            return
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
        _installed = True


# --------------------------------------------------------------- which models
def _device(variable) -> str | None:
    value = getattr(variable, "_value", variable)  # a Keras variable wraps a tf.Variable
    return getattr(value, "device", None)


def _state(model) -> list:
    """Every variable fit/evaluate/predict touch: weights, optimizer, metrics."""
    seen, result = set(), []
    optimizer = getattr(model, "optimizer", None)
    groups = [model.variables, getattr(optimizer, "variables", []), model.metrics_variables]
    for variable in (v for group in groups for v in group):
        if id(variable) not in seen and getattr(variable, "_value", True) is not None:
            seen.add(id(variable))
            result.append(variable)
    return result


def _connected_strategy():
    from psclient import _strategy

    ref = _strategy._active
    return ref() if ref is not None else None


def cluster_strategy(model, method: str):
    """The psclient strategy that holds `model`'s variables, or None for a local model.

    A model with variables both on ps tasks and in this process cannot be
    trained either way: that is an error naming the first local variables.
    """
    variables = _state(model)
    on_ps = [v for v in variables if _runtime.ps_index_of(_device(v)) is not None]
    strategy = _connected_strategy()
    if not on_ps:
        if strategy is not None and method == "fit" and model not in _warned_local:
            _warned_local.add(model)
            warnings.warn(
                f"model.fit() trains {model.name!r} in this process: none of its variables "
                f"is on the ps tasks of the connected {strategy!r}. Create the model and call "
                "compile() inside strategy.scope() to train it on the cluster.",
                stacklevel=3,
            )
        return None
    _check_all_on_ps(model, variables, method)
    if strategy is None:
        raise RuntimeError(
            f"Cannot run model.{method}() for {model.name!r}: its variables live on ps tasks, "
            "but no psclient.ParameterServerStrategy is connected in this process. Connect "
            "the strategy that created them (or load the model from a file to use it locally)."
        )
    _check_mode(model, method)
    return strategy


def _check_all_on_ps(model, variables, method: str) -> None:
    local = [v for v in variables if _runtime.ps_index_of(_device(v)) is None]
    if local:
        names = ", ".join(repr(getattr(v, "path", v.name)) for v in local[:5])
        more = f" and {len(local) - 5} more" if len(local) > 5 else ""
        raise ValueError(
            f"Cannot run model.{method}() for {model.name!r} on the cluster: variables {names}{more} "
            "were created outside strategy.scope() and live in this process, while the others "
            "live on ps tasks. Expected every variable on the ps tasks: create the model (build "
            "it) and call model.compile() inside `with strategy.scope():`."
        )


def _check_mode(model, method: str) -> None:
    if getattr(model, "run_eagerly", False):
        raise ValueError(
            f"Invalid value for argument `run_eagerly` of compile(). Received: run_eagerly=True "
            f"for {model.name!r}, whose variables live on ps tasks. Expected False: on a "
            f"parameter-server cluster every step of model.{method}() runs on a worker as a "
            "tf.function."
        )


def prepare_model(model, strategy, element_spec, method: str) -> None:
    """Build what is still unbuilt (on the ps, from the data's spec) and re-check placement."""
    if _needs_build(model):
        with strategy.scope():
            model._symbolic_build(data_batch=element_spec)  # Keras's own build, on the ps
    _check_all_on_ps(model, _state(model), method)


def _needs_build(model) -> bool:
    unbuilt = [not layer.built for layer in model._flatten_layers()]
    compile_metrics = getattr(model, "_compile_metrics", None)
    compile_loss = getattr(model, "_compile_loss", None)
    optimizer = getattr(model, "optimizer", None)
    return (
        any(unbuilt)
        or (compile_metrics is not None and not compile_metrics.built)
        or (compile_loss is not None and not compile_loss.built)
        or (optimizer is not None and not optimizer.built)
    )


# -------------------------------------------------------------- the train function
class TrainFunction:
    """What Keras's `fit` calls once per `steps_per_execution` steps.

    Each call schedules one closure that runs up to `steps_per_execution`
    train steps on the executing worker's iterator, and returns at once with
    the logs of the most recent finished closure (waiting only for the first
    closure of an epoch, so that callbacks always get real numbers). At most
    `max_in_flight` closures are unfinished at a time, so the coordinator never
    queues more than a few steps ahead of the workers. `finish()` joins them.
    """

    def __init__(self, model, strategy, steps_per_epoch: int):
        import tensorflow as tf

        self._strategy = strategy
        self._steps_per_execution = int(model.steps_per_execution)
        self._steps_per_epoch = steps_per_epoch
        self._steps_scheduled = 0
        self._in_flight: collections.deque = collections.deque()
        self._latest = None
        # Enough to keep every worker's pipeline fed, few enough that logs stay fresh.
        self._max_in_flight = max(4, 2 * strategy.num_workers * strategy.pipeline_depth)
        self._counts: dict[int, object] = {}
        model_ref = weakref.ref(model)  # the model owns this function, not the reverse

        def train_step(iterator):
            # Keras's own train_step, the user's override included.
            return model_ref().train_step(next(iterator))

        def train_steps(iterator, count):
            # `count` steps in one remote call. A while loop whose body reads
            # and updates ps variables makes every task that holds them run
            # the loop too, with the loop condition sent to it each
            # iteration: worth it for many steps per call, and the reason a
            # single step gets its own loop-free function (measured ad hoc
            # with benchmarks/keras_fit.py's model: ~30% more steps/s at
            # steps_per_execution=1).
            step = model_ref().train_step
            logs = step(next(iterator))
            _, logs = tf.while_loop(
                lambda i, _: i < count,
                lambda i, _: (i + 1, step(next(iterator))),
                (tf.constant(1), logs),
            )
            return logs

        train_step.__name__ = f"{model.name}_train_step"
        train_steps.__name__ = f"{model.name}_train_steps"
        self._one_step = tf.function(train_step, autograph=False)
        self._many_steps = tf.function(train_steps, autograph=False)

    def __call__(self, iterator):
        import tensorflow as tf

        count = self._steps_per_execution
        if self._steps_per_epoch:
            # Keras asks for whole executions; never run past the epoch's end.
            count = max(1, min(count, self._steps_per_epoch - self._steps_scheduled))
        if count == 1:
            future = self._strategy.schedule(self._one_step, args=(iterator,))
        else:
            if count not in self._counts:
                self._counts[count] = tf.constant(count, tf.int32)
            future = self._strategy.schedule(self._many_steps, args=(iterator, self._counts[count]))
        self._in_flight.append(future)
        self._steps_scheduled += count
        while len(self._in_flight) > self._max_in_flight:
            self._settle(self._in_flight.popleft())
        while self._in_flight and self._in_flight[0].done():
            self._settle(self._in_flight.popleft())
        if self._latest is None:
            self._settle(self._in_flight.popleft())
        return self._latest

    def finish(self, logs=None):
        """Wait for every scheduled step; return the newest logs (`logs` if none ran)."""
        self._strategy.join()  # raises the first error of a step, if any
        while self._in_flight:
            self._settle(self._in_flight.popleft())
        latest, self._latest, self._steps_scheduled = self._latest, None, 0
        return latest if latest is not None else logs

    def abandon(self) -> None:
        """After an error elsewhere: wait for the pending steps, logging their errors."""
        self._in_flight.clear()
        self._latest, self._steps_scheduled = None, 0
        try:
            self._strategy.join()
        except Exception as error:  # noqa: BLE001 - the error being raised already matters more
            log.warning("a train step failed while fit() was stopping: %s: %s", type(error).__name__, error)

    def _settle(self, future) -> None:
        try:
            self._latest = future.result()
        except BaseException:
            # The scheduler also keeps the first error for join(); raise it
            # there so it is raised once, with the closures after it cancelled.
            self._in_flight.clear()
            self._strategy.join()
            raise


# ------------------------------------------------------------------- patches
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

    from psclient import _keras_data

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
        from psclient import _keras_eval

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
        from psclient import _keras_eval

        return _keras_eval.predict(self, strategy, **_bind(stock, self, args, kwargs))

    return predict
