"""Ctrl-C gets the user out promptly (issue 36, item 6).

An interrupted `psclient demo` on a loaded machine waited in fit for every
queued step (py-spy: `Scheduler.join` under `result_or_first_error`) and did
not exit within 120 s of SIGINT. Fit no longer joins when interrupted, and
the demo bounds the rest of its clean-up: past `_INTERRUPT_DEADLINE_S` it
kills what it started and exits with 130. tests/ops/test_exposure.py runs the
whole demo and interrupts it.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from psclient._keras.trainer import result_or_first_error

from _paths import ROOT_STR


class _Strategy:
    """What result_or_first_error uses of a strategy: join(), which raises the first error."""

    def __init__(self, first_error=None):
        self.joins = 0
        self._first_error = first_error

    def join(self):
        self.joins += 1
        if self._first_error is not None:
            raise self._first_error


class _Future:
    def __init__(self, raises=None, value=None):
        self._raises, self._value = raises, value

    def result(self):
        if self._raises is not None:
            raise self._raises
        return self._value


def test_an_interrupted_wait_for_a_step_joins_nothing():
    strategy, dropped = _Strategy(), []
    with pytest.raises(KeyboardInterrupt):
        result_or_first_error(strategy, _Future(raises=KeyboardInterrupt()), lambda: dropped.append(1))
    assert strategy.joins == 0  # the user wants out, not the queued steps
    assert dropped == [1]


def test_a_failed_step_is_answered_by_the_first_error():
    root = RuntimeError("the first step's error")
    strategy, dropped = _Strategy(first_error=root), []
    with pytest.raises(RuntimeError, match="the first step's error"):
        result_or_first_error(strategy, _Future(raises=ValueError("an echo")), lambda: dropped.append(1))
    assert strategy.joins == 1 and dropped == [1]
    assert result_or_first_error(strategy, _Future(value=7)) == 7 and strategy.joins == 1


_STUCK_CLEAN_UP = """
import subprocess, sys, time
from psclient import _demo
with _demo._InterruptDeadline(float(sys.argv[1])) as deadline:
    child = subprocess.Popen(["sleep", "300"])
    deadline.own(child.kill)
    try:
        print(child.pid, flush=True)  # in the try: the SIGINT may come at once
        while True:
            time.sleep(0.05)
    finally:
        while True:  # a clean-up that never ends
            time.sleep(0.05)
"""


def test_the_demos_clean_up_after_an_interrupt_is_bounded():
    process = subprocess.Popen([sys.executable, "-c", _STUCK_CLEAN_UP, "1.0"], cwd=ROOT_STR, text=True,
                               stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT_STR))
    try:
        sleeper = int(process.stdout.readline())
        process.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        assert process.wait(timeout=60) == 130
        took = time.monotonic() - interrupted
        assert "killing what the demo started" in process.stdout.read()
        assert took >= 1.0, took  # the clean-up had its time first
        # The process it owned was SIGKILLed (then reaped by init, or a zombie until then).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(sleeper):
            time.sleep(0.05)
        assert not _alive(sleeper)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()


_LOST_INTERRUPT = """
import os, signal, sys, time
from psclient import _demo
with _demo._InterruptDeadline(60.0) as deadline:
    try:
        for step in range(1000):  # a training loop: a step, then its callbacks
            try:
                if step == 3:
                    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, during this step
                time.sleep(0.01)  # the interrupt is raised here, and dropped (as in a destructor)
            except KeyboardInterrupt:
                print(f"dropped at step {step}", flush=True)
            deadline.raise_if_interrupted()  # the demo's fit callback, after every step
    except KeyboardInterrupt:
        print(f"stopped at step {step}", flush=True)
        sys.exit(130)
"""


def test_an_interrupt_dropped_where_it_landed_still_stops_the_demos_training():
    process = subprocess.Popen([sys.executable, "-c", _LOST_INTERRUPT], cwd=ROOT_STR, text=True,
                               stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT_STR))
    try:
        assert process.wait(timeout=60) == 130  # at once, not after the deadline's 60 s
        out = process.stdout.read()
        assert "dropped at step 3" in out and "the interrupt was lost where it landed" in out, out
        assert "stopped at step 3" in out, out
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
