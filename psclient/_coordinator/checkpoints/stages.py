"""Staging variables on a ps: where a checkpoint copies a big value before its cut (`fuzzy_copy`, `table_copy`)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import tensorflow as tf

from psclient._coordinator.checkpoints import checkpoint_pieces as _pieces
from psclient._tf import variables as _variables

__all__ = ["CopyStopped", "copy_in_chunks", "emptied_on_failure", "empty", "move_rows", "new_stage"]


def new_stage(shape: list[int], dtype: Any) -> Any:
    """A variable of `shape` on the device in force, of uninitialized memory (`Empty`): its pages cost
    memory as the copy fills them."""
    value = tf.raw_ops.Empty(shape=_pieces.coordinator_constant(shape, tf.int32), dtype=dtype, init=False)
    return _variables.uncreated_variable(value, "psclient_checkpoint_stage")  # its buffer alone: written in place


def move_rows(variable: Any, stage: Any, indices: Any) -> Any:
    """Rows `indices` of `variable` into the same rows of `stage` (on their ps)."""
    return tf.raw_ops.ResourceScatterUpdate(
        resource=stage.handle, indices=indices,
        updates=tf.raw_ops.ResourceGather(resource=variable.handle, indices=indices, dtype=stage.dtype))


class CopyStopped(Exception):
    """A copy given up between two chunks (`copy_in_chunks`' `stop`): another ps's copy failed."""


def copy_in_chunks(variable: Any, stage: Any, rows: int, chunk: int,
                   stop: Callable[[], bool] | None = None) -> None:
    """Rows [0, `rows`) of `variable` into `stage`, `chunk` rows at a time (eagerly, on their ps): each
    copy holds the variable for one chunk only, so training goes on meanwhile. Raises CopyStopped
    before a chunk once `stop()` is true."""
    one = _pieces.coordinator_constant(1, tf.int64)  # (tf.range would convert its delta on the ps)
    for start in range(0, rows, chunk):
        if stop is not None and stop():
            raise CopyStopped(f"stopped at row {start} of {rows}")
        at = tf.raw_ops.Range(start=_pieces.coordinator_constant(start, tf.int64),
                              limit=_pieces.coordinator_constant(min(rows, start + chunk), tf.int64), delta=one)
        move_rows(variable, stage, at)


def empty(stage: Any) -> None:
    """Give `stage` an empty value (eagerly, on its ps): its buffer goes once no read holds it. A ps
    keeps the resources of a function's last call alive until its next call, so a stage merely
    dropped could stay whole until the next checkpoint."""
    shape = _pieces.coordinator_constant([0] + stage.shape.as_list()[1:], tf.int32)  # not converted on the ps
    tf.raw_ops.AssignVariableOp(resource=stage.handle, validate_shape=False,
                                value=tf.raw_ops.Empty(shape=shape, dtype=stage.dtype))


@contextlib.contextmanager
def emptied_on_failure() -> Iterator[list]:
    """A list for the stages made inside: if the block raises, each is emptied on its ps and the error
    goes on. A copy that fails is made again (`on_each_ps` does so for a function not registered yet)
    or given up: its stages must not stay whole on the ps (they stayed for the run: +1x a table)."""
    made: list = []
    try:
        yield made
    except BaseException:
        for stage in made:
            try:
                empty(stage)
            except tf.errors.OpError:
                pass  # its ps lost or failing: the error raised says so
        raise
