"""Model versions, staleness, `max_staleness` and `replicas_to_aggregate`.

One int64 counter on ps 0, the model *version*, orders every update. A
scheduled function that applies gradients with a Keras optimizer (its
`apply`/`apply_gradients`, directly or in Keras's `train_step`) is traced a
second way, *instrumented* (`Steps.instrumented`):

- its first op reads the version on ps 0 (`start`), and every variable read
  of the step waits for that read, so the weights it reads are at least that new;
- the optimizer's apply is intercepted (the Keras seam calls
  `current_step().apply(...)`), and the function returns, besides its own
  result, a small report `[start, version, outcome]` that the dispatcher
  thread strips off (`Steps.caller`) before the future gets the result.

Asynchronous (the default): at its apply, once its gradients exist, a step
takes a ticket, a fetch-and-add of the version on ps 0 (`ResourceCountUpTo`,
atomic under the variable's lock; `assign_add`'s value is a second read), and
then applies. Its staleness is `ticket - 1 - start`: the updates that took a
ticket between its read and its own. One ticket per step, however many
applies it makes. `max_staleness=s`: the apply runs under
`tf.cond(staleness <= s)`; a staler update is dropped (not re-run: a
straggler would compute it again as stale) and counted. A dropped update has
taken its ticket, so staleness counts it too: the bound is conservative.

Synchronous (`replicas_to_aggregate=k`): the gradients are copied to the ps
tasks of their accumulators first; then, inside a `tf.CriticalSection` on ps
0 whose every op runs on a ps task (a worker stopped mid-step never holds
it), a gradient computed on the current version is added to the
accumulators, and the k-th of a version applies their mean with the
optimizer's own apply (its `iterations` counts aggregated updates once),
zeroes them and bumps the version; a gradient of an older version is dropped
and counted. No worker waits on the ps: a worker waits only on the
coordinator, bounded, before its next step (`psclient._core.sync_gate`).

Steps that apply no gradient (evaluation) run their plain trace: not counted,
no extra op. Not instrumented (staleness not measured; with `max_staleness`
or `replicas_to_aggregate` an error naming the argument, `UnsupportedStep`):
an apply inside the function's own `tf.while_loop` or `tf.cond` (Keras fit
with `steps_per_execution` > 1, `LossScaleOptimizer`), a second apply in one
synchronous step, updates made through `tf.distribute`'s `extended.update`
outside a Keras optimizer (tf_keras optimizers), and a `ConcreteFunction`
given to `schedule`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator import runtime as _runtime
from psclient._coordinator.training.accumulators import Accumulators, internal_variable
from psclient._core.errors import PSClientError
from psclient._core.staleness import ACCUMULATED, APPLIED, DROPPED, StalenessStats
from psclient._core.sync_gate import SyncGate
from psclient._tf import variables as _variables

__all__ = ["Steps", "UnsupportedStep", "current_step", "note_update"]

log = logging.getLogger("psclient")

#: Ops that read a variable's value (or rows of it).
_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd"})
#: Ops that run a function (a loop, a branch, a call), which may read variables inside.
_CALLS = frozenset({"While", "If", "Case", "StatefulPartitionedCall", "PartitionedCall"})
_NO_LIMIT = 2**63 - 1  # ResourceCountUpTo's limit: never reached
_tracing = threading.local()  # .step: the _StepTrace this thread traces now; .last: the newest one


class UnsupportedStep(PSClientError, ValueError):
    """A scheduled function applies gradients in a way `max_staleness`/`replicas_to_aggregate` cannot follow."""

    # AutoGraph re-raises an error from converted code with its own type only
    # when that type's constructor is Exception's (else as a StagingError).
    __init__ = Exception.__init__


def current_step() -> "_StepTrace | None":
    """The instrumented step this thread is tracing for `schedule()`, or None."""
    return getattr(_tracing, "step", None)


def note_update() -> None:
    """An `extended.update` of a ps variable is being traced (the update placement calls this)."""
    step = current_step()
    if step is not None and not step.busy:
        step.outside_apply()


class Steps:
    """The strategy's versions, staleness statistics and synchronous state."""

    def __init__(self, scheduler: Any, max_staleness: int | None, replicas_to_aggregate: int | None,
                 *, timeout: float, measured: bool = True):
        # `scheduler`: the strategy's; a synchronous worker's wait ends when it
        # pauses or closes, and counts the workers it has up (SyncGate).
        #: Whether scheduled steps are instrumented (`measure_staleness`).
        self.measured = measured
        self.max_staleness = max_staleness
        self.replicas_to_aggregate = replicas_to_aggregate
        num_workers = len(scheduler.stats()["workers"])
        self.stats = StalenessStats(num_workers)
        self.gate = None if replicas_to_aggregate is None else SyncGate(
            num_workers, replicas_to_aggregate, timeout=timeout, is_up=scheduler.worker_is_up,
            interrupted=lambda: scheduler.paused or scheduler.closed)
        self._lock = threading.RLock()
        self._instrumented: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._applying: weakref.WeakSet = weakref.WeakSet()  # tf.functions whose traces applied
        self._version = None  # int64 ResourceVariable on ps 0, made on first use
        self._mutex = None  # the CriticalSection of synchronous mode
        self._accumulators: dict[tuple, Accumulators] = {}

    @property
    def argument(self) -> str | None:
        """The constructor argument that makes instrumentation mandatory, if any."""
        if self.replicas_to_aggregate is not None:
            return "replicas_to_aggregate"
        return None if self.max_staleness is None else "max_staleness"

    # ------------------------------------------------------------- tracing
    def instrumented(self, function):
        """`function` (a tf.function) traced again from its Python code, instrumented."""
        with self._lock:
            cached = self._instrumented.get(function)
            if cached is not None:
                return cached
        python_function = function.python_function
        enter = tf.autograph.experimental.do_not_convert(self._enter)
        finish = tf.autograph.experimental.do_not_convert(_finish)

        @functools.wraps(python_function)  # TF reads the signature through __wrapped__
        def step(*args, **kwargs):
            with enter() as trace:
                outputs = python_function(*args, **kwargs)
            return outputs, finish(trace)

        cached = tf.function(
            step,
            input_signature=function.input_signature,
            autograph=getattr(function, "_autograph", True),
            reduce_retracing=getattr(function, "_reduce_retracing", False),
            jit_compile=getattr(function, "_jit_compile", None),
        )
        with self._lock:
            return self._instrumented.setdefault(function, cached)

    def known_to_apply(self, function) -> bool:
        """Whether a trace of `function` (a tf.function) applied gradients before."""
        with self._lock:
            return function in self._applying

    def mark_applies(self, function) -> None:
        with self._lock:
            self._applying.add(function)

    @staticmethod
    def applied_untracked(concrete) -> bool:
        """Whether the plain trace `concrete` applies gradients with a Keras optimizer."""
        return concrete.graph in _applied_untracked

    def start_trace(self) -> None:
        _tracing.last = None

    def applies(self, concrete) -> bool:
        """Whether the instrumented trace `concrete` applies gradients (else its plain trace is used)."""
        last = getattr(_tracing, "last", None)
        _tracing.last = None
        if last is not None:  # traced just now on this thread: remember what it found
            _applies[concrete] = last.measured
        return _applies.get(concrete, False)

    def check_concrete(self, concrete, name: str) -> None:
        """A ConcreteFunction given to schedule() cannot be instrumented: refuse one that applies."""
        if self.argument is not None and concrete.graph in _applied_untracked:
            raise UnsupportedStep(
                f"Invalid value for argument `fn` of schedule({name!r}) with {self.argument}="
                f"{getattr(self, self.argument)!r}. Received: a ConcreteFunction that applies "
                "gradients. Expected a tf.function or a Python callable: psclient traces it again "
                f"to apply its gradients under {self.argument}."
            )

    def caller(self, concrete) -> Callable:
        """What a dispatcher calls: `concrete`, its report recorded and stripped off."""
        gate = self.gate

        def call(*args, **kwargs):
            worker = _runtime.current_worker()
            if gate is not None:
                gate.before(worker)
            try:
                outputs, report = concrete(*args, **kwargs)
                start, version, outcome = (int(x) for x in report.numpy())
            except BaseException:
                if gate is not None:
                    gate.abandon(worker)
                raise
            self._record(worker, start, version, outcome)
            return outputs

        call.concrete = concrete
        return call

    # ---------------------------------------------------------- statistics
    def summary(self) -> dict:
        summary = self.stats.summary()
        summary["measured"] = self.measured
        summary["max_staleness"] = self.max_staleness
        summary["replicas_to_aggregate"] = self.replicas_to_aggregate
        if self.gate is not None:
            summary["sync"] = self.gate.stats()
        return summary

    def _record(self, worker: int, start: int, version: int, outcome: int) -> None:
        stats = self.stats
        if self.gate is not None:
            self.gate.after(worker, version, outcome)
            stats.saw_version(version + (outcome == APPLIED))
            if outcome == DROPPED:
                stats.dropped(worker, version - start)
            else:
                stats.applied(worker, 0, update=outcome == APPLIED)
            return
        stats.saw_version(version)
        if outcome == APPLIED:
            stats.applied(worker, version - 1 - start)
        else:
            stats.dropped(worker, version - 1 - start)

    # ------------------------------------------------------ state on the ps
    def renew(self, lost_ps) -> None:
        """After ps tasks were rebuilt: make what lived there again (the traces follow)."""
        with self._lock:
            if 0 in lost_ps:
                self._version = self._mutex = None
            self._accumulators.clear()
        if self.gate is not None:
            self.gate.forget_contributions()

    def _version_variable(self):
        with self._lock:
            if self._version is None:
                floor = max(self.stats.highest_version, 0 if self.gate is None else self.gate.known_step)
                self._version = internal_variable(
                    _runtime.ps_device(0), lambda: tf.constant(floor, tf.int64), "psclient_version")
            return self._version

    def _critical_section(self):
        with self._lock:
            if self._mutex is None:
                with tf.init_scope(), tf.device(_runtime.ps_device(0)):
                    self._mutex = tf.CriticalSection(name="psclient_sync")
            return self._mutex

    def accumulators(self, variables: list) -> "Accumulators":
        key = tuple(id(v) for v in variables)
        with self._lock:
            found = self._accumulators.get(key)
            if found is None or not found.holds(variables):
                found = self._accumulators[key] = Accumulators(variables)
            return found

    @contextlib.contextmanager
    def _enter(self):
        """Read the version first: every variable read of the step made inside waits for it."""
        version = self._version_variable()
        with tf.device(_runtime.ps_device(0)):
            start = version.read_value()
        trace = _StepTrace(self, version, start)
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        previous, _tracing.step = current_step(), trace
        try:
            yield trace
        finally:
            _tracing.step = previous
        # Only the reads (not every op, as tf.control_dependencies would: a
        # control edge from ps 0 to each constant and op of the worker cost 2 ms
        # of task CPU per step in benchmarks/keras_fit.py). TF-internal: what
        # tf.CriticalSection does to its lock.
        for op in graph.get_operations()[first:]:
            reads = op.type in _READS or (
                op.type in _CALLS and any(t.dtype == tf.resource for t in op.inputs))
            if reads and start.op not in op.control_inputs:
                _variables.add_control_input(op, start.op)


class _StepTrace:
    """One trace of an instrumented step: what its apply did, for its report."""

    def __init__(self, steps: Steps, version, start):
        self.steps = steps
        self.version = version
        self.start = start
        self.graph = tf.compat.v1.get_default_graph()
        #: Inside the optimizer's own apply (nested applies and updates pass through).
        self.busy = False
        #: An apply in a nested graph: this trace reports nothing (the plain one runs).
        self.nested = False
        #: Asynchronous: the ticket tensor and (max_staleness) whether to apply.
        self.ticket = None
        self.ok = None
        #: Synchronous: [version, outcome] from the critical section.
        self.report = None
        self._applies = 0

    @property
    def measured(self) -> bool:
        """Whether this trace's report is real (it applied gradients, each where it can be followed)."""
        return not self.nested and (self.ticket is not None or self.report is not None)

    # Called by the Keras seam for `optimizer.apply(grads, variables)`.
    def apply(self, grads: list, variables: list, run: Callable[[list], Any]):
        """Apply `grads` to `variables` (tf-level) under this step's rule; `run(grads)` is the optimizer's apply."""
        steps = self.steps
        if tf.compat.v1.get_default_graph() is not self.graph:
            self._unsupported("applies gradients inside its own tf.while_loop or tf.cond "
                              "(Keras fit: steps_per_execution > 1; a LossScaleOptimizer)")
            self.nested = True  # measured nowhere: the plain trace runs instead
            return self._run(run, grads)
        self._applies += 1
        if steps.gate is not None:
            if self._applies > 1:
                self._unsupported("applies gradients twice in one step")
            return self._contribute(grads, variables, run)
        if self.ticket is None:  # one ticket per step, taken at its first apply
            # Once the gradients exist: nothing else orders it after the step's work.
            computed = tf.group(*tf.nest.flatten([g for g in grads if g is not None], expand_composites=True))
            with tf.device(_runtime.ps_device(0)), tf.control_dependencies([computed]):
                # Fetch-and-add, atomic under the variable's lock (assign_add's
                # value is a second read, which another step's ticket can precede).
                before = tf.raw_ops.ResourceCountUpTo(resource=self.version.handle, limit=_NO_LIMIT, T=tf.int64)
                self.ticket = before + 1
                if steps.max_staleness is not None:
                    self.ok = before - self.start <= steps.max_staleness
        if self.ok is None:
            with tf.control_dependencies([self.ticket]):
                return self._run(run, grads)
        tf.cond(self.ok, lambda: (self._run(run, grads), tf.constant(True))[1], lambda: tf.constant(False))
        return None

    def outside_apply(self) -> None:
        self._unsupported("updates a ps variable through tf.distribute's extended.update outside "
                          "a Keras optimizer's apply (a tf_keras optimizer?)")

    def _unsupported(self, what: str) -> None:
        argument = self.steps.argument
        if argument is None:
            return  # only measured where it can be; nothing is promised otherwise
        raise UnsupportedStep(
            f"Invalid value for argument `{argument}`. Received: {argument}="
            f"{getattr(self.steps, argument)!r} and a scheduled function that {what}. Expected a "
            "function that applies its gradients once per call with a Keras optimizer's apply() or "
            "apply_gradients(), in the function itself (docs/staleness.md)."
        )

    def _run(self, run: Callable, grads: list):
        self.busy = True
        try:
            return run(grads)
        finally:
            self.busy = False

    def _contribute(self, grads: list, variables: list, run: Callable):
        steps = self.steps
        k = steps.replicas_to_aggregate
        kept = [i for i, g in enumerate(grads) if g is not None]
        accumulators = steps.accumulators([variables[i] for i in kept])
        # On the accumulators' ps tasks before the lock: nothing inside it waits on a worker.
        arrived = accumulators.receive([grads[i] for i in kept])
        version, start = self.version, self.start
        mutex = steps._critical_section()

        def apply_mean():
            means = accumulators.means(k)
            full = [None] * len(grads)
            for index, mean in zip(kept, means):
                full[index] = mean
            graph = tf.compat.v1.get_default_graph()
            before = len(graph.get_operations())
            self._run(run, full)
            with tf.control_dependencies(graph.get_operations()[before:]):
                reset = accumulators.reset()
            with tf.control_dependencies(reset):
                bumped = version.assign_add(1)
            with tf.control_dependencies([bumped]):
                return tf.constant(APPLIED, tf.int64)

        def fresh():
            with tf.control_dependencies(accumulators.add(arrived)):
                count = accumulators.count.assign_add(1)
            return tf.cond(count >= k, apply_mean, lambda: tf.constant(ACCUMULATED, tf.int64))

        def locked():
            current = version.read_value()
            outcome = tf.cond(tf.equal(current, start), fresh, lambda: tf.constant(DROPPED, tf.int64))
            return tf.stack([current, outcome])

        with tf.device(_runtime.ps_device(0)):
            result = mutex.execute(locked, exclusive_resource_access=False)
        self.report = (result[0], result[1])
        return None


def _finish(trace: _StepTrace):
    """The report of a step's trace: [start, version, outcome] (int64)."""
    _tracing.last = trace
    if not trace.measured:
        return trace.start
    # Made on ps 0, where its parts are: one tensor fetched from there, none sent to the worker.
    with tf.device(_runtime.ps_device(0)):
        if trace.report is not None:
            return tf.stack([trace.start, trace.report[0], trace.report[1]])
        outcome = tf.constant(APPLIED, tf.int64) if trace.ok is None else \
            tf.where(trace.ok, tf.constant(APPLIED, tf.int64), tf.constant(DROPPED, tf.int64))
        return tf.stack([trace.start, trace.ticket, outcome])


#: Function graphs in which a Keras optimizer applied gradients outside an instrumented step.
_applied_untracked: "weakref.WeakSet" = weakref.WeakSet()
#: Per instrumented trace (a ConcreteFunction), whether it applies gradients; kept
#: here, not stamped on TF's object, and forgotten with the trace.
_applies: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def note_untracked_apply() -> None:
    """A Keras optimizer's apply traced outside an instrumented step (the Keras seam calls it)."""
    if not tf.inside_function():
        return
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        _applied_untracked.add(graph)
        graph = getattr(graph, "outer_graph", None)
