"""`LocalCluster`: a real cluster of TensorFlow task processes on 127.0.0.1.

For tests, examples and single-machine runs. Every worker and ps task is its
own OS process running `python -m psclient serve`, so failures can be injected
the way they happen in production: kill, stop (freeze), resume, restart. By
default a task is forked from a process that imported TensorFlow once
(forkserver.py): starting one costs a fork, not TensorFlow's import.

Each task process is owned by the `LocalCluster` that started it:
`close()` (also run by a `weakref.finalize` at interpreter exit) ends and reaps
every task, and a pipe whose write end only this process holds makes the tasks
exit by themselves if this process dies without closing, even by SIGKILL.
Children this process forks close their copies of those write ends at once
(`os.register_at_fork`), and on Linux each task also gets a parent-death
signal, which ends a task whose owner is gone even while it is stopped.

On Linux, each task's port drops every packet that does not come over
loopback (`psclient serve`'s default; the cluster is all 127.0.0.1).
Elsewhere the tasks run with `--allow-any-host`, after a `RuntimeWarning`.

`throttle` makes a straggler: a helper process owned the same way
(`throttle.py`) runs the task on a SIGSTOP/SIGCONT duty cycle.

`close()` first runs the hooks added with `closing.before_close` (the strategy
registry adds one: it shuts down a strategy still connected to the tasks,
while they still answer, so that TF's view of the cluster is left cleanly and
the next strategy can connect).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
import weakref
from typing import Any, Callable

import portpicker

from psclient._cluster import closing, exposure, forkserver
from psclient._cluster.process import child_env
from psclient._cluster.server import check_inter_op_threads
from psclient._cluster.spec import Cluster
from psclient._cluster.task_process import START_METHODS, TaskProcess, launch, not_ready, shutdown, wait_ready
from psclient._cluster.throttle import DEFAULT_PERIOD_S, Throttler, check_fraction, check_period
from psclient._core.checks import check_positive
from psclient._core.errors import TaskUnreachableError

_HOST = "127.0.0.1"
_JOBS = ("worker", "ps")
_PORT_ATTEMPTS = 3
# What `psclient serve` logs when TensorFlow could not bind its port.
_PORT_TAKEN = ("Could not start gRPC server", "Failed to add port to server")


def _port_was_taken(error: TaskUnreachableError) -> bool:
    return any(sign in str(error) for sign in _PORT_TAKEN)


def _pick_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = portpicker.pick_unused_port()
        if port not in ports:
            ports.append(port)
    return ports


class LocalCluster:
    """A cluster of real worker and ps task processes on 127.0.0.1.

    `LocalCluster()` returns once every task is serving. It also reserves a
    "chief" address (a free port on 127.0.0.1 that nothing listens on) for the
    coordinator: `cluster.cluster` has "worker", "ps" and "chief" jobs.

    Example:

        with psclient.LocalCluster(num_workers=2, num_ps=1) as local:
            strategy = psclient.ParameterServerStrategy(local.cluster)
            local.kill("worker", 1)      # Fault injection...
            local.restart("worker", 1)   # ...and recovery, at the same address.

    Security: task servers accept unauthenticated RPCs, and TensorFlow binds
    each task's port on ALL network interfaces (it has no option to bind one).
    On Linux every task's port drops packets that do not come over loopback,
    so no other host or network namespace reaches it (the coordinator's port
    likewise, once a `ParameterServerStrategy` connects); elsewhere a
    `RuntimeWarning` says the ports are open. Other users of this machine can
    still reach the tasks over loopback: use it on a trusted machine.

    Args:
        num_workers: number of worker tasks, at least 1.
        num_ps: number of ps tasks, at least 1.
        start_timeout: seconds to wait for every task to be ready.
        log_dir: directory for the tasks' logs (`<job>-<index>.log`, stdout and
            stderr); a temporary directory removed by `close()` when None.
        env: environment variables for the tasks, on top of this process's.
        inter_op_threads: TensorFlow inter-op threads per task (at least 2);
            `psclient serve`'s default when None.
        recycle_when_idle: seconds; each task restarts itself in place (same
            pid and port) once a coordinator has used it and no connection
            has been open to it that long (`psclient serve
            --recycle-when-idle`: TF keeps part of every coordinator's
            context for good). Never when None. Linux only.
        start_method: how a task process starts. "forkserver" (the default
            where it works: Linux with pidfds): forked by one process that
            imported TensorFlow once and serves every `LocalCluster` of this
            process whose tasks get the same environment, so a start or
            restart costs a fork and the task's own server, not TensorFlow's
            import (about 3 CPU seconds a task). "spawn": `python -m psclient
            serve` of its own, each import paid again, as on a real cluster
            (measure restart times with it). The tasks are the same either
            way: same command, options, pipes, session and logs.

    Raises:
        TaskUnreachableError: a task exited or was not ready in time; the
            message names it and quotes the end of its log. The other tasks
            are ended first.
    """

    def __init__(
        self,
        num_workers: int = 2,
        num_ps: int = 1,
        *,
        start_timeout: float = 60.0,
        log_dir: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        inter_op_threads: int | None = None,
        recycle_when_idle: float | None = None,
        start_method: str | None = None,
    ):
        check_positive("num_workers", num_workers, integer=True)
        check_positive("num_ps", num_ps, integer=True)
        check_positive("start_timeout", start_timeout, unit="seconds")
        if inter_op_threads is not None:
            check_inter_op_threads(inter_op_threads)
        if start_method is None:
            start_method = "forkserver" if forkserver.supported() else "spawn"
        elif start_method not in START_METHODS:
            raise ValueError(f"Invalid value for argument `start_method`. Received: start_method={start_method!r}. "
                             f"Expected one of {list(START_METHODS)}.")
        elif start_method == "forkserver" and not forkserver.supported():
            raise ValueError("Invalid value for argument `start_method`. Received: start_method='forkserver' on "
                             f"{sys.platform}. Expected 'spawn': a fork server needs Linux with pidfds (5.3+).")
        self._start_method = start_method
        self._start_timeout = float(start_timeout)
        self._serve_options = [] if inter_op_threads is None else ["--inter-op-threads", str(inter_op_threads)]
        if recycle_when_idle is not None:
            check_positive("recycle_when_idle", recycle_when_idle, unit="seconds")
            self._serve_options += ["--recycle-when-idle", repr(float(recycle_when_idle))]
        self._lock = threading.RLock()
        # Tasks a restart() waits for (without the lock: a fault on another task must not wait
        # for a slow start); another call on one of them waits for that restart to end.
        self._restarting: set[TaskProcess] = set()
        self._restarted = threading.Condition(self._lock)
        self._adding = threading.Lock()  # held by `add_worker` for a whole start, without `_lock`
        self._tempdir = None
        if log_dir is None:
            self._tempdir = tempfile.TemporaryDirectory(prefix="psclient-local-")
            log_dir = self._tempdir.name
        self._log_dir = os.fspath(log_dir)
        os.makedirs(self._log_dir, exist_ok=True)

        if not exposure.supported():
            warnings.warn(
                f"LocalCluster: on {sys.platform} the tasks' ports cannot be restricted: TensorFlow "
                "binds them on all network interfaces and they accept unauthenticated RPCs from any "
                "host that reaches them. Use it only on a trusted network.",
                RuntimeWarning, stacklevel=2)
        self._assign_ports(num_workers, num_ps)
        # TF's INFO banners off in the tasks (warnings and errors stay): their
        # logs, and the lines quoted when a task fails, show what matters.
        self._env = child_env(env, quiet_tf=True)
        self._closed = False
        self._throttler = Throttler()
        # Holds no reference to self, so a forgotten cluster is still collected
        # and its tasks ended (at the latest at interpreter exit). `add_worker` appends to the list.
        self._task_list = list(self._tasks.values())
        self._finalizer = weakref.finalize(
            self, shutdown, self._task_list, self._tempdir, os.getpid(), self._throttler)
        with contextlib.ExitStack() as on_failure:  # Whatever stops the start ends every task.
            on_failure.callback(self.close)
            for attempt in range(_PORT_ATTEMPTS):
                try:
                    self._start(list(self._tasks.values()), self._start_timeout)
                    break
                except TaskUnreachableError as error:
                    # A free port picked here can be taken by another process
                    # before the task binds it (many clusters starting on one
                    # machine): every task's TF_CONFIG names every address, so
                    # start them all again on new ports.
                    if attempt + 1 == _PORT_ATTEMPTS or not _port_was_taken(error):
                        raise
                    for task in self._task_list:
                        task.reap()
                    self._assign_ports(num_workers, num_ps)
                    self._task_list[:] = self._tasks.values()
            on_failure.pop_all()

    def _assign_ports(self, num_workers: int, num_ps: int) -> None:
        ports = _pick_ports(num_workers + num_ps + 1)
        addresses = [f"{_HOST}:{port}" for port in ports]
        self._cluster = Cluster(
            {"worker": addresses[:num_workers], "ps": addresses[num_workers:-1], "chief": addresses[-1:]}
        )
        self._tasks = {
            (job, index): TaskProcess(job, index, address, os.path.join(self._log_dir, f"{job}-{index}.log"))
            for job, index, address in self._cluster.tasks()
        }

    def _start(self, tasks: list[TaskProcess], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._launch(tasks, deadline, timeout)
        wait_ready(tasks, deadline, timeout)

    def _launch(self, tasks: list[TaskProcess], deadline: float, timeout: float) -> None:
        """Starts every task (all at once: a spawned task's TensorFlow import dominates its start),
        without waiting for them to be ready; a fork server's answers count against `deadline`."""
        for position, task in enumerate(tasks):
            env = dict(self._env, TF_CONFIG=self._cluster.to_tf_config(task.job, task.index))
            try:
                launch(task, env, self._serve_options, self._start_method, deadline - time.monotonic())
            except forkserver.ForkServerTimeout:  # still importing TensorFlow, or stopped
                raise not_ready(tasks[position:], timeout) from None

    # Inspection -------------------------------------------------------------

    @property
    def cluster(self) -> Cluster:
        """The `Cluster`: "worker" and "ps" tasks, and the reserved "chief" address."""
        return self._cluster

    @property
    def log_dir(self) -> str:
        return self._log_dir

    def _settled(self, job: str, index: int) -> TaskProcess:
        """The task once no restart of it is in progress; called holding the lock (released while waiting)."""
        task = self._task(job, index)
        self._restarted.wait_for(lambda: task not in self._restarting)
        self._check_open()
        return self._task(job, index)  # an added worker that did not start is gone: a clear error

    def _task(self, job: str, index: int) -> TaskProcess:
        if job not in _JOBS:
            raise ValueError(
                f"Invalid value for argument `job`. Received: job={job!r}. "
                f"Expected one of {list(_JOBS)}."
            )
        count = len(self._cluster.jobs[job])
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
            raise ValueError(
                f"Invalid value for argument `index`. Received: index={index!r}. "
                f"Expected an integer in 0..{count - 1} (this cluster has {count} {job} tasks)."
            )
        return self._tasks[(job, index)]

    def log_path(self, job: str, index: int) -> str:
        """The file that holds the task's stdout and stderr, across restarts."""
        return self._task(job, index).log_path

    def logs(self, job: str, index: int) -> str:
        """The task's output so far (empty after close() removed a temporary log_dir)."""
        try:
            with open(self.log_path(job, index), encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def pid(self, job: str, index: int) -> int | None:
        """The task's process id, or None when it is not running."""
        task = self._task(job, index)
        return task.process.pid if task.alive() else None

    def is_running(self, job: str, index: int) -> bool:
        """Whether the task's process exists (a stopped task still does)."""
        return self._task(job, index).alive()

    # Fault injection --------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("This LocalCluster is closed; create a new one.")

    def kill(self, job: str, index: int) -> None:
        """SIGKILLs the task and waits for its process to be gone (its throttle ends)."""
        with self._lock:
            self._check_open()
            task = self._settled(job, index)
            self._unthrottle(task, forget=True)
            task.reap()

    def _signal_live(self, job: str, index: int, sig: signal.Signals) -> TaskProcess:
        with self._lock:
            self._check_open()
            task = self._settled(job, index)
            if not task.alive():
                raise RuntimeError(f"Task {task.name} is not running ({task.state()}); restart() it first.")
            task.process.send_signal(sig)
            return task

    def stop(self, job: str, index: int) -> None:
        """Freezes the task (SIGSTOP): it keeps its connections but answers nothing.

        A throttle pauses meanwhile and goes on at `resume`.
        """
        with self._lock:
            self._check_open()
            task = self._settled(job, index)
            if not task.stopped:
                self._unthrottle(task)
            self._signal_live(job, index, signal.SIGSTOP).stopped = True

    def resume(self, job: str, index: int) -> None:
        """Unfreezes a stopped task (SIGCONT); a throttle set before goes on."""
        with self._lock:
            task = self._signal_live(job, index, signal.SIGCONT)
            task.stopped = False
            if task.throttle < 1:
                self._throttler.set(task.process.pid, task.throttle, task.period)

    def throttle(self, job: str, index: int, fraction: float, *, period: float = DEFAULT_PERIOD_S) -> None:
        """Runs the task at `fraction` of its normal speed (1.0 restores it), to make a straggler.

        A helper process stops and continues the task on a duty cycle: it runs
        `fraction * period` s of every `period` s. A call in flight there
        takes longer by the stopped parts; the task still answers, late.
        Returns once applied. The throttle lasts until another `throttle`,
        `kill` or `restart` (the new process runs at full speed) or `close`;
        `stop`/`resume` pause it.

        Raises:
            ValueError: `fraction` not in (0, 1], or `period` not in [0.005, 10] s.
            RuntimeError: the task is not running, or the cluster is closed.
        """
        fraction, period = check_fraction(fraction), check_period(period)
        with self._lock:
            self._check_open()
            task = self._settled(job, index)
            if not task.alive():
                raise RuntimeError(f"Task {task.name} is not running ({task.state()}); restart() it first.")
            task.throttle, task.period = fraction, period
            if not task.stopped:
                self._throttler.set(task.process.pid, fraction, period)

    def throttled(self) -> dict[tuple[str, int], float]:
        """{(job, index): fraction} of every task running below full speed."""
        with self._lock:
            return {key: t.throttle for key, t in self._tasks.items() if t.throttle < 1 and t.alive()}

    def _unthrottle(self, task: TaskProcess, forget: bool = False) -> None:
        if task.throttle < 1 and task.alive():
            self._throttler.set(task.process.pid, 1.0)
        if forget:
            task.throttle = 1.0

    def restart(self, job: str, index: int, timeout: float | None = None) -> None:
        """Kills the task if it is alive, starts it again at the same address and
        waits until it is ready (at most `timeout` s, default `start_timeout`).

        The wait does not hold up calls on the other tasks (a `stop`, `resume`
        or `kill` of another task from another thread goes ahead at once); a
        call on this task waits for the restart to end.

        Raises:
            TaskUnreachableError: the new process exited or was not ready in time.
        """
        check_positive("timeout", timeout, optional=True, unit="seconds")
        limit = self._start_timeout if timeout is None else float(timeout)
        with self._lock:
            self._check_open()
            task = self._settled(job, index)
            self._unthrottle(task, forget=True)
            task.reap()
            with open(task.log_path, "a", encoding="utf-8") as log:
                log.write(f"--- psclient LocalCluster: restarting {task.name} ---\n")
            deadline = time.monotonic() + limit
            self._restarting.add(task)
        self._start_unlocked(task, deadline, limit, functools.partial(self._reap_locked, task))

    def _start_unlocked(self, task: TaskProcess, deadline: float, limit: float, undo: Callable[[], None]) -> None:
        """Starts `task` (put in `_restarting` under the lock), holding the lock only to launch it:
        the wait until it is ready holds up no call on another task. `undo()` if it does not start
        (a task that did not start is not left half up). Called without the lock."""
        try:
            with contextlib.ExitStack() as on_failure:
                on_failure.callback(undo)
                with self._lock:
                    self._check_open()
                    self._launch([task], deadline, limit)
                wait_ready([task], deadline, limit)
                on_failure.pop_all()
        finally:
            with self._lock:
                self._restarting.discard(task)
                self._restarted.notify_all()

    def _reap_locked(self, task: TaskProcess) -> None:
        with self._lock:
            task.reap()

    # Life cycle -------------------------------------------------------------

    def add_worker(self, timeout: float | None = None) -> int:
        """Starts one more worker task at a new port on 127.0.0.1; returns its index.

        Waits until it serves (at most `timeout` s, default `start_timeout`).
        Its address is `cluster.address("worker", index)` (also the last of
        `cluster.workers`); give it to `ParameterServerStrategy.add_worker`.

        Raises:
            TaskUnreachableError: the new process exited or was not ready in
                time (it is ended, and the cluster is as before).
            RuntimeError: the cluster is closed.
        """
        check_positive("timeout", timeout, optional=True, unit="seconds")
        limit = self._start_timeout if timeout is None else float(timeout)
        # One worker added at a time (one that fails takes back the cluster it grew), and the
        # cluster's lock held only to launch it, as a restart does: a kill, stop or resume of
        # another task goes ahead while it starts, and a call on it waits for its start to end.
        with self._adding:
            with self._lock:
                self._check_open()
                index = self._cluster.num_workers
                taken = {address for addresses in self._cluster.jobs.values() for address in addresses}
                address = f"{_HOST}:{portpicker.pick_unused_port()}"
                while address in taken:  # the reserved chief port is free too: portpicker may offer it
                    address = f"{_HOST}:{portpicker.pick_unused_port()}"
                # The tasks started before keep their TF_CONFIG: any cluster that
                # names a task's own address serves it. The new one is owned as
                # the first ones are from here (close() and the exit finalizer end it).
                jobs = self._cluster.jobs
                jobs["worker"].append(address)
                task = TaskProcess("worker", index, address, os.path.join(self._log_dir, f"worker-{index}.log"))
                self._tasks[("worker", index)] = task  # before the cluster names it: `pid` reads both unlocked
                self._task_list.append(task)
                previous, self._cluster = self._cluster, Cluster(jobs)
                self._restarting.add(task)
                deadline = time.monotonic() + limit
            # A worker that did not start leaves no trace.
            self._start_unlocked(task, deadline, limit, functools.partial(self._forget_added, task, previous))
        return index

    def _forget_added(self, task: TaskProcess, previous: Cluster) -> None:
        """Ends an added worker that did not start and gives the cluster back as it was before it."""
        with self._lock:
            task.reap()
            self._cluster = previous
            del self._tasks[("worker", task.index)]
            self._task_list.remove(task)

    def close(self) -> None:
        """Ends every task (SIGTERM, then SIGKILL after a few seconds) and reaps them.

        A strategy still connected to these tasks is shut down first, while they
        answer (see `ParameterServerStrategy.shutdown`); not while one is stopped
        (`stop`), as its calls would wait for it: the tasks then end at once, as
        before. Removes the temporary log directory, if this cluster made one.
        Safe to call more than once.
        """
        try:
            # Not the hooks again on a second close.
            if self._finalizer.alive and not any(task.stopped for task in self._task_list):
                closing.run_before_close(self._cluster)  # outside the lock: a hook may wait on calls that resume a task
        finally:
            with self._lock:
                self._closed = True
                self._finalizer()  # Runs shutdown at most once.

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        tasks = ", ".join(f"{t.name}={t.address} ({t.state()})" for t in self._tasks.values())
        state = "closed" if self._closed else "open"
        return f"<LocalCluster {state}: {tasks}; chief={self._cluster.chief} (reserved)>"
