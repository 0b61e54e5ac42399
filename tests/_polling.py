"""Waiting on a condition with a deadline, for tests that watch strategy stats."""

import sys
import threading
import time
import traceback

import pytest


def wait_for(predicate, timeout, what, *, interval=0.05, show_threads=False):
    """Poll a cheap predicate (strategy stats, a thread's state) every `interval` seconds until
    true; fail after `timeout`. The one polling helper of the tests. `show_threads`: the failure
    also shows where each thread of this process was (for waits on psclient's own threads)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}"
                        + (f"\n{thread_stacks()}" if show_threads else ""))
        time.sleep(interval)


def thread_stacks() -> str:
    """The Python stack of every thread of this process, by name."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "\n".join(f"--- thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
                     for ident, frame in sys._current_frames().items())
