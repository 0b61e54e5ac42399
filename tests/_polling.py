"""Waiting on a condition with a deadline, for tests that watch strategy stats."""

import time

import pytest


def wait_for(predicate, timeout, what, *, interval=0.05):
    """Poll a cheap predicate (strategy stats, a thread's state) every `interval` seconds until
    true; fail after `timeout`. The one polling helper of the tests."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
