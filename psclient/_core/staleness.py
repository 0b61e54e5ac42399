"""How stale the applied updates are: counts, mean and percentiles. Pure logic.

An update's staleness is the number of updates that took their place in the
model's order (their version "ticket") between the moment its step read the
model version and its own ticket: 0 when nothing came between, 3 when three
other updates did. `psclient._coordinator.training.sync` measures it on the ps; this
module only keeps the numbers.

Every event is O(1): a count, a sum, a maximum and a sparse histogram whose
bins are exact up to `EXACT_BELOW` and logarithmic above (16 bins per
doubling, so a percentile above it is reported as the lower edge of its bin,
at most 1/16 below the true value). Memory stays bounded however long
training runs (at most a few hundred bins per worker); `summary()` walks the
bins, never the events.
"""

from __future__ import annotations

import threading

__all__ = ["APPLIED", "ACCUMULATED", "DROPPED", "EXACT_BELOW", "STALENESS_BUCKETS", "Distribution", "StalenessStats"]

#: What became of one gradient, as the step function reports it.
DROPPED, ACCUMULATED, APPLIED = 0, 1, 2

#: Staleness values below this are counted exactly.
EXACT_BELOW = 128
_SUB_BINS = 16  # bins per doubling above EXACT_BELOW
#: Upper bounds of the staleness histogram Prometheus reads (`Distribution.histogram`); the last is +inf.
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, float("inf"))


def _bin(value: int) -> int:
    """The lower edge of `value`'s bin (the value itself below EXACT_BELOW)."""
    if value < EXACT_BELOW:
        return value
    shift = value.bit_length() - _SUB_BINS.bit_length()  # keep the leading bit and 4 more
    return (value >> shift) << shift


class Distribution:
    """Count, mean, p50, p99 and max of non-negative integers."""

    __slots__ = ("count", "_sum", "max", "_bins")

    def __init__(self):
        self.count = 0
        self._sum = 0
        self.max: int | None = None
        self._bins: dict[int, int] = {}

    def add(self, value: int) -> None:
        value = int(value)
        self.count += 1
        self._sum += value
        self.max = value if self.max is None else max(self.max, value)
        edge = _bin(value)
        self._bins[edge] = self._bins.get(edge, 0) + 1

    def percentile(self, q: float) -> int | None:
        """The nearest-rank `q`-th percentile (0 < q <= 100), None when empty."""
        if not self.count:
            return None
        rank = max(1, -(-self.count * q // 100))  # ceil(count * q / 100)
        seen = 0
        for edge in sorted(self._bins):
            seen += self._bins[edge]
            if seen >= rank:
                return edge
        return self.max  # unreachable: the bins hold `count` values

    def histogram(self, bounds: tuple = STALENESS_BUCKETS) -> dict:
        """Cumulative counts of values <= each of `bounds`, and their sum. Above EXACT_BELOW a
        value counts at its bin's lower edge, at most 1/16 below its own value."""
        cumulative = [sum(n for edge, n in self._bins.items() if edge <= bound) for bound in bounds]
        return {"cumulative": cumulative, "sum": self._sum}

    def summary(self) -> dict:
        return {
            "count": self.count,
            "mean": round(self._sum / self.count, 3) if self.count else None,
            "p50": self.percentile(50),
            "p99": self.percentile(99),
            "max": self.max,
        }


class StalenessStats:
    """Staleness of applied updates, overall and per worker, and the updates dropped.

    `applied(worker, staleness)` for an update that was applied (in
    synchronous mode: a gradient accepted into its step's mean, and
    `update=True` for the one that applied the mean); `dropped(worker,
    staleness)` for one that was not (too stale for `max_staleness`, or a
    gradient for a step already applied). Thread-safe.
    """

    def __init__(self, num_workers: int):
        self._lock = threading.Lock()
        self._all = Distribution()
        self._workers = [Distribution() for _ in range(num_workers)]
        self._dropped = [0] * num_workers
        self._dropped_staleness = Distribution()
        self._updates = 0
        #: The highest model version any step reported (a floor for a rebuilt counter).
        self.highest_version = 0

    def _grow_to(self, worker: int) -> None:
        # Workers added at run time (strategy.add_worker) get their slots here.
        while len(self._workers) <= worker:
            self._workers.append(Distribution())
            self._dropped.append(0)

    def applied(self, worker: int, staleness: int, *, update: bool = True) -> None:
        with self._lock:
            self._grow_to(worker)
            self._all.add(staleness)
            self._workers[worker].add(staleness)
            self._updates += update

    def dropped(self, worker: int, staleness: int) -> None:
        with self._lock:
            self._grow_to(worker)
            self._dropped[worker] += 1
            self._dropped_staleness.add(staleness)

    def saw_version(self, version: int) -> None:
        with self._lock:
            self.highest_version = max(self.highest_version, int(version))

    def summary(self) -> dict:
        """`count/mean/p50/p99/max` of applied updates, `dropped`, and the same per worker;
        `updates`: model updates made (fewer than `count` in synchronous mode)."""
        with self._lock:
            summary = self._all.summary()
            summary["updates"] = self._updates
            summary["histogram"] = self._all.histogram()
            summary["dropped"] = sum(self._dropped)
            summary["dropped_staleness"] = self._dropped_staleness.summary()
            summary["per_worker"] = [
                dict(distribution.summary(), dropped=dropped)
                for distribution, dropped in zip(self._workers, self._dropped)
            ]
            return summary
