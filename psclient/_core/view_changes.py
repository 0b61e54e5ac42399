"""Changes of TF's view of the cluster: how many, how slow, and the one under way. No TensorFlow.

TF's `update_server_def` (a connect, a reconnect after a worker or ps loss)
waits, without a deadline, for every task it names to answer, and for each
task it drops or that restarted to close its old context. No step runs
meanwhile. It usually takes well under a second; seeded chaos plans saw it
wait 16 to 111 s (a worker's dataset iterator closing, since avoided) and for
as long as a task stayed stopped (docs/chaos.md), and psclient cannot cut it
short (TF offers no deadline or cancellation from Python). What psclient can do is say so
while it waits: `ViewChanges` keeps the record that `strategy.stats()` and
the metrics read, and says when the next "still waiting" warning is due.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

__all__ = ["WARN_AFTER_S", "ViewChanges"]

#: Seconds into a change at which it is logged as still waiting; then every doubling of the last.
WARN_AFTER_S = (10.0, 30.0, 60.0)


def warning_times(first: tuple[float, ...] = WARN_AFTER_S):
    """The seconds at which a change still waiting is logged: `first`, then doubling (120, 240, ...)."""
    yield from first
    at = first[-1]
    while True:
        at *= 2
        yield at


class ViewChanges:
    """The record of a process's changes of TF's view (one process, one view: TF's context is the process's).

    `began(tasks)` / `ended()` bracket each `update_server_def`, failed or not; `stats()` is what
    `strategy.stats()["cluster_view"]` reports. Thread-safe; `clock` is injectable for tests.
    """

    def __init__(self, *, slow_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self._slow_s = slow_s
        self._clock = clock
        self._lock = threading.Lock()
        self._changes = 0  # ended
        self._slow = 0  # ended after slow_s or more
        self._longest = 0.0
        self._since: float | None = None  # the one under way: when it began
        self._tasks: tuple[str, ...] = ()  # and the tasks it names

    def now(self) -> float:
        """The record's clock."""
        return self._clock()

    def began(self, tasks) -> float:
        """A change naming `tasks` ("job:index") begins; returns its start on the clock."""
        with self._lock:
            self._since = self._clock()
            self._tasks = tuple(sorted(tasks))
            return self._since

    def ended(self) -> float:
        """The change under way ended (returned or raised); returns how long it took."""
        with self._lock:
            if self._since is None:
                raise RuntimeError("ViewChanges.ended() without began()")
            took = max(0.0, self._clock() - self._since)
            self._since, self._tasks = None, ()
            self._changes += 1
            self._slow += took >= self._slow_s
            self._longest = max(self._longest, took)
            return took

    def stats(self) -> dict:
        """{"changes", "slow_changes", "longest_s", "changing_for_s" (0.0 when none is under way),
        "changing_tasks" (the tasks the one under way names: each must answer before it ends)}."""
        with self._lock:
            waiting = 0.0 if self._since is None else max(0.0, self._clock() - self._since)
            return {"changes": self._changes, "slow_changes": self._slow, "longest_s": round(self._longest, 3),
                    "changing_for_s": round(waiting, 3), "changing_tasks": list(self._tasks)}
