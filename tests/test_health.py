"""Probes with a fake clock (no cluster). What an unanswered probe means is
decided by the recovery state machine (tests/test_recovery_machine.py)."""

import threading

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


def test_a_probe_is_timed_from_when_it_runs_not_while_it_waits_its_turn():
    # One pool thread held by a hung task: the next probe waits in the queue
    # for longer than its timeout, then its task answers at once. That is an
    # answer (a loaded coordinator's queue is no sign of the task); a probe
    # that runs past its timeout is not; `cap` bounds the whole wait.
    clock = FakeClock()
    hung, answered = threading.Event(), threading.Event()
    prober = Prober(lambda device: hung.wait(30) if device == "hung" else None, clock=clock,
                    threads=1, stuck_after=1000.0)
    prober.start("hung")
    queued = prober.start("ps0")
    clock.now = 10.0  # the queued probe has "waited" 10 s, five times the timeout below
    waiter = threading.Thread(target=lambda: answered.set() if prober.ended_within(queued, 2.0, cap=30) else None)
    waiter.start()
    assert not answered.wait(0.3) and queued.running_since is None  # still queued: no verdict
    hung.set()  # the pool thread is free; ps0 answers at once
    waiter.join(30)
    assert answered.is_set() and queued.ok

    stuck = threading.Event()
    prober2 = Prober(lambda device: stuck.wait(30), clock=clock)
    running = prober2.start("w0")
    assert not prober2.ended_within(running, 0.0, cap=30)  # ran its timeout (0 s) without an answer
    assert not prober2.ended_within(prober2.start("w0"), 100.0, cap=0.1)  # the cap ends the wait
    stuck.set()
    for p in (prober, prober2):
        assert p.close(timeout=10) == []
