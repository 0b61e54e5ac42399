"""`psclient serve --recycle-when-idle`: long-lived tasks give back what gone coordinators left.

Real task processes (a LocalCluster whose tasks recycle after 2 s idle) and
real coordinators, each its own process as on a cluster. TensorFlow keeps 4
`tf_Compute` threads of every coordinator's context on each task for good (and
a killed coordinator's variables until its keep-alive, 600 s): these tests
show them released by the in-place restart, the pid and port kept, and a
connected coordinator never restarted under, however idle it is.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

import psclient
from psclient._cluster import exposure
from psclient._cluster.server import context_threads

from _paths import ROOT_STR
from _polling import wait_for

IDLE = 2.0
RESTART_TIMEOUT = 120  # idle time, then TensorFlow's import in the restarted task, on a busy machine

pytestmark = [
    pytest.mark.timeout(400),
    pytest.mark.skipif(not exposure.supported(), reason="--recycle-when-idle reads /proc (Linux only)"),
]

TASKS = (("worker", 0), ("ps", 0))

COORDINATOR = """
import os, signal, sys
import tensorflow as tf
import psclient
if sys.argv[1] == "kill":
    # TF-internal: the keep-alive after which the tasks drop a silent
    # coordinator's context (TF's 600 s otherwise). Until then they keep
    # talking to each other for it, so they are not idle. The module constant
    # alone did not take: TF's set_server_def and update_server_def took it as
    # their default when defined (the tasks kept the context 600 s, the test
    # timed out waiting 120 s for the restart).
    from tensorflow.python.eager import context
    context._KEEP_ALIVE_SECS = 5
    context.Context.set_server_def.__defaults__ = (5,)
    context.Context.update_server_def.__defaults__ = (5,)
strategy = psclient.ParameterServerStrategy(psclient.Cluster.from_env())
with strategy.scope():
    table = tf.Variable(tf.zeros([256, 1024]))  # 1 MiB on the ps
@tf.function
def step():
    table.assign_add(tf.ones([256, 1024]))
    return tf.reduce_sum(table)
futures = [strategy.schedule(step) for _ in range(10)]
strategy.join()
assert sorted(f.result() for f in futures)[-1] == 10 * 256 * 1024, [f.result() for f in futures]
print("steps ok", flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)  # nothing tells the tasks
strategy.shutdown()
"""


@pytest.fixture(scope="module")
def cluster():
    with psclient.LocalCluster(num_workers=1, num_ps=1, recycle_when_idle=IDLE) as local:
        yield local


def log_lines(cluster, job, index, text):
    with open(cluster.log_path(job, index), errors="replace") as f:
        return [line for line in f if text in line]


def restarts(cluster, job, index):
    return len(log_lines(cluster, job, index, "restarting itself in place"))


def ready_count(cluster, job, index):
    return len(log_lines(cluster, job, index, " ready at "))


def listening_sockets(pid, port):
    """How many of process `pid`'s descriptors are sockets listening on `port`."""
    inodes = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{name}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] in inodes
        except OSError:
            continue
    return count


def run_coordinator(cluster, mode, tmp_path):
    script = tmp_path / "coordinator.py"
    script.write_text(COORDINATOR)
    tf_config = cluster.cluster.to_tf_config("chief", 0)
    env = dict(os.environ, PYTHONPATH=ROOT_STR, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=tf_config)
    result = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True,
                            timeout=240, env=env)
    assert "steps ok" in result.stdout, result.stderr[-3000:]
    if mode == "kill":
        assert result.returncode == -signal.SIGKILL
    else:
        assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.long
def test_tasks_restart_in_place_after_each_coordinator_and_stay_flat(cluster, tmp_path):
    """A coordinator that shuts down, then one that is killed: after each, every
    task restarts in place and then holds what a fresh task holds."""
    pids = {task: cluster.pid(*task) for task in TASKS}
    fresh_threads = []
    for mode in ("shutdown", "kill"):
        before = {task: (restarts(cluster, *task), ready_count(cluster, *task)) for task in TASKS}
        run_coordinator(cluster, mode, tmp_path)
        for task in TASKS:
            wait_for(lambda: ready_count(cluster, *task) > before[task][1], RESTART_TIMEOUT,
                     f"{task} to restart and be ready again after a coordinator's {mode}")
            assert restarts(cluster, *task) == before[task][0] + 1
            line = log_lines(cluster, *task, "restarting itself in place")[-1]
            assert "threads of gone coordinators' contexts" in line, line
            # It counted the coordinator's leftover threads by TF's name for them,
            # tf_Compute: a TF that renames them makes this fail, not the restart silently stop.
            assert int(line.split("it holds ")[1].split()[0]) >= 1, line
            assert cluster.pid(*task) == pids[task]  # same process (exec), same port
            # The old process's listening socket did not pass to the new one (one
            # socket, TF's new one), and the new one closed its port to other
            # hosts again before saying ready (serve's default, which LocalCluster keeps).
            port = int(cluster.cluster.address(*task).rsplit(":", 1)[1])
            assert listening_sockets(pids[task], port) == 1
            assert len(log_lines(cluster, *task, "drops every packet")) == ready_count(cluster, *task)
        fresh_threads.append({task: context_threads(pids[task]) for task in TASKS})
    assert fresh_threads[0] == fresh_threads[1], fresh_threads  # flat: nothing carried over


def test_a_connected_coordinator_is_never_restarted_under_however_idle(cluster):
    strategy = psclient.ParameterServerStrategy(cluster.cluster)
    try:
        import tensorflow as tf

        with strategy.scope():
            counter = tf.Variable(0.0)

        @tf.function
        def step():
            counter.assign_add(1.0)
            return counter.read_value()

        before = {task: restarts(cluster, *task) for task in TASKS}
        for _ in range(5):
            strategy.schedule(step)
        strategy.join()
        # Idle well past the recycle time (3.5 times it), connections open: nothing may restart.
        # One window shows it; a second, after more steps, doubled the wait (7 s more).
        deadline = time.monotonic() + 3 * IDLE + 1
        while time.monotonic() < deadline:
            assert {task: restarts(cluster, *task) for task in TASKS} == before
            time.sleep(0.2)
        # The same connection works on after the idle window, on the same tasks.
        for _ in range(5):
            strategy.schedule(step)
        strategy.join()
        assert {task: restarts(cluster, *task) for task in TASKS} == before
        assert float(counter.numpy()) == 10.0  # the ps kept the variable throughout
    finally:
        strategy.shutdown()
