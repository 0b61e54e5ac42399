"""A function's own error resolves its future while another worker is away.

A py_function's Python exception reaches the coordinator as UnknownError, a
code a broken connection also produces. With a worker out of rotation, such
an error was taken for "another task lost, run it again", every time: the
closure ran about 65 times a second for good and `join()` never returned.
"""

import pytest
import tensorflow as tf

import psclient
from tests._polling import wait_for

pytestmark = pytest.mark.cluster


def test_a_py_function_error_fails_its_future_while_a_worker_is_dead(local_cluster):
    # The session's cluster: worker 1 is restarted at the end, as it shares it.
    local = local_cluster
    strategy = psclient.ParameterServerStrategy(local.cluster)
    try:
        with strategy.scope():
            v = tf.Variable(1.0)

        def user_bug(_):
            raise RuntimeError("user bug")

        @tf.function
        def step():
            return tf.py_function(user_bug, [v.read_value()], tf.float32)

        local.kill("worker", 1)
        wait_for(lambda: not strategy.stats()["workers"][1]["up"], 180, "worker 1 taken out after its kill")
        future = strategy.schedule(step)
        with pytest.raises(tf.errors.UnknownError, match="user bug"):
            future.result(timeout=120)
        with pytest.raises(tf.errors.UnknownError):
            strategy.join(timeout=60)  # the error surfaces once more, as TF's contract has it
        assert strategy.stats()["workers"][0]["retried"] <= 20
        # Healthy work still runs on the remaining worker.
        assert strategy.schedule(tf.function(lambda: v.read_value() + 1)).result(timeout=120) == 2.0
    finally:
        strategy.shutdown()
        if not local.is_running("worker", 1):
            local.restart("worker", 1)
