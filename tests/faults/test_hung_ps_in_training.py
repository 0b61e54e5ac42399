"""A ps that hangs while closures run freezes nothing, before and after a ps recovery.

Issue 36's hold-outs run seeded chaos plans with ps kills and hangs in every
order. Here the two orders on the shared 3 workers, 1 ps cluster: the ps
SIGSTOPped while closures keep being scheduled and a checkpoint falls due,
resumed, then killed and recovered, then SIGSTOPped again. The workers'
steps wait on the ps meanwhile (TF's runtime has no deadline for them) and
the checkpoint due then gives up after `hang_timeout`; a heartbeat thread in
the coordinator measures its longest gap (as in test_no_freeze.py), every
future must resolve without an error once the ps answers, no worker may be
taken out for the ps's hang, and the checkpoints go on.
"""

import subprocess
import time

import pytest
import tensorflow as tf
from _heartbeat import MAX_STALL_S, Heartbeat
from _polling import wait_for

import psclient

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

HANG_TIMEOUT = 1.0
#: How long the ps stays stopped while closures are scheduled (the chaos plans' ps hangs: 4-6 s).
STOPPED_S = 4.0
#: How long the ps stays SIGSTOPped at most when the coordinator cannot resume it.
WATCHDOG_S = 30


@pytest.fixture
def heal(three_workers_one_ps, restore_shared_clusters):
    """The shared cluster; afterwards every task it stopped or killed runs again (conftest)."""
    return three_workers_one_ps


def test_a_ps_hung_before_and_after_its_recovery_freezes_nothing(heal, tmp_path):
    cluster = heal
    strategy = psclient.ParameterServerStrategy(
        cluster.cluster, hang_timeout=HANG_TIMEOUT, checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=20,
    )
    try:
        with strategy.scope():
            steps = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def step():
            steps.assign_add(1)
            return steps.read_value()

        def batch(count=10):
            futures = [strategy.schedule(step) for _ in range(count)]
            strategy.join(timeout=120)
            assert [f.exception() for f in futures] == [None] * count
            return futures

        def hang_ps_while_training(when):
            written = strategy.stats()["checkpoints_written"]
            with Heartbeat() as beat:
                cluster.stop("ps", 0)
                # A frozen coordinator could not resume the ps itself: a process of its own does.
                watchdog = subprocess.Popen(
                    ["sh", "-c", f"sleep {WATCHDOG_S}; kill -CONT {cluster.pid('ps', 0)}"])
                futures = []
                try:
                    stopped_at = time.monotonic()
                    # A trickle of closures, as a training loop: they queue behind the hung ps,
                    # and checkpoints fall due meanwhile.
                    while time.monotonic() - stopped_at < STOPPED_S:
                        futures += [strategy.schedule(step) for _ in range(5)]
                        time.sleep(0.05)
                    stopped_for = time.monotonic() - stopped_at
                finally:
                    cluster.resume("ps", 0)
                    watchdog.kill()
                    watchdog.wait()
                psclient.wait(futures, timeout=120)
                batch(25)  # a checkpoint falls due once the ps answers again
                wait_for(lambda: strategy.stats()["checkpoints_written"] > written, 120,
                         f"a checkpoint written after the ps hung {when}")
            print(f"ps hung {when}: {stopped_for:.2f} s, {len(futures)} closures scheduled meanwhile, "
                  f"longest coordinator gap {beat.longest:.2f} s")
            assert stopped_for < WATCHDOG_S, f"scheduling froze until the watchdog resumed the ps ({when})"
            assert [f.exception() for f in futures] == [None] * len(futures), when
            assert all(w["up"] for w in strategy.stats()["workers"]), (
                f"a worker was taken out for the ps's hang ({when}): {strategy.stats()['workers']}")
            assert beat.longest < MAX_STALL_S, f"the coordinator stalled {beat.longest:.2f} s ({when})"

        batch(30)
        wait_for(lambda: strategy.stats()["checkpoints_written"] >= 1, 60, "a first checkpoint")
        hang_ps_while_training("before any ps recovery")

        cluster.kill("ps", 0)
        cluster.restart("ps", 0)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and strategy.stats()["ps"][0]["recoveries"] < 1:
            batch(4)  # a call notices the lost ps; the recovery restores it
        assert strategy.stats()["ps"][0]["recoveries"] == 1, strategy.stats()["ps"]
        batch(10)
        hang_ps_while_training("after its recovery")
    finally:
        cluster.resume("ps", 0)
        strategy.shutdown()
