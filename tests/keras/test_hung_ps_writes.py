"""A callback's write given up on a hung ps (`psclient._keras.hung_ps_writes`), without a cluster:
the given-up try's thread really waits (`checkpoint_parts.on_each_ps` with a work that blocks, as a
call to a SIGSTOPped ps does), and the hooks do not try again until it has ended.

The same with real task processes: tests/keras/test_callbacks_hung_ps.py.
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("tensorflow")

from psclient._coordinator.checkpoints.checkpoint_parts import (  # noqa: E402
    THREAD_PREFIX, CheckpointWriteError, PsTimeout, on_each_ps, waiting_on)
from psclient._keras import hung_ps_writes  # noqa: E402
from psclient._keras.hung_ps_writes import FINAL_ATTEMPTS, HungPsWrites  # noqa: E402

HUNG_PS = 1
WAIT_LIMIT = 60.0  # a generous bound for a thread to end once its gate opens (a loaded machine)


class _Writes:
    """A write to two ps tasks whose ps:1 hangs while `gate` is shut: given up after `timeout`."""

    def __init__(self):
        self.gate = threading.Event()
        self.tries = 0
        self.published = 0

    def write(self):
        self.tries += 1
        try:
            on_each_ps({0: lambda: None, HUNG_PS: lambda: self.gate.wait(WAIT_LIMIT)}, timeout=0.05)
        except PsTimeout as error:
            raise CheckpointWriteError(f"ps:{HUNG_PS} gave no answer") from error
        self.published += 1


def _end_waits(writes: _Writes) -> None:
    writes.gate.set()
    for thread in threading.enumerate():
        if thread.name == f"{THREAD_PREFIX}{HUNG_PS}":
            thread.join(WAIT_LIMIT)
    assert not waiting_on(HUNG_PS)


@pytest.fixture
def short_grace(monkeypatch):
    monkeypatch.setattr(hung_ps_writes, "ANSWER_GRACE", 0.05)


def test_hooks_do_not_try_again_while_the_given_up_try_still_waits_on_its_ps(short_grace):
    writes, hung = _Writes(), HungPsWrites("a test write")
    try:
        hung.run(writes.write)
        assert hung.pending and writes.tries == 1 and writes.published == 0
        assert [failure["task"] for failure in hung.failures] == [f"ps:{HUNG_PS}"]
        assert waiting_on(HUNG_PS) and hung.still_waiting()
        for _hook in range(5):  # the ps still hangs: no second wait, no second thread on it
            hung.run(writes.write)
        assert writes.tries == 1 and hung.hooks_waited == 5 and len(hung.failures) == 1
        waiting = [t for t in threading.enumerate() if t.name == f"{THREAD_PREFIX}{HUNG_PS}"]
        assert len(waiting) == 1, waiting
    finally:
        _end_waits(writes)
    hung.run(writes.write)  # the ps answered: made again at the next hook, and published
    assert writes.tries == 2 and writes.published == 1
    assert not hung.pending and not hung.still_waiting()


def test_only_the_first_hook_after_a_give_up_waits_its_grace(short_grace, monkeypatch):
    """A ps that goes on hanging while steps that do not touch it run: one grace per given-up
    write, not one per batch end; a new give-up gets a grace of its own."""
    graces = []

    def recording_waiting_on(ps, grace=0.0):
        graces.append(grace)
        return waiting_on(ps, grace=grace)

    monkeypatch.setattr(hung_ps_writes, "waiting_on", recording_waiting_on)
    writes, hung = _Writes(), HungPsWrites("a test write")
    try:
        hung.run(writes.write)
        for _hook in range(4):
            hung.run(writes.write)
        assert graces == [hung_ps_writes.ANSWER_GRACE, 0.0, 0.0, 0.0] and hung.hooks_waited == 4
    finally:
        _end_waits(writes)
    writes.gate.clear()  # the ps hangs again: the next write is given up, and gets its own grace
    try:
        hung.run(writes.write)  # the ps answered: made again, and given up on the new hang
        assert writes.tries == 2 and hung.pending and len(hung.failures) == 2
        graces.clear()
        hung.run(writes.write)
        hung.run(writes.write)
        assert graces == [hung_ps_writes.ANSWER_GRACE, 0.0]
    finally:
        _end_waits(writes)


def test_a_ps_that_answers_within_the_grace_gets_the_write_at_that_hook(monkeypatch):
    monkeypatch.setattr(hung_ps_writes, "ANSWER_GRACE", WAIT_LIMIT)
    writes, hung = _Writes(), HungPsWrites("a test write")
    answer = None
    try:
        hung.run(writes.write)
        assert hung.pending and waiting_on(HUNG_PS)
        answer = threading.Timer(0.2, writes.gate.set)  # the ps answers while the hook waits
        answer.start()
        hung.run(writes.write)
        assert writes.tries == 2 and writes.published == 1 and hung.hooks_waited == 0
        assert not hung.pending
    finally:
        if answer is not None:
            answer.join()
        _end_waits(writes)


def test_the_write_that_ends_fit_tries_again_even_while_the_ps_still_hangs(short_grace):
    writes, hung = _Writes(), HungPsWrites("a test write")
    try:
        hung.run(writes.write)
        assert hung.still_waiting()
        with pytest.raises(CheckpointWriteError):
            hung.run(writes.write, final=True)
        assert writes.tries == 1 + FINAL_ATTEMPTS and hung.pending
    finally:
        _end_waits(writes)
    hung.run(writes.write, final=True)
    assert writes.published == 1 and not hung.pending


def test_other_errors_are_raised_at_once_and_leave_nothing_pending():
    hung = HungPsWrites("a test write")

    def full_disk():
        raise CheckpointWriteError("No space left on device")  # no PsTimeout behind it

    with pytest.raises(CheckpointWriteError, match="No space left"):
        hung.run(full_disk)
    assert not hung.pending and not hung.failures
