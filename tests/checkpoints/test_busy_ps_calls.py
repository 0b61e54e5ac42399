"""A ps busy with a call longer than hang_timeout is waited for, on a real cluster.

Saves, restores and exports wait on each ps through `on_each_ps`, given up on a ps that answers
nothing for the timeout. A real ps running a 4-s function answers the probes made beside it,
so the call goes on; bounded by the call's length instead (`probe=None`, the old rule, which
lost a ps in a seeded chaos plan whose restore ran long on a loaded machine), it is given up.
(A SIGSTOPped ps, which answers no probe, is given up on: tests/checkpoints/test_checkpoint_hung_ps.py.)
"""

import pytest
import tensorflow as tf
from _polling import wait_for

from psclient._coordinator.checkpoints.ps_calls import late_threads, on_each_ps
from psclient._core.errors import PsTimeout

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

PS = "/job:ps/replica:0/task:0/device:CPU:0"
BUSY_S = 4.0
TIMEOUT_S = 1.5


@tf.function
def _busy(seconds):
    """Runs on the ps for `seconds` of its clock (not a count of ops: as long on a loaded machine)."""
    start = tf.timestamp()
    total = tf.constant(0.0, tf.float64)
    while tf.timestamp() - start < seconds:
        total += tf.reduce_sum(tf.random.uniform([256], dtype=tf.float64))
    return tf.timestamp() - start


def busy_call():
    with tf.device(PS):
        return float(_busy(tf.constant(BUSY_S, tf.float64)).numpy())


def test_a_call_longer_than_the_timeout_on_a_ps_that_answers_goes_on(strategy):
    took = on_each_ps({0: busy_call}, timeout=TIMEOUT_S)[0]
    assert took >= BUSY_S > 2 * TIMEOUT_S


def test_bounded_by_its_length_the_same_call_is_given_up_on(strategy):
    busy_call()  # traced and registered first: only the run's length counts below
    with pytest.raises(PsTimeout, match="no answer within") as raised:
        on_each_ps({0: busy_call}, timeout=TIMEOUT_S, probe=None)
    assert raised.value._psclient_ps == 0
    wait_for(lambda: not late_threads(), 120, "the call given up on ending once the ps finishes it")
