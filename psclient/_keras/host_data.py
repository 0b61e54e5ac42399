"""`fit` on data made in the coordinator's Python: generators, `keras.utils.PyDataset`, and
`tf.data` datasets that call Python (`Dataset.from_generator`, `py_function`, `numpy_function`).

Such data cannot be rebuilt on a worker: its Python lives in this process. TF still
runs a worker's copy of a `from_generator` dataset, by calling back into this process
for every element, and a copy of data of unknown size cut into ranges re-read the
generator from its start for each range (`benchmarks/host_data.py`: 36,096 elements
made for 6,400 and 51 s an epoch, against 6,400 and 1 s read here). So psclient reads
it here instead, once per epoch, as Keras reads it in one
process: Keras's own adapter makes the batches (a `PyDataset`'s workers and
`use_multiprocessing` included), a prefetching iterator reads them ahead, and each
step's batch travels to a free worker as the argument of one closure. A closure whose
worker dies runs again elsewhere with the same batch. At most the train function's
calls in flight hold batches here, so the coordinator's memory does not grow with the
data.

An epoch ends where the data ends when its size is unknown (Keras's progress bar
counts it in the first epoch, as in one process), or after `steps_per_epoch` steps.
"""

from __future__ import annotations

import itertools
from typing import Any

import tensorflow as tf

from psclient._coordinator.data.per_worker import without_autotune_model
from psclient._keras.data import is_python_made
from psclient._keras.trainer import TrainFunction
from psclient._tf.data import calls_python
from psclient._tf.executors import streamed_registrations

__all__ = ["HostFedTrainFunction", "ReadHere", "host_adapter", "is_host_fed"]


def is_host_fed(x: Any) -> bool:
    """Data whose batches are made in this process's Python."""
    return is_python_made(x) or (isinstance(x, tf.data.Dataset) and calls_python(x))


def host_adapter(x, y, sample_weight, batch_size, shuffle, class_weight, steps_per_epoch):
    """(Keras data adapter for fit's loop, steps of an epoch or None when the data's end tells).

    Keras's own adapter makes the batches, on this process; fit's loop gets a local
    dataset of them, prefetched, which the train function reads.
    """
    from keras.src.trainers.data_adapters import get_data_adapter

    from psclient._keras.data import local_adapter

    adapter = get_data_adapter(x=x, y=y, sample_weight=sample_weight, batch_size=batch_size,
                               steps_per_epoch=steps_per_epoch, shuffle=shuffle, class_weight=class_weight)
    batches = ReadHere(adapter.get_tf_dataset().prefetch(2))
    # Keras's epoch iterator starts a new pass over the data after the data's own batch count
    # (never for a generator, whose count is unknown): told `steps_per_epoch` instead, it
    # would drop a generator's prefetched batches at every epoch's end.
    return local_adapter(batches, adapter.num_batches), steps_per_epoch or adapter.num_batches


class ReadHere:
    """A dataset read on the coordinator, one pass (`_Pass`) per `iter()`: what Keras's epoch
    iterator hands the train function.

    A pass's TF iterator is made, read and deleted with what TF registers meanwhile streamed:
    each is a local op of a kind this process may not have run yet, and TF registers a new
    kind on every task first (a hung worker held fit in `iter()`). `close()` ends the open
    pass (fit calls it when it ends).
    """

    def __init__(self, dataset):
        self._dataset = dataset
        self._open = None

    @property
    def element_spec(self):
        return self._dataset.element_spec

    def __iter__(self):
        self.close()
        with streamed_registrations():  # its deletion must not wait (`without_autotune_model`)
            self._open = _Pass(iter(without_autotune_model(self._dataset)))
        return self._open

    def close(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None


class _Pass:
    """One pass over a `ReadHere`'s dataset (its own iterator: `iter()` of it is itself)."""

    def __init__(self, iterator):
        self._iterator = iterator

    def __iter__(self):
        return self

    def __next__(self):
        if self._iterator is None:
            raise StopIteration
        try:
            with streamed_registrations():
                return next(self._iterator)
        except StopIteration:
            self.close()
            raise

    def close(self) -> None:
        with streamed_registrations():
            self._iterator = None  # deleting a TF iterator runs an op too (DeleteIterator)


class HostFedTrainFunction(TrainFunction):
    """fit's train function for batches read on the coordinator: each step is one closure
    whose argument is its batch (`steps_per_execution` steps: as many closures).

    Without a known number of steps, the data's end ends the epoch: every scheduled step
    is waited for, then `StopIteration`, which Keras's fit loop takes as the epoch's end;
    the epoch's steps are then known, as Keras then knows them.
    """

    def __init__(self, model, strategy, steps_per_epoch: int | None):
        super().__init__(model, strategy, steps_per_epoch or 0)
        self._steps_per_epoch = steps_per_epoch

    def __call__(self, iterator):
        wanted = self._steps_per_execution
        if self._steps_per_epoch is not None:
            wanted = max(1, min(wanted, self._steps_per_epoch - self._steps_scheduled))
        batches = list(itertools.islice(iterator, wanted))  # `ReadHere`: read here
        if not batches:
            if self._steps_per_epoch is None:
                self._steps_per_epoch = self._steps_scheduled
            self.finish()
            raise StopIteration  # Keras's fit loop: the data ended, so does the epoch
        for batch in batches:
            self._schedule_step(self._batch_step, (batch,))
        self._steps_scheduled += len(batches)
        return self._after_scheduling()
