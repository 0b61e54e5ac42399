"""One task process this process started and owns: launched, waited for, ended.

A task is `python -m psclient serve` in its own session, with two pipes to
this process: it writes "ready" to one once it serves, and it exits by itself
when the other reaches EOF, that is when this process is gone (even by
SIGKILL), because only this process holds its write end. Children this
process forks close their copies of those ends at once
(`os.register_at_fork`). `LocalCluster` (local.py) decides which tasks run
where; this module knows how one runs: forked by a fork server that imported
TensorFlow once (forkserver.py), or as a process of its own.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass

from psclient._cluster import exposure, forkserver
from psclient._cluster.throttle import DEFAULT_PERIOD_S, Throttler
from psclient._core.errors import TaskUnreachableError

__all__ = ["START_METHODS", "TaskProcess", "launch", "not_ready", "shutdown", "wait_ready"]

# How long close() lets tasks exit after SIGTERM before it SIGKILLs them.
_TERM_GRACE_S = 5.0
# Bound on reaping a SIGKILLed process (it cannot resist, but may be in I/O).
_REAP_TIMEOUT_S = 30.0
_LOG_TAIL_LINES = 20


@dataclass(eq=False)  # Hashed by identity: _LIVE_TASKS holds them.
class TaskProcess:
    """One task process and the pipes that tie it to this process."""

    job: str
    index: int
    address: str
    log_path: str
    process: subprocess.Popen | forkserver.ForkedProcess | None = None
    parent_w: int | None = None  # Held, never written: EOF tells the task we are gone.
    ready_r: int | None = None  # Open only while waiting for "ready".
    waiting: bool = False  # A thread selects on ready_r (`wait_ready`): it closes it, no one else.
    stopped: bool = False
    throttle: float = 1.0  # The fraction of its speed `LocalCluster.throttle` set...
    period: float = DEFAULT_PERIOD_S  # ...and the length of its duty cycle.

    @property
    def name(self) -> str:
        return f"{self.job}:{self.index}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def close_fds(self, *, waited_on: bool = False) -> None:
        """Closes our pipe ends; not `ready_r` while a `wait_ready` selects on it (a close()
        during a restart: the waiter sees the task's EOF and closes it) unless `waited_on`."""
        for attr in ("parent_w", "ready_r"):
            if attr == "ready_r" and self.waiting and not waited_on:
                continue
            fd = getattr(self, attr)
            if fd is not None:
                os.close(fd)
                setattr(self, attr, None)

    def reap(self) -> None:
        """SIGKILLs the process if alive, waits for it and closes the pipes."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGCONT)  # Harmless, and a stopped task reaps faster.
                self.process.kill()
            self.process.wait(timeout=_REAP_TIMEOUT_S)
        self.stopped = False
        self.close_fds()

    def state(self) -> str:
        if self.process is None:
            return "not started"
        code = self.process.poll()
        if code is None:
            return f"pid {self.process.pid}, " + ("stopped" if self.stopped else "running")
        return f"exited {code}"


# Every task whose pipe ends this process holds: a child forked from here
# closes them at once, so that only this process keeps its tasks alive.
_LIVE_TASKS: weakref.WeakSet = weakref.WeakSet()


def _forget_tasks_in_child() -> None:
    for task in list(_LIVE_TASKS):
        task.close_fds(waited_on=True)  # no thread of the parent's runs here
        task.process = None  # Not this child's to signal or reap.
    _LIVE_TASKS.clear()


os.register_at_fork(after_in_child=_forget_tasks_in_child)


def _log_tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError as e:
        return f"(cannot read {path}: {e.strerror})"
    return "\n".join("    " + line for line in lines[-_LOG_TAIL_LINES:])


#: How `launch` starts a task: forked by this process's fork server, or a process of its own.
START_METHODS = ("forkserver", "spawn")


def launch(task: TaskProcess, env: dict[str, str], serve_options: list[str], start_method: str = "spawn",
           timeout: float = 60.0) -> None:
    """Starts `task`'s process; does not wait for it to be ready.

    "forkserver": forked by the fork server for `env` (forkserver.py; started if none runs, and
    started again once if it has just exited: it idles out); `timeout` bounds its answer.
    "spawn": `python -m psclient serve` of its own."""
    # os.pipe() fds are non-inheritable: a task inherits only the two ends in
    # pass_fds, so the write end of each parent pipe stays in this process alone.
    # Our ends belong to the task at once: its close_fds() (run by reap()) closes
    # them, also when Popen fails below.
    task.ready_r, ready_w = os.pipe()
    parent_r, task.parent_w = os.pipe()
    _LIVE_TASKS.add(task)
    options = ["--job", task.job, "--index", str(task.index)]
    if not exposure.supported():
        # No socket filters: serve would refuse to start. LocalCluster has
        # warned (RuntimeWarning) that the ports are open.
        options.append("--allow-any-host")
    options += serve_options
    argv = [sys.executable, "-m", "psclient", "serve", *options, "--ready-fd", str(ready_w),
            "--parent-fd", str(parent_r)]
    try:
        if start_method == "forkserver":
            task.process = _forked(options, env, task.log_path, {"--ready-fd": ready_w, "--parent-fd": parent_r},
                                   timeout)
            return
        with open(task.log_path, "ab") as log:
            task.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, pass_fds=(ready_w, parent_r),
                # Own session: a Ctrl-C in the terminal reaches the coordinator,
                # which decides what happens to the tasks, not the tasks directly.
                start_new_session=True,
            )
    finally:
        os.close(ready_w)
        os.close(parent_r)


def _forked(options: list[str], env: dict[str, str], log_path: str, fds: dict[str, int], timeout: float):
    try:
        return forkserver.server_for(env).spawn(options, env, log_path, fds, timeout)
    except forkserver.ForkServerGone:  # it idled out just as we asked: start another
        return forkserver.server_for(env).spawn(options, env, log_path, fds, timeout)


def _failure(task: TaskProcess, what: str) -> TaskUnreachableError:
    return TaskUnreachableError(
        f"Task {task.name} ({task.address}) {what}. Last lines of its log "
        f"{task.log_path}:\n{_log_tail(task.log_path)}",
        task=task.name, address=task.address,
    )


def not_ready(pending: list[TaskProcess], timeout: float) -> TaskUnreachableError:
    """The error of a start that gave up after `timeout` s: it names every task not ready."""
    names = ", ".join(f"{t.name} ({t.address})" for t in pending)
    return _failure(pending[0], f"was not ready within {timeout} s (not ready: {names})")


def wait_ready(tasks: list[TaskProcess], deadline: float, timeout: float) -> None:
    """Waits until every task wrote "ready" to its pipe, against one deadline.

    Raises:
        TaskUnreachableError: a task exited first, or the deadline passed.
    """
    with selectors.DefaultSelector() as selector:
        for task in tasks:
            selector.register(task.ready_r, selectors.EVENT_READ, task)
            task.waiting = True
        try:
            _wait(selector, deadline, timeout)
        finally:
            for task in tasks:
                task.waiting = False


def _wait(selector: selectors.BaseSelector, deadline: float, timeout: float) -> None:
    """Reads each registered task's "ready" (or its EOF) until none is left or the deadline passes."""
    while selector.get_map():
        remaining = deadline - time.monotonic()
        events = selector.select(remaining) if remaining > 0 else []
        if not events:
            raise not_ready([key.data for key in selector.get_map().values()], timeout)
        for key, _ in events:
            task = key.data
            selector.unregister(key.fd)
            message = os.read(key.fd, 64)
            os.close(key.fd)
            task.ready_r = None
            if not message.startswith(b"ready"):  # EOF: the task died first.
                try:
                    code = task.process.wait(timeout=_TERM_GRACE_S)
                except subprocess.TimeoutExpired:
                    code = "unknown"
                raise _failure(task, f"exited with status {code} before it was ready")


def shutdown(tasks: list[TaskProcess], tempdir: tempfile.TemporaryDirectory | None, owner: int,
              throttler: Throttler) -> None:
    """Ends the throttle helper, then every task: SIGTERM, a grace period, then SIGKILL; reaps all.

    Only in the process that started them (`owner`): a forked child that
    exits runs this finalizer too, and must leave its parent's tasks alone.
    """
    if os.getpid() != owner:
        return
    throttler.close()  # First: it continues the tasks it stopped.
    live = [t for t in tasks if t.alive()]
    for task in live:
        # A stopped task cannot handle SIGTERM (stop(), or a throttle helper that was killed).
        task.process.send_signal(signal.SIGCONT)
        task.process.terminate()
    deadline = time.monotonic() + _TERM_GRACE_S
    for task in live:
        try:
            task.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # reap() below SIGKILLs it.
    for task in tasks:
        task.reap()
    if tempdir is not None:
        tempdir.cleanup()
