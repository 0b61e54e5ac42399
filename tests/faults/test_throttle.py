"""LocalCluster.throttle: stragglers on demand.

Pure tests of the duty cycle's arithmetic and of the argument checks; a busy
process (no TensorFlow) throttled by the helper; a worker of the shared
cluster throttled while steps run on both workers (it must complete clearly
fewer, and catch up once restored); the helper's life bound to its
LocalCluster's, on close() and when the owner is SIGKILLed.

Bounds are tolerant: this machine is shared and loaded, so every rate is
compared with one measured beside it, never with a constant.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from psclient._cluster.local import LocalCluster
from psclient._cluster.throttle import Throttler, check_fraction, check_period
from psclient._cluster.throttle_helper import duty_cycle, phase

from _paths import ROOT_STR

pytestmark = [pytest.mark.timeout(240)]


# ------------------------------------------------------------------ pure
def test_duty_cycle_splits_the_period():
    assert duty_cycle(0.25, 0.1) == pytest.approx((0.025, 0.075))
    assert duty_cycle(1.0, 0.2) == (0.2, 0.0)
    running, stopped = duty_cycle(0.3, 0.5)
    assert running + stopped == pytest.approx(0.5) and running / 0.5 == pytest.approx(0.3)
    for fraction, period in ((0, 0.1), (1.5, 0.1), (0.5, 0), (-0.1, 0.1)):
        with pytest.raises(ValueError):
            duty_cycle(fraction, period)


def test_phase_runs_first_then_stops_each_period():
    start, f, p = 100.0, 0.25, 0.1
    assert phase(100.0, start, f, p) == (True, pytest.approx(100.025))
    assert phase(100.02, start, f, p) == (True, pytest.approx(100.025))
    assert phase(100.025, start, f, p) == (False, pytest.approx(100.1))
    assert phase(100.099, start, f, p) == (False, pytest.approx(100.1))
    # A helper that wakes late lands in the right part of a later period.
    assert phase(103.45, start, f, p) == (False, pytest.approx(103.5))
    assert phase(103.51, start, f, p) == (True, pytest.approx(103.525))
    assert phase(50.0, start, f, p)[0] is True  # Before the start (clock quirks): running.
    assert phase(123.0, start, 1.0, p) == (True, math.inf)


def test_phase_gives_the_fraction_over_many_periods():
    # Sample a fake clock finely over 37 periods: the running share is the fraction.
    for fraction in (0.1, 0.25, 0.5, 0.9):
        samples = [phase(i * 0.0001, 0.0, fraction, 0.1)[0] for i in range(37_000)]
        assert sum(samples) / len(samples) == pytest.approx(fraction, abs=0.002)


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.01, 2, float("nan"), float("inf"), True, "0.5", None])
def test_bad_fraction_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"Invalid value for argument `fraction`. Received: fraction="):
        check_fraction(bad)


def test_good_fractions_pass():
    assert check_fraction(1) == 1.0 and check_fraction(0.25) == 0.25 and check_fraction(1e-3) == 1e-3


@pytest.mark.parametrize("bad", [0, 0.001, 11, -1, float("nan"), "1", True])
def test_bad_period_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"Invalid value for argument `period`. Received: period="):
        check_period(bad)


# ---------------------------------------------------- the helper, no TF
def _cpu_rate(process, window):
    """CPU seconds per wall second of `process` over `window` s."""
    before, start = sum(process.cpu_times()[:2]), time.monotonic()
    time.sleep(window)
    return (sum(process.cpu_times()[:2]) - before) / (time.monotonic() - start)


def test_helper_slows_a_busy_process_and_restores_it():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    throttler = Throttler()
    try:
        process = psutil.Process(busy.pid)
        full = _cpu_rate(process, 1.5)
        assert throttler.set(busy.pid, 0.25) is True
        helper = psutil.Process(throttler.pid)
        slow = _cpu_rate(process, 2.0)
        assert throttler.set(busy.pid, 1.0) is True
        assert process.status() != psutil.STATUS_STOPPED  # Continued before set() returned.
        restored = _cpu_rate(process, 1.5)
        print(f"busy loop CPU/s: full {full:.3f}, at 0.25 {slow:.3f}, restored {restored:.3f}")
        # A stopped process uses no CPU: at most a quarter, plus slack for the helper waking late.
        assert slow <= 0.45 * max(full, restored), (full, slow, restored)
        assert slow > 0.0, "a process throttled at 0.25 must still run"
        assert restored > 1.5 * slow, (slow, restored)
        assert throttler.set(busy.pid, 0.5) is True
    finally:
        throttler.close()
        status_after_close = process.status()
        busy.kill()
        busy.wait(timeout=30)
    assert not helper.is_running() or helper.status() == psutil.STATUS_ZOMBIE
    assert status_after_close != psutil.STATUS_STOPPED  # The helper continued it before it exited.


def test_a_gone_process_answers_false():
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(timeout=30)
    throttler = Throttler()
    try:
        assert throttler.set(done.pid, 0.5) is False
    finally:
        throttler.close()


# ------------------------------------------------ a throttled TF worker
@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    """This module's own cluster (it stops and throttles the ps); logs kept for a failure's story."""
    with LocalCluster(num_workers=2, num_ps=1, log_dir=tmp_path_factory.mktemp("throttle-logs")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def strategy(local_cluster):
    from psclient._coordinator.strategy import ParameterServerStrategy

    s = ParameterServerStrategy(local_cluster.cluster)
    yield s
    s.shutdown()


_STEPS_PER_ROUND = 400


def _steps_per_worker(strategy, step, window):
    """Steps completed by each worker while both are kept busy for `window` s."""
    before = [w["done"] for w in strategy.stats()["workers"]]
    deadline = time.monotonic() + window
    while time.monotonic() < deadline:
        futures = [strategy.schedule(step) for _ in range(_STEPS_PER_ROUND)]
        while time.monotonic() < deadline and not all(f.done() for f in futures[-4:]):
            time.sleep(0.05)
        if time.monotonic() >= deadline:
            for f in futures:
                f.cancel()
        strategy.join()
    after = [w["done"] for w in strategy.stats()["workers"]]
    return [a - b for a, b in zip(after, before)]


@pytest.mark.long
@pytest.mark.cluster
def test_a_throttled_worker_runs_slower_and_recovers(local_cluster, strategy):
    import tensorflow as tf

    with strategy.scope():
        v = tf.Variable(tf.zeros((64, 64)))

    @tf.function
    def step():
        # Some compute on the worker, then an update on the ps.
        x = tf.random.normal((96, 96))
        for _ in range(4):
            x = tf.tanh(tf.matmul(x, x) / 96.0)
        v.assign_add(x[:64, :64] * 1e-6)
        return tf.reduce_sum(x)

    strategy.schedule(step).result(timeout=120)  # Traced and warm on some worker.
    pid = local_cluster.pid("worker", 1)
    try:
        local_cluster.throttle("worker", 1, 0.25)
        assert local_cluster.throttled() == {("worker", 1): 0.25}
        slow = _steps_per_worker(strategy, step, 6.0)
        local_cluster.throttle("worker", 1, 1.0)
        assert local_cluster.throttled() == {}
        status = psutil.Process(pid).status()
        restored = _steps_per_worker(strategy, step, 6.0)
    finally:
        local_cluster.throttle("worker", 1, 1.0)
    print(f"steps in 6 s (worker 0, worker 1): throttled at 0.25 {slow}, restored {restored}")
    assert status != psutil.STATUS_STOPPED
    assert min(slow) > 0 and min(restored) > 0
    slow_share, restored_share = slow[1] / slow[0], restored[1] / restored[0]
    assert slow_share < 0.6, slow  # A quarter of the time: clearly fewer steps.
    assert restored_share > 1.5 * slow_share, (slow, restored)
    assert local_cluster.pid("worker", 1) == pid  # The same process all along.


@pytest.mark.cluster
def test_bad_arguments_name_themselves(local_cluster):
    with pytest.raises(ValueError, match="argument `fraction`. Received: fraction=0"):
        local_cluster.throttle("worker", 0, 0)
    with pytest.raises(ValueError, match="argument `fraction`. Received: fraction=1.5"):
        local_cluster.throttle("worker", 0, 1.5)
    with pytest.raises(ValueError, match="argument `job`"):
        local_cluster.throttle("chief", 0, 0.5)
    with pytest.raises(ValueError, match="argument `index`"):
        local_cluster.throttle("worker", 7, 0.5)
    with pytest.raises(ValueError, match="argument `period`"):
        local_cluster.throttle("worker", 0, 0.5, period=0)
    assert local_cluster.throttled() == {}


@pytest.mark.cluster
def test_stop_pauses_a_throttle_and_resume_restores_it(local_cluster):
    process = psutil.Process(local_cluster.pid("ps", 0))
    try:
        local_cluster.throttle("ps", 0, 0.5, period=0.05)
        local_cluster.stop("ps", 0)
        deadline = time.monotonic() + 10  # SIGSTOP takes effect asynchronously.
        while process.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.01)
        # Stopped for good: the helper does not continue it while it is stopped.
        statuses = set()
        for _ in range(10):
            statuses.add(process.status())
            time.sleep(0.03)
        assert statuses == {psutil.STATUS_STOPPED}
        local_cluster.resume("ps", 0)
        assert local_cluster.throttled() == {("ps", 0): 0.5}
        seen = set()
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:  # Both parts of the cycle.
            seen.add(process.status() == psutil.STATUS_STOPPED)
            time.sleep(0.007)
        assert seen == {True, False}
    finally:
        if local_cluster._tasks[("ps", 0)].stopped:  # Failed between stop and resume.
            local_cluster.resume("ps", 0)
        local_cluster.throttle("ps", 0, 1.0)
    assert process.status() != psutil.STATUS_STOPPED


# ------------------------------------------------------------ ownership
def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.cluster
def test_the_helper_ends_with_close_and_a_restart_ends_the_throttle():
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        cluster.throttle("worker", 0, 0.1)
        helper = cluster._throttler.pid
        assert helper is not None and not _gone(helper)
        cluster.restart("worker", 0)
        assert cluster.throttled() == {}
        cluster.throttle("worker", 0, 0.2)
        assert cluster.throttled() == {("worker", 0): 0.2}
        tasks = [cluster.pid("worker", 0), cluster.pid("ps", 0)]
    assert _gone(helper)
    assert all(_gone(pid) for pid in tasks)
    with pytest.raises(RuntimeError, match="closed"):
        cluster.throttle("worker", 0, 0.5)


_OWNER = """
import json, sys
sys.path.insert(0, {root!r})
from psclient._cluster.local import LocalCluster
cluster = LocalCluster(num_workers=1, num_ps=1, start_timeout=120)
cluster.throttle("worker", 0, 0.1)
print(json.dumps({{"helper": cluster._throttler.pid,
                  "tasks": [cluster.pid("worker", 0), cluster.pid("ps", 0)]}}), flush=True)
sys.stdin.read()  # Until killed.
"""


@pytest.mark.cluster
def test_nothing_outlives_a_sigkilled_owner():
    owner = subprocess.Popen([sys.executable, "-c", _OWNER.format(root=ROOT_STR)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    pids = []
    try:
        line = owner.stdout.readline()
        assert line, "the owner exited before it started its cluster"
        started = json.loads(line)
        pids = [started["helper"], *started["tasks"]]
        assert not any(_gone(pid) for pid in pids)
        owner.kill()
        owner.wait(timeout=30)
        deadline = time.monotonic() + 60
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in pids if not _gone(pid)]
        assert not left, f"processes {left} outlived their SIGKILLed owner by 60 s (helper {pids[0]})"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=30)
        owner.stdin.close()
        owner.stdout.close()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
