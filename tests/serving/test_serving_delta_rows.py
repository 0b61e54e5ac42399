"""Deltas of an embedding-like dense variable hold its changed rows only (issue 35: a delta's size is
<= 1.2x the touched rows and their keys).

On a real cluster (2 workers, 2 ps) a partitioned `keras.layers.Embedding` (one shard per ps) is trained
between two cuts on a known set of rows: the delta holds exactly those rows, written by the ps holding
each, and `psclient.serving.load` applies them to the full version (row index = the shard's first row +
the row's index in the shard). Without a cluster: a delta of format 1 (every dense variable whole, what
psclient wrote before) is still applied, and a form this psclient does not know is refused by name.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
import psclient.serving  # noqa: E402
from psclient._coordinator.serving.delta_cut import ROW_DIFF_MIN_ROWS  # noqa: E402
from psclient._core import serving_deltas  # noqa: E402

ROWS, DIM = 20_000, 16  # two shards of 10,000 rows
TOUCHED = np.random.default_rng(7).choice(ROWS, 100, replace=False)  # rows of both shards
PROBE = np.concatenate([TOUCHED.reshape(-1, 2), [[0, 1], [ROWS - 1, 9_999], [10_000, 5]]]).astype("int64")


def build(rows=ROWS):
    ids = keras.Input((2,), dtype="int64", name="ids")
    embedded = keras.layers.Embedding(rows, DIM, name="table")(ids)
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(keras.layers.Flatten()(embedded)))
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    return model


def file_bytes(directory, prefix):
    return sum(entry.stat().st_size for entry in os.scandir(directory) if entry.name.startswith(prefix))


@pytest.mark.long
@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_a_delta_holds_the_trained_rows_of_a_partitioned_embedding_and_the_loader_applies_them(
        two_workers_two_ps, tmp_path):
    base = str(tmp_path / "model")
    strategy = psclient.ParameterServerStrategy(
        two_workers_two_ps.cluster,
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
    try:
        with strategy.scope():
            model = build()
        callback = psclient.ServingExport(base, every_seconds=3600, delta_every_seconds=3600)
        rng = np.random.default_rng(0)
        warm = rng.integers(0, ROWS, (64, 2))
        model.fit(warm, np.ones((64, 1), "float32"), batch_size=32, verbose=0, callbacks=[callback])
        assert callback.chain == (1, 0) and not callback.deltas  # the first version is a full one
        # One batch on the touched rows only: its delta, taken when fit ends, holds those rows.
        x = TOUCHED.reshape(-1, 2)
        model.fit(x, rng.standard_normal((len(x), 1)).astype("float32"), batch_size=len(x), verbose=0,
                  callbacks=[callback])
        want = model.predict(PROBE, verbose=0)
    finally:
        strategy.shutdown()

    (delta,) = callback.deltas
    manifest = serving_deltas.read_manifest(delta["path"])
    (table,) = [(j, entry) for j, entry in enumerate(manifest["dense"]) if entry["name"].startswith("table/")]
    j, entry = table
    assert entry["form"] == "rows" and entry["shard_rows"] == [ROWS // 2, ROWS // 2], entry
    assert entry["written"] == ["rows", "rows"] and sum(entry["changed"]) == len(TOUCHED), entry
    assert delta["dense_rows_changed"] == len(TOUCHED)
    written = []
    for i, offset in enumerate([0, ROWS // 2]):
        index = tf.io.parse_tensor(tf.io.read_file(os.path.join(delta["path"], f"d{j}_p{i}_idx")), tf.int64)
        written += list(index.numpy() + offset)
    assert sorted(written) == sorted(TOUCHED.tolist())
    row_bytes = file_bytes(delta["path"], f"d{j}_")
    touched_bytes = len(TOUCHED) * (DIM * 4 + 8)
    print(f"embedding rows in the delta: {row_bytes} B for {touched_bytes} B of touched rows and indices "
          f"({row_bytes / touched_bytes:.3f}x); whole delta {delta['bytes']} B; a whole table "
          f"{ROWS * DIM * 4} B")
    assert row_bytes <= 1.2 * touched_bytes
    others = [entry for entry in manifest["dense"] if not entry["name"].startswith("table/")]
    assert others and all(entry["form"] == "whole" for entry in others)  # the small head: whole

    with psclient.serving.load(base, poll_seconds=None) as loader:
        assert loader.version == (1, 1)
        diff = float(np.abs(loader(tf.constant(PROBE)).numpy() - want).max())
    assert diff <= 1e-6


def local_chain(base, rows):
    """A local model (no cluster) with a full version and one delta after it."""
    model = build(rows)
    callback = psclient.ServingExport(base, every_seconds=3600, delta_every_seconds=3600)
    x = np.random.default_rng(1).integers(0, rows, (32, 2))
    model.fit(x, np.ones((32, 1), "float32"), batch_size=32, verbose=0, callbacks=[callback])
    model.fit(x[:4], np.zeros((4, 1), "float32"), batch_size=4, verbose=0, callbacks=[callback])
    return model, callback


def test_a_format_1_delta_is_still_applied_and_an_unknown_form_is_refused(tmp_path):
    base = str(tmp_path / "model")
    model, callback = local_chain(base, ROW_DIFF_MIN_ROWS)
    (delta,) = callback.deltas
    manifest_path = os.path.join(delta["path"], serving_deltas.MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    assert [entry["form"] for entry in manifest["dense"]] == ["rows", "whole", "whole"]
    want = model.predict(PROBE % ROW_DIFF_MIN_ROWS, verbose=0)

    # What psclient wrote before row diffs: format 1, every dense variable whole in d<j>.
    old = str(tmp_path / "old")
    shutil.copytree(base, old)
    old_delta = os.path.join(serving_deltas.chain_dir(old, 1), "1")
    for j, entry in enumerate(manifest["dense"]):
        variable = next(v for v in model.variables if v.path + ":0" == entry["name"] or v.name == entry["name"])
        for name in os.listdir(old_delta):
            if name.startswith(f"d{j}_"):
                os.remove(os.path.join(old_delta, name))
        tf.io.write_file(os.path.join(old_delta, f"d{j}"), tf.io.serialize_tensor(tf.convert_to_tensor(variable)))
    with open(os.path.join(old_delta, serving_deltas.MANIFEST), "w") as f:
        json.dump({**manifest, "format": 1,
                   "dense": [{"name": e["name"], "dtype": e["dtype"]} for e in manifest["dense"]]}, f)
    for directory in (base, old):
        with psclient.serving.load(directory, poll_seconds=None) as loader:
            assert loader.version == (1, 1)
            np.testing.assert_allclose(loader(tf.constant(PROBE % ROW_DIFF_MIN_ROWS)).numpy(), want, atol=1e-6, rtol=0)

    # A form this psclient does not know: named, and nothing applied.
    with open(manifest_path, "w") as f:
        json.dump({**manifest, "dense": [{**manifest["dense"][0], "form": "bits"}, *manifest["dense"][1:]]}, f)
    with pytest.raises(psclient.ServingDirError, match="in form 'bits'; expected 'whole' or 'rows'"):
        psclient.serving.load(base, poll_seconds=None)


def test_a_variable_whose_rows_all_changed_is_written_whole_and_applied(tmp_path):
    # A dense layer's kernel of ROW_DIFF_MIN_ROWS rows: diffed per row, but every row changes at each
    # step, so the rows and their indices would be bigger than the kernel: written whole instead.
    base = str(tmp_path / "model")
    inputs = keras.Input((ROW_DIFF_MIN_ROWS,), name="x")
    model = keras.Model(inputs, keras.layers.Dense(2, name="wide")(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    callback = psclient.ServingExport(base, every_seconds=3600, delta_every_seconds=3600)
    x = np.random.default_rng(2).standard_normal((16, ROW_DIFF_MIN_ROWS)).astype("float32")
    model.fit(x, np.ones((16, 2), "float32"), batch_size=16, verbose=0, callbacks=[callback])
    model.fit(x, np.zeros((16, 2), "float32"), batch_size=16, verbose=0, callbacks=[callback])
    (delta,) = callback.deltas
    kernel = serving_deltas.read_manifest(delta["path"])["dense"][0]
    assert (kernel["form"], kernel["written"], kernel["changed"]) == ("rows", ["whole"], [ROW_DIFF_MIN_ROWS])
    assert sorted(name for name in os.listdir(delta["path"]) if name.startswith("d0")) == ["d0"]
    with psclient.serving.load(base, poll_seconds=None) as loader:
        assert loader.version == (1, 1)
        np.testing.assert_allclose(loader(tf.constant(x)).numpy(), model.predict(x, verbose=0), atol=1e-6, rtol=0)
