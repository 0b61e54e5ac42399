"""Leaving a `with LocalCluster(...)` block with its strategy still connected (no `shutdown()`).

Written as scripts are: the strategy made inside the block and never shut down. The
close shuts it down while the tasks still answer; before it did, TF's view kept naming
the ended tasks, so every later `tf.function` in the process logged failed registrations
on them, the process's exit logged failed context closes, and the next strategy was
refused ("Another psclient.ParameterServerStrategy is connected").

One child process (TF connects once per process), three clusters: one closed beside a
strategy connected to another (which must stay open), then two one after the other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from _paths import ROOT_STR

SCRIPT = """
import json
import tensorflow as tf
import psclient

def train(strategy):
    with strategy.scope():
        v = tf.Variable(1.0)
    @tf.function
    def step():
        return v.assign_add(1.0)
    for _ in range(3):
        strategy.schedule(step)
    strategy.join()
    return float(v.numpy())

out = {}
with psclient.LocalCluster(num_workers=1, num_ps=1) as first:
    strategy = psclient.ParameterServerStrategy(first.cluster)
    with psclient.LocalCluster(num_workers=1, num_ps=1):
        pass  # another cluster, closed while `strategy` is connected to `first`
    out["open_after_another_cluster_closed"] = not strategy.closed
    out["first"] = train(strategy)
out["closed_with_its_cluster"] = strategy.closed

@tf.function
def local_function(x):
    return x * 2.0
out["local_after"] = float(local_function(tf.constant(3.0)).numpy())

with psclient.LocalCluster(num_workers=1, num_ps=1) as second:
    again = psclient.ParameterServerStrategy(second.cluster)
    out["second"] = train(again)
print(json.dumps(out), flush=True)
"""

# What TF logs when its view names tasks that are gone (psclient's own warnings would name them too).
STALE_VIEW_LOGS = ("Failed to register function remotely", "Unable to close remote context")


def test_a_strategy_left_connected_is_shut_down_when_its_cluster_closes(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT_STR, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=400, cwd=tmp_path)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    out = json.loads(lines[-1])
    assert out == {"open_after_another_cluster_closed": True, "first": 4.0, "closed_with_its_cluster": True,
                   "local_after": 6.0, "second": 4.0}
    logged = [line for line in run.stderr.splitlines() if any(text in line for text in STALE_VIEW_LOGS)]
    assert not logged, logged[:4]


def test_close_runs_the_hooks_first_but_not_while_a_task_is_stopped():
    from psclient._cluster import closing
    from psclient._cluster.local import LocalCluster

    called = []

    def hook(cluster):
        called.append((cluster, [local.is_running(job, index) for job, index, _ in cluster.tasks()]))

    closing.before_close(hook)
    try:
        local = LocalCluster(num_workers=1, num_ps=1)
        local.close()
        local.close()  # a second close runs no hook again
        assert len(called) == 1 and called[0][0] == local.cluster
        assert all(called[0][1]), "the hook ran after the tasks ended"
        local = LocalCluster(num_workers=1, num_ps=1)
        local.stop("worker", 0)  # a strategy's shutdown would wait on its calls: no hook
        local.close()
        assert len(called) == 1
    finally:
        closing._BEFORE_CLOSE.remove(hook)  # noqa: SLF001 - process-wide: leave it as it was
