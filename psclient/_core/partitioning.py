"""How a partitioned variable is cut and where its shards go. Pure logic.

A partitioner (TF's `MinSizePartitioner`, `MaxSizePartitioner`,
`FixedShardsPartitioner`, or any callable with their contract) maps a
variable's shape and dtype to a number of shards per axis, e.g. `[2, 1]`.
psclient splits along axis 0 only, like TF's `ShardedVariable`:

- `shard_count` checks what the partitioner returned and says clearly, naming
  the variable, what was received and what was expected, when it is unusable.
  Variables that cannot be split (a scalar, an unknown shape, axis 0 of size
  0 or 1) are never offered to the partitioner: they stay whole.
- `row_ranges` cuts the rows as TF does: the first `rows % shards` shards get
  one row more than the others.
- `shard_tasks` puts shard `i` on ps task `(first + i) % num_ps`. The first
  task is chosen by the byte-balancing `Placer`; the rest follows, so a
  variable created "colocated with" a partitioned one (an optimizer slot,
  which asks for the task of the reference's first shard) gets every shard
  beside the reference's shard of the same rows.
- `min_size_shards` is the arithmetic of TF's `MinSizePartitioner`, used by
  tests and the documented recommendation.

The default (`variable_partitioner="auto"`) is TF's `MinSizePartitioner` with
`AUTO_MIN_SHARD_BYTES` and at most one shard per ps task: a variable of at
most that size stays whole, a larger one is split across up to `num_ps` tasks.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from psclient._core.errors import PSClientError

__all__ = [
    "AUTO_MIN_SHARD_BYTES", "PartitionError", "can_split", "check_partitioner", "min_size_shards", "row_ranges",
    "shard_count", "shard_tasks",
]

# "auto": variables of more than 128 KiB are split. Small enough that a model's
# big kernels and tables spread over the ps tasks (the 2-ps model of benchmarks/partitioning.py
# is balanced within 1.07x by bytes), large enough that biases, small kernels
# and optimizer scalars stay whole (one variable, one read).
AUTO_MIN_SHARD_BYTES = 128 << 10


class PartitionError(PSClientError, ValueError):
    """A partitioner's answer that cannot be used for a variable."""


def check_partitioner(variable_partitioner: Any) -> None:
    """`variable_partitioner=`: "auto", None or a callable (shape, dtype) -> shards per axis."""
    if isinstance(variable_partitioner, str) and variable_partitioner != "auto":
        raise ValueError(
            "Invalid value for argument `variable_partitioner`. Received: "
            f"variable_partitioner={variable_partitioner!r}. Expected \"auto\" (the default), "
            "None (no partitioning) or a callable (shape, dtype) -> shards per axis."
        )
    if not (variable_partitioner is None or isinstance(variable_partitioner, str) or callable(variable_partitioner)):
        raise TypeError(
            "Invalid value for argument `variable_partitioner`. Received: "
            f"variable_partitioner={variable_partitioner!r} of type "
            f"{type(variable_partitioner).__name__}. Expected \"auto\" (the default), None (no "
            "partitioning) or a callable (shape, dtype) -> shards per axis, e.g. "
            "tf.distribute.experimental.partitioners.MinSizePartitioner(...)."
        )


def can_split(shape: Sequence[int | None] | None) -> bool:
    """Whether a variable of `shape` can be cut along axis 0 at all."""
    return shape is not None and len(shape) >= 1 and all(d is not None for d in shape) and shape[0] >= 2


def shard_count(name: str, shape: Sequence[int], result) -> int:
    """The number of shards along axis 0 that `result` (a partitioner's answer) asks for.

    `result` must be a sequence of positive integers, one per axis of
    `shape`, every one but the first equal to 1, and the first at most the
    number of rows.
    """
    shape = tuple(shape)
    expected = (
        f"Expected a list of {len(shape)} positive integers (shards per axis of shape {list(shape)}), "
        "only the first (axis 0) above 1 and at most the number of rows, e.g. "
        f"{[2] + [1] * (len(shape) - 1)}."
    )
    try:
        counts = [operator.index(c) for c in result]
    except TypeError:  # operator.index's message names no variable; ours says what was expected
        raise PartitionError(
            f"The variable_partitioner returned an invalid partition for variable {name!r}. "
            f"Received: {result!r} of type {type(result).__name__}. {expected}"
        ) from None
    problem = None
    if len(counts) != len(shape):
        problem = f"{len(counts)} numbers for a variable of rank {len(shape)}"
    elif any(c < 1 for c in counts):
        problem = "a number below 1"
    elif any(c != 1 for c in counts[1:]):
        problem = "more than 1 shard along an axis other than 0 (psclient splits along axis 0 only)"
    elif counts[0] > shape[0]:
        problem = f"{counts[0]} shards for {shape[0]} rows"
    if problem:
        raise PartitionError(
            f"The variable_partitioner returned an invalid partition for variable {name!r} of shape "
            f"{list(shape)}: {problem}. Received: {list(counts)}. {expected}"
        )
    return counts[0]


def row_ranges(rows: int, shards: int) -> list[tuple[int, int]]:
    """`(start, stop)` of each shard's rows; the first `rows % shards` get one more."""
    if not 1 <= shards <= rows:
        raise ValueError(
            f"Invalid value for argument `shards`. Received: shards={shards!r} for rows={rows!r}. "
            "Expected an integer between 1 and the number of rows."
        )
    base, extra = divmod(rows, shards)
    ranges, start = [], 0
    for index in range(shards):
        stop = start + base + (1 if index < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def shard_tasks(first: int, shards: int, num_ps: int) -> list[int]:
    """The ps task of each shard: consecutive tasks from `first`, wrapping around."""
    if not 0 <= first < num_ps:
        raise ValueError(
            f"Invalid value for argument `first`. Received: first={first!r}. "
            f"Expected a ps task index in 0..{num_ps - 1}."
        )
    return [(first + index) % num_ps for index in range(shards)]


def min_size_shards(shape: Sequence[int], itemsize: int, min_shard_bytes: int, max_shards: int) -> int:
    """TF's `MinSizePartitioner` along axis 0: ceil(bytes / `min_shard_bytes`), capped.

    Capped by `max_shards` and the number of rows. Like TF, it rounds up: a
    variable of more than `min_shard_bytes` gets at least two shards (when
    allowed), which may then each be smaller than `min_shard_bytes`.
    """
    shape = tuple(shape)
    total = itemsize
    for dim in shape:
        total *= dim
    wanted = -(-total // min_shard_bytes)  # ceil
    return max(1, min(max_shards, wanted, shape[0] if shape else 1))
