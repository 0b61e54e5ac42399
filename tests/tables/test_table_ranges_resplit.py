"""A dense table restored into another number of ps tasks in row ranges (`table_ranges.SplitPlan`): each
saved shard's keys read whole, its rows and slots a range at a time, the rows each shard owns written
in place. Every key, counter, row, slot and clock comes back as the whole path (every saved shard read
whole and merged: `table_checkpoint._restored_state`) gives them, array for array, and a damaged
checkpoint leaves the table as it was. Local tables (no cluster): a table of 2 shards saves, tables of
1 and 3 restore; then the same on a real cluster (the session's 2 workers + 3 ps: a model on 2 ps
saves, one on 3 restores), where nothing is converted under a ps's device."""

from __future__ import annotations

import json

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from psclient._coordinator.checkpoints import table_checkpoint, table_ranges  # noqa: E402
from psclient._coordinator.checkpoints.checkpoint import Checkpoints  # noqa: E402

from _conversions import RemoteConversions  # noqa: E402
from _table_ranges_setup import damage_saved_row, CAPACITY, KEY, ROWS, state, table  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SAVED_BY = 2


@pytest.fixture()
def assigned(monkeypatch):
    """What each `SplitPlan.assign` returned (None: nothing written, the whole path took the shard)."""
    got = []
    assign = table_ranges.SplitPlan.assign

    def recording(self, shard, deltas=()):
        got.append(assign(self, shard, deltas))
        return got[-1]

    monkeypatch.setattr(table_ranges.SplitPlan, "assign", recording)
    return got


def saved(tmp_path, capacity=2 * CAPACITY, storage="dense"):
    """A checkpoint of a table of 2 shards holding `state(1)` and `state(3)` (split by key): its path and
    layout. In dense storage each shard saves its keys with a row first, in their rows' order; in
    hash tables (`storage="hash"`) in the tables' order."""
    source = table(storage=storage, capacity=capacity, shards=SAVED_BY)
    source.import_shards([state(1, shuffled=True), state(3, shuffled=True)])
    path = Checkpoints(str(tmp_path), keep=3).save({}, completed=1, tables={KEY: source})
    return path, json.loads(tf.train.load_checkpoint(path).get_tensor("psclient_layout"))


def restored(path, layout, shards, range_bytes, capacity=2 * CAPACITY):
    """A table of `shards` shards holding something else, then restored from `path` (the check, then
    the assign): (the table, the plan of each shard: None where restored whole, the rows)."""
    target = table(capacity=capacity, shards=shards)
    target.import_shards([state(5)])
    work = table_checkpoint.read(path, {KEY: target}, layout["tables"], layout, range_bytes=range_bytes)
    checked = {ps: run() for ps, run in work.items()}
    plans = [entry["ranges"] for _, _, entry in checked[table_checkpoint.LOCAL]]
    rows = table_checkpoint.assign(checked, lambda runs: {ps: run() for ps, run in runs.items()})
    return target, plans, rows[table_checkpoint.LOCAL]


def assert_same_shards(got, want):
    """Every shard's exported arrays (keys, counters, rows, slots: in order) and clocks equal."""
    assert len(got.shards) == len(want.shards)
    for index in range(len(got.shards)):
        a, b = got.export_shard(index), want.export_shard(index)
        assert sorted(a) == sorted(b) and sorted(a["slots"]) == sorted(b["slots"])
        for field in ("keys", "counters", "row_keys", "rows", "clock", "admissions", "evictions"):
            np.testing.assert_array_equal(a[field], b[field], err_msg=f"shard {index}: {field}")
        for slot in a["slots"]:
            np.testing.assert_array_equal(a["slots"][slot], b["slots"][slot], err_msg=f"shard {index}: {slot}")
    assert got.stats() == want.stats()  # rows, tracked keys, free rows: admissions go on alike


@pytest.mark.parametrize("storage", ["dense", "hash"])
@pytest.mark.parametrize("shards", [1, 3])
def test_a_table_restored_into_another_number_of_shards_in_ranges_is_the_whole_paths(
        tmp_path, shards, storage, assigned):
    path, layout = saved(tmp_path, storage=storage)
    whole, whole_plans, whole_rows = restored(path, layout, shards, range_bytes=None)  # fits one range: whole
    assert whole_plans == [None] * shards
    ranged, plans, rows = restored(path, layout, shards, range_bytes=1024)  # 32 rows of 8 floats a range
    assert all(isinstance(plan, table_ranges.SplitPlan) for plan in plans)
    assert [len(plan.parts) for plan in plans] == [SAVED_BY] * shards
    assert rows == whole_rows == 2 * ROWS
    assert len(assigned) == shards and None not in assigned and sum(assigned) == rows  # in ranges, in place
    assert_same_shards(ranged, whole)
    # (the states' keys: every key on the shard that owns it, none lost)
    held = sorted(k for i in range(shards) for k in ranged.export_shard(i)["row_keys"].tolist())
    assert held == sorted(state(1)["row_keys"].tolist() + state(3)["row_keys"].tolist())


def test_the_owned_keys_with_a_row_come_first_when_saved_so():
    """`_head_size`, `_owned_keys` and `_owned_counters`: of keys saved with their row keys first (a dense shard's
    order), the owned ones with a row form the head, in order; saved in another order, every owned
    key is in the tail. Their counters are split alike."""
    from psclient._coordinator.tables.key_hash import shard_of

    keys = np.arange(100, 140, dtype=np.int64)
    counters = np.stack([np.arange(40), np.arange(40) + 1000], 1).astype(np.int64)
    mine = shard_of(tf.constant(keys), 2).numpy() == 1
    where = (tf.constant(2, tf.int64), tf.constant(1, tf.int32))
    def head_size(keys, row_keys):
        return table_ranges._head_size(keys, table_ranges._owned_rows(row_keys, *where, tf.int32)[2],
                                       tf.constant(len(row_keys), tf.int64))

    def owned(row_keys):
        split = head_size(keys, row_keys)
        head_keys, tail_keys, mine_saved = table_ranges._owned_keys(keys, split, *where)
        np.testing.assert_array_equal(mine_saved, mine)
        return (head_keys, *table_ranges._owned_counters(counters, mine_saved, split), tail_keys)

    head_keys, head_counters, tail_counters, tail_keys = owned(keys[:30])
    np.testing.assert_array_equal(head_keys, keys[:30][mine[:30]])
    np.testing.assert_array_equal(head_counters, counters[:30][mine[:30]])
    np.testing.assert_array_equal(tail_keys, keys[30:][mine[30:]])
    np.testing.assert_array_equal(tail_counters, counters[30:][mine[30:]])
    assert int(head_size(keys, keys[:30])) == 30
    for row_keys in (keys[10:40], np.arange(100, 150, dtype=np.int64)):  # not first; more than the keys
        assert int(head_size(keys, row_keys)) == 0
        head_keys, _, tail_counters, tail_keys = owned(row_keys)
        assert head_keys.shape == (0,)
        np.testing.assert_array_equal(tail_keys, keys[mine])
        np.testing.assert_array_equal(tail_counters, counters[mine])


@pytest.mark.parametrize("storage", ["dense", "hash"])
def test_a_wrong_guess_of_the_saved_order_still_restores_every_key_and_counter(
        tmp_path, storage, assigned, monkeypatch):
    """`_head_size` guesses from a sample whether a saved shard's keys with a row come first. Told the
    opposite of the truth (dense: "not first"; hash tables: "first"), the restore equals the whole
    path's all the same: the shard compares the keys it is given with its keys with a row and looks
    each key up where they differ (`DenseShard._replace_counters`; with that check skipped, the
    "hash" case fails)."""
    path, layout = saved(tmp_path, storage=storage)
    whole, _, _ = restored(path, layout, 3, range_bytes=None)
    guessed = []

    def wrong(keys, sample, count):
        guessed.append(storage)
        return tf.constant(0, tf.int64) if storage == "dense" else count

    monkeypatch.setattr(table_ranges, "_head_size", wrong)
    ranged, plans, _ = restored(path, layout, 3, range_bytes=1024)
    assert all(isinstance(plan, table_ranges.SplitPlan) for plan in plans) and None not in assigned
    assert len(guessed) == 3 * SAVED_BY  # every saved shard, for each of the 3 shards
    assert_same_shards(ranged, whole)


def test_a_shard_given_more_rows_than_its_share_goes_the_whole_way_and_evicts_alike(tmp_path, assigned):
    """Restored into 1 shard of a capacity below the saved rows: `SplitPlan.assign` writes nothing and
    the whole path evicts down to the share, as it does without ranges."""
    path, layout = saved(tmp_path)
    whole, _, _ = restored(path, layout, 1, range_bytes=None, capacity=CAPACITY)
    ranged, plans, _ = restored(path, layout, 1, range_bytes=1024, capacity=CAPACITY)
    assert isinstance(plans[0], table_ranges.SplitPlan) and assigned == [None]
    assert ranged.stats()[0]["rows"] <= CAPACITY
    assert_same_shards(ranged, whole)


def test_a_damaged_saved_shard_leaves_the_table_untouched(tmp_path):
    path, layout = saved(tmp_path)
    target = table(capacity=2 * CAPACITY, shards=1)
    target.import_shards([state(5)])
    before = target.export_shard(0)
    # Bytes inside saved shard 1's rows, found by one of its rows' bytes (state(3)'s rows are random).
    source = table(capacity=2 * CAPACITY, shards=SAVED_BY)
    source.import_shards([state(1, shuffled=True), state(3, shuffled=True)])
    damage_saved_row(path, source.export_shard(1)["rows"][-1])

    work = table_checkpoint.read(path, {KEY: target}, layout["tables"], layout, range_bytes=1024)
    with pytest.raises(tf.errors.OpError):  # the check, in ranges, finds it before anything is assigned
        {ps: run() for ps, run in work.items()}
    after = target.export_shard(0)
    for field in ("keys", "counters", "row_keys", "rows"):
        np.testing.assert_array_equal(after[field], before[field])


# ------------------------------------------------------------------ on a real cluster
def on_ps(local, num_ps, directory):
    """A strategy on the cluster's first `num_ps` ps tasks (no chief: a coordinator picks its own port)."""
    import psclient

    spec = local.cluster.training_spec()
    cluster = psclient.Cluster({"worker": list(spec["worker"]), "ps": list(spec["ps"][:num_ps])})
    return psclient.ParameterServerStrategy(cluster, checkpoint_dir=directory)


def dynamic_model():
    """A DynamicEmbedding (dim 8, capacity 512: dense storage) under Adagrad, and the layer."""
    keras = pytest.importorskip("keras")
    from psclient.layers import DynamicEmbedding

    keras.utils.set_random_seed(1)
    inputs = keras.Input((64,), dtype="int64")
    layer = DynamicEmbedding(8, min_frequency=2, capacity=512, name="ids")
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(layer(inputs))))
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    return model, layer


@pytest.mark.long
@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_on_a_cluster_a_table_saved_by_2_ps_and_restored_on_3_in_ranges_is_the_whole_paths(
        two_workers_three_ps, restore_shared_clusters, tmp_path, monkeypatch, assigned):
    local, directory = two_workers_three_ps, tmp_path / "ckpt"
    strategy = on_ps(local, 2, directory)
    try:
        with strategy.scope():
            model, layer = dynamic_model()
        # Windows of 64 keys sliding by 32: a key seen twice is admitted, once only counted.
        x = np.stack([np.arange(32 * i, 32 * i + 64) for i in range(8)]).astype("int64")
        model.fit(x, np.ones((8, 1), "float32"), epochs=1, batch_size=1, verbose=0)
        strategy.save_checkpoint()
        saved = layer.export_state()
    finally:
        strategy.shutdown()
    assert sum(len(s["row_keys"]) for s in saved) > 0 and sum(len(s["keys"]) for s in saved) > sum(
        len(s["row_keys"]) for s in saved)  # some keys only counted

    def restored_on_3():
        strategy = on_ps(local, 3, directory)
        try:
            with strategy.scope():
                _, layer = dynamic_model()
            with RemoteConversions() as seen:
                assert strategy.restore() is not None
            mine = [found for found in seen.found if any(
                name in found[2] for name in ("table_checkpoint.py", "table_ranges.py", "dense_shard.py"))]
            assert not mine, "\n\n".join(f"{device}: {value}\n{stack}" for device, value, stack in mine)
            return layer.export_state()
        finally:
            strategy.shutdown()

    whole = restored_on_3()  # 171 rows of 8 floats and a slot a shard: one range, restored whole
    assert assigned == []
    monkeypatch.setattr(table_ranges, "READ_BATCH_BYTES", 256)  # no shard fits one range: 8 rows a range
    ranged = restored_on_3()
    assert len(assigned) == 3 and None not in assigned  # each shard in ranges, in place
    assert sum(assigned) == sum(len(s["row_keys"]) for s in saved)
    for got, want in zip(ranged, whole, strict=True):
        assert sorted(got) == sorted(want)
        for field in ("keys", "counters", "row_keys", "rows", "clock", "admissions", "evictions"):
            np.testing.assert_array_equal(got[field], want[field], err_msg=field)
        for slot in want["slots"]:
            np.testing.assert_array_equal(got["slots"][slot], want["slots"][slot], err_msg=slot)
