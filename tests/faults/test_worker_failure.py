"""A worker that dies: its closures run again elsewhere and their futures resolve."""

import pytest
import tensorflow as tf

import psclient

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(local_cluster):
    """The session's shared cluster: the test restarts the worker it kills."""
    return local_cluster


def test_killed_worker_closures_rerun_on_the_other(cluster):
    strategy = psclient.ParameterServerStrategy(cluster.cluster)
    try:
        with strategy.scope():
            steps = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def step():
            x = tf.random.uniform([200, 200])
            for _ in range(5):
                x = tf.linalg.matmul(x, x) / 200.0
            steps.assign_add(1)
            return steps.read_value()

        futures = [strategy.schedule(step) for _ in range(300)]
        # Kill worker 1 once both workers are busy (some futures done).
        psclient.wait(futures[:20], timeout=120)
        cluster.kill("worker", 1)
        strategy.join(timeout=300)
        assert all(f.done() and not f.cancelled() and f.exception() is None for f in futures)
        stats = strategy.stats()
        assert stats["workers"][1]["up"] is False
        assert stats["workers"][0]["done"] > 0
        # At least once: a closure cut off by the kill may have counted before dying.
        retried = sum(w["retried"] for w in stats["workers"])
        assert retried >= 1
        assert 300 <= steps.numpy() <= 300 + retried
        # Later work keeps flowing to the surviving worker.
        assert strategy.schedule(step).result(120) > 0
    finally:
        strategy.shutdown()
        cluster.restart("worker", 1)
