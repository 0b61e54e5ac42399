"""The closure queue and its bookkeeping: pure logic, no TensorFlow.

Everything about *what runs where and what happens to its future* lives here;
the threads that talk to TensorFlow (`_dispatch.py`) only carry closures out
and report back through the four events below. That keeps the policy testable
without a cluster.

Events in                          | effect
-----------------------------------|----------------------------------------------
submit(closure)                    | queued (FIFO); unfinished += 1
take(worker) -> closure            | dispatcher of `worker` gets the oldest queued
                                   | closure; its future goes RUNNING (a cancelled
                                   | one is dropped here)
succeeded(worker, closure, value)  | future resolved with value; unfinished -= 1
failed(worker, closure, error,     | retry=True: back to the *front* of the queue
       retry=...)                  | (the future stays RUNNING). retry=False: the
                                   | future gets the error, the first such error is
                                   | kept for join(), everything queued is cancelled
worker_down(worker) / worker_up    | a down worker takes nothing until it is up

`join()` waits until nothing is unfinished, then raises the first error once.
The same pending error is also raised by the next `submit()` or `done()`,
whichever comes first (as TF's coordinator does): a long scheduling loop stops
early instead of queueing thousands of closures that would be cancelled.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import threading
import time
from typing import Any, Callable

from psclient._errors import StrategyClosedError
from psclient._future import Future

__all__ = ["Closure", "Scheduler", "WorkerStats"]

_ids = itertools.count()


class Closure:
    """One scheduled call: the function, its arguments and its future."""

    __slots__ = (
        "id", "fn", "args", "kwargs", "future", "attempts", "started_at", "per_worker",
    )

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, future: Future):
        self.id = next(_ids)
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.future = future
        self.attempts = 0
        self.started_at = 0.0
        #: Whether `args`/`kwargs` hold per-worker values to resolve per worker.
        self.per_worker = False

    @property
    def name(self) -> str:
        return self.future.name

    def __repr__(self) -> str:
        return f"<Closure #{self.id} {self.name!r} attempts={self.attempts}>"


@dataclasses.dataclass
class WorkerStats:
    done: int = 0
    failed: int = 0
    retried: int = 0
    in_flight: int = 0
    up: bool = True
    # Recent latencies only, so memory stays flat however long training runs.
    latencies: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=2048)
    )

    def summary(self) -> dict:
        lat = sorted(self.latencies)
        mean = sum(lat) / len(lat) if lat else None
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None
        return {
            "done": self.done,
            "failed": self.failed,
            "retried": self.retried,
            "in_flight": self.in_flight,
            "up": self.up,
            "latency_mean_s": mean,
            "latency_p99_s": p99,
        }


class Scheduler:
    """FIFO closure queue shared by every worker's dispatcher threads."""

    def __init__(self, num_workers: int, *, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: collections.deque[Closure] = collections.deque()
        self._unfinished = 0
        self._error: BaseException | None = None
        self._closed = False
        self._workers = [WorkerStats() for _ in range(num_workers)]
        self._submitted = 0

    # ------------------------------------------------------------ producer side
    def submit(self, closure: Closure) -> None:
        with self._cond:
            if self._closed:
                raise StrategyClosedError(
                    f"Cannot schedule {closure.name!r}: the strategy was shut down. "
                    "Create a new ParameterServerStrategy to schedule more work."
                )
            self._raise_pending_error()
            self._queue.append(closure)
            self._unfinished += 1
            self._submitted += 1
            self._cond.notify()

    # ---------------------------------------------------------- dispatcher side
    def take(self, worker: int, timeout: float | None = None) -> Closure | None:
        """Next closure for `worker`, or None when closed or `timeout` passed."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._workers[worker].up:
                    while self._queue:
                        closure = self._queue.popleft()
                        if closure.attempts == 0 and not closure.future.set_running_or_notify_cancel():
                            self._finish_locked()  # cancelled by the user while queued
                            continue
                        closure.attempts += 1
                        closure.started_at = self._clock()
                        self._workers[worker].in_flight += 1
                        return closure
                remaining = None if deadline is None else deadline - self._clock()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def succeeded(self, worker: int, closure: Closure, value: Any) -> None:
        with self._cond:
            stats = self._workers[worker]
            stats.in_flight -= 1
            stats.done += 1
            stats.latencies.append(self._clock() - closure.started_at)
            self._finish_locked()
        # Outside the lock: done-callbacks run user code.
        closure.future.set_result(value)

    def failed(self, worker: int, closure: Closure, error: BaseException, *, retry: bool) -> None:
        cancelled: list[Closure] = []
        with self._cond:
            stats = self._workers[worker]
            stats.in_flight -= 1
            if retry and not self._closed:
                stats.retried += 1
                self._queue.appendleft(closure)
                self._cond.notify()
                return
            stats.failed += 1
            self._finish_locked()
            if self._error is None:
                self._error = error
                cancelled = list(self._queue)
                self._queue.clear()
                self._unfinished -= len(cancelled)
                self._cond.notify_all()
        closure.future.set_exception(error)
        _cancel_all(cancelled, f"an earlier closure ({closure.name!r}) failed")

    def worker_down(self, worker: int) -> None:
        with self._cond:
            self._workers[worker].up = False

    def worker_is_up(self, worker: int) -> bool:
        with self._cond:
            return self._workers[worker].up

    def worker_up(self, worker: int) -> None:
        with self._cond:
            self._workers[worker].up = True
            self._cond.notify_all()

    # ----------------------------------------------------------- waiting side
    def join(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted is resolved; raise the first error.

        Returns False if `timeout` passed first (nothing is raised or cleared then).
        """
        with self._cond:
            self._drop_cancelled_locked()
            if not self._cond.wait_for(lambda: self._unfinished == 0, timeout):
                return False
            self._raise_pending_error()
            return True

    def done(self) -> bool:
        with self._cond:
            self._drop_cancelled_locked()
            self._raise_pending_error()
            return self._unfinished == 0

    def close(self) -> list[Closure]:
        """Stop handing out work; cancel and return what was still queued."""
        with self._cond:
            self._closed = True
            cancelled = list(self._queue)
            self._queue.clear()
            self._unfinished -= len(cancelled)
            self._cond.notify_all()
        _cancel_all(cancelled, "the strategy was shut down")
        return cancelled

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict:
        with self._cond:
            return {
                "scheduled": self._submitted,
                "unfinished": self._unfinished,
                "queue_depth": len(self._queue),
                "workers": [w.summary() for w in self._workers],
            }

    # ---------------------------------------------------------------- private
    def _finish_locked(self) -> None:
        self._unfinished -= 1
        if self._unfinished == 0:
            self._cond.notify_all()

    def _drop_cancelled_locked(self) -> None:
        # Futures cancelled by the user while queued would otherwise wait in
        # the queue until a dispatcher pops them.
        kept = collections.deque(c for c in self._queue if not c.future.cancelled())
        self._unfinished -= len(self._queue) - len(kept)
        self._queue = kept

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _cancel_all(closures: list[Closure], why: str) -> None:
    for closure in closures:
        if not closure.future.cancel():
            # A retried closure is already RUNNING, which stdlib futures cannot
            # cancel; resolve it with the same exception type instead.
            closure.future.set_exception(concurrent.futures.CancelledError(why))
