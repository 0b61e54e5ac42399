"""More keras.io patterns as published, on the cluster: each runs as it runs locally.

The child (`_published_more_child.py`, a fresh process: TF connects a process once) runs each
example with local Keras, then creates the strategy and runs it again with its model built in the
strategy's scope; here the two runs are compared. Asynchronous training on two workers does not
give local Keras's numbers, so learned quantities are compared within a tolerance, and what the
code decides (epochs run, a resumed fit, learning rates set by a callback, files written, the
optimizer a policy chose) exactly. In the long tier: about a minute of two fresh processes.
"""

import os

import numpy as np
import pytest

from _paths import ROOT_STR
from _published_runs import both_runs, run_children

pytestmark = [pytest.mark.cluster, pytest.mark.long, pytest.mark.timeout(900)]

_CHILD = os.path.join(ROOT_STR, "tests", "_published_more_child.py")
#: How far below local Keras's an accuracy on the cluster may end (asynchronous updates).
ACCURACY_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def examples(local_cluster, tmp_path_factory):
    return run_children([_CHILD], local_cluster, tmp_path_factory.mktemp("more-examples"))


def _both(examples, name):
    local, cluster = both_runs(examples, name)
    for run in (local, cluster):
        for key, values in run["history"].items():
            assert np.all(np.isfinite(values)), (key, values)
    return local, cluster


def _accuracy_as_local(local, cluster, key="accuracy", floor=0.6):
    mine, theirs = cluster["use"]["evaluate"][key], local["use"]["evaluate"][key]
    assert theirs > floor, f"the local reference did not learn ({key} {theirs})"
    assert mine >= theirs - ACCURACY_TOLERANCE, (mine, theirs)


def test_transformer_text_classifier_with_custom_layers(examples):
    local, cluster = _both(examples, "transformer")
    _accuracy_as_local(local, cluster, floor=0.85)
    assert len(cluster["history"]["val_loss"]) == 3


def test_bidirectional_lstm_over_token_ids(examples):
    local, cluster = _both(examples, "bidirectional_lstm")
    _accuracy_as_local(local, cluster, floor=0.8)


def test_backup_and_restore_resumes_an_interrupted_fit_at_its_epoch(examples):
    """The guide's `InterruptingCallback` raises at the start of epoch 2; the same `fit` again
    runs only the epochs left (2, 3 and 4 of 5), and the backup is removed once it completes."""
    local, cluster = _both(examples, "backup_and_restore")
    for run in (local, cluster):
        assert run["use"]["interrupted"] == ["Interrupting!"]
        assert len(run["history"]["loss"]) == 3, run["history"]
        assert run["use"]["backup_left"] is False
    _accuracy_as_local(local, cluster, floor=0.8)


def test_learning_rate_scheduler_beside_tensorboard_histograms(examples):
    local, cluster = _both(examples, "lr_and_tensorboard")
    for run in (local, cluster):
        # The schedule halves the rate at each epoch's start, from 0.1: the logs say so, as locally.
        assert run["history"]["learning_rate"] == pytest.approx([0.05, 0.025, 0.0125])
        assert run["use"]["learning_rate"] == pytest.approx(0.0125)
        assert run["use"]["event_files"] == ["train/events", "validation/events"]
    assert cluster["use"]["evaluate"]["loss"] < cluster["history"]["loss"][0]


def test_pydataset_for_fit_evaluate_and_predict(examples):
    local, cluster = _both(examples, "pydataset")
    _accuracy_as_local(local, cluster, floor=0.5)
    assert len(cluster["use"]["predicted"]) == 10 and all(0 <= p < 10 for p in cluster["use"]["predicted"])


def test_augmentation_layers_inside_the_model(examples):
    local, cluster = _both(examples, "augmentation_in_model")
    _accuracy_as_local(local, cluster, key="acc", floor=0.3)


def test_a_training_loop_written_from_scratch(examples):
    """`tf.function` train step called by the script's own loop on the coordinator: its variables,
    optimizer and metric on the ps tasks, every batch applied once."""
    local, cluster = _both(examples, "custom_loop")
    batches = 3 * int(np.ceil(1797 / 64))  # three epochs of the digits
    for run in (local, cluster):
        assert run["use"]["iterations"] == batches
        assert run["history"]["acc"][-1] > run["history"]["acc"][0]
    assert local["history"]["acc"][-1] > 0.7, "the local reference did not learn"
    assert cluster["history"]["acc"][-1] >= local["history"]["acc"][-1] - ACCURACY_TOLERANCE
    assert cluster["use"]["loss"] <= local["use"]["loss"] * 1.5


def test_mixed_precision_policy(examples):
    local, cluster = _both(examples, "mixed_precision")
    assert local["use"]["optimizer"] == cluster["use"]["optimizer"] == "LossScaleOptimizer"
    _accuracy_as_local(local, cluster, floor=0.4)


def test_jit_compile_and_steps_per_execution_on_a_repeated_dataset(examples):
    local, cluster = _both(examples, "jit_and_spe")
    for run in (local, cluster):
        assert len(run["history"]["val_loss"]) == 3
        assert run["history"]["loss"][-1] < run["history"]["loss"][0]
    _accuracy_as_local(local, cluster, floor=0.3)


def test_best_full_model_checkpoint_with_a_custom_metric_loaded_back(examples):
    local, cluster = _both(examples, "best_full_model_checkpoint")
    for run in (local, cluster):
        val_loss = run["history"]["val_loss"]
        assert set(run["use"]["loaded"]) == set(run["use"]["model"]) == {"loss", "hits"}
        if int(np.argmin(val_loss)) == len(val_loss) - 1:  # the best epoch is the last: the file holds the model
            assert run["use"]["loaded"]["loss"] == pytest.approx(run["use"]["model"]["loss"], rel=1e-4)
            assert run["use"]["loaded"]["hits"] == run["use"]["model"]["hits"]
        else:  # an earlier epoch's model: a loss no better than the one trained on
            assert run["use"]["loaded"]["loss"] >= run["use"]["model"]["loss"] - 1e-4
