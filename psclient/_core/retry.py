"""Backoff between tries of a recovery step that failed. Pure logic.

A step that fails the same way each time (a checkpoint against a ps that
no longer holds its variables, a reconnect a task refuses) must not be
tried again at once: the recovery machine would spin, and log each failure,
as fast as the step fails. Each step (a key) waits `base * 2**(n-1)` seconds
after its n-th failure in a row, at most `cap`; a success starts over.
"""

from __future__ import annotations

from typing import Hashable

__all__ = ["Backoff"]


class Backoff:
    """Consecutive failures per step and the earliest time each is tried again."""

    def __init__(self, base: float = 0.5, cap: float = 30.0):
        self.base, self.cap = base, cap
        self._failures: dict[Hashable, int] = {}
        self._not_before: dict[Hashable, float] = {}

    def failed(self, key: Hashable, now: float, cap: float | None = None) -> float:
        """Count a failure of `key` at `now`; return how long it now waits (at most `cap`)."""
        failures = self._failures.get(key, 0) + 1
        self._failures[key] = failures
        delay = min(self.cap if cap is None else cap, self.base * 2 ** (failures - 1))
        self._not_before[key] = now + delay
        return delay

    def succeeded(self, key: Hashable) -> None:
        self._failures.pop(key, None)
        self._not_before.pop(key, None)

    def ready(self, key: Hashable, now: float) -> bool:
        return now >= self._not_before.get(key, float("-inf"))

    def failures(self, key: Hashable) -> int:
        """Failures of `key` in a row so far."""
        return self._failures.get(key, 0)
