"""A worker restarted behind the coordinator's back, then a ps lost: nothing reaches a future.

Forked tasks (LocalCluster's default) are back within a second, before any call noticed
they were gone. Here worker 1 is killed and restarted unnoticed and ps 0 right after: the
first call on worker 1 fails as the ps loss, the ps recovery's reconnect makes worker 1's
context again, and its next calls named per-worker iterators of the old context
("Unable to find the relevant tensor remote_handle"): that failed futures, as the
function's own error. Now worker 1 is taken out and rejoins with its iterators made again.
"""

import time

import pytest
from _summing_step import summing_training

import psclient

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def test_a_worker_restarted_unnoticed_then_a_ps_lost_fails_no_future(three_workers_one_ps,
                                                                       restore_shared_clusters, tmp_path):
    cluster = three_workers_one_ps
    strategy = psclient.ParameterServerStrategy(cluster.cluster, hang_timeout=2.0,
                                                checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        dataset_fn, step = summing_training(strategy)

        iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

        def run(count):
            futures = [strategy.schedule(step, args=(iterator,)) for _ in range(count)]
            strategy.join(timeout=120)
            return [f.exception() for f in futures]

        assert run(30) == [None] * 30
        strategy.save_checkpoint()
        cluster.kill("worker", 1)
        cluster.restart("worker", 1)  # no call in between: unnoticed
        cluster.kill("ps", 0)
        cluster.restart("ps", 0)
        errors = run(20) + run(20)
        assert errors == [None] * 40, [e for e in errors if e is not None][:2]
        stats = strategy.stats(read_ps=False)
        assert stats["ps"][0]["recoveries"] == 1
        deadline = time.monotonic() + 120
        while strategy.stats(read_ps=False)["workers"][1]["done"] == stats["workers"][1]["done"]:
            assert time.monotonic() < deadline, "worker 1 never ran a closure again"
            assert run(6) == [None] * 6
    finally:
        strategy.shutdown()
