"""The dispatcher threads waiting in `Scheduler.take`, and which one is woken. Pure logic.

Each waiting thread waits on a condition of its own (over the scheduler's
lock), listed in `idle` (oldest first) while its worker is up and in
`parked[worker]` while it is down. A closure becoming takeable wakes one
waiter, the one idle longest, and only one that can take it: the cost of a
closure does not grow with the number of workers. Guarded by the scheduler's
lock: every method is called with it held.
"""

from __future__ import annotations

import collections
import threading
from typing import Sequence

__all__ = ["Waiter", "Waiters"]


class Waiter:
    """One dispatcher thread waiting in take(): woken alone, and only for work it can take."""

    __slots__ = ("worker", "cond", "signalled", "home")

    def __init__(self, worker: int, lock: threading.Lock):
        self.worker = worker
        self.cond = threading.Condition(lock)
        #: Woken for a queued closure and not yet back in take()'s loop.
        self.signalled = False
        #: The collection it is listed in while it waits (idle or parked), else None.
        self.home: dict | None = None


class Waiters:
    """Idle and parked waiters, and the wakeups promised to them (see the module docstring)."""

    def __init__(self, lock: threading.Lock):
        self._lock = lock
        # Of up workers (an OrderedDict pops its oldest in O(1)), and of down workers, per worker.
        self._idle: collections.OrderedDict[Waiter, None] = collections.OrderedDict()
        self._parked: dict[int, dict[Waiter, None]] = {}
        #: Waiters woken for work that have not looked at the queue yet.
        self._signalled = 0
        #: Wakeups given to dispatcher threads (for tests and benchmarks).
        self.wakeups = 0

    def new(self, worker: int) -> Waiter:
        return Waiter(worker, self._lock)

    def was_woken(self, waiter: Waiter | None) -> bool:
        """Whether `waiter` was woken for work; the promise is taken back either way."""
        if waiter is None or not waiter.signalled:
            return False
        waiter.signalled = False
        self._signalled -= 1
        return True

    def wait(self, waiter: Waiter, up: bool, timeout: float | None) -> None:
        """List `waiter` (idle if its worker is `up`, else parked) and wait until woken or `timeout`."""
        if up:
            waiter.home = self._idle
            self._idle[waiter] = None
        else:
            self._park(waiter)
        try:
            waiter.cond.wait(timeout)
        finally:
            # Still listed after waking: it timed out, or close() woke it.
            if waiter.home is not None:
                waiter.home.pop(waiter, None)
                waiter.home = None

    def wake(self, takeable: int, workers: Sequence) -> None:
        """Wake one idle waiter that can take work per takeable closure not yet promised to
        one; waiters of down workers (`workers[i].up` false) met on the way are parked."""
        idle = self._idle
        while self._signalled < takeable and idle:
            waiter, _ = idle.popitem(last=False)  # the longest idle first, as TF's queue does
            if not workers[waiter.worker].up:
                self._park(waiter)
                continue
            waiter.home = None
            waiter.signalled = True
            self._signalled += 1
            self.wakeups += 1
            waiter.cond.notify()

    def unpark(self, worker: int) -> None:
        """`worker` is up again: its waiting threads may take work."""
        for waiter in self._parked.pop(worker, {}):
            waiter.home = self._idle
            self._idle[waiter] = None

    def end(self, worker: int) -> None:
        """Wake `worker`'s waiting threads to end (it was retired: take() returns None)."""
        for waiter in [w for w in self._idle if w.worker == worker]:
            self._idle.pop(waiter)
            waiter.home = None
            waiter.cond.notify()
        for waiter in self._parked.pop(worker, {}):
            waiter.home = None
            waiter.cond.notify()

    def notify_all(self) -> None:
        """Wake every waiting thread (the scheduler closed)."""
        for waiters in (self._idle, *self._parked.values()):
            for waiter in waiters:
                waiter.cond.notify()

    def _park(self, waiter: Waiter) -> None:
        home = self._parked.setdefault(waiter.worker, {})
        waiter.home = home
        home[waiter] = None

    def counts(self) -> tuple[int, int]:
        """(threads waiting on up workers, on down workers)."""
        return len(self._idle), sum(len(p) for p in self._parked.values())
