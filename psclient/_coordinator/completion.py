"""Calls that return only once their function has run, at pipeline depth above 1.

Above depth 1 dispatchers call through TF's streaming enqueue, where a call
returns once it is *sent*: its output tensors are handles that become ready
when the worker answers, after the whole function ran (its stateful ops
included: a function's outputs come back only when every op of it has
finished). A function without tensor outputs gave nothing to wait for, so it
counted as done before it ran: 300 calls of a function that only did
`v.assign_add(1)`, then `join()`, left `v` at 74 in a test here, and the
coordinator crashed when the process exited.

So each call waits for its outputs to be ready (reading a remote tensor's
shape waits for the worker's answer without copying the tensor; measured:
the shape read took the function's run time, the copy after it 1 ms), and a
function without tensor outputs is traced once more, wrapped, with a scalar
output to wait for. A function's error then surfaces at that wait, inside
the dispatcher's call, as at depth 1.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import tensorflow as tf

from psclient._tf.executors import unregistered_executor

__all__ = ["WaitedCalls"]


class WaitedCalls:
    """Makes a traced function's call wait until the worker ran it (one per tracer)."""

    def __init__(self):
        self._lock = threading.Lock()

    def caller(self, concrete, name: str, args: tuple, kwargs: dict,
               concrete_of: Callable[[Any, str, tuple, dict], Any]) -> Callable:
        """What a dispatcher calls instead of `concrete`, traced for `args`, `kwargs`
        (`name`: the scheduled function's, for messages; `concrete_of(function, name,
        args, kwargs)`: traces the marked wrapper the tracer's way, in its variable
        creator and with its registrations streamed)."""
        # Kept on the concrete function (as sync.py keeps its caller): the
        # caller holds it, so a table beside it would keep every trace alive.
        known = getattr(concrete, "_psclient_waited", None)
        if known is not None:
            return known
        with self._lock:
            known = getattr(concrete, "_psclient_waited", None)
            if known is None:
                if concrete.outputs:
                    known = _Waited(concrete, marked=False)
                else:
                    known = _Waited(concrete_of(_marked(concrete), name, args, kwargs), marked=True)
                concrete._psclient_waited = known
            return known


def _marked(concrete):
    """A tf.function calling `concrete` and returning (its outputs, a scalar)."""

    def marked(*args, **kwargs):
        # The scalar comes back with the call's answer, which TF sends once
        # every op of the function (the call of `concrete` included) has run.
        return concrete(*args, **kwargs), tf.constant(True)

    return tf.function(marked, autograph=False)


class _Waited:
    """Calls a concrete function and waits until its outputs are ready."""

    __slots__ = ("concrete", "_marked")

    def __init__(self, concrete, *, marked: bool):
        self.concrete = concrete
        self._marked = marked

    def __call__(self, *args, **kwargs):
        outputs = self.concrete(*args, **kwargs)
        if self._marked:
            outputs, marker = outputs
            _wait(marker)
            return outputs
        # Expanded: a sparse or ragged output's components are the tensors to wait for.
        for value in tf.nest.flatten(outputs, expand_composites=True):
            if isinstance(value, tf.Tensor):
                _wait(value)  # one is enough: every output comes back in the same answer
                break
        return outputs


def _wait(tensor) -> None:
    # A remote output's shape is known once the worker answered (its error, if
    # the function failed, is raised here). Waited for outside the thread's
    # executor, on which the call is pending until then: an answer that never
    # comes must not hold up TF's cache clearing (`unregistered_executor`).
    with unregistered_executor():
        tensor.shape  # noqa: B018 - read for its wait
