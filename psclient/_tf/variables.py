"""Variables where TF's public API stops: a new resource for a kept variable,
a variable that bypasses the creators in force, a deferred restore recognised,
a control edge added to an op already made, an initial value lifted out of a
function being traced.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.python.eager import lift_to_graph
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.trackable import base as trackable

from psclient._tf.renewed_captures import handle_renewed
from psclient._tf.registrations import until_registered

__all__ = ["add_control_input", "is_checkpoint_initial_value", "lifted_initial_value", "renew_handle",
           "uncreated_variable"]


def renew_handle(variable: Any, device: str) -> None:
    """Give `variable` a new, uninitialized resource on `device`, keeping the object.

    The user's objects (Keras layers, optimizers) hold the `tf.Variable`s
    themselves, so only the handle is replaced: there is no public way.
    """
    with tf.device(device):
        handle = resource_variable_ops._variable_handle_from_shape_and_dtype(  # noqa: SLF001
            shape=variable.shape, dtype=variable.dtype, shared_name=None,
            name=variable.name.split(":")[0], graph_mode=False,
        )
    old = variable._handle  # noqa: SLF001
    variable._handle = handle  # noqa: SLF001
    handle_renewed(old)  # traces that captured the old one are made again at their next call


def uncreated_variable(value: Any, name: str):
    """A non-trainable `ResourceVariable` of `value`, made on the device in force.

    `ResourceVariable` itself, not `tf.Variable`: a subclass bypasses the
    variable creators in force (a strategy's, which would place and
    checkpoint it).
    """
    return resource_variable_ops.ResourceVariable(value, trainable=False, name=name)


def is_checkpoint_initial_value(initial_value: Any) -> bool:
    """Whether `initial_value` restores from a checkpoint file (TF's deferred restore)."""
    return isinstance(initial_value, trackable.CheckpointInitialValueCallable)


def add_control_input(op, before) -> None:
    """Make graph op `op` run after op `before` (what `tf.CriticalSection` does to its lock)."""
    op._add_control_input(before)  # noqa: SLF001


def lifted_initial_value(value: Any, name: Any) -> Any:
    """For `value`, a tensor of a function being traced (`tf.Variable(tf.zeros(...))` at its first
    trace), a zero-argument callable that makes it eagerly, on the device in force; for anything
    else, None.

    A variable is made eagerly on its ps, where the traced tensor cannot be used: its ops are
    copied into a function of their own (`lift_to_graph`, as `tf.function` does with the
    initializers of the variables it makes). A value computed from the function's inputs or
    captured tensors cannot be: ValueError, naming it.
    """
    if not tf.is_tensor(value) or not tf.is_symbolic_tensor(value) or not hasattr(value, "graph"):
        return None
    graph = value.graph
    inputs = {tensor.op for tensor in list(getattr(graph, "inputs", [])) + list(getattr(graph, "internal_captures", []))}
    try:  # checked at once, in the trace: a clear error there, not at the variable's first use
        lift_to_graph.lift_to_graph([value], tf.Graph(), disallowed_placeholders=inputs)
    except lift_to_graph.UnliftableError as error:  # its message is in ours: TF's traceback is noise here
        raise ValueError(
            f"Invalid value for argument `initial_value` of tf.Variable{f' {name!r}' if name else ''}. Received: a tensor "
            f"({value.name}) computed from the inputs or captured values of the function being traced. "
            "Expected a value made from constants only (`tf.zeros(shape)`), or a callable that makes it "
            "(`tf.Variable(lambda: tf.zeros(shape))`): psclient makes the variable on a ps task, outside "
            f"the function. ({error})") from None

    @tf.function(autograph=False)
    def make():
        return lift_to_graph.lift_to_graph([value], tf.compat.v1.get_default_graph())[value]

    # Traced (and registered on every task, streamed) at its first call, on a ps, inside the trace
    # that asked for it: that call can overtake the registration, and is then made again.
    return lambda: until_registered(make)
