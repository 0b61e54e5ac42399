"""Variables where TF's public API stops: a new resource for a kept variable,
a variable that bypasses the creators in force, a deferred restore recognised,
a control edge added to an op already made.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.trackable import base as trackable

__all__ = ["add_control_input", "is_checkpoint_initial_value", "renew_handle", "uncreated_variable"]


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
    variable._handle = handle  # noqa: SLF001


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
