"""Several bounded DynamicEmbedding tables admitted and updated together in one step
(psclient/_coordinator/tables/fused_admission.py): each table keeps its own capacity, LRU order and rows,
as a reference computed here says; the batched LRU selection picks what the per-shard one picks."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from psclient._coordinator.tables.least_recent import least_recent  # noqa: E402
from psclient._coordinator.tables.least_recent import least_recent_rows  # noqa: E402
from psclient._core.dynamic_tables import headroom, scan_every  # noqa: E402
from psclient.layers import DynamicEmbedding  # noqa: E402

START, LR = 0.5, 0.1


def test_the_batched_selection_picks_what_the_per_shard_one_picks():
    rng = np.random.default_rng(0)
    for _ in range(20):
        shards, share = rng.integers(1, 5), rng.integers(1, 40)
        keys = rng.choice(10**6, (shards, share), replace=False) - 500_000
        last = rng.integers(-1, 6, (shards, share))  # few distinct steps: many ties
        member = last >= 0
        k = np.array([rng.integers(0, m + 1) for m in member.sum(1)])
        got = least_recent_rows(tf.constant(keys), tf.constant(last), tf.constant(member), tf.constant(k)).numpy()
        for g in range(shards):
            want = least_recent(tf.constant(keys[g]), tf.constant(last[g]), tf.constant(member[g]),
                                tf.constant(k[g])).numpy()
            np.testing.assert_array_equal(got[g], want)
            assert got[g].sum() == k[g]


def sgd(row, slots, g):
    return row - LR * g


class Reference:
    """One table by hand: rows (and slots, from `first_slots`) updated by `rule(row, slots, gradient)`
    (SGD by default) on sum(rows * weights), LRU down to share - headroom when full."""

    def __init__(self, capacity, first_slots=None):
        self.capacity, self.first_slots = capacity, first_slots or {}
        self.rows, self.slots, self.last, self.clock = {}, {}, {}, 0

    def step(self, keys, weights, rule=sgd):
        self.clock += 1
        batch = list(dict.fromkeys(keys))
        new = [k for k in batch if k not in self.rows]
        held = len(self.rows)
        if held + len(new) > self.capacity:
            excess = held + len(new) - (self.capacity - headroom(self.capacity))
            old = sorted((self.last[k], k) for k in self.rows if k not in batch)
            for _, k in old[:excess]:
                del self.rows[k], self.slots[k], self.last[k]
        for k in new:
            self.rows[k] = np.full(2, START)
            self.slots[k] = {name: np.full(2, value) for name, value in self.first_slots.items()}
        grads = {}
        for k, w in zip(keys, weights):
            grads[k] = grads.get(k, 0) + np.asarray(w)
        for k, g in grads.items():
            self.rows[k] = rule(self.rows[k], self.slots[k], g)
            self.last[k] = self.clock


def test_tables_of_one_step_keep_their_own_capacity_and_rows():
    """Three alike tables (one group), one of another capacity and one of another width (groups of
    their own), all in one traced step, over batches that keep evicting."""
    rng = np.random.default_rng(1)
    specs = {"a": (2, 6), "b": (2, 6), "c": (2, 6), "d": (2, 9), "e": (3, 6)}
    init = keras.initializers.Constant(START)
    layers = {name: DynamicEmbedding(dim, capacity=cap, embeddings_initializer=init, name=f"fused_{name}")
              for name, (dim, cap) in specs.items()}
    for layer in layers.values():
        layer.build()
    refs = {name: Reference(cap) for name, (_, cap) in specs.items() if specs[name][0] == 2}
    sgd = keras.optimizers.SGD(LR)
    variables = [v for layer in layers.values() for v in layer.trainable_variables]

    @tf.function
    def step(keys, weights):
        with tf.GradientTape() as tape:
            loss = sum(tf.reduce_sum(layers[n](keys[n], training=True)[:, :2] * weights[n]) for n in layers)
        sgd.apply(tape.gradient(loss, variables), variables)

    for _ in range(12):
        keys = {n: rng.integers(0, 15, 4).astype("int64") for n in layers}
        weights = {n: rng.normal(size=(4, 2)).astype("float32") for n in layers}
        step({n: tf.constant(v) for n, v in keys.items()}, {n: tf.constant(v) for n, v in weights.items()})
        for n, ref in refs.items():
            ref.step(keys[n].tolist(), weights[n].tolist())
    for name, ref in refs.items():
        [state] = layers[name].export_state()
        held = dict(zip(state["row_keys"].tolist(), state["rows"].tolist()))
        assert set(held) == set(ref.rows), name
        for key, row in held.items():
            np.testing.assert_allclose(row, ref.rows[key], rtol=1e-5, err_msg=f"{name} key {key}")
        stats = layers[name].table_stats()[0]
        assert stats["rows"] == len(ref.rows) <= specs[name][1] and stats["clock"] == 12
    assert layers["e"].table_stats()[0]["rows"] <= 6


def test_a_key_admitted_into_a_reused_row_starts_from_its_first_row_and_slots():
    """A row freed by eviction and given to a new key: the key starts from its own first row and the
    slots' first values, not what the row held, also in a slot of an earlier optimizer that the
    current one does not update."""
    acc0, eps, momentum = 0.25, 1e-7, 0.5
    layer = DynamicEmbedding(2, capacity=4, embeddings_initializer=keras.initializers.Constant(START),
                             name="reused_rows")
    layer.build()
    ref = Reference(4, {"accumulator": acc0, "momentum": 0.0})

    def adagrad(row, slots, g):
        slots["accumulator"] = slots["accumulator"] + g * g
        return row - LR * g / np.sqrt(slots["accumulator"] + eps)

    def sgd_momentum(row, slots, g):
        slots["momentum"] = momentum * slots["momentum"] - LR * g
        return row + slots["momentum"]

    rng = np.random.default_rng(3)

    def run(optimizer, batches, rule):
        @tf.function
        def step(keys, weights):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(keys, training=True) * weights)
            optimizer.apply(tape.gradient(loss, layer.trainable_variables), layer.trainable_variables)

        for keys in batches:
            weights = rng.normal(size=(len(keys), 2))
            step(tf.constant(keys, tf.int64), tf.constant(weights, tf.float32))
            ref.step(keys, weights, rule)

    run(keras.optimizers.Adagrad(LR, initial_accumulator_value=acc0, epsilon=eps),
        [[1, 2, 3], [2, 4], [5, 6, 1], [7, 2]], adagrad)
    run(keras.optimizers.SGD(LR, momentum=momentum), [[8, 9, 7], [10, 1, 8]], sgd_momentum)

    [state] = layer.export_state()
    assert sorted(state["row_keys"].tolist()) == sorted(ref.rows)
    assert layer.table_stats()[0]["evictions"] > 0  # rows were reused
    for i, key in enumerate(state["row_keys"].tolist()):
        np.testing.assert_allclose(state["rows"][i], ref.rows[key], rtol=1e-5, err_msg=f"row of key {key}")
        for name in ("accumulator", "momentum"):
            np.testing.assert_allclose(state["slots"][name][i], ref.slots[key][name], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name} of key {key}")


def test_a_layer_called_twice_in_a_step_admits_and_updates_each_key_once():
    """One table for two inputs (user and item ids from one key space): as one call on both."""
    init = keras.initializers.Constant(START)
    twice = DynamicEmbedding(2, capacity=8, embeddings_initializer=init, name="called_twice")
    once = DynamicEmbedding(2, capacity=8, embeddings_initializer=init, name="called_once")
    for layer in (twice, once):
        layer.build()
    sgd = keras.optimizers.SGD(LR)

    @tf.function
    def step(a, b, wa, wb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(twice(a, training=True) * wa) + tf.reduce_sum(twice(b, training=True) * wb)
            loss += tf.reduce_sum(once(tf.concat([a, b], 0), training=True) * tf.concat([wa, wb], 0))
        variables = twice.trainable_variables + once.trainable_variables
        sgd.apply(tape.gradient(loss, variables), variables)

    rng = np.random.default_rng(2)
    for _ in range(6):
        a, b = (tf.constant(rng.integers(0, 10, 3), tf.int64) for _ in range(2))
        wa, wb = (tf.constant(rng.normal(size=(3, 2)), tf.float32) for _ in range(2))
        step(a, b, wa, wb)
    [got], [want] = twice.export_state(), once.export_state()
    assert sorted(got["row_keys"].tolist()) == sorted(want["row_keys"].tolist())
    rows = dict(zip(want["row_keys"].tolist(), want["rows"].tolist()))
    for key, row in zip(got["row_keys"].tolist(), got["rows"].tolist()):
        np.testing.assert_allclose(row, rows[key], rtol=1e-5)
    assert twice.table_stats()[0]["admissions"] == once.table_stats()[0]["admissions"]


def test_alike_tables_with_min_frequency_and_ttl_steps_count_and_expire_their_own_keys():
    """Two alike tables with `min_frequency` and `ttl_steps` (one group: their keys still counting
    and their expired rows split by table in one pass) end as the same two tables do trained each
    in a step of its own (a group of one): same counting keys and counters, rows, clocks."""
    init = keras.initializers.Constant(START)

    def make(name):
        layer = DynamicEmbedding(2, capacity=8, min_frequency=2, ttl_steps=3, embeddings_initializer=init, name=name)
        layer.build()
        return layer

    together, alone = [make("policy_a"), make("policy_b")], [make("policy_a_alone"), make("policy_b_alone")]

    def step_of(layers):
        sgd = keras.optimizers.SGD(LR)  # one per step: Keras ties an optimizer to its first variables
        variables = [v for layer in layers for v in layer.trainable_variables]

        @tf.function
        def step(keys, weights):
            with tf.GradientTape() as tape:
                loss = sum(tf.reduce_sum(layer(k, training=True) * w) for layer, k, w in zip(layers, keys, weights))
            sgd.apply(tape.gradient(loss, variables), variables)

        return step

    fused, solo = step_of(together), [step_of([layer]) for layer in alone]
    rng = np.random.default_rng(4)
    for _ in range(14):
        keys = [tf.constant(rng.integers(0, 12, 5), tf.int64) for _ in range(2)]
        weights = [tf.constant(rng.normal(size=(5, 2)), tf.float32) for _ in range(2)]
        fused(keys, weights)
        for step, k, w in zip(solo, keys, weights):
            step([k], [w])
    for got_layer, want_layer in zip(together, alone):
        [got], [want] = got_layer.export_state(), want_layer.export_state()
        counters = {k: c for k, c in zip(want["keys"].tolist(), want["counters"].tolist())}
        assert dict(zip(got["keys"].tolist(), got["counters"].tolist())) == counters
        rows = dict(zip(want["row_keys"].tolist(), want["rows"].tolist()))
        assert sorted(got["row_keys"].tolist()) == sorted(rows) and len(rows) < len(counters)
        for key, row in zip(got["row_keys"].tolist(), got["rows"].tolist()):
            np.testing.assert_allclose(row, rows[key], rtol=1e-5, err_msg=f"{got_layer.name} key {key}")
        got_stats, want_stats = got_layer.table_stats()[0], want_layer.table_stats()[0]
        for field in ("clock", "rows", "tracked_keys", "admissions", "evictions"):
            assert got_stats[field] == want_stats[field], (got_layer.name, field)
        assert got_stats["evictions"] > 0  # rows expired (ttl_steps) or were evicted on the way


def test_min_frequency_and_ttl_steps_read_as_without_a_capacity_also_for_keys_seen_between_expiry_and_scan():
    """A bounded table (fused admission: keys still counting written per group, stale rows freed
    under one conditional, the scan inside the admission's section) reads, in training and after
    each step, what a table without a capacity (hash tables, admission per step, its own scan)
    reads over the same stream: admitted at the 2nd sighting, expired after `ttl_steps` unseen,
    Adagrad's slots started afresh on re-admission. The stream re-sights keys after their expiry
    before a scan removed them (checked below), the case the conditional frees rows in."""
    ttl, every, steps = 16, scan_every(16), 90
    bounded = DynamicEmbedding(2, capacity=64, min_frequency=2, ttl_steps=ttl, name="policies_bounded")
    unbounded = DynamicEmbedding.from_config({**bounded.get_config(), "name": "policies_unbounded", "capacity": None})
    rng = np.random.default_rng(11)
    batches = [rng.choice(24, 3, replace=False) for _ in range(steps)]
    # Sightings of a key after its row expired (clock - last > ttl) and before a scan (clock % every == 0,
    # after the step) removed it: the stale rows the admission frees itself.
    last, stale = {}, 0
    for clock, keys in enumerate(batches, start=1):
        for key in keys.tolist():
            if key in last and clock - last[key] > ttl and not any(
                    c % every == 0 for c in range(last[key] + ttl + 1, clock)):
                stale += 1
            last[key] = clock
    assert stale > 0, "the stream must re-sight a key between its expiry and the scan"

    def step_of(layer):
        optimizer = keras.optimizers.Adagrad(LR)

        @tf.function
        def step(keys, weights):
            with tf.GradientTape() as tape:
                out = layer(keys, training=True)
                loss = tf.reduce_sum(out * weights)
            optimizer.apply(tape.gradient(loss, layer.trainable_variables), layer.trainable_variables)
            return out

        return step

    bounded_step, unbounded_step = step_of(bounded), step_of(unbounded)
    probe = tf.range(24, dtype=tf.int64)
    for index, keys in enumerate(batches):
        keys = tf.constant(keys, tf.int64)
        weights = tf.constant(rng.normal(size=(3, 2)), tf.float32)
        np.testing.assert_allclose(bounded_step(keys, weights), unbounded_step(keys, weights), rtol=1e-5,
                                   err_msg=f"training read, step {index + 1}")
        np.testing.assert_allclose(bounded(probe, training=False), unbounded(probe, training=False), rtol=1e-5,
                                   err_msg=f"inference read, step {index + 1}")
    got, want = bounded.table_stats()[0], unbounded.table_stats()[0]
    assert got["admissions"] == want["admissions"] and got["clock"] == want["clock"] == steps
    assert got["evictions"] > 0  # rows expired and were freed, by the scan or by the admission
