"""TF Serving's layout written safely, without a cluster: versions, one run per base_dir, keep, a
failed export leaves nothing visible, and bad input named (psclient._core.serving_dirs and
psclient.export_servable / ServingExport's argument checks)."""

from __future__ import annotations

import json
import os

import pytest

import psclient
from psclient._core import serving_dirs
from psclient._core.serving_dirs import RUN_MARKER, ServingDirError


def write_version(base, version=None, run_id="run-a", keep=None, take_over=False):
    """What export_servable does around the SavedModel, with a file for the model."""
    serving_dirs.claim(str(base), run_id, take_over)
    with serving_dirs.new_version(str(base), version) as (scratch, version):
        with open(os.path.join(scratch, "saved_model.pb"), "w") as f:
            f.write(f"version {version}")
    serving_dirs.prune(str(base), keep)
    return version


def visible(base):
    return sorted(name for name in os.listdir(base) if not name.startswith("."))


def test_versions_are_the_next_integer_and_a_chosen_one_must_be_new(tmp_path):
    base = tmp_path / "model"
    assert [write_version(base), write_version(base), write_version(base, version=10), write_version(base)] \
        == [1, 2, 10, 11]
    assert visible(base) == ["1", "10", "11", "2"]
    assert (base / "10" / "saved_model.pb").read_text() == "version 10"
    with pytest.raises(ServingDirError, match=r"argument `version`.*version=2, which exists"):
        write_version(base, version=2)
    assert [n for n in os.listdir(base) if n.startswith(".psclient-version-")] == []  # no scratch left


def test_keep_prunes_the_oldest_versions(tmp_path):
    base = tmp_path / "model"
    for _ in range(5):
        write_version(base, keep=2)
    assert visible(base) == ["4", "5"]
    assert serving_dirs.prune(str(base), None) == []


def test_a_failed_export_leaves_no_version_and_no_scratch(tmp_path):
    base = tmp_path / "model"
    write_version(base)

    class Full(OSError):
        pass

    with pytest.raises(Full):
        with serving_dirs.new_version(str(base), None) as (scratch, version):
            assert os.path.basename(scratch).startswith(".") and version == 2  # hidden while written
            with open(os.path.join(scratch, "variables.data"), "w") as f:
                f.write("half")
            raise Full("No space left on device")
    assert visible(base) == ["1"]
    assert sorted(os.listdir(base)) == [RUN_MARKER, "1"]


def test_another_runs_base_dir_is_refused_unless_taken_over(tmp_path):
    base = tmp_path / "model"
    write_version(base, run_id="run-a", keep=1)
    with pytest.raises(ServingDirError, match=r"run 'run-a' writes.*this is run 'run-b'.*take_over=True"):
        write_version(base, run_id="run-b", keep=1)
    assert visible(base) == ["1"]  # neither written nor pruned
    assert write_version(base, run_id="run-b", keep=1, take_over=True) == 2
    assert visible(base) == ["2"]
    assert json.loads((base / RUN_MARKER).read_text()) == {"run_id": "run-b"}
    with pytest.raises(ServingDirError, match="run 'run-b' writes"):
        write_version(base, run_id="run-a")  # the directory is run-b's now


def test_versions_without_a_marker_are_someone_elses(tmp_path):
    base = tmp_path / "model"
    (base / "7").mkdir(parents=True)
    with pytest.raises(ServingDirError, match=r"holds versions \[7\] but no psclient run marker"):
        write_version(base)
    assert write_version(base, take_over=True) == 8


def test_an_unreadable_marker_is_named(tmp_path):
    base = tmp_path / "model"
    base.mkdir()
    (base / RUN_MARKER).write_text("not json")
    with pytest.raises(ServingDirError, match="run marker .* cannot be read"):
        write_version(base)


@pytest.mark.parametrize("kwargs, message", [
    ({"version": -1}, r"argument `version`. Received: version=-1"),
    ({"version": True}, r"argument `version`. Received: version=True"),
    ({"version": "3"}, r"argument `version`. Received: version='3'"),
    ({"keep": 0}, r"argument `keep`. Received: keep=0"),
    ({"keep": 2.5}, r"argument `keep`. Received: keep=2.5"),
    ({"run_id": ""}, r"argument `run_id`. Received: run_id=''"),
    ({"take_over": "yes"}, r"argument `take_over`. Received: take_over='yes'"),
])
def test_export_servable_names_a_bad_argument(tmp_path, kwargs, message):
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises((ValueError, TypeError), match=message):
        psclient.export_servable(model, tmp_path / "model", **kwargs)
    assert not (tmp_path / "model").exists() or visible(tmp_path / "model") == []


def test_export_servable_names_a_bad_model_or_base_dir(tmp_path):
    keras = pytest.importorskip("keras")
    with pytest.raises(TypeError, match=r"argument `model`. Received: model of type str"):
        psclient.export_servable("model.keras", tmp_path)
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"argument `model`.*not built"):
        psclient.export_servable(unbuilt, tmp_path)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    (tmp_path / "file").write_text("")
    with pytest.raises(ServingDirError, match=r"argument `base_dir`.*not a directory"):
        psclient.export_servable(model, tmp_path / "file")
    with pytest.raises(TypeError, match=r"argument `base_dir`. Received: base_dir=3"):
        psclient.export_servable(model, 3)


@pytest.mark.parametrize("kwargs, message", [
    ({"every_seconds": 0}, r"argument `every_seconds`. Received: every_seconds=0"),
    ({"every_seconds": "10"}, r"argument `every_seconds`. Received: every_seconds='10'"),
    ({"every_epochs": 0}, r"argument `every_epochs`. Received: every_epochs=0"),
    ({"every_epochs": 1.5}, r"argument `every_epochs`. Received: every_epochs=1.5"),
    ({"keep": -1}, r"argument `keep`. Received: keep=-1"),
])
def test_serving_export_names_a_bad_argument(tmp_path, kwargs, message):
    pytest.importorskip("keras")
    with pytest.raises((ValueError, TypeError), match=message):
        psclient.ServingExport(tmp_path / "model", **kwargs)


def test_a_local_model_exports_and_a_failed_export_publishes_nothing(tmp_path, monkeypatch):
    keras = pytest.importorskip("keras")
    import numpy as np
    import tensorflow as tf

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    path = psclient.export_servable(model, tmp_path / "model", run_id="local")
    assert path == str(tmp_path / "model" / "1")
    loaded = tf.saved_model.load(path)
    x = np.ones((3, 2), "float32")
    np.testing.assert_allclose(loaded.serve(x).numpy(), model.predict(x, verbose=0), rtol=1e-6)

    def export_fails_midway(self, filepath, **kwargs):
        with open(os.path.join(filepath, "saved_model.pb"), "w") as f:
            f.write("half")
        raise OSError("No space left on device")

    monkeypatch.setattr(keras.Model, "export", export_fails_midway)
    with pytest.raises(OSError, match="No space left"):
        psclient.export_servable(model, tmp_path / "model", run_id="local")
    assert sorted(os.listdir(tmp_path / "model")) == [RUN_MARKER, "1"]


# ------------------------------------------------------------------ deltas (psclient._core.serving_deltas)
from psclient._core import serving_deltas  # noqa: E402
from psclient._core.serving_deltas import Step, next_step  # noqa: E402


def write_delta(base, version, seq, fail=False):
    with serving_deltas.new_delta(str(base), version, seq) as scratch:
        with open(os.path.join(scratch, "t0_s0_keys"), "w") as f:
            f.write("rows")
        if fail:
            raise OSError("disk full")
        serving_deltas.write_manifest(scratch, {"version": version, "seq": seq, "tables": [], "dense": []})


def test_deltas_sit_beside_the_versions_where_tf_serving_does_not_look(tmp_path):
    write_version(tmp_path)
    write_delta(tmp_path, 1, 1)
    write_delta(tmp_path, 1, 2)
    assert serving_dirs.versions(str(tmp_path)) == [1]  # what TF Serving scans: integers at the top only
    assert serving_deltas.deltas(str(tmp_path), 1) == [1, 2]
    manifest = serving_deltas.read_manifest(serving_deltas.chain_dir(str(tmp_path), 1) + "/2")
    assert (manifest["version"], manifest["seq"], manifest["format"]) == (1, 2, serving_deltas.FORMAT)


def test_a_failed_delta_leaves_nothing_visible_and_a_written_one_is_never_overwritten(tmp_path):
    write_version(tmp_path)
    with pytest.raises(OSError, match="disk full"):
        write_delta(tmp_path, 1, 1, fail=True)
    assert os.listdir(serving_deltas.chain_dir(str(tmp_path), 1)) == []  # the hidden scratch is gone too
    write_delta(tmp_path, 1, 1)
    with pytest.raises(ServingDirError, match="seq=1, which exists"):
        write_delta(tmp_path, 1, 1)


def test_the_deltas_of_a_pruned_version_go_with_it(tmp_path):
    for version in (1, 2, 3):
        write_version(tmp_path)
        write_delta(tmp_path, version, 1)
    serving_dirs.prune(str(tmp_path), keep=1)
    assert serving_deltas.prune_chains(str(tmp_path)) == [1, 2]
    assert visible(os.path.join(tmp_path, serving_deltas.DELTAS)) == ["3"]


def test_an_unreadable_manifest_is_named(tmp_path):
    os.makedirs(tmp_path / "d")
    with pytest.raises(ServingDirError, match="cannot be read"):
        serving_deltas.read_manifest(str(tmp_path / "d"))
    (tmp_path / "d" / serving_deltas.MANIFEST).write_text(json.dumps({"format": 99}))
    with pytest.raises(ServingDirError, match="unknown format"):
        serving_deltas.read_manifest(str(tmp_path / "d"))


@pytest.mark.parametrize("at, fulls, chain, handled, expected", [
    (None, [], [], None, Step("wait")),                              # nothing written yet
    (None, [3, 4], [], None, Step("load", 4)),                       # start from the newest full version
    ((4, 0), [3, 4], [1, 2], None, Step("apply", 4, 1)),             # then its deltas, in order
    ((4, 2), [3, 4], [1, 2], None, Step("wait")),
    ((4, 2), [4, 5], [1, 2, 3], None, Step("load", 5)),              # a newer full version wins
    ((4, 1), [4], [1, 3, 4], None, Step("load", 4, gap=2)),          # a gap: never delta 3 before 2
    ((4, 1), [4], [1, 3, 4], (4, 2), Step("wait")),                  # that gap answered: wait for 2
    ((4, 1), [4], [1, 2, 3, 4], (4, 2), Step("apply", 4, 2)),        # 2 came after all
])
def test_what_a_reader_does_next(at, fulls, chain, handled, expected):
    assert next_step(at, fulls, chain, handled) == expected


@pytest.mark.parametrize("argument, value", [("delta_every_seconds", 0), ("delta_every_seconds", "10"),
                                             ("full_every_deltas", 0), ("full_every_deltas", 2.5)])
def test_serving_export_names_a_bad_delta_argument(tmp_path, argument, value):
    with pytest.raises(ValueError, match=f"Invalid value for argument `{argument}`. Received: {argument}="):
        psclient.ServingExport(tmp_path, **{argument: value})
