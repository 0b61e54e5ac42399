"""A dataset moved between devices: its graph serialized, rebuilt where it is needed."""

from __future__ import annotations

import hashlib
import logging
import types
import uuid

import tensorflow as tf
from tensorflow.core.framework import dataset_options_pb2

from psclient._tf.data_paths import absolute_paths
from psclient._tf.executors import streamed_registrations
from psclient._tf.local_variables import serialize_carrying

__all__ = ["calls_python", "deserialize_dataset", "fix_shuffle_orders", "make_deterministic", "serialize_dataset",
           "serialize_self_contained"]

log = logging.getLogger("psclient")

#: Dataset ops with a random order or random elements, each with the position of its (seed, seed2)
#: inputs, its attribute that draws anew each iteration (None: it has none) and the position of its
#: seed-generator resource input (a handle serialized as a constant; None: it has none).
#: `sample_from_datasets` chooses with a RandomDataset.
SEEDED_OPS = types.MappingProxyType({
    "ShuffleDataset": (2, "reshuffle_each_iteration", None),
    "ShuffleDatasetV3": (2, "reshuffle_each_iteration", 4),
    "ShuffleAndRepeatDataset": (2, "reshuffle_each_iteration", None),
    "ShuffleAndRepeatDatasetV2": (2, "reshuffle_each_iteration", 5),
    "RandomDataset": (0, None, None),
    "RandomDatasetV2": (0, "rerandomize_each_iteration", 2),
})


# A dataset is serialized on the coordinator with what TF registers meanwhile streamed (all its
# ops are local): TF runs an eager op as a function and registers each new kind of op on every
# task of the cluster with a blocking RPC, so the first `DatasetToGraphV2` waited for a hung
# worker (a Keras evaluate starting while one hung did).


def serialize_dataset(dataset):
    """The dataset's graph as a string tensor, to rebuild it on any worker (`deserialize_dataset`).

    Relative file paths in it are made absolute against this process's working
    directory (`data_paths`): a worker would look them up in its own.
    TF-internal: a dataset's graph is the only way to move it.
    """
    def serialize():
        with streamed_registrations():  # local ops only (see above `serialize_dataset`)
            return dataset._as_serialized_graph(  # noqa: SLF001
                strip_device_assignment=True,
                external_state_policy=tf.data.experimental.ExternalStatePolicy.WARN,
            )

    gone = (tf.errors.FailedPreconditionError, tf.errors.NotFoundError)
    try:
        # A variable made before the connection is looked up on the process's new device:
        # registered there again for the serialization (local_variables).
        graph = serialize_carrying(serialize, gone)
    except gone as error:
        # TF fails this way when a resource the pipeline uses is gone (made on a device that
        # no longer exists); psclient carries variables and lookup tables across the connection.
        raise ValueError(
            "Cannot send this tf.data.Dataset to the workers: TensorFlow cannot serialize its "
            f"graph ({type(error).__name__}: {str(error).splitlines()[0]}). If the pipeline uses "
            "a TF resource other than a variable or a lookup table that was made before "
            "psclient.ParameterServerStrategy(...) connected this process to the cluster, it "
            "lives on a device the process no longer has: make it (and the dataset) after "
            "creating the strategy, or pass a dataset function, fn(input_context), that makes it "
            "on each worker."
        ) from error
    serialized, changed = absolute_paths(graph.numpy())
    if not changed:
        return graph
    log.info("dataset sent to the workers with its relative paths made absolute: %s", "; ".join(changed[:5]))
    return tf.constant(serialized)


#: Ops that read or write files, or reach outside the process (a dataset that has one reads the
#: coordinator's disk, where a worker may see other files or none); besides, any op whose name
#: has "File", "Reader" or "Record" in it.
_OUTSIDE_OPS = frozenset({
    "TextLineDataset", "CSVDataset", "CSVDatasetV2", "ExperimentalCSVDataset", "LMDBDataset",
    "ExperimentalLMDBDataset", "SqlDataset", "ExperimentalSqlDataset", "LoadDataset", "SnapshotDataset",
    "SnapshotDatasetV2", "SnapshotDatasetReader", "CacheDataset", "CacheDatasetV2", "DataServiceDataset",
    "DataServiceDatasetV2", "DataServiceDatasetV3", "DataServiceDatasetV4", "SaveDataset", "SaveDatasetV2",
    "ImmutableConst",
})


def serialize_self_contained(dataset):
    """The dataset's graph as `serialize_dataset` gives it if it holds everything it yields
    (tensors in the graph, maps of them), else None: it reads files (`_OUTSIDE_OPS`) or has
    state TF cannot put in a graph (random ops in a map, a Python function)."""
    try:
        with streamed_registrations():  # local ops only (see above `serialize_dataset`)
            graph = dataset._as_serialized_graph(  # noqa: SLF001 - as serialize_dataset
                strip_device_assignment=True,
                external_state_policy=tf.data.experimental.ExternalStatePolicy.FAIL,
            )
    except (tf.errors.FailedPreconditionError, tf.errors.UnimplementedError, tf.errors.InvalidArgumentError):
        return None
    parsed = tf.compat.v1.GraphDef()
    parsed.ParseFromString(graph.numpy())
    ops = {node.op for node in parsed.node} | {
        node.op for function in parsed.library.function for node in function.node_def}
    if any(op in _OUTSIDE_OPS or any(word in op for word in ("File", "Reader", "Record")) for op in ops):
        return None
    return graph


def deserialize_dataset(graph_def, element_spec):
    """The dataset whose graph `serialize_dataset` gave, built where this runs."""
    variant = tf.raw_ops.DatasetFromGraph(graph_def=graph_def)
    return tf.data.experimental.from_variant(variant, element_spec)


def fix_shuffle_orders(serialized: bytes, seed: int, variant: int = 0) -> tuple[bytes, list[str]]:
    """The dataset graph `serialized` with every shuffle made to give one order in every copy.

    A shuffle (or a random dataset, `SEEDED_OPS`) without a seed (seed and
    seed2 the constant 0, TF's "no seed") gets seeds derived from `seed`,
    `variant` and the node's name; a seeded shuffle that reshuffled per
    iteration keeps its seeds in variant 0 and gets seeds derived from them
    and `variant` in the others (one variant per epoch: a new order each
    epoch, as reshuffling gives); every shuffle stops reshuffling per
    iteration; and each shuffle's seed generator gets a name
    of its own, so that copies rebuilt on one worker never share a generator
    with another dataset's (a worker keeps generators by name, and a shared
    one would advance from copy to copy). Returns the new graph and the ops
    changed ("op name: what"). Shuffles whose order cannot be fixed here (no
    seed inputs, or seeds computed at run time from random ops) are left
    alone: the caller checks what is left.
    """
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(serialized)
    changed: list[str] = []
    run = uuid.uuid4().hex  # generator names unique to this rewrite
    _fix_nodes(graph.node, graph.node, lambda name: name.split(":")[0].lstrip("^"), None, (seed, variant), run,
               changed)
    for function in graph.library.function:  # datasets made inside map/interleave functions
        _fix_nodes(function.node_def, function.node_def, lambda name: name.split(":")[0].lstrip("^"),
                   function.signature.name, (seed, variant), run, changed)
    return graph.SerializeToString(), changed


def _fix_nodes(nodes, container, base_name, scope, seeding, run, changed) -> None:
    by_name = {node.name: node for node in nodes}
    in_function = scope is not None
    for node in list(nodes):
        if node.op not in SEEDED_OPS:
            continue
        what = []
        first, redraws, generator = SEEDED_OPS[node.op]
        seeds = [_int_constant(by_name.get(base_name(name))) for name in node.input[first:first + 2]]
        reshuffles = redraws is not None and redraws in node.attr and node.attr[redraws].b
        base, variant = seeding
        if seeds == [0, 0] or (reshuffles and variant and None not in seeds):
            origin = f"{base}" if seeds == [0, 0] else f"{seeds[0]}/{seeds[1]}"
            digest = hashlib.sha256(f"{origin}/{variant}/{scope}/{node.name}".encode()).digest()
            for position, value in ((first, int.from_bytes(digest[:4], "little") + 1),
                                    (first + 1, int.from_bytes(digest[4:8], "little") + 1)):
                name = f"{node.name}/psclient_seed{position - first + 1}"
                const = container.add()
                const.name = name
                const.op = "Const"
                const.attr["dtype"].type = tf.int64.as_datatype_enum
                const.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, tf.int64))
                node.input[position] = f"{name}:output:0" if in_function else name
            what.append("seeded" if seeds == [0, 0] else "reseeded")
        if reshuffles:
            node.attr[redraws].b = False
            what.append(f"{redraws}=False")
        handle = by_name.get(base_name(node.input[generator])) if generator is not None \
            and generator < len(node.input) else None
        if handle is not None and handle.op == "Const" and handle.attr["value"].tensor.resource_handle_val:
            for value in handle.attr["value"].tensor.resource_handle_val:
                value.name = f"{value.name}/psclient-{run}"
        if what:
            changed.append(f"{node.op} {node.name}: {', '.join(what)}")


def _int_constant(node) -> int | None:
    """The value of a scalar integer Const node, or None."""
    if node is None or node.op != "Const" or node.attr["value"].tensor.dtype not in (3, 9):  # int32, int64
        return None
    return int(tf.make_ndarray(node.attr["value"].tensor))


def make_deterministic(serialized: bytes) -> tuple[bytes, list[str]]:
    """The dataset graph `serialized` with every op that may yield out of order made to keep order.

    `deterministic=False` on a parallel `map`, `interleave` or `batch` (and
    the legacy `parallel_interleave(sloppy=True)`) lets the op yield whichever
    element is ready first; `Options.deterministic=False` does the same for
    every such op left at its default. Here those ops get
    `deterministic="true"` (a `sloppy` attribute False) and the options
    `deterministic=True`, in the graph and in the functions it calls: the
    same elements, in the order of the data. Returns the new graph and the
    ops changed ("op name: what").
    """
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(serialized)
    changed: list[str] = []
    nodes = list(graph.node) + [node for function in graph.library.function for node in function.node_def]
    for node in nodes:
        what = []
        if "deterministic" in node.attr and node.attr["deterministic"].s == b"false":
            node.attr["deterministic"].s = b"true"
            what.append("deterministic=True")
        if "sloppy" in node.attr and node.attr["sloppy"].b:
            node.attr["sloppy"].b = False
            what.append("sloppy=False")
        if node.op == "OptionsDataset" and "serialized_options" in node.attr:
            options = dataset_options_pb2.Options()
            options.ParseFromString(node.attr["serialized_options"].s)
            if options.WhichOneof("optional_deterministic") and not options.deterministic:
                options.deterministic = True
                node.attr["serialized_options"].s = options.SerializeToString()
                what.append("options.deterministic=True")
        if what:
            changed.append(f"{node.op} {node.name}: {', '.join(what)}")
    return graph.SerializeToString(), changed


#: Ops that run a Python function of the process that made the graph.
_PYTHON_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})


def calls_python(dataset) -> bool:
    """Whether any function of `dataset`'s pipeline (or of a dataset made inside one) calls Python.

    Walks the pipeline's datasets and their traced functions (TF-internal `_inputs`,
    `_functions`): nothing is serialized, so data held in the graph is not copied.
    """
    seen, stack = set(), [dataset]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for wrapper in current._functions():  # noqa: SLF001 - a dataset op's traced functions
            graph = wrapper.function.graph.as_graph_def()
            ops = {node.op for node in graph.node}
            ops.update(node.op for function in graph.library.function for node in function.node_def)
            if ops & _PYTHON_OPS:
                return True
        stack.extend(current._inputs())  # noqa: SLF001 - the datasets this one reads
    return False
