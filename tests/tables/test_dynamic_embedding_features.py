"""One DynamicEmbedding over a dict of features (psclient/_keras/dynamic_embedding.py): each feature
trains as a layer of its own would, the features share the capacity, bad features are named, the
export serves without a cluster; and the same on a cluster (2 workers, 2 ps)."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from psclient._coordinator.strategy import ParameterServerStrategy  # noqa: E402
from psclient.layers import DynamicEmbedding  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def sgd_steps(layer, batches):
    """Eager custom-loop steps: loss = sum over the features of sum(rows * weights)."""
    optimizer = keras.optimizers.SGD(0.1)
    for features, weights in batches:
        with tf.GradientTape() as tape:
            out = layer(features, training=True)
            if not isinstance(out, dict):
                out = {"only": out}
            loss = sum(tf.reduce_sum(out[name] * weights[name]) for name in out)
        optimizer.apply(tape.gradient(loss, layer.trainable_variables), layer.trainable_variables)


def test_each_feature_trains_as_its_own_layer_would():
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(4):
        keys = {name: tf.constant(rng.integers(0, 6, 5), tf.int64) for name in ("user", "item")}  # same ids
        weights = {name: tf.constant(rng.normal(size=(5, 3)), tf.float32) for name in keys}
        batches.append((keys, weights))
    init = keras.initializers.Constant(0.25)
    both = DynamicEmbedding(3, embeddings_initializer=init, capacity=64, name="both")
    sgd_steps(both, batches)
    for name in ("user", "item"):
        alone = DynamicEmbedding(3, embeddings_initializer=init, capacity=32, name=f"{name}_alone")
        sgd_steps(alone, [(keys[name], {"only": weights[name]}) for keys, weights in batches])
        probe = tf.range(6, dtype=tf.int64)
        np.testing.assert_allclose(both({name: probe})[name].numpy(), alone(probe).numpy(), rtol=1e-6)
    # An id in both features holds two rows: the table holds the distinct (feature, id) pairs.
    pairs = {(name, int(k)) for keys, _ in batches for name, ids in keys.items() for k in ids.numpy()}
    assert sum(entry["rows"] for entry in both.table_stats()) == len(pairs)


def test_the_features_share_the_capacity_and_take_any_shape():
    layer = DynamicEmbedding(2, capacity=8, combiner=None, name="shared_capacity")
    sgd_steps(layer, [({"a": tf.range(start, start + 3, dtype=tf.int64), "b": tf.range(start, start + 3, dtype=tf.int64)},
                       {"a": tf.ones([3, 2]), "b": tf.ones([3, 2])}) for start in (0, 3)])
    stats = layer.table_stats()[0]
    assert stats["admissions"] == 12 and stats["rows"] <= 8 and stats["evictions"] >= 4  # 8 rows for 12 keys
    out = layer({"a": tf.zeros([3, 4], tf.int64), "b": tf.constant([7], tf.int32)})
    assert out["a"].shape == (3, 4, 2) and out["b"].shape == (1, 2)
    summed = DynamicEmbedding(2, combiner="sum", name="multi_hot")(
        {"tags": tf.ragged.constant([[1, 2], [3]], tf.int64), "ids": tf.constant([[1, 1]], tf.int64)})
    assert summed["tags"].shape == (2, 2) and summed["ids"].shape == (1, 2)


@pytest.mark.parametrize("features, error, match", [
    ({}, ValueError, r"Received: a dict with keys \[\]\. Expected a non-empty dict of features"),
    ({"user": tf.constant([1.5])}, TypeError, r"argument `inputs\['user'\]`.*Received: dtype=float32"),
    ({"user": tf.constant(3, tf.int64)}, ValueError, r"argument `inputs\['user'\]`.*Expected a tensor of rank >= 1"),
])
def test_a_bad_feature_is_named(features, error, match):
    with pytest.raises(error, match=match):
        DynamicEmbedding(2, name="bad_features")(features)


def dict_model(name, capacity):
    inputs = {field: keras.Input((), dtype="int64", name=field) for field in ("user", "item", "query")}
    embedded = DynamicEmbedding(4, capacity=capacity, name=name)(inputs)
    hidden = keras.layers.Concatenate()([embedded[field] for field in sorted(embedded)])
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def clicks(seed, n=768):
    """The user id sets the label; item and query ids are noise drawn from the same numbers."""
    rng = np.random.default_rng(seed)
    x = {field: rng.integers(0, 200, n) for field in ("user", "item", "query")}
    return x, (x["user"] % 2).astype("float32")


def test_saved_dict_model_predicts_the_same_without_the_training_state(tmp_path):
    model = dict_model("local_features", capacity=1000)
    x, y = clicks(0, n=256)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    np.testing.assert_allclose(keras.models.load_model(path).predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.long
def test_on_a_cluster_fit_learns_and_the_export_serves_without_it(two_workers_two_ps, tmp_path):
    strategy = ParameterServerStrategy(two_workers_two_ps.cluster)
    try:
        with strategy.scope():
            model = dict_model("cluster_features", capacity=400)  # 600 (feature, id) pairs: evictions
        x, y = clicks(1)
        history = model.fit(x, y, batch_size=64, epochs=3, verbose=0)
        assert history.history["loss"][-1] < history.history["loss"][0]
        per_ps = strategy.stats()["dynamic_embeddings"]["cluster_features"]
        assert [entry["ps"] for entry in per_ps] == [0, 1]
        assert all(0 < entry["rows"] <= 200 and entry["evictions"] > 0 for entry in per_ps)
        predicted = model.predict(x, verbose=0)
        path = str(tmp_path / "m.keras")
        model.save(path)
    finally:
        strategy.shutdown()
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), predicted, rtol=1e-5, atol=1e-6)


@pytest.mark.long
def test_the_strategys_storage_setting_reaches_its_tables(two_workers_two_ps):
    # StrategyConfig.dynamic_table_storage, handed down by the layer to its table (no environment switch).
    strategy = ParameterServerStrategy(two_workers_two_ps.cluster, dynamic_table_storage="hash")
    try:
        with strategy.scope():
            model = dict_model("hashed_features", capacity=400)
        layer = model.get_layer("hashed_features")
        assert [shard.dense for shard in layer.table.shards] == [False, False]  # hash tables, not the matrix
        assert layer.table.owner() is strategy
        x, y = clicks(2)
        history = model.fit(x, y, batch_size=64, epochs=2, verbose=0)
        assert history.history["loss"][-1] < history.history["loss"][0]
        per_ps = strategy.stats()["dynamic_embeddings"]["hashed_features"]
        assert [entry["ps"] for entry in per_ps] == [0, 1] and all(entry["rows"] > 0 for entry in per_ps)
    finally:
        strategy.shutdown()
