"""A copied table shard packed after the cut (`checkpoints.table_copy._pack`), in this process.

The stages hold a shard's storage at the cut: rows and slots of `share` rows,
each row's key, each row's last step (-1: free). Packing must give what
`DenseShard.saved` gives from the same storage: the held rows' keys (then the
keys still counting), their counters, and each row and slot stage's held rows,
in storage order: each row and slot stage moved in place a chunk at a time
(its first rows then read sharing its buffer), a stage whose rows are not a
multiple of 64 bytes read as two pieces (its first rows up to an aligned end,
through its flat vector; the rest copied). Chunks smaller than the shard here,
holes everywhere, so that a chunk reads rows past those earlier chunks wrote."""

import ctypes

import numpy as np
import pytest
import tensorflow as tf

from psclient._coordinator.checkpoints.table_copy import _pack

SHARE, DIM, MIN_FREQUENCY = 1000, 4, 3


def address(tensor) -> int:
    """Where `tensor`'s buffer starts (through DLPack, which shares it): equal addresses, one buffer."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    managed = get(tf.experimental.dlpack.to_dlpack(tensor), b"dltensor")
    return ctypes.cast(managed, ctypes.POINTER(ctypes.c_void_p))[0]  # DLTensor.data, its first field


@pytest.mark.parametrize("chunk,waiting_count,dim", [(1, 2, 16), (7, 2, 16), (64, 2, 16), (SHARE, 2, 16),
                                                     (7, 0, 16), (SHARE, 0, 16), (7, 2, DIM), (SHARE, 0, DIM)])
def test_pack_gives_the_held_rows_in_storage_order(chunk, waiting_count, dim):
    """With keys waiting and without (min_frequency=1: the keys are the packed row keys themselves);
    rows of 64 bytes (16 floats: one piece) and of 16 (two pieces, the first ending on 64 bytes)."""
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
    for stage, packed, expected in ((stages[0], packed_rows, rows[held]), (stages[1], packed_slot, slot[held])):
        if dim * 4 % 64 == 0:
            first = packed
            np.testing.assert_array_equal(packed.numpy(), expected)
        else:
            first, rest = packed
            assert int(first.shape[0]) == held.size - held.size % 4 and int(rest.shape[0]) == held.size % 4
            np.testing.assert_array_equal(np.concatenate([first.numpy(), rest.numpy()]), expected)
        assert address(first) == address(stage.read_value())  # the first rows are the stage's: no copy
    # The keys' and steps' stages are gathered and emptied; the rows and slots are packed in place.
    assert [int(tf.shape(v)[0]) for v in (key_stage, last_stage)] == [0, 0]
    assert [int(tf.shape(v)[0]) for v in stages] == [SHARE, SHARE]


def test_pack_of_a_shard_holding_no_row():
    empty = tf.Variable(np.full(SHARE, -1, np.int64))
    keys, counters, row_keys, (packed,) = _pack(
        [tf.Variable(tf.ones([SHARE, DIM]))], tf.Variable(tf.zeros([SHARE], tf.int64)), empty,
        tf.zeros([0], tf.int64), tf.zeros([0, 2], tf.int64), 1, 64)
    assert keys.shape == [0] and counters.shape == [0, 2] and row_keys.shape == [0]
    assert [piece.shape for piece in packed] == [[0, DIM], [0, DIM]]  # 16-byte rows: two pieces


@pytest.mark.parametrize("first_rows,rest_rows", [(6, 1), (6, 0), (0, 1), (0, 0)])
def test_a_field_in_two_pieces_is_saved_as_slices_and_read_back_whole(tmp_path, first_rows, rest_rows):
    from psclient._coordinator.checkpoints.table_copy import Split, as_slices
    from psclient._tf import checkpoints

    rows = np.arange((first_rows + rest_rows) * 3, dtype=np.float32).reshape(-1, 3)
    field = Split(tf.constant(rows[:first_rows]), tf.constant(rows[first_rows:]))
    assert field.shape == rows.shape and field.dtype == tf.float32
    names, specs, values = as_slices(["a", "t/rows", "b"], ["", "", "4 0,2"], [tf.ones([2]), field, tf.ones([2])])
    pieces = (first_rows > 0) + (rest_rows > 0)
    assert names == ["a"] + ["t/rows"] * max(pieces, 1) + ["b"] and specs[-1] == "4 0,2"
    assert specs[1:-1] == ([""] if pieces < 2 else [f"{rows.shape[0]} 3 0,{first_rows}:-", f"{rows.shape[0]} 3 {first_rows},1:-"])
    checkpoints.save(str(tmp_path / "ckpt"), names, specs, values)
    (read,) = checkpoints.restore(str(tmp_path / "ckpt"), ["t/rows"], [""], [tf.float32])
    np.testing.assert_array_equal(read.numpy(), rows)
    np.testing.assert_array_equal(field.joined().numpy(), rows)
