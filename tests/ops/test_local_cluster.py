"""LocalCluster with real task processes: start-up, fault injection, logs, clean-up.

Tests on the shared `local_cluster` leave every task running when they finish.
"""

import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

import psclient._cluster.local
import psclient._cluster.task_process
from psclient._cluster import forkserver
from psclient._cluster.local import LocalCluster
from psclient._core.errors import TaskUnreachableError

from _paths import ROOT_STR
from _polling import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def answers(address, timeout=10):
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout):
        return True


def gone(process):
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until_gone(processes, timeout=30):
    """Polls psutil until every process has exited (an unreaped zombie counts)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in processes if not gone(p)]
        if not alive:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"still running after {timeout} s: {[p.pid for p in alive]}")
        psutil.wait_procs(alive, timeout=0.1)  # Paces the polling; returns early on exit.


def wait_for_status(process, wanted, timeout=10):
    deadline = time.monotonic() + timeout
    while (status := process.status()) not in wanted:
        if time.monotonic() > deadline:
            pytest.fail(f"pid {process.pid} is {status!r}, not {wanted} after {timeout} s")
        psutil.wait_procs([process], timeout=0.05)  # Paces the polling.


def serve_children():
    """Task processes started by this test process (children, or its fork servers' children)."""
    found = set()
    for process in psutil.Process().children(recursive=True):
        try:
            command = " ".join(process.cmdline())
            forked_by_a_server = process.ppid() in fork_servers()
        except psutil.NoSuchProcess:
            continue
        if "serve" in command and (forked_by_a_server or forkserver.OPTION not in command):
            found.add(process.pid)
    return found


def fork_servers():
    return {server.pid for server in forkserver._servers.values() if not server.gone}


# The shared cluster ------------------------------------------------------------


def test_every_task_answers_on_127_0_0_1(local_cluster):
    cluster = local_cluster.cluster
    assert (cluster.num_workers, cluster.num_ps) == (2, 1)
    assert cluster.chief is not None
    for job, index, address in cluster.tasks():
        assert address.startswith("127.0.0.1:")
        assert local_cluster.is_running(job, index)
        assert answers(address), f"{job}:{index} at {address}"
    assert cluster.chief.startswith("127.0.0.1:")


def test_logs_hold_the_warning_and_one_ready_line_per_start(local_cluster):
    for job, index, address in local_cluster.cluster.tasks():
        path = local_cluster.log_path(job, index)
        assert os.path.dirname(path) == local_cluster.log_dir
        logs = local_cluster.logs(job, index)
        assert "accept unauthenticated RPCs" in logs and "ALL network interfaces" in logs
        assert f"{job}:{index} ready at {address} (pid " in logs
        # TF_CPP_MIN_LOG_LEVEL=1 in the tasks: no INFO line once absl is up.
        assert "Started server with target" not in logs


def test_kill_then_restart_at_the_same_address(local_cluster):
    address = local_cluster.cluster.address("worker", 1)
    process = psutil.Process(local_cluster.pid("worker", 1))
    # The session's cluster is shared: earlier tests may have restarted it too.
    starts_before = local_cluster.logs("worker", 1).count("worker:1 ready at")
    local_cluster.kill("worker", 1)
    try:
        assert gone(process)  # kill() waited for it.
        assert not local_cluster.is_running("worker", 1)
        assert local_cluster.pid("worker", 1) is None
        with pytest.raises(ConnectionRefusedError):
            answers(address)
        local_cluster.kill("worker", 1)  # Killing a dead task is a no-op.
    finally:
        local_cluster.restart("worker", 1)
    assert local_cluster.cluster.address("worker", 1) == address
    assert local_cluster.pid("worker", 1) not in (None, process.pid)
    assert answers(address)
    logs = local_cluster.logs("worker", 1)
    assert "restarting worker:1" in logs
    assert logs.count("worker:1 ready at") == starts_before + 1


def test_restart_of_a_running_task(local_cluster):
    old = local_cluster.pid("ps", 0)
    local_cluster.restart("ps", 0, timeout=60)
    assert local_cluster.pid("ps", 0) != old
    assert answers(local_cluster.cluster.address("ps", 0))


def test_stop_and_resume(local_cluster):
    process = psutil.Process(local_cluster.pid("worker", 0))
    local_cluster.stop("worker", 0)
    try:
        wait_for_status(process, {psutil.STATUS_STOPPED})
        assert local_cluster.is_running("worker", 0)
        assert "stopped" in repr(local_cluster)
    finally:
        local_cluster.resume("worker", 0)
    wait_for_status(process, {psutil.STATUS_RUNNING, psutil.STATUS_SLEEPING})
    assert answers(local_cluster.cluster.address("worker", 0))


def test_a_restart_or_an_added_worker_holds_up_calls_on_its_own_task_only():
    """While a restart (or `add_worker`) waits for its task to start, `stop`/`resume` of the other
    tasks go ahead (the cluster's lock was held for the whole start: a fault plan's 5 s ps hang lasted
    25 s, its SIGCONT waiting on a worker's restart), and a call on the starting task waits for the
    start to end. The new process is SIGSTOPped by the test so that the start is still waiting,
    whatever the load: started as a process of its own ("spawn"), as a forked task is ready too soon
    to be caught."""
    with LocalCluster(num_workers=2, num_ps=1, start_method="spawn", start_timeout=120) as local_cluster:
        _a_start_holds_up_calls_on_its_own_task_only(local_cluster, lambda: local_cluster.restart("worker", 1), 1)
        assert _a_start_holds_up_calls_on_its_own_task_only(local_cluster, local_cluster.add_worker, 2) == 2


def _a_start_holds_up_calls_on_its_own_task_only(local_cluster, start, index):
    """`start()` (a restart of worker `index`, or the `add_worker` that makes it) in a thread, its
    new process SIGSTOPped: `stop`/`resume` of ps 0 and worker 0 go ahead, a `resume` of worker
    `index` waits for the start to end. Returns what `start()` returned."""
    old = local_cluster.pid("worker", index) if index < local_cluster.cluster.num_workers else None
    ended = {}

    def run_start():
        ended["value"] = start()
        ended["start"] = time.monotonic()

    def resume_started():
        local_cluster.resume("worker", index)
        ended["resume"] = time.monotonic()

    def new_pid():
        return index < local_cluster.cluster.num_workers and local_cluster.pid("worker", index) not in (None, old)

    starting = threading.Thread(target=run_start, name="test-start")
    starting.start()
    new = None
    try:
        wait_for(new_pid, 60, f"the new worker:{index} process")
        new = psutil.Process(local_cluster.pid("worker", index))
        new.suspend()  # not ready while stopped: the start keeps waiting
        waiting = threading.Thread(target=resume_started, name="test-resume")
        waiting.start()
        for job, other in (("ps", 0), ("worker", 0)):
            local_cluster.stop(job, other)
            local_cluster.resume(job, other)
        assert starting.is_alive() and "resume" not in ended  # went ahead of the start
    finally:
        if new is not None:
            new.resume()
        starting.join(timeout=150)
    waiting.join(timeout=30)
    assert not starting.is_alive() and not waiting.is_alive()
    assert ended["resume"] >= ended["start"]  # the call on the starting worker waited for its start
    for job, other in (("ps", 0), ("worker", 0), ("worker", index)):
        assert answers(local_cluster.cluster.address(job, other))
    return ended["value"]


@pytest.mark.parametrize(
    "job, index, message",
    [
        ("chief", 0, r"argument `job`. Received: job='chief'. Expected one of \['worker', 'ps'\]"),
        ("worker", 2, r"argument `index`. Received: index=2. Expected an integer in 0..1"),
        ("ps", -1, r"Received: index=-1. Expected an integer in 0..0"),
        ("ps", "0", r"Received: index='0'"),
    ],
)
def test_bad_job_or_index(local_cluster, job, index, message):
    for method in (local_cluster.kill, local_cluster.stop, local_cluster.pid, local_cluster.logs):
        with pytest.raises(ValueError, match=message):
            method(job, index)


def test_repr_names_every_task(local_cluster):
    text = repr(local_cluster)
    for job, index, address in local_cluster.cluster.tasks():
        assert f"{job}:{index}={address}" in text
    assert f"chief={local_cluster.cluster.chief}" in text


# Own clusters ------------------------------------------------------------------


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_startup_time_and_close_leaves_no_process(capsys, start_method):
    start = time.monotonic()
    with LocalCluster(num_workers=2, num_ps=1, start_method=start_method) as cluster:
        elapsed = time.monotonic() - start
        processes = [psutil.Process(cluster.pid(job, i)) for job, i, _ in cluster.cluster.tasks()]
        log_dir = cluster.log_dir
        assert os.path.isdir(log_dir)
    with capsys.disabled():
        print(f"\nLocalCluster(2 workers, 1 ps, start_method={start_method!r}) ready in {elapsed:.2f} s")
    assert elapsed < 30
    wait_until_gone(processes, timeout=1)  # close() reaped them already.
    assert not os.path.exists(log_dir)  # Its own temporary directory is removed.
    cluster.close()  # Idempotent.
    assert "closed" in repr(cluster)
    with pytest.raises(RuntimeError, match="closed"):
        cluster.restart("worker", 0)


def test_add_worker_starts_a_task_at_a_new_port_owned_like_the_others():
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        before = cluster.cluster
        index = cluster.add_worker()
        assert index == 1
        address = cluster.cluster.address("worker", 1)
        assert cluster.cluster.workers == (*before.workers, address)
        assert cluster.cluster.ps == before.ps and cluster.cluster.chief == before.chief
        assert address not in before.jobs["worker"] + before.jobs["ps"] + [before.chief]
        assert answers(address)
        assert "worker:1 ready at " + address in cluster.logs("worker", 1)
        assert cluster.add_worker(timeout=60) == 2  # and another
        processes = [psutil.Process(cluster.pid("worker", i)) for i in (1, 2)]
        cluster.kill("worker", 2)  # retired: its slot and address stay, restart brings it back
        assert not cluster.is_running("worker", 2) and cluster.cluster.num_workers == 3
        cluster.restart("worker", 2)
        processes.append(psutil.Process(cluster.pid("worker", 2)))
        with pytest.raises(ValueError, match="timeout"):
            cluster.add_worker(timeout=0)
        running = serve_children()
        with pytest.raises(TaskUnreachableError, match=r"worker:3"):
            cluster.add_worker(timeout=0.001)  # did not start: ended, and the cluster as before
        assert cluster.cluster.num_workers == 3
        # (forked after the caller gave up, a task finds its pipes closed and exits by itself)
        wait_for(lambda: serve_children() == running, 60, "the worker that did not start to be gone")
        with pytest.raises(ValueError, match="index"):
            cluster.pid("worker", 3)
    wait_until_gone(processes, timeout=1)  # close() ended the added ones too
    with pytest.raises(RuntimeError, match="closed"):
        cluster.add_worker()


def test_tasks_exit_when_the_coordinator_is_sigkilled(tmp_path):
    script = f"""
import json, sys
sys.path.insert(0, {ROOT_STR!r})
from psclient._cluster.local import LocalCluster
cluster = LocalCluster(num_workers=2, num_ps=1, log_dir={str(tmp_path)!r})
print(json.dumps([cluster.pid(job, i) for job, i, _ in cluster.cluster.tasks()]), flush=True)
sys.stdin.read()  # Until killed.
"""
    coordinator = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = coordinator.stdout.readline()  # Bounded by the cluster's start_timeout.
        processes = [psutil.Process(pid) for pid in json.loads(line)]
        assert len(processes) == 3
    finally:
        coordinator.kill()
        coordinator.wait(timeout=30)
        coordinator.stdin.close()
        coordinator.stdout.close()
    wait_until_gone(processes, timeout=30)
    for name in ("worker-0.log", "worker-1.log", "ps-0.log"):
        assert "exiting: its parent process is gone" in (tmp_path / name).read_text()


def test_a_task_that_cannot_start_is_named_with_its_log(monkeypatch, tmp_path):
    before = serve_children()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # Every start (LocalCluster tries new ports 3 times) gives ps:0 the taken port.
        ports = itertools.cycle([psclient._cluster.local.portpicker.pick_unused_port(), port,
                                 psclient._cluster.local.portpicker.pick_unused_port()])
        monkeypatch.setattr(psclient._cluster.local.portpicker, "pick_unused_port", lambda: next(ports))
        with pytest.raises(TaskUnreachableError) as info:
            LocalCluster(num_workers=1, num_ps=1, log_dir=tmp_path)
    error = info.value
    assert (error.task, error.address) == ("ps:0", f"127.0.0.1:{port}")
    assert f"Task ps:0 (127.0.0.1:{port}) exited with status 1 before it was ready" in str(error)
    assert f"cannot start ps:0 at 127.0.0.1:{port}" in str(error)  # From its log.
    assert serve_children() == before  # The worker was ended too.


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_task_whose_process_cannot_be_created_leaks_no_pipe(monkeypatch, tmp_path, start_method):
    def no_fork(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")

    if start_method == "spawn":
        monkeypatch.setattr(psclient._cluster.task_process.subprocess, "Popen", no_fork)
    else:
        forkserver.server_for(psclient._cluster.local.child_env(None, quiet_tf=True))  # its socket counted before
        monkeypatch.setattr(forkserver.ForkServer, "spawn", no_fork)
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        LocalCluster(num_workers=1, num_ps=1, log_dir=tmp_path, start_method=start_method)
    assert set(os.listdir("/proc/self/fd")) <= fds


def test_start_timeout_names_the_tasks_and_ends_them():
    before = serve_children()
    with pytest.raises(TaskUnreachableError, match=r"was not ready within 0.2 s \(not ready: worker:0 \(127.0.0.1:\d+\), ps:0"):
        LocalCluster(num_workers=1, num_ps=1, start_timeout=0.2)
    assert serve_children() == before


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_workers": 0}, r"`num_workers`. Received: num_workers=0. Expected an integer >= 1"),
        ({"num_ps": 1.5}, r"`num_ps`. Received: num_ps=1.5"),
        ({"start_timeout": 0}, r"`start_timeout`. Received: start_timeout=0"),
        ({"inter_op_threads": 1}, r"`inter_op_threads`. Received: 1. Expected an integer >= 2"),
        ({"start_method": "fork"}, r"`start_method`. Received: start_method='fork'. Expected one of \['forkserver', 'spawn'\]"),
    ],
)
def test_invalid_arguments_start_nothing(kwargs, message):
    before = serve_children()
    with pytest.raises(ValueError, match=message):
        LocalCluster(**kwargs)
    assert serve_children() == before


def test_a_port_taken_before_its_task_binds_it_starts_the_cluster_on_new_ports(monkeypatch):
    """Another process may take a picked port before the task binds it (many clusters
    starting at once on one machine): the cluster starts again on new ports."""
    local_module = psclient._cluster.local
    blocker = socket.socket()
    blocker.bind(("0.0.0.0", 0))  # TF binds every interface: so does the other process here
    blocker.listen()
    taken = blocker.getsockname()[1]
    real_pick, picks = local_module._pick_ports, []

    def pick(count):
        ports = real_pick(count)
        if not picks:
            ports[0] = taken  # worker 0's port, taken
        picks.append(ports)
        return ports

    monkeypatch.setattr(local_module, "_pick_ports", pick)
    try:
        with LocalCluster(num_workers=1, num_ps=1) as local:
            assert len(picks) == 2
            assert local.cluster.address("worker", 0) == f"127.0.0.1:{picks[1][0]}" != f"127.0.0.1:{taken}"
            assert all(local.is_running(job, 0) for job in ("worker", "ps"))
    finally:
        blocker.close()
