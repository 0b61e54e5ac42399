"""`psclient.ModelCheckpoint(delta_every=N)` in a real `model.fit` (LocalCluster: 2 workers, 2 ps).

A partitioned `keras.layers.Embedding` (4096 rows: row-diffed) feeds a Dense layer; each epoch is
SAVE_FREQ batches and the callback saves every SAVE_FREQ batches, so each save falls on an epoch's
last batch, after fit waited for every step of the epoch: nothing runs while it is taken, and the
state a test callback reads right after it is the state the checkpoint holds.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import psclient

keras = pytest.importorskip("keras")
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

ROWS, DIM, IDS = 4096, 16, 8
SAVE_FREQ, EPOCHS = 4, 6
partitioners = tf.distribute.experimental.partitioners


@pytest.fixture(scope="module")
def strategy(two_workers_two_ps):
    s = psclient.ParameterServerStrategy(
        two_workers_two_ps.cluster, hang_timeout=30.0, variable_partitioner=partitioners.FixedShardsPartitioner(2))
    yield s
    s.shutdown()


def build(strategy, optimizer_name, seed):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        inputs = keras.Input((IDS,), dtype="int32")
        x = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(ROWS, DIM)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(3)(x))
        optimizer = {"adagrad": lambda: keras.optimizers.Adagrad(0.1), "adam": lambda: keras.optimizers.Adam(0.01)}
        model.compile(optimizer=optimizer[optimizer_name](),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data():
    """SAVE_FREQ batches of 16 rows; ids among the first 512 rows of the table (1/8 of it)."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, 512, size=(16 * SAVE_FREQ, IDS)).astype("int32")
    return x, rng.integers(0, 3, size=(16 * SAVE_FREQ,)).astype("int32")


def state(model):
    return [np.array(v.numpy()) for v in [*model.weights, *model.optimizer.variables]]


class Recorder(keras.callbacks.Callback):
    """The model's and optimizer's values after each save (it comes after the ModelCheckpoint)."""

    def __init__(self):
        super().__init__()
        self.states, self._batches = [], 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches % SAVE_FREQ == 0:
            self.states.append(state(self.model))


def checkpoint_bytes(path):
    """The bytes of the checkpoint `path` (full or delta): its index and data files, not its deltas'."""
    return sum(os.path.getsize(name) for name in [path + ".index", *tf.io.gfile.glob(path + ".data-*")])


def assert_same(got, want, what):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"{what}: variable {i}")


@pytest.mark.parametrize("optimizer_name", ["adagrad", "adam"])
def test_fit_writes_deltas_and_restore_is_the_state_at_the_newest(strategy, tmp_path, optimizer_name):
    directory = tmp_path / "ckpts"
    model = build(strategy, optimizer_name, seed=1)
    saver = psclient.ModelCheckpoint(directory, save_freq=SAVE_FREQ, max_to_keep=1, delta_every=2)
    recorder = Recorder()
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=EPOCHS, verbose=0, callbacks=[saver, recorder])

    names = [os.path.basename(p) for p in saver.saved]
    assert names == ["ckpt-1", "ckpt-1.delta-1", "ckpt-1.delta-2", "ckpt-2", "ckpt-2.delta-1", "ckpt-2.delta-2"]
    assert len(recorder.states) == EPOCHS
    # max_to_keep=1 counts full checkpoints: ckpt-1 went with its deltas once ckpt-2 was committed;
    # the deltas of ckpt-2, the one kept, are all there.
    left = sorted(os.listdir(directory))
    assert not [n for n in left if n.startswith("ckpt-1.")], left
    assert {"ckpt-2.index", "ckpt-2.delta-1.index", "ckpt-2.delta-2.index"} <= set(left), left
    assert tf.train.latest_checkpoint(str(directory)) == saver.saved[3]  # the state file names full ones only

    full = checkpoint_bytes(saver.saved[3])
    deltas = [checkpoint_bytes(p) for p in saver.saved[4:]]
    print(f"{optimizer_name}: full {full} bytes, deltas {deltas} bytes")
    # Each delta holds the changed rows of the embedding and its slots, the dense layer and the layout.
    # Adagrad changes the rows the save's steps touched; Adam every row ever touched (its moments
    # decay each step), but rows never touched keep zero moments and their values: here both are
    # among the first 512 of 4096.
    assert all(d < full / 4 for d in deltas), (full, deltas)

    fresh = build(strategy, optimizer_name, seed=7)  # other initial values, optimizer not built
    restored = psclient.ModelCheckpoint(directory, delta_every=2).restore(fresh)
    assert restored["path"] == saver.saved[3]
    assert restored["deltas"] == saver.saved[4:]
    assert restored["step"] == EPOCHS * SAVE_FREQ
    assert_same(state(fresh), recorder.states[-1], "full + 2 deltas")
    assert_same(state(fresh), state(model), "the trained model")  # nothing ran after the last save

    # Without the newest delta: the state at the save before it.
    os.remove(saver.saved[5] + ".index")
    again = build(strategy, optimizer_name, seed=9)
    restored = psclient.ModelCheckpoint(directory).restore(again)
    assert restored["deltas"] == saver.saved[4:5]
    assert_same(state(again), recorder.states[4], "full + 1 delta")


def test_the_sidecar_evaluates_the_full_checkpoints_of_a_delta_chain(strategy, tmp_path):
    """The state file names full checkpoints only: the sidecar evaluates every (delta_every + 1)-th
    save, and files of deltas beside them do not disturb it."""
    directory = tmp_path / "ckpts"
    model = build(strategy, "adagrad", seed=1)
    recorder = Recorder()
    x, y = data()
    saver = psclient.ModelCheckpoint(directory, save_freq=SAVE_FREQ, delta_every=2)
    model.fit(x, y, batch_size=16, epochs=5, verbose=0, callbacks=[saver, recorder])
    assert [os.path.basename(p) for p in saver.saved][3:] == ["ckpt-2", "ckpt-2.delta-1"]
    psclient.write_final_marker(directory, saver.saved[3])

    keras.utils.set_random_seed(3)
    inputs = keras.Input((IDS,), dtype="int32")
    x_local = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(ROWS, DIM)(inputs))
    local = keras.Model(inputs, keras.layers.Dense(3)(x_local))
    local.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    report = psclient.SidecarEvaluator(local, (x, y), directory, poll_interval=0.05, settle_time=0,
                                       idle_timeout=60).start()
    steps = [e["step"] for e in report.evaluations]
    assert steps[-1] == 4 * SAVE_FREQ and set(steps) <= {SAVE_FREQ, 4 * SAVE_FREQ}, steps  # ckpt-2 (ckpt-1)
    assert_same([np.array(w.numpy()) for w in local.weights], recorder.states[3][:len(local.weights)], "ckpt-2")


def test_restore_of_an_empty_directory_and_bad_arguments(strategy, tmp_path):
    model = build(strategy, "adagrad", seed=1)
    assert psclient.ModelCheckpoint(tmp_path / "empty").restore(model) is None
    with pytest.raises(ValueError, match=r"Received: delta_every=0\. Expected None"):
        psclient.ModelCheckpoint(tmp_path / "c", delta_every=0)
    with pytest.raises(ValueError, match="Received: overwrite=True"):
        psclient.ModelCheckpoint(tmp_path / "c", overwrite=True).restore(model)


def build_with_table(strategy, name, seed):
    """The partitioned Embedding beside a DynamicEmbedding (int64 ids), both averaged into the Dense."""
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        inputs = keras.Input((IDS,), dtype="int64")
        table = psclient.layers.DynamicEmbedding(DIM, capacity=1024, name=name)
        pooled = [keras.layers.GlobalAveragePooling1D()(layer(inputs))
                  for layer in (table, keras.layers.Embedding(ROWS, DIM))]
        model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Concatenate()(pooled)))
        model.compile(optimizer=keras.optimizers.Adagrad(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, table


def rows_by_key(layer):
    """{key: (counters, row, {slot: row})} over every shard of the table."""
    out = {}
    for shard in layer.export_state():
        counters = dict(zip(shard["keys"].tolist(), shard["counters"].reshape(-1, 2).tolist()))
        for i, key in enumerate(shard["row_keys"].tolist()):
            out[key] = (counters.get(key), shard["rows"][i].tolist(),
                        {slot: value[i].tolist() for slot, value in shard["slots"].items()})
    return out


def test_dynamic_embedding_rows_come_back_from_the_full_checkpoint_and_its_deltas(strategy, tmp_path):
    directory = tmp_path / "ckpts"
    model, table = build_with_table(strategy, "mc_delta_ids", seed=1)
    tables = []

    class TableRecorder(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):  # after the save of the epoch's last batch
            tables.append(rows_by_key(table))

    recorder = Recorder()
    x, y = data()
    saver = psclient.ModelCheckpoint(directory, save_freq=SAVE_FREQ, delta_every=2)
    model.fit(x.astype("int64"), y, batch_size=16, epochs=3, verbose=0, callbacks=[saver, recorder, TableRecorder()])
    assert [os.path.basename(p) for p in saver.saved] == ["ckpt-1", "ckpt-1.delta-1", "ckpt-1.delta-2"]
    assert tables[-1] and tables[-1] != tables[0]  # rows trained, and changed between the saves

    fresh, fresh_table = build_with_table(strategy, "mc_delta_ids_2", seed=7)
    restored = psclient.ModelCheckpoint(directory).restore(fresh)
    assert restored["deltas"] == saver.saved[1:]
    assert_same(state(fresh), recorder.states[-1], "full + 2 deltas")
    assert rows_by_key(fresh_table) == tables[-1]
