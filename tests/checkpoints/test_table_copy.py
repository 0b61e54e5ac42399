"""A bounded DynamicEmbedding table copied before a checkpoint's cut and packed after it.

`checkpoints.table_copy`: a shard above one row chunk gets write marks on its
rows and slots; the checkpoint copies them while training goes on, the cut
reads again only the rows written since and the write packs the copy by the
keys. On a real cluster (2 workers, 2 ps), with steps running beside the
saves: every step trains the same 64 keys, whose rows start equal and stay
equal step after step (same rows, same kernel, same gradient: one worker, so
no step reads rows another is writing), spread over the storage of both
shards; a checkpoint that mixed rows of different moments would hold them
unequal.
"""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
from psclient._coordinator.checkpoints import checkpoint_snapshot, fuzzy_copy  # noqa: E402
from psclient._tf.write_marks import marks_of  # noqa: E402
from _conversions import RemoteConversions  # noqa: E402
from _polling import wait_for  # noqa: E402
from _saves_beside import KEEP_EVERY_SAVE, saves_beside_fit  # noqa: E402
from tables.test_table_saves import by_key, saved_state  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

CAPACITY, DIM = 300_000, 32  # 150,000 rows a ps: 19.2 MB a variable, three row chunks of 8 MiB
FILLED = 120_000  # keys imported before training
PROBES = np.arange(10**9, 10**9 + FILLED, FILLED // 64, dtype=np.int64)[:64]  # spread over the storage


@pytest.fixture(scope="module")
def cluster(two_workers_two_ps):
    return two_workers_two_ps


def one_worker(local):
    """The shared cluster's ps tasks and its first worker: steps one after another."""
    spec = local.cluster.training_spec()
    return psclient.Cluster({"worker": list(spec["worker"][:1]), "ps": list(spec["ps"])})


def build(strategy, dim=DIM, capacity=CAPACITY, **policy):
    with strategy.scope():
        ids = keras.Input([1], dtype="int64")
        layer = psclient.layers.DynamicEmbedding(dim, capacity=capacity, name="item", **policy)
        model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
        model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="mse")
    return model, layer


def fill(layer, dim=DIM):
    """FILLED keys imported with equal rows (the probes among them, each on its own storage row)."""
    keys = np.arange(10**9, 10**9 + FILLED, dtype=np.int64)
    layer.import_state([{"keys": keys, "counters": np.stack([np.ones(FILLED, np.int64), np.zeros(FILLED, np.int64)], 1),
                         "row_keys": keys, "rows": np.full([FILLED, dim], 0.01, np.float32),
                         "slots": {"accumulator": np.full([FILLED, dim], 0.1, np.float32)},
                         "clock": 0, "admissions": 0, "evictions": 0}])


def probe_data():
    """Built before the strategy and the model, as published scripts do: every batch is the 64 probes."""
    return tf.data.Dataset.from_tensor_slices((PROBES[:, None], np.ones([64, 1], np.float32))).batch(64).repeat()


def assert_probes_in_step(path):
    """The probes' rows and accumulators in the checkpoint are one moment's: all equal, trained."""
    rows, _clocks = saved_state(path)
    found = [rows[int(key)] for key in PROBES]
    assert all(row == found[0][1] for _c, row, _s in found), f"{path}: probes' rows differ"
    accumulators = [slots["accumulator"] for _c, _r, slots in found]
    assert all(acc == accumulators[0] for acc in accumulators), f"{path}: probes' accumulators differ"
    assert accumulators[0][0] > 0.1  # trained


def test_each_checkpoint_holds_one_moment_of_a_table_trained_beside_it(cluster, tmp_path):
    data = probe_data()
    strategy = psclient.ParameterServerStrategy(one_worker(cluster), checkpoint_dir=str(tmp_path / "ckpt"),
                                                checkpoints_to_keep=KEEP_EVERY_SAVE)
    try:
        # The imported keys but the probes expire after 2 steps: their rows are freed, the probes'
        # stay where they were, so each save packs rows from all over the storage.
        model, layer = build(strategy, ttl_steps=2)
        shards = layer.table.shards
        assert all(shard.marked for shard in shards)
        model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)  # the slots made, the saves traced
        assert all(marks_of(shard.slots["accumulator"]) is not None for shard in shards)
        fill(layer)

        # No step running: the copy is the cut's state, saved as the table exports it.
        model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
        assert sum(stats["rows"] for stats in layer.table_stats()) == len(PROBES)  # the others expired
        path = strategy.save_checkpoint()
        stats = strategy.stats()["checkpoints"]
        # Each ps: its rows and accumulator (4 bytes a value), its row keys and last steps (8 bytes a row).
        assert stats["last_copied_bytes"] == 2 * (CAPACITY // 2) * (2 * DIM * 4 + 16), stats
        assert saved_state(path) == by_key(layer.export_state())
        assert_probes_in_step(path)

        seen = saves_beside_fit(strategy, model, data)  # until a cut read rows again
        for saved, _again in seen:
            assert_probes_in_step(saved)
        restored = strategy.restore()
        assert restored["path"] == seen[-1][0]
        assert by_key(layer.export_state()) == saved_state(seen[-1][0])
    finally:
        strategy.shutdown()


def test_a_cut_whose_registration_never_reached_its_ps_is_traced_again(cluster, tmp_path, monkeypatch):
    """The copy's first call of a shard's cut fails "not registered" for good (a registration lost
    on its way, as one was in a chaos plan): once the retries are spent the cut is traced again,
    under a new name, and the checkpoint is the table's (it failed the save)."""
    from psclient._tf import registrations

    def lost(*_args):
        raise tf.errors.NotFoundError(None, None, "'__inference_staged_7' is neither a type of a primitive "
                                      "operation nor a name of a function registered in binary running on ps-0.")

    monkeypatch.setattr(registrations, "ATTEMPTS", 2)
    data = probe_data()
    strategy = psclient.ParameterServerStrategy(one_worker(cluster), checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        model, layer = build(strategy)
        model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
        fill(layer)
        model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
        shard = layer.table.shards[0]
        shard.copy_cut = (shard.version, lost)  # what the copy will call first
        path = strategy.save_checkpoint()
        assert shard.copy_cut[1] is not lost
        assert strategy.stats()["checkpoints"]["last_copied_bytes"] == 2 * (CAPACITY // 2) * (2 * DIM * 4 + 16)
        assert saved_state(path) == by_key(layer.export_state())
    finally:
        strategy.shutdown()


@pytest.mark.long
def test_rows_of_8_floats_are_packed_in_place_and_a_pre_call_made_again_copies_once(cluster, tmp_path,
                                                                                      monkeypatch):
    """8-wide rows (32 bytes: TF would copy a matrix's first rows, a second table beside the stages)
    are packed in place and written as two slices of their key (`table_copy.Split`: the first
    read through the flat vector, sharing the stage); the checkpoint equals the table. The cut's first call,
    made at the copy, overtakes its registration on each ps: called again, the copy not made again
    (it was: the first copy's stages then stayed whole on the ps for the run)."""
    from psclient._coordinator.checkpoints import stages, table_copy

    data = probe_data()
    strategy = psclient.ParameterServerStrategy(one_worker(cluster), checkpoint_dir=str(tmp_path / "ckpt"))
    copied, overtaken = [], set()
    copy_in_chunks, cut_function = stages.copy_in_chunks, table_copy._cut_function

    def counting(variable, *args, **kwargs):
        copied.append(variable.name)
        return copy_in_chunks(variable, *args, **kwargs)

    def overtaking(shard):
        traced = cut_function(shard)

        def call(*args):
            if id(shard) not in overtaken:
                overtaken.add(id(shard))
                raise tf.errors.NotFoundError(None, None, "Op type not registered '__inference_staged_1' in binary")
            return traced(*args)
        return call

    try:
        model, layer = build(strategy, dim=8, capacity=2 * CAPACITY)  # 9.6 MB a variable: above a chunk
        model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
        fill(layer, dim=8)
        model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
        monkeypatch.setattr(stages, "copy_in_chunks", counting)
        monkeypatch.setattr(table_copy, "_cut_function", overtaking)
        path = strategy.save_checkpoint()
        assert len(overtaken) == 2 and len(copied) == 2 * 4, copied  # rows, accumulator, row keys, last steps
        assert strategy.stats()["checkpoints"]["last_copied_bytes"] == 2 * CAPACITY * (2 * 8 * 4 + 16)
        assert saved_state(path) == by_key(layer.export_state())
    finally:
        strategy.shutdown()


@pytest.mark.long
def test_a_copy_taken_before_an_import_is_not_saved(cluster, tmp_path):
    """An import (as a restore) writes the shard without marks: the copy made before it is stale,
    and the cut saves the shard as it is then, packed there."""
    data = probe_data()
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        model, layer = build(strategy)
        model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
        fill(layer)
        model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
        tables = strategy.parts.store.tables()
        prepared = fuzzy_copy.prepare({}, str, tables=tables)
        assert prepared is not None and sum(len(by_shard) for by_shard in prepared.tables.values()) == 2
        before = by_key(layer.export_state())
        state = layer.export_state()
        for shard_state in state:
            shard_state["rows"] = np.asarray(shard_state["rows"]) + 1.0
        layer.import_state(state)
        assert all(prepared.take_table(ps, shard) is None for ps, shard in enumerate(layer.table.shards))
        snapshot = checkpoint_snapshot.take_snapshot({}, str, tables, prepared=prepared)
        path = str(tmp_path / "direct" / "ckpt-1")
        tf.io.gfile.makedirs(str(tmp_path / "direct"))
        checkpoint_snapshot.write_snapshot(path, snapshot, {}, str)
        prepared.release()
        after = saved_state(path)
        assert after == by_key(layer.export_state()) and after != before
    finally:
        strategy.shutdown()


def test_checkpoint_cut_copy_leaves_the_table_unmarked(cluster, tmp_path):
    data = probe_data()
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_cut="copy")
    try:
        model, layer = build(strategy)
        assert not any(shard.marked for shard in layer.table.shards)
        model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
        path = strategy.save_checkpoint()
        assert strategy.stats()["checkpoints"]["last_copied_bytes"] == 0
        assert saved_state(path) == by_key(layer.export_state())
    finally:
        strategy.shutdown()


@pytest.mark.long
def test_a_restarted_ps_gets_new_marks_and_its_shard_is_copied_again(cluster, restore_shared_clusters, tmp_path):
    """ps 1 killed and started again: its shard's storage and marks are made again there and
    restored (unmarked writes: no copy of the old storage is used); the next checkpoints copy
    the new storage and hold the table as it exports."""
    data = probe_data()
    strategy = psclient.ParameterServerStrategy(one_worker(cluster), checkpoint_dir=str(tmp_path / "ckpt"),
                                                hang_timeout=3.0)
    try:
        model, layer = build(strategy)
        model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
        fill(layer)
        strategy.save_checkpoint()
        old_marks = marks_of(layer.table.shards[1].rows)
        cluster.kill("ps", 1)
        cluster.restart("ps", 1)
        # stats() meets the restarted ps and reports it (not waiting): the recovery makes its shards again
        # and restores them.
        strategy.stats()
        wait_for(lambda: strategy.stats(read_ps=False)["ps"][1]["recoveries"] == 1, 300, "ps 1 to be recovered")
        assert strategy.stats()["ps"][1]["recoveries"] == 1
        shard = layer.table.shards[1]
        assert shard.marked and marks_of(shard.rows) is not old_marks
        model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
        path = strategy.save_checkpoint()
        stats = strategy.stats()["checkpoints"]
        assert stats["last_copied_bytes"] == 2 * (CAPACITY // 2) * (2 * DIM * 4 + 16), stats  # both shards
        assert saved_state(path) == by_key(layer.export_state())
    finally:
        strategy.shutdown()


@pytest.mark.long
def test_a_save_with_copies_converts_nothing_on_the_ps(cluster, tmp_path):
    """The copies before the cut, the cut and the write (a big variable's and a table's) hand the ps
    no Python value to convert under its device: TF copies one there holding the GIL, so a hung ps
    would stop every thread of the coordinator."""
    rows = 300_000  # an Embedding of 19.2 MB: two shards (one per ps), each above a row chunk
    ids = np.stack([PROBES, PROBES % rows], 1)
    data = tf.data.Dataset.from_tensor_slices((ids, np.ones([64, 1], np.float32))).batch(64).repeat()
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        with strategy.scope():
            both = keras.Input([2], dtype="int64")
            layer = psclient.layers.DynamicEmbedding(DIM, capacity=CAPACITY, name="item")
            embedding = keras.layers.Embedding(rows, 16)
            joined = keras.layers.Concatenate()([keras.layers.Flatten()(layer(both[:, :1])),
                                                 keras.layers.Flatten()(embedding(both[:, 1:]))])
            model = keras.Model(both, keras.layers.Dense(1)(joined))
            model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="mse")
        model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
        strategy.save_checkpoint()  # the first: functions traced and made on the ps
        model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
        with RemoteConversions() as seen:
            path = strategy.save_checkpoint()
        stats = strategy.stats()["checkpoints"]
        # The embedding and its accumulator, and the table's storage, were copied before the cut.
        assert stats["last_copied_bytes"] == 2 * rows * 16 * 4 + 2 * (CAPACITY // 2) * (2 * DIM * 4 + 16), stats
        assert not seen.found, "Python values converted under a task's device:\n" + seen.report()
        assert saved_state(path) == by_key(layer.export_state())
    finally:
        strategy.shutdown()
