"""`evaluate`/`predict` data, read once on the coordinator and cut into ranges of batches.

A worker can only start in the middle of a dataset by reading everything
before it: `skip` runs the whole pipeline (file reads, parsing, maps) for each
skipped batch. Ranges rebuilt on workers therefore cost passes over the data
in proportion to their number (8 ranges of a CSV file read it 4.5 times over,
each range skipping to its start, and the coordinator read it once more to
count its batches). Read here,
every batch is made once, as Keras makes it in one process, and travels once,
to the worker that evaluates it; workers run only the model, and reading
overlaps with their work. Memory stays bounded: the caller reads a range only
when fewer than a few are in flight.

A range travels as a small dataset of its batches (a serialized graph, like
any dataset psclient sends a worker), so every element structure does:
ragged, sparse and string tensors, batches of different shapes. A range that
runs again after its worker died sends the same batches, so each example is
evaluated exactly once whatever the data's own order (a dataset that
reshuffles on every pass is evaluated in the order read here).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import tensorflow as tf

from psclient._coordinator.data.per_worker import serialize_dataset
from psclient._tf.data import serialize_self_contained
from psclient._tf.executors import streamed_registrations

__all__ = ["MIN_RANGE_BATCHES", "RANGES_PER_WORKER", "UNKNOWN_SIZE_BATCHES", "MAX_RANGE_BYTES", "cut",
           "range_sizes", "read_ranges", "whole_range"]

#: Ranges per worker for data of known size: more balances load and re-runs
#: less after a failure; fewer costs fewer closures.
RANGES_PER_WORKER = 4
#: Batches per range for data of unknown size.
UNKNOWN_SIZE_BATCHES = 16
#: The fewest batches a range of known-size data has (unless the data has
#: fewer): each range costs the coordinator a fixed time (its dataset made and
#: serialized, a closure scheduled, its metric states merged; about 25 ms of CPU
#: here), as much as a small model's step on about 16 batches. Small data so
#: goes out in one or a few ranges (docs/keras_eval.md, fixed cost).
MIN_RANGE_BATCHES = 16
#: A range closes early at this many bytes of data: one range is one message
#: to a worker, and a serialized graph must stay far below protobuf's 2 GiB.
MAX_RANGE_BYTES = 32 << 20


def range_sizes(num_batches: int | None, num_workers: int) -> Iterator[int]:
    """Batches per range: known sizes in `RANGES_PER_WORKER * num_workers` ranges
    within one batch of each other, fewer where that would leave a range under
    `MIN_RANGE_BATCHES`; unknown sizes in `UNKNOWN_SIZE_BATCHES`."""
    if num_batches is None:
        return itertools.repeat(UNKNOWN_SIZE_BATCHES)
    pieces = max(1, min(num_batches // MIN_RANGE_BATCHES, RANGES_PER_WORKER * num_workers))
    base, extra = divmod(num_batches, pieces)
    return iter([base + (i < extra) for i in range(pieces) if base + (i < extra)])


def cut(
    batches: Iterable[Any], sizes: Iterator[int], max_bytes: int, size_of: Callable[[Any], int]
) -> Iterator[list]:
    """Consecutive lists of `batches`, each of the next size in `sizes`, or
    shorter where its bytes reach `max_bytes` (the rest of that size follows
    as the next list). Reads `batches` lazily, one list at a time."""
    batches = iter(batches)
    want = 0
    while True:
        if want == 0:
            want = next(sizes, 0)
            if want == 0:
                return
        taken, total = [], 0
        for batch in itertools.islice(batches, want):
            taken.append(batch)
            total += size_of(batch)
            if total >= max_bytes:
                break
        if not taken:
            return
        want -= len(taken)
        yield taken


def read_ranges(dataset, num_batches: int | None, num_workers: int) -> Iterator[tuple[int, int, Any]]:
    """(start, count, graph) for each range of `dataset`, read here in order:
    `graph` is the serialized dataset of the range's `count` batches.

    Small data of known size that holds everything it yields (`whole_range`)
    is one range, `dataset`'s own graph: nothing is read here.
    """
    whole = whole_range(dataset, num_batches)
    if whole is not None:
        yield 0, num_batches, whole
        return
    # Reading, stacking and serializing are local ops, of kinds this process may not have run
    # yet (TF registers each new kind on every task first: a hung worker held evaluate here),
    # so each range is made with those registrations streamed; the caller's scheduling, between
    # the yields, is not (a streamed op to a task that dies waits for good).
    with streamed_registrations():
        # Prefetched: the next batches are read and parsed while this thread cuts
        # and serializes the last ones.
        ranges = cut(dataset.prefetch(tf.data.AUTOTUNE), range_sizes(num_batches, num_workers),
                     MAX_RANGE_BYTES, _nbytes)
    start = 0
    while True:
        with streamed_registrations():
            batches = next(ranges, None)
            if batches is None:
                return
            graph = serialize_dataset(_as_dataset(batches))
        yield start, len(batches), graph
        start += len(batches)


def whole_range(dataset, num_batches: int | None):
    """`dataset`'s own graph, to be read by the worker that gets it, if it is one range
    (`MIN_RANGE_BATCHES` or fewer batches, a known number), holds what it yields (no file
    reads, no state outside the graph: `serialize_self_contained`) and its graph is under
    `MAX_RANGE_BYTES`; else None.

    What that saves is evaluate's fixed cost on small data: reading each batch
    here (an eager op per batch), stacking the batches and making a new
    dataset of them (docs/keras_eval.md, fixed cost). A worker that dies
    makes the range run again from the data's start, so each example still
    counts once; the order is the data's, as Keras reads it in one process.
    """
    if num_batches is None or num_batches > MIN_RANGE_BATCHES:
        return None
    graph = serialize_self_contained(dataset)
    if graph is None or graph.shape.num_elements() != 1 or len(graph.numpy()) > MAX_RANGE_BYTES:
        return None
    return graph


def _nbytes(batch) -> int:
    total, strings = 0, []
    for tensor in tf.nest.flatten(batch, expand_composites=True):
        if tensor.dtype == tf.string:
            strings.append(tensor)
        else:
            total += tensor.shape.num_elements() * tensor.dtype.size
    if strings:
        total += int(_string_bytes()(strings))
    return total


@functools.cache
def _string_bytes():
    """The bytes of a list of string tensors, in one call (a table's many
    string columns would cost two eager ops each)."""
    def string_bytes(tensors):
        return tf.add_n([tf.reduce_sum(tf.cast(tf.strings.length(t), tf.int64)) for t in tensors])

    return tf.function(string_bytes, reduce_retracing=True, autograph=False)


def _as_dataset(batches: list):
    """A dataset of `batches`, in order.

    Runs of plain tensors with one shape are stacked into one
    `from_tensor_slices` (few ops, compact); anything else is one
    `from_tensors` per batch. The parts are joined by one
    `choose_from_datasets` rather than a chain of `concatenate`s, whose
    cost grows with its length.
    """
    parts, choices = [], []
    for _, run in itertools.groupby(batches, key=_stack_key):
        run = list(run)
        if _stack_key(run[0]) is not None:
            stacked = tf.nest.map_structure(lambda *tensors: tf.stack(tensors), *run)
            parts.append(tf.data.Dataset.from_tensor_slices(stacked))
            choices += [len(parts) - 1] * len(run)
        else:
            for batch in run:
                parts.append(tf.data.Dataset.from_tensors(batch))
                choices.append(len(parts) - 1)
    if len(parts) == 1:
        return parts[0]
    return tf.data.Dataset.choose_from_datasets(
        parts, tf.data.Dataset.from_tensor_slices(tf.constant(choices, tf.int64))
    )


def _stack_key(batch):
    """What batches must share to be stacked: structure, dtypes and shapes;
    None for a batch with a composite tensor (sparse, ragged), never stacked."""
    leaves = tf.nest.flatten(batch)
    if not all(isinstance(t, tf.Tensor) for t in leaves):
        return None
    return repr(tf.nest.map_structure(lambda _: 0, batch)), tuple((t.dtype, tuple(t.shape)) for t in leaves)
