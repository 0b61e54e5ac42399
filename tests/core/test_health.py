"""Probes with a fake clock (no cluster). What an unanswered probe means is
decided by the recovery state machine (tests/core/test_recovery_machine.py)."""

import threading
import time

from psclient._core.health import Prober


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_an_unanswered_probe_is_overdue_and_never_doubled():
    clock = FakeClock()
    release = threading.Event()
    calls = []

    def run_probe(device):
        calls.append(device)
        if device == "w1":
            release.wait(30)

    prober = Prober(run_probe, clock=clock)
    assert prober.answers("w0", timeout=10)
    first = prober.start("w1")
    clock.now = 4.0
    assert prober.overdue("w1", clock.now) == 4.0
    assert prober.start("w1") is first  # one outstanding probe per task
    assert prober.overdue("w0", clock.now) is None
    release.set()
    assert first.done.wait(10) and first.ok
    assert prober.overdue("w1", clock.now) is None
    assert calls.count("w1") == 1
    assert prober.close(timeout=10) == []


def test_a_failing_probe_means_does_not_answer():
    def run_probe(device):
        raise ConnectionError("gone")

    prober = Prober(run_probe)
    assert not prober.answers("w0", timeout=10)
    assert prober.close(timeout=10) == []


def test_close_names_the_probes_still_hanging():
    release = threading.Event()
    prober = Prober(lambda device: release.wait(30))
    prober.start("w0")
    assert prober.close(timeout=0.05) == ["w0"]
    release.set()
    assert prober.close(timeout=10) == []


def test_probes_reuse_a_small_pool_of_threads():
    prober = Prober(lambda device: None, threads=2)
    for _ in range(50):
        for worker in range(20):
            assert prober.answers(f"w{worker}", timeout=10)
    assert prober.threads_started <= 2
    assert prober.threads <= 2
    assert prober.close(timeout=10) == []
    assert prober.threads == 0


def test_a_hung_probe_gets_one_more_thread_and_does_not_hold_up_the_others():
    clock = FakeClock()
    release, entered = threading.Event(), threading.Event()

    def run_probe(device):
        if device == "hung":
            entered.set()
            release.wait(30)

    prober = Prober(run_probe, clock=clock, threads=1, stuck_after=0.5)
    hung = prober.start("hung")
    assert entered.wait(10)  # the pool's only thread is inside it
    clock.now = 1.0  # the only thread has been inside that probe for 1 s: stuck
    assert prober.answers("w1", timeout=10)  # served by one more thread
    assert prober.threads_started == 2
    assert prober.answers("w2", timeout=10)
    assert prober.threads_started == 2  # no thread per probe
    assert prober.most_stuck == 1  # the one extra thread was started for the one stuck probe
    assert prober.close(timeout=0.05) == ["hung"]
    release.set()
    assert hung.done.wait(10) and hung.ok
    assert prober.close(timeout=10) == []


def test_last_failed_tells_an_ended_probe_without_answer_from_one_pending_or_answered():
    release = threading.Event()
    answering = {"w0"}

    def run_probe(device):
        if device == "w2":
            release.wait(30)
        if device not in answering:
            raise ConnectionError(device)

    prober = Prober(run_probe)
    try:
        assert not prober.last_failed("w0")  # never probed
        assert prober.answers("w0", timeout=10)
        assert not prober.last_failed("w0")
        assert not prober.answers("w1", timeout=10)
        assert prober.last_failed("w1")
        prober.start("w2")
        assert not prober.last_failed("w2")  # still waiting: not an ended probe
        answering.add("w1")
        assert prober.answers("w1", timeout=10)
        assert not prober.last_failed("w1")  # the latest answered
    finally:
        release.set()
        prober.close(10)


def test_an_urgent_probe_runs_ahead_of_the_heartbeats_queued_before_it():
    # One pool thread, busy; three heartbeats queued; then a failed call's probe of the ps.
    # It runs next, not after them: a burst of heartbeats on a loaded coordinator must not
    # make a ps that answers at once look silent.
    busy, order = threading.Event(), []

    def run_probe(device):
        if device == "busy":
            busy.wait(30)
        order.append(device)

    prober = Prober(run_probe, threads=1, stuck_after=1000.0)
    held = prober.start("busy")
    deadline = time.monotonic() + 30
    while held.running_since is None and time.monotonic() < deadline:
        time.sleep(0.01)  # bounded: until the pool's one thread has taken it
    for worker in range(3):
        prober.start(f"w{worker}")
    ps = prober.start("ps0", urgent=True)
    busy.set()
    assert ps.done.wait(30) and ps.ok
    assert held.running_since is not None and order[:2] == ["busy", "ps0"], order
    assert prober.close(timeout=10) == []
