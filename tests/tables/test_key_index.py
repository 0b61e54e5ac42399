"""The bounded tables' key -> row index and LRU selection (no cluster): sizing, tombstones under churn, reserved keys."""

import numpy as np
import pytest
import tensorflow as tf

from psclient._coordinator.tables.key_index import RESERVED_KEYS, SUBSTITUTE_KEY, KeyIndex, buckets_for


@pytest.mark.parametrize("rows, buckets", [(1, 4), (3, 4), (4, 8), (100, 128), (102, 128), (103, 256),
                                           (260_000, 524_288), (209_715, 262_144)])
def test_buckets_hold_the_rows_at_most_eighty_percent_full(rows, buckets):
    assert buckets_for(rows) == buckets
    assert rows <= 0.8 * buckets


def test_churn_keeps_the_index_exact_and_its_size_fixed():
    """Keys come and go far beyond the buckets; tombstones are cleared by rebuilds, nothing grows."""
    rows = 100
    index = KeyIndex(rows, "churn")
    buckets = int(index.buckets())
    live: dict[int, int] = {}
    free = list(range(rows))
    rng = np.random.default_rng(0)
    rebuilds = 0

    vector = tf.TensorSpec([None], tf.int64)

    @tf.function(input_signature=[vector] * 5)  # traced once: the index's graph path
    def step(new_keys, new_rows, gone, live_keys, live_rows):
        with tf.control_dependencies([index.remove(gone)]):
            rebuilt = index.rebuild_if_worn(lambda: (live_keys, live_rows))
        with tf.control_dependencies([rebuilt]):
            inserted = index.insert(new_keys, new_rows)
        with tf.control_dependencies([inserted]):
            return tf.identity(rebuilt)

    next_key = 1
    for _ in range(80):
        gone = rng.choice(sorted(live), size=20, replace=False) if len(live) >= 80 else []
        for key in gone:
            free.append(live.pop(int(key)))
        new = list(range(next_key, next_key + 20))
        next_key += 20
        places = [free.pop() for _ in new]
        rebuilds += bool(step(*(tf.constant(np.asarray(v, "int64").reshape(-1)) for v in (
            new, places, gone, list(live), [live[k] for k in live]))))
        live.update(zip(new, places))
        probe = np.array(sorted(live) + [next_key + 1, 0, -1], "int64")
        expected = [live[k] for k in sorted(live)] + [-1, -1, -1]
        assert index.lookup(tf.constant(probe)).numpy().tolist() == expected
        assert int(index.size()) == len(live)
    assert next_key > 10 * buckets  # far more keys went through than there are buckets
    assert rebuilds >= 3, rebuilds
    assert int(index.buckets()) == buckets


def test_reserved_keys_read_as_absent_and_are_not_usable():
    index = KeyIndex(8, "reserved")
    index.insert(tf.constant([5], tf.int64), tf.constant([2], tf.int64))
    keys = tf.constant([5, *RESERVED_KEYS], tf.int64)
    assert len(RESERVED_KEYS) == 3
    assert index.lookup(keys).numpy().tolist() == [2, -1, -1, -1]
    assert index.usable(keys).numpy().tolist() == [True, False, False, False]
    # The table refuses two of them; asked for, they become the third, which is never inserted.
    assert index.asked(keys).numpy().tolist() == [5, SUBSTITUTE_KEY, SUBSTITUTE_KEY, SUBSTITUTE_KEY]


def test_reset_holds_exactly_the_given_keys_growing_for_more_than_the_rows():
    index = KeyIndex(4, "reset")
    index.insert(tf.constant([1, 2], tf.int64), tf.constant([0, 1], tf.int64))
    index.remove(tf.constant([1], tf.int64))
    keys = tf.constant(np.arange(10, 40), tf.int64)
    index.reset(keys, tf.range(30, dtype=tf.int64))  # a restore of more rows than the shard's
    assert int(index.buckets()) == 64 and int(index.size()) == 30 and int(index.removed) == 0
    assert index.lookup(tf.constant([2, 10, 39], tf.int64)).numpy().tolist() == [-1, 0, 29]


def test_a_shard_too_large_for_int32_rows_is_refused():
    with pytest.raises(ValueError, match="2\\*\\*31"):
        KeyIndex(2**31, "huge")


def test_entries_are_the_held_keys_and_their_rows():
    index = KeyIndex(8, "entries")
    index.insert(tf.constant([4, 5, 6], tf.int64), tf.constant([0, 1, 2], tf.int64))
    index.remove(tf.constant([5], tf.int64))
    keys, rows = index.entries()
    assert sorted(zip(keys.numpy().tolist(), rows.numpy().tolist())) == [(4, 0), (6, 2)]


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_least_recent_selects_k_members_oldest_first_smaller_key_on_ties(k):
    from psclient._coordinator.tables.least_recent import least_recent

    keys = tf.constant([10, 11, 12, 13, 14, 15], tf.int64)
    last = tf.constant([5, 2, 2, 7, 1, 9], tf.int64)
    member = tf.constant([True, True, True, True, True, False])
    expected = [key for _, key in sorted(zip([5, 2, 2, 7, 1], [10, 11, 12, 13, 14]))][:k]
    chosen = least_recent(keys, last, member, tf.constant(k, tf.int64)).numpy()
    assert chosen.shape == (6,) and sorted(keys.numpy()[chosen].tolist()) == sorted(expected)
    for entries in (None, 6):  # under a conditional, and without (a small shard)
        traced = tf.function(least_recent)(keys, last, member, tf.constant(k, tf.int64), entries).numpy()
        assert traced.tolist() == chosen.tolist()
