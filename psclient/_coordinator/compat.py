"""`ClusterCoordinator`: TF's coordinator API on top of psclient.

Code written for `tf.distribute.coordinator.ClusterCoordinator` (for example
the custom-loop part of TF's parameter-server tutorial) runs by changing the
import and the strategy constructor. Everything is delegated to the strategy;
`schedule` returns a `psclient.Future`, which also answers TF's
`RemoteValue.fetch()` and `.get()`.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator.data.datasets import (
    TracedDatasetFunction,
    trace_dataset_function,
    trace_or_fall_back,
    tracing_per_worker_dataset_fn,
)
from psclient._coordinator.data.per_worker import PerWorker, PerWorkerDataset, refuse_variables
from psclient._coordinator.strategy import ParameterServerStrategy
from psclient._core.future import Future

__all__ = ["ClusterCoordinator"]

class ClusterCoordinator:
    """Drop-in for `tf.distribute.coordinator.ClusterCoordinator`."""

    def __new__(cls, strategy: ParameterServerStrategy):
        # As TF's: one coordinator per strategy; a second call returns the first (the strategy's
        # parts hold it weakly).
        if isinstance(strategy, ParameterServerStrategy):
            facades = strategy.parts.facades
            with facades.lock:
                existing = facades.coordinator()
                if existing is not None:
                    return existing
        return super().__new__(cls)

    def __init__(self, strategy: ParameterServerStrategy):
        if getattr(self, "_strategy", None) is not None:
            return  # the strategy's existing coordinator
        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(
                "Invalid value for argument `strategy`. Received: "
                f"{type(strategy).__name__}. Expected a psclient.ParameterServerStrategy "
                "(TF's own strategy works only with TF's own coordinator)."
            )
        self._strategy = strategy
        facades = strategy.parts.facades
        with facades.lock:
            facades.coordinator = weakref.ref(self)

    @property
    def strategy(self) -> ParameterServerStrategy:
        return self._strategy

    def schedule(self, fn: Callable, args=None, kwargs=None) -> Future:
        return self._strategy.schedule(fn, args=() if args is None else args, kwargs=kwargs)

    def join(self) -> None:
        self._strategy.join()

    def done(self) -> bool:
        return self._strategy.done()

    def fetch(self, val: Any) -> Any:
        """Values of a future, or of a nested structure of futures, as numpy."""
        return tf.nest.map_structure(lambda x: x.result() if isinstance(x, Future) else x, val)

    def create_per_worker_dataset(self, dataset_fn) -> PerWorkerDataset:
        """Per-worker datasets, from any of the forms TF's coordinator accepts.

        `dataset_fn` may be a `tf.data.Dataset` (cloned to every worker), a
        function of no arguments returning a dataset (TF's form; it may call
        `strategy.distribute_datasets_from_function(fn)` or
        `strategy.experimental_distribute_dataset(ds)`, as TF's tutorial
        does), a function of the `InputContext`, or the result of
        `strategy.distribute_datasets_from_function`. A function is traced
        once, as TF does, and the traced function builds the dataset on each
        worker (see `psclient._coordinator.data.datasets`).
        """
        if isinstance(dataset_fn, PerWorkerDataset):
            return dataset_fn
        if isinstance(dataset_fn, tf.data.Dataset):
            return self._strategy.distribute_datasets_from_function(dataset_fn)
        # TF's tutorial wraps the dataset function in tf.function: psclient
        # traces the Python function itself (once, with its own checks).
        python_fn = getattr(dataset_fn, "python_function", dataset_fn)
        if not (callable(python_fn) and _takes_no_args(python_fn)):
            return self._strategy.distribute_datasets_from_function(python_fn)
        name = getattr(python_fn, "__name__", None) or "dataset_fn"
        with tracing_per_worker_dataset_fn():
            concrete = trace_or_fall_back(python_fn, name)
        if concrete is not None:
            def retrace():
                with tracing_per_worker_dataset_fn():
                    return trace_dataset_function(python_fn, name)

            return self._strategy.distribute_datasets_from_function(TracedDatasetFunction(concrete, name, retrace))
        # Not traceable (module doc of datasets.py): called once, eagerly.
        with refuse_variables(f"`dataset_fn` ({name})"):
            made = python_fn()
        if isinstance(made, PerWorkerDataset):
            return made
        if not isinstance(made, tf.data.Dataset):
            raise TypeError(
                f"Invalid value for argument `dataset_fn`: the dataset function {name!r} returned "
                f"an object of type {type(made).__name__}. Expected a tf.data.Dataset (or the "
                "result of strategy.distribute_datasets_from_function)."
            )
        return self._strategy.distribute_datasets_from_function(made)

    def create_per_worker_resources(self, fn: Callable[[], Any]) -> PerWorker:
        return self._strategy.create_per_worker_resource(fn)


def _takes_no_args(fn: Callable) -> bool:
    try:
        inspect.signature(fn).bind()
    except TypeError:
        return False
    except ValueError:  # no signature available
        return False
    return True
