"""keras.io examples as published, on the cluster: each runs as it runs locally.

`_published_examples_child.py` runs nine examples in a fresh process (TF connects a process
once), `_published_gans_child.py` three more (two GANs, a miniature GPT) in another: their
data and preprocessing first, each example with local Keras, then the strategy and the
same examples with their models built in its scope. The two runs are compared
here. Two asynchronous workers train differently from one local loop, so results are
compared with a tolerance, and each local result is first checked to say something.
"""

import os

import numpy as np
import pytest

from _paths import ROOT_STR
from _published_runs import both_runs, run_children

_CHILDREN = [os.path.join(ROOT_STR, "tests", name) for name in ("_published_examples_child.py", "_published_gans_child.py")]
#: How far below local Keras's an accuracy on the cluster may end (asynchronous updates).
ACCURACY_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def examples(local_cluster, tmp_path_factory):
    return run_children(_CHILDREN, local_cluster, tmp_path_factory.mktemp("examples"))


_both = both_runs


def test_text_classification_from_scratch(examples):
    """`text_dataset_from_directory`, a `TextVectorization` adapted and mapped before the strategy,
    and the example's end-to-end model on raw strings, made and compiled after training."""
    local, cluster = _both(examples, "text")
    assert local["use"]["evaluate"]["accuracy"] > 0.75, "the local reference did not learn"
    assert cluster["use"]["evaluate"]["accuracy"] >= local["use"]["evaluate"]["accuracy"] - ACCURACY_TOLERANCE
    for run in (local, cluster):  # the same model on strings as on the vectorized dataset
        assert run["use"]["end_to_end"]["accuracy"] == pytest.approx(run["use"]["evaluate"]["accuracy"])
        assert run["use"]["end_to_end"]["loss"] == pytest.approx(run["use"]["evaluate"]["loss"], rel=1e-4)


def test_structured_data_with_feature_space(examples):
    """A `FeatureSpace` adapted before the strategy and mapped in the pipeline; its inference model."""
    local, cluster = _both(examples, "feature_space")
    assert local["use"]["evaluate"]["accuracy"] > 0.75, "the local reference did not learn"
    assert cluster["use"]["evaluate"]["accuracy"] >= local["use"]["evaluate"]["accuracy"] - ACCURACY_TOLERANCE
    for run in (local, cluster):
        assert 0.0 < run["use"]["inference"] < 1.0


def test_timeseries_forecast_with_best_weights_checkpoint(examples):
    """`timeseries_dataset_from_array`, an LSTM, EarlyStopping and a weights-only best checkpoint loaded back."""
    local, cluster = _both(examples, "forecast")
    for run in (local, cluster):
        # The target is a sine (variance 0.5): both learned it, and the loaded weights are the best epoch's.
        assert run["use"]["best_val_loss"] < 0.05
        assert run["use"]["loaded_val_loss"] == pytest.approx(run["use"]["best_val_loss"], rel=1e-4)


def test_vae_with_its_own_train_step_and_seed_generator(examples):
    local, cluster = _both(examples, "vae")
    for run in (local, cluster):
        loss = run["history"]["loss"]
        assert np.all(np.isfinite(loss)) and loss[-1] < loss[0]
        assert run["use"]["z_mean_finite"]
    assert cluster["history"]["loss"][-1] <= local["history"]["loss"][-1] * 1.2


def test_knowledge_distillation_overriding_compile_and_compute_loss(examples):
    local, cluster = _both(examples, "distillation")
    for role in ("teacher", "student"):
        accuracy = "sparse_categorical_accuracy"
        assert local["use"][role][accuracy] > 0.25, f"the local {role} did not learn (chance: 0.1)"
        assert cluster["use"][role][accuracy] >= local["use"][role][accuracy] - ACCURACY_TOLERANCE
    assert np.all(np.isfinite(cluster["history"]["loss"]))


def test_multi_input_multi_output_model_with_losses_by_name(examples):
    local, cluster = _both(examples, "multi_io")
    assert set(cluster["history"]) == {"loss", "priority_loss", "department_loss"}
    for name, value in cluster["use"]["evaluate"].items():
        assert np.isfinite(value) and value == pytest.approx(local["use"]["evaluate"][name], rel=0.25), name


def test_transfer_learning_unfrozen_and_compiled_again_after_training(examples):
    """The guide's fine-tuning: a frozen base, then `trainable = True` and `compile` again (outside
    any scope) after the first fit, and a second fit that trains the base too."""
    local, cluster = _both(examples, "transfer")
    for run in (local, cluster):
        assert (run["use"]["trainable_frozen"], run["use"]["trainable_unfrozen"]) == (2, 4)
    accuracy = "sparse_categorical_accuracy"
    assert local["use"]["evaluate"][accuracy] > 0.75, "the local reference did not learn"
    assert cluster["use"]["evaluate"][accuracy] >= local["use"]["evaluate"][accuracy] - ACCURACY_TOLERANCE


def test_callback_stops_at_min_loss_and_sets_the_best_weights_back(examples):
    """The callbacks guide's `EarlyStoppingAtMinLoss`: `get_weights()` at each better epoch, then
    `stop_training` and `set_weights()` of those, all from inside `fit`."""
    local, cluster = _both(examples, "min_loss")
    for run in (local, cluster):
        epochs = len(run["history"]["loss"])
        assert epochs < 30 and epochs == run["use"]["stopped_epoch"] + 1, "it did not stop early"
        # The weights set back are the best epoch's: evaluated, about that epoch's (running) loss.
        assert run["use"]["loss_now"] == pytest.approx(run["use"]["best"], rel=0.15)
        assert run["use"]["loss_now"] < 0.05  # the linear target (noise 0.01) was learned


def test_activity_loss_layer_in_a_model_with_its_own_test_step(examples):
    local, cluster = _both(examples, "add_loss")
    assert local["use"]["evaluate"]["accuracy"] > 0.6, "the local reference did not learn"
    assert cluster["use"]["evaluate"]["accuracy"] >= local["use"]["evaluate"]["accuracy"] - ACCURACY_TOLERANCE
    assert np.all(np.isfinite(cluster["history"]["val_loss"]))


@pytest.mark.parametrize("name", ["gan", "wgan_gp"])
def test_gans_overriding_compile_with_two_optimizers_and_their_own_train_step(examples, name):
    local, cluster = _both(examples, name)
    for run in (local, cluster):
        for loss in ("d_loss", "g_loss"):
            assert np.all(np.isfinite(run["history"][loss]))
        assert run["use"]["generated_finite"] and run["use"]["generated_shape"] == [16, 8, 8, 1]
    # Each optimizer applied once a step, as locally; their state on the ps tasks.
    assert cluster["use"]["iterations"] == local["use"]["iterations"]
    assert cluster["use"]["iterations"][0] > 0
    assert cluster["use"]["optimizer_state_on_ps"]
    # The discriminator's loss ends where it ends locally (two asynchronous workers: not the same numbers).
    local_last, cluster_last = local["history"]["d_loss"][-1], cluster["history"]["d_loss"][-1]
    assert abs(cluster_last - local_last) <= 0.15 * abs(local_last) + 0.05, (local_last, cluster_last)


def test_gpt_with_a_callback_that_generates_with_predict_after_each_epoch(examples):
    local, cluster = _both(examples, "gpt")
    for run in (local, cluster):
        loss = run["history"]["loss"]
        assert loss[-1] < 0.5 * loss[0], loss
        generated = run["use"]["generated"]
        assert len(generated) == len(loss)  # one generation per epoch, from the callback
        # The data counts up (next = token % 39 + 1): the last epoch's tokens continue the start.
        last = generated[-1]
        assert last[:3] == [5, 6, 7] and all(b == a % 39 + 1 for a, b in zip(last, last[1:])), last
