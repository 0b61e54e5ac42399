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
