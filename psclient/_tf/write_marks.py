"""Which rows of a big variable were written: what lets a checkpoint copy it while training goes on.

A checkpoint's cut is the moment between closures whose values it saves. A
variable updated by sparse ops (`ResourceScatter*`: an embedding table and its
optimizer's slots) is in TensorFlow's copy-on-read mode, so reading it in the
cut copies it whole there, and the pause grows with its bytes. Instead, its
rows can be copied in ranges *before* the cut, while training goes on (a
"fuzzy" copy: each range as of its own moment), and the cut then reads again
only the rows written since the copy began. That needs every write to say
which rows it wrote: `WriteMarks` keeps, beside the variable on its ps,

- `rows`: one int8 per row, set to 1 by every sparse write of those rows;
- `whole`: a scalar set to 1 by every dense write (`assign`, `assign_add`,
  `assign_sub`, `batch_scatter_update`): the cut must then read it whole.

`attach` wraps the variable's own write methods (`scatter_*`, `scatter_nd_*`,
`assign*`) on that object, so Keras's optimizers (which call them), psclient's
sparse updates and user code that calls them all mark what they write, eagerly
or traced. In a traced function the mark runs after the write (a control
dependency): a mark seen in the cut then always follows its write. Writes that
bypass the methods (raw ops on `variable.handle`, `tf.compat.v1.scatter_*`) are
not marked: `StrategyConfig(checkpoint_cut="copy")` reads every variable whole
in the cut instead (docs/fault_tolerance.md).

Cost: a mark is one more scatter (int8) on the ps per sparse write, and the
marks take one byte per row (1/128 of a 32-wide float32 row).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable

import tensorflow as tf

from psclient._tf import context as _context

__all__ = ["WriteMarks", "attach", "marking", "marks_of", "unmarked"]

_SPARSE = ("scatter_add", "scatter_sub", "scatter_update", "scatter_max", "scatter_min", "scatter_mul",
           "scatter_div")
_SPARSE_ND = ("scatter_nd_add", "scatter_nd_sub", "scatter_nd_update", "scatter_nd_max", "scatter_nd_min")
_DENSE = ("assign", "assign_add", "assign_sub", "batch_scatter_update")

#: The attribute of a marked variable that holds its WriteMarks.
_ATTRIBUTE = "_psclient_write_marks"


class WriteMarks:
    """The write marks of one variable (or shard) of rank >= 1, on its ps (see the module)."""

    __slots__ = ("rows", "whole", "__weakref__")

    def __init__(self, rows: Any, whole: Any):
        self.rows, self.whole = rows, whole

    def mark_rows(self, indices: Any, after: Any) -> None:
        indices = tf.reshape(tf.convert_to_tensor(indices), [-1])
        with _after(after), _on(self.rows):
            self.rows.scatter_update(tf.IndexedSlices(tf.ones_like(indices, dtype=tf.int8), indices))

    def mark_whole(self, after: Any) -> None:
        with _after(after), _on(self.whole):
            self.whole.assign(tf.constant(1, tf.int8), read_value=False)

    def reset(self) -> None:
        """Every mark cleared (eagerly, on their ps): writes from now on are marked again."""
        _cleared(self.rows, self.whole)

    def flags(self) -> Any:
        """int8 [whether any row is marked, whether `whole` is set], on their ps (eagerly one call)."""
        return _flags(self.rows, self.whole)

    def variables(self) -> tuple:
        return self.rows, self.whole


# Traced: their Python values (a shape, a zero) are constants of the function. Converted eagerly under
# the ps's device, TF would copy each to the ps inside the conversion, holding the GIL: a hung ps would
# then stop every thread of the coordinator (tests/_conversions.py).
@functools.partial(tf.function, autograph=False)
def _cleared(rows, whole):
    # The static shape (one trace per size): the marks of a ps just restarted hold no value yet.
    rows.assign(tf.zeros(rows.shape, tf.int8), read_value=False)
    whole.assign(tf.constant(0, tf.int8), read_value=False)


@functools.partial(tf.function, autograph=False, reduce_retracing=True)
def _flags(rows, whole):
    return tf.stack([tf.reduce_max(rows.read_value()), whole.read_value()])


def _on(mark: Any):
    """Eagerly, the mark's device. Traced, none: a graph places a write with its variable, and a
    function run on the ps itself (a table's restore section) must not name a device."""
    return tf.device(mark.device) if tf.executing_eagerly() else contextlib.nullcontext()


def _after(write: Any):
    """Control dependencies on `write` (a write method's result) in a traced function; none eagerly
    (ops then run in program order)."""
    if tf.executing_eagerly() or write is None:
        return tf.control_dependencies(None)
    op = getattr(write, "op", write)
    return tf.control_dependencies([op])


def marks_of(variable: Any) -> WriteMarks | None:
    return getattr(variable, _ATTRIBUTE, None)


def attach(variable: Any, make: Callable[[Any, str], Any], rows: int | None = None) -> WriteMarks:
    """Give `variable` write marks, made by `make(initial_value, name)` (a plain variable on
    `variable`'s ps, from a callable initial value), and wrap its write methods to set them.
    `rows`: its rows, where its shape does not say (a dynamic table's storage, of unknown shape)."""
    rows = int(variable.shape[0]) if rows is None else int(rows)
    name = variable.name.split(":")[0]
    # Callables: made where `make` puts them (the ps), eagerly even while a function is traced, from
    # tensors made eagerly too, on the coordinator's CPU (the ops copy them to the ps without the GIL;
    # a Python value converted under the ps's device is copied inside the conversion, holding it: a
    # hung ps would stop every thread of the coordinator, tests/_conversions.py).
    with tf.init_scope(), tf.device(_context.coordinator_cpu()):
        size, zero = tf.constant([rows], tf.int32), tf.constant(0, tf.int8)
    marks = WriteMarks(make(lambda: tf.raw_ops.Fill(dims=size, value=zero), f"{name}/rows_written"),
                       make(lambda: tf.identity(zero), f"{name}/written_whole"))
    setattr(variable, _ATTRIBUTE, marks)
    for method in _SPARSE:
        setattr(variable, method, _sparse(getattr(variable, method), marks, lambda delta: delta.indices))
    for method in _SPARSE_ND:
        setattr(variable, method, _sparse(getattr(variable, method), marks, lambda indices: indices[..., 0]))
    for method in _DENSE:
        setattr(variable, method, _dense(getattr(variable, method), marks))
    return marks


_unmarked = threading.local()


@contextlib.contextmanager
def unmarked():
    """Writes made (or traced) by this thread inside are not marked: for writers that say so another
    way (a dynamic table's restore sections: `DenseShard.restores`)."""
    before = getattr(_unmarked, "active", False)
    _unmarked.active = True
    try:
        yield
    finally:
        _unmarked.active = before


def marking() -> bool:
    """Whether writes made (or traced) by this thread now are marked (not inside `unmarked()`)."""
    return not getattr(_unmarked, "active", False)


def _sparse(write: Callable, marks: WriteMarks, rows_of: Callable) -> Callable:
    @functools.wraps(write)
    def method(what, *args, **kwargs):
        result = write(what, *args, **kwargs)
        if marking():
            marks.mark_rows(rows_of(what), result)
        return result
    return method


def _dense(write: Callable, marks: WriteMarks) -> Callable:
    @functools.wraps(write)
    def method(*args, **kwargs):
        result = write(*args, **kwargs)
        if marking():
            marks.mark_whole(result)
        return result
    return method
