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
from typing import Any, Callable

__all__ = [
    "PerWorker",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "check_dataset_fn",
    "has_per_worker",
    "resolve_per_worker",
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

    def __iter__(self) -> "PerWorkerIterator":
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

    def __next__(self):
        raise TypeError(
            "A per-worker iterator cannot be advanced on the coordinator; pass it to "
            "strategy.schedule(fn, args=(iterator,)) and call next() inside fn."
        )


def check_dataset_fn(dataset_fn: Callable) -> None:
    """Reject a dataset function that cannot take a `tf.distribute.InputContext`."""
    if not callable(dataset_fn):
        raise TypeError(
            "Invalid value for argument `dataset_fn`. Received: "
            f"dataset_fn={dataset_fn!r} of type {type(dataset_fn).__name__}. Expected a "
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
            "Invalid value for argument `dataset_fn`. Received: a function with signature "
            f"{getattr(dataset_fn, '__name__', 'dataset_fn')}{signature}. Expected a function "
            "taking exactly one argument, the tf.distribute.InputContext (use "
            "input_context.num_input_pipelines and input_context.input_pipeline_id to shard)."
        ) from None


def has_per_worker(args: tuple, kwargs: dict) -> bool:
    import tensorflow as tf

    return any(isinstance(x, PerWorker) for x in tf.nest.flatten((args, kwargs)))


def resolve_per_worker(args: tuple, kwargs: dict, worker: int) -> tuple[tuple, dict]:
    import tensorflow as tf

    def pick(x):
        return x.value(worker) if isinstance(x, PerWorker) else x

    return tf.nest.map_structure(pick, (args, kwargs))
