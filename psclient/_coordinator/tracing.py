"""Turning what the user schedules into what a dispatcher calls.

A scheduled function is traced once per input signature, on the coordinator,
when it is scheduled (so argument mismatches raise `TypeError` at once).
Tracing happens inside the strategy's variable creator, so variables made on
a first trace (an optimizer building its slots) land on ps tasks too.

After a ps task is rebuilt its variables have new resources, and every function traced before
captured the old ones. `retrace` then starts a new *generation*: functions are traced again from
their Python code (a fresh `tf.function` per original), and queued closures get the new traces
(`renew` does the same for a function whose registration never reached a worker).

Finding the trace for a call costs the coordinator more CPU than making the call (TF canonicalises
and hashes every argument's type): about a third of `model.fit`'s coordinator time at one step per
call, profiled with py-spy. Most programs schedule the same function with the same argument objects
again and again (a per-worker iterator, a cached count), so when every argument is a per-worker
value, an eager tensor or an immutable scalar, the trace is cached by the identity of those objects:
a repeated call skips TF's lookup, on the coordinator and on the worker's dispatcher thread. Anything
else (nested structures, mutable Python objects, variables) takes TF's own lookup.
"""

from __future__ import annotations

import collections
import inspect
import logging
import os
import sysconfig
import threading
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator import runtime as _runtime
from psclient._coordinator.completion import WaitedCalls
from psclient._coordinator.data.per_worker import PerWorker, has_per_worker, resolve_per_worker
from psclient._core.future import Future
from psclient._core.closure import Closure
from psclient._tf.functions import fresh_tf_function

__all__ = ["Tracer", "reject_futures", "warn_unless_scheduling"]

log = logging.getLogger("psclient")

#: depth > 0 while this thread traces a function given to schedule().
_scheduling = threading.local()


def reject_futures(args: tuple, kwargs: dict, name: str) -> None:
    """Refuse a psclient Future among a schedule() call's arguments."""
    # A future's value exists only once its call finished, on the coordinator;
    # TF's coordinator refuses its RemoteValue as an input the same way.
    for value in tf.nest.flatten((args, kwargs)):
        if isinstance(value, Future):
            raise ValueError(
                f"Invalid value for argument `args`/`kwargs` of schedule({name!r}). Received: "
                f"{value!r}, the result of an earlier schedule(). Expected tensors, Python values "
                "or per-worker values: a scheduled call's result cannot be an input of another "
                "(TF's coordinator does not support RemoteValue inputs either). Wait for it "
                "and pass its value: future.result() (or coordinator.fetch(future))."
            )


def warn_unless_scheduling(method: str) -> None:
    """Log TF's warning for run/reduce called outside a function being scheduled."""
    # TF's parameter-server strategy says the same when run/reduce execute
    # outside the tracing of a function given to schedule().
    if not getattr(_scheduling, "depth", 0):
        log.warning(
            "ParameterServerStrategy.%s() is invoked without using `ClusterCoordinator.schedule` "
            "(or strategy.schedule). If you are not tracing a tf.function, this runs on the "
            "coordinator, which can be slow. To run on workers, call run/reduce inside a "
            "function passed to schedule().", method,
        )


class Tracer:
    def __init__(self, create_variable: Callable, steps: Any = None, *, wait_for_run: bool = False):
        self._create_variable = create_variable
        # Above pipeline depth 1 a call returns once sent: make each wait until it ran (completion.py).
        self._waited = WaitedCalls() if wait_for_run else None
        # `psclient._coordinator.training.sync.Steps`: a function that applies gradients is
        # traced instrumented (its model versions reported), others plainly.
        self._steps = steps
        # Plain callables wrapped in a tf.function once, so their traces are reused.
        self._wrapped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._fresh: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._signatures: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._checked: set[int] = set()
        self._warned_variables: set[str] = set()
        self.generation = 0
        # (function, generation, argument identities) -> _Trace; see the module doc.
        self._by_identity: collections.OrderedDict = collections.OrderedDict()
        #: Held while a closure is traced and queued, and while a generation turns.
        self.lock = threading.RLock()

    def as_function(self, fn) -> tuple[Any, str]:
        """`fn` as something TF can trace, and its name for messages."""
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

    def with_defaults(self, function, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """`args` and `kwargs` with the Python defaults of `function` filled in.

        The dispatcher calls traced (concrete) functions, which take every
        argument explicitly; the tf.function itself would have applied them.
        """
        if isinstance(function, tf.types.experimental.ConcreteFunction):
            return args, kwargs
        signature = self._signatures.get(function, False)
        if signature is False:
            try:
                signature = inspect.signature(function.python_function)
            except (AttributeError, TypeError, ValueError):
                signature = None
            if not any(p.default is not p.empty for p in getattr(signature, "parameters", {}).values()):
                signature = None
            self._signatures[function] = signature
        if signature is None:
            return args, kwargs
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return args, kwargs  # tracing raises the argument mismatch, naming the function
        bound.apply_defaults()
        return tuple(bound.args), dict(bound.kwargs)

    def ready_closure(self, fn: Callable, args: Any, kwargs: Any, *, before_trace: Callable[[], None],
                      submit: Callable[[Closure], None], guard: Callable | None = None) -> Closure:
        """`fn(*args, **kwargs)` as a closure ready to run, given to `submit` and returned.

        Checks the call (argument mismatches raise TypeError here), calls
        `before_trace()` (the strategy checkpoints new variables there), then
        traces it for the current variables and submits it under this
        tracer's lock: a ps recovery retraces what is queued under the same
        lock, so no closure is traced for variables that are gone. If no
        worker could build a per-worker argument, the closure fails with that
        input error when it runs (as in TF: `join()` raises it).

        `guard(attempt, what)` runs the checkpoint and the trace through a ps
        loss (`psclient._core.ps_access`): a trace reads ps state eagerly
        (a dynamic table's slots), and a ps lost while nothing ran fails
        that read. The attempt is made again whole, once the recovery has
        restored the ps; the wait is outside this tracer's lock, which the
        recovery's retrace takes. What `submit` refuses (an earlier
        function's error, a strategy shut down) is raised, never retried.
        """
        function, name = self.as_function(fn)
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"Invalid value for argument `args`. Received: args={args!r} of type "
                f"{type(args).__name__}. Expected a tuple or list of positional arguments."
            )
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise TypeError(
                f"Invalid value for argument `kwargs`. Received: kwargs={kwargs!r} of type "
                f"{type(kwargs).__name__}. Expected a mapping of keyword arguments or None."
            )
        args, kwargs = self.with_defaults(function, tuple(args), dict(kwargs or {}))
        reject_futures(args, kwargs, name)
        closure = Closure(None, args, kwargs, Future(name))
        closure.per_worker = has_per_worker(args, kwargs)  # only walk the arguments when needed
        closure.function = function

        def attempt() -> BaseException | None:
            before_trace()
            with self.lock:
                try:
                    self.prepare(closure)
                except _runtime.closure_input_error_type() as error:
                    closure.fn, closure.generation = _raise(error), self.generation
                try:
                    submit(closure)
                except Exception as refusal:  # noqa: BLE001 - the scheduler's, raised below: outside the guard
                    return refusal
            return None

        refused = attempt() if guard is None else guard(attempt, f"tracing {name!r} for schedule()")
        if refused is not None:
            raise refused
        return closure

    def prepare(self, closure: Closure) -> None:
        """Set `closure.fn`: what a dispatcher calls, traced for the current variables.

        Without per-worker arguments the traced (concrete) function is called
        directly. With them, each worker's values need their trace: tensor-like
        ones (iterators) share one, Python-object resources (e.g. lookup
        tables) get one each. Arguments that qualify for the identity cache
        (module doc) find it there, per worker; others go through the
        tf.function's own lookup on every call.
        """
        self._prepare(closure)
        closure.generation = self.generation  # only once traced: a trace that raised is tried again

    def _prepare(self, closure: Closure) -> None:
        function = closure.function
        if self.generation and not isinstance(function, tf.types.experimental.ConcreteFunction):
            function = self._fresh_function(function)
        key = _identity_key(closure.args, closure.kwargs)
        if key is not None:
            key = (id(function), self.generation, key)
            known = self._by_identity.get(key)
            if known is not None and known.matches(function, closure.args, closure.kwargs):
                self._by_identity.move_to_end(key)
                closure.fn = known.call
                return
        args, kwargs = closure.args, closure.kwargs
        if closure.per_worker:
            # Traced with type specs (or a built value): a worker out of rotation is not needed.
            args, kwargs = resolve_per_worker(args, kwargs, None)
        concrete = self._trace(function, closure.name, args, kwargs)
        if key is None:
            if closure.per_worker:
                # TF's lookup on every call; instrumented or waited, psclient's (a trace per signature).
                closure.fn = function if self._steps is None and self._waited is None else \
                    _Retracing(self._trace, function, closure.name)
            else:
                closure.fn = concrete
            return
        if closure.per_worker:
            # Each worker's values (its iterator, its table) get their own
            # trace, looked up by their identity on the dispatcher thread.
            # The name, not the closure: the cache must not keep its result alive.
            name = closure.name
            known = _Trace(function, closure.args, closure.kwargs, _PerWorkerTraces(
                lambda a, k: self._trace(function, name, a, k)))
        else:
            known = _Trace(function, closure.args, closure.kwargs, concrete)
        self._by_identity[key] = known
        while len(self._by_identity) > _MAX_REMEMBERED:
            self._by_identity.popitem(last=False)
        closure.fn = known.call

    def current(self, closure: Closure) -> bool:
        """Trace `closure` again if it was traced before the latest `retrace`; whether it was.

        `retrace` traces what is queued. A closure out of the queue then and back in it
        later, by any path, must not run its old trace (it names the resources of the ps
        recovered since): a dispatcher asks here before each call, an integer compare."""
        if closure.generation == self.generation or closure.function is None \
                or isinstance(closure.function, tf.types.experimental.ConcreteFunction):
            return False
        with self.lock:
            if closure.generation == self.generation:
                return False
            try:
                self.prepare(closure)
            except _runtime.closure_input_error_type() as error:
                closure.fn, closure.generation = _raise(error), self.generation
        return True

    def renew(self, closure: Closure) -> bool:
        """Trace `closure` anew, under a new name, in a new generation (its registration never reached a
        worker: TF sends a function only once); False for a concrete function, which cannot be."""
        if closure.function is None or isinstance(closure.function, tf.types.experimental.ConcreteFunction):
            return False
        self.retrace([closure])  # the others are traced again as they reach a worker (`current`)
        return True

    def retrace(self, queued: list[Closure]) -> None:
        """Start a new generation and trace the queued closures again."""
        with self.lock:
            self.generation += 1
            self._by_identity.clear()
            for closure in queued:
                self.prepare(closure)

    # ---------------------------------------------------------------- private
    def _fresh_function(self, function):
        cached = self._fresh.get(function)
        if cached is None or cached[0] != self.generation:
            fresh = fresh_tf_function(function)
            cached = (self.generation, fresh)
            self._fresh[function] = cached
        return cached[1]

    def _trace(self, function, name: str, args: tuple, kwargs: dict):
        """What to call for these arguments: a concrete function, or (instrumented) its caller."""
        steps = self._steps
        if isinstance(function, tf.types.experimental.ConcreteFunction):
            concrete = function
            if steps is not None:
                steps.check_concrete(concrete, name)
        else:
            # Asynchronous (staleness only measured): a function is traced
            # plainly until one of its traces applies gradients, from then on
            # instrumented; so one that never applies (evaluation, a dataset
            # step) is traced once, as by TF, and a training step twice at its
            # first schedule() only. With max_staleness/replicas_to_aggregate
            # the instrumented trace comes first: it also refuses what those
            # modes cannot follow (an extended.update outside an optimizer).
            if steps is not None and (steps.argument is not None or steps.known_to_apply(function)):
                call = self._instrumented_call(function, name, args, kwargs)
                if call is not None:
                    return call
            concrete = self._concrete(function, name, args, kwargs)
            if steps is not None and steps.applied_untracked(concrete):
                steps.mark_applies(function)
                call = self._instrumented_call(function, name, args, kwargs)
                if call is not None:
                    return call
        self._check(concrete, name)
        return concrete if self._waited is None else self._waited.caller(concrete, name, args, kwargs, self._concrete)

    def _instrumented_call(self, function, name: str, args: tuple, kwargs: dict):
        """The caller of `function`'s instrumented trace, or None if that trace applies nothing."""
        steps = self._steps
        steps.start_trace()
        concrete = self._concrete(steps.instrumented(function), name, args, kwargs)
        if not steps.applies(concrete):
            return None
        self._check(concrete, name)
        call = getattr(concrete, "_psclient_call", None)
        if call is None:
            call = concrete._psclient_call = steps.caller(concrete)
        return call

    def _concrete(self, function, name: str, args: tuple, kwargs: dict):
        from psclient._coordinator.training.sync import UnsupportedStep

        # Traced as TF's coordinator does: inside the strategy's variable
        # creator and in a cross-replica context (strategy.run in the
        # function enters the replica's).
        _scheduling.depth = getattr(_scheduling, "depth", 0) + 1
        try:
            with tf.variable_creator_scope(self._create_variable), _runtime.cross_replica_context(), \
                    _runtime.streamed_registrations():
                return function.get_concrete_function(*args, **kwargs)
        except UnsupportedStep:
            raise  # says what is wrong with the function itself
        except (TypeError, ValueError) as error:
            if _raised_by_traced_code(error):
                # The function's own code (a Keras layer given the wrong shape...): its error, as
                # a local call raises it, not one about schedule()'s arguments.
                error.add_note(f"(raised while {name!r} was traced for schedule())")
                raise
            raise TypeError(
                f"The arguments given to schedule() do not match {name!r}: {error}"
            ) from error
        finally:
            _scheduling.depth -= 1

    def _check(self, concrete, name: str) -> None:
        if id(concrete) not in self._checked:
            self._checked.add(id(concrete))
            self._warn_unplaced_variables(concrete, name)

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
                stacklevel=6,
            )


# ------------------------------------------------- traces by argument identity
_MAX_REMEMBERED = 64
_SCALARS = (int, float, bool, str, bytes, type(None))


def _raise(error: BaseException) -> Callable:
    def fail(*_args, **_kwargs):
        raise error

    return fail


def _cacheable(value) -> bool:
    # Eager tensors are immutable; per-worker values resolve per worker (and
    # are looked up again by identity there); scalars are compared by identity
    # while held. A variable, a list or an object could change under the same
    # identity, and TF traces them by what they hold.
    return isinstance(value, (PerWorker, _SCALARS)) or (isinstance(value, tf.Tensor) and hasattr(value, "numpy"))


def _identity_key(args: tuple, kwargs: dict) -> tuple | None:
    if not all(map(_cacheable, args)) or not all(map(_cacheable, kwargs.values())):
        return None
    return _ids(args, kwargs)


def _ids(args: tuple, kwargs: dict) -> tuple:
    return tuple(map(id, args)) + tuple((name, id(value)) for name, value in sorted(kwargs.items()))


def _holder(value) -> Callable[[], Any]:
    """A reference to `value` that does not keep tensors and iterators alive."""
    try:
        return weakref.ref(value)
    except TypeError:  # scalars: held, which keeps their identity unique
        return lambda: value


class _Holds:
    """The argument objects a cached trace was made for, without owning them."""

    def __init__(self, args: tuple, kwargs: dict):
        self._args = [_holder(a) for a in args]
        self._kwargs = {name: _holder(v) for name, v in kwargs.items()}

    def same(self, args: tuple, kwargs: dict) -> bool:
        # An id can be reused once its object is gone: compare the objects.
        return (
            len(args) == len(self._args)
            and all(held() is a for held, a in zip(self._args, args))
            and kwargs.keys() == self._kwargs.keys()
            and all(self._kwargs[name]() is v for name, v in kwargs.items())
        )


class _Trace:
    """A trace remembered for one function and one set of argument objects."""

    def __init__(self, function, args: tuple, kwargs: dict, call: Callable):
        self._function = weakref.ref(function)
        self._holds = _Holds(args, kwargs)
        self.call = call

    def matches(self, function, args: tuple, kwargs: dict) -> bool:
        return self._function() is function and self._holds.same(args, kwargs)


class _Retracing:
    """Calls `function` through `trace(function, name, args, kwargs)` on every call."""

    def __init__(self, trace: Callable, function, name: str):
        self._trace, self._function, self._name = trace, function, name

    def __call__(self, *args, **kwargs):
        return self._trace(self._function, self._name, args, kwargs)(*args, **kwargs)


class _PerWorkerTraces:
    """Calls with one worker's values, through a trace per set of those values."""

    def __init__(self, trace: Callable[[tuple, dict], Any]):
        self._trace = trace
        self._traces: dict[tuple, tuple[_Holds, Any]] = {}
        self._lock = threading.Lock()  # pipeline_depth threads per worker call at once

    def __call__(self, *args, **kwargs):
        # The other arguments passed _cacheable when scheduled; what the
        # per-worker ones resolved to (iterators, datasets, resources) was
        # built by psclient and is only ever replaced, never changed.
        key = _ids(args, kwargs)
        with self._lock:
            known = self._traces.get(key)
        if known is None or not known[0].same(args, kwargs):
            known = (_Holds(args, kwargs), self._trace(args, kwargs))
            with self._lock:
                self._traces[key] = known
                while len(self._traces) > _MAX_REMEMBERED:
                    self._traces.pop(next(iter(self._traces)))
        return known[1](*args, **kwargs)


_NOT_TRACED_CODE = tuple(os.path.dirname(path) + os.sep for path in (tf.__file__, __file__)) + (
    sysconfig.get_paths()["stdlib"] + os.sep,)


def _raised_by_traced_code(error: BaseException) -> bool:
    """Whether `error` came from the traced function's body (a frame of its code, Keras's, or
    autograph's conversion of it), not from TF's binding of the arguments (TF's and the standard
    library's frames only, below this module's)."""
    frame = error.__traceback__
    while frame is not None:
        if not os.path.abspath(frame.tb_frame.f_code.co_filename).startswith(_NOT_TRACED_CODE):
            return True
        frame = frame.tb_next
    return False

