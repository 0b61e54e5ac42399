"""Workers joining and leaving at run time, for the recovery machine. Pure logic.

`Joins` holds the tickets of the callers waiting on `add_worker` and
`remove_worker` (concurrent.futures.Future objects the recovery thread
finishes); the machine (`RecoveryMachine`, recovery_machine.py) owns the
task states and gives them to each call explicitly.

Joining (`WorkerAdded`): the worker is a rejoin candidate from the start, so
the rejoin flow carries it in: RejoinWorker(UP workers + it) -> CheckAnswers ->
RebuildWorker (its per-worker datasets and resources) -> BringUp(joined),
and its ticket is finished with its index. A failed step leaves it out of
rotation, tried again as any returning worker is (once it answers).

Leaving (`WorkerRetired`): the caller has drained it or handed its closures
back already (the scheduler gives it nothing). It is no longer UP for any
Reconnect, so the next one (the drop flow starts one at once) leaves it out
of TF's view; that Reconnect names it in `leaving`, and the recovery thread
does not start it while the worker neither answers nor refuses connections
(TF would wait on a hung one for good). Until it is out of the view it is
heartbeat-probed like the others; out of it, it is RETIRED, never probed,
and its ticket is finished. Checkpoints wait until then, as for a gone worker.
"""

from __future__ import annotations

from typing import Any

from psclient._core.errors import StrategyClosedError
from psclient._core.recovery_messages import BringUp, Finish, TaskState

__all__ = ["Joins"]


class Joins:
    """The joining and leaving workers and their tickets; see the module docstring."""

    def __init__(self):
        #: Workers that joined and are not up yet -> the ticket to finish then.
        self._joining: dict[int, Any] = {}
        #: Retired workers still in TF's view -> tickets to finish once out of it.
        self._leaving: dict[int, list] = {}

    # ----------------------------------------------------------- queries
    def is_leaving(self, worker: int) -> bool:
        return worker in self._leaving

    def leaving(self) -> list[int]:
        """Retired workers still in TF's view."""
        return sorted(self._leaving)

    def leaving_in_view(self, view: frozenset, workers: frozenset) -> frozenset:
        """The leaving workers that a Reconnect from `view` to `workers` drops."""
        return frozenset(w for w in self._leaving if w in view and w not in workers)

    # ------------------------------------------------------------ events
    def add(self, worker: int, ticket: Any, workers: list, epochs: list) -> list:
        """A worker joins at slot `worker` (a new one, or a retired one out of TF's view).

        Updates the machine's `workers` states and `epochs` in place. Returns
        [] when it joins (the caller makes it a rejoin candidate), or the
        Finish that refuses it.
        """
        if worker == len(workers):
            workers.append(TaskState.LOST)
            epochs.append(0)
        elif worker < len(workers) and workers[worker] is TaskState.RETIRED and worker not in self._leaving:
            workers[worker] = TaskState.LOST
            epochs[worker] += 1  # reports about its earlier process are stale
        else:
            state = workers[worker].value if worker < len(workers) else "no such slot"
            return [Finish(ticket, error=ValueError(
                f"worker {worker} cannot join: it is {state} (expected slot {len(workers)} "
                "or a retired one that left TF's view)"))]
        self._joining[worker] = ticket
        return []

    def leave(self, worker: int, ticket: Any) -> list:
        """A worker is retired: it leaves once out of TF's view. Returns the Finish of
        its join ticket, if it had not joined yet."""
        actions = []
        joining = self._joining.pop(worker, None)
        if joining is not None:
            actions.append(Finish(joining, error=RuntimeError(f"worker {worker} was removed before it joined")))
        self._leaving.setdefault(worker, []).append(ticket)
        return actions

    def out_of_view(self, view: frozenset, coming: frozenset, workers: list) -> tuple[list, list[int]]:
        """Leaving workers no longer in TF's view (nor coming into it): RETIRED in
        `workers`, their tickets finished. Returns (actions, those workers)."""
        actions, left = [], []
        for worker in [w for w in self._leaving if w not in view and w not in coming]:
            workers[worker] = TaskState.RETIRED
            left.append(worker)
            actions += [Finish(ticket, value=worker) for ticket in self._leaving.pop(worker)]
        return actions, left

    def joined(self, worker: int, since: float, now: float) -> list:
        """The end of the rejoin flow: BringUp, joined (and its ticket finished) if it was joining."""
        ticket = self._joining.pop(worker, None)
        if ticket is None:
            return [BringUp(worker, recovered_after=now - since)]
        return [BringUp(worker, recovered_after=now - since, joined=True), Finish(ticket, value=worker)]

    def shutdown(self) -> list:
        """Every waiting ticket fails: the strategy is shutting down."""
        closed = StrategyClosedError("the strategy was shut down before the worker joined or left")
        tickets = list(self._joining.values()) + [t for ts in self._leaving.values() for t in ts]
        self._joining.clear()
        self._leaving.clear()
        return [Finish(ticket, error=closed) for ticket in tickets]
