"""The recovery machine's side of elastic workers: joining and leaving. Pure logic.

A mixin of `RecoveryMachine` (kept apart so that module stays small), with
the machine's own state and clock discipline: events in, actions out.

Joining (`WorkerAdded`): the worker is a rejoin candidate from the start, so
the rejoin flow carries it in: Reconnect(UP workers + it) -> CheckAnswers ->
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
from psclient._core.recovery_messages import (
    BringUp,
    Finish,
    Reconnect,
    TaskState,
    WorkerAdded,
    WorkerRetired,
)

__all__ = ["ElasticFlows"]


class ElasticFlows:
    """Joining and leaving workers; see the module docstring. Mixed into `RecoveryMachine`."""

    def _init_elastic(self) -> None:
        #: Workers that joined and are not up yet -> the ticket to finish then.
        self._joining: dict[int, Any] = {}
        #: Retired workers still in TF's view -> tickets to finish once out of it.
        self._leaving: dict[int, list] = {}

    # ------------------------------------------------------------ events
    def _on_WorkerAdded(self, event: WorkerAdded, now: float) -> list:
        worker = event.worker
        if worker == len(self.workers):
            self.workers.append(TaskState.LOST)
            self.epochs.append(0)
        elif worker < len(self.workers) and self.workers[worker] is TaskState.RETIRED \
                and worker not in self._leaving:
            self.workers[worker] = TaskState.LOST
            self.epochs[worker] += 1  # reports about its earlier process are stale
        else:
            state = self.workers[worker].value if worker < len(self.workers) else "no such slot"
            return [Finish(event.ticket, error=ValueError(
                f"worker {worker} cannot join: it is {state} (expected slot {len(self.workers)} "
                "or a retired one that left TF's view)"))]
        self._joining[worker] = event.ticket
        self._back_since[worker] = now  # a rejoin candidate: the rejoin flow brings it in
        return []

    def _on_WorkerRetired(self, event: WorkerRetired, now: float) -> list:
        worker = event.worker
        if worker >= len(self.workers) or self.workers[worker] is TaskState.RETIRED:
            return [Finish(event.ticket, value=worker)]
        actions = []
        joining = self._joining.pop(worker, None)
        if joining is not None:
            actions.append(Finish(joining, error=RuntimeError(
                f"worker {worker} was removed before it joined")))
        self._back_since.pop(worker, None)
        self._leaving.setdefault(worker, []).append(event.ticket)
        if not self._up() and self._all_down_since is None:
            self._all_down_since = now
        return actions + self._retire_out_of_view()

    # ----------------------------------------------------------- queries
    def leaving(self) -> list[int]:
        """Retired workers still in TF's view."""
        return sorted(self._leaving)

    def _leaving_in_view(self, workers: frozenset) -> frozenset:
        """The leaving workers that a Reconnect to `workers` drops from the view."""
        return frozenset(w for w in self._leaving if w in self.view and w not in workers)

    # ----------------------------------------------------------- helpers
    def _retire_out_of_view(self) -> list:
        """Leaving workers no longer in TF's view: RETIRED, their tickets finished."""
        actions = []
        # A Reconnect under way may still put a worker it names into the view.
        coming = self.op.workers if isinstance(self.op, Reconnect) else frozenset()
        for worker in [w for w in self._leaving if w not in self.view and w not in coming]:
            self.workers[worker] = TaskState.RETIRED
            self._back_since.pop(worker, None)
            actions += [Finish(ticket, value=worker) for ticket in self._leaving.pop(worker)]
        return actions

    def _joined(self, worker: int, since: float, now: float) -> list:
        """The end of the rejoin flow for a joining worker: BringUp(joined) and its ticket."""
        ticket = self._joining.pop(worker, None)
        if ticket is None:
            return [BringUp(worker, recovered_after=now - since)]
        return [BringUp(worker, recovered_after=now - since, joined=True), Finish(ticket, value=worker)]

    def _elastic_shutdown(self) -> list:
        closed = StrategyClosedError("the strategy was shut down before the worker joined or left")
        tickets = list(self._joining.values()) + [t for ts in self._leaving.values() for t in ts]
        self._joining.clear()
        self._leaving.clear()
        return [Finish(ticket, error=closed) for ticket in tickets]
