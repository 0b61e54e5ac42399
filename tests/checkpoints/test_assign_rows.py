"""`assign_rows`: a restore's range of rows lands on those rows only, whatever the variable's rank."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from psclient._coordinator.checkpoints.checkpoint_pieces import assign_rows

from _conversions import RemoteConversions


@pytest.mark.parametrize("shape", [(10,), (10, 3), (10, 2, 4)], ids=["rank1", "rank2", "rank3"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.int64, tf.bfloat16])
def test_a_range_is_written_into_its_rows_and_no_other(shape, dtype):
    before = np.arange(np.prod(shape)).reshape(shape)
    variable = tf.Variable(tf.constant(before, dtype))
    value = tf.constant(-1 - np.arange(4 * int(np.prod(shape[1:]))).reshape((4,) + shape[1:]), dtype)
    assign_rows(variable, 3, 7, value)
    expected = before.copy()
    expected[3:7] = value.numpy().astype(before.dtype)
    np.testing.assert_array_equal(variable.numpy().astype(before.dtype), expected)


def test_in_a_traced_function_the_rank_comes_from_the_value():
    """A table shard's restore is traced with its variable's handle: the variable's shape may be
    unknown there, and the rows' rank is the value's."""
    variable = tf.Variable(tf.zeros((6, 2)))

    @tf.function
    def restore(handle_holder, value):
        assign_rows(handle_holder, 2, 4, value)

    class Unshaped:  # what a traced shard exposes: a handle, a shape of unknown rank
        handle = variable.handle
        shape = tf.TensorShape(None)
        dtype = tf.float32

    restore(Unshaped(), tf.ones((2, 2)))
    np.testing.assert_array_equal(variable.numpy(), [[0, 0], [0, 0], [1, 1], [1, 1], [0, 0], [0, 0]])


@pytest.mark.parametrize("shape", [(10,), (10, 3)], ids=["rank1", "rank2"])
def test_no_python_value_is_converted_under_the_variables_device(shape, monkeypatch):
    """On a cluster the range is assigned under its ps's device: a Python value converted there
    (the `1` of `tf.range`'s step) is copied to the ps from inside the conversion, holding the GIL,
    and a hung ps would stop every thread of the coordinator. Here the device in force stands for
    the ps and the coordinator's constants are made with no device."""
    from psclient._coordinator.checkpoints import checkpoint_pieces

    monkeypatch.setattr(checkpoint_pieces._runtime, "coordinator_cpu", lambda: None)  # no device
    variable = tf.Variable(tf.zeros(shape))
    value = tf.ones((2,) + shape[1:])
    here = "/job:localhost/replica:0/task:0/device:CPU:0"
    with RemoteConversions(jobs=("/job:localhost",)) as seen, tf.device(here):
        assign_rows(variable, 2, 4, value)
    assert not seen.found, seen.report()
    assert variable.numpy()[2:4].tolist() == value.numpy().tolist()
