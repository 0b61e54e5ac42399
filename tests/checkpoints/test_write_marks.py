"""Write marks (`psclient._tf.write_marks`) on a variable in this process: no cluster needed.

Which rows a write method marks, eagerly and traced; that a dense write sets the
flag; that reset clears both; that a mark in a traced function runs after its
write (what lets a checkpoint's cut trust the marks)."""

import numpy as np
import pytest
import tensorflow as tf

from psclient._tf.write_marks import attach, marks_of, unmarked

ROWS, WIDTH = 12, 3


def marked_variable():
    variable = tf.Variable(tf.zeros([ROWS, WIDTH]))
    attach(variable, lambda value, name: tf.Variable(value, trainable=False, name=name))
    return variable


def rows_marked(variable):
    return sorted(np.flatnonzero(marks_of(variable).rows.numpy()).tolist())


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_sparse_writes_mark_their_rows_and_dense_writes_the_flag(traced):
    variable = marked_variable()
    ones = tf.ones([2, WIDTH])

    def writes():
        variable.scatter_add(tf.IndexedSlices(ones, tf.constant([1, 4])))
        variable.scatter_update(tf.IndexedSlices(ones, tf.constant([4, 7], tf.int64)))
        variable.scatter_nd_sub(tf.constant([[9], [9]]), ones)
        variable.scatter_max(tf.IndexedSlices(ones, tf.constant([0, 0])))

    (tf.function(writes) if traced else writes)()
    assert rows_marked(variable) == [0, 1, 4, 7, 9]
    assert int(marks_of(variable).whole.numpy()) == 0
    np.testing.assert_array_equal(variable.numpy()[[1, 4, 7]], 1.0)  # the writes themselves happened
    (tf.function(lambda: variable.assign_add(tf.ones([ROWS, WIDTH]))) if traced else
     lambda: variable.assign_add(tf.ones([ROWS, WIDTH])))()
    assert int(marks_of(variable).whole.numpy()) == 1
    marks_of(variable).reset()
    assert rows_marked(variable) == [] and int(marks_of(variable).whole.numpy()) == 0
    variable.assign(tf.zeros([ROWS, WIDTH]), read_value=False)
    assert int(marks_of(variable).whole.numpy()) == 1


def test_a_traced_mark_runs_after_its_write():
    variable = marked_variable()

    @tf.function
    def write(rows):
        variable.scatter_add(tf.IndexedSlices(tf.ones([2, WIDTH]), rows))

    graph = write.get_concrete_function(tf.TensorSpec([2], tf.int32)).graph
    writes = [op for op in graph.get_operations() if op.type == "ResourceScatterAdd"]
    marks = [op for op in graph.get_operations() if op.type == "ResourceScatterUpdate"]
    assert len(writes) == 1 and len(marks) == 1
    assert writes[0] in upstream(marks[0])  # through a control input of the mark or of its inputs


def upstream(op):
    """Every op `op` waits for: its inputs' ops and control inputs, transitively."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for before in [t.op for t in current.inputs] + list(current.control_inputs):
            if before not in seen:
                seen.add(before)
                todo.append(before)
    return seen


def test_unmarked_variables_are_left_alone():
    variable = tf.Variable(tf.zeros([ROWS, WIDTH]))
    assert marks_of(variable) is None
    variable.scatter_add(tf.IndexedSlices(tf.ones([1, WIDTH]), tf.constant([2])))
    assert float(variable.numpy()[2, 0]) == 1.0


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_writes_made_unmarked_mark_nothing(traced):
    """A dynamic table's restore sections write under `unmarked()` (they count restores instead)."""
    variable = marked_variable()

    def writes():
        variable.scatter_add(tf.IndexedSlices(tf.ones([1, WIDTH]), tf.constant([2])))
        variable.assign(tf.zeros([ROWS, WIDTH]))

    with unmarked():
        (tf.function(writes) if traced else writes)()
    assert rows_marked(variable) == [] and int(marks_of(variable).whole.numpy()) == 0
    variable.scatter_add(tf.IndexedSlices(tf.ones([1, WIDTH]), tf.constant([5])))  # marked again outside
    assert rows_marked(variable) == [5]


def test_a_variable_of_unknown_shape_is_marked_over_the_rows_given():
    """A dynamic table's storage has no static shape: its rows are given."""
    variable = tf.Variable(tf.zeros([ROWS, WIDTH]), shape=tf.TensorShape(None))
    attach(variable, lambda value, name: tf.Variable(value, trainable=False, name=name), rows=ROWS)
    variable.scatter_update(tf.IndexedSlices(tf.ones([2, WIDTH]), tf.constant([3, 11])))
    assert marks_of(variable).rows.shape == [ROWS] and rows_marked(variable) == [3, 11]
