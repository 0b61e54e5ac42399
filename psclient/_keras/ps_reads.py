"""Keras's reads and writes of a cluster model's ps variables on the coordinator, through a ps loss.

Keras's fit resets the metrics at each epoch's start and reads them for the
epoch's logs (`get_metrics_result`, which its `_get_metrics_result_or_logs`
calls), on the coordinator: no scheduled closure, so a ps lost right before
one of them failed fit with TF's error. During psclient's fit and evaluate,
the model's `reset_metrics` and `get_metrics_result` (the user's overrides
included) go through the strategy's coordinator access: a lost ps is
reported to the recovery, the access waits until the ps is restored and runs
again, or raises `PSUnavailableError` if the recovery gives up
(`psclient._core.ps_access`). A user's own callback that reads weights on the
coordinator during the outage still gets TF's error.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Callable, TypeVar

import tensorflow as tf

from psclient._coordinator.ps_state import on_ps
from psclient._core.errors import PSUnavailableError

__all__ = ["guarded", "metrics_through_ps_loss", "restore_cause"]

T = TypeVar("T")

#: The model methods guarded during fit and evaluate, with what they do (for errors).
_METHODS = types.MappingProxyType(
    {"reset_metrics": "resetting the metrics", "get_metrics_result": "reading the metrics"})


def guarded(strategy, access: Callable[[], T], what: str) -> T:
    """`access()` through a ps loss; as is while tracing (a traced read runs in a closure)."""
    return on_ps(strategy, access, what)


def _metrics_device(model) -> str | None:
    """The device of the model's first metric variable (a ps), where Keras's metric results are
    computed during fit and evaluate; None (no device) for a model without metric variables.

    Computed on the coordinator, a result's first op of a new kind (a `divide_no_nan`) would be
    registered by TF on every task of the cluster with a blocking RPC each, so a hung worker
    held the epoch's end until it answered. An op placed on a remote device is not registered
    anywhere else; only its result comes back.
    """
    for variable in model.metrics_variables:
        device = getattr(getattr(variable, "value", variable), "device", None)
        if device:
            return device
    return None


def restore_cause(error: BaseException) -> None:
    """A `PSUnavailableError` from inside Keras's fit chained to TF's error again.

    Keras's traceback filter re-raises `from None`, which drops `__cause__`
    but keeps `__context__` (the same TF error here)."""
    if isinstance(error, PSUnavailableError) and error.__cause__ is None and error.__context__ is not None:
        error.__cause__ = error.__context__


@contextlib.contextmanager
def metrics_through_ps_loss(model, strategy):
    """While inside: the model's metric resets and reads go through `guarded` (module doc)."""
    own = vars(model)
    if any(name in own for name in _METHODS):  # already inside (fit's validation evaluate)
        yield
        return
    for name, what in _METHODS.items():
        stock = getattr(model, name)  # bound: the user's override included

        @functools.wraps(stock)
        def method(*args, _stock=stock, _what=f"{what} of {model.name!r}", **kwargs):
            # Eager reads only: a traced step's reads stay where its trace puts them.
            device = _metrics_device(model) if tf.executing_eagerly() else None
            with tf.device(device) if device else contextlib.nullcontext():
                return guarded(strategy, lambda: _stock(*args, **kwargs), _what)

        own[name] = method  # an instance attribute: Keras's tracking need not see it
    try:
        yield
    finally:
        for name in _METHODS:
            own.pop(name, None)
