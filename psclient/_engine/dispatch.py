"""The threads that carry closures to the workers.

Each worker gets `pipeline_depth` dispatcher threads. A thread takes the next
closure the scheduler hands it for its worker, calls the traced function on
that worker's device (the call blocks in TF's C++ runtime with the GIL
released, so threads run in parallel), copies the outputs to the coordinator,
and reports success or failure back to the scheduler.

A failed call is classified (`psclient._core.failures.classify`, with bounded
probes); what the verdict means for a task is only *reported* to the recovery
thread (`report(WorkerNotAnswering(...))`, `report(PsNotAnswering(...))`),
whose state machine decides. What becomes of the call itself (run again, after
which pause, with its iterators made again, or its error to the future) is
decided by a pure function (`failures.after_failure`) that this thread carries out.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from psclient._engine.edge import Edge, PerWorkerValues
from psclient._core import ps_access
from psclient._core.failures import (
    MAX_TRANSIENT_ATTEMPTS, Verdict, after_failure, classify, end_of_sequence, iterator_cancelled, stale_worker_context,
)
from psclient._core.recovery_messages import Drained, PsNotAnswering, WorkerNotAnswering
from psclient._core.closure import Closure
from psclient._core.errors import first_line
from psclient._core.scheduler import Scheduler

__all__ = ["Dispatcher"]

log = logging.getLogger("psclient")

#: Calls made while their function's registration has not reached the worker
#: (bounded: about 10 s in all, the registration's stream to a live worker takes far less).
_NOT_REGISTERED_ATTEMPTS = 25


class Dispatcher:
    """Owns the dispatcher threads of every worker; `stop()` joins them all."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        num_workers: int,
        pipeline_depth: int,
        prepare: Callable[[Closure, int], tuple],
        probes: Any,
        report: Callable[[Any], None],
        release_timeout: float,
        iterators: PerWorkerValues,
        edge: Edge,
        renew_trace: Callable[[Closure], bool] | None = None,
    ):
        # `prepare(closure, worker)` -> (function, args, kwargs) for that worker;
        # `probes`: a `FailureProbes`; `report(event)` posts to the recovery thread;
        # `iterators`: the `PerWorkerRegistry`, to renew a worker's cancelled iterators;
        # `edge`: what is asked of TensorFlow (`psclient._engine.edge.Edge`); `renew_trace`:
        # `StrategyParts.renew_trace`, for a function whose registration never reached a worker.
        self._edge = edge
        self._renew_trace = renew_trace
        self._scheduler = scheduler
        self._prepare = prepare
        self._probes = probes
        self._report = report
        self._release_timeout = release_timeout
        # The call each thread is inside, by thread: (worker, its cancel()).
        self._calls: dict[int, tuple[int, Callable[[], None]]] = {}
        self._calls_lock = threading.Lock()
        self._iterators = iterators
        self._pipeline_depth = pipeline_depth
        self._num_workers = num_workers
        self._threads: list[threading.Thread] = []
        self._results_copied = 0

    def start(self) -> None:
        """Start the threads of the first `num_workers` workers (they wait in the scheduler)."""
        for worker in range(self._num_workers):
            self.add_worker(worker)

    def add_worker(self, worker: int) -> None:
        """Start `pipeline_depth` threads for `worker` (a new one: elastic.py); they
        wait in the scheduler until it is up, and end when it is retired."""
        threads = [
            threading.Thread(
                target=self._run,
                args=(worker,),
                name=f"psclient-worker{worker}-{slot}",
                daemon=True,  # joined by stop(); daemon only so a crash can't wedge exit
            )
            for slot in range(self._pipeline_depth)
        ]
        self._threads = [t for t in self._threads if t.is_alive() or t.ident is None] + threads
        for thread in threads:
            thread.start()

    def worker_threads(self, worker: int) -> list[threading.Thread]:
        """The threads of `worker` still running (a retired worker's end after their call)."""
        prefix = f"psclient-worker{worker}-"
        return [t for t in self._threads if t.name.startswith(prefix) and t.is_alive()]

    def stop(self, timeout: float | None = None) -> list[str]:
        """Wait for every thread to exit (the scheduler must be closed first).

        Calls still running after `timeout` are cancelled (a hung worker
        would hold their threads until it answers or dies). Returns the names
        of threads still alive after that.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if timeout is not None and self.cancel_calls():
            # One wait for all: above pipeline depth 1 a call waiting for a hung
            # worker's answer is not cancellable (psclient/_coordinator/completion.py).
            deadline = time.monotonic() + min(timeout, 5.0)
            for thread in self._threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]

    def cancel_calls(self, worker: int | None = None) -> int:
        """Cancel the calls running on `worker` (every worker: None); returns how many.

        For a worker taken out: its closures were re-queued already, and a
        hung worker's calls would otherwise hold their threads (and TF's
        cache clearing) until it answers.
        """
        with self._calls_lock:
            cancels = [cancel for w, cancel in self._calls.values() if worker is None or w == worker]
        for cancel in cancels:
            cancel()
        return len(cancels)

    @property
    def alive_threads(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def _run(self, worker: int) -> None:
        device = self._edge.worker_device(worker)
        # A ps lost under a call here (its trace included) fails the closure: the closure's
        # failure handling reports it and runs the closure again (psclient._core.ps_access).
        with self._edge.device_scope(device, worker), ps_access.handled_elsewhere():
            while True:
                closure = self._scheduler.take(worker)
                if closure is None:
                    return
                self._execute(worker, device, closure)
                # An idle thread must not hold its last closure: through the
                # user's function it can reach the strategy, whose collection
                # (and finalizer, which stops these threads) it would prevent.
                del closure

    def _execute(self, worker: int, device: str, closure: Closure) -> None:
        attempt = closure.attempts
        iterators_generation = self._iterators.generation(worker)
        try:
            value = self._call_registered(worker, closure)
            # A closure whose outputs nobody reads (closure.outputs_unread) leaves them on the
            # worker: the call has run (synchronous executor), the copy is all that is skipped.
            value = self._copied(value) if closure.copy_outputs else None
        except Exception as error:  # noqa: BLE001 - every error of the user's function is routed to its future
            self._failed(worker, device, closure, attempt, error, iterators_generation)
        else:
            self._scheduler.succeeded(worker, closure, value, attempt=attempt)
            if self._scheduler.paused and not self._scheduler.running():
                self._report(Drained())  # a checkpoint's pause goes on at once (a failure's: next round)

    def _copied(self, outputs: Any) -> Any:
        value = self._edge.to_numpy(outputs)
        with self._calls_lock:
            self._results_copied += 1
        return value

    @property
    def results_copied(self) -> int:
        """Calls whose outputs were copied to the coordinator so far (failed copies not counted)."""
        return self._results_copied

    def _call_registered(self, worker: int, closure: Closure) -> Any:
        """The closure's call on `worker`; once a worker still does not know its function after the
        attempts of `_call` (its registration lost on the way: TF sends a function to the tasks
        only at its first reference), traced anew under a new name and called again."""
        fn, args, kwargs = self._prepare(closure, worker)
        try:
            return self._call(worker, fn, args, kwargs)
        except self._edge.op_error() as error:
            if self._renew_trace is None or not self._edge.function_not_registered_yet(error) \
                    or not self._renew_trace(closure):
                raise
            log.warning("%r: its function never reached worker %d (%s); traced again under a new name",
                        closure, worker, first_line(error))
        fn, args, kwargs = self._prepare(closure, worker)
        return self._call(worker, fn, args, kwargs)

    def _call(self, worker: int, fn: Callable, args: tuple, kwargs: dict) -> Any:
        me = threading.get_ident()
        for attempt in range(_NOT_REGISTERED_ATTEMPTS):
            with self._edge.cancellable_call() as cancel:
                with self._calls_lock:
                    self._calls[me] = (worker, cancel)
                try:
                    return fn(*args, **kwargs)
                except self._edge.op_error() as error:
                    # A new function's registration travels down the worker's
                    # stream unwaited and this call can overtake it: call again.
                    if attempt + 1 == _NOT_REGISTERED_ATTEMPTS or \
                            not self._edge.function_not_registered_yet(error):
                        raise
                finally:
                    with self._calls_lock:
                        self._calls.pop(me, None)
            time.sleep(min(0.5, 0.01 * 2 ** attempt))
        raise AssertionError("unreachable")

    def _renew_iterators(self, worker: int, seen_generation: int) -> None:
        try:
            renewed = self._iterators.renew_iterators(worker, seen_generation)
        except self._edge.op_error() as error:  # the worker went away too: its rejoin rebuilds them
            log.warning("worker %d: could not make its cancelled iterators again (%s)", worker, error)
            return
        if renewed:
            log.warning(
                "worker %d: a dataset iterator broke (cancelled, or an endless dataset said it ended, "
                "after its step broke while a task was away); %d iterator(s) made again, starting "
                "over from their datasets' beginning",
                worker, renewed,
            )

    def _broken_endless_iterator(self, worker: int, closure: Closure, error: Exception) -> bool:
        # The end of a dataset that never ends: its iterator broke (a call was
        # cancelled while its repeat() began a new pass). Made again, for a few tries.
        if not end_of_sequence(error) or closure.unexplained_failures + 1 >= MAX_TRANSIENT_ATTEMPTS:
            return False
        try:
            return self._iterators.endless(closure.args, closure.kwargs, worker)
        except self._edge.op_error():
            return False

    def _failed(
        self, worker: int, device: str, closure: Closure, attempt: int, error: Exception,
        iterators_generation: int,
    ) -> None:
        failed_at = time.monotonic()
        probes = self._probes
        # Reports carry the epoch they were made in: one made before a task came back is stale.
        epochs, ps_epoch = probes.epochs(), probes.ps_epoch()
        lost_ps: tuple = ()

        def ps_lost() -> bool:
            nonlocal lost_ps
            lost_ps = probes.lost_ps()
            return bool(lost_ps)

        def others_lost() -> bool:
            lost = probes.lost_workers(worker)
            for other in lost:
                self._report(WorkerNotAnswering(other, None, epochs[other]))
            # A worker out of rotation counts while it is still in TF's view
            # (until the reconnect that drops it); a retired one left on purpose.
            view = probes.view()
            return bool(lost) or any(
                not self._scheduler.worker_is_up(w) and not self._scheduler.is_retired(w)
                for w in range(len(epochs)) if w != worker and w in view
            )

        verdict = classify(
            error, lambda: probes.worker_answers(worker), others_lost=others_lost, ps_lost=ps_lost,
            attempts=closure.unexplained_failures + 1, other_lost_attempts=closure.other_lost_failures + 1,
            worker_device=device,
        )
        if verdict is Verdict.WORKER_LOST:
            stale = stale_worker_context(error, device)
            log.warning("worker %d %s (%s: %s); re-queueing its closures for other workers", worker,
                        "answers from a stale context (restarted unnoticed), taking it out to rejoin" if stale
                        else "does not answer", type(error).__name__, first_line(error)[:300])
            if stale:  # it does answer: bounded like an unexplained failure
                closure.unexplained_failures += 1
            self._report(WorkerNotAnswering(worker, time.monotonic() - failed_at, epochs[worker]))
            # Taking the worker out re-queues this closure (and any other running
            # there); this attempt's own report would then be stale.
            if not self._scheduler.wait_released(worker, closure, attempt, self._release_timeout):
                self._scheduler.failed(worker, closure, error, retry=True, attempt=attempt)
            return
        if verdict is Verdict.PS_LOST:
            self._report(PsNotAnswering(lost_ps, ps_epoch))
        broken = (self._broken_endless_iterator(worker, closure, error) if verdict is Verdict.FUNCTION_ERROR
                  else verdict is Verdict.TRANSIENT and iterator_cancelled(error))
        then = after_failure(verdict, unexplained_failures=closure.unexplained_failures,
                             other_lost_failures=closure.other_lost_failures, broken_iterator=broken)
        if not then.retry:
            named = self._edge.name_error(error, closure.name, device)
            self._scheduler.failed(worker, closure, named, retry=False, attempt=attempt)
            return
        closure.unexplained_failures += then.unexplained
        closure.other_lost_failures += then.other_lost
        if then.renew_iterators:
            self._renew_iterators(worker, iterators_generation)
        if verdict is not Verdict.FUNCTION_ERROR:  # (a broken endless iterator: logged by its renewal)
            log.warning(
                "%r on worker %d failed with %s (%s: %s); re-queueing it%s", closure, worker, type(error).__name__,
                verdict.value, first_line(error)[:300], f" in {then.pause:.1f} s" if then.pause else "",
            )
        if then.pause:
            time.sleep(then.pause)  # back off in this worker's thread: the channel needs the time
        self._scheduler.failed(worker, closure, error, retry=True, attempt=attempt)
