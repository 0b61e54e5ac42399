"""Keras 3's `model.fit/evaluate/predict` on a psclient cluster.

`psclient._keras.install` patches Keras's TF-backend trainer class once. The patches act
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
import logging
import warnings
import weakref

from psclient._coordinator import registry
from psclient._coordinator import runtime as _runtime

__all__ = ["TrainFunction", "cluster_strategy", "prepare_model"]

log = logging.getLogger("psclient")

_warned_local: weakref.WeakSet = weakref.WeakSet()


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
    return registry.current()


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
