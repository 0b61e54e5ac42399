"""A per-worker value whose worker no longer holds the context it was built in (no cluster).

TF says so with an InvalidArgumentError ("Unable to find the relevant tensor remote_handle"), which
is no error of the dataset function: the value must not be marked failed for good. A chaos plan
(ps 0 killed, a worker hung during its recovery, then back) failed a Keras `fit` that way: the
worker's rejoin took it for the dataset's own error, and every later closure there failed with it.
"""

import pytest
import tensorflow as tf

from psclient._coordinator.data.per_worker import PerWorker, PerWorkerDataset, worker_context_lost
from psclient._coordinator.stores import PerWorkerRegistry

SPEC = tf.TensorSpec([None], tf.float32)
STALE = "Unable to find the relevant tensor remote_handle: Op ID: 2900, Output num: 0."


def stale_error():
    return tf.errors.InvalidArgumentError(None, None, STALE)


class Worker:
    """What the builders see of the workers: datasets made, and which ones a worker still holds."""

    def __init__(self):
        self.made = 0
        self.held: set[str] = set()
        self.iterators: list[str] = []
        self.builds_fail_stale = 0

    def build(self, worker):
        if self.builds_fail_stale:
            self.builds_fail_stale -= 1
            raise stale_error()
        self.made += 1
        name = f"dataset{worker}.{self.made}"
        self.held.add(name)
        return name

    def make_iterator(self, worker, dataset):
        if dataset not in self.held:  # made in a context the worker no longer holds
            raise stale_error()
        self.iterators.append(dataset)
        return f"iterator over {dataset}"


def per_worker(worker_side):
    registry = PerWorkerRegistry()
    dataset = PerWorkerDataset(worker_side.build, 2, "d", make_iterator=worker_side.make_iterator,
                               on_new=registry.track, element_spec=SPEC)
    return registry, dataset, iter(dataset)


def test_stale_context_errors_are_told_from_the_functions_own():
    assert worker_context_lost(stale_error(), 0)
    own_device = tf.errors.InvalidArgumentError(None, None, "/job:worker/replica:0/task:1/device:CPU:0 unknown device.")
    assert worker_context_lost(own_device, 1) and not worker_context_lost(own_device, 0)
    assert worker_context_lost(tf.errors.UnavailableError(None, None, "Socket closed"), 0)
    assert not worker_context_lost(tf.errors.InvalidArgumentError(None, None, "bad data"), 0)


def test_an_iterator_over_a_dataset_the_worker_no_longer_holds_makes_the_dataset_again():
    side = Worker()
    _registry, dataset, iterator = per_worker(side)
    assert iterator.value(0) == "iterator over dataset0.1"
    side.held.clear()  # the worker left TF's view and came back: its context was made again
    iterator.renew(0)  # a cancelled iterator made again over the worker's dataset
    assert iterator.value(0) == "iterator over dataset0.2"
    assert dataset.values[0] == "dataset0.2" and side.iterators == ["dataset0.1", "dataset0.2"]


def test_a_build_that_finds_a_stale_context_leaves_the_value_pending_not_failed():
    side = Worker()
    _registry, _dataset, iterator = per_worker(side)
    side.builds_fail_stale = 1
    with pytest.raises(tf.errors.InvalidArgumentError, match="remote_handle"):
        iterator.value(1)  # the closure fails with it: its worker is taken for stale and rejoins
    assert not iterator.built(1)
    assert iterator.value(1) == "iterator over dataset1.1"  # the next closure there builds it


def test_a_rejoin_that_finds_a_stale_context_fails_and_is_tried_again():
    side = Worker()
    registry, dataset, iterator = per_worker(side)
    assert iterator.value(0) == "iterator over dataset0.1"
    side.builds_fail_stale = 1
    with pytest.raises(tf.errors.InvalidArgumentError, match="remote_handle"):
        registry.rebuild(0, resources_only=False)  # the rejoin's failure: the rejoin is retried
    assert not dataset.built(0)  # pending, not failed (the worker takes no closure until it rejoins)
    registry.rebuild(0, resources_only=False)
    assert iterator.value(0) == "iterator over dataset0.2"


def test_a_resource_rebuild_after_a_ps_recovery_leaves_a_stale_worker_pending():
    registry = PerWorkerRegistry()
    made, stale = [], set()

    def build(worker):
        if worker in stale:
            raise stale_error()
        made.append(worker)
        return f"resource{worker}.{len(made)}"

    resource = PerWorker(build, 2, "table")
    registry.track(resource)
    stale.add(1)
    registry.rebuild(None, resources_only=True)  # worker 1's is left pending, worker 0's made again
    assert resource.values == ("resource0.3", None)
    stale.clear()
    assert resource.value(1) == "resource1.4"  # built by its first closure there
