"""A finite dataset of unknown size as shards of its batches: each batch once per epoch.

TF cannot tell the cardinality of a dataset after a `filter`, or of CSV files
read by `make_csv_dataset(num_epochs=1)`; Keras in one process simply reads it
to its end. On a cluster, psclient counts its batches once, here on the
coordinator (one pass over the data), and cuts the count into ranges of
batches: each range is a shard of a `ShardedDataset` whose `make_dataset`
rebuilds the dataset on the worker from its graph and takes
`skip(start).take(end - start)`. Skipping reads the batches before `start`
again, so a shard late in the data costs more to start; with a few shards per
worker that is a few passes over the data per epoch, spread over the workers.

That is exact only if every copy of the dataset yields its batches in the same
order. A `shuffle` without a seed or that reshuffles each iteration (the
defaults of `Dataset.shuffle` and `make_csv_dataset`: its seed generator
advances from copy to copy), and likewise the random choices of
`sample_from_datasets` or `Dataset.random`, would give each copy its own order, so shards
would overlap and miss batches: psclient rewrites such shuffles in the
dataset's graph (`psclient._tf.data.fix_shuffle_orders`) to a fixed seed that
does not reshuffle, so every copy has one order (the shard order is shuffled
per epoch instead). Likewise a parallel `map`, `interleave` or `batch` with
`deterministic=False` (or `Options.deterministic=False`), which yields whichever
element is ready first, is rewritten to keep the data's order
(`psclient._tf.data.make_deterministic`). The cost: such an op holds back the
elements that finish early until the ones before them are done, so a pipeline
whose elements take uneven times runs slower (docs/keras.md says how much). The
epoch's batches are the same; only when each arrives changes.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from psclient._coordinator.data.per_worker import deserialize_dataset, serialize_dataset
from psclient._tf.data import SEEDED_OPS, fix_shuffle_orders, make_deterministic
from psclient._coordinator.data.shards import ShardedDataset, range_shards
from psclient._core.errors import PSClientError

__all__ = ["NondeterministicDatasetError", "is_finite_of_unknown_size", "sharded_from_dataset"]

log = logging.getLogger("psclient")

#: The seed of shuffles that had none (one order in every copy and every run); epoch e uses
#: variant e % SHUFFLE_EPOCHS of the rewritten graph (`fix_shuffle_orders`).
SHUFFLE_SEED = 0
#: Distinct shuffle orders, epoch after epoch: one graph of the dataset each, so only for a
#: graph under SMALL_GRAPH bytes (a file reader, not data held in the graph); else one order.
SHUFFLE_EPOCHS = 8
SMALL_GRAPH = 1 << 20

#: Shards per worker: enough for late binding to balance a slow worker, few enough
#: that the skips stay cheap.
SHARDS_PER_WORKER = 4


class NondeterministicDatasetError(PSClientError, ValueError):
    """A dataset whose copies would yield batches in different orders."""


def is_finite_of_unknown_size(x) -> bool:
    return isinstance(x, tf.data.Dataset) and int(x.cardinality()) == tf.data.UNKNOWN_CARDINALITY


def sharded_from_dataset(dataset, num_workers: int) -> ShardedDataset:
    """`dataset` (finite, of unknown size) as a ShardedDataset of ranges of its batches."""
    original, ordered = make_deterministic(serialize_dataset(dataset).numpy())
    if ordered:
        log.info("fit: a dataset of unknown size: its parallel ops made to keep the data's order on every "
                 "worker (%s)", "; ".join(ordered))
    serialized, changed = fix_shuffle_orders(original, SHUFFLE_SEED)
    _refuse_nondeterministic(serialized)
    orders = 1
    if changed:
        orders = SHUFFLE_EPOCHS if len(serialized) < SMALL_GRAPH else 1
        log.info("fit: a dataset of unknown size: its shuffles given one order on every worker, %s (%s)",
                 f"a new one for each of {orders} epochs in turn" if orders > 1 else "the same every epoch",
                 "; ".join(changed))
    # One graph per epoch's order: every copy of epoch e is the same, epoch after epoch they differ.
    graphs = tf.constant([serialized] + [fix_shuffle_orders(original, SHUFFLE_SEED, k)[0] for k in range(1, orders)])
    log.info("fit: a dataset of unknown size and no steps_per_epoch: counting its batches on the coordinator")
    count = int(dataset.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
    if count == 0:
        raise ValueError("Invalid value for argument `x`. Received: a dataset that yields no batches. "
                         "Expected at least one batch.")
    size = -(-count // (SHARDS_PER_WORKER * num_workers))
    log.info("fit: a dataset of unknown size: counted %d batches on the coordinator; %d shards of %d batches",
             count, -(-count // size), size)
    spec = dataset.element_spec

    def make_dataset(shard):
        graph = graphs[0] if orders == 1 else tf.gather(graphs, tf.math.floormod(shard.epoch, orders))
        return deserialize_dataset(graph, spec).skip(shard.start).take(shard.end - shard.start)

    # The shard order is shuffled per epoch (seeded), in place of the dataset's own shuffle.
    return ShardedDataset(range_shards(count, size), make_dataset, seed=0)


def _refuse_nondeterministic(serialized: bytes) -> None:
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(serialized)
    nodes = {node.name: node for node in graph.node}
    for function in graph.library.function:  # datasets made inside map/interleave functions
        for node in function.node_def:
            nodes.setdefault(f"{function.signature.name}/{node.name}", node)
    for node in nodes.values():
        if node.op == "RepeatDataset" and _constant(nodes, node.input[1]) == -1:
            raise ValueError(
                "Invalid value for argument `steps_per_epoch`. Received: steps_per_epoch=None with a "
                "dataset of unknown size that repeats forever (repeat() before a filter or similar). "
                "Expected an integer >= 1, or data that ends: psclient would count its batches forever."
            )
        if node.op in SEEDED_OPS and (_redraws(node) or _unseeded(node, nodes)):
            # What fix_shuffle_orders could not fix (it fixes every seed given as a constant).
            received = "seed=None" if _unseeded(node, nodes) else "a new order every iteration"
            raise NondeterministicDatasetError(
                f"Invalid value for argument `x`: a dataset of unknown size with a `{node.op}` that gives "
                f"every copy its own order. Received: {received}. Expected no shuffle "
                "(make_csv_dataset(..., shuffle=False)) or shuffle(..., seed=N, "
                "reshuffle_each_iteration=False): psclient rebuilds the dataset on every worker and takes "
                "a different range of batches from each copy, which is exact only when every copy has the "
                "same order. Its shards are handed out in a new order every epoch instead."
            )


def _redraws(node) -> bool:
    attribute = SEEDED_OPS[node.op][1]
    return attribute is not None and attribute in node.attr and node.attr[attribute].b


def _unseeded(node, nodes) -> bool:
    """Whether a shuffle's (or random dataset's) seed and seed2 inputs are both the constant 0
    (TF's "no seed"); computed seeds are not the default."""
    first = SEEDED_OPS[node.op][0]
    return [_constant(nodes, name) for name in node.input[first:first + 2]] == [0, 0]


def _constant(nodes, name: str) -> int | None:
    """The value of the scalar integer constant feeding input `name`, or None."""
    const = nodes.get(name.split(":")[0].lstrip("^"))
    if const is None or const.op != "Const" or const.attr["value"].tensor.dtype not in (3, 9):  # int32, int64
        return None
    return int(tf.make_ndarray(const.attr["value"].tensor))
