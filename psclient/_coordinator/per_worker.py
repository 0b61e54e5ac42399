"""Values that exist once per worker: datasets, iterators, resources.

A `PerWorker` holds one value per worker, each built *on* that worker by a
builder function. Passed to `schedule`, it resolves to the value of whichever
worker runs the closure. Builders are kept, so a worker that comes back after
a failure gets its values rebuilt (datasets before the iterators made from
them) before it takes work again.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "PerWorker",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "call_dataset_fn",
    "check_dataset_fn",
    "dataset_cloner",
    "deserialize_dataset",
    "has_per_worker",
    "per_worker_datasets",
    "per_worker_resource",
    "resolve_per_worker",
    "serialize_dataset",
]


class PerWorker:
    """One value per worker, built by `build(worker_index)` on that worker."""

    def __init__(self, build: Callable[[int], Any], num_workers: int, name: str):
        self._build = build
        self._name = name
        self._lock = threading.Lock()
        self._values = [build(i) for i in range(num_workers)]

    @property
    def name(self) -> str:
        return self._name

    @property
    def num_workers(self) -> int:
        return len(self._values)

    def value(self, worker: int) -> Any:
        """The value that lives on worker `worker`."""
        return self._values[worker]

    @property
    def values(self) -> tuple:
        """Every worker's value, in worker order."""
        return tuple(self._values)

    def rebuild(self, worker: int) -> None:
        """Build worker `worker`'s value again (its old one died with it)."""
        value = self._build(worker)
        with self._lock:
            self._values[worker] = value

    def __repr__(self) -> str:
        return f"<psclient.PerWorker {self._name!r} on {len(self._values)} workers>"


class PerWorkerDataset(PerWorker):
    """A `tf.data.Dataset` per worker; `iter()` gives a per-worker iterator."""

    def __init__(self, build, num_workers, name, *, make_iterator: Callable[[int, Any], Any], on_new):
        super().__init__(build, num_workers, name)
        self._make_iterator = make_iterator
        self._on_new = on_new

    def __iter__(self) -> PerWorkerIterator:
        iterator = PerWorkerIterator(self, self._make_iterator)
        self._on_new(iterator)
        return iterator


class PerWorkerIterator(PerWorker):
    """An iterator per worker over that worker's dataset.

    Rebuilding a worker's iterator rebuilds its dataset first, because the
    dataset's resources died with the worker too.
    """

    def __init__(self, dataset: PerWorkerDataset, make_iterator: Callable[[int, Any], Any]):
        self._dataset = dataset
        super().__init__(
            lambda i: make_iterator(i, dataset.value(i)),
            dataset.num_workers,
            f"iter({dataset.name})",
        )

    def rebuild(self, worker: int) -> None:
        self._dataset.rebuild(worker)
        super().rebuild(worker)

    def renew(self, worker: int) -> None:
        """A new iterator over the worker's existing dataset (the old one broke, the worker did not)."""
        super().rebuild(worker)

    def __next__(self):
        raise TypeError(
            "A per-worker iterator cannot be advanced on the coordinator; pass it to "
            "strategy.schedule(fn, args=(iterator,)) and call next() inside fn."
        )


def check_dataset_fn(dataset_fn: Callable, argument: str = "dataset_fn") -> None:
    """Reject what cannot be a dataset function: not callable, or not taking one argument.

    `argument` is the name the user gave it (`dataset_fn`, or `x` in Keras's fit).
    """
    if not callable(dataset_fn):
        raise TypeError(
            f"Invalid value for argument `{argument}`. Received: "
            f"{argument}={dataset_fn!r} of type {type(dataset_fn).__name__}. Expected a "
            "tf.data.Dataset or a function input_context -> tf.data.Dataset."
        )
    try:
        signature = inspect.signature(dataset_fn)
    except (TypeError, ValueError):
        return  # builtins and C functions: let the call itself decide
    try:
        signature.bind(object())
    except TypeError:
        raise TypeError(
            f"Invalid value for argument `{argument}`. Received: a function with signature "
            f"{getattr(dataset_fn, '__name__', 'dataset_fn')}{signature}. Expected a function "
            "taking exactly one argument, the tf.distribute.InputContext (use "
            "input_context.num_input_pipelines and input_context.input_pipeline_id to shard), "
            "and returning a tf.data.Dataset."
        ) from None


def call_dataset_fn(dataset_fn: Callable, input_context, argument: str = "dataset_fn"):
    """`dataset_fn(input_context)`, which must be a `tf.data.Dataset`."""
    import tensorflow as tf

    dataset = dataset_fn(input_context)
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"Invalid value for argument `{argument}`: the dataset function returned an "
            f"object of type {type(dataset).__name__}. Expected a tf.data.Dataset."
        )
    return dataset


def has_per_worker(args: tuple, kwargs: dict) -> bool:
    import tensorflow as tf

    return any(isinstance(x, PerWorker) for x in tf.nest.flatten((args, kwargs)))


def resolve_per_worker(args: tuple, kwargs: dict, worker: int) -> tuple[tuple, dict]:
    import tensorflow as tf

    def pick(x):
        return x.value(worker) if isinstance(x, PerWorker) else x

    return tf.nest.map_structure(pick, (args, kwargs))


def per_worker_datasets(dataset_fn, num_workers: int, *, on_new) -> PerWorkerDataset:
    """`dataset_fn(input_context)` (or a dataset, cloned) built on every worker."""
    import tensorflow as tf

    from psclient._coordinator import runtime as _runtime

    if isinstance(dataset_fn, tf.data.Dataset):
        build_dataset, name = dataset_cloner(dataset_fn), "dataset"
    else:
        check_dataset_fn(dataset_fn)
        build_dataset = dataset_fn
        name = getattr(dataset_fn, "__name__", "dataset_fn")

    def build(worker: int):
        ctx = tf.distribute.InputContext(
            num_input_pipelines=num_workers, input_pipeline_id=worker, num_replicas_in_sync=num_workers
        )
        with tf.device(_runtime.worker_device(worker)):
            return call_dataset_fn(build_dataset, ctx)

    def make_iterator(worker: int, dataset):
        with tf.device(_runtime.worker_device(worker)):
            return iter(dataset)

    return PerWorkerDataset(build, num_workers, name, make_iterator=make_iterator, on_new=on_new)


def per_worker_resource(fn: Callable[[], Any], num_workers: int) -> PerWorker:
    """`fn()` called on every worker's device."""
    import tensorflow as tf

    from psclient._coordinator import runtime as _runtime

    if not callable(fn):
        raise TypeError(
            f"Invalid value for argument `fn`. Received: fn={fn!r} of type "
            f"{type(fn).__name__}. Expected a function returning the worker's resource."
        )

    def build(worker: int):
        with tf.device(_runtime.worker_device(worker)):
            return fn()

    return PerWorker(build, num_workers, getattr(fn, "__name__", "resource"))


def dataset_cloner(dataset) -> Callable:
    """A dataset function that rebuilds `dataset` on whichever device is in force.

    A dataset made on the coordinator lives there: an iterator made from it
    under a worker's device would still read on the coordinator. So the
    dataset's graph is serialized once and re-created on each worker.
    """
    graph_def, spec = serialize_dataset(dataset), dataset.element_spec

    def clone(_input_context):
        return deserialize_dataset(graph_def, spec)

    return clone


def serialize_dataset(dataset):
    """The dataset's graph as a string tensor, to rebuild it on any worker (`deserialize_dataset`)."""
    import tensorflow as tf

    return dataset._as_serialized_graph(  # TF-internal, the only way to move a dataset
        strip_device_assignment=True,
        external_state_policy=tf.data.experimental.ExternalStatePolicy.WARN,
    )


def deserialize_dataset(graph_def, element_spec):
    """The dataset whose graph `serialize_dataset` gave, built where this runs."""
    import tensorflow as tf

    variant = tf.raw_ops.DatasetFromGraph(graph_def=graph_def)
    return tf.data.experimental.from_variant(variant, element_spec)
