"""Incremental checkpoints (`delta_checkpoint_every`) on a real LocalCluster (2 workers, 2 ps).

A partitioned `keras.layers.Embedding` (4096 rows: row-diffed) and a Dense layer train in
phases of STEPS steps, each phase touching its own rows; the strategy writes a full
checkpoint before the first step, then a delta after each phase. The state at each
checkpoint is read once training is idle and the checkpoint written (nothing runs then).
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf
from _conversions import RemoteConversions
from _polling import wait_for

import psclient
from psclient._coordinator.checkpoints import checkpoint_pieces
from psclient._tf import checkpoints as tf_checkpoints

keras = pytest.importorskip("keras")
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

STEPS = 4
ROWS, DIM = 4096, 32
TOUCHED = 256  # distinct rows each phase's steps touch (ids of 64 per step)
partitioners = tf.distribute.experimental.partitioners


def build(optimizer_name, seed=1):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((64,), dtype="int32")
    x = keras.layers.Embedding(ROWS, DIM)(inputs)
    if optimizer_name == "adam":  # a [64 * DIM, 3] kernel: row-diffed, every row changes: its shards whole
        x = keras.layers.Flatten()(x)
    else:  # a [DIM, 3] kernel: small, written whole
        x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(inputs, keras.layers.Dense(3)(x))
    optimizer = {"adagrad": lambda: keras.optimizers.Adagrad(0.1),
                 "adam": lambda: keras.optimizers.Adam(0.01)}[optimizer_name]()
    optimizer.build(model.trainable_variables)
    return model, optimizer


def phase_ids(phase, step):
    """Phase p touches rows [p * TOUCHED, (p + 1) * TOUCHED): 64 per step, STEPS steps."""
    start = phase * TOUCHED + step * (TOUCHED // STEPS)
    return np.arange(start, start + TOUCHED // STEPS, dtype="int32").reshape(1, 64)


def step_function(model, optimizer, ids):
    x = tf.constant(ids)
    y = tf.constant([1], tf.int64)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss
    return step


def state(model, optimizer):
    return [np.array(w.numpy()) for w in model.weights] + [np.array(v.numpy()) for v in optimizer.variables]


def assert_same(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"variable {i}")


def deltas_written(strategy):
    return strategy.stats()["checkpoints"]["deltas_written"]


def writes(strategy):
    return strategy.stats()["checkpoints"]["background_writes"]


def run_phase(strategy, model, optimizer, phase, steps=STEPS):
    for s in range(steps):
        strategy.schedule(step_function(model, optimizer, phase_ids(phase, s)))
    strategy.join(timeout=180)


def train_with_deltas(cluster, directory, optimizer_name, **kwargs):
    """A full checkpoint, two deltas, then STEPS - 1 steps no delta holds. Returns the strategy
    (open), the model, optimizer and the states at the full checkpoint and each delta."""
    kwargs.setdefault("variable_partitioner", partitioners.FixedShardsPartitioner(2))
    strategy = psclient.ParameterServerStrategy(
        cluster.cluster, checkpoint_dir=directory, delta_checkpoint_every=STEPS, hang_timeout=10.0, **kwargs)
    try:
        with strategy.scope():
            model, optimizer = build(optimizer_name)
        states = [state(model, optimizer)]  # the full checkpoint, taken before the first step
        for phase in (0, 1):
            run_phase(strategy, model, optimizer, phase)
            wait_for(lambda: deltas_written(strategy) >= phase + 1, 120, f"delta {phase + 1}")
            states.append(state(model, optimizer))
        run_phase(strategy, model, optimizer, 2, steps=STEPS - 1)  # after the newest delta
        assert deltas_written(strategy) == 2
    except BaseException:
        strategy.shutdown()
        raise
    return strategy, model, optimizer, states


def restored_in_a_new_run(cluster, directory, optimizer_name):
    """A second coordinator's run: the same model, other initial values, `restore()`."""
    strategy = psclient.ParameterServerStrategy(
        cluster.cluster, checkpoint_dir=directory, hang_timeout=10.0,
        variable_partitioner=partitioners.FixedShardsPartitioner(2))
    try:
        with strategy.scope():
            model, optimizer = build(optimizer_name, seed=7)
        result = strategy.restore()
        return result, state(model, optimizer)
    finally:
        strategy.shutdown()


@pytest.fixture(scope="module")
def cluster(two_workers_two_ps):
    return two_workers_two_ps


@pytest.mark.parametrize("optimizer_name", ["adagrad", "adam"])
def test_restore_is_the_full_checkpoint_and_its_deltas_in_order(cluster, tmp_path, optimizer_name):
    directory = tmp_path / "ckpt"
    with RemoteConversions() as seen:
        restore_through_deltas(cluster, directory, optimizer_name)
    assert_none_of_mine(seen)


def assert_none_of_mine(seen, modules=("_deltas.py", "delta_restore.py", "checkpoint_pieces.py")):
    """No Python value converted under a task's device by the deltas' diffs and replays (a hung ps would
    then stop every coordinator thread: tests/strategy/test_no_remote_conversions.py)."""
    mine = [found for found in seen.found if any(name in found[2] for name in modules)]
    assert not mine, "\n\n".join(f"{device}: {value}\n{stack}" for device, value, stack in mine)


def restore_through_deltas(cluster, directory, optimizer_name):
    strategy, model, optimizer, states = train_with_deltas(cluster, directory, optimizer_name)
    try:
        stats = strategy.stats()["checkpoints"]
        assert stats["deltas_since_full"] == 2
        assert stats["last_delta_stall_seconds"] is not None and stats["last_delta_bytes"] > 0
        # Newer than the newest delta: what a restore must not bring back.
        assert not np.array_equal(state(model, optimizer)[0], states[-1][0])
    finally:
        strategy.shutdown()
    names = sorted(os.listdir(directory))
    assert "ckpt-1.delta-1.index" in names and "ckpt-1.delta-2.index" in names
    assert tf.train.latest_checkpoint(str(directory)).endswith("ckpt-1")  # deltas are not checkpoints to TF
    assert not [n for n in names if ".tmp-" in n or n.startswith(".psclient-save")]

    shapes = tf.train.load_checkpoint(str(directory / "ckpt-1.delta-2")).get_variable_to_shape_map()
    whole = [k for k in shapes if k.endswith("/idx") and shapes[k] == [0] and shapes[k[:-3] + "rows"] == [1024, 3]]
    # Adam: the kernel's shards and its moments' changed in every row: written whole (an empty index).
    assert len(whole) == (6 if optimizer_name == "adam" else 0)
    result, got = restored_in_a_new_run(cluster, directory, optimizer_name)
    assert result["path"].endswith("ckpt-1")
    assert [os.path.basename(p) for p in result["deltas"]] == ["ckpt-1.delta-1", "ckpt-1.delta-2"]
    assert result["completed_closures"] == 2 * STEPS
    assert_same(got, states[2])  # every row of the embedding and of each slot, the dense layer, iterations


def test_delta_holds_the_touched_rows_only_and_falls_back_from_a_bad_delta(cluster, tmp_path):
    directory = tmp_path / "ckpt"
    strategy, model, optimizer, states = train_with_deltas(cluster, directory, "adagrad")
    try:
        stats = strategy.stats()["checkpoints"]
        # Adagrad changes the rows it gets gradients for: the embedding's and its accumulator's.
        assert stats["last_delta_rows"] == 2 * TOUCHED
        row_bytes = DIM * 4  # float32 rows, the same for the accumulator (slot)
        bound = 1.2 * (TOUCHED * (row_bytes + row_bytes) + 2 * TOUCHED * 8)  # + an int64 index per row
        print(f"delta bytes {stats['last_delta_bytes']}, bound {bound:.0f}, full rows {2 * ROWS * row_bytes}")
        assert stats["last_delta_bytes"] <= bound
    finally:
        strategy.shutdown()

    # A damaged newest delta: the state of the one before it.
    for name in os.listdir(directory):
        if name.startswith("ckpt-1.delta-2.data-"):
            with open(directory / name, "r+b") as f:
                f.truncate(16)
    result, got = restored_in_a_new_run(cluster, directory, "adagrad")
    assert [os.path.basename(p) for p in result["deltas"]] == ["ckpt-1.delta-1"]
    assert any("ckpt-1.delta-2" in s["path"] for s in result["skipped"])
    assert_same(got, states[1])

    # A missing first delta: the later ones cannot apply; the full checkpoint alone.
    os.remove(directory / "ckpt-1.delta-1.index")
    result, got = restored_in_a_new_run(cluster, directory, "adagrad")
    assert result["deltas"] == []
    assert any("ckpt-1.delta-1 is missing" in s["error"] for s in result["skipped"])
    assert_same(got, states[0])


def test_a_ps_stopped_during_a_delta_fails_it_and_the_next_delta_diffs_from_the_last_written(
        cluster, restore_shared_clusters, tmp_path):
    from psclient._coordinator.checkpoints.checkpoint_parts import late_threads

    directory = tmp_path / "ckpt"
    strategy = psclient.ParameterServerStrategy(
        cluster.cluster, checkpoint_dir=directory, delta_checkpoint_every=STEPS, hang_timeout=3.0,
        variable_partitioner=partitioners.FixedShardsPartitioner(2))
    checkpoints = strategy._recovery.checkpoints  # noqa: SLF001 - the tests' seam into the write

    def stop_ps1_once(path):
        checkpoints.before_write = None
        assert path.endswith("ckpt-1.delta-2")
        cluster.stop("ps", 1)

    try:
        with strategy.scope():
            model, optimizer = build("adagrad")
        run_phase(strategy, model, optimizer, 0)
        wait_for(lambda: deltas_written(strategy) == 1, 120, "delta 1")
        checkpoints.before_write = stop_ps1_once
        run_phase(strategy, model, optimizer, 1)
        wait_for(lambda: strategy.stats()["checkpoints"]["write_errors"] >= 1, 60, "the delta to fail")
        error = strategy.stats()["checkpoints"]["last_write_error"]
        assert "ps:1" in error and "ckpt-1.delta-2" in error, error
        assert not (directory / "ckpt-1.delta-2.index").exists()
        cluster.resume("ps", 1)
        wait_for(lambda: not late_threads(), 60, "the calls left waiting on ps:1 to return")
        # Tried again once ps:1 answers: diffed against delta 1's cut (the failed one changed no base),
        # so it holds phase 1's rows.
        wait_for(lambda: deltas_written(strategy) == 2, 120, "delta 2, tried again")
        assert strategy.stats()["checkpoints"]["last_delta_rows"] == 2 * TOUCHED
        want = state(model, optimizer)
    finally:
        cluster.resume("ps", 1)
        strategy.shutdown()
    result, got = restored_in_a_new_run(cluster, directory, "adagrad")
    assert [os.path.basename(p) for p in result["deltas"]] == ["ckpt-1.delta-1", "ckpt-1.delta-2"]
    assert_same(got, want)


def shards_on(model, optimizer, ps, values=None):
    """The values of every shard (and whole variable) held by ps task `ps`: read from the cluster, or cut
    from `values` (a `state()` taken earlier) by each shard's rows."""
    out = []
    variables = [*model.weights, *optimizer.variables]
    for i, variable in enumerate(variables):
        value = variable.value if isinstance(variable, keras.Variable) else variable
        start = 0
        for shard in getattr(value, "variables", [value]):
            rows = int(shard.shape[0]) if shard.shape.rank else None
            if f"/job:ps/replica:0/task:{ps}/" in shard.device:
                if values is None:
                    out.append(np.array(shard.numpy()))
                else:
                    out.append(values[i] if rows is None or not hasattr(value, "variables")
                               else values[i][start:start + rows])
            start += rows or 0
    return out


# ------------------------------------------------------------------ dynamic embedding tables
def build_dynamic(capacity, seed=1):
    from psclient.layers import DynamicEmbedding

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((64,), dtype="int64")
    layer = DynamicEmbedding(8, min_frequency=2, capacity=capacity, name="ids")
    x = keras.layers.GlobalAveragePooling1D()(layer(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    optimizer = keras.optimizers.Adagrad(0.1)
    optimizer.build(model.trainable_variables)
    return model, optimizer, layer


def dynamic_step(model, optimizer, keys):
    x = tf.constant(keys)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x, training=True)))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss
    return step


def dynamic_keys(phase, step):
    """Windows of 64 keys, each sliding by 32: a key seen in two steps is admitted (min_frequency=2),
    one seen once is only counted. Phase 1 comes back to half of phase 0's keys. With capacity=64,
    admissions evict: deltas then carry removed keys."""
    start = (0 if phase == 1 and step < 2 else phase * 1000) + step * 32
    return np.arange(start, start + 64, dtype="int64").reshape(1, 64)


def table_state(layer):
    """Every shard's tracked keys with their counters, and rows with their slots, by key (order-free)."""
    out = []
    for index in range(len(layer.table.shards)):
        shard = layer.table.export_shard(index)
        counters = {int(k): tuple(c) for k, c in zip(shard["keys"], shard["counters"].reshape(-1, 2))}
        rows = {int(k): (tuple(r), *(tuple(shard["slots"][s][i]) for s in sorted(shard["slots"])))
                for i, (k, r) in enumerate(zip(shard["row_keys"], shard["rows"]))}
        out.append((counters, rows, int(shard["clock"]), int(shard["admissions"]), int(shard["evictions"])))
    return out


# 600,000: 300,000 8-wide rows a ps (9.6 MB a variable, above a row chunk), so each checkpoint copies
# the shards before its cut and gathers their rows in the write (rows of 32 bytes): deltas diff those.
@pytest.mark.long
@pytest.mark.parametrize("capacity", [None, 64, 600_000], ids=["hash", "bounded", "bounded-copied"])
def test_dynamic_table_rows_slots_and_counters_come_back_from_full_and_deltas(cluster, tmp_path, capacity,
                                                                               monkeypatch):
    from psclient._coordinator.checkpoints import table_copy

    copied, copy_shards = [], table_copy.copy_shards
    monkeypatch.setattr(table_copy, "copy_shards", lambda *a, **k: copied.append(copy_shards(*a, **k)) or copied[-1])
    with RemoteConversions() as seen:
        evictions = tables_through_deltas(cluster, tmp_path / "ckpt", capacity)
    # The tables' own saves and restores too (hash tables have no prepared per-ps save).
    assert_none_of_mine(seen, ("_deltas.py", "delta_restore.py", "checkpoint_pieces.py", "table_checkpoint.py",
                               "table_ranges.py", "ps_saves.py"))
    assert evictions > 0 if capacity == 64 else evictions == 0
    # Only the big shards are copied before the cut (hash shards are, by `hash_copy`, in the same dicts).
    assert any(isinstance(copy, table_copy.TableCopy) for by_shard in copied for copy in by_shard.values()) == \
        (capacity == 600_000)


@pytest.mark.long
def test_a_bounded_table_restored_in_ranges_applies_its_deltas_in_place(cluster, tmp_path, monkeypatch):
    """The same, each shard forced onto the ranged path (a big shard's: one range a row, so a
    64-row table takes it): the deltas' rows are written in place after the saved ranges
    (`table_ranges.Plan.assign`), and every row, slot and counter comes back as the newest delta
    holds it, on a real cluster (the local tests in tests/tables/test_table_ranges_deltas.py
    compare it with the whole path)."""
    from psclient._coordinator.checkpoints import table_ranges

    monkeypatch.setattr(table_ranges, "READ_BATCH_BYTES", 1)  # no shard fits one range
    applied = []
    assign = table_ranges.Plan.assign

    def recording(self, shard, deltas=()):
        rows = assign(self, shard, deltas)
        applied.append((len(deltas), rows))
        return rows

    monkeypatch.setattr(table_ranges.Plan, "assign", recording)
    with RemoteConversions() as seen:
        tables_through_deltas(cluster, tmp_path / "ckpt", 64)
    assert_none_of_mine(seen, ("_deltas.py", "delta_restore.py", "table_checkpoint.py", "table_ranges.py"))
    assert applied and all(deltas == 2 and rows is not None for deltas, rows in applied), applied


def merged(shards):
    """A table's state over all its shards (for a restore into another number of ps tasks)."""
    counters, rows = {}, {}
    for c, r, *_ in shards:
        counters.update(c)
        rows.update(r)
    return (counters, rows, max(s[2] for s in shards), sum(s[3] for s in shards), sum(s[4] for s in shards))


def tables_through_deltas(cluster, directory, capacity, restore_on=None):
    """Full checkpoints, then 2 deltas of a DynamicEmbedding model, STEPS - 1 steps more; a new run (on
    `restore_on`, default the same cluster) restores every row, slot and counter of the newest delta."""
    strategy = psclient.ParameterServerStrategy(cluster.cluster, checkpoint_dir=directory,
                                                delta_checkpoint_every=STEPS, hang_timeout=10.0)
    try:
        with strategy.scope():
            model, optimizer, layer = build_dynamic(capacity)
        states = []
        for phase in (0, 1, 2):
            for s in range(STEPS):
                strategy.schedule(dynamic_step(model, optimizer, dynamic_keys(phase, s)))
            strategy.join(timeout=180)
            # The table's slots are made by the first step: the first checkpoint after it is full
            # (its base had none), the next ones deltas.
            wait_for(lambda: writes(strategy) >= phase + 2, 120, f"checkpoint {phase + 2}")
            assert strategy.stats()["checkpoints"]["write_errors"] == 0
            states.append((table_state(layer), state(model, optimizer)))
        assert deltas_written(strategy) == 2
        counters = states[-1][0]
        assert sum(len(c) for c, *_ in counters) > sum(len(r) for _, r, *_ in counters) > 0  # some only counted
        for s in range(STEPS - 1):  # after the newest delta
            strategy.schedule(dynamic_step(model, optimizer, dynamic_keys(3, s)))
        strategy.join(timeout=180)
        assert table_state(layer) != states[-1][0]
        # The delta held the changed rows only: without a capacity, fewer than the table holds (phase 2
        # left phase 1's rows alone); with capacity=64, phase 2's admissions replaced every row.
        held = sum(len(r) for _, r, *_ in states[-1][0])
        assert 0 < strategy.stats()["checkpoints"]["last_delta_rows"] <= held
        assert strategy.stats()["checkpoints"]["last_delta_rows"] < held or capacity is not None
        evictions = sum(s[4] for s in states[-1][0])
    finally:
        strategy.shutdown()

    strategy = psclient.ParameterServerStrategy((restore_on or cluster).cluster, checkpoint_dir=directory,
                                                hang_timeout=10.0)
    try:
        with strategy.scope():
            model, optimizer, layer = build_dynamic(capacity, seed=7)
        result = strategy.restore()
        assert result["path"].endswith("ckpt-2") and len(result["deltas"]) == 2
        got, want = table_state(layer), states[-1][0]
        if len(got) == len(want):
            assert got == want
        else:
            assert merged(got) == merged(want)
        assert_same(state(model, optimizer), states[-1][1])
    finally:
        strategy.shutdown()
    return evictions


# ------------------------------------------------------------------ one lost ps out of four
@pytest.fixture(scope="module")
def four_ps():
    """1 worker, 4 ps: one lost ps out of four."""
    from psclient._cluster.local import LocalCluster

    with LocalCluster(num_workers=1, num_ps=4, start_timeout=300) as cluster:
        yield cluster


@pytest.mark.long
def test_one_lost_ps_of_four_rolls_back_to_the_newest_delta_only(four_ps, tmp_path):
    cluster, lost = four_ps, 2
    strategy, model, optimizer, states = train_with_deltas(
        cluster, tmp_path / "ckpt", "adagrad", ps_recovery="part", checkpoints_to_keep=1,
        variable_partitioner=partitioners.FixedShardsPartitioner(4))
    try:
        now = {ps: shards_on(model, optimizer, ps) for ps in range(4)}  # trained since the newest delta
        on_lost = [shard for variable in model.weights for shard in getattr(variable.value, "variables", [])
                   if f"/job:ps/replica:0/task:{lost}/" in shard.device]
        assert on_lost  # (placement: a shard of the embedding is there)
        try:
            cluster.kill("ps", lost)
        finally:
            cluster.restart("ps", lost)
        touch = tf.function(lambda: tf.add_n([tf.reduce_sum(shard.read_value()) for shard in on_lost]))
        strategy.schedule(touch).result(timeout=150)
        strategy.join(timeout=60)
        rolled = strategy.stats()["ps"][lost]["rolled_back"]
        assert rolled["mode"] == "part"
        assert rolled["closures"] == STEPS - 1  # the steps after the newest delta, not after the full one
        for ps in range(4):
            if ps != lost:
                assert_same(shards_on(model, optimizer, ps), now[ps])  # kept every update
        restored = shards_on(model, optimizer, lost)
        assert any(not np.array_equal(a, b) for a, b in zip(restored, now[lost]))
        assert_same(restored, shards_on(model, optimizer, lost, values=states[2]))  # every row and slot
        # The copy the lost ps kept for the next delta went with it: the next checkpoint is full.
        assert strategy.stats()["checkpoints"]["deltas_since_full"] == 0
        written = writes(strategy)
        run_phase(strategy, model, optimizer, 3)
        wait_for(lambda: writes(strategy) > written, 120, "the checkpoint after the recovery")
        assert strategy.stats()["checkpoints"]["deltas_since_full"] == 0
        assert tf.train.latest_checkpoint(str(tmp_path / "ckpt")).endswith("ckpt-2")
        # checkpoints_to_keep=1: ckpt-1 was pruned, its deltas with it.
        assert not [name for name in os.listdir(tmp_path / "ckpt") if name.startswith("ckpt-1.")]
    finally:
        strategy.shutdown()


@pytest.mark.long
def test_deltas_restore_into_another_number_of_ps(cluster, four_ps, tmp_path):
    """Written on 2 ps, restored on 4: the deltas' rows land in other shards (global row indices), the
    table deltas' keys on the ps that owns them now."""
    strategy, _model, _optimizer, states = train_with_deltas(cluster, tmp_path / "embedding", "adagrad")
    strategy.shutdown()
    strategy = psclient.ParameterServerStrategy(four_ps.cluster, checkpoint_dir=tmp_path / "embedding",
                                                variable_partitioner=partitioners.FixedShardsPartitioner(4))
    try:
        with strategy.scope():
            model, optimizer = build("adagrad", seed=7)
        assert len(model.weights[0].value.variables) == 4
        with RemoteConversions() as seen:  # the rows scattered into other shards: nothing converted on a ps
            assert len(strategy.restore()["deltas"]) == 2
        assert_none_of_mine(seen)
        assert_same(state(model, optimizer), states[2])
    finally:
        strategy.shutdown()
    tables_through_deltas(cluster, tmp_path / "tables", None, restore_on=four_ps)


@pytest.mark.long
def test_a_slot_above_the_read_limit_is_saved_read_and_assigned_in_row_ranges_with_its_deltas(
        cluster, tmp_path, monkeypatch):
    """The read limit lowered to 16 KiB: the embedding's shards (2048 rows of 128 bytes, 256 KiB) and
    its accumulator's are saved in chunks of 128 rows, read and assigned 128 rows at a time, and each
    delta's changed rows (256 rows, 32 KiB, chunked too) are read for the rows of each range only."""
    limit, row_bytes = 16 << 10, DIM * 4
    monkeypatch.setattr(checkpoint_pieces, "READ_BATCH_BYTES", limit)
    directory = tmp_path / "ckpt"
    with RemoteConversions() as seen:
        strategy, _model, _optimizer, states = train_with_deltas(cluster, directory, "adagrad")
        strategy.shutdown()
        reader = tf.train.load_checkpoint(str(directory / "ckpt-1"))
        layout = json.loads(reader.get_tensor("psclient_layout"))
        big = sorted(k for k, shape in reader.get_variable_to_shape_map().items() if shape == [ROWS, DIM])
        assert len(big) == 2  # the embedding and its Adagrad accumulator
        assert layout["row_chunks"]["bytes"] == limit and set(big) <= set(layout["row_chunks"]["keys"])

        reads = []
        real = tf_checkpoints.restore

        def recording(prefix, keys, specs, dtypes):  # the real RestoreV2, each call's keys and slices noted
            reads.append((os.path.basename(prefix), list(keys), list(specs)))
            return real(prefix, keys, specs, dtypes)

        monkeypatch.setattr(tf_checkpoints, "restore", recording)
        result, got = restored_in_a_new_run(cluster, directory, "adagrad")
    assert_none_of_mine(seen)
    assert [os.path.basename(p) for p in result["deltas"]] == ["ckpt-1.delta-1", "ckpt-1.delta-2"]
    assert_same(got, states[2])  # every row: the full checkpoint's, then each delta's, in order

    per_range = limit // row_bytes
    for key in big:
        specs = [spec for prefix, keys, specs in reads if prefix == "ckpt-1"
                 for k, spec in zip(keys, specs) if k == key]
        ranges = sorted({tuple(int(x) for x in spec.split(" ")[2].split(":")[0].split(",")) for spec in specs})
        # Each range read twice (the check, then the assign): 2 shards of 2048 rows, 16 ranges each.
        assert len(specs) == 2 * len(ranges) and ranges == [(start, per_range)
                                                            for start in range(0, ROWS, per_range)], ranges
    # Each delta's changed rows (256 of the embedding, 256 of its accumulator, in shard 0 or 1): read a
    # range at a time, none whole at assign time.
    delta_rows = [spec for prefix, keys, specs in reads if ".delta-" in prefix
                  for k, spec in zip(keys, specs) if k.endswith("/rows")]
    assert delta_rows and all(spec and int(spec.split(" ")[2].split(":")[0].split(",")[1]) <= per_range
                              for spec in delta_rows), delta_rows
