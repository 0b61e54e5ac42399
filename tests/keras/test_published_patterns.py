"""Keras scripts as published examples write them: data and preprocessing built before the strategy.

Published Keras examples read a CSV, make a tf.data pipeline and adapt their preprocessing
layers first, then build the model. Creating a strategy connects the process to the cluster;
everything made before must keep working. TF connects a process once, so the
script runs in a fresh child process (`_published_patterns_child.py`) on the shared cluster:
local Keras first, then the same model on the cluster, in the same process, compared here.
Its CSVs are read by relative paths from a working directory that is not the cluster tasks'.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from _paths import ROOT_STR

_CHILD = os.path.join(ROOT_STR, "tests", "_published_patterns_child.py")
#: Asynchronous updates from two workers: a final accuracy this close to local Keras's.
ACCURACY_TOLERANCE = 0.1


def _write_csv(path, rows, seed):
    rng = np.random.default_rng(seed)
    lines = ["num1,num2,cat,target"]
    for _ in range(rows):
        num1, num2 = rng.normal(50, 10), rng.normal(5, 2)
        cat = rng.choice(["a", "b", "c", "d"])
        # A clear rule, on scales only a Normalization makes easy.
        target = int((num1 - 50) / 10 - (num2 - 5) / 2 + (1.5 if cat in ("a", "b") else -1.5) > 0)
        lines.append(f"{num1:.3f},{num2:.3f},{cat},{target}")
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def published_run(local_cluster, tmp_path_factory):
    """One run of the child script: its JSON results."""
    data = tmp_path_factory.mktemp("published")
    for name, rows, seed in (("train.csv", 480, 1), ("val.csv", 160, 2), ("test.csv", 160, 3)):
        _write_csv(data / name, rows, seed)
    # No "chief": this process may hold that port already (TF never releases it).
    jobs = {job: list(addresses) for job, addresses in local_cluster.cluster.jobs.items() if job != "chief"}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT_STR, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, _CHILD, json.dumps(jobs)], cwd=data, env=env,
                         capture_output=True, text=True, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, f"the script failed (exit {run.returncode}):\n{run.stderr[-4000:]}"
    return json.loads(lines[-1]), str(data)


@pytest.mark.long
def test_the_script_ran_in_a_directory_the_tasks_do_not_share(published_run, local_cluster):
    results, data = published_run
    assert results["cwd"] == data != os.getcwd()  # relative CSV paths resolved where the script runs


def test_fit_with_validation_matches_local_keras(published_run):
    results, _ = published_run
    local, cluster = results["local"], results["cluster"]
    assert local["val_accuracy"] > 0.85, "the local reference did not learn: the comparison says nothing"
    assert cluster["val_accuracy"] >= local["val_accuracy"] - ACCURACY_TOLERANCE
    assert cluster["weights_on_ps"]


def test_evaluate_and_predict_on_data_built_before_the_strategy(published_run):
    results, _ = published_run
    local, cluster = results["local"], results["cluster"]
    assert cluster["n_predictions"] == local["n_predictions"] == 160
    assert cluster["evaluate"]["accuracy"] >= local["evaluate"]["accuracy"] - ACCURACY_TOLERANCE
    # The saved model, evaluated by local Keras: the cluster's own evaluate and predict, exactly.
    assert cluster["evaluate"]["loss"] == pytest.approx(cluster["loaded_evaluate"]["loss"], rel=1e-4)
    assert cluster["evaluate"]["accuracy"] == pytest.approx(cluster["loaded_evaluate"]["accuracy"])
    assert cluster["max_prediction_difference"] < 1e-5


def test_normalization_adapted_outside_the_scope_moves_with_one_warning(published_run):
    results, _ = published_run
    moved = results["cluster"]["moved_warnings"]
    assert len(moved) == 1, moved  # two fits, one warning
    assert "'normalization/mean'" in moved[0] and "copied onto the ps" in moved[0]


def test_model_compiled_outside_the_scope_after_training(published_run):
    results, _ = published_run
    recompiled = results["recompiled"]
    # Same weights, new metrics made in this process: the same evaluation as before.
    assert recompiled["evaluate"]["loss"] == pytest.approx(results["cluster"]["evaluate"]["loss"], rel=1e-4)
    # Its new optimizer and metrics moved onto the ps; this model was warned about already (once a model).
    assert recompiled["state_on_ps"]
    assert recompiled["warnings"] == []


def test_schedule_reads_a_dataset_and_table_built_before(published_run):
    results, _ = published_run
    # Each worker reads its own copy from the start: a first or second batch, as local Keras reads them.
    assert set(results["schedule_batch_category_sums"]) <= set(results["local"]["batch_category_sums"])
    assert len(results["schedule_batch_category_sums"]) == 2


def test_images_augmented_in_a_pipeline_made_before_the_strategy_train(published_run):
    """keras.io's image classification input: `data_augmentation` (RandomFlip, RandomRotation) in the
    dataset's map, made before the strategy. Its random layers' seed generator states are variables
    made before the connection, which a dataset's serialization looked up on the new device and
    did not find ("Could not find resource"): sending the dataset to the workers failed."""
    results, _ = published_run
    augmented = results["augmented"]
    assert "error" not in augmented, augmented
    assert len(augmented["loss"]) == 2 and all(np.isfinite(augmented["loss"]))
    assert 0.0 <= augmented["evaluate"]["accuracy"] <= 1.0 and np.isfinite(augmented["evaluate"]["loss"])
