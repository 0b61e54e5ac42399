"""Changing TF's view of the cluster without hanging on a task that does not answer.

TF's `update_server_def` (`Edge.connect`) waits for good on a named task that
does not answer. So before a Reconnect, every worker it names (but the one
coming back) and every leaving one it drops must answer a probe first; one
that does not is *refused*, and the recovery machine takes it out and decides
again next round. A task that does not take the connection itself (a worker
that died after its probe, a restarted ps whose channel has not reconnected
yet) refuses the same way: not a failed step.
"""

from __future__ import annotations

import logging
import time

from psclient._core.errors import first_line
from psclient._core.health import Prober
from psclient._core.recovery_messages import DropWorkers, Reconnect
from psclient._core.tcp_state import TcpState
from psclient._engine.edge import Edge, Roster

__all__ = ["Reconnector", "Refused"]

log = logging.getLogger("psclient")
#: TF's (and gRPC's) code for UnavailableError: the task did not take the call.
_UNAVAILABLE = 14


class Refused:
    """A Reconnect not tried: these workers (-> TCP state) did not answer first."""

    def __init__(self, workers: dict):
        self.workers = workers


class Reconnector:
    """Carries out the recovery machine's Reconnect operations; see the module docstring."""

    def __init__(self, edge: Edge, roster: Roster, prober: Prober, *, probe_timeout: float):
        self._edge = edge
        self._roster = roster
        self._prober = prober
        self._probe_timeout = probe_timeout

    def reconnect(self, action: Reconnect, retired: frozenset) -> bool | Refused:
        """Every named worker (but the returning one) must answer first: TF's
        `update_server_def` waits for good on a task that does not. So must
        each leaving one it drops (retired), unless its port refuses (gone)."""
        leaving = [w for w in action.leaving
                   if self._edge.tcp_state(self._roster.cluster.address("worker", w), 1.0) != TcpState.CLOSED]
        probes = {
            worker: self._prober.start(self._edge.worker_device(worker))
            for worker in [*action.workers, *leaving] if worker != action.returning
        }
        deadline = time.monotonic() + min(2.0, self._probe_timeout)
        refused = {}
        for worker, probe in probes.items():
            # Any answer, even an error, means the process is there; an error
            # can come from the stale view this reconnect replaces.
            answered = probe.done.wait(max(0.0, deadline - time.monotonic()))
            state = self._edge.tcp_state(self._roster.cluster.address("worker", worker), 1.0)
            if not (answered and (probe.ok or state == TcpState.OPEN)):
                refused[worker] = state
        if refused:
            return Refused(refused)
        try:
            self._edge.connect(self._roster.cluster, sorted(action.workers))
        except self._edge.op_error() as error:
            if getattr(error, "error_code", None) != _UNAVAILABLE:
                raise
            # A named task did not take the connection: a worker that died
            # after its probe (its port now refuses: taken out at once), or a
            # restarted ps whose channel has not reconnected yet (TF's gRPC
            # channels retry within a second). Not a failed step: next round.
            log.info("reconnect: a task was not reachable yet (%s); trying again", first_line(error))
            return Refused({
                worker: state for worker in action.workers
                if (state := self._edge.tcp_state(self._roster.cluster.address("worker", worker), 1.0)) == TcpState.CLOSED
            })
        gone = sorted(set(range(self._roster.cluster.num_workers)) - set(action.workers) - retired)
        if isinstance(action, DropWorkers) and gone:  # (a removed worker is no longer expected back)
            log.info("worker(s) %s left out of the cluster until they answer again", gone)
        return True
