"""One loss of ps tasks, from the first report until recovered or given up. Pure logic.

When a ps task does not answer, the recovery machine (recovery_machine.py)
holds the queue and opens a `PsLoss`; until it ends, nothing else runs. The
loss decides the waiting and the order of the steps; the machine keeps the
tasks' states and carries its answers out. It is guarded as the machine is
(one thread, one event at a time).

1. Wait for the closures still running: they fail against the lost ps and
   come back. After hang_timeout, RequeueRunning abandons the rest (nothing
   traced for the old variables may report after the recovery).
2. Wait for every lost ps to accept connections again, for ps_timeout at most
   from the first report (then give up).
3. Reconnect -> RenewAndRestore -> Retrace -> RebuildResources: recovered.
   RenewAndRestore restores the lost ps only (`mode` "part") or every
   variable ("all"): `psclient._core.part_recovery`.
   A step that fails is tried again next round; a step that fails with an
   error `attempts` times gives up. A step refused by a task that does not
   answer (a ps just back may not take connections yet) is tried again
   without counting, until ps_timeout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from psclient._core.recovery_messages import (
    RebuildResources,
    Reconnect,
    ReconnectPs,
    RenewAndRestore,
    RequeueRunning,
    Retrace,
)

__all__ = ["PS_STEPS", "PsLoss", "GiveUp", "asks_for_restarted_ps"]

#: The operations of a ps recovery (step 3 of the module doc).
PS_STEPS = (ReconnectPs, RenewAndRestore, Retrace, RebuildResources)


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """The loss cannot be recovered: every closure fails, for good."""

    why: str


@dataclasses.dataclass
class PsLoss:
    """One loss under way; see the module docstring."""

    since: float
    hang_timeout: float
    ps_timeout: float
    attempts: int
    #: When every lost ps accepted connections again (reported with PsRecovered).
    back_at: float | None = None
    requeued: bool = False
    failures: int = 0
    #: A step failed this round: the next try waits for the next round.
    retry_next_round: bool = False
    #: Whose state RenewAndRestore restores: "part" (the lost ps only) or "all" (part_recovery.py).
    mode: str = "all"

    def before_reconnect(self, now: float, running: int, unreachable: bool) -> list | GiveUp | None:
        """What still comes before the reconnect: actions (`[]`: wait on), `GiveUp`, or None: go.

        `running`: closures running now; `unreachable`: a lost ps does not accept connections yet.
        """
        if running and not self.requeued:
            if now - self.since < self.hang_timeout:
                return []
            self.requeued = True
            return [RequeueRunning()]
        # Gone, or back but not taking connections yet: either way, for ps_timeout at most.
        if now - self.since > self.ps_timeout:
            return GiveUp(f"it did not come back within ps_timeout={self.ps_timeout:g} s")
        if unreachable:
            return []
        if self.back_at is None:
            self.back_at = now
        return None

    #: A ps was lost during the step under way: the steps start again after it, whatever its outcome.
    restart: bool = False

    def widened(self, midway: bool) -> None:
        """Another ps was lost while this loss was under way (`midway`: during one of its steps):
        tries count again from none (the last failed on it) and the steps start again from the
        reconnect, once it is back."""
        self.failures, self.back_at = 0, None
        self.retry_next_round, self.restart = True, midway

    def take_restart(self) -> bool:
        """Whether the step that just ended must be followed by the steps from the start."""
        restart, self.restart = self.restart, False
        return restart

    def failed(self, error: Any) -> GiveUp | None:
        """A step failed (`error` None: a named task did not answer); it is tried again next round."""
        self.retry_next_round = True
        if error is None:
            return None  # not counted: tried again until ps_timeout (`before_reconnect`)
        self.failures += 1
        if self.failures >= self.attempts:
            return GiveUp(f"restoring it failed {self.failures} times: {error}")
        return None

    def next_step(self, op: Any, lost: tuple) -> Any:
        """The operation after `op` succeeded; None once the last one did (recovered)."""
        if isinstance(op, Reconnect):
            return RenewAndRestore(lost, self.mode)
        if isinstance(op, RenewAndRestore):
            return Retrace()
        if isinstance(op, Retrace):
            return RebuildResources()
        return None


def asks_for_restarted_ps(op: Any, ok: bool, error: Any, recovering: bool) -> bool:
    """Whether the outcome of operation `op` calls for asking each ps whether it still holds this
    coordinator's variables (a ps restarted while nothing noticed answers that it does not).

    With no ps loss under way: after a reconnect that introduced the tasks anew (a restarted ps then
    answers probes, but the old handles fail "invalid device") and after a step that failed. During
    a loss (`recovering`): after a step that failed with an error, for the ps not already lost. With
    `ps_recovery="all"` the restore writes every ps, and a second ps restarted under it failed the
    restore with "invalid device" at every try until the loss was given up (a chaos plan on 4 ps);
    a refusal (`error` None: a lost ps not back yet) asks nothing.
    """
    if recovering:
        return not ok and error is not None
    if isinstance(op, Reconnect):
        return ok and not isinstance(op, ReconnectPs)  # a ps recovery's own renews every handle
    return not ok
