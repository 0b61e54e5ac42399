"""`ClusterCoordinator`: TF's coordinator API on top of psclient.

Code written for `tf.distribute.coordinator.ClusterCoordinator` (for example
the custom-loop part of TF's parameter-server tutorial) runs by changing the
import and the strategy constructor. Everything is delegated to the strategy;
`schedule` returns a `psclient.Future`, which also answers TF's
`RemoteValue.fetch()` and `.get()`.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable

from psclient._coordinator.per_worker import PerWorker, PerWorkerDataset
from psclient._coordinator.strategy import ParameterServerStrategy
from psclient._core.future import Future

__all__ = ["ClusterCoordinator"]

_lock = threading.Lock()


class ClusterCoordinator:
    """Drop-in for `tf.distribute.coordinator.ClusterCoordinator`."""

    def __new__(cls, strategy: ParameterServerStrategy):
        # As TF's: one coordinator per strategy; a second call returns the first.
        with _lock:
            existing = getattr(strategy, "_cluster_coordinator", None)
            if isinstance(existing, cls):
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
        # The strategy holds its coordinator (a reference cycle, as in TF):
        # when both are dropped, gc collects them and the strategy's finalizer
        # stops its threads.
        with _lock:
            strategy._cluster_coordinator = self

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
        import tensorflow as tf

        return tf.nest.map_structure(lambda x: x.result() if isinstance(x, Future) else x, val)

    def create_per_worker_dataset(self, dataset_fn) -> PerWorkerDataset:
        """Per-worker datasets, from any of the forms TF's coordinator accepts.

        `dataset_fn` may be a `tf.data.Dataset`, a function of the
        `InputContext`, a function of no arguments returning a dataset, or the
        result of `strategy.distribute_datasets_from_function`.
        """
        import tensorflow as tf

        if isinstance(dataset_fn, PerWorkerDataset):
            return dataset_fn
        # TF's tutorial wraps the dataset function in tf.function; TF's
        # coordinator runs it on each worker, psclient runs the Python function.
        dataset_fn = getattr(dataset_fn, "python_function", dataset_fn)
        if callable(dataset_fn) and not isinstance(dataset_fn, tf.data.Dataset) and _takes_no_args(dataset_fn):
            made = dataset_fn()
            if isinstance(made, PerWorkerDataset):
                return made
            return self._strategy.distribute_datasets_from_function(lambda _ctx: dataset_fn())
        return self._strategy.distribute_datasets_from_function(dataset_fn)

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
