"""LocalCluster's fork server: tasks forked from one process that imported TensorFlow once.

Real task processes: the tasks of two clusters come from one fork server, a task's exit status
is reported, and the fork server's loss or its owner's ends every task (no orphans)."""

import json
import signal
import subprocess
import sys

import psutil
import pytest

from psclient._cluster import forkserver
from psclient._cluster.local import LocalCluster

from _paths import ROOT_STR
from _polling import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240),
              pytest.mark.skipif(not forkserver.supported(), reason="fork servers need Linux with pidfds")]


def parent_of(cluster, job, index):
    return psutil.Process(cluster.pid(job, index)).ppid()


def test_the_tasks_of_two_clusters_come_from_one_fork_server_that_reports_exits():
    with LocalCluster(num_workers=1, num_ps=1, start_method="forkserver") as first, \
            LocalCluster(num_workers=1, num_ps=1, start_method="forkserver") as second:
        server = forkserver.server_for(first._env)
        assert server is forkserver.server_for(second._env)
        command = " ".join(psutil.Process(server.pid).cmdline())
        assert "psclient serve --fork-server" in command
        for cluster in (first, second):
            for job, index, _ in cluster.cluster.tasks():
                assert parent_of(cluster, job, index) == server.pid
                assert f"{job}:{index} ready at" in cluster.logs(job, index)
        first.kill("worker", 0)  # SIGKILL: the server reaps it and reports how it ended
        assert "exited -9" in repr(first)
        first.restart("worker", 0)
        assert parent_of(first, "worker", 0) == server.pid
        assert first.logs("worker", 0).count("worker:0 ready at") == 2


def test_a_lost_fork_server_ends_its_tasks_and_the_next_start_gets_a_new_one():
    with LocalCluster(num_workers=1, num_ps=1, start_method="forkserver") as cluster:
        server = forkserver.server_for(cluster._env)
        tasks = [psutil.Process(cluster.pid(job, index)) for job, index, _ in cluster.cluster.tasks()]
        psutil.Process(server.pid).send_signal(signal.SIGKILL)
        psutil.wait_procs(tasks, timeout=60)  # their parent-death signal: each exits by itself
        assert not any(task.is_running() and task.status() != psutil.STATUS_ZOMBIE for task in tasks)
        wait_for(lambda: server.gone, 60, "the coordinator to see its fork server gone")
        wait_for(lambda: not cluster.is_running("ps", 0), 60, "ps:0 to count as ended")
        assert "its parent process is gone" in cluster.logs("ps", 0)
        cluster.restart("ps", 0)  # a new fork server
        assert forkserver.server_for(cluster._env) is not server
        assert parent_of(cluster, "ps", 0) == forkserver.server_for(cluster._env).pid


def test_the_fork_server_and_its_tasks_exit_when_their_owner_is_sigkilled(tmp_path):
    script = f"""
import json, sys
sys.path.insert(0, {ROOT_STR!r})
from psclient._cluster import forkserver
from psclient._cluster.local import LocalCluster
cluster = LocalCluster(num_workers=2, num_ps=1, log_dir={str(tmp_path)!r}, start_method="forkserver")
pids = [cluster.pid(job, i) for job, i, _ in cluster.cluster.tasks()]
print(json.dumps([forkserver.server_for(cluster._env).pid, *pids]), flush=True)
sys.stdin.read()  # Until killed.
"""
    owner = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline()  # Bounded by the cluster's start_timeout.
        processes = [psutil.Process(pid) for pid in json.loads(line)]
        assert len(processes) == 4
    finally:
        owner.kill()
        owner.wait(timeout=30)
        owner.stdin.close()
        owner.stdout.close()
    gone, alive = psutil.wait_procs(processes, timeout=60)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    for name in ("worker-0.log", "worker-1.log", "ps-0.log"):
        assert "exiting: its parent process is gone" in (tmp_path / name).read_text()


class _GoneServer:
    gone = True  # its fork server lost: nobody reports the status, the pidfd says when it ends


def test_an_orphaned_task_waited_on_by_several_threads_ends_once_for_each():
    # Each waiter selects on its own copy of the pidfd: the first to see the end closes the
    # original, the others are not left with a closed (or reused) descriptor.
    import threading

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        task = forkserver.ForkedProcess(child.pid, ["sleep"], _GoneServer())
        codes, errors = [], []

        def wait():
            try:
                codes.append(task.wait(timeout=60))
            except Exception as error:  # noqa: BLE001 - the assertion below names it
                errors.append(error)

        waiters = [threading.Thread(target=wait) for _ in range(8)]
        for waiter in waiters:
            waiter.start()
        for waiter in waiters:
            waiter.join(timeout=60)
        assert errors == [] and codes == [-1] * 8
        assert task.poll() == -1
    finally:
        child.wait(timeout=30)
