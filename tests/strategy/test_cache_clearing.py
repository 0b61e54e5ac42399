"""`tf.random.set_seed` (TF's cache clearing) beside calls that do not answer.

TF's clearing waits, with the GIL held, for every node pending on every
thread's executor. psclient's gate (psclient/_tf/calls.py) waits first, GIL
released, for its own calls and probes. Two ways this went wrong:
- a worker hung: the clearing waited, GIL held, on a health probe of it, and
  every thread of the coordinator froze until the worker answered;
- at pipeline depth 2 a call abandoned by a shutdown (or by its worker's
  takeout) that never got its answer held the gate for good, and the next
  `set_seed` of the process (a later test module's) waited forever.

Each test starts its own strategy on this module's cluster (2 workers, 1 ps).
"""

import subprocess
import threading
import time

import pytest
import tensorflow as tf
from _busy_step import busy_counting_step
from _polling import wait_for
from _threads import psclient_threads

import psclient
from psclient._cluster.local import LocalCluster
from psclient._tf import calls

pytestmark = pytest.mark.cluster

_LIMIT = 120.0  # seconds: start-up, takeout and thread exits on a loaded machine
_FREEZE_BOUND = 60  # seconds the hung worker stays stopped at most


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_workers=2, num_ps=1, start_timeout=300) as local:
        yield local


def _set_seed_in_thread(returned: threading.Event | None = None) -> threading.Event:
    returned = threading.Event() if returned is None else returned

    def set_seed():
        tf.random.set_seed(7)
        returned.set()

    threading.Thread(target=set_seed, name="test-set-seed", daemon=True).start()
    return returned


@pytest.mark.long
def test_set_seed_while_a_worker_hangs_waits_without_freezing_the_coordinator(cluster):
    strategy = psclient.ParameterServerStrategy(cluster.cluster, hang_timeout=5)
    try:
        v, step = busy_counting_step(strategy)
        # Stopped under load: worker 1 is taken out while calls run on it (its health
        # probes then wait on it). Stopped while idle, no probe froze anything.
        futures = [strategy.schedule(step) for _ in range(300)]
        psclient.wait(futures[:20], timeout=_LIMIT)
        cluster.stop("worker", 1)
        # A frozen coordinator could not resume the worker itself: a process does, after
        # _FREEZE_BOUND, so that a freeze fails the test below instead of hanging it.
        watchdog = subprocess.Popen(
            ["sh", "-c", f"sleep {_FREEZE_BOUND}; kill -CONT {cluster.pid('worker', 1)}"])
        try:
            strategy.join(timeout=_LIMIT)
            assert strategy.stats()["workers"][1]["up"] is False
            # The coordinator's other threads run while the clearing waits (its
            # wait on the hung worker's probe held the GIL: every thread froze).
            returned = threading.Event()
            beats = [time.monotonic()]

            def beat():
                while not returned.is_set() and beats[-1] - beats[0] < 3 * _FREEZE_BOUND:
                    time.sleep(0.01)
                    beats.append(time.monotonic())

            heart = threading.Thread(target=beat, name="test-heartbeat", daemon=True)
            heart.start()
            _set_seed_in_thread(returned)
            wait_for(lambda: len(beats) >= 200 or returned.is_set(), _LIMIT, "200 heartbeats", interval=0.02)
        finally:
            cluster.resume("worker", 1)
            watchdog.kill()
            watchdog.wait()
        assert returned.wait(_LIMIT), "tf.random.set_seed did not return once the worker answered"
        heart.join(_LIMIT)
        longest = max(b - a for a, b in zip(beats, beats[1:]))
        assert longest < _FREEZE_BOUND / 2, f"the coordinator froze for {longest:.1f} s"
        # Calls go on after the clearing.
        psclient.wait([strategy.schedule(step) for _ in range(5)], timeout=_LIMIT)
        assert v.numpy() >= 305
    finally:
        strategy.shutdown()


@pytest.mark.skipif(
    tuple(int(part) for part in tf.__version__.split(".")[:2]) < (2, 21),
    reason="on TF 2.16.1 (nox -s oldest) a depth-2 call whose answer never comes held the GIL inside "
           "TF's execute (py-spy: every thread idle, the call in TFE_Py_ExecuteCancelable): the process "
           "froze before any cache clearing; measured on 2.16.1 and 2.21 only")
def test_calls_a_shutdown_abandoned_at_depth_2_hold_up_no_cache_clearing(cluster):
    strategy = psclient.ParameterServerStrategy(cluster.cluster, pipeline_depth=2, hang_timeout=5)
    try:
        # A call whose answer never comes, on a healthy worker: a dequeue from an empty queue.
        with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
            queue = tf.queue.FIFOQueue(4, tf.float32, shapes=[])

        @tf.function
        def blocked():
            return queue.dequeue()

        futures = [strategy.schedule(blocked) for _ in range(2)]
        wait_for(lambda: calls._call_gate.running >= 2, _LIMIT, "both calls sent", interval=0.02)
    finally:
        strategy.shutdown()  # cancels them; above depth 1 they still wait for an answer
    # None succeeded: each is still pending, cancelled (exception() would raise CancelledError) or
    # failed. The shutdown cancels them; at times TF's cancellation reaches a call first.
    assert not any(f.done() and not f.cancelled() and f.exception(timeout=0) is None for f in futures)
    # Usually the abandoned calls' threads still wait (the worker never answers). Once in a full
    # suite run TF delivered the shutdown's cancellation to both streamed calls (CANCELLED, their
    # threads gone): then nothing holds the gate either, and set_seed must not wait all the same.
    waiting = [t for t in psclient_threads() if t.name.startswith("psclient-worker")]
    gate_held = calls._call_gate.running

    assert _set_seed_in_thread().wait(_LIMIT), "tf.random.set_seed waited for calls a shutdown abandoned"
    if not waiting:
        print(f"the shutdown's cancellation reached both calls (gate held by {gate_held}): no call was "
              "left waiting this time")
        return

    # The worker's end is their answer: their threads exit, none is left behind.
    cluster.kill("worker", 0)
    for thread in waiting:
        thread.join(_LIMIT)
    assert not [t.name for t in waiting if t.is_alive()]
