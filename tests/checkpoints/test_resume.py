"""Coordinator restart: a training script killed mid-run resumes from its checkpoint."""

import json
import os
import signal
import sys

import pytest
from _child_runs import run_and_read_events
from _paths import ROOT

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

SCRIPT = os.path.join(str(ROOT),
                      "examples", "resume_training.py")
STEPS = 40


def run_script(cluster_file, checkpoint_dir, kill_after_epoch=None):
    """Run the example as a coordinator process; SIGKILL it after an epoch if asked.

    Returns its exit status, its JSON events and the tail of its stderr.
    """
    def killed_after_epoch(events):
        # mid-run: the next epoch is being scheduled
        return kill_after_epoch is not None and events[-1].get("epoch") == kill_after_epoch \
            and events[-1]["event"] == "epoch"

    return run_and_read_events(
        [sys.executable, SCRIPT, "--cluster", str(cluster_file), "--checkpoint-dir",
         str(checkpoint_dir), "--epochs", "4", "--steps-per-epoch", str(STEPS)],
        checkpoint_dir.parent / f"stderr-{kill_after_epoch}.txt", killed_after_epoch, timeout=200,
    )


@pytest.mark.long
def test_killed_coordinator_resumes_from_the_last_completed_epoch(local_cluster, tmp_path):
    cluster_file = tmp_path / "cluster.json"
    # Without the "chief" entry: this test process may already serve that
    # address as its own coordinator; the script's coordinator picks a port.
    jobs = {job: tasks for job, tasks in local_cluster.cluster.training_spec().items() if job != "chief"}
    cluster_file.write_text(json.dumps(jobs))
    ckpt = tmp_path / "ckpt"

    code, first, err = run_script(cluster_file, ckpt, kill_after_epoch=2)
    assert code == -signal.SIGKILL, err
    assert first[0] == {"event": "start", "epoch": 0, "steps": 0, "restored": None}
    assert [e["steps"] for e in first if e["event"] == "epoch"] == [STEPS, 2 * STEPS]

    code, second, err = run_script(cluster_file, ckpt)
    assert code == 0, (second, err)
    start = second[0]
    # Resumed exactly at the end of epoch 2: nothing of the cut-off epoch 3 stays.
    assert (start["epoch"], start["steps"]) == (2, 2 * STEPS)
    assert start["restored"]["path"].startswith(str(ckpt))
    epochs = [(e["epoch"], e["steps"]) for e in second if e["event"] == "epoch"]
    assert epochs == [(3, 3 * STEPS), (4, 4 * STEPS)]
    done = second[-1]
    assert done == {"event": "done", "epoch": 4, "steps": 4 * STEPS, "iterations": 4 * STEPS}
