"""Partitioned variables: one variable cut along axis 0 into shards on several ps tasks.

The variable itself is `psclient._tf.partitioned.PartitionedVariable` (TF's
`ShardedVariable` made usable as the value of a Keras 3 variable; see there).
Here: making one (`create_partitioned`, `cut`), the partitioner argument, and
`split_update`, which runs an optimizer's update of a partitioned variable
shard by shard on each shard's ps (see its docstring).
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from psclient._core.partitioning import AUTO_MIN_SHARD_BYTES
from psclient._tf.partitioned import PartitionedVariable, focus, is_partitioned

__all__ = ["create_partitioned", "cut", "is_partitioned", "partitioner_argument", "per_shard", "split_update"]


def create_partitioned(next_creator: Callable, kwargs: dict, parts: list, devices: list[str]):
    """Create shard `i` on `devices[i]` with initial value `parts[i]`; wrap them.

    `kwargs` are the `tf.Variable` arguments the creator received. A part is
    a tensor (see `cut`) or a zero-argument callable, which `tf.Variable`
    runs under the shard's device: its value is made on that shard's ps.
    """
    name = kwargs.get("name") or "Variable"
    shards = []
    for index, (part, device) in enumerate(zip(parts, devices)):
        shard_kwargs = dict(kwargs, initial_value=part, name=f"{name}/part_{index}")
        shard_kwargs.pop("shape", None)
        with tf.device(device):
            shards.append(next_creator(**shard_kwargs))
    return PartitionedVariable(shards, name=name)


def cut(value, ranges: list[tuple[int, int]]) -> list:
    """`value`'s rows of each range, sliced where `value` is."""
    if tf.is_symbolic_tensor(value):
        # A value computed inside a trace (an optimizer built by its first
        # step): cut it there; TF lifts each shard's initializer as it would
        # the whole one.
        return [value[start:stop] for start, stop in ranges]
    # An eager value: cut eagerly, on its own device (a value already on a
    # ps stays there; only the shards travel, ps to ps).
    with tf.init_scope(), tf.device(value.device or None):
        return [value[start:stop] for start, stop in ranges]


#: A variable of rank 2 with at least this many rows (over all its shards) is embedding-like: the
#: checkpoints' and the serving exports' deltas write only its changed rows. Below it the variable is
#: a few hundred KB at most for common widths: keeping a copy of it on its ps and diffing it saves
#: little, and a dense layer's kernel (most rows change each step) gains nothing.
ROW_DIFF_MIN_ROWS = 1024


# Keras optimizers whose update is elementwise in the variable, its slots and
# its gradient, so applying it to each shard's rows gives the update of the
# whole (not Adafactor: its factored slots average over rows and columns;
# psclient._keras.adafactor splits its update with sums from every shard).
_ELEMENTWISE_OPTIMIZERS = frozenset(
    {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "Lion", "Ftrl", "Adadelta", "Nadam"}
)


def split_update(colocate_with: Any, fn: Callable, args: tuple, run: Callable[[tuple], Any]):
    """Run an optimizer's update of a partitioned variable shard by shard, each on its ps.

    Keras applies each variable's update as `extended.update(var, fn)`, which
    psclient routes here (`psclient._coordinator.training.updates`). For a Keras
    variable whose value is a `PartitionedVariable` and an optimizer in
    `_ELEMENTWISE_OPTIMIZERS`, `fn` is traced once per shard (`run(args)`),
    under that shard's ps device, with the gradient's rows of that shard
    (sliced on the worker: only they travel) and every partitioned variable
    of the same layout (the variable and its slots) standing for its shard
    while `fn` runs. So the arithmetic, the slot reads and the writes happen
    on each shard's ps. Returns the shards' results, or None for any other
    update (not split: the caller runs it whole).
    """
    value = colocate_with if is_partitioned(colocate_with) else getattr(colocate_with, "value", None)
    if not is_partitioned(value) or value.focused is not None or not _elementwise(fn):
        return None
    results, start = [], 0
    for index, shard in enumerate(value.variables):
        stop = start + int(shard.shape[0])
        shard_args = tuple(_rows(arg, start, stop, value) for arg in args)  # on the worker
        with focus(value.layout, index), tf.device(shard.device):
            results.append(run(shard_args))
        start = stop
    return tuple(results)


def _elementwise(fn) -> bool:
    """Whether `fn` is the update of an optimizer known to be elementwise.

    Keras's update function is a closure over its optimizer (TF's autograph
    may wrap it in a closure of its own, hence the search a few levels
    deep); one not found there (another caller of `extended.update`) is not
    split.
    """
    functions, seen = [fn], set()
    for _depth in range(3):
        inner = []
        for function in functions:
            if id(function) in seen:
                continue
            seen.add(id(function))
            for cell in getattr(function, "__closure__", None) or ():
                try:
                    owner = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if hasattr(owner, "update_step") and hasattr(owner, "iterations"):
                    return type(owner).__name__ in _ELEMENTWISE_OPTIMIZERS
                if callable(owner) and hasattr(owner, "__closure__"):
                    inner.append(owner)
        functions = inner
    return False


def _rows(arg, start: int, stop: int, value):
    """`arg`'s rows start:stop if it is a gradient of `value`'s full shape, else `arg`."""
    full = value.full_shape  # not `shape`: that follows the focus
    if isinstance(arg, tf.IndexedSlices):
        rows = tf.logical_and(arg.indices >= start, arg.indices < stop)
        return tf.IndexedSlices(
            tf.boolean_mask(arg.values, rows),
            tf.boolean_mask(arg.indices, rows) - tf.cast(start, arg.indices.dtype),
            tf.constant([stop - start] + full.as_list()[1:], dtype=tf.int64),
        )
    if isinstance(arg, (tf.Tensor, tf.Variable)) and arg.shape == full:
        return arg[start:stop]
    return arg


def per_shard(grad, variable) -> list:
    """`grad`, a gradient of the whole partitioned `variable`, cut into its shards' rows."""
    pieces, start = [], 0
    for shard in variable.variables:
        stop = start + int(shard.shape[0])
        pieces.append(_rows(grad, start, stop, variable))
        start = stop
    return pieces


def partitioner_argument(variable_partitioner: Any, num_ps: int) -> Callable | None:
    """`ParameterServerStrategy(variable_partitioner=...)` with "auto" made concrete (the value
    itself is checked once, by `StrategyConfig`).

    "auto" is the default: TF's MinSizePartitioner, 128 KiB per shard at
    least, one shard per ps at most (None with a single ps task: nothing to
    split over).
    """
    if variable_partitioner != "auto":
        return variable_partitioner
    if num_ps == 1:
        return None  # one task: a split would only add ops
    return tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=AUTO_MIN_SHARD_BYTES, max_shards=num_ps)
