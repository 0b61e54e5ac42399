"""A hung ps (SIGSTOPped) during `export_servable`: bounded, on a real cluster (issue 36 item 5).

The export gives up after hang_timeout with PSUnavailableError naming the ps,
publishes no version (its hidden directory is removed once the ps answers),
and after SIGCONT the next export is whole and no thread is left behind.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from _polling import wait_for
from _two_shard_model import fit_with_a_ps_stopped, two_shard_strategy_and_model

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
from psclient._coordinator.checkpoints.checkpoint_parts import late_threads  # noqa: E402
from psclient._keras.bounded_export import THREAD_NAME  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

HANG_TIMEOUT = 3.0
#: Beyond hang_timeout: the probe interval, a loaded machine's scheduling, the error's way back.
SLACK_S = 20.0
LIMIT = 120.0


@pytest.fixture
def cluster(one_worker_two_ps, restore_shared_clusters):
    """The shared 1 worker + 2 ps; every task runs again after the test (SIGCONT)."""
    return one_worker_two_ps


def _versions(base_dir):
    return sorted(name for name in os.listdir(base_dir) if name.isdigit())


def _hidden(base_dir):
    return sorted(name for name in os.listdir(base_dir) if name.startswith(".psclient-version"))


def _export_threads():
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def _strategy_and_model(cluster, tmp_path):
    strategy, model, x, y = two_shard_strategy_and_model(cluster, HANG_TIMEOUT)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    return strategy, model, x


def _back_to_normal(cluster, strategy, model, x, base_dir):
    cluster.resume("ps", 1)
    wait_for(lambda: not _export_threads() and not late_threads(), LIMIT,
             "the export and the probes left waiting on ps:1 to end")
    assert _versions(base_dir) == [] and _hidden(base_dir) == [], os.listdir(base_dir)
    want = model.predict(x[:8], verbose=0)
    path = psclient.export_servable(model, base_dir)
    assert _versions(base_dir) == ["1"] and _hidden(base_dir) == []
    served = tf.saved_model.load(path)
    np.testing.assert_allclose(served.serve(tf.constant(x[:8])).numpy(), want, atol=1e-6)


def _loader_serves(base_dir, version, model, x):
    """`psclient.serving.load(base_dir)` serves `version` (full, deltas) and predicts what `model` does."""
    import psclient.serving

    want = model.predict(x, verbose=0)
    with psclient.serving.load(base_dir, poll_seconds=None) as loader:
        assert loader.version == version
        np.testing.assert_allclose(loader(tf.constant(x)).numpy(), want, atol=1e-5)


def _fails_naming_ps1(error, seconds):
    assert isinstance(error, psclient.PSUnavailableError), repr(error)
    assert "ps:1" in str(error) and f"hang_timeout={HANG_TIMEOUT:g}" in str(error), str(error)
    assert error.task == "ps:1"
    assert seconds < HANG_TIMEOUT + SLACK_S, f"gave up after {seconds:.1f} s"


def test_an_export_with_a_ps_already_stopped_fails_within_hang_timeout_and_writes_nothing(cluster, tmp_path):
    base_dir = str(tmp_path / "serving")
    os.makedirs(base_dir)
    strategy, model, x = _strategy_and_model(cluster, tmp_path)
    try:
        cluster.stop("ps", 1)
        started = time.monotonic()
        with pytest.raises(psclient.PSUnavailableError) as caught:
            psclient.export_servable(model, base_dir)
        _fails_naming_ps1(caught.value, time.monotonic() - started)
        assert "nothing was written" in str(caught.value)
        assert _versions(base_dir) == [] and _hidden(base_dir) == []
        _back_to_normal(cluster, strategy, model, x, base_dir)
    finally:
        cluster.resume("ps", 1)
        strategy.shutdown()


def test_a_ps_stopped_during_an_export_fails_it_within_hang_timeout_and_publishes_nothing(cluster, tmp_path):
    base_dir = str(tmp_path / "serving")
    os.makedirs(base_dir)
    strategy, model, x = _strategy_and_model(cluster, tmp_path)
    try:
        outcome = {}

        def export():
            started = time.monotonic()
            try:
                outcome["path"] = psclient.export_servable(model, base_dir)
            except Exception as error:  # noqa: BLE001 - checked below
                outcome["error"] = error
            outcome["seconds"] = time.monotonic() - started

        caller = threading.Thread(target=export, name="export-under-test")
        caller.start()
        try:
            # Stopped as soon as the export's hidden directory exists (its traces and writes still to come).
            wait_for(lambda: _hidden(base_dir) or not caller.is_alive(), LIMIT, "the export to begin")
            stopped = time.monotonic()
            cluster.stop("ps", 1)
        finally:
            caller.join(LIMIT)
        assert not caller.is_alive(), "export_servable did not return with ps:1 stopped"
        assert "error" in outcome, f"the export published {outcome.get('path')} although ps:1 was stopped"
        _fails_naming_ps1(outcome["error"], time.monotonic() - stopped)
        assert "not published" in str(outcome["error"]), str(outcome["error"])  # given up on mid-export
        assert _versions(base_dir) == []  # a reader sees no version: the hidden one is removed once ps:1 answers
        _back_to_normal(cluster, strategy, model, x, base_dir)
    finally:
        cluster.resume("ps", 1)
        strategy.shutdown()


def test_fit_goes_on_when_a_serving_export_is_given_up_on_a_hung_ps(cluster, tmp_path):
    """`ServingExport` in `fit`: an export given up on a hung ps (epoch 1's) is noted, fit goes on once
    the ps answers, and the export is made again (the next batch's end): the newest version serves the
    model. (It raised out of fit, ending the training.)"""
    base_dir = str(tmp_path / "serving")
    strategy, model, x = _strategy_and_model(cluster, tmp_path)
    callback = psclient.ServingExport(base_dir, every_epochs=1, keep=None)
    try:
        fit_with_a_ps_stopped(cluster, model, x, (x[:, :1] % 3).astype("float32"), 1, [callback],
                              lambda: callback.failed_exports, LIMIT)
        assert [f["task"] for f in callback.failed_exports] == ["ps:1"], callback.failed_exports
        assert f"hang_timeout={HANG_TIMEOUT:g}" in callback.failed_exports[0]["error"]
        # Epoch 1's export given up, made again at the next batch's end; then epochs 2 and 3: nothing
        # half-written.
        assert [os.path.basename(path) for path in callback.exported] == ["1", "2", "3"]
        wait_for(lambda: not _export_threads(), LIMIT, "the export given up on to end")
        assert _versions(base_dir) == ["1", "2", "3"] and _hidden(base_dir) == [], os.listdir(base_dir)
        served = tf.saved_model.load(callback.exported[-1])
        np.testing.assert_allclose(served.serve(tf.constant(x[:8])).numpy(), model.predict(x[:8], verbose=0),
                                   atol=1e-6)
    finally:
        strategy.shutdown()


def test_a_full_version_of_a_delta_chain_given_up_on_a_hung_ps_is_made_again_and_its_chain_served(cluster, tmp_path):
    """With deltas, the chain's base is cut on the export's thread after every ps answered its probe
    (before the export): a ps stopped before a full version fails it within hang_timeout as without
    deltas (the base's copies are not waited for on the caller's thread), and the chain made after the
    resume serves the model."""

    base_dir = str(tmp_path / "serving")
    strategy, model, x = _strategy_and_model(cluster, tmp_path)
    callback = psclient.ServingExport(base_dir, every_epochs=1, keep=None, delta_every_seconds=3600)
    try:
        fit_with_a_ps_stopped(cluster, model, x, (x[:, :1] % 3).astype("float32"), 1, [callback],
                              lambda: callback.failed_exports, LIMIT)
        assert [f["task"] for f in callback.failed_exports] == ["ps:1"], callback.failed_exports
        assert [os.path.basename(path) for path in callback.exported] == ["1", "2", "3"]
        assert callback.chain == (3, 1) and not callback.failed_deltas, (callback.chain, callback.failed_deltas)
        wait_for(lambda: not _export_threads(), LIMIT, "the export given up on to end")
        assert _versions(base_dir) == ["1", "2", "3"] and _hidden(base_dir) == [], os.listdir(base_dir)
        _loader_serves(base_dir, (3, 1), model, x[:8])
    finally:
        callback.release()
        strategy.shutdown()


def test_a_delta_cut_on_a_ps_stopped_after_the_join_is_given_up_within_hang_timeout(cluster, tmp_path, monkeypatch):
    """A delta's cut (the copies on the ps tasks, taken once the steps in flight ended) gives up on a ps
    that stops right then, as a full version does: the fit's last delta is noted in `failed_exports`
    with the ps, and once the ps answers the delta is taken again (`fit`'s end tries it again; a batch's
    end would make a full version): the chain goes on from the same base. (It waited for the ps.)"""
    from psclient._keras import servable

    base_dir = str(tmp_path / "serving")
    strategy, model, x = _strategy_and_model(cluster, tmp_path)
    y = (x[:, :1] % 3).astype("float32")
    callback = psclient.ServingExport(base_dir, every_seconds=3600, keep=None, delta_every_seconds=3600)
    outcome = {}
    try:
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[callback])
        assert callback.chain == (1, 0)
        real_join, stopped = servable._join_steps, []

        def join_then_stop_ps1():
            real_join()
            if not stopped:  # the fit's last delta: no step in flight, its cut next
                stopped.append(time.monotonic())
                cluster.stop("ps", 1)

        monkeypatch.setattr(servable, "_join_steps", join_then_stop_ps1)

        def fit():
            try:
                model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[callback])
            except Exception as error:  # noqa: BLE001 - checked below
                outcome["error"] = error

        fitting = threading.Thread(target=fit, name="fit-under-test")
        fitting.start()
        try:
            wait_for(lambda: callback.failed_exports or not fitting.is_alive(), LIMIT,
                     "the delta's cut to be given up on ps:1")
            given_up = time.monotonic()
        finally:
            cluster.resume("ps", 1)
            fitting.join(LIMIT)
        assert not fitting.is_alive() and "error" not in outcome, outcome.get("error")
        assert given_up - stopped[0] < HANG_TIMEOUT + SLACK_S, f"gave up after {given_up - stopped[0]:.1f} s"
        (failure,) = callback.failed_exports
        assert failure["task"] == "ps:1" and "a ServingExport delta's cut" in failure["error"], failure
        assert [os.path.basename(path) for path in callback.exported] == ["1"]
        assert callback.chain == (1, 1) and not callback.failed_deltas, (callback.chain, callback.failed_deltas)
        _loader_serves(base_dir, (1, 1), model, x[:8])
    finally:
        cluster.resume("ps", 1)
        callback.release()
        strategy.shutdown()


def _delta_threads():
    return [t for t in threading.enumerate() if t.name == "psclient-serving-deltas"]


def test_a_delta_write_on_a_ps_stopped_under_it_is_given_up_and_never_published(cluster, tmp_path):
    """A delta being written (each ps writes its part while training goes on) when a ps stops: the
    wait for it at `fit`'s end gives up after hang_timeout (recorded in `failed_deltas`, naming the
    ps; `fit` returns), nothing of it is ever visible, its hidden directory is removed once the ps
    answers, and the next version is a full one that serves the model. (The wait was unbounded.)"""
    from psclient._core import serving_deltas

    base_dir = str(tmp_path / "serving")
    strategy, model, x = _strategy_and_model(cluster, tmp_path)
    y = (x[:, :1] % 3).astype("float32")
    callback = psclient.ServingExport(base_dir, every_seconds=3600, keep=None, delta_every_seconds=3600)
    try:
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[callback])
        assert callback.chain == (1, 0)
        chain_1 = serving_deltas.chain_dir(base_dir, 1)
        stopped = []

        def stop_ps1_after_ps0_wrote(device):
            if not stopped and "/job:ps/replica:0/task:0" in device:
                stopped.append(time.monotonic())
                cluster.stop("ps", 1)

        callback._chain_state.after_part = stop_ps1_after_ps0_wrote  # noqa: SLF001 - the test's seam
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[callback])  # ends with delta 1
        returned = time.monotonic()
        callback._chain_state.after_part = None  # noqa: SLF001
        assert stopped, "ps 1 was not stopped during the delta's write"
        assert returned - stopped[0] < HANG_TIMEOUT + SLACK_S, f"fit returned {returned - stopped[0]:.1f} s after"
        (failure,) = callback.failed_deltas
        assert (failure["version"], failure["seq"]) == (1, 1), failure
        assert "ps:1" in failure["error"] and "a ServingExport delta's write" in failure["error"], failure
        assert callback.chain == (1, 0) and not callback.deltas
        assert not [name for name in os.listdir(chain_1) if name.isdigit()]  # never visible
    finally:
        cluster.resume("ps", 1)
    try:
        wait_for(lambda: not _delta_threads(), LIMIT, "the given-up delta's thread to end once ps 1 answers")
        assert os.listdir(chain_1) == [], os.listdir(chain_1)  # its hidden directory removed, nothing published
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[callback])
        assert callback.chain == (2, 0), callback.chain  # the chain starts again with a full version
        _loader_serves(base_dir, (2, 0), model, x[:8])
    finally:
        callback.release()
        strategy.shutdown()
