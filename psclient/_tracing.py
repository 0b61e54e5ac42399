"""Turning what the user schedules into what a dispatcher calls.

A scheduled function is traced once per input signature, on the coordinator,
when it is scheduled (so argument mismatches raise `TypeError` at once).
Tracing happens inside the strategy's variable creator, so variables made on
a first trace (an optimizer building its slots) land on ps tasks too.

After a ps task is rebuilt its variables have new resources, and every
function traced before captured the old ones. `retrace` then starts a new
*generation*: functions are traced again from their Python code (a fresh
`tf.function` per original), and queued closures get the new traces.
"""

from __future__ import annotations

import inspect
import threading
import warnings
import weakref
from typing import Any, Callable

from psclient import _runtime
from psclient._per_worker import resolve_per_worker
from psclient._scheduler import Closure

__all__ = ["Tracer"]


class Tracer:
    def __init__(self, create_variable: Callable):
        self._create_variable = create_variable
        # Plain callables wrapped in a tf.function once, so their traces are reused.
        self._wrapped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._fresh: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._checked: set[int] = set()
        self._warned_variables: set[str] = set()
        self.generation = 0
        #: Held while a closure is traced and queued, and while a generation turns.
        self.lock = threading.RLock()

    def as_function(self, fn) -> tuple[Any, str]:
        """`fn` as something TF can trace, and its name for messages."""
        import tensorflow as tf

        if not callable(fn):
            raise TypeError(
                f"Invalid value for argument `fn`. Received: fn={fn!r} of type "
                f"{type(fn).__name__}. Expected a tf.function or a Python callable."
            )
        name = getattr(fn, "__name__", None) or getattr(fn, "name", None) or type(fn).__name__
        if isinstance(fn, (tf.types.experimental.PolymorphicFunction, tf.types.experimental.ConcreteFunction)):
            return fn, name
        owner, key = (fn.__self__, fn.__func__) if inspect.ismethod(fn) else (fn, None)
        try:
            cache = self._wrapped.setdefault(owner, {})
        except TypeError:  # not weak-referenceable: wrap anew (and retrace)
            return tf.function(fn), name
        if key not in cache:
            cache[key] = tf.function(fn)
        return cache[key], name

    def prepare(self, closure: Closure) -> None:
        """Set `closure.fn`: what a dispatcher calls, traced for the current variables.

        Without per-worker arguments the traced (concrete) function is called
        directly. With them, each worker's call goes through the tf.function,
        whose cache maps tensor-like values (iterators) to the same trace and
        Python-object resources (e.g. lookup tables) to one trace each.
        """
        import tensorflow as tf

        function = closure.function
        if self.generation and not isinstance(function, tf.types.experimental.ConcreteFunction):
            function = self._fresh_function(function)
        args, kwargs = closure.args, closure.kwargs
        if closure.per_worker:
            args, kwargs = resolve_per_worker(args, kwargs, 0)
        concrete = self._trace(function, closure.name, args, kwargs)
        closure.fn = function if closure.per_worker else concrete

    def retrace(self, queued: list[Closure]) -> None:
        """Start a new generation and trace the queued closures again."""
        with self.lock:
            self.generation += 1
            for closure in queued:
                self.prepare(closure)

    # ---------------------------------------------------------------- private
    def _fresh_function(self, function):
        import tensorflow as tf

        cached = self._fresh.get(function)
        if cached is None or cached[0] != self.generation:
            fresh = tf.function(
                function.python_function,
                input_signature=function.input_signature,
                reduce_retracing=getattr(function, "_reduce_retracing", False),
                jit_compile=getattr(function, "_jit_compile", None),
            )
            cached = (self.generation, fresh)
            self._fresh[function] = cached
        return cached[1]

    def _trace(self, function, name: str, args: tuple, kwargs: dict):
        import tensorflow as tf

        if isinstance(function, tf.types.experimental.ConcreteFunction):
            concrete = function
        else:
            try:
                with tf.variable_creator_scope(self._create_variable):
                    concrete = function.get_concrete_function(*args, **kwargs)
            except (TypeError, ValueError) as error:
                raise TypeError(
                    f"The arguments given to schedule() do not match {name!r}: {error}"
                ) from error
        if id(concrete) not in self._checked:
            self._checked.add(id(concrete))
            self._warn_unplaced_variables(concrete, name)
        return concrete

    def _warn_unplaced_variables(self, concrete, name: str) -> None:
        for variable in getattr(concrete, "variables", ()):
            if _runtime.ps_index_of(variable.device) is not None or variable.name in self._warned_variables:
                continue
            self._warned_variables.add(variable.name)
            warnings.warn(
                f"Variable {variable.name!r} used by scheduled function {name!r} was created "
                f"outside strategy.scope() and lives on {variable.device or 'the coordinator'}; "
                "every step reads and writes it there. Create it inside strategy.scope() to "
                "place it on a parameter server.",
                stacklevel=5,
            )
