"""psclient's own reads and writes of ps state on the coordinator, through a ps loss.

Beside the scheduled closures, psclient touches the ps tasks from the
caller's thread: a trace reads a dynamic table's rows to size its slots,
`stats()` and `save_checkpoint()` read every table, Keras's fit resets and
reads its metrics, callbacks write checkpoints, a layer exports its rows. A
ps that died (or died and was started again) while no closure ran fails
such an access with TF's error, before any closure could report the loss.
`on_ps` runs the access through the strategy's coordinator access
(`psclient._core.ps_access`): the loss is reported to the recovery, the
access waits until the ps is restored from the newest checkpoint and runs
again; if the recovery gives up, `PSUnavailableError` chained to TF's error.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import tensorflow as tf

from psclient._coordinator.runtime import check_handle
from psclient._tf import executors as _executors

__all__ = ["check_every_ps", "on_ps", "settled"]

T = TypeVar("T")


def on_ps(strategy, access: Callable[[], T], what: str, *, wait: bool = True) -> T:
    """`access()` through a ps loss (module doc); as is without a strategy or while building a graph.

    `what` names the access in the error ("reading the metrics of 'model'").
    Tensors in the result are read inside, so a remote error surfaces there.
    `wait=False`: a lost ps is reported to the recovery and `PSUnavailableError` raised at once.
    """
    if strategy is None or not tf.executing_eagerly():
        return access()  # in a graph nothing runs here: the closure that runs it has its own handling
    return strategy.parts.engine.coordinator_access.run(lambda: _on_own_executor(access), what, wait=wait)


def _on_own_executor(access: Callable[[], T]) -> T:
    """`settled(access())` through this thread's own executor (`executors.on_thread_executor`): on
    TF's shared default one, in a seeded chaos plan (seed 500), a dynamic table's stats read made
    by another thread while its function was not yet registered on a ps failed a `fit`'s metric
    read with that error ("'__inference__stats_values_...' is neither a type of a primitive
    operation nor a name of a function registered", `[Op:DivNoNan]`)."""
    with _executors.on_thread_executor():
        return settled(access())  # read inside: the reads go through it too


def settled(result):
    """`result`, its eager tensors read (a remote read's error surfaces at once)."""
    for value in tf.nest.flatten(result):
        if isinstance(value, tf.Tensor) and hasattr(value, "numpy"):
            value.numpy()
    return result


def check_every_ps(strategy, what: str) -> None:
    """One shape op on a variable of each ps task (no data moves), through a ps loss.

    What fit, evaluate and predict do first: a ps lost since the last call
    (nothing ran to notice it) is then restored before the call sends any
    closure or reads anything, whichever of its reads would have met it first.
    """
    def check() -> None:
        for variable in strategy.parts.store.one_per_ps().values():
            check_handle(variable)

    on_ps(strategy, check, what)
