"""The closure queue and its bookkeeping: pure logic, no TensorFlow.

Everything about *what runs where and what happens to its future* lives here;
the threads that talk to TensorFlow (`_engine/dispatch.py`) only carry closures out
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
worker_lost(worker, detected_after)| down, and every closure running on it goes
                                   | back to the front of the queue; a late report
                                   | from that attempt is ignored (stale); a down
                                   | worker takes nothing until worker_up(worker)
pause() / resume()                 | nothing is handed out while paused (checkpoints,
                                   | ps recovery); running() counts running ones
fail_all(error)                    | every queued and running closure gets `error`
                                   | (all workers gone for too long, a ps lost)

Wakeups: a closure that becomes takeable (submitted, retried, requeued, its
worker back, dispatch resumed) wakes one waiting dispatcher thread of an up
worker and no other (waiters.py); a completion wakes nobody unless someone
waits for that state (join, wait_idle). An earlier design, one condition for
every dispatcher, told by every completion, gave 54 closures/s at 1,000 threads.

`join()` waits until nothing is unfinished, then raises the first error once.
The same pending error is also raised by the next `submit()` or `done()`,
whichever comes first (as TF's coordinator does): a long scheduling loop stops
early instead of queueing thousands of closures that would be cancelled.
As in TF, raising it clears every error collected so far: `submit()`/`done()`
first wait for the closures still running, whose own errors are absorbed, and
a closure that would run again while the error is pending is cancelled.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

from psclient._core.attempts import RunningAttempts
from psclient._core.closure import Closure, cancel_all
from psclient._core.errors import StrategyClosedError
from psclient._core.membership import Membership
from psclient._core.waiters import Waiter, Waiters
from psclient._core.worker_stats import WorkerStats

__all__ = ["Scheduler"]

class Scheduler:
    """FIFO closure queue shared by every worker's dispatcher threads.

    Cost per event does not grow with the number of workers: a dispatcher
    thread waiting for work waits on its own condition (`Waiters`,
    waiters.py); a closure becoming takeable wakes one waiter, and only one
    that can take it. Counters (running, completed) are kept, not summed over
    workers. Callers that wait for a state (join, wait_idle, wait_released)
    wait on conditions of their own, told only when that state may be reached.
    Workers join and retire at run time (which slots: `Membership`, membership.py);
    what runs where, and which reports are stale: `RunningAttempts`, attempts.py.
    """

    def __init__(self, num_workers: int, *, clock: Callable[[], float] = time.monotonic, lock=None):
        self._clock = clock
        self._lock = threading.Lock() if lock is None else lock  # a test's may hold a thread back
        self._finished = threading.Condition(self._lock)  # join(): nothing is unfinished any more
        #: wait_idle() / wait_released(): told when running attempts end all at
        #: once (requeued, failed, closed) or the last running one ends.
        self._released = threading.Condition(self._lock)
        self._queue: collections.deque[Closure] = collections.deque()
        self._unfinished = 0
        self._error: BaseException | None = None
        self._closed = False
        self._workers = [WorkerStats() for _ in range(num_workers)]
        self._running = RunningAttempts(num_workers)
        self._completed = 0
        #: When each worker last finished a closure (a sign of life for the heartbeat).
        self._last_done = [float("-inf")] * num_workers
        self._submitted = 0
        self._paused = 0
        #: Waiting dispatcher threads.
        self._waiters = Waiters(self._lock)
        #: Closures cancelled instead of re-queued (error pending), resolved outside the lock.
        self._cancelled_on_requeue: list[Closure] = []
        self._membership = Membership()

    # ------------------------------------------------------------ producer side
    def submit(self, closure: Closure) -> None:
        with self._lock:
            if self._closed:
                raise StrategyClosedError(
                    f"Cannot schedule {closure.name!r}: the strategy was shut down. "
                    "Create a new ParameterServerStrategy to schedule more work."
                )
            self._raise_pending_error()
            self._queue.append(closure)
            self._unfinished += 1
            self._submitted += 1
            self._wake_locked()

    # ---------------------------------------------------------- dispatcher side
    def take(self, worker: int, timeout: float | None = None) -> Closure | None:
        """Next closure for `worker`, or None when closed or `timeout` passed."""
        deadline = None if timeout is None else self._clock() + timeout
        waiter: Waiter | None = None
        with self._lock:
            while True:
                woken = self._waiters.was_woken(waiter)
                if self._closed or self._membership.is_retired(worker):
                    if woken and not self._closed:
                        self._wake_locked()  # retired meanwhile: the wakeup goes to another waiter
                    return None
                stats = self._workers[worker]
                if stats.up and not self._paused:
                    while self._queue:
                        closure = self._queue.popleft()
                        if closure.attempts == 0 and not closure.future.set_running_or_notify_cancel():
                            self._finish_locked()  # cancelled by the user while queued
                            continue
                        closure.attempts += 1
                        closure.started_at = self._clock()
                        self._running.start(worker, closure)
                        return closure
                if woken:
                    self._wake_locked()  # not taken here: the wakeup goes to another waiter
                remaining = None if deadline is None else deadline - self._clock()
                if remaining is not None and remaining <= 0:
                    return None
                if waiter is None:
                    waiter = self._waiters.new(worker)
                self._waiters.wait(waiter, self._workers[worker].up, remaining)

    def succeeded(self, worker: int, closure: Closure, value: Any, attempt: int | None = None) -> None:
        with self._lock:
            if not self._release_locked(worker, closure, attempt):
                return
            stats = self._workers[worker]
            stats.done += 1
            self._completed += 1
            now = self._last_done[worker] = self._clock()
            stats.record_latency(now - closure.started_at)
            self._finish_locked()
        # Outside the lock: done-callbacks run user code.
        closure.future.set_result(value)

    def failed(
        self, worker: int, closure: Closure, error: BaseException, *, retry: bool,
        attempt: int | None = None,
    ) -> None:
        """Report a failed attempt. `attempt` is `closure.attempts` as it was
        when the closure was taken: a report from an attempt that was given up
        on (its worker was declared lost) is ignored."""
        with self._lock:
            if not self._release_locked(worker, closure, attempt):
                return
            stats = self._workers[worker]
            if retry and not self._closed and self._error is None:
                stats.retried += 1
                self._queue.appendleft(closure)
                self._wake_locked()
                return
            if retry:
                # An error is pending: what would run again is cancelled
                # instead, as everything queued was when the error came.
                self._finish_locked()
                cancelled, error = [closure], None
            else:
                stats.failed += 1
                self._finish_locked()
                cancelled = self._keep_error_locked(error)
        if error is not None:
            closure.future.set_exception(error)
        cancel_all(cancelled, f"an earlier closure ({closure.name!r}) failed")

    def worker_lost(self, worker: int, *, detected_after: float | None = None) -> list[Closure]:
        """Take `worker` out and re-queue every closure running on it.

        Returns the re-queued closures. Their running attempts are abandoned:
        if the worker answers later (a hung one resumes), those reports are
        stale and ignored, so each future still resolves exactly once.
        """
        with self._lock:
            stats = self._workers[worker]
            if stats.up:
                stats.failures += 1
                stats.last_detection_s = detected_after
            stats.up = False
            requeued = self._requeue_running_locked([worker])
        self._resolve_cancelled_on_requeue()
        return requeued

    def requeue_running(self) -> list[Closure]:
        """Abandon every running attempt and queue those closures again, in order.

        For a ps recovery that cannot wait for calls stuck on the lost task:
        their late reports are stale and ignored.
        """
        with self._lock:
            requeued = self._requeue_running_locked(self._running.busy_workers())
        self._resolve_cancelled_on_requeue()
        return requeued

    def worker_is_up(self, worker: int) -> bool:
        with self._lock:
            return self._workers[worker].up

    def worker_up(self, worker: int, *, recovered_after: float | None = None) -> None:
        with self._lock:
            stats = self._workers[worker]
            if self._membership.is_retired(worker):
                return  # retired: a late rejoin does not bring it back
            joined = self._membership.first_up(worker)  # a new worker's first up is no rejoin
            if not stats.up and not joined:
                stats.rejoins += 1
                stats.last_recovery_s = recovered_after
            stats.up = True
            self._waiters.unpark(worker)  # its waiting threads may take work again
            self._wake_locked()

    def pause(self) -> None:
        """Hand out nothing until `resume()` (calls nest)."""
        with self._lock:
            self._paused += 1

    def resume(self) -> None:
        with self._lock:
            self._paused = max(0, self._paused - 1)
            self._wake_locked()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no closure is running on any worker; False on timeout."""
        with self._lock:
            return self._released.wait_for(lambda: self._running.total == 0, timeout)

    def running(self) -> int:
        """Closures running now, over all workers."""
        with self._lock:
            return self._running.total

    def wait_released(self, worker: int, closure: Closure, attempt: int, timeout: float | None) -> bool:
        """Wait until this attempt of `closure` no longer runs on `worker` (taken out,
        requeued, failed) or the scheduler is closed; False on timeout."""
        with self._lock:
            return self._released.wait_for(
                lambda: self._closed or closure.worker != worker or closure.attempts != attempt
                or not self._running.runs(worker, closure),
                timeout,
            )

    def queued(self) -> list[Closure]:
        with self._lock:
            return list(self._queue)

    def completed(self) -> int:
        """Closures that finished successfully, over all workers."""
        with self._lock:
            return self._completed

    def last_done_times(self) -> list[float]:
        """Per worker, when it last finished a closure (this scheduler's clock); -inf if never."""
        with self._lock:
            return list(self._last_done)

    def fail_all(self, error: BaseException) -> int:
        """Resolve every queued and running closure with `error`; join() raises it.

        Running attempts are abandoned as in `worker_lost`. Returns how many
        futures got the error.
        """
        with self._lock:
            victims = list(self._queue)
            self._queue.clear()
            for worker in self._running.busy_workers():
                victims.extend(self._running.abandon(worker))
            self._unfinished -= len(victims)
            if victims and self._error is None:
                self._error = error
            self._released.notify_all()
            self._finished.notify_all()
        for closure in victims:
            if not closure.future.done():
                if closure.future.running() or closure.future.set_running_or_notify_cancel():
                    closure.future.set_exception(error)
        return len(victims)

    # --------------------------------------------------------- elastic workers
    @property
    def num_workers(self) -> int:
        """Worker slots, retired ones included (indices are never reused for another slot)."""
        with self._lock:
            return len(self._workers)

    @property
    def wakeups(self) -> int:
        """Wakeups given to dispatcher threads (for tests and benchmarks)."""
        return self._waiters.wakeups

    def add_worker(self) -> int:
        """A new worker slot, down until `worker_up` (its first is no rejoin); returns its index."""
        with self._lock:
            index = len(self._workers)
            self._workers.append(WorkerStats(up=False))
            self._running.add_worker()
            self._last_done.append(float("-inf"))
            self._membership.joined(index)
            return index

    def rejoin_slot(self, worker: int) -> None:
        """A retired slot becomes a joining worker again (down until `worker_up`).

        Raises:
            ValueError: the slot is not retired.
        """
        with self._lock:
            self._membership.rejoin(worker)
            self._workers[worker].retired = False

    def retire_worker(self, worker: int, *, drain: bool) -> list:
        """Take `worker` out for good: it takes no new closure, its waiting dispatcher
        threads end. `drain`: its running closures finish there; else they go back to
        the front of the queue (as worker_lost), their late reports ignored. Returns
        the closures handed back."""
        with self._lock:
            stats = self._workers[worker]
            stats.up = False
            stats.retired = True
            self._membership.retire(worker)
            requeued = [] if drain else self._requeue_running_locked([worker])
            self._waiters.end(worker)
            self._released.notify_all()
        self._resolve_cancelled_on_requeue()
        return requeued

    def is_retired(self, worker: int) -> bool:
        with self._lock:
            return self._membership.is_retired(worker)

    def retired(self) -> frozenset:
        with self._lock:
            return self._membership.retired()

    def running_on(self, worker: int) -> int:
        """Closures running on `worker` now."""
        with self._lock:
            return self._running.on(worker)

    def wait_drained(self, worker: int, timeout: float | None) -> bool:
        """Wait until nothing runs on `worker` (or the scheduler is closed); False on timeout."""
        with self._lock:
            return self._released.wait_for(lambda: self._closed or not self._running.on(worker), timeout)

    def hand_back(self, worker: int) -> list:
        """Abandon what still runs on `worker` and queue it again (a drain that took too long)."""
        with self._lock:
            requeued = self._requeue_running_locked([worker])
        self._resolve_cancelled_on_requeue()
        return requeued

    # ----------------------------------------------------------- waiting side
    def join(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted is resolved; raise the first error.

        Returns False if `timeout` passed first (nothing is raised or cleared then).
        """
        with self._lock:
            self._drop_cancelled_locked()
            if not self._finished.wait_for(lambda: self._unfinished == 0, timeout):
                return False
            self._raise_pending_error()
            return True

    def done(self) -> bool:
        with self._lock:
            self._drop_cancelled_locked()
            self._raise_pending_error()
            return self._unfinished == 0

    def close(self) -> list[Closure]:
        """Stop handing out work; cancel and return what was still queued."""
        with self._lock:
            self._closed = True
            cancelled = list(self._queue)
            self._queue.clear()
            self._unfinished -= len(cancelled)
            self._waiters.notify_all()
            self._released.notify_all()
            self._finished.notify_all()
        cancel_all(cancelled, "the strategy was shut down")
        return cancelled

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def paused(self) -> bool:
        """Whether nothing is handed out now (a checkpoint, a ps recovery)."""
        return bool(self._paused)

    def stats(self) -> dict:
        """Counts and latencies per worker: O(workers), no sorting (cheap at 1,000 workers)."""
        with self._lock:
            return {
                "scheduled": self._submitted,
                "unfinished": self._unfinished,
                "queue_depth": len(self._queue),
                "paused": bool(self._paused),
                "stale_reports": self._running.stale,
                "waiting_dispatchers": sum(self._waiters.counts()),  # idle, so in no call (a late one too)
                "workers": [w.summary(in_flight=self._running.on(i)) for i, w in enumerate(self._workers)],
            }

    def waiting_threads(self) -> tuple[int, int]:
        """(dispatcher threads waiting for work on up workers, on down workers)."""
        with self._lock:
            return self._waiters.counts()

    # ---------------------------------------------------------------- private
    def _wake_locked(self) -> None:
        """Wake one waiting dispatcher that can take work per queued closure not yet promised to one."""
        if not (self._paused or self._closed):
            self._waiters.wake(len(self._queue), self._workers)

    def _release_locked(self, worker: int, closure: Closure, attempt: int | None) -> bool:
        """End the attempt; False if it was abandoned earlier (stale report)."""
        if not self._running.end(worker, closure, attempt):
            return False
        if self._running.total == 0:
            self._released.notify_all()  # wait_idle
        elif self._membership.is_retired(worker) and not self._running.on(worker):
            self._released.notify_all()  # wait_drained
        return True

    def _requeue_running_locked(self, workers) -> list[Closure]:
        requeued = []
        for worker in workers:
            running = self._running.abandon(worker)
            self._workers[worker].retried += len(running)
            requeued.extend(running)
        requeued.sort(key=lambda c: c.id)
        if self._error is not None and requeued:
            # An error is pending: cancelled, not run again (see failed()).
            self._unfinished -= len(requeued)
            if self._unfinished == 0:
                self._finished.notify_all()
            self._released.notify_all()
            self._cancelled_on_requeue.extend(requeued)
            return []
        for closure in reversed(requeued):
            self._queue.appendleft(closure)
        self._released.notify_all()
        self._wake_locked()
        return requeued

    def _resolve_cancelled_on_requeue(self) -> None:
        with self._lock:
            cancelled, self._cancelled_on_requeue = self._cancelled_on_requeue, []
        cancel_all(cancelled, "an earlier closure failed")

    def _keep_error_locked(self, error: BaseException) -> list[Closure]:
        """Keep the first error for join(); cancel (and return) what is queued."""
        if self._error is not None:
            return []
        self._error = error
        cancelled = list(self._queue)
        self._queue.clear()
        self._unfinished -= len(cancelled)
        if self._unfinished == 0:
            self._finished.notify_all()
        return cancelled

    def _finish_locked(self) -> None:
        self._unfinished -= 1
        if self._unfinished == 0:
            self._finished.notify_all()

    def _drop_cancelled_locked(self) -> None:
        # Futures cancelled by the user while queued would otherwise wait in
        # the queue until a dispatcher pops them.
        kept = collections.deque(c for c in self._queue if not c.future.cancelled())
        self._unfinished -= len(self._queue) - len(kept)
        self._queue = kept

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            # As TF's coordinator: before the error is raised (and cleared),
            # wait for the closures still running; their own errors are
            # absorbed by it, so a later join() does not raise them.
            self._released.wait_for(lambda: self._running.total == 0)
            error, self._error = self._error, None
            raise error
