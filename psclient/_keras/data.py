"""What `model.fit/evaluate/predict` accept as data on a cluster, and how it gets there.

Training data goes to every worker as a per-worker dataset (`fit`), and
evaluation/prediction data as one finite dataset that closures cut into
contiguous ranges of batches (`evaluate`, `predict`). Arrays are batched by
Keras's own data adapter, so `batch_size`, `shuffle`, `sample_weight` and
`class_weight` mean what they mean in Keras. Inputs made in this process's
Python (generators, `keras.utils.PyDataset`, datasets that call Python) cannot
run on a worker: evaluate and predict read every input here anyway, and fit
reads those here (`psclient._keras.host_data`).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import tensorflow as tf

from psclient._coordinator.data.per_worker import call_dataset_fn, check_dataset_fn
from psclient._tf.executors import streamed_function_registrations, streamed_registrations

__all__ = [
    "finite_dataset",
    "is_dataset_fn",
    "is_python_made",
    "local_adapter",
    "per_worker_adapter",
    "training_data",
    "validation_adapter",
]


def is_python_made(x: Any) -> bool:
    """A Python generator or a `keras.utils.PyDataset`: data whose every batch Python makes."""
    import keras

    return isinstance(x, (types.GeneratorType, keras.utils.PyDataset))


def is_dataset_fn(x: Any) -> bool:
    """A callable that is not itself data: psclient's dataset-function input."""
    return callable(x) and not isinstance(x, (tf.data.Dataset, type)) and not is_python_made(x)


def _refuse_extras(argument: str, **given: Any) -> None:
    for name, value in given.items():
        if value is not None:
            raise ValueError(
                f"Invalid value for argument `{name}`. Received: {name} of type "
                f"{type(value).__name__} together with a dataset function as `{argument}`. "
                f"Expected None: the dataset function's elements carry it."
            )


def _per_worker(strategy, dataset_or_fn):
    """`strategy.distribute_datasets_from_function(dataset_or_fn)` as Keras's adapter, the
    dataset function's trace registered on the workers without waiting for a hung one.

    Only function registrations are streamed: a dataset function that cannot be traced
    builds its datasets on the workers at once, with ops that must fail if a worker died.
    (A traced one, or a dataset, is built on each worker by its first closure.)
    """
    with streamed_function_registrations():
        return per_worker_adapter(strategy.distribute_datasets_from_function(dataset_or_fn))


def training_data(
    strategy, x, y, sample_weight, batch_size, shuffle, class_weight, steps_per_epoch
) -> tuple[Any, int]:
    """`fit`'s data as a per-worker dataset, and the steps of one epoch.

    Every worker's dataset is repeated, so no worker runs dry in the middle of
    an epoch: an epoch is `steps_per_epoch` steps taken from whichever workers
    are free. Without `steps_per_epoch`, finite data gives one epoch per
    `cardinality` batches; data of infinite or unknown size needs it.
    """
    from keras.src.trainers.data_adapters import get_data_adapter

    _check_steps("steps_per_epoch", steps_per_epoch)
    if is_dataset_fn(x):
        check_dataset_fn(x, "x")
        _refuse_extras("x", y=y, sample_weight=sample_weight, class_weight=class_weight)
        if steps_per_epoch is None:
            raise ValueError(_steps_required("steps_per_epoch", "a dataset function as `x`"))

        def per_worker(ctx):
            return call_dataset_fn(x, ctx, "x").repeat()

        return _per_worker(strategy, per_worker), steps_per_epoch
    # Keras's adapter and the dataset's size run eager ops here, on the coordinator only.
    with streamed_registrations():
        adapter = get_data_adapter(
            x=x, y=y, sample_weight=sample_weight, batch_size=batch_size,
            steps_per_epoch=steps_per_epoch, class_weight=class_weight,
            # Only arrays are shuffled by Keras (a dataset shuffles itself).
            shuffle=shuffle and not isinstance(x, tf.data.Dataset),
        )
        # A dataset is cloned onto each worker; repeat it there so that workers,
        # which take steps at their own pace, never run out within an epoch.
        dataset = adapter.get_tf_dataset().repeat()
        if steps_per_epoch is None:
            steps_per_epoch = adapter.num_batches
    if steps_per_epoch is None:
        raise ValueError(_steps_required("steps_per_epoch", "data of infinite or unknown size"))
    return _per_worker(strategy, dataset), steps_per_epoch


def validation_adapter(validation_data, batch_size, steps):
    """`fit`'s `validation_data` read once, before the first epoch: a Keras data adapter of
    the finite dataset and batch count that each epoch's validation (`evaluate`) then uses.

    Keras's fit otherwise adapts `validation_data` itself at the first epoch's end (a
    dataset's `cardinality`, an eager op registered on every task: a hung worker held fit
    there) and psclient's evaluate adapted it again every epoch.
    """
    if validation_data is None or isinstance(validation_data, _finite_adapter_class()):
        return validation_data
    import keras

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(validation_data)
    return _finite_adapter_class()(*finite_dataset(x, y, sample_weight, batch_size, steps,
                                                   steps_argument="validation_steps"))


def finite_dataset(x, y, sample_weight, batch_size, steps, *, with_targets: bool = True,
                   steps_argument: str = "steps"):
    """`evaluate`/`predict` data as one finite dataset and its batch count (None: unknown).

    A dataset function is called once with a one-pipeline InputContext: the
    whole data set, which psclient then splits between closures itself.
    `steps_argument`: the name errors give `steps` (fit's `validation_steps`).
    """
    # Keras's data adapters run eager ops of kinds this process may not have run yet (a
    # `RangeDataset`), and TF registers each new kind on every task of the cluster with a
    # blocking RPC: one hung worker held fit, evaluate and predict here until it answered.
    # Local work only: inside, this thread's remote ops stream too (a streamed op to a task
    # that died waits for good).
    with streamed_registrations():
        from keras.src.trainers.data_adapters import get_data_adapter

        if isinstance(x, _finite_adapter_class()):  # fit's validation data, read before (with its steps)
            return x.dataset, x.num_batches
        _check_steps(steps_argument, steps)
        known = None  # the batches Keras's adapter knows when TF's cardinality does not (arrays)
        if is_dataset_fn(x):
            check_dataset_fn(x, "x")
            _refuse_extras("x", y=y, sample_weight=sample_weight)
            dataset = call_dataset_fn(x, tf.distribute.InputContext(), "x")
        else:
            # A generator or PyDataset too: Keras's adapter makes its batches here, where the
            # ranges are read anyway (psclient._keras.ranges).
            adapter = get_data_adapter(
                x=x, y=y if with_targets else None, sample_weight=sample_weight if with_targets else None,
                batch_size=batch_size, steps_per_epoch=steps, shuffle=False,
            )
            dataset = adapter.get_tf_dataset()
            known = adapter.num_batches
        if steps is not None:
            dataset = dataset.take(steps)
            known = None if known is None else min(known, steps)
        cardinality = int(dataset.cardinality())
        if cardinality == tf.data.INFINITE_CARDINALITY:
            raise ValueError(_steps_required(steps_argument, "an infinite dataset"))
        if cardinality == tf.data.UNKNOWN_CARDINALITY and known is not None:
            # Keras's array adapter batches with a flat_map, whose size TF cannot tell; it knows.
            return dataset, known
        # Unknown size stays unknown: counting would read the data one more time.
        return dataset, None if cardinality == tf.data.UNKNOWN_CARDINALITY else cardinality


def _check_steps(name: str, value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(
            f"Invalid value for argument `{name}`. Received: {name}={value!r}. "
            "Expected None or an integer >= 1."
        )


def _steps_required(name: str, what: str) -> str:
    return (
        f"Invalid value for argument `{name}`. Received: {name}=None with {what}. "
        f"Expected an integer >= 1: on a parameter-server cluster psclient cannot tell "
        f"where an epoch of this data ends, so `{name}` must say how many batches it has."
    )


class _PassedThrough(tf.distribute.DistributedDataset):
    """`data` (iterable, with an element spec) as what Keras's TF epoch iterator passes through
    untouched: a `tf.distribute.DistributedDataset` (it distributes anything else)."""

    def __init__(self, data):
        self._data = data

    def __iter__(self):
        return iter(self._data)

    @property
    def element_spec(self):
        return self._data.element_spec


@functools.cache
def _adapter_class():
    """A Keras data adapter whose "dataset" is a psclient per-worker dataset.

    Keras's `fit` accepts any `DataAdapter` as `x`; its TF epoch iterator
    passes a `tf.distribute.DistributedDataset` through untouched and hands
    `iter()` of it to the train function. So `fit`'s own loop drives the
    epochs while every step reads from the executing worker's iterator.
    Built on first use, to keep Keras out of psclient's import.
    """
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter

    class PerWorkerAdapter(DataAdapter):
        def __init__(self, per_worker):
            self._dataset = _PassedThrough(per_worker)

        def get_tf_dataset(self):
            return self._dataset

        @property
        def element_spec(self):
            return self._dataset.element_spec

        # Repeated on every worker: endless; the batch sizes are the user's.
        num_batches = None
        batch_size = None
        has_partial_batch = None
        partial_batch_size = None

    return PerWorkerAdapter


def per_worker_adapter(per_worker_dataset):
    return _adapter_class()(per_worker_dataset)


def local_adapter(dataset, num_batches):
    """A Keras data adapter whose epoch iterator hands the train function `iter(dataset)`, a
    dataset read on the coordinator, of `num_batches` batches an epoch (None: unknown)."""
    return _finite_adapter_class()(dataset, num_batches)


@functools.cache
def _finite_adapter_class():
    """A Keras data adapter holding one finite dataset and its batch count (None: unknown).

    Two users: fit's validation data (Keras's fit makes an epoch iterator of it, which reads the
    adapter's `num_batches` and passes a `tf.distribute.DistributedDataset` through untouched,
    then hands the adapter to `evaluate`, psclient's, which takes the dataset from it), and fit's
    training data made in Python (`local_adapter`: read on the coordinator, `host_data`).
    """
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter

    class FiniteAdapter(DataAdapter):
        def __init__(self, dataset, num_batches):
            self.dataset = dataset
            self._num_batches = num_batches

        def get_tf_dataset(self):
            return _PassedThrough(self.dataset)

        @property
        def num_batches(self):
            return self._num_batches

        @property
        def element_spec(self):
            return self.dataset.element_spec

        batch_size = None
        has_partial_batch = None
        partial_batch_size = None

    return FiniteAdapter
