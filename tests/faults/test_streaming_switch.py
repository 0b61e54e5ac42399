"""One thread's streamed registrations and another thread's eager ops on a ps: a known race.

TF streams an enqueue when the calling thread's executor allows it and the process's
environment switch (`TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE`) is on, read at every
enqueue by every thread. psclient turns it on to stream function registrations. While it
was on for whole blocks of work (a trace, a range of a dataset cut), another thread's eager
op on a ps failed now and then with "Unable to find the relevant tensor remote_handle": the
value copied to the ps for it went down the stream, the op itself as a call of its own once
the switch was off, and overtook the copy (seen in the suite: a DynamicEmbedding's storage
made in `scope()` on the main thread failed so; reproduced with a thread entering such
blocks back to back: 3,144 of 12,533 eager ops failed).

Not fixed yet, so expected to fail (strict: it must fail until fixed). Turning the switch on
for each registration alone fixed this test, but then a call the tracing thread made right
after a registration no longer shared its stream and overtook it: three suite runs each failed
in another of psclient's calls so (docs/development.md, "A hung task does not freeze the
coordinator").
"""

import threading
import time

import pytest
import tensorflow as tf

import psclient
from psclient._tf import executors

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

#: Bounds of the main thread's loop: enough iterations that the old switch failed dozens.
ITERATIONS, SECONDS = 600, 30.0


@pytest.mark.xfail(strict=True, reason="known race: TF's streaming switch is process-wide and psclient holds it "
                   "on for whole blocks of work (docs/development.md); not fixed yet")
def test_a_thread_in_streamed_blocks_leaves_another_threads_ps_ops_whole(local_cluster):
    strategy = psclient.ParameterServerStrategy(local_cluster.cluster)
    stop, blocks, failures, ran = threading.Event(), [0], [], [0]

    def in_blocks():  # what a thread that traces as it goes does: block after block
        deadline = time.monotonic() + SECONDS + 30
        while not stop.is_set() and time.monotonic() < deadline:
            with executors.streamed_registrations():
                time.sleep(0.0005)
            blocks[0] += 1
            time.sleep(0.0005)

    other = threading.Thread(target=in_blocks, name="test-streamed-blocks")
    other.start()
    try:
        started = time.monotonic()
        while ran[0] < ITERATIONS and time.monotonic() - started < SECONDS:
            try:  # a value copied to the ps, an op there that uses it, a variable made and read
                with tf.device("/job:ps/task:0"):
                    value = tf.zeros([256, 8]) + float(ran[0] % 5)
                    variable = tf.Variable(value)
                    total = float(tf.reduce_sum(variable.read_value()))
                assert total == 256 * 8 * (ran[0] % 5)
            except tf.errors.OpError as error:
                failures.append(str(error).split("\n")[0][:200])
            ran[0] += 1
    finally:
        stop.set()
        other.join(60)
        strategy.shutdown()
    assert not other.is_alive()
    assert ran[0] >= 100 and blocks[0] >= 100, (ran, blocks)  # both threads did enough to meet
    assert not failures, f"{len(failures)} of {ran[0]} eager ops on the ps failed, e.g. {failures[:2]}"
