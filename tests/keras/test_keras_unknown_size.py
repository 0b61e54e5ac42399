"""fit on finite data of unknown size against Keras in one process: nondeterministic maps, the progress bar.

psclient cuts such data into shards of its batches (psclient._coordinator.data.finite), which needs every
worker's copy to yield the batches in one order: parallel ops with `deterministic=False` are made to
keep order in the graph the workers get. The model's learning rate is 0, so each epoch's loss is the
mean over exactly the data's batches, on the cluster as locally.
"""

import re

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402

pytestmark = pytest.mark.timeout(600)

_RNG = np.random.default_rng(11)
X = _RNG.standard_normal((256, 8)).astype("float32")
Y = (X[:, :1] - X[:, 2:3]).astype("float32")
BATCH = 8
BATCHES = len(X) // BATCH  # 32; psclient cuts them into 4 shards per worker


def build():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0), loss="mse")
    return model


@pytest.fixture(scope="module")
def models(strategy):
    with strategy.scope():
        on_cluster = build()
    local = build()
    local.set_weights(on_cluster.get_weights())
    return on_cluster, local


def slices():
    return tf.data.Dataset.from_tensor_slices((X, Y))


def sloppy_options():
    options = tf.data.Options()
    options.deterministic = False
    return options


# Each of unknown size (a filter), each with an op free to yield out of order: a published tabular
# example maps with deterministic=False.
DATA = {
    "map(deterministic=False)": lambda: slices().filter(lambda x, y: True).map(
        lambda x, y: (x * 1.0, y), num_parallel_calls=tf.data.AUTOTUNE, deterministic=False).batch(BATCH),
    "interleave(deterministic=False)": lambda: tf.data.Dataset.range(4).interleave(
        lambda k: slices().shard(4, k), cycle_length=4, num_parallel_calls=4, deterministic=False
    ).filter(lambda x, y: True).batch(BATCH),
    "batch(deterministic=False), Options.deterministic=False": lambda: slices().filter(lambda x, y: True).batch(
        BATCH, num_parallel_calls=2, deterministic=False).map(
        lambda x, y: (x, y), num_parallel_calls=2).with_options(sloppy_options()),
}


@pytest.mark.parametrize("name", list(DATA))
def test_nondeterministic_ops_train_each_batch_once_as_keras_does(models, name):
    on_cluster, local = models
    assert int(DATA[name]().cardinality()) == tf.data.UNKNOWN_CARDINALITY
    got = on_cluster.fit(DATA[name](), epochs=2, verbose=0).history
    want = local.fit(DATA[name](), epochs=2, verbose=0).history
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)


def progress_lines(out: str) -> list[str]:
    """The progress bar's "done/total" counts, one per update (Keras redraws with "\\r" and colours)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    return [match.group(1) for part in re.split(r"[\r\n]", plain)
            if (match := re.match(r"\s*(\d+/(?:\d+|Unknown))\s", part))]


def test_the_progress_bar_counts_batches_on_data_of_unknown_size(models, capsys):
    on_cluster, local = models

    def data():
        return slices().filter(lambda x, y: True).batch(BATCH)

    local.fit(data(), epochs=2, verbose=1)
    keras_lines = progress_lines(capsys.readouterr().out)
    on_cluster.fit(data(), epochs=2, verbose=1)
    lines = progress_lines(capsys.readouterr().out)
    # Keras: "32/Unknown" while the first epoch counts, "32/32" after it. psclient counts the
    # batches before the first epoch (to cut them into shards): "32/32" from the start; never shards.
    assert keras_lines and keras_lines[-1] == f"{BATCHES}/{BATCHES}", keras_lines
    assert lines and set(lines) <= {f"{n}/{BATCHES}" for n in range(1, BATCHES + 1)}, lines
    assert lines[-1] == f"{BATCHES}/{BATCHES}" and lines.count(f"{BATCHES}/{BATCHES}") >= 2, lines  # both epochs


def test_a_sharded_dataset_progress_bar_counts_batches_from_its_second_epoch(models, strategy, capsys):
    on_cluster, _ = models
    shard_records = 64  # 8 batches a shard, 4 shards

    def make(shard):
        ids = tf.data.Dataset.range(shard.start, shard.end)
        return ids.map(lambda i: (tf.gather(X, i), tf.gather(Y, i))).batch(BATCH)

    sharded = psclient.data.ShardedDataset(psclient.data.range_shards(len(X), shard_records), make, seed=0)
    seen = []

    class Batches(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    on_cluster.fit(sharded, epochs=2, verbose=1, callbacks=[Batches()])
    lines = progress_lines(capsys.readouterr().out)
    # As Keras on data of unknown size: no total while the first epoch counts, then its count.
    assert lines[-1] == f"{BATCHES}/{BATCHES}" and all(
        line.endswith(("/Unknown", f"/{BATCHES}")) for line in lines), lines
    # Batch hooks count batches: each epoch's last call ends at its last batch.
    assert len(seen) == 8 and seen[3] == seen[7] == BATCHES - 1, seen
    assert seen[:4] == sorted(seen[:4]) and seen[4:] == sorted(seen[4:]), seen
