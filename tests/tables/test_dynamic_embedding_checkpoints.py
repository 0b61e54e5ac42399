"""DynamicEmbedding tables in checkpoints, on one real cluster (2 workers, 3 ps; strategies use 2 or 3 of
the ps): each ps saves its own shards, restore into the same or another number of ps tasks, a lost ps
gets its shards back, Keras's BackupAndRestore / ModelCheckpoint and the sidecar evaluator carry the
rows, a SIGKILLed coordinator resumes, and an export predicts without a cluster what the cluster did."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from _paths import ROOT_STR, TESTS_STR
from _polling import wait_for

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
from psclient._coordinator.tables.dynamic_tables import shard_of  # noqa: E402
from psclient._coordinator.runtime import ps_index_of  # noqa: E402
from _conversions import RemoteConversions  # noqa: E402
from _dynamic_coordinator import CAPACITY, UNKNOWN, data, make_model, probe  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
HELPER = os.path.join(TESTS_STR, "_dynamic_coordinator.py")


@pytest.fixture()
def local(two_workers_three_ps, restore_shared_clusters):
    """The session's 2 workers + 3 ps (shared with tests/checkpoints/test_checkpoint_parts.py); a ps a test
    killed is restarted after it."""
    return two_workers_three_ps


def jobs(local, num_ps):
    """The cluster with its first `num_ps` ps tasks (no chief: a coordinator picks its own port)."""
    spec = local.cluster.training_spec()
    return {"worker": list(spec["worker"]), "ps": list(spec["ps"][:num_ps])}


def connect(local, num_ps, **kwargs):
    return psclient.ParameterServerStrategy(psclient.Cluster(jobs(local, num_ps)), **kwargs)


def by_key(states):
    """{key: (counters, row, {slot: value})} over every shard of `layer.export_state()`.

    (A row may lack counters: with two workers, a row one step's scan evicted can be written back
    by another step; see docs/dynamic_embeddings.md.)
    """
    out = {}
    for state in states:
        counters = dict(zip(state["keys"].tolist(), state["counters"].reshape(-1, 2).tolist()))
        for i, key in enumerate(state["row_keys"].tolist()):
            out[key] = (counters.get(key), state["rows"][i].tolist(),
                        {name: value[i].tolist() for name, value in state["slots"].items()})
    return out


def assert_no_table_conversions(seen):
    """No Python value converted under a ps's device by the tables' save or restore: TF copies such a
    value to the ps holding the GIL, so a ps hung then would stop every coordinator thread
    (tests/strategy/test_no_remote_conversions.py). Before they ran traced: 26 in a save, 252 in a
    restore of one table on 2 ps."""
    mine = [found for found in seen.found
            if any(name in found[2] for name in ("table_checkpoint.py", "table_ranges.py", "dense_shard.py",
                                                 "key_index.py", "key_hash.py", "dynamic_tables.py"))]
    assert not mine, "\n\n".join(f"{device}: {value}\n{stack}" for device, value, stack in mine)


@pytest.mark.long
def test_each_ps_saves_its_shards_and_restore_resplits_them(local, tmp_path):
    x, y = data(0)
    strategy = connect(local, 2, checkpoint_dir=tmp_path)
    try:
        with strategy.scope():
            model, layer = make_model("ids")
        model.fit(x, y, epochs=2, batch_size=64, verbose=0)
        with RemoteConversions() as seen:  # each shard's save runs on its ps: nothing converted there
            path = strategy.save_checkpoint()
        assert_no_table_conversions(seen)
        with RemoteConversions() as seen:  # each shard's stats in one traced call on its ps
            stats = layer.table_stats()
        assert_no_table_conversions(seen)
        saved, predicted = layer.export_state(), model.predict(probe(), verbose=0)
        model.fit(x, y, epochs=1, batch_size=64, verbose=0)  # the tables move on after the checkpoint
        assert by_key(layer.export_state()) != by_key(saved)
    finally:
        strategy.shutdown()
    layout = json.loads(tf.train.load_checkpoint(path).get_tensor("psclient_layout"))
    parts = {part["task"]: part["keys"] for part in layout["parts"]}
    for ps in (0, 1):  # each ps wrote its own shard, in its own part
        assert {f"table/0000/ps{ps}/rows", f"table/0000/ps{ps}/slot/accumulator"} <= set(parts[f"ps:{ps}"])
    assert set(parts) == {"ps:0", "ps:1"}  # the coordinator's own part holds only scalars and the layout
    assert layout["tables"]["table/0000"]["name"] == "ids"
    assert sum(e["rows"] for e in stats) > 0 and sum(e["evictions"] for e in stats) > 0

    for num_ps in (2, 3):
        strategy = connect(local, num_ps, checkpoint_dir=tmp_path)
        try:
            with strategy.scope():
                model, layer = make_model("ids")
            with RemoteConversions() as seen:  # the re-split runs on the ps tasks: nothing converted there
                assert strategy.restore() is not None  # ckpt-2, or the one the next fit took before its first step
            assert_no_table_conversions(seen)
            restored = layer.export_state()
            if num_ps == 2:
                assert by_key(restored) == by_key(saved)  # keys, counters, rows and slots
                assert layer.table_stats() == stats  # clocks, admissions, evictions per ps
                np.testing.assert_allclose(model.predict(probe(), verbose=0), predicted, rtol=1e-5, atol=1e-6)
            else:
                for index, state in enumerate(restored):  # every key on the ps that owns it now
                    assert (shard_of(tf.constant(state["keys"]), 3).numpy() == index).all()
                now = layer.table_stats()
                assert sum(e["admissions"] for e in now) == sum(e["admissions"] for e in stats)
                # A ps that got more keys than its share (a third of the capacity) evicted its least
                # recently seen ones at the restore: counted, and the others restored as they were.
                kept, before = by_key(restored), by_key(saved)
                assert all(before[key] == value for key, value in kept.items())
                assert all(e["rows"] <= -(-CAPACITY // 3) for e in now)
                assert len(before) - len(kept) == (sum(e["evictions"] for e in now)
                                                   - sum(e["evictions"] for e in stats))
            history = model.fit(x, y, epochs=1, batch_size=64, verbose=0)  # training goes on from there
            assert np.isfinite(history.history["loss"][-1])
        finally:
            strategy.shutdown()


@pytest.mark.long
def test_the_shards_counters_are_no_model_variables(local, tmp_path):
    counts = []
    for num_ps in (2, 3):
        strategy = connect(local, num_ps)
        try:
            with strategy.scope():
                model, layer = make_model("counted")
            names = [entry["name"] for entry in strategy.placement()["variables"]]
            assert not any("clock" in name or "admissions" in name for name in names), names
            counts.append(len(names))
            assert sorted(ps_index_of(shard.clock.device) for shard in layer.table.shards) == list(range(num_ps))
        finally:
            strategy.shutdown()
    assert counts[0] == counts[1]  # a checkpoint's variables do not depend on the number of ps


def test_predict_with_dict_inputs_on_a_compiled_model_never_fitted(local):
    strategy = connect(local, 2)
    try:
        with strategy.scope():
            inputs = {name: keras.Input((1,), dtype="int64", name=name) for name in ("user", "item")}
            layer = psclient.layers.DynamicEmbedding(4, name="dict_ids", embeddings_initializer="ones")
            merged = keras.layers.Concatenate()([keras.layers.Flatten()(layer(inputs[n])) for n in ("user", "item")])
            model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(merged))
            model.compile(optimizer="adagrad", loss="mse", metrics=["mae"])
        x = {"user": np.array([[1], [2]]), "item": np.array([[3], [4]])}
        # Never trained: every key reads the default (zero) row, so the output is the bias (0).
        np.testing.assert_array_equal(model.predict(x, verbose=0), np.zeros((2, 1)))
    finally:
        strategy.shutdown()


@pytest.mark.long
def test_a_lost_ps_gets_its_shards_back_from_the_checkpoint(local, tmp_path):
    x, y = data(1, n=128)
    keys = tf.constant(np.unique(x))
    strategy = connect(local, 2, checkpoint_dir=tmp_path)
    try:
        with strategy.scope():
            model, layer = make_model("lost_ids", keras.optimizers.SGD(0.5))

        @tf.function
        def step(ids, labels):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model.loss(labels, model(ids, training=True)))
            model.optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return loss

        @tf.function
        def read(ids):
            return layer(ids, training=False)

        for _ in range(3):
            strategy.schedule(step, (x, y))
        strategy.join()
        strategy.save_checkpoint()
        saved, rows = by_key(layer.export_state()), read(keys).numpy()
        before = strategy.stats()["dynamic_embeddings"]["lost_ids"]
        try:
            local.kill("ps", 1)
        finally:
            local.restart("ps", 1)
        # Nothing ran against the restarted ps yet: stats() meets it first (or the probes did) and
        # reports it to the recovery, which re-makes the shards and restores them (and every
        # variable) from the checkpoint; stats() does not wait for that (a monitoring thread's
        # call would hang as long): the shard is reported as being recovered, the other read.
        first = strategy.stats()["dynamic_embeddings"]["lost_ids"]
        assert first[0] == before[0], (first, before)
        assert first[1]["available"] is False and first[1]["recovering"] is True, first
        wait_for(lambda: strategy.stats(read_ps=False)["ps"][1]["recoveries"] == 1, 300, "ps 1 recovered")
        entries = strategy.stats()["dynamic_embeddings"]["lost_ids"]
        assert entries == before, (entries, before)
        again = strategy.schedule(read, (keys,)).result(timeout=300)
        assert strategy.stats()["ps"][1]["recoveries"] == 1
        np.testing.assert_array_equal(again, rows)
        assert by_key(layer.export_state()) == saved
        assert np.isfinite(strategy.schedule(step, (x, y)).result(timeout=120))
    finally:
        strategy.shutdown()


@pytest.mark.long
def test_keras_callbacks_and_the_sidecar_carry_the_rows(local, tmp_path):
    x, y = data(2)
    strategy = connect(local, 2)
    try:
        with strategy.scope():
            model, layer = make_model("cb_ids")
        backup = psclient.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False)
        writer = psclient.ModelCheckpoint(str(tmp_path / "ckpts"))
        model.fit(x, y, epochs=2, batch_size=64, verbose=0, callbacks=[backup, writer])
        saved, predicted = by_key(layer.export_state()), model.predict(probe(), verbose=0)
        with strategy.scope():
            model, layer = make_model("cb_ids_2")
        history = model.fit(x, y, epochs=2, batch_size=64, verbose=0,
                            callbacks=[psclient.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False)])
        assert history.history == {}  # resumed after the last epoch: nothing left to train
        assert by_key(layer.export_state()) == saved
    finally:
        strategy.shutdown()
    evaluated, _ = make_model("sidecar_ids")  # no cluster: a local table
    report = psclient.SidecarEvaluator(evaluated, (x, y), tmp_path / "ckpts", max_evaluations=1,
                                       settle_time=0, idle_timeout=60, poll_interval=0.1).start()
    assert len(report.evaluations) == 1, report
    np.testing.assert_allclose(evaluated.predict(probe(), verbose=0), predicted, rtol=1e-5, atol=1e-6)


def _child(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT_STR, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, HELPER, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=os.path.dirname(HELPER))


def _first_json(process, timeout):
    """The child's first JSON line (its stderr in the failure message)."""
    for line in process.stdout:
        if line.startswith("{"):
            return json.loads(line)
    process.wait(timeout=timeout)
    pytest.fail(f"no result from the child (exit {process.returncode}): {process.stderr.read()[-3000:]}")


@pytest.mark.long
def test_a_killed_coordinator_resumes_and_its_export_serves_without_a_cluster(local, tmp_path):
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(jobs(local, 3)))
    child = _child("train", cluster_file, tmp_path / "ckpt")
    try:
        first = _first_json(child, 300)
        child.send_signal(signal.SIGKILL)  # while it trains on
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=60)
        child.stdout.close()
        child.stderr.close()

    strategy = connect(local, 3, checkpoint_dir=tmp_path / "ckpt")
    try:
        with strategy.scope():
            model, _ = make_model("ids")
        assert strategy.restore()["path"] >= first["path"]  # or one the next fit took before its first step
        np.testing.assert_allclose(model.predict(probe(), verbose=0), first["predicted"], rtol=1e-5, atol=1e-6)
        x, y = data(3)
        model.fit(x, y, epochs=1, batch_size=64, verbose=0)
        predicted = model.predict(probe(), verbose=0)
        model.save(tmp_path / "m.keras")
    finally:
        strategy.shutdown()

    server = _child("serve", tmp_path / "m.keras")
    try:
        served = _first_json(server, 300)
        assert server.wait(timeout=120) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=60)
        server.stdout.close()
        server.stderr.close()
    np.testing.assert_allclose(served["predicted"], predicted, rtol=1e-5, atol=1e-6)
    assert np.array(served["unknown_rows"]).shape == (len(UNKNOWN), 4)
    assert not np.any(served["unknown_rows"])  # unknown keys read the default (zero) row
