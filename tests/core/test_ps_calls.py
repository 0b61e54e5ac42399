"""Calls on each ps given up on by silence, not by length (`psclient._coordinator.checkpoints.ps_calls`).

A seeded chaos plan lost a ps for good when its restore, on a loaded machine, ran longer than
`hang_timeout` three times: the wait was bounded by the call's length. Now a ps is given up on
once it answers nothing, neither its call nor a probe made while the call runs, for `timeout`.
The decision (`Hearing`) is tested with given times; the wait with threads, events and fake
probes (no cluster: a work that needs no TF op on a task).
"""

import threading

import pytest

from psclient._coordinator.checkpoints import ps_calls
from psclient._coordinator.checkpoints.ps_calls import Hearing, on_each_ps
from psclient._core.errors import PsTimeout

#: How long a test waits for an event that must come (a loaded machine's scheduling included).
EVENTUALLY_S = 60.0


# ---------------------------------------------------------------- the decision, pure
def test_a_ps_is_silent_once_nothing_was_heard_from_it_for_the_timeout():
    hearing = Hearing([0, 1, 2], started=100.0)
    assert hearing.silent({0, 1, 2}, now=102.9, timeout=3.0) == []
    assert hearing.wait_for({0, 1, 2}, now=102.0, timeout=3.0) == pytest.approx(1.0)
    hearing.heard(1, 102.5)  # a probe answered
    assert hearing.silent({0, 1, 2}, now=103.0, timeout=3.0) == [0, 2]
    assert hearing.silent({1}, now=105.4, timeout=3.0) == []
    assert hearing.wait_for({1}, now=105.0, timeout=3.0) == pytest.approx(0.5)
    assert hearing.silent({1}, now=105.5, timeout=3.0) == [1]


def test_an_older_answer_never_moves_the_last_one_back():
    hearing = Hearing([0], started=10.0)
    hearing.heard(0, 20.0)
    hearing.heard(0, 15.0)
    assert hearing.last(0) == 20.0


def test_progress_is_heard_from_every_ps_and_minus_infinity_gives_up_at_once():
    hearing = Hearing([0, 1], started=0.0)
    assert hearing.silent({0, 1}, now=5.0, timeout=3.0, progress=4.0) == []
    assert hearing.silent({0, 1}, now=7.0, timeout=3.0, progress=4.0) == [0, 1]
    assert hearing.silent({0, 1}, now=0.1, timeout=3.0, progress=float("-inf")) == [0, 1]
    assert hearing.wait_for({0, 1}, now=0.1, timeout=3.0, progress=float("-inf")) == 0.0


# ---------------------------------------------------------------- the wait, with threads
class Probes:
    """A fake probe per ps: answers at once, or waits for `released` (a hung ps) after `answers` answers."""

    def __init__(self, answers=None):
        self.answers, self.count = answers, 0
        self.released = threading.Event()
        self.counted = threading.Condition()

    def __call__(self, ps):
        with self.counted:
            self.count += 1
            self.counted.notify_all()
            hung = self.answers is not None and self.count > self.answers
        if hung:
            self.released.wait(EVENTUALLY_S)

    def reached(self, n):
        with self.counted:
            return self.counted.wait_for(lambda: self.count >= n, EVENTUALLY_S)


def test_a_call_longer_than_the_timeout_on_a_ps_that_answers_its_probes_goes_on():
    probes = Probes()

    def long_call():  # ends only after three probes, about 3 s: twice the timeout
        assert probes.reached(3)
        return "restored"

    assert on_each_ps({0: long_call}, timeout=1.5, probe=probes) == {0: "restored"}
    assert probes.count >= 3


def test_without_probes_the_same_call_is_given_up_on_after_the_timeout():
    done = threading.Event()
    late = []
    try:
        with pytest.raises(PsTimeout, match="no answer within 1.5 s") as raised:
            on_each_ps({3: lambda: done.wait(EVENTUALLY_S)}, timeout=1.5, probe=None, on_late=late.append)
        assert raised.value._psclient_ps == 3
        assert len(late) == 1 and not late[0].done()  # its thread goes on
    finally:
        done.set()


def test_a_ps_that_never_answers_a_probe_is_given_up_on_as_before():
    probes = Probes(answers=0)  # hung from the start
    done = threading.Event()
    try:
        with pytest.raises(PsTimeout) as raised:
            on_each_ps({0: lambda: "quick", 1: lambda: done.wait(EVENTUALLY_S)}, timeout=1.5, probe=probes)
        assert raised.value._psclient_ps == 1
        assert "answered its last probe" not in str(raised.value)
    finally:
        probes.released.set()
        done.set()


def test_a_ps_that_stops_answering_mid_call_is_given_up_on_a_timeout_after_its_last_answer():
    probes = Probes(answers=2)  # answers two probes, then hangs
    done = threading.Event()
    try:
        with pytest.raises(PsTimeout, match="answered its last probe") as raised:
            on_each_ps({2: lambda: done.wait(EVENTUALLY_S)}, timeout=1.5, probe=probes)
        assert raised.value._psclient_ps == 2
        assert probes.count == 3  # the third probe is the one that hung
    finally:
        probes.released.set()
        done.set()


def test_the_probes_end_with_the_call():
    probes = Probes()
    on_each_ps({0: lambda: probes.reached(2)}, timeout=1.5, probe=probes)
    probers = [t for t in threading.enumerate() if t.name.startswith(ps_calls.PROBE_THREAD_PREFIX)]
    for thread in probers:
        thread.join(EVENTUALLY_S)
    assert not [t for t in probers if t.is_alive()]


def test_errors_are_raised_after_every_call_ended_lowest_ps_first():
    def fails(message):
        def run():
            raise ValueError(message)
        return run

    with pytest.raises(ValueError, match="ps 1"):
        on_each_ps({2: fails("ps 2"), 1: fails("ps 1"), 0: lambda: None}, timeout=5.0, probe=Probes())


def test_a_probe_that_cannot_be_sent_hears_nothing():
    done = threading.Event()

    def unsendable(ps):
        raise ValueError("no such task")

    try:
        with pytest.raises(PsTimeout):
            on_each_ps({0: lambda: done.wait(EVENTUALLY_S)}, timeout=1.5, probe=unsendable)
    finally:
        done.set()
