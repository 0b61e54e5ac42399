"""SidecarEvaluator on real checkpoints written by TensorFlow and Keras (no cluster needed)."""

import json
import logging
import os

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(180)

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import psclient  # noqa: E402
from psclient._sidecar.evaluator import SidecarEvaluator, write_final_marker  # noqa: E402
from psclient._sidecar.formats import CheckpointMismatchError  # noqa: E402

X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
Y = (X.sum(axis=1) > 0).astype("int64")


def build(extra_layer=False, drop_layer=False):
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="hidden")]
    if not drop_layer:
        layers.append(keras.layers.Dense(2, name="out"))
    if extra_layer:
        layers.append(keras.layers.Dense(2, name="more"))
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def data():
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)


def train_tf_checkpoints(directory, count):
    """Writes `count` CheckpointManager checkpoints, one per training epoch; returns their prefixes."""
    model = build()
    step = tf.Variable(0, dtype=tf.int64)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, step=step), str(directory), max_to_keep=None)
    prefixes = []
    for _ in range(count):
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
        step.assign_add(4)
        prefixes.append(manager.save())
    return prefixes


def evaluate_directly(prefix):
    model = build()
    tf.train.Checkpoint(model=model).read(prefix).expect_partial()
    return {k: float(v) for k, v in model.evaluate(data(), verbose=0, return_dict=True).items()}


def sidecar(directory, **kwargs):
    kwargs.setdefault("poll_interval", 0.05)
    kwargs.setdefault("idle_timeout", 30)
    return SidecarEvaluator(build(), data(), directory, **kwargs)


def test_tf_checkpoints_newest_first_until_the_final_marker(tmp_path, caplog):
    prefixes = train_tf_checkpoints(tmp_path, 3)
    write_final_marker(tmp_path, prefixes[-1], step=12)
    caplog.set_level(logging.INFO, logger="psclient.sidecar")
    report = sidecar(tmp_path).start()
    assert report.stop_reason == "the final checkpoint ckpt-3 is done"
    assert [e["checkpoint"] for e in report.evaluations] == ["ckpt-3"]
    assert report.skipped == ["ckpt-1", "ckpt-2"]
    assert "skipped ckpt-1, ckpt-2: evaluated the newer ckpt-3 instead" in caplog.text
    record = report.evaluations[0]
    assert record["step"] == 12  # The checkpoint's own `step` variable.
    assert record["metrics"] == pytest.approx(evaluate_directly(prefixes[-1]), rel=1e-6)
    lines = (tmp_path / "eval" / "evaluations.jsonl").read_text().splitlines()
    assert [json.loads(line)["checkpoint"] for line in lines] == ["ckpt-3"]
    events = [n for n in os.listdir(tmp_path / "eval") if n.startswith("events.out.tfevents")]
    assert events, os.listdir(tmp_path / "eval")
    summaries = {}
    for event in tf.compat.v1.train.summary_iterator(str(tmp_path / "eval" / events[0])):
        for value in event.summary.value:
            summaries[value.tag] = (event.step, float(tf.make_ndarray(value.tensor)))
    assert summaries["accuracy"] == (12, pytest.approx(record["metrics"]["accuracy"]))


def test_half_written_tf_checkpoint_is_never_read(tmp_path):
    (prefix,) = train_tf_checkpoints(tmp_path, 1)
    # ckpt-2's files exist but the state file does not name them yet: TF is still writing.
    (tmp_path / "ckpt-2.index").write_bytes(b"\x00garbage")
    (tmp_path / "ckpt-2.data-00000-of-00001").write_bytes(b"\x00garbage")
    report = sidecar(tmp_path, max_evaluations=1).start()
    assert [e["checkpoint"] for e in report.evaluations] == ["ckpt-1"]
    assert report.unreadable == [] and report.stop_reason == "max_evaluations=1 reached"
    assert report.evaluations[0]["metrics"] == pytest.approx(evaluate_directly(prefix), rel=1e-6)


def test_keras_files_corrupt_one_is_skipped_and_the_older_evaluated(tmp_path, caplog):
    model = build()
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    model.save_weights(tmp_path / "e1.weights.h5")
    good = model.evaluate(data(), verbose=0, return_dict=True)
    with open(tmp_path / "e1.weights.h5", "rb") as f:
        (tmp_path / "e2.weights.h5").write_bytes(f.read()[:300])  # Truncated: corrupt.
    os.utime(tmp_path / "e2.weights.h5", ns=(os.stat(tmp_path / "e1.weights.h5").st_mtime_ns + 10**9,) * 2)
    caplog.set_level(logging.INFO, logger="psclient.sidecar")
    report = sidecar(tmp_path, settle_time=0, max_evaluations=1).start()
    assert [e["checkpoint"] for e in report.evaluations] == ["e1.weights.h5"]
    assert len(report.unreadable) == 1 and "e2.weights.h5" in report.unreadable[0]
    assert "skipped e2.weights.h5: unreadable" in caplog.text
    record = report.evaluations[0]
    assert record["metrics"] == pytest.approx({k: float(v) for k, v in good.items()}, rel=1e-6)
    assert record["step"] == 4  # The optimizer's iterations: 64 examples / 16 per batch.


def test_truncated_tf_data_file_is_skipped_with_a_log_line(tmp_path, caplog):
    (prefix,) = train_tf_checkpoints(tmp_path, 1)
    data_file = tmp_path / "ckpt-1.data-00000-of-00001"
    data_file.write_bytes(data_file.read_bytes()[:40])  # TF's reader: IndexError, "Read less bytes".
    write_final_marker(tmp_path, prefix)
    caplog.set_level(logging.INFO, logger="psclient.sidecar")
    report = sidecar(tmp_path).start()
    assert report.evaluations == []
    assert len(report.unreadable) == 1 and report.unreadable[0].startswith("cannot read ckpt-1:")
    assert "skipped ckpt-1: unreadable" in caplog.text


def test_a_bug_while_reading_a_checkpoint_propagates_instead_of_unreadable(tmp_path, monkeypatch):
    from psclient._sidecar import formats

    build().save_weights(tmp_path / "m.weights.h5")
    write_final_marker(tmp_path, "m.weights.h5")

    def buggy(f):
        raise TypeError("a bug in psclient, not a damaged file")

    monkeypatch.setattr(formats, "_h5_variables", buggy)
    with pytest.raises(TypeError, match="a bug in psclient"):
        sidecar(tmp_path).start()


def test_a_keras_archive_without_weights_is_unreadable_not_a_crash(tmp_path):
    import zipfile

    with zipfile.ZipFile(tmp_path / "m.keras", "w") as archive:
        archive.writestr("config.json", "{}")
    write_final_marker(tmp_path, "m.keras")
    report = sidecar(tmp_path).start()
    assert report.evaluations == []
    assert report.unreadable == ["cannot read m.keras: it holds no model.weights.h5"]


def test_keras_file_and_export_best(tmp_path):
    model = build()
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0)
    model.save(tmp_path / "final.keras")
    write_final_marker(tmp_path, "final.keras")
    export = tmp_path / "best" / "best.keras"
    report = sidecar(tmp_path, export_best=export, best_metric="accuracy").start()
    assert [e["checkpoint"] for e in report.evaluations] == ["final.keras"]
    assert report.best["checkpoint"] == "final.keras"
    exported = keras.saving.load_model(export)
    np.testing.assert_allclose(exported.predict(X, verbose=0), model.predict(X, verbose=0), rtol=1e-5)
    assert [n for n in os.listdir(export.parent)] == ["best.keras"]  # No temporary left.


@pytest.mark.parametrize("kind", ["tf", "keras"])
@pytest.mark.parametrize("change, missing, extra", [
    ({"extra_layer": True}, "more/kernel", None),
    ({"drop_layer": True}, None, "out"),
])
def test_model_that_does_not_match_names_the_variables(tmp_path, kind, change, missing, extra):
    if kind == "tf":
        (prefix,) = train_tf_checkpoints(tmp_path, 1)
        write_final_marker(tmp_path, prefix)
    else:
        build().save_weights(tmp_path / "m.weights.h5")
        write_final_marker(tmp_path, "m.weights.h5")
    # The options as one EvaluatorConfig (the other tests pass them as keywords).
    evaluator = SidecarEvaluator(build(**change), data(), tmp_path,
                                 config=psclient.EvaluatorConfig(poll_interval=0.05, idle_timeout=30))
    assert evaluator.config.poll_interval == 0.05
    with pytest.raises(CheckpointMismatchError, match="does not match the checkpoint") as info:
        evaluator.start()
    error = info.value
    if missing:
        assert error.missing and not error.extra
        assert "missing from the checkpoint" in str(error)
        if kind == "tf":
            assert any(missing in m for m in error.missing), error.missing
        else:
            # Keras names layers in weights files by class and position, not by name.
            assert error.missing == ["layers/dense_2/vars/0 [2, 2]", "layers/dense_2/vars/1 [2]"]
    else:
        assert error.extra and not error.missing
        assert "extra in the checkpoint" in str(error)
        assert len(error.extra) == 2  # The kernel and bias of layer "out".


def test_wrong_model_key_lists_the_checkpoint_roots(tmp_path):
    (prefix,) = train_tf_checkpoints(tmp_path, 1)
    write_final_marker(tmp_path, prefix)
    with pytest.raises(CheckpointMismatchError, match=r"Received: model_key='net'. Expected one of .*\['model', 'save_counter', 'step'\]"):
        sidecar(tmp_path, model_key="net").start()


def test_missing_directory_waits_with_a_message_until_the_idle_timeout(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="psclient.sidecar")
    report = sidecar(tmp_path / "not-yet", idle_timeout=0.3).start()
    assert report.evaluations == []
    assert report.stop_reason == "the checkpoint directory does not exist for 0.3 s (idle_timeout)"
    assert caplog.text.count("waiting: the checkpoint directory does not exist") == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, r"argument `steps`. Received: steps=0. Expected an integer >= 1 or None"),
    ({"idle_timeout": -1}, r"argument `idle_timeout`. Received: idle_timeout=-1"),
    ({"export_best": "best.h5"}, r"argument `export_best`. Received: 'best.h5'. Expected a path ending in '.keras'"),
    ({"best_mode": "up"}, r"argument `best_mode`. Received: 'up'"),
])
def test_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SidecarEvaluator(build(), data(), tmp_path, **kwargs)


def test_uncompiled_model_is_rejected(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="Expected a compiled model"):
        SidecarEvaluator(model, data(), tmp_path)
