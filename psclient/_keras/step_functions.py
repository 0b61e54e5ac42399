"""A model's train-step `tf.function`s, kept on the model across `fit` calls, and the state they capture."""

from __future__ import annotations

import weakref

import tensorflow as tf

from psclient._coordinator import runtime as _runtime
from psclient._keras import seam

__all__ = ["StepFunctions", "model_state", "step_functions", "tf_variable"]


def tf_variable(variable):
    """The tf.Variable behind a Keras variable (None before it is created), or `variable`."""
    return variable if isinstance(variable, tf.Variable) else seam.internal(variable, "_value")


def model_state(model) -> list:
    """Every variable fit/evaluate/predict touch: weights, optimizer, metrics."""
    seen, result = set(), []
    optimizer = getattr(model, "optimizer", None)  # set by compile()
    groups = [model.variables, optimizer.variables if optimizer is not None else [], model.metrics_variables]
    for variable in (v for group in groups for v in group):
        if id(variable) not in seen and tf_variable(variable) is not None:
            seen.add(id(variable))
            result.append(variable)
    return result


# Where a model keeps its step functions between fit() calls (not a Keras attribute).
_STEP_FUNCTIONS_ATTRIBUTE = "_psclient_step_functions"


class StepFunctions:
    """A model's train-step `tf.function`s (one step, a loop of steps, one step on a batch read on
    the coordinator), and what they were made for.

    Kept on the model across fit() calls, as Keras keeps its own train
    function until the next compile(): a new `tf.function` per fit() traced
    the step again on the coordinator and made every task instantiate it
    again, about a second of CPU per fit() (Adam, measured with
    benchmarks/step_cpu.py), where tf_keras traces once. compile() makes a
    new loss tracker (and usually a new optimizer and compiled loss), so
    the functions are made again after it, as Keras's would be.
    """

    def __init__(self, model, strategy):
        self.made_for = _made_for(model, strategy)
        model_ref = weakref.ref(model)  # the model owns these functions, not the reverse

        def train_step(iterator):
            # Keras's own train_step, the user's override included, in the replica's context as
            # locally (and as tf_keras's fit under strategy.run): LossScaleOptimizer refuses the other.
            with _runtime.replica_context():
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
            with _runtime.replica_context():
                logs = step(next(iterator))
                _, logs = tf.while_loop(
                    lambda i, _: i < count,
                    lambda i, _: (i + 1, step(next(iterator))),
                    (tf.constant(1), logs),
                )
            return logs

        def batch_step(batch):
            # One step on a batch read on the coordinator (psclient._keras.host_data).
            with _runtime.replica_context():
                return model_ref().train_step(batch)

        train_step.__name__ = f"{model.name}_train_step"
        train_steps.__name__ = f"{model.name}_train_steps"
        batch_step.__name__ = f"{model.name}_batch_step"
        self.one_step = tf.function(train_step, autograph=False)
        self.many_steps = tf.function(train_steps, autograph=False)
        # Batches differ in size (the last one): one trace for all sizes after the second.
        self.batch_step = tf.function(batch_step, autograph=False, reduce_retracing=True)


def _made_for(model, strategy) -> tuple:
    """What a model's step functions depend on beyond its variables, compared by identity.

    The strategy is held weakly: a model must not keep alive a strategy
    nobody else references (its owners shut it down when it goes). The
    tf.Variables behind the model's state are in it too: a trace captured
    them, so one replaced (a new object) needs a new trace.
    """
    train_step = model.train_step
    return (weakref.ref(strategy), getattr(train_step, "__func__", train_step), model.optimizer,
            seam.internal(model, "_loss_tracker"), seam.internal(model, "_compile_loss"),
            seam.internal(model, "_compile_metrics"), *(tf_variable(v) for v in model_state(model)))


def step_functions(model, strategy) -> tuple:
    """The model's (one step, many steps, batch step) functions: those of its last fit() if still valid."""
    kept = getattr(model, _STEP_FUNCTIONS_ATTRIBUTE, None)
    made_for = _made_for(model, strategy)
    if kept is None or kept.made_for[0]() is not strategy or len(kept.made_for) != len(made_for) or \
            any(a is not b for a, b in zip(kept.made_for[1:], made_for[1:])):
        kept = StepFunctions(model, strategy)
        setattr(model, _STEP_FUNCTIONS_ATTRIBUTE, kept)
    return kept.one_step, kept.many_steps, kept.batch_step
