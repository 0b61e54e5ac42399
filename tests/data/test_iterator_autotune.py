"""The iterators psclient makes of a dataset run without tf.data's autotuning model thread, unless the
dataset's options ask for it.

Deleting an iterator whose model thread waits between optimizations can wait for the rest of that
wait, up to 60 s on a long-lived iterator (TF's cancellation wakes the thread before it reads as
cancelled); a worker's iterators are deleted when TF's reconnect closes its context, and the
reconnect waits for that (docs/chaos.md, 2026-12-06). The race itself needs minutes of reading on a
loaded machine: measured in docs/chaos.md, not timed here. Checked: the options each iterator's
dataset gets, the user's own choice kept, the elements unchanged; and on a cluster, a per-worker
dataset's iterators read on.
"""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from psclient._coordinator.data.per_worker import without_autotune_model  # noqa: E402


def _pipeline():
    return tf.data.Dataset.range(100).map(lambda x: x * 2, num_parallel_calls=tf.data.AUTOTUNE) \
        .batch(10).prefetch(tf.data.AUTOTUNE)


def test_an_unset_autotune_is_turned_off_and_the_elements_stay_the_same():
    dataset = _pipeline()
    assert dataset.options().autotune.enabled is None
    changed = without_autotune_model(dataset)
    assert changed.options().autotune.enabled is False
    assert [b.numpy().tolist() for b in changed] == [b.numpy().tolist() for b in dataset]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_users_own_autotune_choice_is_kept(enabled):
    options = tf.data.Options()
    options.autotune.enabled = enabled
    dataset = _pipeline().with_options(options)
    assert without_autotune_model(dataset) is dataset


@pytest.mark.cluster
def test_per_worker_iterators_read_with_autotune_off(strategy, monkeypatch):
    """On the shared cluster: a per-worker dataset of an AUTOTUNE pipeline, read through its iterators,
    each made of the worker's dataset with the model off (the options read back from the worker)."""
    from psclient._coordinator.data import datasets

    made = []

    def recorded(dataset):
        changed = without_autotune_model(dataset)
        made.append(changed.options().autotune.enabled)
        return changed

    monkeypatch.setattr(datasets, "without_autotune_model", recorded)
    dataset = strategy.distribute_datasets_from_function(lambda _ctx: _pipeline().repeat())
    iterator = iter(dataset)

    @tf.function
    def total(it):
        return tf.reduce_sum(next(it))

    values = [strategy.schedule(total, (iterator,)) for _ in range(4)]
    strategy.join()
    assert all(np.isfinite(v.result(timeout=120)) for v in values)
    for worker in range(iterator.num_workers):
        if iterator.built(worker):
            break
    else:
        pytest.fail("no worker built its iterator")
    assert made and all(enabled is False for enabled in made), made
