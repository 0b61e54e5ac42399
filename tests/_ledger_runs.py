"""Coordinator processes for the data-ledger restart tests: run one, read its JSON events, SIGKILL it.

`tests/_ledger_restart_child.py` is the coordinator; `run_coordinator` runs it
with a mode, collects the JSON lines it prints and, once `kill_when(events)`
holds, SIGKILLs it (mid-epoch, shards in flight).
"""

import json
import os
import signal
import subprocess
import sys

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
    stderr = open(checkpoint_dir.parent / f"stderr-{mode}.txt", "w+")
    process = subprocess.Popen([sys.executable, CHILD, str(cluster_file), str(checkpoint_dir), mode],
                               stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    events = []
    try:
        for line in process.stdout:
            if line.startswith("{"):
                events.append(json.loads(line))
                if kill_when is not None and kill_when(events):
                    process.send_signal(signal.SIGKILL)  # mid-epoch, shards in flight
                    break
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        process.stdout.close()
        stderr.seek(0)
        tail = stderr.read()[-3000:]
        stderr.close()
    return process.returncode, events, tail
