"""Keras 3 support, installed when `strategy.scope()` is first entered.

All class-level, idempotent and inert for variables and models
that do not live on a psclient strategy's ps tasks:

1. Atomic increments. Keras 3 implements `Variable.assign_add(v)` as
   `assign(self + v)`: a read, then a write. In one process that is harmless;
   with several workers updating the same ps variable at once, increments are
   lost (measured: an optimizer's `iterations` counted 36 of 41 steps; metric
   totals lose updates the same way). `tf.Variable.assign_add` is one atomic
   op on the ps, so psclient routes Keras's TF-backend variables to it. The
   arithmetic is identical; only the race goes. Optimizer weight updates
   already use `tf.Variable.assign_sub` directly.
2. `model.fit/evaluate/predict` on the cluster (`psclient._keras.trainer`,
   `psclient._keras.eval`): `TensorFlowTrainer.fit/evaluate/predict` wrapped;
   during fit, the model's `reset_metrics` and `get_metrics_result` are
   guarded against a lost ps (`psclient._keras.ps_reads`).
3. The data path (docs/data_path.md). Optimizer updates already run on
   the ps of their variable (`psclient._coordinator.training.updates`); two Keras paths
   do not go through it and are placed here: embedding lookups (`ops.take` on
   axis 0 of a ps variable gathers the rows on the ps, so only the looked-up
   rows travel, not the table) and the EMA's moving averages (`use_ema`),
   updated on the ps of each average. And Adagrad's update of a ps variable
   (or shard) from a `tf.IndexedSlices` gradient works on the touched rows
   only, where Keras's computes `sqrt(accumulator + epsilon)` over the whole
   table every step (same arithmetic on those rows, see
   `psclient._keras.sparse_adagrad`). Adafactor's update of a partitioned variable
   runs on each shard's ps (`psclient._keras.adafactor`). Adam's (and AdamW's) and
   SGD's update of a ps variable from a dense gradient is one TF kernel each
   (`psclient._keras.fused_updates`): the same formulas; SGD's bit for bit, Adam's
   as with its betas rounded to float32.
4. BatchNormalization's moving statistics, which Keras writes with a plain
   read-then-assign, written with one atomic `assign_sub` each on their ps
   (`psclient._keras.moving_stats`), so concurrent workers' updates compose;
   with `renorm=True`, `moving_variance`, which Keras derives from
   `moving_stddev`, is assigned that derivation after the stddev's update.
5. Initial values made on the ps: each weight's and slot's initializer runs
   on its ps task (shard by shard when partitioned), never in the coordinator
   (`psclient._keras.initializers`).

6. Exports (`psclient._keras.serving`): Keras's `model.export` is one export
   scope, in which a `DynamicEmbedding` reads a snapshot of its rows in stock
   TF variables, and a model's SavedModel leaves out its optimizer and
   compiled metrics (also installed by the first `DynamicEmbedding`, which
   works without a strategy).
7. The optimizer's `apply` (`psclient._keras.optimizer_apply`): one wrapper
   updates the rows of `DynamicEmbedding` layers, then applies the other
   weights under the strategy's rule for model versions.
8. A trainable ps weight read inside a while loop of a layer's call (an LSTM's
   kernels, once per timestep) is read once per forward pass, outside the
   loop, so the loop runs on the worker alone (`psclient._keras.loop_reads`).

Nothing else in psclient patches Keras. Before patching, every private Keras
name psclient uses (`psclient._keras.seam.KERAS_INTERNALS`) is looked up, so a
Keras that moved one fails here, loudly, naming it.

Keras's other backends keep their variables outside TensorFlow, where no ps
task can hold them: with Keras imported under another backend, entering the
scope is an error rather than a silent local run.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import types

import tensorflow as tf

from psclient._coordinator.data import finite
from psclient._keras import adafactor, fused_updates, initializers, moving_stats, sparse_adagrad
from psclient._keras import eval as _keras_eval
from psclient._keras import loop_reads, optimizer_apply, seam, serving, sharded_fit
from psclient._keras.interrupts import InterruptWatch
from psclient._keras.ps_reads import metrics_through_ps_loss, restore_cause
from psclient._keras.trainer import (
    TrainFunction,
    cluster_strategy,
    fit_callbacks,
    prepare_model,
)
from psclient._tf.executors import streamed_function_registrations, streamed_registrations

__all__ = ["FIT_ARGUMENTS", "check_keras_backend", "fit_arguments", "install"]

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
    except ImportError:  # Keras is optional: without it there is nothing to patch
        return False
    if not keras.__version__.startswith("3."):
        return False  # Keras 2 (tf_keras) keeps its variables as tf.Variables already
    from keras.src.backend import backend

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
    """Install psclient's Keras 3 support once (the name is the scope's hook).

    Raises `psclient._keras.seam.KerasSeamError` if the installed Keras lacks
    an internal psclient needs; then nothing is patched.
    """
    global _done
    with _lock:
        if _done:
            return
        if not check_keras_backend():
            return
        seam.check()
        _install_atomic_increments()
        initializers.install()
        _install_trainer_patches()
        _install_ps_gather()
        _install_moving_average_on_ps()
        _install_partitioned_shape()
        sparse_adagrad.install()
        fused_updates.install()
        adafactor.install()
        moving_stats.install()
        serving.install()
        optimizer_apply.install()
        loop_reads.install()
        _done = True


def _install_atomic_increments() -> None:
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from keras.src.backend.tensorflow.core import Variable

    def atomic(plain, method_name):
        def update(self, value):
            tf_variable = seam.internal(self, "_value")
            if not isinstance(tf_variable, tf.Variable) or in_stateless_scope():
                return plain(self, value)
            return getattr(tf_variable, method_name)(tf.cast(value, tf_variable.dtype))

        functools.update_wrapper(update, plain)
        update.__doc__ = f"Atomic `{method_name}` on the underlying tf.Variable (patched by psclient)."
        return update

    Variable.assign_add = atomic(Variable.assign_add, "assign_add")
    Variable.assign_sub = atomic(Variable.assign_sub, "assign_sub")


def _install_ps_gather() -> None:
    """`take(table, ids, axis=0)` on a ps variable: gather the rows on the ps.

    Keras's TF `take` (Embedding's lookup) starts with `convert_to_tensor(x)`:
    for a variable that reads the whole table, which then crosses from the ps
    to the worker every step. `tf.gather` on the `tf.Variable` itself is a
    ResourceGather, which runs where the variable lives, so only the rows
    travel; its gradient is the same `tf.IndexedSlices`. Keras's negative-index
    semantics ("fill": -1 is the last row) are kept. A partitioned table
    (`psclient._coordinator.variables.sharding`) is looked up shard by shard, each
    shard's rows gathered on its ps. Anything else (another
    axis, sparse or ragged or non-integer indices, a variable in this process,
    a value that an autocast or stateless scope replaces) is Keras's own take.
    """
    import keras
    from keras.src.backend.tensorflow import numpy as tf_numpy

    from psclient._coordinator.variables.sharding import is_partitioned
    from psclient._coordinator.training.updates import ps_device_of

    stock = tf_numpy.take

    def take(x, indices, axis=None):
        # `.value` of a Keras variable: the tf.Variable itself unless a scope
        # substitutes or casts it (then a tensor: Keras's path).
        variable = loop_reads.take_source(x) if isinstance(x, keras.Variable) else x
        partitioned = is_partitioned(variable)
        if (
            axis == 0
            and (partitioned or (isinstance(variable, tf.Variable) and ps_device_of(variable) is not None))
            and not isinstance(indices, (tf.SparseTensor, tf.RaggedTensor))
        ):
            ids = tf.convert_to_tensor(indices)
            if ids.dtype.is_integer:
                # Static when known: tf.shape() of a variable would read it whole.
                rows = variable.shape[0]
                rows = tf.shape(variable, out_type=ids.dtype)[0] if rows is None else tf.constant(rows, ids.dtype)
                ids = tf.where(ids < 0, ids + rows, ids)  # Keras's "fill" mode
                if partitioned:
                    # Each shard's rows gathered on its ps; "div" cuts rows as psclient does.
                    return tf.nn.embedding_lookup(variable.variables, ids)
                return tf.gather(variable, ids)  # ResourceGather, on the ps
        return stock(x, indices, axis=axis)

    functools.update_wrapper(take, stock)
    take.__doc__ = f"{stock.__doc__ or ''}\n\nOn a ps variable, axis 0: rows gathered on the ps (psclient)."
    tf_numpy.take = take


def _install_partitioned_shape() -> None:
    """A Keras variable's `shape` follows its partitioned value's focus on one shard.

    While psclient traces an optimizer's update of a partitioned variable one
    shard at a time (`psclient._coordinator.variables.sharding.split_update`), the
    variable and its slots stand for that shard; Keras's `assign` compares a
    value's shape with the variable's, so the variable reports the shard's.
    Any other variable, and any other time, Keras's own shape.
    """
    from keras.src.backend.tensorflow.core import Variable

    from psclient._coordinator.variables.sharding import is_partitioned

    stock = Variable.shape

    def shape(self):
        value = seam.internal(self, "_value")
        if is_partitioned(value) and value.focused is not None:
            return value.shape
        return stock.fget(self)

    Variable.shape = property(shape, doc=stock.__doc__)


def _install_moving_average_on_ps() -> None:
    """The EMA's moving averages (`use_ema=True`) updated on the ps of each average.

    Keras updates them outside `extended.update`, so the arithmetic would run
    on the worker and read each weight and its average over the network. The
    formula is Keras's own (`BaseOptimizer._update_model_variables_moving_average`
    in Keras 3.10-3.15), written with the same ops so results are identical;
    optimizers without an average on a ps task keep Keras's method.
    """
    import contextlib

    from keras import ops
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    from psclient._coordinator.training.updates import ps_device_of

    stock = TFOptimizer._update_model_variables_moving_average

    def update_moving_average(self, trainable_variables):
        averages = seam.internal(self, "_model_variables_moving_average") if self.use_ema else []
        devices = [None if average is None else ps_device_of(average) for average in averages]
        if not any(devices):
            return stock(self, trainable_variables)
        for var, average, device in zip(trainable_variables, averages, devices):
            if average is None:
                continue
            with tf.device(device) if device else contextlib.nullcontext():
                not_first_step = ops.not_equal(self.iterations, 0)
                momentum = ops.multiply(ops.cast(not_first_step, var.dtype), self.ema_momentum)
                average.assign(
                    ops.add(ops.multiply(momentum, average), ops.multiply(ops.subtract(1, momentum), var))
                )

    functools.update_wrapper(update_moving_average, stock)
    update_moving_average.__doc__ = f"{stock.__doc__ or ''} On the ps of each average (psclient)."
    TFOptimizer._update_model_variables_moving_average = update_moving_average


def _install_trainer_patches() -> None:
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    for name, make in (("fit", _patched_fit), ("evaluate", _patched_evaluate), ("predict", _patched_predict)):
        stock = getattr(TensorFlowTrainer, name)
        setattr(TensorFlowTrainer, name, functools.update_wrapper(make(stock), stock))


def _bind(stock, model, args, kwargs) -> dict:
    bound = inspect.signature(stock).bind(model, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    extra = arguments.pop("kwargs", {})
    arguments.update(extra)
    return arguments


# ------------------------------------------------------------------------ fit
#: fit's arguments, each with what psclient does with it: consumed (turned
#: into the per-worker data and the epoch's steps) or forwarded to Keras's own
#: fit unchanged. Keras 3.10-3.15's fit takes exactly these; an argument a later
#: Keras adds is refused (`fit_arguments`) rather than silently dropped.
FIT_ARGUMENTS = types.MappingProxyType({
    "x": "consumed", "y": "consumed", "sample_weight": "consumed", "batch_size": "consumed",
    "shuffle": "consumed", "class_weight": "consumed", "steps_per_epoch": "consumed",
    "validation_split": "consumed", "validation_data": "consumed",
    "epochs": "forwarded", "verbose": "forwarded", "callbacks": "forwarded",
    "initial_epoch": "forwarded", "validation_steps": "forwarded",
    "validation_batch_size": "forwarded", "validation_freq": "forwarded",
})


def fit_arguments(signature: inspect.Signature, model, args: tuple, kwargs: dict) -> dict:
    """fit's arguments by name, defaults filled in; refuse one psclient does not handle.

    An argument Python cannot bind to `signature` raises Python's own
    TypeError, as Keras's fit does.
    """
    bound = signature.bind(model, *args, **kwargs)
    given = {name: value for name, value in bound.arguments.items() if name != "self"}
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            given.update(given.pop(name, {}))
    for name, value in given.items():
        if name not in FIT_ARGUMENTS:
            import keras

            raise ValueError(
                f"Invalid argument `{name}` for model.fit() on a parameter-server cluster. "
                f"Received: {name}={value!r}. Expected it left out: psclient runs fit with "
                f"the arguments {', '.join(sorted(FIT_ARGUMENTS))} and does not know what "
                f"`{name}` of Keras {keras.__version__} needs on a cluster "
                f"(psclient is tested with keras{seam.keras_range()})."
            )
    bound.apply_defaults()
    arguments = {name: bound.arguments[name] for name in FIT_ARGUMENTS if name in bound.arguments}
    return arguments


def _patched_fit(stock):
    signature = inspect.signature(stock)

    def fit(self, *args, **kwargs):
        strategy = cluster_strategy(self, "fit")
        if strategy is None:
            return stock(self, *args, **kwargs)
        with InterruptWatch() as interrupts:  # a Ctrl-C dropped where it landed is raised again
            return _fit(stock, self, strategy, fit_arguments(signature, self, args, kwargs), interrupts)

    return fit


def _fit(stock, model, strategy, a: dict, interrupts=None):
    import keras
    from keras.src.trainers.data_adapters import array_slicing

    from psclient._keras import data as _keras_data, host_data

    model._assert_compile_called("fit")
    forwarded = {name: a[name] for name, use in FIT_ARGUMENTS.items() if use == "forwarded"}
    # Keras validates in batches of `validation_batch_size or batch_size`; its fit gets
    # batch_size=None from psclient (the data is batched by then), so the default is set here.
    forwarded["validation_batch_size"] = a["validation_batch_size"] or a["batch_size"]
    batches = None  # an epoch's batches, when a ShardedDataset's shards are ranges of batches
    # Local work on the coordinator (a dataset's size, its batches counted): its eager ops'
    # registrations on the tasks streamed, so that a hung worker does not hold fit here.
    with streamed_registrations():
        host_fed = host_data.is_host_fed(a["x"])  # made in this process's Python: read here
        if not host_fed and a["steps_per_epoch"] is None and finite.is_finite_of_unknown_size(a["x"]):
            # Keras reads such data to its end; psclient cuts its batches into shards. Keras's own
            # adapter first: it refuses `y` and `sample_weight` and applies `class_weight`, and
            # `batch_size` means nothing to a dataset (beyond validation's default, above).
            from keras.src.trainers.data_adapters import get_data_adapter

            dataset = get_data_adapter(a["x"], a["y"], a["sample_weight"], class_weight=a["class_weight"])
            a = dict(a, x=finite.sharded_from_dataset(dataset.get_tf_dataset(), strategy.num_workers),
                     y=None, sample_weight=None, class_weight=None, batch_size=None)
            batches = a["x"].num_records  # counted: its shards are ranges of batches

    def validation(data):  # read once, here; each epoch's validation evaluates what it made
        return _keras_data.validation_adapter(
            sharded_fit.as_finite(data), forwarded["validation_batch_size"], forwarded["validation_steps"])

    if sharded_fit.is_sharded(a["x"]):  # psclient.data: every shard once per epoch, through a ledger
        a = dict(a, validation_data=validation(a["validation_data"]))
        return sharded_fit.fit(stock, model, strategy, a, forwarded, lambda function, callbacks, steps, index: (
            fit_callbacks(model, function, callbacks, a["verbose"], a["epochs"], steps, index, interrupts)), batches)
    x, y, sample_weight = a["x"], a["y"], a["sample_weight"]
    validation_data = a["validation_data"]
    if a["validation_split"] and validation_data is None:
        # Keras splits arrays inside fit; the split must happen before psclient
        # turns x into per-worker datasets.
        (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
            (x, y, sample_weight), validation_split=a["validation_split"]
        )
    validation_data = validation(validation_data)
    if host_fed:
        with streamed_registrations():  # Keras's adapter: local ops only
            adapter, steps_per_epoch = host_data.host_adapter(
                x, y, sample_weight, a["batch_size"], a["shuffle"], a["class_weight"], a["steps_per_epoch"])
        make_train_function = host_data.HostFedTrainFunction
    else:
        adapter, steps_per_epoch = _keras_data.training_data(
            strategy, x, y, sample_weight, a["batch_size"], a["shuffle"], a["class_weight"], a["steps_per_epoch"]
        )
        make_train_function = TrainFunction
    prepare_model(model, strategy, adapter.element_spec, "fit")
    # The steps Keras's loop will run per epoch: it caps them for debugging
    # runs (keras.config.set_max_steps_per_epoch), and so the epochs.
    cap = keras.config.max_steps_per_epoch()
    epoch_steps = min(steps_per_epoch or cap, cap) if cap else steps_per_epoch  # None: the data's end tells
    epochs = min(a["epochs"], keras.config.max_epochs() or a["epochs"])
    previous = seam.internal(model, "train_function")
    train_function = make_train_function(model, strategy, epoch_steps)
    # Keras's fit calls make_train_function(), which keeps a train function
    # already set: this one, for the duration of this fit.
    model.train_function = train_function
    callbacks = fit_callbacks(model, train_function, a["callbacks"], a["verbose"], epochs, epoch_steps,
                              interrupts=interrupts)
    try:
        forwarded["callbacks"] = callbacks
        # Keras's own metric reads go through a ps loss; what its loop traces meanwhile (the
        # validation data's map functions) is registered on every task without waiting on a
        # hung worker (`streamed_function_registrations`).
        with metrics_through_ps_loss(model, strategy), streamed_function_registrations():
            return stock(
                model, x=adapter, batch_size=None, validation_data=validation_data, shuffle=False,
                steps_per_epoch=steps_per_epoch, **forwarded,
            )
    except BaseException as error:
        # Interrupted (Ctrl-C): the user wants out, not the steps in flight; the
        # strategy's shutdown cancels them. Any other error: wait for them.
        train_function.abandon(wait=not isinstance(error, KeyboardInterrupt))
        restore_cause(error)
        raise
    finally:
        model.train_function = previous
        if host_fed:
            adapter.dataset.close()  # its open pass (`host_data.ReadHere`)


# ------------------------------------------------------------ evaluate, predict
def _patched_evaluate(stock):
    def evaluate(self, *args, **kwargs):
        strategy = cluster_strategy(self, "evaluate")
        if strategy is None:
            return stock(self, *args, **kwargs)
        a = _bind(stock, self, args, kwargs)
        a["x"] = sharded_fit.as_finite(a["x"])
        a.pop("_use_cached_eval_dataset", None)  # fit's validation passes the data itself too
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
        a = _bind(stock, self, args, kwargs)
        a["x"] = sharded_fit.as_finite(a["x"])
        return _keras_eval.predict(self, strategy, **a)

    return predict
