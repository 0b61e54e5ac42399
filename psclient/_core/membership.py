"""The scheduler's side of elastic workers: joining and retiring. Pure logic.

A mixin of `Scheduler` (kept apart so that module stays small); it works on
the scheduler's own state under its lock. Worker indices are slots that never
move: a new worker gets the next index, a retired one keeps its slot (and its
stats) until a worker at the same address takes it again (`rejoin_slot`).

Events in                          | effect
-----------------------------------|----------------------------------------------
add_worker() -> index              | a new slot, down: it takes work once
                                   | worker_up(index) (its first is no rejoin)
retire_worker(worker, drain)       | takes no new closure; its waiting dispatcher
                                   | threads get None from take() and end. drain:
                                   | its running closures finish there; no drain:
                                   | they go back to the front of the queue (as
                                   | worker_lost), their late reports ignored
wait_drained(worker, timeout)      | until nothing runs on it
rejoin_slot(worker)                | a retired slot is a joining worker again
"""

from __future__ import annotations


from psclient._core.worker_stats import WorkerStats

__all__ = ["Membership"]


class Membership:
    """Adding and retiring workers; see the module docstring. Mixed into `Scheduler`."""

    def _init_membership(self) -> None:
        #: Retired slots: they take nothing, and their threads end.
        self._retired: set[int] = set()
        #: New slots not yet brought up once (their first worker_up is no rejoin).
        self._joining: set[int] = set()

    @property
    def num_workers(self) -> int:
        """Worker slots, retired ones included (indices are never reused for another slot)."""
        with self._lock:
            return len(self._workers)

    def add_worker(self) -> int:
        """A new worker slot, down until `worker_up`; returns its index."""
        with self._lock:
            index = len(self._workers)
            self._workers.append(WorkerStats(up=False))
            self._running.append({})
            self._last_done.append(float("-inf"))
            self._joining.add(index)
            return index

    def rejoin_slot(self, worker: int) -> None:
        """A retired slot becomes a joining worker again (down until `worker_up`).

        Raises:
            ValueError: the slot is not retired.
        """
        with self._lock:
            if worker not in self._retired:
                raise ValueError(f"worker {worker} is not retired")
            self._retired.discard(worker)
            self._joining.add(worker)
            self._workers[worker].retired = False

    def retire_worker(self, worker: int, *, drain: bool) -> list:
        """Take `worker` out for good; returns the closures handed back (none with `drain`)."""
        with self._lock:
            stats = self._workers[worker]
            stats.up = False
            stats.retired = True
            self._retired.add(worker)
            self._joining.discard(worker)
            requeued = [] if drain else self._requeue_running_locked([worker])
            # Its waiting threads: woken to end (take() returns None for a retired worker).
            for waiter in [w for w in self._idle if w.worker == worker]:
                self._idle.pop(waiter)
                waiter.home = None
                waiter.cond.notify()
            for waiter in self._parked.pop(worker, {}):
                waiter.home = None
                waiter.cond.notify()
            self._released.notify_all()
        self._resolve_cancelled_on_requeue()
        return requeued

    def is_retired(self, worker: int) -> bool:
        with self._lock:
            return worker in self._retired

    def retired(self) -> frozenset:
        with self._lock:
            return frozenset(self._retired)

    def running_on(self, worker: int) -> int:
        """Closures running on `worker` now."""
        with self._lock:
            return len(self._running[worker])

    def wait_drained(self, worker: int, timeout: float | None) -> bool:
        """Wait until nothing runs on `worker` (or the scheduler is closed); False on timeout."""
        with self._lock:
            return self._released.wait_for(lambda: self._closed or not self._running[worker], timeout)

    def hand_back(self, worker: int) -> list:
        """Abandon what still runs on `worker` and queue it again (a drain that took too long)."""
        with self._lock:
            requeued = self._requeue_running_locked([worker])
        self._resolve_cancelled_on_requeue()
        return requeued

    # ------------------------------------------------- for Scheduler, locked
    def _ends_thread_locked(self, worker: int) -> bool:
        return worker in self._retired

    def _first_up_locked(self, worker: int) -> bool:
        """Whether this worker_up is a new worker's first (not a rejoin); forgets it."""
        if worker in self._joining:
            self._joining.discard(worker)
            return True
        return False

    def _drained_locked(self, worker: int) -> None:
        if worker in self._retired and not self._running[worker]:
            self._released.notify_all()  # wait_drained


