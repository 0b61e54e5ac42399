"""Optimizer updates run on the ps task that holds the variable.

Keras 3's TF optimizers (and tf_keras's) apply each variable's update as
`distribution.extended.update(var, fn)`, on the tf.distribute strategy current
when the optimizer was made. Under psclient that is TF's default strategy,
which runs `fn` with no device, so on the calling worker: the worker would read
the variable and every optimizer slot from the ps, compute, and write them all
back, every step (Adam: 8x the parameter bytes per step, where gradients in and
weights out make 2x). TF's own ParameterServerStrategy runs `fn` colocated with
the variable; psclient does the same for variables on its ps tasks
(`place_updates_on_ps`, installed when a strategy's scope is entered).

What that covers: everything Keras routes through `extended.update`, i.e. every
optimizer's `update_step` (dense and `tf.IndexedSlices` gradients, all slots),
weight decay (AdamW, Lion, `weight_decay=` of any optimizer), gradient
accumulation and the EMA overwrite. The arithmetic is Keras's own, op for op,
so results equal a local Keras run (tests/strategy/test_ps_updates.py). Adam's,
AdamW's and SGD's dense updates are one TF kernel each (`psclient._keras.fused_updates`):
SGD's equal Keras's bit for bit, Adam's are Keras's formula with `1 - beta` formed in
float32. What stays on
the worker, all scalars or all-gradient work: the step counter's increment
(one atomic op on its ps), the learning rate (schedule), gradient clipping,
Nadam's `_u_product` (a scalar read-then-write; see docs/data_path.md).
The EMA's moving averages are placed by the Keras integration
(`psclient._keras.install`), which Keras does not route through
`extended.update`.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from psclient._coordinator import runtime as _runtime
from psclient._coordinator.training import sync
from psclient._coordinator.variables import sharding
from psclient._tf import updates as _updates

__all__ = ["place_updates_on_ps", "ps_device_of"]


def ps_device_of(variable: Any) -> str | None:
    """The device of `variable` if it is a `tf.Variable` on a ps task, else None.

    A Keras 3 variable counts by the `tf.Variable` it holds (its `.value`).
    Anything else (a tensor, a list given to `update_non_slot`, a variable
    in this process or on a worker) is None.
    """
    if not isinstance(variable, tf.Variable):
        inner = getattr(variable, "value", None)  # a Keras 3 Variable: its tf.Variable
        if not isinstance(inner, tf.Variable):
            return None
        variable = inner
    device = variable.device
    return device if _runtime.ps_index_of(device) is not None else None


def place_updates_on_ps() -> None:
    """Run every default-strategy update of a ps variable on that variable's ps task,
    and shard by shard for a partitioned one (`sharding.split_update`).

    Idempotent and class-wide; updates of any other variable run exactly as
    before (inert for local Keras).
    """
    _updates.route_default_updates(_route)


def _route(colocate_with: Any, fn, args: tuple, run):
    split = sharding.split_update(colocate_with, fn, args, run)
    if split is not None:
        return split
    device = ps_device_of(colocate_with)
    if device is None:
        return run(args)
    # An update outside a Keras optimizer's apply, in a step traced for schedule():
    # max_staleness / replicas_to_aggregate cannot follow it (an error there).
    sync.note_update()
    with tf.device(device):
        return run(args)
