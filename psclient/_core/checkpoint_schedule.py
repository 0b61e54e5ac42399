"""When the recovery machine checkpoints, and who waits for it. Pure logic.

`CheckpointSchedule` holds the callers waiting on a requested checkpoint
(their tickets), when and after how many completed closures the last one was
written, and whether any checkpoint exists (to restore a lost ps from). The
machine (`RecoveryMachine`, recovery_machine.py) asks `due` each round and
reports each outcome; it decides whether the cluster is in a state to save.

A checkpoint is taken in a cut (`started`), then written while training goes
on (`written`): one write at a time, so nothing is due while one is in
flight; the callers waiting on it get its path or its error. An error of a
write nobody waited for (a periodic one) goes to the next caller, unless a
later write succeeded first: it is never lost.

Deltas (`delta_interval`, `delta_every`: incremental checkpoints, see
`psclient._coordinator.checkpoints.checkpoint_deltas`) fall due between full
ones: the full rule counts from the last full checkpoint, the delta rule from
the last checkpoint of either kind, and a full one due wins. `due` names a
delta "delta"; a written path with `.delta-` in its name is one (the store
writes a full checkpoint instead when it has no base to diff against).
"""

from __future__ import annotations

from typing import Any

from psclient._core.errors import StrategyClosedError
from psclient._core.recovery_messages import CopyForCheckpoint, Finish, StopCopy

__all__ = ["CheckpointSchedule", "CopyPhase", "is_delta"]


class CopyPhase:
    """The copy of the big variables before a checkpoint's cut (`MachineConfig.copies_before_cut`),
    which runs in a thread of its own so that failures are handled meanwhile: none, under way
    (`under_way`: its number, so that the end of an older one is told apart), or `done` and held
    for the pause it was made for."""

    def __init__(self) -> None:
        self.under_way: int | None = None
        self.done = False
        self._started = 0

    def start(self) -> CopyForCheckpoint:
        self._started += 1
        self.under_way = self._started
        return CopyForCheckpoint(self._started)

    def ended(self, copy: int) -> None:
        if copy == self.under_way:
            self.under_way, self.done = None, True

    def used(self) -> None:
        """The pause it was made for ended (its cut taken, or not: the engine drops it then)."""
        self.done = False

    def stop(self) -> list:
        """A ps recovery starts: the copy under way, or held, goes (its variables are renewed)."""
        held = self.under_way is not None or self.done
        self.under_way, self.done = None, False
        return [StopCopy()] if held else []


class CheckpointSchedule:
    """Requests, the interval/count rule and the last save; see the module docstring."""

    def __init__(self, *, interval: float | None, every: int | None, has_checkpoint: bool, now: float,
                 delta_interval: float | None = None, delta_every: int | None = None):
        self._interval = interval
        self._every = every
        self._delta_interval = delta_interval
        self._delta_every = delta_every
        # When, and after how many completed closures, the last checkpoint of either kind was written.
        self._any_at = now
        self._any_completed = 0
        #: A checkpoint exists (written by this run, or restored from).
        self.has_checkpoint = has_checkpoint
        self._saved_once = False
        self._saved_at = now
        self._saved_completed = 0
        self._requests: list[tuple[Any, str]] = []
        # The requests the write in flight answers; None: no write in flight.
        self._writing: list[tuple[Any, str]] | None = None
        # The error of the last write, which nobody waited for (None after a write succeeded).
        self._unobserved: BaseException | None = None

    @classmethod
    def of(cls, config: Any, now: float) -> "CheckpointSchedule":
        """The schedule of a `MachineConfig`'s checkpoint fields."""
        return cls(interval=config.checkpoint_interval, every=config.checkpoint_every,
                   has_checkpoint=config.has_checkpoint, now=now,
                   delta_interval=config.delta_checkpoint_interval, delta_every=config.delta_checkpoint_every)

    @property
    def writing(self) -> bool:
        return self._writing is not None

    def request(self, ticket: Any, reason: str) -> list:
        """Queue a request; or, after a write nobody waited for failed, answer it with that error."""
        if self._unobserved is not None:
            error, self._unobserved = self._unobserved, None
            return [Finish(ticket, error=error)]
        self._requests.append((ticket, reason))
        return []

    def due(self, now: float, completed: int, *, periodic: bool) -> str | None:
        """Why a checkpoint is due now (a request's reason, or "interval"), or None.

        By interval or count only when `periodic` (checkpointing, and not
        broken), and after a first one was saved: nothing to save before the
        first requested one.
        """
        if self._writing is not None:
            return None  # one write at a time: the next is taken once it ended
        if self._requests:
            return self._requests[0][1]
        if not periodic or not self._saved_once:
            return None
        if self._interval is not None and now - self._saved_at >= self._interval:
            return "interval"
        if self._every is not None and completed - self._saved_completed >= self._every:
            return "interval"
        if self._delta_interval is not None and now - self._any_at >= self._delta_interval:
            return "delta"
        if self._delta_every is not None and completed - self._any_completed >= self._delta_every:
            return "delta"
        return None

    def started(self) -> list:
        """The checkpoint was taken (a snapshot); its write goes on: its requests wait for it."""
        self._writing, self._requests = self._requests, []
        return []

    def written(self, now: float, path: str | None, completed: int | None, error: BaseException | None) -> list:
        """The write in flight ended: the requests it answers get `path` or `error`. An error
        none of them waited for goes to the requests queued meanwhile, else to the next one."""
        requests, self._writing = self._writing or [], None
        if error is None:
            self._unobserved = None
            if not is_delta(path):
                self._saved_at, self._saved_completed = now, completed
            self._any_at, self._any_completed = now, completed
            self._saved_once = self.has_checkpoint = True
            return self._finish(requests, value=path)
        self._saved_at = self._any_at = now
        if not requests:
            requests, self._requests = self._requests, []
            if not requests:
                self._unobserved = error
        return self._finish(requests, error=error)

    def saved(self, now: float, path: str, completed: int) -> list:
        """A checkpoint was written: its requests are finished with its path."""
        self._saved_at = self._any_at = now
        self._saved_once = self.has_checkpoint = True
        self._saved_completed = self._any_completed = completed
        return self._finish(self._take(), value=path)

    def failed(self, now: float, error: BaseException) -> list:
        """The checkpoint failed: its requests get the error."""
        self._saved_at = self._any_at = now
        return self._finish(self._take(), error=error)

    def skipped(self) -> list:
        """Running closures did not stop in time: the requests get None (nothing saved)."""
        return self._finish(self._take(), value=None)

    def closed(self) -> list:
        requests, self._writing = (self._writing or []) + self._take(), None
        return self._finish(requests, error=shut_down_error())

    def _take(self) -> list:
        requests, self._requests = self._requests, []
        return requests

    @staticmethod
    def _finish(requests: list, **outcome: Any) -> list:
        return [Finish(ticket, **outcome) for ticket, _ in requests]


def is_delta(path: str | None) -> bool:
    """Whether `path` names a delta checkpoint (`ckpt-N.delta-M`), not a full one."""
    return path is not None and ".delta-" in path.replace("\\", "/").rsplit("/", 1)[-1]


def shut_down_error() -> StrategyClosedError:
    """What a checkpoint request gets when the strategy shuts down before it is written."""
    return StrategyClosedError("the strategy was shut down before the checkpoint")
