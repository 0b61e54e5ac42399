"""A worker that dies while the coordinator reconnects does not freeze it.

TF's `update_server_def` asks every task it names for its devices. Under
the gRPC setting TF's own coordinator uses ("use_caller") it waited, for a
worker that had died, until some process listened on that worker's port
again: the recovery thread sat inside it holding the process-wide
connection lock, the strategy never noticed the death, and every later
strategy of the process failed to connect (seen in CI: eight workers with
kills, then 30 tests of the following modules). psclient now makes such RPCs
fail at once and waits for tasks itself.
"""

import threading

import pytest
import tensorflow as tf

import psclient
from psclient._coordinator import runtime
from tests._polling import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("restore_shared_clusters")]


@pytest.fixture(scope="module")
def local(local_cluster):
    """The session's shared cluster: restore_shared_clusters restarts what a test killed."""
    return local_cluster


def _in_thread(fn, timeout):
    """Run fn in a thread; (finished, error) after at most `timeout` seconds."""
    outcome: list = []

    def run():
        try:
            fn()
            outcome.append(None)
        except tf.errors.OpError as error:
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return (not thread.is_alive()), (outcome[0] if outcome else None)


def test_a_reconnect_naming_a_dead_worker_fails_at_once_and_the_rest_goes_on(local):
    runtime.connect(local.cluster, streaming_enqueue=False)
    try:
        with tf.device(runtime.ps_device(0)):
            value = tf.Variable(1.0)
        local.kill("worker", 1)
        finished, error = _in_thread(lambda: runtime.connect(local.cluster, streaming_enqueue=False), 60)
        assert finished, "a reconnect naming a dead worker waited for it (over 60 s)"
        assert isinstance(error, tf.errors.UnavailableError), error
        # TF's context is still usable: leave the dead worker out, call the live one.
        runtime.connect(local.cluster, streaming_enqueue=False, workers=[0])
        with tf.device(runtime.worker_device(0)):
            assert (value + 1).numpy() == 2.0
        local.restart("worker", 1, timeout=180)
        runtime.connect(local.cluster, streaming_enqueue=False)
        with tf.device(runtime.worker_device(1)):
            assert (value + 2).numpy() == 3.0
    finally:
        runtime.disconnect()


def test_a_patient_connect_to_a_dead_worker_names_it_after_its_patience(local):
    """The strategy's first connect (patience=connect_timeout): TaskUnreachableError naming the task."""
    from psclient._core.errors import TaskUnreachableError

    runtime.connect(local.cluster, streaming_enqueue=False)
    try:
        local.kill("worker", 1)
        raised: list = []

        def connect():
            try:
                runtime.connect(local.cluster, streaming_enqueue=False, patience=1.0)
            except TaskUnreachableError as error:
                raised.append(error)

        thread = threading.Thread(target=connect, daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "a connect with patience=1 s took over 60 s"
        assert raised, "no TaskUnreachableError"
        error = raised[0]
        assert error.task == "worker:1" and error.address == local.cluster.address("worker", 1), error
        assert "connect_timeout=1 s" in str(error) and "worker:1 at " in str(error)
        local.restart("worker", 1, timeout=180)
        runtime.connect(local.cluster, streaming_enqueue=False, patience=60.0)  # a restarted task: taken
    finally:
        runtime.disconnect()


@pytest.mark.long
def test_a_worker_killed_between_the_probes_and_the_reconnect(local, monkeypatch):
    """The recovery thread reconnects to bring a restarted worker back; the other
    worker dies just before TF is called (the race the probes cannot close)."""
    strategy = psclient.ParameterServerStrategy(local.cluster, hang_timeout=10)
    try:
        with strategy.scope():
            counter = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def step():
            counter.assign_add(1)
            return counter.read_value()

        first = [strategy.schedule(step) for _ in range(4)]
        strategy.join(timeout=120)
        assert sorted(f.result() for f in first) == [1, 2, 3, 4]
        edge = strategy._recovery._edge  # white-box: what the recovery thread reconnects through
        real_connect = edge.connect
        killed = threading.Event()

        def connect_after_killing_worker_0(cluster, workers):
            if 0 in workers and not killed.is_set():
                killed.set()
                local.kill("worker", 0)
            return real_connect(cluster, workers)

        local.kill("worker", 1)
        wait_for(lambda: not strategy.stats()["workers"][1]["up"], 180, "worker 1 taken out after its kill")
        monkeypatch.setattr(edge, "connect", connect_after_killing_worker_0)
        local.restart("worker", 1, timeout=180)
        assert killed.wait(180), "no reconnect brought worker 1 back"
        # Not frozen: the death of worker 0 is noticed and worker 1 comes back.
        wait_for(lambda: not strategy.stats()["workers"][0]["up"], 180, "worker 0 taken out after its kill")
        wait_for(lambda: strategy.stats()["workers"][1]["up"], 180, "worker 1 back in rotation")
        futures = [strategy.schedule(step) for _ in range(6)]
        strategy.join(timeout=180)
        assert sorted(f.result() for f in futures)[-1] >= 10
        local.restart("worker", 0, timeout=180)
        wait_for(lambda: strategy.stats()["workers"][0]["up"], 180, "worker 0 back in rotation")
    finally:
        strategy.shutdown()
    # The connection lock is free: the next connection of the process does not wait.
    finished, error = _in_thread(lambda: (runtime.connect(local.cluster, streaming_enqueue=False),
                                          runtime.disconnect()), 60)
    assert finished and error is None, error
