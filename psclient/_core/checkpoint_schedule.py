"""When the recovery machine checkpoints, and who waits for it. Pure logic.

`CheckpointSchedule` holds the callers waiting on a requested checkpoint
(their tickets), when and after how many completed closures the last one was
written, and whether any checkpoint exists (to restore a lost ps from). The
machine (`RecoveryMachine`, recovery_machine.py) asks `due` each round and
reports each outcome; it decides whether the cluster is in a state to save.
"""

from __future__ import annotations

from typing import Any

from psclient._core.recovery_messages import Finish

__all__ = ["CheckpointSchedule"]


class CheckpointSchedule:
    """Requests, the interval/count rule and the last save; see the module docstring."""

    def __init__(self, *, interval: float | None, every: int | None, has_checkpoint: bool, now: float):
        self._interval = interval
        self._every = every
        #: A checkpoint exists (written by this run, or restored from).
        self.has_checkpoint = has_checkpoint
        self._saved_once = False
        self._saved_at = now
        self._saved_completed = 0
        self._requests: list[tuple[Any, str]] = []

    def request(self, ticket: Any, reason: str) -> None:
        self._requests.append((ticket, reason))

    def due(self, now: float, completed: int, *, periodic: bool) -> str | None:
        """Why a checkpoint is due now (a request's reason, or "interval"), or None.

        By interval or count only when `periodic` (checkpointing, and not
        broken), and after a first one was saved: nothing to save before the
        first requested one.
        """
        if self._requests:
            return self._requests[0][1]
        if not periodic or not self._saved_once:
            return None
        if self._interval is not None and now - self._saved_at >= self._interval:
            return "interval"
        if self._every is not None and completed - self._saved_completed >= self._every:
            return "interval"
        return None

    def saved(self, now: float, path: str, completed: int) -> list:
        """A checkpoint was written: its requests are finished with its path."""
        self._saved_at = now
        self._saved_once = self.has_checkpoint = True
        self._saved_completed = completed
        return self._finish(value=path)

    def failed(self, now: float, error: BaseException) -> list:
        """The checkpoint failed: its requests get the error."""
        self._saved_at = now
        return self._finish(error=error)

    def skipped(self) -> list:
        """Running closures did not stop in time: the requests get None (nothing saved)."""
        return self._finish(value=None)

    def closed(self) -> list:
        return self._finish(error="closed")

    def _finish(self, **outcome: Any) -> list:
        requests, self._requests = self._requests, []
        return [Finish(ticket, **outcome) for ticket, _ in requests]
