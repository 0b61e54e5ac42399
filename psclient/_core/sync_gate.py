"""When a worker may start its next synchronous step (`replicas_to_aggregate`). Pure logic.

In synchronous mode a step's gradient is added to the ps's accumulators for
the model version (step) it was computed on, and the k-th gradient of a step
applies their mean (`psclient._coordinator.training.sync`). A worker that has just
added its gradient to step s must not compute another one for s: the k
gradients of a step should come from k different workers, not from the
fastest one k times. So before a worker's next synchronous call, the
coordinator waits (in that worker's dispatcher thread, never on the ps and
never holding anything a peer needs) until one of:

  advanced     the step was applied (a report with a newer step arrived);
  short        step s can no longer get k different workers: those that
               contributed plus the others still up are fewer than k
               (workers taken out by the heartbeat count as gone);
  timeout      `timeout` seconds passed (a peer that is slow but alive);
  interrupted  the strategy pauses (a checkpoint) or shuts down.

After "short" or "timeout" the worker contributes to step s again, which
counts as one more of its k gradients (`repeats` in the stats): so nobody
waits for a slow or dead peer longer than `timeout`, and k = n keeps training
(at the pace of the timeout) when a worker is gone for good. One synchronous
call per worker runs at a time (with `pipeline_depth` > 1 the others wait
their turn here).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from psclient._core.staleness import APPLIED, ACCUMULATED

__all__ = ["SyncGate"]


class SyncGate:
    def __init__(
        self,
        num_workers: int,
        replicas_to_aggregate: int,
        *,
        timeout: float,
        is_up: Callable[[int], bool],
        interrupted: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
        poll: float = 0.1,
    ):
        self._n = num_workers
        self._k = replicas_to_aggregate
        self._timeout = timeout
        self._is_up = is_up
        self._interrupted = interrupted
        self._clock = clock
        self._poll = poll
        self._cond = threading.Condition()
        #: The newest step any report showed the ps at.
        self.known_step = 0
        self._contributed: list[int | None] = [None] * num_workers
        self._in_flight = [False] * num_workers
        self._contributors: dict[int, set[int]] = {}
        self._released = {"advanced": 0, "short": 0, "timeout": 0, "interrupted": 0}
        self._waited_s = 0.0
        self._repeats = 0
        #: Threads inside `before` waiting right now (statistics, and what
        #: tests wait on to know a thread has reached its wait).
        self._waiting = 0

    def before(self, worker: int) -> str:
        """Wait until `worker` may start a synchronous call; return why it may.

        "free" (nothing to wait for) or one of the reasons in the module doc.
        """
        with self._cond:
            self._grow_to(worker)
            started = self._clock()
            deadline = started + self._timeout
            waited = False
            while True:
                if self._interrupted():
                    reason = "interrupted"
                    break
                busy = self._in_flight[worker]
                step = self._contributed[worker]
                pending = step is not None and step >= self.known_step
                if not busy and not pending:
                    reason = "advanced" if waited else "free"
                    break
                if not busy and self._too_few(step):
                    reason = "short"
                    break
                remaining = deadline - self._clock()
                if remaining <= 0:
                    reason = "timeout"
                    break
                waited = True
                self._waiting += 1
                try:
                    self._cond.wait(min(self._poll, remaining))
                finally:
                    self._waiting -= 1
            self._in_flight[worker] = True
            if reason != "free":
                self._released[reason] += 1
                self._waited_s += self._clock() - started
            return reason

    def after(self, worker: int, current: int, outcome: int) -> None:
        """`worker`'s call ended: its gradient was `outcome` (staleness.DROPPED,
        ACCUMULATED or APPLIED) at ps step `current`."""
        with self._cond:
            self._grow_to(worker)
            self._in_flight[worker] = False
            self.known_step = max(self.known_step, current + 1 if outcome == APPLIED else current)
            if outcome in (ACCUMULATED, APPLIED):
                if self._contributed[worker] == current:
                    self._repeats += 1
                self._contributed[worker] = current
                self._contributors.setdefault(current, set()).add(worker)
            for step in [s for s in self._contributors if s < self.known_step]:
                del self._contributors[step]
            self._cond.notify_all()

    def abandon(self, worker: int) -> None:
        """`worker`'s call failed: nothing is known of its gradient."""
        with self._cond:
            self._grow_to(worker)
            self._in_flight[worker] = False
            self._cond.notify_all()

    def forget_contributions(self) -> None:
        """The ps lost its accumulated gradients (a ps task was rebuilt): nobody waits for them."""
        with self._cond:
            self._contributed = [None] * self._n
            self._contributors.clear()
            self._cond.notify_all()

    def stats(self) -> dict:
        with self._cond:
            return {
                "step": self.known_step,
                "waits_released": dict(self._released),
                "wait_s": round(self._waited_s, 3),
                "repeats": self._repeats,
                "waiting": self._waiting,
            }

    def _grow_to(self, worker: int) -> None:
        # A worker added at run time (strategy.add_worker) counts from its
        # first call on; until then "short" may come early (the waiting
        # worker contributes again), never late.
        while self._n <= worker:
            self._contributed.append(None)
            self._in_flight.append(False)
            self._n += 1

    def _too_few(self, step: int) -> bool:
        contributors = self._contributors.get(step, set())
        able = len(contributors) + sum(
            1 for other in range(self._n) if other not in contributors and self._is_up(other)
        )
        return able < self._k
