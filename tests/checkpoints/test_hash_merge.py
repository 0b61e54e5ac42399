"""A hash shard's copy merged with its cut's reads (`checkpoints.hash_copy`), in this process.

`_positions` says where each entry of the export and of the cut's reads goes (the export's
entries of touched keys, and the cut's of keys gone, dropped); `_stitch` builds one field of
exactly the merged size: checked against the same merge in NumPy, for 8-wide rows (32 bytes:
TF would copy the first rows of a longer result), keys and counters, and for nothing left.
"""

import numpy as np
import pytest
import tensorflow as tf

from psclient._coordinator.checkpoints.hash_copy import _positions, _stitch


def merged_by_numpy(keys, values, touched, cut_values, present):
    kept = ~np.isin(keys, touched)
    return np.concatenate([values[kept], cut_values[present]])


@pytest.mark.parametrize("seed,n_keys,n_touched", [(0, 1000, 37), (1, 50, 50), (2, 1, 1), (3, 200, 0)])
def test_the_merged_fields_hold_the_kept_exports_then_the_cut_entries(seed, n_keys, n_touched):
    rng = np.random.default_rng(seed)
    keys = rng.choice(10**6, n_keys, replace=False).astype(np.int64)
    # Touched: some exported keys, some new ones; a few of them gone at the cut.
    touched = np.concatenate([rng.choice(keys, n_touched // 2, replace=False),
                              rng.integers(10**6, 2 * 10**6, n_touched - n_touched // 2)]).astype(np.int64)
    present = rng.random(touched.size) < 0.8
    counters = rng.integers(0, 9, (n_keys, 2)).astype(np.int64)
    rows = rng.standard_normal((n_keys, 8)).astype(np.float32)
    cut_counters = rng.integers(0, 9, (touched.size, 2)).astype(np.int64)
    cut_rows = rng.standard_normal((touched.size, 8)).astype(np.float32)

    to_counters, _to_rows = _positions(keys, keys, touched, present, present)
    size = int(to_counters[2])
    assert size == int((~np.isin(keys, touched)).sum() + present.sum())
    for export, at_cut in [(keys, touched), (counters, cut_counters), (rows, cut_rows)]:
        out = _stitch(tf.constant(export), tf.constant(at_cut), *to_counters)
        assert out.shape[0] == size
        np.testing.assert_array_equal(out.numpy(), merged_by_numpy(keys, export, touched, at_cut, present))


def test_a_merge_that_keeps_nothing_is_empty():
    keys = np.array([5, 6], np.int64)
    to, _ = _positions(keys, keys, keys, np.array([False, False]), np.array([False, False]))
    out = _stitch(tf.constant(np.ones([2, 8], np.float32)), tf.constant(np.ones([2, 8], np.float32)), *to)
    assert out.shape == [0, 8]
