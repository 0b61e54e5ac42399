"""No task outlives its coordinator: forks, multiprocessing pools and stopped tasks.

The coordinator is a subprocess that starts a LocalCluster (its tasks forked by
a fork server, LocalCluster's default), forks (a plain
os.fork child that stays alive, a multiprocessing fork pool), stops one task
(SIGSTOP), and is then SIGKILLed. Every task process must be gone within a
generous bound. Whatever is left is killed in teardown.
"""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from _paths import ROOT_STR

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

_COORDINATOR = """
import json, multiprocessing, os, sys, time
sys.path.insert(0, {root!r})
from psclient._cluster import forkserver
from psclient._cluster.local import LocalCluster

cluster = LocalCluster(num_workers=2, num_ps=1, log_dir={log_dir!r}, start_timeout=120)
tasks = [cluster.pid(job, i) for job, i, _ in cluster.cluster.tasks()]
# The fork server the tasks came from (the default start method): the forks below must not keep it.
fork_servers = [forkserver.server_for(cluster._env).pid] if cluster._start_method == "forkserver" else []

# A forked child that exits normally runs this process's finalizers: it must
# leave the tasks alone.
quitter = os.fork()
if quitter == 0:
    sys.exit(0)
os.waitpid(quitter, 0)
alive_after_child_exit = all(cluster.is_running(job, i) for job, i, _ in cluster.cluster.tasks())

# A forked child that stays (it would hold the tasks' lifeline without the fix).
stayer = os.fork()
if stayer == 0:
    time.sleep(120)  # The test kills it long before.
    os._exit(0)
pool = multiprocessing.get_context("fork").Pool(1)
pool_pids = pool.apply(os.getpid), [p.pid for p in pool._pool]
cluster.stop("worker", 1)  # Stopped when its owner dies: must still go.
print(json.dumps({{"tasks": tasks, "fork_servers": fork_servers, "children": [stayer, *pool_pids[1]],
                  "alive_after_child_exit": alive_after_child_exit}}), flush=True)
sys.stdin.read()  # Until killed.
"""


def _gone(pid):
    try:
        process = psutil.Process(pid)
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def coordinator(tmp_path):
    """The coordinator subprocess, in its own session; teardown kills it, its
    children (its process group) and any task still alive."""
    script = _COORDINATOR.format(root=ROOT_STR, log_dir=str(tmp_path))
    process = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    leftovers = []
    yield process, leftovers
    try:
        os.killpg(process.pid, signal.SIGKILL)  # The forked children are in its group.
    except ProcessLookupError:
        pass
    process.wait(timeout=30)
    process.stdin.close()
    process.stdout.close()
    for pid in leftovers:
        if not _gone(pid):
            _kill(pid)


def test_no_task_outlives_a_sigkilled_coordinator_that_forked(coordinator, tmp_path):
    process, leftovers = coordinator
    line = process.stdout.readline()  # Bounded by the cluster's start_timeout.
    assert line, "the coordinator exited before it started its cluster"
    started = json.loads(line)
    leftovers.extend(started["tasks"] + started["fork_servers"])
    assert len(started["tasks"]) == 3
    assert started["alive_after_child_exit"] is True
    assert len(started["children"]) == 2  # The forked child and the pool's worker.
    assert all(not _gone(pid) for pid in started["children"])

    process.kill()
    process.wait(timeout=30)
    killed_at = time.monotonic()
    deadline = killed_at + 60
    owned = started["tasks"] + started["fork_servers"]
    while not all(_gone(pid) for pid in owned) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in owned if not _gone(pid)]
    assert not left, f"processes {left} (tasks, fork server) still alive 60 s after their coordinator was SIGKILLed"
    print(f"every task gone {time.monotonic() - killed_at:.2f} s after the coordinator's SIGKILL")
    assert not _gone(started["children"][0])  # The forked child lives on: it did not keep them.
    for name in ("worker-0.log", "worker-1.log", "ps-0.log"):  # worker-1 was stopped.
        assert "exiting: its parent process is gone" in (tmp_path / name).read_text()
