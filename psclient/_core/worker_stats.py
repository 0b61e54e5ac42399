"""Per-worker counts and recent latencies for `stats()`. Pure logic.

Every update is O(log n) at most and `summary()` is O(1), so `stats()` stays
cheap with thousands of workers (it used to sort every worker's latencies).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools

__all__ = ["WorkerStats", "LATENCY_BUCKETS", "LATENCY_WINDOW"]

#: Latencies kept per worker for stats().
LATENCY_WINDOW = 2048
#: Upper bounds (seconds) of the latency histogram that every latency ever recorded is counted in
#: (Prometheus's `psclient_closure_latency_seconds`); the last is +inf.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   float("inf"))


@dataclasses.dataclass
class WorkerStats:
    done: int = 0
    failed: int = 0
    retried: int = 0
    up: bool = True
    #: Removed from the strategy (`remove_worker`): takes no work, its slot kept.
    retired: bool = False
    #: Times the worker was taken out (died, unreachable, hung) and came back.
    failures: int = 0
    rejoins: int = 0
    #: Seconds from the first sign of the last failure to taking the worker out,
    #: and from the worker answering again to it taking work.
    last_detection_s: float | None = None
    last_recovery_s: float | None = None
    # Recent latencies only, so memory stays flat however long training runs:
    # in arrival order (to forget the oldest) and sorted (so summary() reads
    # the p99 without sorting: stats() stays cheap at thousands of workers).
    latencies: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=LATENCY_WINDOW)
    )
    _sorted: list = dataclasses.field(default_factory=list, repr=False)
    _sum: float = dataclasses.field(default=0.0, repr=False)
    # Every latency, counted into LATENCY_BUCKETS (not cumulative here), and their sum.
    _bucket_counts: list = dataclasses.field(default_factory=lambda: [0] * len(LATENCY_BUCKETS), repr=False)
    _sum_ever: float = dataclasses.field(default=0.0, repr=False)

    def record_latency(self, seconds: float) -> None:
        """Keep `seconds` among the recent latencies (O(log n) search, one memmove)."""
        window = self.latencies
        if len(window) == window.maxlen:
            oldest = window[0]
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
            self._sum -= oldest
        window.append(seconds)
        bisect.insort(self._sorted, seconds)
        self._sum += seconds
        self._bucket_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self._sum_ever += seconds

    def summary(self, *, in_flight: int) -> dict:
        """The counts and latencies; `in_flight` (running now) is the scheduler's to say."""
        lat = self._sorted
        mean = max(0.0, self._sum / len(lat)) if lat else None
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None
        return {
            "done": self.done,
            "failed": self.failed,
            "retried": self.retried,
            "in_flight": in_flight,
            "up": self.up,
            "retired": self.retired,
            "failures": self.failures,
            "rejoins": self.rejoins,
            "last_detection_s": self.last_detection_s,
            "last_recovery_s": self.last_recovery_s,
            "latency_mean_s": mean,
            "latency_p99_s": p99,
            "latency_histogram": {"cumulative": list(itertools.accumulate(self._bucket_counts)),
                                  "sum": self._sum_ever},
        }
