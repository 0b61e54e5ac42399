"""A lost ps that came back gets its state again: the recovery thread's RenewAndRestore step.

What is restored (the lost ps only, or every variable) is decided in
`psclient._core.part_recovery`; this module carries it out through the
variable store and the checkpoint directory, tells the data ledgers, and
keeps what `stats()["ps"][k]` reports of each recovery.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from psclient._core import recovery_messages as rm
from psclient._core.part_recovery import RestoreScope, closures_undone, kept, restore_scope, rolled_back

__all__ = ["PSStats", "PsRestore"]

log = logging.getLogger("psclient")


@dataclasses.dataclass
class PSStats:
    failures: int = 0
    recoveries: int = 0
    last_recovery_s: float | None = None
    #: Closures completed since the checkpoint whose updates on this ps were undone, in all (each
    #: closure once: a second restore of the same checkpoint counts only those since the first).
    rolled_back_closures: int = 0
    #: What the last recovery that restored this ps took back (`part_recovery.rolled_back`; mode
    #: "kept": it came back holding its variables, nothing restored).
    rolled_back: dict | None = None


class PsRestore:
    """RenewAndRestore and PsRecovered, for the recovery thread (`psclient._engine.recovery`).

    `completed()`: closures completed so far (the scheduler's);
    `meta_restored(meta)` / `meta_restored(meta, lost=...)`: the data ledgers
    roll back to `meta` ("all") or keep theirs ("part", see `part_recovery`).
    """

    def __init__(self, store: Any, checkpoints: Any, num_ps: int, completed: Callable[[], int],
                 meta_restored: Callable[..., None], clock: Callable[[], float],
                 holding: Callable[[tuple], tuple] = lambda lost: ()):
        # `holding(lost)`: those of the `lost` ps that answer holding this coordinator's variables
        # (`FailureProbes.holding`; by default none: every lost ps is restored).
        self._store = store
        self._checkpoints = checkpoints
        self._num_ps = num_ps
        self._completed = completed
        self._meta_restored = meta_restored
        self._clock = clock
        self._holding = holding
        self.ps_stats = [PSStats() for _ in range(num_ps)]
        self._completed_then: int | None = None
        self._restored: dict | None = None
        self._scope: RestoreScope | None = None
        self._kept: tuple = ()
        # ps -> closures completed when its last restore ended (`closures_undone`).
        self._restored_at: dict[int, int] = {}
        # The ps whose variables a step renewed and whose restore has not ended (it failed, e.g. a
        # function not yet registered on the new task): they answer holding variables then, the
        # renewed ones, and must not be taken for a ps that hung (its state was lost with the task).
        self._renewed_unrestored: set[int] = set()

    def renew_and_restore(self, action: rm.RenewAndRestore) -> bool:
        """New resources on the lost ps, then their state (or every one's) from the newest checkpoint.

        A lost ps that answers holding its variables (it hung, it was not
        restarted) keeps them (`part_recovery.restore_scope`); if every lost ps
        does, nothing is renewed or restored.
        """
        lost = tuple(action.lost)
        holding = tuple(ps for ps in self._holding(lost) if ps not in self._renewed_unrestored)
        scope = restore_scope(action.mode, lost, holding, self._num_ps)
        # Under "all", a ps that hung is restored with the rest once another lost its state.
        restored = frozenset() if scope is None else scope.restored_ps
        self._kept = tuple(ps for ps in lost if ps in holding and ps not in restored)
        self._scope, self._restored, self._completed_then = scope, None, None
        if scope is None:
            log.warning("ps task(s) %s answered again holding their variables (they hung, they were not "
                        "restarted): nothing restored, training goes on with their state", list(lost))
            return True
        self._renewed_unrestored |= set(scope.lost)
        renewed = self._store.renew(set(scope.lost))
        restored = self._checkpoints.restore(self._store.named(), tables=self._store.tables(),
                                             only_ps=scope.only_ps)
        self._renewed_unrestored -= set(scope.lost)
        self._restored = restored
        self._completed_then = None if restored is None else restored["completed_closures"]
        # While nothing is dispatched: what the coordinator keeps of the data follows.
        meta = None if restored is None else restored.get("meta")
        if scope.rolls_back_ledgers:
            self._meta_restored(meta)
        else:
            self._meta_restored(meta, lost=frozenset(scope.lost))
        log.info("ps task(s) %s: %d variables re-created, %s restored%s", list(scope.lost), renewed,
                 "every variable" if scope.only_ps is None else "their own variables",
                 f"; ps task(s) {list(self._kept)} kept theirs (they hung)" if self._kept else "")
        return True

    def recovered(self, action: rm.PsRecovered, where: str | None) -> None:
        """The lost ps answer with their state again: what `stats()` reports of it."""
        completed = self._completed()
        recovery = self._clock() - action.back_at
        for ps in action.lost:
            stats = self.ps_stats[ps]
            stats.recoveries += 1
            stats.last_recovery_s = recovery
        for ps, what in kept(self._kept).items():
            self.ps_stats[ps].rolled_back = what
        scope = self._scope
        if scope is None:
            if not self._kept:  # no RenewAndRestore ran (not expected): reported as a whole rollback
                scope = RestoreScope("all", tuple(action.lost), self._num_ps)
            else:
                return
        counts = (self._restored or {}).get("restored", {})
        where = (self._restored or {}).get("path", where)  # the one used (a damaged newest is passed over)
        undone = closures_undone(completed, self._completed_then, self._restored_at, scope.restored_ps)
        report = rolled_back(scope, counts.get("variables", {}), counts.get("rows", {}), undone, where)
        for ps, what in report.items():
            if 0 <= ps < len(self.ps_stats):
                self.ps_stats[ps].rolled_back = what
                self.ps_stats[ps].rolled_back_closures += undone[ps]
                self._restored_at[ps] = completed
        closures = max(undone.values(), default=0)
        if scope.mode == "part":
            log.warning(
                "ps task(s) %s recovered from %s: their own variables restored, the other ps kept "
                "theirs; the updates of %d closures completed since were lost on them only "
                "(%.2f s after the task came back)", list(scope.lost), where, closures, recovery)
        else:
            log.warning(
                "ps task(s) %s recovered from %s: every variable restored; %d completed closures "
                "rolled back (%.2f s after the task came back)", list(scope.lost), where, closures, recovery)
        self._scope = self._restored = None
