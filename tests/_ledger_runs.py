"""Coordinator processes for the data-ledger restart tests: run one, read its JSON events, SIGKILL it.

`tests/_ledger_restart_child.py` is the coordinator; `run_coordinator` runs it
with a mode, collects the JSON lines it prints and, once `kill_when(events)`
holds, SIGKILLs it (mid-epoch, shards in flight).
"""

import json
import os
import sys

from _child_runs import run_and_read_events

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ledger_restart_child.py")


def write_cluster_file(cluster, path) -> None:
    """The LocalCluster's worker and ps addresses, for a child coordinator to connect to."""
    path.write_text(json.dumps({job: tasks for job, tasks in cluster.cluster.training_spec().items()
                                if job != "chief"}))


def run_coordinator(cluster_file, checkpoint_dir, mode, kill_when=None, timeout=400):
    """Run the child coordinator in `mode`; SIGKILL it as soon as `kill_when(events)` is true.
    Returns (exit code, events, the tail of its stderr)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(CHILD)), os.environ.get("PYTHONPATH", "")]))
    return run_and_read_events([sys.executable, CHILD, str(cluster_file), str(checkpoint_dir), mode],
                               checkpoint_dir.parent / f"stderr-{mode}.txt", kill_when, timeout, env)
