"""A copied table shard packed after the cut (`checkpoints.table_copy._pack`), in this process.

The stages hold a shard's storage at the cut: rows and slots of `share` rows,
each row's key, each row's last step (-1: free). Packing must give what
`DenseShard.saved` gives from the same storage: the held rows' keys (then the
keys still counting), their counters, and each row and slot stage's held rows,
in storage order: a stage whose rows are a multiple of 64 bytes moved in place
a chunk at a time (its first rows then read sharing its buffer), any other
gathered into a buffer of its own and emptied (TF would copy its first rows).
Chunks smaller than the shard here, holes everywhere, so that a chunk reads
rows past those earlier chunks wrote."""

import numpy as np
import pytest
import tensorflow as tf

from psclient._coordinator.checkpoints.table_copy import _pack

SHARE, DIM, MIN_FREQUENCY = 1000, 4, 3


@pytest.mark.parametrize("chunk,waiting_count,dim", [(1, 2, 16), (7, 2, 16), (64, 2, 16), (SHARE, 2, 16),
                                                     (7, 0, 16), (SHARE, 0, 16), (7, 2, DIM), (SHARE, 0, DIM)])
def test_pack_gives_the_held_rows_in_storage_order(chunk, waiting_count, dim):
    """With keys waiting and without (min_frequency=1: the keys are the packed row keys themselves);
    rows of 64 bytes (16 floats: packed in place) and of 16 (gathered)."""
    rng = np.random.default_rng(chunk)
    last = np.where(rng.random(SHARE) < 0.4, -1, rng.integers(0, 50, SHARE)).astype(np.int64)
    row_key = rng.integers(0, 2**40, SHARE).astype(np.int64)
    rows, slot = rng.standard_normal((SHARE, dim)).astype(np.float32), rng.random((SHARE, dim)).astype(np.float32)
    waiting_keys = np.array([7, 9], np.int64)[:waiting_count]
    waiting = np.array([[1, 40], [2, 41]], np.int64)[:waiting_count].reshape([-1, 2])
    stages = [tf.Variable(rows), tf.Variable(slot)]
    key_stage, last_stage = tf.Variable(row_key), tf.Variable(last)
    keys, counters, row_keys, (packed_rows, packed_slot) = _pack(
        stages, key_stage, last_stage, tf.constant(waiting_keys), tf.constant(waiting), MIN_FREQUENCY, chunk)

    held = np.flatnonzero(last >= 0)
    assert held[0] > 0 or held.size < SHARE  # holes before held rows: rows move
    np.testing.assert_array_equal(row_keys.numpy(), row_key[held])
    np.testing.assert_array_equal(keys.numpy(), np.concatenate([row_key[held], waiting_keys]))
    np.testing.assert_array_equal(counters.numpy(), np.concatenate(
        [np.stack([np.full(held.size, MIN_FREQUENCY), last[held]], 1), waiting]))
    np.testing.assert_array_equal(packed_rows.numpy(), rows[held])
    np.testing.assert_array_equal(packed_slot.numpy(), slot[held])
    # Gathered stages are emptied by the pack; those packed in place keep their rows (read sharing them).
    assert [int(tf.shape(v)[0]) for v in (key_stage, last_stage)] == [0, 0]
    assert [int(tf.shape(v)[0]) for v in stages] == ([SHARE, SHARE] if dim * 4 % 64 == 0 else [0, 0])


def test_pack_of_a_shard_holding_no_row():
    empty = tf.Variable(np.full(SHARE, -1, np.int64))
    keys, counters, row_keys, (packed,) = _pack(
        [tf.Variable(tf.ones([SHARE, DIM]))], tf.Variable(tf.zeros([SHARE], tf.int64)), empty,
        tf.zeros([0], tf.int64), tf.zeros([0, 2], tf.int64), 1, 64)
    assert keys.shape == [0] and counters.shape == [0, 2] and row_keys.shape == [0] and packed.shape == [0, DIM]
