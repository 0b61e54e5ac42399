"""The executors psclient calls and probes through do not sync the whole cluster.

TF's executors, by default, sync every task of the cluster before a call of
a function with inputs on another task (a step reading ps variables) whenever
the call goes to another client than their previous one did, and a reconnect
gives every worker a new client. With a dead worker still in TF's view, that
sync failed every later call of a healthy worker (and every probe made on TF's
shared default executor), naming the dead one: among eight workers with kills
and restarts, healthy workers' calls failed until the strategy gave up on them
(tests/faults/test_many_workers.py). Here the same sequence, at the TF edge: a call,
a reconnect, a worker killed, another call on a healthy worker.
"""

import queue
import threading

import pytest
import tensorflow as tf

from psclient._coordinator import runtime

pytestmark = pytest.mark.cluster


class _CallingThread:
    """A dispatcher-like thread: one worker, one executor of its own for its life."""

    def __init__(self, worker: int):
        self._requests: queue.Queue = queue.Queue()
        self._answers: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(worker,), daemon=True)
        self._thread.start()

    def call(self, fn, timeout: float = 60):
        self._requests.put(fn)
        ok, value = self._answers.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def stop(self):
        self._requests.put(None)
        self._thread.join(60)

    def _run(self, worker):
        with runtime.device_scope(runtime.worker_device(worker), worker):
            while (fn := self._requests.get()) is not None:
                try:
                    self._answers.put((True, fn().numpy()))
                except tf.errors.OpError as error:
                    self._answers.put((False, error))


@pytest.mark.usefixtures("restore_shared_clusters")
def test_calls_and_probes_of_a_healthy_worker_ignore_a_dead_one(local_cluster):
    local = local_cluster  # shared: restore_shared_clusters restarts worker 1 afterwards
    # Streaming on: TF then remembers the client each call went to.
    runtime.connect(local.cluster, streaming_enqueue=True)
    caller = None
    try:
        with tf.device(runtime.ps_device(0)):
            counter = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def step():
            counter.assign_add(1)
            return counter.read_value()

        caller = _CallingThread(0)
        assert caller.call(step) == 1
        # A probe made after a call on this (the main) thread's executor.
        with tf.device(runtime.worker_device(0)):
            assert step().numpy() == 2
        runtime.connect(local.cluster, streaming_enqueue=True)  # a reconnect: new clients
        local.kill("worker", 1)  # still in TF's view

        assert caller.call(step) == 3
        probed: list = []
        prober = threading.Thread(target=lambda: probed.append(runtime.probe(runtime.worker_device(0))))
        prober.start()
        prober.join(60)
        assert probed == [None], "the probe of the healthy worker did not answer"
    finally:
        if caller is not None:
            caller.stop()
        runtime.disconnect()
