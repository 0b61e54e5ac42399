"""Admission and eviction rules of dynamic embedding tables, as plain logic.

A table (`psclient.layers.DynamicEmbedding`) keeps, per ps task, a row per
admitted key and, for every key it has seen and not yet forgotten, a
counter: how often it was seen and the step it was last seen at. The clock
of a ps task counts the training lookups that reached it (one per training
step of the layer). These are the rules, shared by the TensorFlow
implementation on the ps (`psclient._coordinator.tables.dynamic_tables`) and the
tests, which check that implementation against `choose_evictions`.

- Admission: a key gets a row of its own at its `min_frequency`-th sighting
  (sightings counted per occurrence in the batches); before that it reads a
  zero vector and its gradient is dropped.
- Expiry (`ttl_steps=S`): a key last seen more than S steps ago is gone; a
  lookup treats it as never seen, and the next scan removes it.
- Capacity (`capacity=N`, rows over all ps tasks, `per_ps` each): when a ps
  task holds more rows than its share, its least recently used rows are
  evicted (ties: the smaller key first) down to the share minus `headroom`,
  so the scan, which reads every counter of the ps task, runs once per
  `headroom` new rows rather than every step. Keys still counting towards
  admission are bounded the same way, by the same share.
"""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple

from psclient._core.checks import check_positive

__all__ = ["Policy", "choose_evictions", "expired", "headroom", "per_ps", "scan_every"]


class Policy(NamedTuple):
    """A table's admission and eviction arguments, checked."""

    min_frequency: int = 1
    capacity: int | None = None
    ttl_steps: int | None = None

    @classmethod
    def checked(cls, min_frequency=1, capacity=None, ttl_steps=None) -> "Policy":
        check_positive("min_frequency", min_frequency, integer=True)
        check_positive("capacity", capacity, integer=True, optional=True)
        check_positive("ttl_steps", ttl_steps, integer=True, optional=True)
        return cls(min_frequency, capacity, ttl_steps)


def per_ps(capacity: int | None, num_ps: int) -> int | None:
    """Rows each ps task may hold: the capacity split evenly, rounded up (keys are split by a hash)."""
    return None if capacity is None else max(1, math.ceil(capacity / num_ps))


def headroom(share: int) -> int:
    """Rows freed beyond the share when a ps task is over it: 1/16 of it, at least one."""
    return max(1, share // 16)


def scan_every(ttl_steps: int | None) -> int | None:
    """Steps between scans for expired keys: an eighth of the ttl, at least one."""
    return None if ttl_steps is None else max(1, math.ceil(ttl_steps / 8))


def expired(clock: int, last_seen: int, ttl_steps: int | None) -> bool:
    return ttl_steps is not None and clock - last_seen > ttl_steps


def choose_evictions(
    entries: Iterable[tuple[int, int, int]], clock: int, policy: Policy, share: int | None
) -> set[int]:
    """The keys a scan of one ps task removes.

    `entries`: (key, count, last_seen) for every key the ps task tracks;
    `share`: its capacity (`per_ps`), or None.
    """
    entries = list(entries)
    gone = {key for key, _count, last in entries if expired(clock, last, policy.ttl_steps)}
    if share is None:
        return gone
    kept = sorted((last, key, count) for key, count, last in entries if key not in gone)
    for admitted in (True, False):
        group = [key for _last, key, count in kept if (count >= policy.min_frequency) == admitted]
        if len(group) > share:
            gone.update(group[: len(group) - (share - headroom(share))])
    return gone
