"""The staleness statistics and the synchronous gate, without a cluster."""

import random
import threading
import time

import pytest

from psclient._core.staleness import (
    ACCUMULATED,
    APPLIED,
    DROPPED,
    EXACT_BELOW,
    Distribution,
    StalenessStats,
)
from psclient._core.sync_gate import SyncGate

from _polling import wait_for


def nearest_rank(values, q):
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[rank - 1]


# ------------------------------------------------------------ Distribution
def test_empty_distribution_reports_nothing():
    summary = Distribution().summary()
    assert summary == {"count": 0, "mean": None, "p50": None, "p99": None, "max": None}


def test_small_values_are_exact():
    rng = random.Random(0)
    values = [rng.randrange(EXACT_BELOW) for _ in range(5000)]
    d = Distribution()
    for v in values:
        d.add(v)
    summary = d.summary()
    assert summary["count"] == len(values)
    assert summary["max"] == max(values)
    assert summary["mean"] == pytest.approx(sum(values) / len(values), abs=1e-3)
    for q, key in ((50, "p50"), (99, "p99")):
        assert summary[key] == nearest_rank(values, q)
    assert d.percentile(100) == max(values)


def test_large_values_within_a_sixteenth_below():
    rng = random.Random(1)
    values = [int(rng.lognormvariate(8, 2)) for _ in range(5000)]
    d = Distribution()
    for v in values:
        d.add(v)
    for q in (1, 50, 90, 99):
        exact = nearest_rank(values, q)
        got = d.percentile(q)
        assert exact * (1 - 1 / 16) <= got <= exact, (q, exact, got)
    assert d.summary()["max"] == max(values)  # the maximum itself is kept exactly


def test_memory_is_bounded_by_bins_not_events():
    d = Distribution()
    for v in range(200_000):
        d.add(v)
    # Exact bins below EXACT_BELOW, 16 per doubling above it.
    assert len(d._bins) <= EXACT_BELOW + 16 * (200_000).bit_length()


# --------------------------------------------------------- StalenessStats
def test_staleness_stats_overall_and_per_worker():
    stats = StalenessStats(num_workers=3)
    for s in (0, 1, 2, 3):
        stats.applied(0, s)
    stats.applied(2, 7)
    stats.applied(1, 0, update=False)  # a synchronous gradient that did not apply the mean
    stats.dropped(1, 9)
    stats.dropped(1, 12)
    summary = stats.summary()
    assert summary["count"] == 6 and summary["updates"] == 5
    assert summary["max"] == 7 and summary["p50"] == 1
    assert summary["dropped"] == 2
    assert summary["dropped_staleness"]["max"] == 12
    per_worker = summary["per_worker"]
    assert [w["count"] for w in per_worker] == [4, 1, 1]
    assert [w["dropped"] for w in per_worker] == [0, 2, 0]
    assert per_worker[0]["mean"] == 1.5 and per_worker[2]["max"] == 7


def test_workers_added_at_run_time_get_their_own_entries():
    stats = StalenessStats(num_workers=2)
    stats.applied(3, 4)  # worker 3 joined with strategy.add_worker
    stats.dropped(2, 9)
    per_worker = stats.summary()["per_worker"]
    assert [w["count"] for w in per_worker] == [0, 0, 0, 1]
    assert [w["dropped"] for w in per_worker] == [0, 0, 1, 0]


def test_highest_version_is_a_running_maximum():
    stats = StalenessStats(num_workers=1)
    for version in (3, 10, 4):
        stats.saw_version(version)
    assert stats.highest_version == 10


def test_staleness_stats_are_thread_safe():
    stats = StalenessStats(num_workers=4)

    def record(worker):
        for i in range(2000):
            stats.applied(worker, i % 5)

    threads = [threading.Thread(target=record, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stats.summary()["count"] == 8000
    assert stats.summary()["updates"] == 8000


# ---------------------------------------------------------------- SyncGate
class Cluster:
    def __init__(self, n):
        self.up = [True] * n
        self.interrupted = False


def gate(n=3, k=3, timeout=5.0, cluster=None):
    cluster = cluster or Cluster(n)
    g = SyncGate(n, k, timeout=timeout, is_up=lambda w: cluster.up[w],
                 interrupted=lambda: cluster.interrupted, poll=0.01)
    return g, cluster


def in_thread(fn, *args):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn(*args)))
    thread.start()
    return thread, result


def waiting_in(g, thread):
    """True once `thread` waits inside the gate (not merely started, nor finished)."""
    wait_for(lambda: g.stats()["waiting"] == 1 or not thread.is_alive(), 10, "the thread to wait in the gate")
    return g.stats()["waiting"] == 1 and thread.is_alive()


def test_first_call_is_free_and_the_next_waits_for_the_step():
    g, _ = gate()
    assert g.before(0) == "free"
    g.after(0, 0, ACCUMULATED)
    thread, result = in_thread(g.before, 0)
    assert waiting_in(g, thread)  # step 0 not applied yet: worker 0 waits
    g.before(1)
    g.after(1, 0, APPLIED)  # worker 1's gradient applied step 0's mean
    thread.join(2)
    assert result["value"] == "advanced"
    assert g.known_step == 1
    assert g.stats()["waits_released"]["advanced"] == 1


def test_a_worker_taken_out_ends_the_wait_when_k_cannot_be_reached():
    g, cluster = gate(n=3, k=3)
    g.before(0)
    g.after(0, 5, ACCUMULATED)
    thread, result = in_thread(g.before, 0)
    assert waiting_in(g, thread)  # workers 1 and 2 can still contribute
    cluster.up[2] = False  # the heartbeat took worker 2 out: 1 + 1 < 3
    thread.join(2)
    assert result["value"] == "short"
    # Its next gradient for step 5 counts again.
    g.after(0, 5, ACCUMULATED)
    assert g.stats()["repeats"] == 1


def test_the_wait_is_bounded_by_the_timeout():
    g, _ = gate(timeout=0.2)
    g.before(0)
    g.after(0, 0, ACCUMULATED)
    started = time.monotonic()
    assert g.before(0) == "timeout"
    assert 0.15 <= time.monotonic() - started < 2.0


def test_pause_or_shutdown_interrupts_the_wait():
    g, cluster = gate()
    g.before(0)
    g.after(0, 0, ACCUMULATED)
    thread, result = in_thread(g.before, 0)
    assert waiting_in(g, thread)
    cluster.interrupted = True
    thread.join(2)
    assert result["value"] == "interrupted"


def test_one_call_per_worker_at_a_time():
    g, _ = gate(k=1)
    assert g.before(0) == "free"
    thread, result = in_thread(g.before, 0)  # a second dispatcher thread of worker 0
    assert waiting_in(g, thread)
    g.abandon(0)  # the first call failed
    thread.join(2)
    assert result["value"] == "advanced"


def test_a_dropped_gradient_leaves_the_worker_free():
    g, _ = gate()
    g.before(0)
    g.after(0, 3, DROPPED)  # computed on step < 3: nothing of it stayed on the ps
    assert g.known_step == 3
    assert g.before(0) == "free"


def test_k_of_n_never_waits_for_the_slowest():
    # k = n - 1: two of three workers apply each step; the third is never waited for.
    g, _ = gate(n=3, k=2)
    for step in range(5):
        g.before(0)
        g.after(0, step, ACCUMULATED)
        g.before(1)
        g.after(1, step, APPLIED)
    assert g.before(0) == "free"
    assert g.stats()["waits_released"] == {"advanced": 0, "short": 0, "timeout": 0, "interrupted": 0}


def test_a_worker_added_at_run_time_takes_part():
    g, cluster = gate(n=2, k=2)
    cluster.up.append(True)  # worker 2 joins (strategy.add_worker)
    assert g.before(2) == "free"
    g.after(2, 0, ACCUMULATED)
    assert g.before(0) == "free"
    g.after(0, 0, APPLIED)
    assert g.before(2) == "free"  # its step was applied meanwhile: nothing to wait for
    assert g.known_step == 1 and g.stats()["step"] == 1


def test_contributions_lost_with_a_ps_are_not_waited_for():
    g, _ = gate()
    g.before(0)
    g.after(0, 4, ACCUMULATED)
    g.forget_contributions()  # a ps task was rebuilt: step 4's sums are gone
    assert g.before(0) == "free"
