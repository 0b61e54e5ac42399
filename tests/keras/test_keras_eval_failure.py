"""model.evaluate stays exact when a worker is killed in the middle of it.

Kills a task, so it runs its own strategy; on the session's shared cluster,
whose worker it restarts before it ends.
"""

import threading

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from psclient._coordinator.strategy import ParameterServerStrategy  # noqa: E402


@pytest.mark.timeout(300)
def test_evaluate_exact_when_a_worker_dies_mid_evaluation(local_cluster):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4000, 16)).astype("float32")
    y = rng.integers(0, 4, 4000).astype("int32")
    local = local_cluster  # shared: worker 1 is restarted before the test ends
    strategy = ParameterServerStrategy(local.cluster)
    try:
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4),
            ])
            model.compile(
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        reference = keras.Sequential.from_config(model.get_config())
        reference.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
        )
        reference.set_weights(model.get_weights())
        want = reference.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)

        killed = threading.Event()
        ranges_after_kill = []

        class KillWorkerOne(keras.callbacks.Callback):
            def on_test_batch_end(self, batch, logs=None):
                if killed.is_set():
                    ranges_after_kill.append(batch)
                else:
                    local.kill("worker", 1)  # its range in flight is re-run elsewhere
                    killed.set()

        try:
            got = model.evaluate(
                x, y, batch_size=10, verbose=0, return_dict=True, callbacks=[KillWorkerOne()],
            )
        finally:
            local.restart("worker", 1)
        assert killed.is_set() and ranges_after_kill  # the kill happened with work left
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["accuracy"] == pytest.approx(want["accuracy"], rel=1e-6)
        # Every example counted once: no range lost, none merged twice.
        assert float(model._loss_tracker.count.numpy()) == 4000
    finally:
        strategy.shutdown()
