"""Elastic workers: `strategy.add_worker(address)` and `strategy.remove_worker(...)`.

Worker indices are slots that never move (TF names a worker's device and
every resource on it by its index). A new address gets the next slot; a
removed worker keeps its slot and address (`strategy.cluster` still names
it, `strategy.workers` does not), and adding that address again brings the
slot back, as a new process: its per-worker values are built again.

Adding: the address is checked, must accept TCP connections within
`connect_timeout`, then gets a slot in the scheduler (down) and its
dispatcher threads (waiting); the recovery thread carries the rest, as for a
worker that comes back (`psclient._core.joining`): TF's view is updated with
`update_server_def` (variables on the ps tasks are untouched: nothing is
created again), the worker must answer a probe, its per-worker datasets,
iterators and resources are built on it, then it takes work. `add_worker`
returns its index once it does.

Removing: the scheduler gives the worker nothing new at once. `drain=True`:
its running closures finish there (at most `hang_timeout`, then they are
handed back); `drain=False`: they go back to the front of the queue at once
and their calls are cancelled, their late results ignored. Every future
resolves once either way; a closure handed back runs again on another
worker, so its side effects (a `assign_add` on the ps) may happen twice, as
after a worker failure. Then the recovery thread drops the worker from TF's
view; `remove_worker` returns once it is out (its process may be ended then).

One change at a time: calls from several threads (a watcher and the user)
are serialized.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

from psclient._cluster.spec import Cluster, address_problem
from psclient._core import recovery_messages as rm
from psclient._core.errors import TaskUnreachableError
from psclient._core.scheduler import Scheduler
from psclient._engine.dispatch import Dispatcher
from psclient._engine.edge import Edge, Roster
from psclient._engine.recovery import Recovery

__all__ = ["Elastic"]

log = logging.getLogger("psclient")

#: How long a removed worker's dispatcher threads get to end after their last call.
_THREADS_END_S = 10.0


class Elastic:
    """The strategy's changing set of workers (see the module docstring)."""

    def __init__(self, roster: Roster, *, scheduler: Scheduler, dispatcher: Dispatcher, recovery: Recovery,
                 edge: Edge, connect_timeout: float, hang_timeout: float):
        self._roster = roster
        self._scheduler = scheduler
        self._dispatcher = dispatcher
        self._recovery = recovery
        self._edge = edge
        self._connect_timeout = connect_timeout
        self._hang_timeout = hang_timeout
        self._lock = threading.RLock()

    # ------------------------------------------------------------- queries
    @property
    def cluster(self) -> Cluster:
        """Every worker slot (removed ones keep their address), the ps tasks, the chief."""
        return self._roster.cluster

    @property
    def workers(self) -> dict[int, str]:
        """{index: address} of the workers in the strategy now (joining ones included)."""
        retired = self._scheduler.retired()
        return {i: a for i, a in enumerate(self._roster.cluster.workers) if i not in retired}

    # -------------------------------------------------------------- adding
    def add_worker(self, address: Any, timeout: float | None = None) -> int:
        address = _check_address(address)
        with self._lock:
            index, reuse = self._slot_for(address)
            _wait_accepting(self._edge, address, self._connect_timeout)
            if reuse:
                leftover = self._dispatcher.worker_threads(index)
                if leftover:
                    raise RuntimeError(
                        f"Cannot add worker {address!r} again yet: the threads of its earlier "
                        f"process ({', '.join(t.name for t in leftover)}) are still inside a call "
                        "there. Try again once they end.")
                self._scheduler.rejoin_slot(index)
            else:
                if self._scheduler.add_worker() != index or self._roster.grow(address) != index:
                    raise AssertionError("scheduler slots and cluster workers disagree")
            self._dispatcher.add_worker(index)
            ticket: concurrent.futures.Future = concurrent.futures.Future()
            self._recovery.report(rm.WorkerAdded(index, ticket))
            log.info("worker %d (%s) added; joining", index, address)
            wait = max(60.0, self._connect_timeout) if timeout is None else timeout
            try:
                ticket.result(timeout=wait)
            except concurrent.futures.TimeoutError:  # the message says all: the wait's own error is noise
                raise TimeoutError(
                    f"worker {index} ({address}) was added but has not joined within {wait:g} s "
                    "(it did not answer, or a hung task holds TF's reconnect). It stays in the "
                    f"strategy and joins once it answers; remove_worker({index}) gives up on it."
                ) from None
            return index

    def _slot_for(self, address: str) -> tuple[int, bool]:
        """(index, reuses a retired slot) for a new worker at `address`."""
        cluster = self._roster.cluster
        for job, addresses in cluster.jobs.items():
            if address not in addresses:
                continue
            index = addresses.index(address)
            if job == "worker" and self._scheduler.is_retired(index):
                return index, True
            what = f"worker {index} of this strategy" if job == "worker" else f"task {job}:{index}"
            raise ValueError(
                f"Invalid value for argument `address`. Received: address={address!r}, already "
                f"the address of {what}. Expected the address of a new worker task.")
        return cluster.num_workers, False

    # ------------------------------------------------------------ removing
    def remove_worker(self, index_or_address: Any, drain: bool = True, timeout: float | None = None) -> int:
        if not isinstance(drain, bool):
            raise TypeError(
                f"Invalid value for argument `drain`. Received: drain={drain!r} of type "
                f"{type(drain).__name__}. Expected True (running closures finish there) or "
                "False (they go back to the queue).")
        with self._lock:
            index = self._index_of(index_or_address)
            if len(self.workers) == 1:
                raise ValueError(
                    f"Invalid value for argument `index_or_address`. Received: index_or_address="
                    f"{index_or_address!r}, the last worker of the strategy. Expected another "
                    "worker: add one first (a strategy needs at least one).")
            self._scheduler.retire_worker(index, drain=drain)
            if drain and not self._scheduler.wait_drained(index, self._hang_timeout):
                log.warning("worker %d: its closures did not finish within hang_timeout=%g s; handing "
                            "them back to the queue", index, self._hang_timeout)
                drain = False
                self._scheduler.hand_back(index)
            if not drain:
                self._dispatcher.cancel_calls(index)  # their closures run elsewhere already
            ticket: concurrent.futures.Future = concurrent.futures.Future()
            self._recovery.report(rm.WorkerRetired(index, ticket))
            wait = max(60.0, self._connect_timeout, self._hang_timeout) if timeout is None else timeout
            try:
                ticket.result(timeout=wait)
            except concurrent.futures.TimeoutError:  # the message says all: the wait's own error is noise
                raise TimeoutError(
                    f"worker {index} takes no more work, but is still in TF's view after {wait:g} s "
                    "(it, or another worker, does not answer). It leaves once it answers or its "
                    "process is gone; ending its process now is safe for training.") from None
            deadline = time.monotonic() + _THREADS_END_S
            for thread in self._dispatcher.worker_threads(index):
                thread.join(max(0.0, deadline - time.monotonic()))
            log.info("worker %d (%s) removed (%s)", index, self._roster.cluster.workers[index],
                     "drained" if drain else "its closures handed back")
            return index

    def _index_of(self, index_or_address: Any) -> int:
        workers = self.workers
        if isinstance(index_or_address, str):
            found = [i for i, a in workers.items() if a == index_or_address]
        elif isinstance(index_or_address, int) and not isinstance(index_or_address, bool):
            found = [index_or_address] if index_or_address in workers else []
        else:
            raise TypeError(
                "Invalid value for argument `index_or_address`. Received: index_or_address="
                f"{index_or_address!r} of type {type(index_or_address).__name__}. Expected a "
                "worker's index (int) or address ('host:port').")
        if not found:
            raise ValueError(
                "Invalid value for argument `index_or_address`. Received: index_or_address="
                f"{index_or_address!r}, not a worker of this strategy. Expected one of "
                f"{workers} (index: address).")
        return found[0]


def _check_address(address: Any) -> str:
    if not isinstance(address, str):
        raise TypeError(
            f"Invalid value for argument `address`. Received: address={address!r} of type "
            f"{type(address).__name__}. Expected a 'host:port' string.")
    problem = address_problem(address)
    if problem is not None:
        raise ValueError(
            f"Invalid value for argument `address`. Received: address={address!r} ({problem}). "
            "Expected 'host:port' with a port in 1..65535.")
    return address


def _wait_accepting(edge: Edge, address: str, timeout: float) -> None:
    """Until `address` accepts TCP connections; TaskUnreachableError after `timeout`."""
    deadline = time.monotonic() + timeout
    while not edge.tcp_reachable(address, timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TaskUnreachableError(
                f"Cannot add worker {address!r}: nothing accepted a connection there within "
                f"connect_timeout={timeout:g} s. Check that `psclient serve` runs there and that "
                "the address and port are right.", task="worker", address=address)
        time.sleep(min(0.2, left))  # the task may still be starting
