"""model.evaluate / model.predict on the cluster against single-process Keras, and saving."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(300)

_RNG = np.random.default_rng(1)
X = _RNG.standard_normal((203, 6)).astype("float32")  # 203: batches do not divide it
Y = _RNG.integers(0, 3, 203).astype("int32")
W = _RNG.uniform(0.5, 2.0, 203).astype("float32")


def build(metrics=True):
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(12, activation="relu"),
        keras.layers.Dense(3, activation="softmax"),
    ])
    if metrics:
        model.compile(
            optimizer="adam",
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")],
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="weighted_acc")],
        )
    return model


@pytest.fixture(scope="module")
def trained(strategy):
    """A model trained a little on the cluster, and a local copy with the same weights."""
    with strategy.scope():
        model = build()
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0)
    local = build()
    local.set_weights(model.get_weights())
    return model, local


def test_evaluate_equals_single_process(trained):
    model, local = trained
    for kwargs in ({"batch_size": 16}, {"batch_size": 7, "sample_weight": W}, {"batch_size": 10, "steps": 5}):
        got = model.evaluate(X, Y, verbose=0, return_dict=True, **kwargs)
        want = local.evaluate(X, Y, verbose=0, return_dict=True, **kwargs)
        assert set(got) == set(want)
        for name in want:
            assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name


def test_evaluate_dataset_list_order_and_progress_bar(trained, capsys):
    model, local = trained
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(20)
    got = model.evaluate(dataset, verbose=1)
    want = local.evaluate(dataset, verbose=0)
    assert np.allclose(got, want, rtol=1e-5)
    assert "11/11" in capsys.readouterr().out  # 203 rows in batches of 20
    # Evaluation leaves its (merged) state in the metric variables, as Keras's does.
    assert float(model._loss_tracker.count.numpy()) == pytest.approx(203)


def test_evaluate_callbacks_see_progress(trained):
    model, _ = trained
    seen = []

    class Record(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            seen.append(batch)

        def on_test_end(self, logs=None):
            seen.append(("end", sorted(logs)))

    model.evaluate(X, Y, batch_size=8, verbose=0, callbacks=[Record()])
    batches = seen[:-1]
    assert batches == sorted(batches) and batches[-1] == 25  # 26 batches, last index 25
    assert seen[-1] == ("end", ["accuracy", "loss", "top2", "weighted_acc"])


def test_predict_returns_outputs_in_input_order(trained):
    model, local = trained
    for batch_size in (32, 9):
        got = model.predict(X, batch_size=batch_size, verbose=0)
        want = local.predict(X, batch_size=batch_size, verbose=0)
        assert got.shape == (203, 3)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    dataset = tf.data.Dataset.from_tensor_slices(X).batch(25)
    np.testing.assert_allclose(model.predict(dataset, verbose=0), local.predict(dataset, verbose=0), rtol=1e-5, atol=1e-6)


def test_file_backed_data_of_unknown_size_and_reshuffled_data(trained, tmp_path):
    """A CSV file read by make_csv_dataset (size unknown), and a dataset that
    reshuffles on every pass: each example counted once, as Keras counts it."""
    model, local = trained
    path = tmp_path / "data.csv"
    with open(path, "w") as f:
        f.write("a,b,c,d,e,f,label\n")
        f.writelines(",".join(f"{v!r}" for v in row) + f",{label}\n" for row, label in zip(X.tolist(), Y.tolist()))

    def csv(with_labels=True):
        data = tf.data.experimental.make_csv_dataset(
            str(path), batch_size=6, label_name="label", num_epochs=1, shuffle=False,
            column_defaults=[tf.float32] * 6 + [tf.int32],
        )
        if with_labels:
            return data.map(lambda cols, label: (tf.stack(list(cols.values()), axis=1), label))
        return data.map(lambda cols, label: tf.stack(list(cols.values()), axis=1))

    assert int(csv().cardinality()) == tf.data.UNKNOWN_CARDINALITY
    got = model.evaluate(csv(), verbose=0, return_dict=True)
    want = local.evaluate(csv(), verbose=0, return_dict=True)
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name
    assert float(model._loss_tracker.count.numpy()) == 203
    np.testing.assert_allclose(
        model.predict(csv(with_labels=False), verbose=0), local.predict(csv(with_labels=False), verbose=0),
        rtol=1e-5, atol=1e-6,
    )
    # Sums over the examples do not depend on their order: Keras's numbers, from one pass.
    reshuffled = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(203, seed=5).batch(16)
    got = model.evaluate(reshuffled, verbose=0, return_dict=True)
    want = local.evaluate(X, Y, batch_size=16, verbose=0, return_dict=True)
    assert float(model._loss_tracker.count.numpy()) == 203
    for name in ("loss", "accuracy", "top2"):
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name


def test_predict_multiple_outputs_keep_structure(strategy):
    with strategy.scope():
        inputs = keras.Input((6,))
        model = keras.Model(inputs, {"a": keras.layers.Dense(2)(inputs), "b": keras.layers.Dense(1)(inputs)})
    local = keras.Model.from_config(model.get_config())
    local.set_weights(model.get_weights())
    got = model.predict(X, batch_size=50, verbose=0)
    want = local.predict(X, batch_size=50, verbose=0)
    assert set(got) == {"a", "b"}
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)


_LOAD_SCRIPT = """
import json, sys
import numpy as np
import keras
model = keras.saving.load_model(sys.argv[1])
np.savez(sys.argv[2], *model.get_weights())
print(json.dumps({"devices": sorted({v._value.device for v in model.weights}),
                  "pred": model.predict(np.ones((1, 6), "float32"), verbose=0).tolist()}))
"""


def test_saved_model_loads_without_a_cluster(trained, tmp_path):
    model, _ = trained
    path = str(tmp_path / "m.keras")
    model.save(path)
    ps_weights = [v.numpy() for v in model.weights]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, path, str(tmp_path / "w.npz")],
        capture_output=True, text=True, timeout=240, env=env, check=True,
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert not any("/job:ps" in d or "/job:worker" in d for d in loaded["devices"])  # a plain local model
    with np.load(tmp_path / "w.npz") as saved:
        weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    assert len(weights) == len(ps_weights)
    for got, want in zip(weights, ps_weights):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(loaded["pred"], model.predict(np.ones((1, 6), "float32"), verbose=0), rtol=1e-6)
