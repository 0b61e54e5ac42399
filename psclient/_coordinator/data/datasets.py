"""Per-worker datasets: a dataset function traced once, run on every worker.

As TF's coordinator does, a dataset function is traced once, on the
coordinator, into a function that returns the dataset, and that function is
called on each worker's device: the dataset (and its `map` functions, traced
within) is built there, from one trace. The `InputContext` it receives has
`num_input_pipelines` = number of workers and `input_pipeline_id` = the
worker's index as a scalar int64 tensor, filled in on each call (TF's
`experimental_get_current_worker_index()`, which works inside the function
too). Creating a `tf.Variable` in it raises ValueError, as in TF.

A dataset function that cannot be traced that way (it needs the index as a
Python int, e.g. to slice a list of files, or runs eager-only code) raises a
TypeError or AttributeError while traced; it is then called once per worker,
eagerly, with the index as a Python int (psclient's behaviour before this
module; logged).

`ClusterCoordinator.create_per_worker_dataset(per_worker_dataset_fn)` traces
the user's `per_worker_dataset_fn` itself (TF's tutorial wraps
`strategy.distribute_datasets_from_function(dataset_fn)` in one): inside that
trace, the strategy's dataset calls return the dataset the traced function
should build (`dataset_in_trace`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from psclient._coordinator import runtime as _runtime
from psclient._coordinator.data.per_worker import (
    PerWorkerDataset,
    call_dataset_fn,
    check_dataset_fn,
    dataset_cloner,
    deserialize_dataset,
    refuse_variables,
    serialize_dataset,
    without_autotune_model,
)
from psclient._core.errors import PSClientError

__all__ = [
    "TracedDatasetFunction",
    "check_distributable",
    "check_not_in_function",
    "dataset_in_trace",
    "inside_per_worker_dataset_fn",
    "per_worker_datasets",
    "trace_dataset_function",
    "trace_or_fall_back",
    "tracing_per_worker_dataset_fn",
]

log = logging.getLogger("psclient")

_trace_state = threading.local()


class TracedDatasetFunction:
    """A dataset function already traced (by `trace_dataset_function`), with its name.

    `retrace()`: the same function traced anew (a new name), for a registration lost on its way.
    """

    def __init__(self, concrete, name: str, retrace: Callable[[], Any]):
        self.concrete = concrete
        self.name = name
        self.retrace = retrace


@contextlib.contextmanager
def tracing_per_worker_dataset_fn():
    """While a `per_worker_dataset_fn` is traced on this thread (see the module doc)."""
    previous = getattr(_trace_state, "active", False)
    _trace_state.active = True
    try:
        yield
    finally:
        _trace_state.active = previous


def inside_per_worker_dataset_fn() -> bool:
    return getattr(_trace_state, "active", False) and tf.inside_function()


def worker_input_context(num_workers: int):
    """The InputContext of a traced dataset function: the worker's index is filled in per call."""
    return tf.distribute.InputContext(
        num_input_pipelines=num_workers,
        input_pipeline_id=tf.distribute.coordinator.experimental_get_current_worker_index(),
        num_replicas_in_sync=num_workers,
    )


def dataset_in_trace(dataset_or_fn, num_workers: int):
    """What the strategy's dataset methods return inside a traced
    `per_worker_dataset_fn`: the dataset the traced function builds on each worker."""
    if isinstance(dataset_or_fn, tf.data.Dataset):
        if tf.is_symbolic_tensor(tf.data.experimental.to_variant(dataset_or_fn)):
            return dataset_or_fn  # made inside the trace: built on each worker as it is
        # Made on the coordinator: its graph travels, not the dataset (see dataset_cloner).
        with tf.init_scope():
            graph_def = serialize_dataset(dataset_or_fn)
        return deserialize_dataset(graph_def, dataset_or_fn.element_spec)
    check_dataset_fn(dataset_or_fn)
    return call_dataset_fn(dataset_or_fn, worker_input_context(num_workers))


def check_not_in_function(what: str) -> None:
    """Refuse `what` inside a tf.function other than a traced `per_worker_dataset_fn`."""
    if not tf.inside_function():
        return
    raise RuntimeError(
        f"{what}() was called inside a tf.function. Call it eagerly (outside any tf.function): "
        "it builds a dataset on every worker. Only the `per_worker_dataset_fn` given to "
        "ClusterCoordinator.create_per_worker_dataset may call it inside a tf.function, as in TF."
    )


def check_distributable(dataset, options) -> None:
    """The arguments of `strategy.experimental_distribute_dataset`."""
    if options is not None:
        raise ValueError(
            f"Invalid value for argument `options`. Received: options={options!r}. Expected "
            "None: psclient builds each worker's dataset on that worker, without input options."
        )
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"Invalid value for argument `dataset`. Received: dataset={dataset!r} of type "
            f"{type(dataset).__name__}. Expected a tf.data.Dataset."
        )


def trace_dataset_function(make: Callable[[], Any], name: str, argument: str = "dataset_fn"):
    """`make` traced once into a concrete function returning a dataset.

    Raises what tracing raised (a TypeError or AttributeError means: the
    function cannot be traced; callers fall back), a ValueError for a
    variable made inside, a TypeError if it does not return a dataset, and a
    ValueError if it captures a dataset made on the coordinator.
    """
    def dataset_function():
        return make()

    dataset_function.__name__ = name if name.isidentifier() else "dataset_fn"
    with refuse_variables(f"`{argument}` ({name})"), _runtime.streamed_registrations():
        concrete = tf.function(dataset_function).get_concrete_function()
    check_traced(concrete, name, argument)
    return concrete


class NotADatasetError(PSClientError, TypeError):
    """The traced function returned something else than a dataset (not a reason to fall back)."""


def check_traced(concrete, name: str, argument: str) -> None:
    output = concrete.structured_outputs
    if not isinstance(output, tf.data.Dataset):
        raise NotADatasetError(
            f"Invalid value for argument `{argument}`: the dataset function {name!r} returned an "
            f"object of type {type(output).__name__}. Expected a tf.data.Dataset."
        )
    for external, _internal in concrete.graph.captures:
        if external.dtype == tf.variant:
            raise ValueError(
                f"Invalid value for argument `{argument}`: the dataset function {name!r} uses a "
                "tf.data.Dataset made on the coordinator (outside the function). A dataset lives "
                "in the process that made it and cannot be copied to the workers (TF fails such a "
                "function at join() with \"Failed copying input tensor\"). Make the dataset inside "
                "the dataset function, or pass the dataset itself to create_per_worker_dataset / "
                "distribute_datasets_from_function: psclient then rebuilds it on every worker "
                "from its graph."
            )


def per_worker_datasets(dataset_fn, num_workers: int, *, on_new,
                        is_up: Callable[[int], bool] | None = None) -> PerWorkerDataset:
    """`dataset_fn(input_context)` (traced once), a dataset (cloned) or a
    `TracedDatasetFunction`, built on every worker."""
    element_spec = None
    if isinstance(dataset_fn, TracedDatasetFunction):
        build, name, element_spec = _TracedBuilder(dataset_fn.concrete, num_workers, dataset_fn.retrace), \
            dataset_fn.name, dataset_fn.concrete.structured_outputs.element_spec
    elif isinstance(dataset_fn, tf.data.Dataset):
        build, name, element_spec = _eager_builder(dataset_cloner(dataset_fn), num_workers), \
            "dataset", dataset_fn.element_spec
    else:
        check_dataset_fn(dataset_fn)
        name = getattr(dataset_fn, "__name__", None) or "dataset_fn"

        def make():
            return dataset_fn(worker_input_context(num_workers))

        concrete = trace_or_fall_back(make, name)
        if concrete is None:
            build = _eager_builder(dataset_fn, num_workers)
        else:
            build = _TracedBuilder(concrete, num_workers, lambda: trace_dataset_function(make, name))
            element_spec = concrete.structured_outputs.element_spec

    def make_iterator(worker: int, dataset):
        with tf.device(_runtime.worker_device(worker)):
            return iter(without_autotune_model(dataset))  # its deletion must not wait (per_worker.py)

    return PerWorkerDataset(build, num_workers, name, make_iterator=make_iterator, on_new=on_new,
                            element_spec=element_spec, is_up=is_up)


def trace_or_fall_back(make: Callable[[], Any], name: str, argument: str = "dataset_fn"):
    """`trace_dataset_function(make)`, or None if the function cannot be traced (module doc)."""
    try:
        return trace_dataset_function(make, name, argument)
    except NotADatasetError:
        raise
    except (TypeError, AttributeError) as error:
        first = str(error).splitlines()[0] if str(error) else ""
        log.info(
            "dataset function %r cannot be traced once (%s: %s); it is called on each worker "
            "instead, with the worker's index as a Python int", name, type(error).__name__, first,
        )
        return None


def _pipeline(worker: int, num_workers: int) -> int:
    """The input pipeline of `worker`: its index, or for a worker that joined after the
    dataset was made (`strategy.add_worker`), the pipeline of index modulo their number."""
    return worker % num_workers


class _TracedBuilder:
    """`build(worker)`: the traced dataset function called on the worker. `remake()`: the function
    traced anew (`retrace()`), under a new name, which TF registers afresh on every task: a
    registration lost on its way (`until_registered`) would otherwise fail every closure given
    that worker's iterator until the worker restarts."""

    def __init__(self, concrete, num_workers: int, retrace: Callable[[], Any]):
        self._concrete, self._num_workers, self._retrace = concrete, num_workers, retrace

    def __call__(self, worker: int):
        # The pipeline id the traced function reads is the dispatch context's worker index.
        with tf.device(_runtime.worker_device(worker)), \
                _runtime.worker_index_scope(_pipeline(worker, self._num_workers)):
            return self._concrete()

    def remake(self) -> None:
        self._concrete = self._retrace()


def _eager_builder(dataset_fn, num_workers: int) -> Callable[[int], Any]:
    name = getattr(dataset_fn, "__name__", None) or "dataset_fn"

    def build(worker: int):
        ctx = tf.distribute.InputContext(num_input_pipelines=num_workers,
                                         input_pipeline_id=_pipeline(worker, num_workers),
                                         num_replicas_in_sync=num_workers)
        with tf.device(_runtime.worker_device(worker)), _runtime.worker_index_scope(worker), \
                refuse_variables(f"`dataset_fn` ({name})"):
            return call_dataset_fn(dataset_fn, ctx)

    return build
