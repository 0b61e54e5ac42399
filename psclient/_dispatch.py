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
from typing import Callable

from psclient import _runtime
from psclient._failures import Verdict, classify
from psclient._scheduler import Closure, Scheduler

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
        resolve_args: Callable[[Closure, int], tuple],
        worker_answers: Callable[[int], bool],
        others_lost: Callable[[int], bool],
        on_worker_lost: Callable[[int], None],
    ):
        self._scheduler = scheduler
        self._resolve_args = resolve_args
        self._worker_answers = worker_answers
        self._others_lost = others_lost
        self._on_worker_lost = on_worker_lost
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

    def stop(self, timeout: float | None = None) -> None:
        """Wait for every thread to exit (the scheduler must be closed first)."""
        for thread in self._threads:
            thread.join(timeout)

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
        try:
            args, kwargs = self._resolve_args(closure, worker)
            value = _runtime.to_numpy(closure.fn(*args, **kwargs))
        except Exception as error:  # noqa: BLE001 - every error is routed to a future
            verdict = classify(
                error, lambda: self._worker_answers(worker), lambda: self._others_lost(worker)
            )
            if verdict is Verdict.WORKER_LOST:
                log.warning(
                    "worker %d does not answer (%s); re-queueing %r for another worker",
                    worker, type(error).__name__, closure,
                )
                self._on_worker_lost(worker)
                self._scheduler.failed(worker, closure, error, retry=True)
            elif verdict is Verdict.OTHER_TASK_LOST:
                log.warning(
                    "%r on worker %d was broken by another lost task (%s); re-queueing it",
                    closure, worker, type(error).__name__,
                )
                self._scheduler.failed(worker, closure, error, retry=True)
            else:
                named = _runtime.name_error(error, closure.name, device)
                self._scheduler.failed(worker, closure, named, retry=False)
        else:
            self._scheduler.succeeded(worker, closure, value)
