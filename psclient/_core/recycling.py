"""When a long-lived task server should restart itself: pure decisions, no I/O.

TensorFlow's task server keeps part of every coordinator's eager context after
the coordinator has gone, even after a clean `shutdown()`: measured, 4 of the
context's inter-op threads (`tf_Compute`) and about 1 MiB per coordinator, for
good. Nothing in TF releases them, so a task that serves coordinators one
after the other grows without bound. What does release them is a fresh
process. `psclient serve --recycle-when-idle S` re-executes the task (same
pid, same port) once it holds such leftovers and no connection has been open
to its port for S seconds: then no coordinator can be using it (a live
coordinator keeps its gRPC connection to every task open, and sends TF's
keep-alive over it).

`IdleRecycler` decides; the task's main loop feeds it what it reads from
/proc once a second and restarts the process when it says so.
"""

from __future__ import annotations

import dataclasses

from psclient._core.checks import check_positive


@dataclasses.dataclass(frozen=True)
class TaskLoad:
    """What a task server's process shows at one moment."""

    connections: int  # open TCP connections to the task's port
    context_threads: int  # TF's per-context inter-op threads (named tf_Compute)


class IdleRecycler:
    """Says when a task server holds only what gone coordinators left and nobody is connected.

    Args:
        idle_after: seconds without any connection to the task's port (and
            with leftovers) before the task restarts; > 0.
        baseline: `TaskLoad` read once the server was ready, before any
            coordinator connected: context threads above its count are what
            coordinators left behind.
        now: the time of `baseline`, in the caller's clock.
    """

    def __init__(self, idle_after: float, baseline: TaskLoad, now: float):
        self.idle_after = float(check_positive("idle_after", idle_after, unit="seconds"))
        self.baseline_threads = baseline.context_threads
        self._idle_since: float | None = None
        self.observe(baseline, now)

    def leftover_threads(self, load: TaskLoad) -> int:
        return max(0, load.context_threads - self.baseline_threads)

    def observe(self, load: TaskLoad, now: float) -> bool:
        """True when the task should restart now."""
        if load.connections > 0 or self.leftover_threads(load) == 0:
            # In use, or nothing to give back: a restart would only cost time.
            self._idle_since = None
            return False
        if self._idle_since is None:
            self._idle_since = now
        return now - self._idle_since >= self.idle_after

    def idle_for(self, now: float) -> float:
        """Seconds the task has been idle with leftovers (0 when it is not)."""
        return 0.0 if self._idle_since is None else now - self._idle_since
