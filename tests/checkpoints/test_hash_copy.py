"""A DynamicEmbedding table in hash storage copied before a checkpoint's cut and merged after it.

`checkpoints.hash_copy`: the shard's tables are exported while training goes
on, the keys each write touches meanwhile are kept on the ps, the cut reads
those keys again and the write merges them into the exports. On a real
cluster (2 workers, 2 ps): steps scheduled between the copy and the cut admit
keys, count keys still short of `min_frequency`, train rows and slots and
expire keys (`ttl_steps`); the checkpoint must hold the table as it is at the
cut, every tracked key, counter, row and slot.
"""


import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
from psclient._coordinator.checkpoints import checkpoint_snapshot, fuzzy_copy, hash_copy  # noqa: E402
from _conversions import RemoteConversions  # noqa: E402
from _polling import wait_for  # noqa: E402
from _saves_beside import KEEP_EVERY_SAVE, saves_beside_fit  # noqa: E402
from tables.test_table_saves import read_local  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

DIM = 8


@pytest.fixture(scope="module")
def cluster(two_workers_two_ps):
    return two_workers_two_ps


def build(strategy, width=4, **policy):
    """A model over one DynamicEmbedding without a capacity (hash storage) of `width` keys an example,
    and a scheduled training step that applies its gradient (traced once, before any save)."""
    with strategy.scope():
        ids = keras.Input([width], dtype="int64")
        layer = psclient.layers.DynamicEmbedding(DIM, name="item", **policy)
        model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
        model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")

    @tf.function
    def train(batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(batch, training=True) - 1.0) ** 2)
        model.optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss
    return model, layer, train


def batch(first: int) -> tf.Tensor:
    """64 keys: 32 seen in every batch (trained again, counted), 32 new from `first` on."""
    ids = np.concatenate([np.arange(1000, 1032), np.arange(first, first + 32)]).astype(np.int64)
    return tf.constant(ids.reshape(16, 4))


def state(states) -> tuple:
    """Every tracked key's counters, every row and slot by key, and each shard's clock, admissions and
    evictions, from `export_state()` or a checkpoint's parts."""
    counters, rows, slots, clocks = {}, {}, {}, []
    for part in states:
        counters.update(zip(np.asarray(part["keys"]).tolist(), np.asarray(part["counters"]).reshape(-1, 2).tolist()))
        row_keys = np.asarray(part["row_keys"]).tolist()
        rows.update(zip(row_keys, np.asarray(part["rows"]).reshape(-1, DIM).tolist()))
        for name, value in part["slots"].items():
            slots.setdefault(name, {}).update(zip(row_keys, np.asarray(value).reshape(-1, DIM).tolist()))
        clocks.append((int(part["clock"]), int(part["admissions"]), int(part["evictions"])))
    return counters, rows, slots, clocks


def copying(shard) -> bool:
    """Whether a copy of the shard is under way (its writes then note their keys)."""
    begun, ended = shard.copies.numpy().tolist()
    return begun > ended


def saved(path) -> tuple:
    import json

    reader = tf.train.load_checkpoint(path)
    layout = json.loads(reader.get_tensor("psclient_layout"))
    return state(read_local(reader, "table/0000", layout["tables"]["table/0000"]))


def test_writes_between_the_copy_and_the_cut_are_in_the_checkpoint(cluster, tmp_path, monkeypatch):
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        model, layer, train = build(strategy, min_frequency=2, ttl_steps=2)
        shards = layer.table.shards
        assert all(not shard.dense and shard.marked for shard in shards)
        for step in range(4):  # each group of new keys twice: given rows
            strategy.schedule(train, args=(batch(10_000 + 32 * (step // 2)),)).result(timeout=120)
        prepare, during = fuzzy_copy.prepare, {}

        def prepare_then_train(*args, **kwargs):
            prepared = prepare(*args, **kwargs)
            during["before"] = state(layer.export_state())
            # Between the copy and the cut: keys admitted, counted, trained and expired.
            for step in range(4):
                strategy.schedule(train, args=(batch(20_000 + 32 * ((step + 1) // 2)),)).result(timeout=120)
            return prepared

        monkeypatch.setattr(fuzzy_copy, "prepare", prepare_then_train)
        path = strategy.save_checkpoint()
        stats = strategy.stats()["checkpoints"]
        now = state(layer.export_state())
        before = during["before"]
        # Each kind of write happened while the copy stood: new rows, new keys still counting, rows
        # trained, keys and their rows expired (ttl_steps=2: the new keys of the steps before the copy).
        assert set(now[1]) - set(before[1]) and set(now[0]) - set(now[1])
        assert set(before[0]) - set(now[0]) and set(before[1]) - set(now[1])
        assert sum(c[2] for c in now[3]) > sum(c[2] for c in before[3])
        assert now[1][1000] != before[1][1000]
        assert stats["last_copied_bytes"] > 0 and stats["last_rows_read_again"] > 0, stats
        assert saved(path) == now
        monkeypatch.setattr(fuzzy_copy, "prepare", prepare)
        # Nothing written between: the copy is the cut's state, and marking stops after the write.
        again = strategy.save_checkpoint()
        assert strategy.stats()["checkpoints"]["last_rows_read_again"] == 0
        assert saved(again) == now
        assert not any(copying(shard) for shard in shards)
        restored = strategy.restore()
        assert restored["path"] == again and state(layer.export_state()) == now
    finally:
        strategy.shutdown()


def test_a_copy_whose_functions_never_reached_the_ps_traces_them_again(cluster, tmp_path, monkeypatch):
    """The copy's begin and its cut fail "not registered" for good (registrations lost on their way,
    as one was in a chaos plan): once the retries are spent each is traced again, under a new name,
    and the checkpoint holds the table (it failed the save)."""
    from psclient._tf import registrations

    def lost(*_args):
        raise tf.errors.NotFoundError(None, None, "'__inference_read_again_7' is neither a type of a "
                                      "primitive operation nor a name of a function registered in binary.")

    monkeypatch.setattr(registrations, "ATTEMPTS", 2)
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        _model, layer, train = build(strategy, min_frequency=2)
        for step in range(4):
            strategy.schedule(train, args=(batch(10_000 + 32 * (step // 2)),)).result(timeout=120)
        shard = layer.table.shards[0]
        shard.hash_cut = (shard.version, lost)
        class LostBegin:  # the begin's trace: its registration lost too
            __call__ = staticmethod(lost)

            @staticmethod
            def experimental_get_tracing_count():
                return 0

        lost_begin = LostBegin()
        monkeypatch.setattr(hash_copy._begin, "function", lost_begin)
        path = strategy.save_checkpoint()
        assert shard.hash_cut[1] is not lost
        assert isinstance(hash_copy._begin.function, tf.types.experimental.PolymorphicFunction)  # a new one
        assert strategy.stats()["checkpoints"]["last_copied_bytes"] > 0
        assert saved(path) == state(layer.export_state())
        assert not any(copying(s) for s in layer.table.shards)
    finally:
        strategy.shutdown()


def test_an_update_that_lands_after_the_copy_began_is_in_the_checkpoint(cluster, tmp_path, monkeypatch):
    """A step's lookup (its keys counted, touched then) before the copy began and its update after:
    the update marks its keys itself, or the checkpoint would hold their rows as exported before it.
    The two halves run eagerly here, the copy between them."""
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        _model, layer, train = build(strategy)
        strategy.schedule(train, args=(batch(10_000),)).result(timeout=120)  # rows and slots made
        table = layer.table
        keys = tf.constant(np.arange(1000, 1032), tf.int64)
        _rows, looked_up = table.train_lookup(keys, tf.ones([32], tf.int64))
        prepare = fuzzy_copy.prepare

        def prepare_then_update(*args, **kwargs):
            prepared = prepare(*args, **kwargs)
            table.apply(looked_up, tf.ones([32, DIM]), lambda rows, gradient, slots: (rows + gradient, slots))
            return prepared

        before = state(layer.export_state())
        monkeypatch.setattr(fuzzy_copy, "prepare", prepare_then_update)
        path = strategy.save_checkpoint()
        now = state(layer.export_state())
        updated = [np.float32(before[1][key]) + np.float32(1.0) for key in range(1000, 1032)]
        assert all(np.array_equal(np.float32(now[1][key]), want) for key, want in zip(range(1000, 1032), updated))
        assert saved(path) == now
    finally:
        strategy.shutdown()


def test_each_checkpoint_holds_one_moment_of_a_table_trained_beside_it(cluster, tmp_path):
    """fit in another thread while checkpoints are taken: the 64 keys of every batch are trained by
    every step alike (one worker: no step reads rows another writes), so a checkpoint that mixed rows
    of different moments would hold them unequal."""
    spec = cluster.cluster.training_spec()
    one_worker = psclient.Cluster({"worker": list(spec["worker"][:1]), "ps": list(spec["ps"])})
    probes = np.arange(1000, 1064, dtype=np.int64)
    data = tf.data.Dataset.from_tensor_slices((probes[:, None], np.ones([64, 1], np.float32))).batch(64).repeat()
    strategy = psclient.ParameterServerStrategy(one_worker, checkpoint_dir=str(tmp_path / "ckpt"),
                                                checkpoints_to_keep=KEEP_EVERY_SAVE)
    try:
        model, layer, _train = build(strategy, width=1)  # one key an example: every probe trained alike
        model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
        keys = np.arange(10**9, 10**9 + 100_000, dtype=np.int64)  # bulk: a copy that takes a while
        layer.import_state([{"keys": np.concatenate([keys, probes]),
                             "counters": np.stack([np.ones(keys.size + 64, np.int64), np.ones(keys.size + 64, np.int64)], 1),
                             "row_keys": np.concatenate([keys, probes]),
                             "rows": np.full([keys.size + 64, DIM], 0.01, np.float32),
                             "slots": {"accumulator": np.full([keys.size + 64, DIM], 0.1, np.float32)},
                             "clock": 1, "admissions": 0, "evictions": 0}])
        for path, _again in saves_beside_fit(strategy, model, data):  # until a cut read rows again
            _counters, rows, slots, _clocks = saved(path)
            assert len(rows) == keys.size + 64
            assert len({tuple(rows[int(k)]) for k in probes}) == 1, f"{path}: probes' rows differ"
            assert len({tuple(slots["accumulator"][int(k)]) for k in probes}) == 1, f"{path}: accumulators differ"
            assert slots["accumulator"][1000][0] > 0.1  # trained
    finally:
        strategy.shutdown()


def test_an_end_that_reaches_the_ps_late_leaves_a_later_copy_under_way(cluster):
    """A release on a ps that hung runs there once it answers, maybe after the next copy began: the
    copies are numbered, and an earlier number's end does not end a later copy."""
    strategy = psclient.ParameterServerStrategy(cluster)  # connects this process to the ps tasks
    try:
        with tf.device("/job:ps/task:0"):
            copies = tf.Variable(tf.zeros([2], tf.int64))
            touched = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, tf.constant(0, tf.int64))
        touched.insert(tf.constant([7, 8], tf.int64), tf.constant([1, 1], tf.int64))
        hash_copy._begin(copies, touched, tf.constant(5, tf.int64))
        assert copies.numpy().tolist() == [5, 0] and int(touched.size()) == 0
        hash_copy._end(copies, tf.constant(4, tf.int64))  # copy 4's end, late
        assert copies.numpy().tolist() == [5, 4]  # copy 5 still under way
        hash_copy._end(copies, tf.constant(5, tf.int64))
        assert copies.numpy().tolist() == [5, 5]
    finally:
        strategy.shutdown()


def test_each_export_counts_as_progress_and_a_stop_ends_the_copy_between_them(cluster, tmp_path):
    """A hash shard's export is one op: the copy asks `stop` before each (its caller's progress mark,
    so a table whose export takes long is not taken for a hung ps), and once `stop` is true it gives
    up before the next export and ends the copies it began (their writes no longer note keys)."""
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        _model, layer, train = build(strategy)
        strategy.schedule(train, args=(batch(10_000),)).result(timeout=120)
        tables = strategy.parts.store.tables()
        shards = layer.table.shards
        asked = []
        prepared = fuzzy_copy.prepare({}, str, tables=tables, stop=lambda: asked.append(1) or False)
        assert prepared is not None
        # Each shard: before its copy began, its counters' export, its rows' export, each slot's read.
        assert len(asked) == sum(3 + len(shard.slots) for shard in shards) == 8, asked
        assert all(copying(shard) for shard in shards)
        prepared.release()
        assert not any(copying(shard) for shard in shards)

        asked.clear()
        stopped = fuzzy_copy.prepare({}, str, tables=tables, stop=lambda: len(asked.append(1) or asked) > 4)
        assert stopped is None
        assert 4 < len(asked) < 8, asked  # given up before the last exports
        assert not any(copying(shard) for shard in shards)
        # The next checkpoint copies and saves the table as it is.
        strategy.schedule(train, args=(batch(20_000),)).result(timeout=120)
        assert saved(strategy.save_checkpoint()) == state(layer.export_state())
    finally:
        strategy.shutdown()


def test_a_copy_taken_before_an_import_is_not_saved(cluster, tmp_path):
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        _model, layer, train = build(strategy)
        strategy.schedule(train, args=(batch(10_000),)).result(timeout=120)
        tables = strategy.parts.store.tables()
        prepared = fuzzy_copy.prepare({}, str, tables=tables)
        assert prepared is not None
        assert all(isinstance(prepared.take_table(ps, shard), hash_copy.HashCopy)
                   for ps, shard in enumerate(layer.table.shards))
        exported = layer.export_state()
        for part in exported:
            part["rows"] = np.asarray(part["rows"]) + 1.0
        layer.import_state(exported)
        assert all(prepared.take_table(ps, shard) is None for ps, shard in enumerate(layer.table.shards))
        snapshot = checkpoint_snapshot.take_snapshot({}, str, tables, prepared=prepared)
        tf.io.gfile.makedirs(str(tmp_path / "direct"))
        path = str(tmp_path / "direct" / "ckpt-1")
        checkpoint_snapshot.write_snapshot(path, snapshot, {}, str)
        prepared.release()
        assert saved(path) == state(layer.export_state())
    finally:
        strategy.shutdown()


def test_a_restarted_ps_gets_new_marks_and_a_save_converts_nothing_on_the_ps(cluster, restore_shared_clusters,
                                                                            tmp_path):
    """ps 1 killed and started again: its shard's tables are made again (new `touched`, no copy under
    way) and restored; the next checkpoints copy both shards and hold the table as it exports,
    and the copy, the cut and the merge hand the ps no Python value to convert (TF copies one there
    holding the GIL: a hung ps would stop every thread of the coordinator)."""
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"), hang_timeout=3.0)
    try:
        _model, layer, train = build(strategy)
        strategy.schedule(train, args=(batch(10_000),)).result(timeout=120)
        strategy.save_checkpoint()
        old = layer.table.shards[1].touched
        cluster.kill("ps", 1)
        cluster.restart("ps", 1)
        # stats() meets the restarted ps and reports it (not waiting): the recovery makes its shards again
        # and restores them.
        strategy.stats()
        wait_for(lambda: strategy.stats(read_ps=False)["ps"][1]["recoveries"] == 1, 300, "ps 1 to be recovered")
        assert strategy.stats()["ps"][1]["recoveries"] == 1
        shard = layer.table.shards[1]
        assert shard.marked and shard.touched is not old and not copying(shard)
        strategy.schedule(train, args=(batch(20_000),)).result(timeout=120)
        strategy.save_checkpoint()  # the first with the new tables: the cut's function traced there
        strategy.schedule(train, args=(batch(30_000),)).result(timeout=120)
        with RemoteConversions() as seen:
            path = strategy.save_checkpoint()
        assert not seen.found, "Python values converted under a task's device:\n" + seen.report()
        assert strategy.stats()["checkpoints"]["last_copied_bytes"] > 0
        assert saved(path) == state(layer.export_state())
    finally:
        strategy.shutdown()


def test_checkpoint_cut_copy_leaves_hash_tables_unmarked(cluster, tmp_path):
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_cut="copy")
    try:
        _model, layer, train = build(strategy)
        assert not any(shard.marked or hasattr(shard, "touched") for shard in layer.table.shards)
        strategy.schedule(train, args=(batch(10_000),)).result(timeout=120)
        path = strategy.save_checkpoint()
        assert strategy.stats()["checkpoints"]["last_copied_bytes"] == 0
        assert saved(path) == state(layer.export_state())
    finally:
        strategy.shutdown()
