"""Which closures run where now, and which reports come too late. Pure logic.

A closure taken by a worker runs there as one *attempt* (`closure.attempts`
counts them). An attempt ends when its worker reports it, or earlier when it
is abandoned: its worker was lost, a ps recovery could not wait for it, the
run failed. A report from an abandoned attempt is *stale*: counted, ignored,
so each future still resolves exactly once.

The scheduler owns one `RunningAttempts`; it is guarded by the scheduler's
lock (every method is called with it held), as `Membership` and `Waiters` are.
"""

from __future__ import annotations

from psclient._core.closure import Closure

__all__ = ["RunningAttempts"]


class RunningAttempts:
    """The running attempts per worker slot; see the module docstring."""

    def __init__(self, num_workers: int):
        self._by_worker: list[dict[int, Closure]] = [{} for _ in range(num_workers)]
        #: Running attempts over all workers (kept, not summed: cheap at 1,000 workers).
        self.total = 0
        #: Reports that came from an abandoned attempt.
        self.stale = 0

    def add_worker(self) -> None:
        self._by_worker.append({})

    def start(self, worker: int, closure: Closure) -> None:
        closure.worker = worker
        self._by_worker[worker][closure.id] = closure
        self.total += 1

    def end(self, worker: int, closure: Closure, attempt: int | None) -> bool:
        """End the attempt `worker` reports; False if it was abandoned earlier (stale).

        `attempt` is `closure.attempts` as it was when the closure was taken
        (None: whichever attempt runs on `worker`).
        """
        current = closure.worker == worker and (attempt is None or attempt == closure.attempts)
        if not current or self._by_worker[worker].pop(closure.id, None) is None:
            self.stale += 1
            return False
        closure.worker = None
        self.total -= 1
        return True

    def abandon(self, worker: int) -> list[Closure]:
        """Give up on every attempt running on `worker`; returns their closures."""
        running = list(self._by_worker[worker].values())
        self._by_worker[worker].clear()
        self.total -= len(running)
        for closure in running:
            closure.worker = None
        return running

    def busy_workers(self) -> list[int]:
        return [worker for worker, running in enumerate(self._by_worker) if running]

    def on(self, worker: int) -> int:
        """Attempts running on `worker` now."""
        return len(self._by_worker[worker])

    def runs(self, worker: int, closure: Closure) -> bool:
        return closure.id in self._by_worker[worker]
