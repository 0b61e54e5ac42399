"""Calls of functions whose registration on a task has not arrived, or never will.

TF registers a function on every task at its first reference in the process; with streamed
registrations (`executors.streamed_function_registrations`) a call can overtake it (retried:
`until_registered`), and in a seeded chaos plan one never arrived (traced again: `RegisteredCall`,
`Renewable`, the `remake` of `until_registered`).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Callable

import tensorflow as tf

__all__ = ["ATTEMPTS", "Renewable", "RegisteredCall", "function_not_registered_yet", "until_registered"]

#: Calls made while a function's registration is on its way, with pauses growing to 0.5 s: about 10 s.
ATTEMPTS = 25


def until_registered(build: Callable[[], Any], attempts: int | None = None,
                     remake: Callable[[], None] | None = None) -> Any:
    """`build()`, made again (bounded: about 10 s) while the worker does not know
    a function yet (`function_not_registered_yet`): a per-worker value built
    right after its dataset function was traced can overtake the registration.

    `remake`: drops the caller's trace of the function, so that `build()` traces a new one. Given,
    a task still not knowing the function once the attempts are spent is taken for a registration
    lost on its way (see `RegisteredCall`): `remake()`, then `build()` tried as many times again.
    """
    attempts = ATTEMPTS if attempts is None else attempts
    try:
        return _tried(build, attempts)
    except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as error:
        if remake is None or not function_not_registered_yet(error):
            raise
        logging.getLogger("psclient").warning(
            "a function psclient made never reached a task (%s); tracing it again", str(error).splitlines()[0])
    remake()
    return _tried(build, attempts)


def _tried(build: Callable[[], Any], attempts: int) -> Any:
    for attempt in range(attempts):
        try:
            return build()
        except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as error:
            if attempt + 1 == attempts or not function_not_registered_yet(error):
                raise
        time.sleep(min(0.5, 0.01 * 2 ** attempt))
    raise AssertionError("unreachable")


class RegisteredCall:
    """A call of the function `make()` returns, through `until_registered`; once a task still does not
    know it after the attempts, made again (a new trace, registered afresh on every task) and called.
    `function`: the function now called (None before the first call).

    A registration can be lost on its way: in a seeded chaos plan a shard's stats function never
    reached two ps tasks (a worker was dropped from TF's view and another ps restarted in the same
    second), and every later call of it failed with "not registered" (a `ServingExport` delta, then
    the `fit`). TF sends a function to the tasks only at its first reference in the process, so the
    same function cannot be sent again; a new trace of it is."""

    def __init__(self, make: Callable[[], Callable[[], Any]], attempts: int | None = None):
        self._make, self._attempts = make, attempts
        self.function: Callable[[], Any] | None = None

    def __call__(self) -> Any:
        if self.function is None:
            self.function = self._make()
        return until_registered(lambda: self.function(), self._attempts, remake=self._renew)

    def _renew(self) -> None:
        self.function = self._make()


class Renewable:
    """`tf.function(python_function, **options)`, made anew by `renew()`: a new trace, under a new
    name, which TF registers afresh on every task (the `remake` of `until_registered` for a
    module's own traced function). `tracing_count()`: the traces of every one made so far."""

    def __init__(self, python_function: Callable, **options: Any):
        self._python_function, self._options, self._earlier_traces = python_function, options, 0
        self.function = tf.function(python_function, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    def get_concrete_function(self, *args: Any, **kwargs: Any) -> Any:
        return self.function.get_concrete_function(*args, **kwargs)

    def renew(self) -> None:
        self._earlier_traces += self.function.experimental_get_tracing_count()
        self.function = tf.function(self._python_function, **self._options)

    def tracing_count(self) -> int:
        return self._earlier_traces + self.function.experimental_get_tracing_count()


def function_not_registered_yet(error: BaseException) -> bool:
    """Whether a call failed because its function's registration had not reached the worker yet.

    Registrations travel down each task's stream without being waited for
    (see `connect`); a dispatcher's call travels its own way and can arrive first.
    """
    if isinstance(error, tf.errors.NotFoundError):
        return _NOT_REGISTERED.search(str(error)) is not None
    # A function the called one calls (a conditional's branch) that has not arrived yet: the
    # worker finds the call's function, then fails building its graph with InvalidArgumentError
    # (a seeded chaos plan: a step's first call on a rejoined worker failed for good so).
    return isinstance(error, tf.errors.InvalidArgumentError) and _NOT_REGISTERED_INSIDE.search(str(error)) is not None


# The worker looks the call up as an op type (TF's OpRegistry: "Op type not
# registered '<function>' in binary running on ...", or in TF 2.21 "'<function>'
# is neither a type of a primitive operation nor a name of a function
# registered in binary ...") or in its function library ("Unable to find
# Function(Def) with name: ...").
_OP_NOT_REGISTERED = (r"Op type not registered '"
                      r"|is neither a type of a primitive operation nor a name of a function registered")
_NOT_REGISTERED = re.compile(_OP_NOT_REGISTERED + r"|Unable to find Function(?:Def)? (?:with name:|for )")
# A function that the called one calls, as the worker words it when it builds the call's graph.
_NOT_REGISTERED_INSIDE = re.compile(_OP_NOT_REGISTERED)
