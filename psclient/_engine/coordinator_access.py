"""The engine's side of `psclient._core.ps_access`: reads and writes of ps state made
on the coordinator (traces, checkpoints, Keras's metrics, dynamic tables: see
`psclient._coordinator.ps_state`), run again once the recovery has restored a lost ps.

What a failed access means is decided in `psclient._core.ps_access`; here are
the probes (`FailureProbes`, as a failed closure's), the event a failed closure
posts for a lost ps (`PsNotAnswering`) and the recovery's wait for it to settle.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from psclient._core import ps_access
from psclient._core.errors import StrategyClosedError
from psclient._core.recovery_messages import PsNotAnswering
from psclient._engine.edge import Edge, Roster
from psclient._engine.recovery import Recovery

__all__ = ["CoordinatorAccess"]

T = TypeVar("T")

#: Beyond the ps recovery's own limits (hang_timeout for running closures,
#: ps_timeout for the ps to come back): its steps once the ps is back
#: (reconnect, restore, retrace). The recovery gives up by itself before that.
_STEPS_AFTER_BACK_S = 120.0


class CoordinatorAccess:
    """`run(access, what)`: `access()`, through a ps loss (`psclient._core.ps_access`; `wait=False`:
    a lost ps reported, not waited for)."""

    def __init__(self, recovery: Recovery, edge: Edge, roster: Roster,
                 sleep: Callable[[float], None] = time.sleep):
        self._recovery = recovery
        self._edge = edge
        self._roster = roster
        self._sleep = sleep
        config = recovery.config
        self.settle_timeout = config.hang_timeout + config.ps_timeout + _STEPS_AFTER_BACK_S

    def run(self, access: Callable[[], T], what: str, *, wait: bool = True) -> T:
        return ps_access.through_ps_loss(access, self, what, self._sleep, wait=wait)

    # ------------------------------------------------------------- PsAccessEdge
    def is_op_error(self, error: BaseException) -> bool:
        # Or caused by one: a checkpoint a ps could not write raises CheckpointWriteError from TF's error.
        op_error = self._edge.op_error()
        seen = 0
        while error is not None and seen < 8:
            if isinstance(error, op_error):
                return True
            error, seen = error.__cause__, seen + 1
        return False

    def connection_changes(self) -> int:
        return self._edge.connection_changes()

    def lost_ps(self) -> tuple:
        return self._recovery.probes.lost_ps()

    def ps_epoch(self) -> int:
        return self._recovery.probes.ps_epoch()

    def report_lost(self, lost: tuple, epoch: int) -> None:
        self._recovery.report(PsNotAnswering(lost, epoch))

    def wait_settled(self, epoch: int, timeout: float) -> bool:
        return self._recovery.wait_ps_settled(epoch, timeout)

    def given_up(self) -> BaseException | None:
        if self._recovery.broken is not None:
            return self._recovery.broken
        if self._recovery.stopped:  # shut down, or the recovery thread died
            return StrategyClosedError("the strategy was shut down")
        return None

    def describe(self, lost: tuple) -> tuple[str, str | None]:
        ps = lost[0] if lost else 0
        return f"ps:{ps}", self._roster.cluster.address("ps", ps)
