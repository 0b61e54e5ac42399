"""Per-worker datasets whose element spec is known are built by each worker's first closure (no cluster).

Built from the calling thread, one hung worker held `create_per_worker_dataset` (and a Keras fit
starting) until it answered; the cluster test is `tests/faults/test_no_freeze.py`.
"""

import threading

import pytest
import tensorflow as tf

from psclient._coordinator.data.per_worker import PerWorkerDataset
from psclient._coordinator.stores import PerWorkerRegistry

SPEC = tf.TensorSpec([None], tf.float32)


def _per_worker(spec, fail_on=()):
    built, iterators = [], []

    def build(worker):
        built.append((worker, threading.current_thread().name))
        if worker in fail_on:
            raise tf.errors.InvalidArgumentError(None, None, f"bad data on worker {worker}")
        return f"dataset{worker}"

    def make_iterator(worker, dataset):
        iterators.append((worker, dataset))
        return f"iterator of {dataset}"

    registry = PerWorkerRegistry()
    dataset = PerWorkerDataset(build, 3, "d", make_iterator=make_iterator, on_new=registry.track,
                               element_spec=spec)
    return dataset, built, iterators


def test_nothing_is_built_until_a_worker_needs_its_value_and_then_once_on_the_asking_thread():
    dataset, built, iterators = _per_worker(SPEC)
    iterator = iter(dataset)
    assert built == [] and iterators == []
    assert iterator.element_spec == SPEC and iterator.sample() == tf.data.IteratorSpec(SPEC)
    assert not any(iterator.built(w) for w in range(3))

    answers = {}

    def first_closure_on(worker):
        answers[worker] = iterator.value(worker)

    threads = [threading.Thread(target=first_closure_on, args=(w,), name=f"dispatcher-{w}") for w in (2, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert answers == {2: "iterator of dataset2", 0: "iterator of dataset0"}
    assert sorted(built) == [(0, "dispatcher-0"), (2, "dispatcher-2")]  # worker 1 never asked
    assert iterator.value(0) == "iterator of dataset0" and len(iterators) == 2  # kept, not built again
    assert not iterator.built(1) and dataset.values == ("dataset0", None, "dataset2")


def test_a_failed_build_fails_that_workers_closures_only():
    dataset, built, _ = _per_worker(SPEC, fail_on=(1,))
    iterator = iter(dataset)
    assert iterator.value(0) == "iterator of dataset0"
    with pytest.raises(Exception, match="could not be built on worker 1") as raised:
        iterator.value(1)
    assert "bad data on worker 1" in str(raised.value)
    with pytest.raises(Exception, match="could not be built on worker 1"):
        iterator.value(1)
    assert [w for w, _ in built] == [0, 1]  # a failed value is not built again until a rebuild


def test_without_a_known_spec_the_datasets_are_built_at_once():
    # An untraceable dataset function: its spec is read from a built dataset.
    dataset, built, _ = _per_worker(None)
    assert [w for w, _ in built] == [0, 1, 2]
    iter(dataset)
    assert [w for w, _ in built] == [0, 1, 2]
