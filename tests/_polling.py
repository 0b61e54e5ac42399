"""Waiting on a condition with a deadline, for tests that watch strategy stats."""

import time

import pytest


def wait_for(predicate, timeout, what):
    """Poll a cheap predicate (strategy stats) until true; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
