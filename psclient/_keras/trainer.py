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
  real numbers that lag a few steps behind (when none reads them, only the
  first call's logs are copied: `TrainFunction`). The epoch's last call waits for
  every pending step (as does the call after which a callback sets
  `model.stop_training`, through `fit_callbacks`), so when Keras reads the
  epoch's logs from the metric variables, which live on the ps and are updated
  atomically by every worker, they aggregate all workers exactly.
- `evaluate` and `predict` cannot keep Keras's one-call-per-batch loop and
  still visit every example exactly once when a worker dies mid-way, so they
  split the data into contiguous ranges of batches instead (`psclient._keras.eval`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import warnings
import weakref

import tensorflow as tf

from psclient._engine import registry
from psclient._coordinator import runtime as _runtime
from psclient._coordinator.ps_state import check_every_ps
from psclient._core.closure import outputs_unread
from psclient._keras import dynamic_embedding, outside_state, seam
from psclient._keras.step_functions import model_state as _state, step_functions as _step_functions
from psclient._keras.step_functions import tf_variable as _tf_variable
from psclient._tf.executors import local_device_in_force, register_summary_kinds, streamed_registrations

__all__ = ["TrainFunction", "cluster_strategy", "fit_callbacks", "prepare_model", "reads_batch_logs",
           "register_callback_kinds", "result_or_first_error"]

log = logging.getLogger("psclient")

_warned_local: weakref.WeakSet = weakref.WeakSet()


# --------------------------------------------------------------- which models
def _device(variable) -> str | None:
    return getattr(_tf_variable(variable), "device", None)


def _connected_strategy():
    return registry.current()


def cluster_strategy(model, method: str):
    """The psclient strategy that holds `model`'s variables, or None for a local model.

    A model with variables both on ps tasks and in this process (state made
    outside the scope) gets copies of the local ones on the ps tasks, with a
    warning (`outside_state`).
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
    if strategy is None:
        raise RuntimeError(
            f"Cannot run model.{method}() for {model.name!r}: its variables live on ps tasks, "
            "but no psclient.ParameterServerStrategy is connected in this process. Connect "
            "the strategy that created them (or load the model from a file to use it locally)."
        )
    _check_mode(model, method)
    outside_state.move_to_ps(model, strategy, variables, method)
    return strategy


def _check_mode(model, method: str) -> None:
    if model.run_eagerly:
        raise ValueError(
            f"Invalid value for argument `run_eagerly` of compile(). Received: run_eagerly=True "
            f"for {model.name!r}, whose variables live on ps tasks. Expected False: on a "
            f"parameter-server cluster every step of model.{method}() runs on a worker as a "
            "tf.function."
        )


def prepare_model(model, strategy, element_spec, method: str) -> None:
    """Build what is still unbuilt (on the ps, from the data's spec) and re-check placement.

    First every ps is checked through a ps loss: one lost since the last call is restored now."""
    check_every_ps(strategy, f"checking the ps tasks before model.{method}()")
    if method == "predict":
        # The layers only: Keras's own build also builds the compiled loss and metrics, from
        # targets predict has none of (a compiled model never fitted failed on None targets).
        if not all(layer.built for layer in model._flatten_layers()):
            import keras

            x, _, _ = keras.utils.unpack_x_y_sample_weight(element_spec)
            with strategy.scope():
                model.compute_output_spec(tf.nest.map_structure(
                    lambda spec: keras.KerasTensor(spec.shape, spec.dtype.name), x))
    elif _needs_build(model):
        with strategy.scope():
            try:
                model._symbolic_build(data_batch=element_spec)  # Keras's own build, on the ps
            except RuntimeError:
                if not _step_overridden(model, method):
                    raise
                # Keras without a strategy never builds symbolically: a model whose own step
                # never calls it (a GAN's train_step) builds its state in that step's first trace,
                # which psclient runs inside the strategy's variable creator (on the ps).
                log.info("%s cannot be called on its data's spec; its own train_step builds it when traced",
                         model.name)
    if method == "fit" and not _step_overridden(model, method) and getattr(model, "optimizer", None) is not None:
        # Keras's own train_step updates with `model.optimizer`; a step of the user's may use another.
        dynamic_embedding.make_slots_ahead(model, model.optimizer)
    outside_state.move_to_ps(model, strategy, _state(model), method)


def _step_overridden(model, method: str) -> bool:
    """Whether `fit` runs the model's own `train_step` (evaluate's and predict's steps run in a
    stateless scope, where nothing can be built)."""
    import keras

    return method == "fit" and type(model).train_step is not keras.Model.train_step


def _needs_build(model) -> bool:
    unbuilt = [not layer.built for layer in model._flatten_layers()]
    # None when compile() got no metrics / no loss.
    compile_metrics = seam.internal(model, "_compile_metrics")
    compile_loss = seam.internal(model, "_compile_loss")
    optimizer = getattr(model, "optimizer", None)  # set by compile(); predict needs none
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
    queues more than a few steps ahead of the workers. The epoch's last call
    (`steps_per_epoch` steps scheduled) waits for all of them (`finish`), so
    the metric variables hold the whole epoch when Keras reads its logs.

    The first call's logs are copied to the coordinator. If their keys are
    those of the model's metrics (Keras then reads the epoch's logs from the
    metric variables) and no callback reads batch logs (`reads_batch_logs`),
    the later calls leave their logs on the worker (`closure.outputs_unread`)
    and return the first call's: copying them cost each step's worker more
    than a small call itself. Otherwise every call's logs are copied.
    """

    def __init__(self, model, strategy, steps_per_epoch: int):
        self._strategy = strategy
        self._model_ref = weakref.ref(model)
        self._steps_per_execution = int(model.steps_per_execution)
        self._steps_per_epoch = steps_per_epoch
        self._steps_scheduled = 0
        self._in_flight: collections.deque = collections.deque()  # (future, whether its logs are copied)
        self._latest = None
        # None until the first logs are back; then whether the later steps' logs are left on the workers.
        self._logs_unread: bool | None = None
        self._callbacks = None  # fit's callback list (`watch`); None: assume they read batch logs
        # Enough to keep every worker's pipeline fed, few enough that logs stay fresh.
        self._max_in_flight = max(4, 2 * strategy.num_workers * strategy.pipeline_depth)
        self._counts: dict[int, object] = {}
        self._one_step, self._many_steps, self._batch_step = _step_functions(model, strategy)

    def __call__(self, iterator):
        # Keras asks for whole executions; never run past the epoch's end.
        count = max(1, min(self._steps_per_execution, self._steps_per_epoch - self._steps_scheduled))
        if count == 1:
            function, args = self._one_step, (iterator,)
        else:
            if count not in self._counts:
                self._counts[count] = tf.constant(count, tf.int32)
            function, args = self._many_steps, (iterator, self._counts[count])
        self._schedule_step(function, args)
        self._steps_scheduled += count
        return self._after_scheduling()

    def _schedule_step(self, function, args) -> None:
        copied = not self._logs_unread
        with contextlib.nullcontext() if copied else outputs_unread():
            future = self._strategy.schedule(function, args=args)
        self._in_flight.append((future, copied))

    def _after_scheduling(self):
        """The logs to hand Keras once a call's steps are scheduled (waiting for all at the epoch's end)."""
        if self._steps_per_epoch is not None and self._steps_scheduled >= self._steps_per_epoch:
            return self.finish()  # the epoch's last call
        while len(self._in_flight) > self._max_in_flight:
            self._settle(self._in_flight.popleft())
        while self._in_flight and self._in_flight[0][0].done():
            self._settle(self._in_flight.popleft())
        if self._latest is None:
            self._settle(self._in_flight.popleft())
        return self._latest

    def finish(self):
        """Wait for every scheduled step and start a new epoch; return the newest logs."""
        self._strategy.join()  # raises the first error of a step, if any
        while self._in_flight:
            self._settle(self._in_flight.popleft())
        latest, self._steps_scheduled = self._latest, 0
        if not self._logs_unread:
            # The next epoch's first call waits for its logs: callbacks see this epoch's numbers.
            self._latest = None
        return latest

    def watch(self, callbacks) -> None:
        """Take fit's callback list: whether its callbacks read batch logs is asked of it."""
        self._callbacks = callbacks

    def abandon(self, wait: bool = True) -> None:
        """After an error elsewhere: wait for the pending steps (unless `wait` is
        False), logging their errors."""
        self._in_flight.clear()
        self._latest, self._steps_scheduled = None, 0
        if not wait:
            return
        try:
            self._strategy.join()
        except Exception as error:  # noqa: BLE001 - any step error; the one being raised matters more
            log.warning("a train step failed while fit() was stopping: %s: %s", type(error).__name__, error)

    def _settle(self, pending) -> None:
        future, copied = pending
        logs = result_or_first_error(self._strategy, future, self._in_flight.clear)
        if not copied:
            return  # left on the worker (None): the last copied logs stand
        self._latest = logs
        if self._logs_unread is None:
            self._logs_unread = self._unread_after(logs)

    def _unread_after(self, logs) -> bool:
        """Whether, given the first step's `logs`, the later steps' logs may stay on the workers."""
        model = self._model_ref()
        if model is None or self._callbacks is None or reads_batch_logs(self._callbacks):
            return False
        # Keras's own test (`_get_metrics_result_or_logs`): logs whose keys are the metrics'
        # are replaced by the metric variables' results at the end of the epoch.
        return isinstance(logs, dict) and set(logs) == set(model.get_metrics_result())


def result_or_first_error(strategy, future, on_error=None):
    """`future.result()`; if it fails, the strategy's first error instead, raised once.

    The scheduler keeps the first error of any closure for `join()` and
    cancels the closures after it, so a failed or cancelled future is answered
    by `join()`'s error: the root cause, not this future's echo of it.
    `on_error()` runs first (drop what is pending).

    Interrupted (Ctrl-C) while waiting, it joins nothing: the user wants out,
    not every step still queued (fit's own handler and the strategy's shutdown
    stop them). Joining there left an interrupted `psclient demo` waiting for
    every queued step on a loaded machine (py-spy: Scheduler.join under this).
    """
    try:
        return future.result()
    except KeyboardInterrupt:
        if on_error is not None:
            on_error()
        raise
    except BaseException:
        if on_error is not None:
            on_error()
        strategy.join()
        raise


def fit_callbacks(model, train_function: TrainFunction, callbacks, verbose, epochs: int, steps: int | None,
                  batch_index=None, interrupts=None):
    """fit's callbacks, made as Keras's fit makes them, that also join when training stops.

    A callback that sets `model.stop_training` in a batch hook ends the epoch
    early: the list waits for the pending steps right after the batch's hooks,
    before Keras reads the epoch's logs from the metric variables. Keras's
    own list is kept otherwise (History, progress bar, asynchronous batch
    hooks); a `CallbackList` the user passes is wrapped, not changed.
    `steps` is the callbacks' `params["steps"]` (None: unknown, as Keras has
    it for data of unknown size). `batch_index(step, end)`, if given, is the
    batch index the batch hooks get at the beginning or `end` of Keras's
    `step`: a fit whose steps are not batches (a shard each) still reports
    batches, Keras's unit, to the progress bar and every other callback.
    `interrupts` (an `interrupts.InterruptWatch`): a Ctrl-C during the fit is raised
    again after each step and epoch, in case Python dropped it where it landed.
    """
    import keras

    def index(step, end):
        return step if batch_index is None else batch_index(step, end)

    class _StopJoins(keras.callbacks.CallbackList):
        def on_train_batch_begin(self, batch, logs=None):
            super().on_train_batch_begin(index(batch, False), logs)

        def on_train_batch_end(self, batch, logs=None):
            if interrupts is not None:
                interrupts.raise_if_interrupted()
            super().on_train_batch_end(index(batch, True), logs)
            if model_ref().stop_training:
                train_function.finish()

        def on_epoch_end(self, epoch, logs=None):
            if interrupts is not None:
                interrupts.raise_if_interrupted()
            # With a TensorBoard callback, the dynamic embedding tables' sizes,
            # admissions and evictions become epoch scalars (and History entries).
            if logs is not None and any(isinstance(c, keras.callbacks.TensorBoard) for c in _flat(self)):
                from psclient._keras.dynamic_embedding import epoch_logs

                logs.update(epoch_logs(model_ref()))
            super().on_epoch_end(epoch, logs)

    model_ref = weakref.ref(model)
    register_callback_kinds(callbacks)  # before the list: it calls each callback's set_model
    if isinstance(callbacks, keras.callbacks.CallbackList):
        made = _StopJoins([callbacks], model=model)
    else:
        made = _StopJoins(
            callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose, epochs=epochs,
            steps=steps, model=model,
        )
    if isinstance(train_function, TrainFunction):
        train_function.watch(made)
    return made


def register_callback_kinds(callbacks) -> None:
    """Registers on the tasks, without waiting for a hung worker, the kinds of local op that
    Keras's callbacks among `callbacks` (a list or a CallbackList) run: fit or evaluate
    started while a worker hangs then does not wait for it in their hooks.

    TF registers each new kind of eager op on every task first, even a local one; these are
    run once here, their registrations streamed (only local ops inside): a TensorBoard's
    writers (`register_summary_kinds`), and the comparison with the best value so far that
    EarlyStopping, ReduceLROnPlateau and ModelCheckpoint make at each epoch's end.
    """
    import keras

    found = _flat(callbacks or [])
    if any(isinstance(callback, keras.callbacks.TensorBoard) for callback in found):
        register_summary_kinds()
    monitors = (keras.callbacks.EarlyStopping, keras.callbacks.ReduceLROnPlateau, keras.callbacks.ModelCheckpoint)
    if any(isinstance(callback, monitors) for callback in found) and local_device_in_force():
        with streamed_registrations():
            keras.ops.less(0.0, 1.0)
            keras.ops.greater(0.0, 1.0)


def reads_batch_logs(callbacks) -> bool:
    """Whether any callback in `callbacks` (a CallbackList) may read the logs of a batch.

    One that overrides `on_train_batch_end` or `on_batch_end` of
    `keras.callbacks.Callback` does, except those known to use only the
    epoch's logs: History, BackupAndRestore, a ProgbarLogger that does not show a bar per batch
    (verbose != 1), a TensorBoard that writes per epoch, and psclient's
    callbacks whose own class sets `_psclient_reads_batch_logs = False` (a
    subclass may override the hooks: it counts as reading).
    """
    import keras

    hooks = ("on_train_batch_end", "on_batch_end")
    for callback in _flat(callbacks):
        kind = type(callback)
        # The bound hooks, not the class's: a LambdaCallback sets its hooks on the instance.
        if all(getattr(getattr(callback, hook), "__func__", None) is getattr(keras.callbacks.Callback, hook)
               for hook in hooks):
            continue
        if any(hook in getattr(callback, "__dict__", {}) for hook in hooks):
            return True
        if vars(kind).get("_psclient_reads_batch_logs") is False or \
                isinstance(callback, (keras.callbacks.History, keras.callbacks.BackupAndRestore)) or \
                (isinstance(callback, keras.callbacks.ProgbarLogger) and callback.verbose != 1) or \
                (isinstance(callback, keras.callbacks.TensorBoard) and callback.update_freq == "epoch"):
            continue
        return True
    return False


def _flat(callbacks) -> list:
    """The callbacks of a CallbackList (or a list), nested lists opened."""
    import keras

    out = []
    for callback in callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList) else callbacks:
        out += _flat(callback) if isinstance(callback, keras.callbacks.CallbackList) else [callback]
    return out
