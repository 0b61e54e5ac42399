"""DynamicEmbedding without a cluster: optimizers against references computed here, admission,
eviction, bad input, multi-hot and export (psclient/_keras/dynamic_embedding.py,
psclient/_coordinator/tables/dynamic_tables.py). The cluster path: test_dynamic_embedding_cluster.py."""

from __future__ import annotations

import collections

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from psclient._core.dynamic_tables import choose_evictions  # noqa: E402
from psclient.layers import DynamicEmbedding, UnsupportedOptimizerError  # noqa: E402

DIM = 2
START = 0.5  # every new row: Constant(START)


def train(layer, optimizer, batches):
    """One eager custom-loop step per (keys, weights): loss = sum(rows * weights)."""
    for keys, weights in batches:
        with tf.GradientTape() as tape:
            out = layer(tf.constant(keys, tf.int64), training=True)
            loss = tf.reduce_sum(out * tf.constant(weights, tf.float32))
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply(grads, layer.trainable_variables)


def traced_step(layer, optimizer):
    """A tf.function training step: loss = sum of the layer's rows for `keys`."""

    @tf.function
    def step(keys):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(keys, training=True))
        optimizer.apply(tape.gradient(loss, layer.trainable_variables), layer.trainable_variables)

    return step


def rows_of(layer, keys):
    return layer(tf.constant(keys, tf.int64), training=False).numpy()


def reference(kind, batches, **kw):
    """Lazy updates by hand: per key, the gradient summed over its occurrences; slots change only when touched."""
    rows, slots = {}, {}
    for step, (keys, weights) in enumerate(batches, start=1):
        grads = collections.defaultdict(lambda: np.zeros(DIM))
        for key, w in zip(keys, weights):
            grads[key] += np.asarray(w, dtype="float64")
        for key, g in grads.items():
            r = rows.setdefault(key, np.full(DIM, START))
            s = slots.setdefault(key, {"m": np.zeros(DIM), "v": np.zeros(DIM), "acc": np.full(DIM, 0.1),
                                       "lin": np.zeros(DIM)})
            lr = kw["lr"]
            if kind == "sgd":
                s["m"] = 0.9 * s["m"] - lr * g
                rows[key] = r + s["m"]
            elif kind == "adagrad":
                s["acc"] = s["acc"] + g * g
                rows[key] = r - lr * g / np.sqrt(s["acc"] + 1e-7)
            elif kind == "adam":
                s["m"] = s["m"] + (g - s["m"]) * 0.1
                s["v"] = s["v"] + (g * g - s["v"]) * 0.001
                alpha = lr * np.sqrt(1 - 0.999**step) / (1 - 0.9**step)
                rows[key] = r - alpha * s["m"] / (np.sqrt(s["v"]) + 1e-7)
            elif kind == "ftrl":
                l1, l2 = 0.01, 0.02
                new_acc = s["acc"] + g * g
                s["lin"] = s["lin"] + g - (new_acc**0.5 - s["acc"] ** 0.5) / lr * r
                quadratic = new_acc**0.5 / lr + 2 * l2
                rows[key] = (np.clip(s["lin"], -l1, l1) - s["lin"]) / quadratic
                s["acc"] = new_acc
    return rows


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.1, epsilon=1e-7),
    "adam": lambda: keras.optimizers.Adam(0.1, epsilon=1e-7),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1, initial_accumulator_value=0.1, l1_regularization_strength=0.01,
                                          l2_regularization_strength=0.02),
}
# Key 2 twice in the first batch (gradients summed); key 1 untouched in the last two (lazy).
BATCHES = [
    ([1, 2, 2], [[1.0, -2.0], [0.5, 0.5], [0.25, -1.0]]),
    ([2, 3], [[-1.0, 0.3], [2.0, 1.0]]),
    ([3, 4, 2], [[0.2, 0.2], [-0.7, 0.1], [1.5, -0.5]]),
]


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_optimizer_updates_only_touched_rows_as_the_reference_does(kind):
    layer = DynamicEmbedding(DIM, embeddings_initializer=keras.initializers.Constant(START))
    train(layer, OPTIMIZERS[kind](), BATCHES)
    expected = reference(kind, BATCHES, lr=0.1)
    keys = sorted(expected)
    np.testing.assert_allclose(rows_of(layer, keys), np.stack([expected[k] for k in keys]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer, named", [
    (lambda: keras.optimizers.RMSprop(0.1), "RMSprop"),
    (lambda: keras.optimizers.AdamW(0.1), "AdamW"),
    (lambda: keras.optimizers.Adam(0.1, amsgrad=True), "amsgrad=True"),
    (lambda: keras.optimizers.SGD(0.1, clipnorm=1.0), "clipnorm=1.0"),
])
def test_unsupported_optimizer_is_named_with_what_works(optimizer, named):
    layer = DynamicEmbedding(DIM)
    with pytest.raises(UnsupportedOptimizerError, match=rf"(?s)optimizer=.*{named}.*Expected one of SGD"):
        train(layer, optimizer(), BATCHES[:1])


def test_rows_start_from_a_stream_seeded_by_the_key():
    a = DynamicEmbedding(8, name="a")
    b = DynamicEmbedding.from_config({**a.get_config(), "name": "b"})  # the same initializer seed
    train(a, keras.optimizers.SGD(0.0), [([5, 6], np.zeros((2, 8)))])
    train(b, keras.optimizers.SGD(0.0), [([6, 5], np.zeros((2, 8)))])
    rows = rows_of(a, [5, 6])
    np.testing.assert_array_equal(rows, rows_of(b, [5, 6]))  # same key, same first row
    assert np.all(np.abs(rows) <= 0.05) and not np.allclose(rows[0], rows[1])  # "uniform": +-0.05
    other = DynamicEmbedding(8, name="c")  # unseeded: a seed of its own, as Keras draws one
    train(other, keras.optimizers.SGD(0.0), [([5], np.zeros((1, 8)))])
    assert not np.allclose(rows_of(other, [5]), rows[:1])


def test_min_frequency_admits_a_key_at_its_kth_sighting():
    layer = DynamicEmbedding(DIM, embeddings_initializer=keras.initializers.Constant(START), min_frequency=2)
    sgd, grad = keras.optimizers.SGD(1.0), [[1.0, 1.0]]
    out = layer(tf.constant([7], tf.int64), training=True)
    np.testing.assert_array_equal(out.numpy(), np.zeros((1, DIM)))  # first sighting: zeros
    train(layer, sgd, [([7], grad)])  # second sighting: admitted, starts at START, updated once
    np.testing.assert_allclose(rows_of(layer, [7]), [[START - 1.0] * DIM])
    train(layer, sgd, [([8, 8], [[1.0, 1.0], [1.0, 1.0]])])  # two sightings in one batch: admitted now
    np.testing.assert_allclose(rows_of(layer, [8]), [[START - 2.0] * DIM])
    [stats] = layer.table_stats()
    assert (stats["rows"], stats["tracked_keys"], stats["admissions"]) == (2, 2, 2)


def test_capacity_evicts_the_least_recently_used_rows_on_the_table_itself():
    layer = DynamicEmbedding(DIM, capacity=4)
    sgd = keras.optimizers.SGD(0.1)
    for key in (1, 2, 3, 4, 2, 5):  # 1 is the least recently used, then 3
        train(layer, sgd, [([key], [[1.0, 1.0]])])
    [state] = layer.export_state()
    # 5 rows for 4: evicted down to 4 - headroom(4) = 3 rows.
    assert sorted(state["row_keys"]) == [2, 4, 5]
    assert layer.table_stats()[0]["evictions"] == 2
    np.testing.assert_array_equal(rows_of(layer, [1, 3]), np.zeros((2, DIM)))  # gone: the default row


def test_a_scan_removes_what_the_rules_choose():
    rng = np.random.default_rng(3)
    layer = DynamicEmbedding(DIM, min_frequency=2, capacity=10, ttl_steps=5)
    layer.build()
    keys = rng.choice(10**9, 40, replace=False)
    counts, last = rng.integers(1, 4, 40), rng.integers(0, 21, 40)
    admitted = keys[counts >= 2]
    layer.import_state([{"keys": keys, "counters": np.stack([counts, last], 1), "row_keys": admitted,
                         "rows": np.ones((len(admitted), DIM)), "slots": {}, "clock": 20, "admissions": 0,
                         "evictions": 0}])
    gone = choose_evictions(zip(keys.tolist(), counts.tolist(), last.tolist()), 20, layer.table.policy, 10)
    layer.table.scan()  # the import scanned already: more rows than the capacity came in
    [state] = layer.export_state()
    assert set(state["keys"].tolist()) == set(keys.tolist()) - gone
    assert set(state["row_keys"].tolist()) == set(admitted.tolist()) - gone
    assert layer.table_stats()[0]["evictions"] == len(set(admitted.tolist()) & gone) > 0


def test_ttl_steps_expires_keys_not_seen_for_that_many_steps():
    layer = DynamicEmbedding(DIM, embeddings_initializer="ones", ttl_steps=2)
    sgd = keras.optimizers.SGD(0.0)
    train(layer, sgd, [([1, 2], np.zeros((2, DIM))), ([2], np.zeros((1, DIM))), ([2], np.zeros((1, DIM)))])
    np.testing.assert_array_equal(rows_of(layer, [1, 2]), np.ones((2, DIM)))  # 1 last seen 2 steps ago
    train(layer, sgd, [([2], np.zeros((1, DIM)))])
    np.testing.assert_array_equal(rows_of(layer, [1, 2]), [[0, 0], [1, 1]])  # 3 steps: expired
    [stats] = layer.table_stats()
    assert (stats["rows"], stats["evictions"]) == (1, 1)  # and removed by the scan (every step here)


def test_capacity_below_one_batch_of_keys_is_a_clear_error():
    # The keys are admitted by the update, which checks that they fit and writes nothing if not.
    layer = DynamicEmbedding(DIM, capacity=2)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"(?s)argument `capacity`.*Received: capacity=2 "
                                                              r"\(2 rows per ps task\).*brought.*3"):
        train(layer, keras.optimizers.SGD(0.1), [([1, 2, 3], [[1.0] * DIM] * 3)])
    assert layer.table_stats()[0]["rows"] == 0
    train(layer, keras.optimizers.SGD(0.1), [([1, 2], [[1.0] * DIM] * 2)])  # a batch that fits still trains
    assert layer.table_stats()[0]["rows"] == 2


@pytest.mark.parametrize("inputs, error, match", [
    (lambda: tf.constant([1.0, 2.0]), TypeError, r"Received: dtype=float32\. Expected int64 or int32"),
    (lambda: tf.constant(["a"]), TypeError, r"Received: dtype=string\. Expected int64 or int32"),
    (lambda: tf.constant(3, tf.int64), ValueError, r"Received: shape=\(\)\. Expected a tensor of rank >= 1"),
    (lambda: tf.ragged.constant([[1], [2, 3]], tf.int64), ValueError, r"combiner=None\. Expected a rank-2"),
])
def test_bad_keys_name_the_argument_received_and_expected(inputs, error, match):
    with pytest.raises(error, match=match):
        DynamicEmbedding(DIM)(inputs())


@pytest.mark.parametrize("kwargs, match", [
    ({"key_dtype": "float32"}, r"Received: key_dtype='float32'\. Expected 'int64' or 'string'"),
    ({"min_frequency": 0}, r"Received: min_frequency=0\. Expected an integer >= 1"),
    ({"capacity": -1}, r"Received: capacity=-1\. Expected an integer >= 1 or None"),
    ({"combiner": "max"}, r"Received: combiner='max'\. Expected 'sum', 'mean' or None"),
    ({"embeddings_initializer": "orthogonal"}, r"Received: embeddings_initializer='orthogonal'"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicEmbedding(DIM, **kwargs)


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_multi_hot_ragged_keys_are_combined(combiner):
    layer = DynamicEmbedding(4, combiner=combiner)
    train(layer, keras.optimizers.SGD(0.0), [([[1, 2, 3]], np.zeros((1, 4)))])
    single = dict(zip([1, 2, 3], rows_of(layer, [[1], [2], [3]])))  # one key per example: its row
    out = layer(tf.ragged.constant([[1, 2], [3]], tf.int64)).numpy()
    reduce = np.sum if combiner == "sum" else np.mean
    np.testing.assert_allclose(out, [reduce([single[1], single[2]], 0), single[3]], rtol=1e-6)


def test_string_keys_get_their_own_rows():
    layer = DynamicEmbedding(4, key_dtype="string")
    train_out = layer(tf.constant(["apple", "pear", "apple"]), training=True).numpy()
    np.testing.assert_array_equal(train_out[0], train_out[2])
    assert not np.allclose(train_out[0], train_out[1])
    assert layer.table_stats()[0]["rows"] == 2


def test_saved_model_predicts_the_same_without_the_training_state(tmp_path):
    ids = keras.Input((2,), dtype="int64")
    layer = DynamicEmbedding(3, name="ids_embedding", capacity=100)
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    x = np.random.default_rng(0).integers(0, 50, (64, 2))
    model.fit(x, x[:, :1] % 3, epochs=2, batch_size=16, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    np.testing.assert_array_equal(rows_of(loaded.get_layer("ids_embedding"), [10**12]), np.zeros((1, 3)))
    assert loaded.get_layer("ids_embedding").get_config()["capacity"] == 100


def test_an_unreadable_shard_is_reported_and_left_out_of_the_epoch_logs(monkeypatch):
    """A ps lost at an epoch's end: stats say so instead of raising, the logs keep what can be read."""
    from psclient._keras.dynamic_embedding import epoch_logs

    ids = keras.Input((1,), dtype="int64")
    layer = DynamicEmbedding(DIM, capacity=8, name="outage")
    model = keras.Model(ids, layer(ids))
    train(layer, keras.optimizers.SGD(0.1), [([1, 2], [[1.0] * DIM, [1.0] * DIM])])  # admits with the update
    assert epoch_logs(model)["outage/rows"] == 2.0

    def lost(index):
        raise tf.errors.UnavailableError(None, None, "ps task 0 restarted")

    monkeypatch.setattr(layer.table, "shard_stats", lost)
    [entry] = layer.table_stats()
    assert entry["available"] is False and "UnavailableError: ps task 0 restarted" in entry["error"]
    assert not any(name.startswith("outage/") for name in epoch_logs(model))


def test_reserved_index_keys_read_the_default_row_and_are_never_admitted():
    from psclient._coordinator.tables.key_index import RESERVED_KEYS

    layer = DynamicEmbedding(DIM, capacity=8, embeddings_initializer="ones")
    reserved = len(RESERVED_KEYS)
    out = layer(tf.constant([*RESERVED_KEYS, 3], tf.int64), training=True).numpy()
    np.testing.assert_array_equal(out[:reserved], np.zeros((reserved, DIM)))
    np.testing.assert_array_equal(out[reserved], np.ones(DIM))
    train(layer, keras.optimizers.SGD(0.1), [([*RESERVED_KEYS, 3], [[1.0] * DIM] * (reserved + 1))])  # admits
    assert layer.table_stats()[0]["rows"] == 1


def test_a_stream_of_new_keys_keeps_the_key_index_exact_within_its_buckets():
    """Far more keys than the index has buckets pass through a small table in traced steps: the
    index is rebuilt by the steps' scans (its tombstones cleared) and never grows."""
    layer = DynamicEmbedding(DIM, capacity=16, embeddings_initializer="ones")
    step = traced_step(layer, keras.optimizers.SGD(0.1))
    layer.build()
    [shard] = layer.table.shards
    buckets = int(shard.index.buckets())
    removed_before_rebuild = []
    for start in range(0, 60 * 8, 8):
        step(tf.range(start, start + 8, dtype=tf.int64))
        removed_before_rebuild.append(int(shard.index.removed))
    assert 60 * 8 > 10 * buckets and int(shard.index.buckets()) == buckets
    assert any(b < a for a, b in zip(removed_before_rebuild, removed_before_rebuild[1:]))  # rebuilt
    keys, rows = (t.numpy() for t in shard.index.entries())
    np.testing.assert_array_equal(shard.row_key.numpy()[rows], keys)
    assert set(keys.tolist()) >= set(range(472, 480))  # the last batch holds rows, trained once
    np.testing.assert_allclose(rows_of(layer, list(range(472, 480))), np.full((8, DIM), 0.9))


@pytest.mark.parametrize("min_frequency", [1, 2])
def test_steps_racing_the_expiry_scan_leave_no_row_without_its_counter(min_frequency):
    """Eight threads run traced steps on one table without a capacity, on keys that drift upwards:
    each key is sighted for a while, expires (ttl_steps=1), is sometimes sighted again while another
    step's scan removes it, and then never comes back. Every row left must still have its counter:
    the scans walk the counters only, so a row without one would never expire and would be served
    for good. (Before the fix, 8 threads of 250 steps left 2 to 14 such rows; test_serving's
    `unbounded` layer met one on a 2-worker cluster.)"""
    import itertools
    import threading

    layer = DynamicEmbedding(16, ttl_steps=1, min_frequency=min_frequency)
    step = traced_step(layer, keras.optimizers.Adagrad(0.1))  # Adagrad: a slot table, written with the rows
    layer.build()
    step(tf.range(24, dtype=tf.int64))  # traced once, before the threads
    ticks, errors = itertools.count(), []

    def run(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(600):
                step(tf.constant(next(ticks) // 4 + rng.integers(0, 30, 24), tf.int64))
        except tf.errors.OpError as error:  # reported below, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(seed,), name=f"racing-step-{seed}") for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not any(thread.is_alive() for thread in threads) and errors == []
    [state] = layer.export_state()
    without_counter = set(state["row_keys"].tolist()) - set(state["keys"].tolist())
    assert without_counter == set(), sorted(without_counter)
    [shard] = layer.table.shards  # and no slot entry without its row
    rows, slots = int(shard.values.size()), {name: int(table.size()) for name, table in shard.slots.items()}
    assert rows > 0 and slots and all(n == rows for n in slots.values()), (rows, slots)
