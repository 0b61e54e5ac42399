"""Fault tolerance on a real LocalCluster: workers killed, hung and restarted; ps tasks lost.

Each test makes its own strategy (with short timeouts) on the session's
shared `local_cluster`, and leaves every task running when it ends (`heal`).
"""

import concurrent.futures
import time

import pytest
import tensorflow as tf
from _polling import wait_for
from _threads import psclient_threads

import psclient

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

HANG_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster


@pytest.fixture
def heal(cluster):
    """After the test: every task of the module's cluster runs again."""
    yield cluster
    for job, count in (("worker", 2), ("ps", 1)):
        for index in range(count):
            if not cluster.is_running(job, index):
                cluster.restart(job, index)


def make_strategy(cluster, **kwargs):
    kwargs.setdefault("hang_timeout", HANG_TIMEOUT)
    return psclient.ParameterServerStrategy(cluster.cluster, **kwargs)


def counting_step(strategy, work=2):
    with strategy.scope():
        steps = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step():
        x = tf.random.uniform([150, 150])
        for _ in range(work):
            x = tf.linalg.matmul(x, x) / 150.0
        steps.assign_add(1)
        return steps.read_value()

    return steps, step


def test_killed_worker_rejoins_after_restart_with_its_iterator_rebuilt(heal):
    cluster = heal
    strategy = make_strategy(cluster)
    try:
        steps, _ = counting_step(strategy)
        dataset = strategy.distribute_datasets_from_function(
            lambda ctx: tf.data.Dataset.range(1_000_000).map(lambda x: x + 1)
        )
        iterator = iter(dataset)

        @tf.function
        def step(it):
            steps.assign_add(1)
            return next(it)

        futures = [strategy.schedule(step, args=(iterator,)) for _ in range(200)]
        psclient.wait(futures[:20], timeout=120)
        cluster.kill("worker", 1)
        strategy.join(timeout=180)
        assert all(f.exception() is None for f in futures)
        assert strategy.stats()["workers"][1]["failures"] == 1

        cluster.restart("worker", 1)
        restarted = time.monotonic()
        wait_for(lambda: strategy.stats()["workers"][1]["up"], 60, "worker 1 to rejoin")
        rejoin_s = time.monotonic() - restarted
        # Its iterator was rebuilt: it serves elements again, from the start.
        done_before = strategy.stats()["workers"][1]["done"]
        more = [strategy.schedule(step, args=(iterator,)) for _ in range(100)]
        strategy.join(timeout=180)
        assert all(f.exception() is None for f in more)
        stats = strategy.stats()["workers"][1]
        assert stats["rejoins"] == 1
        assert stats["done"] > done_before, "the rejoined worker took no work"
        assert stats["last_recovery_s"] is not None
        assert rejoin_s < 30
    finally:
        strategy.shutdown()


def test_all_workers_killed_then_one_restarted_finishes_the_work(heal):
    cluster = heal
    strategy = make_strategy(cluster, worker_timeout=120)
    try:
        steps, step = counting_step(strategy)
        futures = [strategy.schedule(step) for _ in range(100)]
        psclient.wait(futures[:10], timeout=120)
        cluster.kill("worker", 0)
        cluster.kill("worker", 1)
        wait_for(lambda: not any(w["up"] for w in strategy.stats()["workers"]), 60, "both down")
        assert not strategy.done()
        cluster.restart("worker", 0)
        strategy.join(timeout=180)
        assert all(f.exception() is None for f in futures)
        assert steps.numpy() >= 100
        assert strategy.stats()["workers"][0]["rejoins"] == 1
    finally:
        strategy.shutdown()


def test_every_worker_gone_fails_join_and_results_after_worker_timeout(heal):
    cluster = heal
    strategy = make_strategy(cluster, worker_timeout=2.0)
    try:
        _, step = counting_step(strategy)
        strategy.schedule(step).result(60)
        cluster.kill("worker", 0)
        cluster.kill("worker", 1)
        futures = [strategy.schedule(step) for _ in range(20)]
        started = time.monotonic()
        with pytest.raises(psclient.WorkerUnavailableError, match="worker_timeout"):
            strategy.join(timeout=120)
        assert time.monotonic() - started < 60
        for future in futures:
            with pytest.raises((psclient.WorkerUnavailableError, concurrent.futures.CancelledError)):
                future.result(timeout=10)
        assert any(isinstance(f.exception(), psclient.WorkerUnavailableError) for f in futures)
    finally:
        strategy.shutdown()


def test_hung_worker_is_detected_its_work_moves_and_it_rejoins_on_resume(heal):
    cluster = heal
    strategy = make_strategy(cluster)
    try:
        steps, step = counting_step(strategy, work=4)
        futures = [strategy.schedule(step) for _ in range(150)]
        psclient.wait(futures[:10], timeout=120)
        cluster.stop("worker", 1)
        try:
            wait_for(lambda: not strategy.stats()["workers"][1]["up"], 60, "the hang to be detected")
            stats = strategy.stats()["workers"][1]
            assert HANG_TIMEOUT <= stats["last_detection_s"] < HANG_TIMEOUT + 5
            strategy.join(timeout=180)  # the other worker finishes everything
            assert all(f.exception() is None for f in futures)
        finally:
            cluster.resume("worker", 1)
        wait_for(lambda: strategy.stats()["workers"][1]["up"], 60, "worker 1 to rejoin after SIGCONT")
        assert strategy.stats()["workers"][1]["rejoins"] == 1
        # A stale answer from the abandoned attempt did not resolve anything twice.
        assert steps.numpy() >= 150
        more = [strategy.schedule(step) for _ in range(40)]
        strategy.join(timeout=120)
        assert all(f.exception() is None for f in more)
    finally:
        strategy.shutdown()


def test_lost_ps_without_checkpoint_dir_raises_ps_unavailable_promptly(heal):
    cluster = heal
    strategy = make_strategy(cluster)
    try:
        _, step = counting_step(strategy)
        futures = [strategy.schedule(step) for _ in range(100)]
        psclient.wait(futures[:10], timeout=120)
        cluster.kill("ps", 0)
        started = time.monotonic()
        with pytest.raises(psclient.PSUnavailableError, match="ps:0") as raised:
            strategy.join(timeout=120)
        assert time.monotonic() - started < 30
        assert raised.value.task == "ps:0"
        assert raised.value.address == cluster.cluster.address("ps", 0)
        with pytest.raises(psclient.PSUnavailableError):
            strategy.schedule(step)
    finally:
        strategy.shutdown()


def test_lost_ps_is_restored_from_the_newest_checkpoint_and_training_goes_on(heal, tmp_path):
    cluster = heal
    strategy = make_strategy(cluster, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=50)
    try:
        import keras

        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
            optimizer = keras.optimizers.Adam(0.01)
            optimizer.build(model.trainable_variables)
            steps = tf.Variable(0, dtype=tf.int64)
        x = tf.random.stateless_normal([32, 8], seed=[1, 2])
        y = tf.reduce_sum(x, axis=1, keepdims=True)

        @tf.function
        def train_step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                          model.trainable_variables))
            steps.assign_add(1)
            return loss

        futures = [strategy.schedule(train_step) for _ in range(300)]
        psclient.wait(futures[:120], timeout=180)
        # The first before any step; another once 50 more completed.
        wait_for(lambda: strategy.stats()["checkpoints_written"] >= 2, 60, "a second checkpoint")
        cluster.kill("ps", 0)
        cluster.restart("ps", 0)
        strategy.join(timeout=200)
        assert all(f.exception() is None for f in futures)
        stats = strategy.stats()
        ps = stats["ps"][0]
        assert ps["failures"] == 1 and ps["recoveries"] == 1
        assert ps["last_recovery_s"] < 15
        # The counter went back to the checkpoint, then counted every closure
        # completed after it (at least once: a re-run may count twice).
        rolled_back = ps["rolled_back_closures"]
        retried = sum(w["retried"] for w in stats["workers"])
        assert 300 - rolled_back <= steps.numpy() <= 300 - rolled_back + retried
        assert int(optimizer.iterations.numpy()) == int(steps.numpy())
        # Training goes on with the restored variables, and the loss is finite.
        assert float(strategy.schedule(train_step).result(60)) < float(futures[0].result())
    finally:
        strategy.shutdown()


def test_ps_recovery_goes_on_while_a_worker_is_down_and_its_resources_follow_it(heal, tmp_path, caplog):
    # A ps recovery rebuilds every worker's per-worker resources; a worker that
    # is down then keeps its resource pending (built when it is back) instead of
    # failing the recovery, and training goes on with the other worker.
    cluster = heal
    caplog.set_level("INFO", logger="psclient")
    strategy = make_strategy(cluster, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=20)
    try:
        with strategy.scope():
            steps = tf.Variable(0, dtype=tf.int64)
        coordinator = psclient.ClusterCoordinator(strategy)
        offsets = coordinator.create_per_worker_resources(lambda: tf.constant(1, dtype=tf.int64))

        @tf.function
        def step_with(offset):
            steps.assign_add(1)
            return steps.read_value() + offset

        psclient.wait([strategy.schedule(step_with, args=(offsets,)) for _ in range(60)], timeout=120)
        wait_for(lambda: strategy.stats()["checkpoints_written"] >= 2, 60, "a second checkpoint")
        cluster.kill("worker", 1)
        # The worker's loss is noticed when a call on it fails.
        psclient.wait([strategy.schedule(step_with, args=(offsets,)) for _ in range(10)], timeout=120)
        wait_for(lambda: not strategy.stats()["workers"][1]["up"], 60, "worker 1 taken out")
        # Once it is out of TF's view too (a ps restarted during that reconnect
        # is the case of test_a_ps_restarted_while_idle_is_recovered_...).
        wait_for(lambda: any("left out of the cluster" in r.getMessage() for r in caplog.records),
                 60, "worker 1 left out of TF's view")
        cluster.kill("ps", 0)
        cluster.restart("ps", 0)
        futures = [strategy.schedule(step_with, args=(offsets,)) for _ in range(30)]
        strategy.join(timeout=200)
        assert all(f.exception() is None for f in futures)
        assert strategy.stats()["ps"][0]["recoveries"] == 1
        cluster.restart("worker", 1)
        wait_for(lambda: strategy.stats()["workers"][1]["up"], 120, "worker 1 back")
        more = [strategy.schedule(step_with, args=(offsets,)) for _ in range(40)]
        strategy.join(timeout=200)
        assert all(f.exception() is None for f in more)
        assert strategy.stats()["workers"][1]["done"] > 0
    finally:
        strategy.shutdown()


def test_a_worker_that_dies_while_idle_is_taken_out_and_rejoins(heal):
    # No closure runs there: only the heartbeat can notice (its probe fails and
    # the port refuses). Before, such a worker stayed "up" until work reached it.
    cluster = heal
    strategy = make_strategy(cluster)
    try:
        steps, step = counting_step(strategy, work=1)
        psclient.wait([strategy.schedule(step) for _ in range(4)], timeout=120)
        cluster.kill("worker", 1)
        wait_for(lambda: not strategy.stats()["workers"][1]["up"], 60, "idle dead worker 1 taken out")
        assert strategy.stats()["workers"][0]["up"]
        cluster.restart("worker", 1)
        wait_for(lambda: strategy.stats()["workers"][1]["up"], 120, "worker 1 back")
        futures = [strategy.schedule(step) for _ in range(40)]
        strategy.join(timeout=120)
        assert all(f.exception() is None for f in futures)
    finally:
        strategy.shutdown()


def test_a_ps_restarted_while_idle_is_recovered_when_a_reconnect_introduces_it(heal, tmp_path, caplog):
    # The ps and a worker die while nothing runs: no call notices the ps. The
    # reconnect that drops the worker introduces the restarted ps to the
    # coordinator; before, every later read of its variables failed with
    # InvalidArgumentError ("invalid device"): scheduled functions failed,
    # checkpoints failed in a tight loop, and the ps was never recovered.
    cluster = heal
    caplog.set_level("INFO", logger="psclient")
    strategy = make_strategy(cluster, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=20)
    try:
        steps, step = counting_step(strategy, work=1)
        psclient.wait([strategy.schedule(step) for _ in range(30)], timeout=120)
        wait_for(lambda: strategy.stats()["checkpoints_written"] >= 2, 60, "a checkpoint after 20 steps")
        cluster.kill("worker", 1)
        cluster.kill("ps", 0)
        wait_for(lambda: not strategy.stats()["workers"][1]["up"], 60, "idle dead worker 1 taken out")
        cluster.restart("ps", 0)
        wait_for(lambda: strategy.stats()["ps"][0]["recoveries"] == 1, 120, "the restarted ps recovered")
        futures = [strategy.schedule(step) for _ in range(20)]
        strategy.join(timeout=120)
        assert [f.exception() for f in futures] == [None] * 20
        stats = strategy.stats()
        assert stats["ps"][0]["failures"] == 1
        # Restored (to 20 or more), then counted on.
        assert 40 <= int(steps.numpy()) <= 50
        failures = [r.getMessage() for r in caplog.records if "recovery step" in r.getMessage()]
        assert len(failures) < 10, failures
    finally:
        strategy.shutdown()


def test_probing_a_hung_worker_does_not_freeze_the_coordinators_threads(heal):
    # Made under the worker's device, the probe's constant was copied there
    # holding the GIL: with the worker SIGSTOPped, every thread of the
    # coordinator (the one that would SIGCONT it too) froze until it answered.
    import threading

    from psclient._coordinator import runtime

    cluster = heal
    strategy = make_strategy(cluster)
    try:
        runtime.probe(runtime.worker_device(1))  # connected, and the channel warm
        cluster.stop("worker", 1)
        try:
            ended = []  # how the probe ended, if it did: said by the assertion below

            def probe():
                try:
                    runtime.probe(runtime.worker_device(1))
                    ended.append(f"returned at {time.monotonic() - started:.2f} s")
                except Exception as error:  # noqa: BLE001 - any end is reported, none expected
                    ended.append(f"raised at {time.monotonic() - started:.2f} s: {error!r}"[:2000])

            probing = threading.Thread(target=probe, daemon=True)
            started = time.monotonic()
            probing.start()
            last = time.monotonic()
            worst = 0.0
            while time.monotonic() - started < 5.0:
                time.sleep(0.01)  # a thread of the coordinator that wants to run
                now = time.monotonic()
                worst, last = max(worst, now - last), now
            # The probe still waits on the hung worker (once seen ended within 5 s on a loaded machine,
            # cause unknown: the message says how it ended, and whether the task was still stopped)...
            assert probing.is_alive(), (ended, cluster.is_running("worker", 1), strategy.stats()["workers"][1])
            assert worst < 3.0  # ...and this thread ran meanwhile (frozen: >= 5 s)
        finally:
            cluster.resume("worker", 1)
        probing.join(60)
    finally:
        strategy.shutdown()


def test_shutdown_with_a_hung_worker_returns_within_hang_timeout(heal):
    import threading

    cluster = heal
    strategy = make_strategy(cluster)
    try:
        _, step = counting_step(strategy, work=4)
        futures = [strategy.schedule(step) for _ in range(60)]
        psclient.wait(futures[:5], timeout=120)
        cluster.stop("worker", 0)
        wait_for(lambda: not strategy.stats()["workers"][0]["up"], 60, "the hang to be detected")
        started = time.monotonic()
        strategy.shutdown()
        assert time.monotonic() - started < HANG_TIMEOUT + 5
    finally:
        strategy.shutdown()
        cluster.resume("worker", 0)
    # Once the worker answers, the thread that waited on it ends too.
    stuck = [t for t in threading.enumerate() if t.name.startswith("psclient-worker0")]
    for thread in stuck:
        thread.join(60)
    assert not any(t.is_alive() for t in stuck)


def test_keras_fit_goes_on_through_a_ps_restart_mid_epoch(heal, tmp_path):
    import threading

    import keras
    import numpy as np

    cluster = heal
    strategy = make_strategy(cluster, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=40)
    killer = None
    try:
        with strategy.scope():
            model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, "relu"), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        x = np.random.default_rng(0).normal(size=(2048, 16)).astype("float32")
        y = x.sum(axis=1, keepdims=True)

        class RestartPs(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                nonlocal killer
                if batch == 30 and killer is None:
                    killer = threading.Thread(target=lambda: (cluster.kill("ps", 0), cluster.restart("ps", 0)))
                    killer.start()

        history = model.fit(x, y, batch_size=64, epochs=4, steps_per_epoch=60, verbose=0,
                            callbacks=[RestartPs()])
        killer.join(60)
        ps = strategy.stats()["ps"][0]
        assert ps["recoveries"] == 1
        # The optimizer's step counter went back with everything else, by
        # the steps the rollback undid (one step per closure here). A step
        # retried after a transient error right after the restart may have
        # counted itself before failing (docs/api.md, Semantics): at most once more
        # per retry.
        expected = 4 * 60 - ps["rolled_back_closures"]
        retried = sum(w["retried"] for w in strategy.stats()["workers"])
        assert expected <= int(model.optimizer.iterations.numpy()) <= expected + retried
        assert len(history.history["loss"]) == 4
        assert history.history["loss"][-1] < history.history["loss"][0]
    finally:
        if killer is not None:
            killer.join(60)
        strategy.shutdown()


def test_a_forgotten_strategy_is_collected_and_never_blocks_the_next_one(local_cluster):
    import gc
    import threading
    import weakref

    before = set(threading.enumerate())
    strategy = psclient.ParameterServerStrategy(local_cluster.cluster, hang_timeout=HANG_TIMEOUT)
    _, step = counting_step(strategy)
    assert strategy.schedule(step).result(60) >= 1
    threads = psclient_threads(set(threading.enumerate()) - before)
    assert any(t.name == "psclient-health" for t in threads)
    forgotten = weakref.ref(strategy)
    del strategy  # no shutdown(): its threads and finalizer must not keep it alive
    gc.collect()
    assert forgotten() is None
    for thread in threads:
        thread.join(30)
    assert not [t.name for t in threads if t.is_alive()]
    following = psclient.ParameterServerStrategy(local_cluster.cluster, hang_timeout=HANG_TIMEOUT)
    try:
        _, step = counting_step(following)
        assert following.schedule(step).result(60) >= 1
    finally:
        following.shutdown()
