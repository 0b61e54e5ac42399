"""The threads that carry closures to the workers.

Each worker gets `pipeline_depth` dispatcher threads. A thread takes the next
closure the scheduler hands it for its worker, calls the traced function on
that worker's device (the call blocks in TF's C++ runtime with the GIL
released, so threads run in parallel), copies the outputs to the coordinator,
and reports success or failure back to the scheduler. Policy (retry or fail)
comes from `_failures.classify`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from psclient._coordinator import runtime as _runtime
from psclient._core.failures import Verdict, classify
from psclient._core.scheduler import Closure, Scheduler

__all__ = ["Dispatcher"]

log = logging.getLogger("psclient")


class Dispatcher:
    """Owns the dispatcher threads of every worker; `stop()` joins them all."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        num_workers: int,
        pipeline_depth: int,
        prepare: Callable[[Closure, int], tuple],
        worker_answers: Callable[[int], bool],
        ps_lost: Callable[[], bool],
        others_lost: Callable[[int], bool],
    ):
        # `prepare(closure, worker)` -> (function, args, kwargs) for that worker;
        # `ps_lost()` probes the ps tasks and starts their recovery if one is gone.
        self._scheduler = scheduler
        self._prepare = prepare
        self._worker_answers = worker_answers
        self._ps_lost = ps_lost
        self._others_lost = others_lost
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(worker,),
                name=f"psclient-worker{worker}-{slot}",
                daemon=True,  # joined by stop(); daemon only so a crash can't wedge exit
            )
            for worker in range(num_workers)
            for slot in range(pipeline_depth)
        ]
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float | None = None) -> list[str]:
        """Wait for every thread to exit (the scheduler must be closed first).

        Returns the names of threads still inside a call after `timeout`
        (a hung worker holds them until it answers or dies).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]

    @property
    def alive_threads(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def _run(self, worker: int) -> None:
        import tensorflow as tf

        device = _runtime.worker_device(worker)
        with tf.device(device):
            while True:
                closure = self._scheduler.take(worker)
                if closure is None:
                    return
                self._execute(worker, device, closure)

    def _execute(self, worker: int, device: str, closure: Closure) -> None:
        attempt = closure.attempts
        try:
            fn, args, kwargs = self._prepare(closure, worker)
            value = _runtime.to_numpy(fn(*args, **kwargs))
        except Exception as error:  # noqa: BLE001 - every error is routed to a future
            failed_at = time.monotonic()
            verdict = classify(
                error,
                lambda: self._worker_answers(worker),
                others_lost=lambda: self._others_lost(worker),
                ps_lost=self._ps_lost,
                attempts=closure.attempts,
            )
            if verdict is Verdict.WORKER_LOST:
                log.warning(
                    "worker %d does not answer (%s); re-queueing its closures for other workers",
                    worker, type(error).__name__,
                )
                # Re-queues this closure and any other running there; this
                # attempt's own report would now be stale, so none is sent.
                self._scheduler.worker_lost(worker, detected_after=time.monotonic() - failed_at)
            elif verdict in (Verdict.PS_LOST, Verdict.OTHER_TASK_LOST):
                log.warning(
                    "%r on worker %d was broken by a lost %s (%s); re-queueing it",
                    closure, worker, "ps task" if verdict is Verdict.PS_LOST else "task",
                    type(error).__name__,
                )
                self._scheduler.failed(worker, closure, error, retry=True, attempt=attempt)
            elif verdict is Verdict.TRANSIENT:
                pause = min(2.0, 0.5 * 2 ** (closure.attempts - 1))
                log.warning(
                    "%r on worker %d failed with %s while every task answers; trying again in "
                    "%.1f s", closure, worker, type(error).__name__, pause,
                )
                # Back off in this worker's thread: the channel needs the time.
                time.sleep(pause)
                self._scheduler.failed(worker, closure, error, retry=True, attempt=attempt)
            else:
                named = _runtime.name_error(error, closure.name, device)
                self._scheduler.failed(worker, closure, named, retry=False, attempt=attempt)
        else:
            self._scheduler.succeeded(worker, closure, value, attempt=attempt)
