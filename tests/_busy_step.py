"""A scheduled step that keeps a worker busy for a moment and counts its runs (a test helper).

Tests that kill or stop a worker mid-run need calls that are still running
when it happens: five 200x200 matmuls take a few milliseconds here.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["busy_counting_step"]


def busy_counting_step(strategy):
    """(count, step): an int64 variable on the ps and a tf.function adding 1 to it after its matmuls."""
    with strategy.scope():
        count = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step():
        x = tf.random.uniform([200, 200])
        for _ in range(5):
            x = tf.linalg.matmul(x, x) / 200.0
        count.assign_add(1)

    return count, step
