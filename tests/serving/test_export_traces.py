"""An export traces the model once (psclient._keras.serving): `model.export`, a second `model.export`
of the same model, `tf.saved_model.save`, `psclient.export_servable`, Keras's `ExportArchive` given
`SaveOptions`; on a cluster too, with a partitioned `Embedding` (each weight saved once, whole) and a
`DynamicEmbedding`. Keras alone traces it three times per export, four with a `DynamicEmbedding`
(benchmarks/results/serving_export-traces-before-2026-11-29.json: "traces").

Traces are counted by a layer of the model that counts its calls: the model is never run eagerly
here, so each call is a trace. Each SavedModel is loaded back and must answer as the model does.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
from psclient.layers import DynamicEmbedding  # noqa: E402

PROBE = np.arange(0, 40, dtype="int64").reshape(-1, 2)


class Counted(keras.layers.Layer):
    """The identity, counting its calls in `traces`; `on_trace(layer)`, if set, runs at each one."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.traces = 0
        self.on_trace = None

    def call(self, inputs):
        self.traces += 1
        if self.on_trace is not None:
            self.on_trace(self)
        return inputs


def build(rows=None):
    """ids -> [partitioned Embedding(rows) if rows] + DynamicEmbedding -> Counted -> BatchNormalization -> Dense."""
    ids = keras.Input((2,), dtype="int64", name="ids")
    parts = [keras.layers.Flatten()(DynamicEmbedding(4, capacity=64, name="dynamic")(ids))]
    if rows is not None:
        parts.append(keras.layers.Flatten()(keras.layers.Embedding(rows, 4, name="table")(ids)))
    joined = parts[0] if len(parts) == 1 else keras.layers.Concatenate()(parts)
    counted = Counted(name="counted")
    out = keras.layers.Dense(1, name="out")(keras.layers.BatchNormalization(name="bn")(counted(joined)))
    model = keras.Model(ids, out)
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    x = np.random.default_rng(0).integers(0, 40, (64, 2))
    model.fit(x, (x[:, :1] % 3).astype("float32"), batch_size=16, epochs=1, verbose=0)
    return model, counted


def traces_of(counted, write):
    before = counted.traces
    write()
    return counted.traces - before


def serves_as_the_model(path, model):
    """The SavedModel at `path` answers PROBE as `model` does (its `serve` and `serving_default`)."""
    loaded = tf.saved_model.load(path)
    expected = model.predict(PROBE, verbose=0)
    signature = loaded.signatures["serving_default"]
    (name,) = signature.structured_input_signature[1]
    (served,) = signature(**{name: tf.constant(PROBE)}).values()
    np.testing.assert_allclose(served.numpy(), expected, atol=1e-5, rtol=0)
    if hasattr(loaded, "serve"):
        np.testing.assert_allclose(loaded.serve(tf.constant(PROBE)).numpy(), expected, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def local_model():
    return build()


@pytest.mark.timeout(600)
def test_each_export_traces_the_model_once_and_serves_as_it(local_model, tmp_path):
    model, counted = local_model
    writes = {
        "export": lambda path: model.export(path, verbose=False),
        "export_again": lambda path: model.export(path, verbose=False),
        "saved_model_save": lambda path: tf.saved_model.save(model, path),
        "export_servable": lambda path: psclient.export_servable(model, path),
    }
    traces = {name: traces_of(counted, lambda: write(str(tmp_path / name))) for name, write in writes.items()}
    assert traces == dict.fromkeys(writes, 1), traces
    # The DynamicEmbedding's snapshot functions are kept from one export to the next: traced twice
    # for the four exports, once by Keras's exports and once inside the save context of
    # `tf.saved_model.save`, which TF traces apart (each export traced them again before: about a
    # sixth of its CPU).
    kept = model.get_layer("dynamic")._serving.functions  # noqa: SLF001 - what the layer keeps between exports
    counts = {shard: call.function.experimental_get_tracing_count() for shard, (_, call) in kept.items()}
    assert counts and set(counts.values()) == {2}, counts
    for name in ("export", "export_again", "saved_model_save"):
        serves_as_the_model(str(tmp_path / name), model)
    serves_as_the_model(str(tmp_path / "export_servable" / "1"), model)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("policy", [None, "expand_distributed_variables"])
def test_an_export_archive_with_save_options_traces_once(local_model, tmp_path, policy):
    """The trace Keras lists the variables from is made with the options TF's save then uses."""
    model, counted = local_model

    def write():
        archive = keras.export.ExportArchive()
        archive.track(model)
        archive.add_endpoint("serve", model.__call__, input_signature=[keras.InputSpec(shape=(None, 2), dtype="int64")])
        options = tf.saved_model.SaveOptions(experimental_variable_policy=policy)
        archive.write_out(str(tmp_path / "archive"), options, verbose=False)  # options given by position

    assert traces_of(counted, write) == 1
    serves_as_the_model(str(tmp_path / "archive"), model)


@pytest.mark.timeout(600)
def test_the_default_signature_is_left_alone_on_other_threads_and_after(local_model, tmp_path):
    """Only the exporting thread, while it exports, reads the model's default signature as None."""
    model, counted = local_model
    seen = {}
    reader_done = threading.Event()

    def read_on_another_thread(layer):
        layer.on_trace = None
        reader = threading.Thread(target=lambda: (seen.update(other=model._default_save_signature), reader_done.set()))
        reader.start()
        assert reader_done.wait(120), "the reader thread read the signature"
        reader.join()
        seen["exporting"] = model._default_save_signature

    counted.on_trace = read_on_another_thread
    try:
        model.export(str(tmp_path / "export"), verbose=False)
    finally:
        counted.on_trace = None
    assert seen["exporting"] is None
    assert isinstance(seen["other"], tf.types.experimental.GenericFunction), seen
    assert isinstance(model._default_save_signature, tf.types.experimental.GenericFunction)
    tf.saved_model.save(model, str(tmp_path / "saved"))  # its serving_default is the default signature
    serves_as_the_model(str(tmp_path / "saved"), model)


@pytest.mark.long
@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_on_a_cluster_an_export_traces_once_and_saves_each_weight_once(one_worker_two_ps, tmp_path):
    strategy = psclient.ParameterServerStrategy(
        one_worker_two_ps.cluster,
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
    try:
        with strategy.scope():
            model, counted = build(rows=100)
        table = next(w for w in model.get_layer("table").weights)
        assert len(table.value.shards) == 2, "the Embedding is partitioned over the 2 ps"
        writes = {
            "export": lambda path: model.export(path, verbose=False),
            "export_again": lambda path: model.export(path, verbose=False),
            "export_servable": lambda path: psclient.export_servable(model, path),  # on its own thread
        }
        traces = {name: traces_of(counted, lambda: write(str(tmp_path / name))) for name, write in writes.items()}
        assert traces == dict.fromkeys(writes, 1), traces
        for name in ("export", "export_again", "export_servable/1"):
            path = str(tmp_path / name)
            serves_as_the_model(path, model)
            shapes = [tuple(shape) for _, shape in tf.train.list_variables(os.path.join(path, "variables", "variables"))]
            assert shapes.count((100, 4)) == 1, shapes  # the partitioned table once, whole
            assert (50, 4) not in shapes, shapes  # not again as its shards
    finally:
        strategy.shutdown()
