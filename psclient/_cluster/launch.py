"""`psclient launch`: a local cluster, a training script and an optional evaluator, as one job.

The launcher owns every process of the job:

- the task processes, through a `LocalCluster` (loopback only);
- the training script (the coordinator, "chief"), given the cluster in TF_CONFIG;
- the evaluator command, if any, given TF_CONFIG with an "evaluator" task
  (it never connects to the cluster; it reads checkpoints).

Each child runs in its own process group, so a terminal's Ctrl-C reaches only
the launcher, which decides: it forwards the signal to the script and the
evaluator, escalates to SIGTERM and SIGKILL if they do not exit, and closes
the cluster. Children also get SIGTERM if the launcher dies without cleaning
up (Linux's parent-death signal). Every output line is prefixed with its
process's name. The launcher exits with the script's exit status.
"""

from __future__ import annotations

import ctypes
import os
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO

import portpicker

from psclient._cluster.process import child_env, is_tf_banner
from psclient._cluster.server import local_security_warning
from psclient._cluster.spec import Cluster
from psclient._core.errors import TaskUnreachableError

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TICK_S = 0.5  # How often task liveness is checked while waiting for the script.
_TAIL_INTERVAL_S = 0.2  # How often task log files are read for new lines.


@dataclass(frozen=True)
class LaunchConfig:
    """What `psclient launch` was asked to run."""

    command: list[str]
    num_workers: int = 2
    num_ps: int = 1
    evaluator: str | None = None  # A command line, split with shlex (no shell).
    restart_failed: bool = False
    max_restarts: int = 3  # Per task.
    log_dir: str | None = None
    evaluator_timeout: float = 300.0  # How long the evaluator may run on after the script.
    grace: float = 10.0  # How long a signalled child may take to exit before the next, harder signal.


class _Output:
    """Writes lines prefixed with their source's name, one whole line at a time."""

    def __init__(self, stream: IO[str], names: list[str]):
        self._stream = stream
        self._width = max(len(n) for n in names)
        self._lock = threading.Lock()

    def line(self, name: str, text: str) -> None:
        with self._lock:
            self._stream.write(f"{name:<{self._width}} | {text.rstrip(chr(10))}\n")
            self._stream.flush()


def _pipe_to_output(pipe: IO[bytes], name: str, output: _Output) -> threading.Thread:
    """A thread that copies a child's output to `output` until EOF; the caller joins it."""

    def copy() -> None:
        with pipe:
            for raw in pipe:
                output.line(name, raw.decode("utf-8", "replace"))

    thread = threading.Thread(target=copy, name=f"psclient-launch-{name}", daemon=True)
    thread.start()
    return thread


class _LogTailer:
    """Follows the task log files (appended across restarts) and prefixes their lines.

    TensorFlow's start-up INFO banners (`is_tf_banner`), which every task and
    every restart prints, are left out: the files keep them; warnings and
    errors are shown.
    """

    def __init__(self, paths: dict[str, str], output: _Output):
        self._paths = paths
        self._offsets = {name: 0 for name in paths}
        self._partial = {name: b"" for name in paths}
        self._output = output
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="psclient-launch-logs")

    def start(self) -> None:
        self._thread.start()

    def _read_new(self) -> None:
        for name, path in self._paths.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets[name])
                    data = f.read()
            except OSError:
                continue
            self._offsets[name] += len(data)
            *lines, self._partial[name] = (self._partial[name] + data).split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", "replace")
                if not is_tf_banner(line):
                    self._output.line(name, line)

    def _run(self) -> None:
        while not self._stop.wait(_TAIL_INTERVAL_S):
            self._read_new()
        self._read_new()  # What the tasks wrote last.

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # Started.
            self._thread.join()


def _parent_death_signal():
    """A preexec_fn: SIGTERM to the child when the launcher's thread dies (Linux), or None.

    The launcher starts its children from its main thread, which lives as long
    as the launcher, so this fires when the launcher process is gone, however
    it died. prctl is looked up here, in the parent: after fork, the child only
    calls it (no dlopen, whose lock another thread may have held at fork time).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):
        return None
    return lambda: prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


class _Child:
    """One child command in its own process group, its output prefixed with `name`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], output: _Output):
        self.name = name
        self.process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, preexec_fn=_parent_death_signal(),
        )
        self._reader = _pipe_to_output(self.process.stdout, name, output)

    def send(self, sig: int) -> None:
        """Sends `sig` to the child's whole process group (its own children too)."""
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass  # Already gone (and its group with it).

    def stop(self, grace: float, first: int = signal.SIGTERM) -> None:
        """Signals the group with `first`, then SIGKILL after `grace` s; reaps it."""
        if self.process.poll() is None:
            self.send(first)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self.send(signal.SIGKILL)  # Also ends anything the child left in its group.
        self.process.wait()
        # Its output ends with the group; a process that left the group and kept
        # the pipe open must not hold the caller (the reader is a daemon).
        self._reader.join(timeout=_READER_GRACE_S)


#: How long `_Child.stop` waits for the last of a stopped child's output.
_READER_GRACE_S = 5.0


def exit_status(returncode: int) -> int:
    """A shell-style exit status: 128 + N for a child ended by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class _Signals:
    """Signals delivered to the launcher, read from a wakeup fd in its main loop.

    A Python handler only runs when the main thread executes bytecode; the
    wakeup fd lets the main loop block in select() and still see every signal.
    """

    def __init__(self):
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        os.set_blocking(self.read_fd, False)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd)
        self._previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in _SIGNALS}

    def received(self) -> list[int]:
        try:
            return [s for s in os.read(self.read_fd, 64) if s in _SIGNALS]
        except BlockingIOError:
            return []

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self.read_fd)
        os.close(self._write_fd)


class Launcher:
    """Runs one `LaunchConfig`; `run()` returns the script's exit status."""

    def __init__(self, config: LaunchConfig, stream: IO[str] | None = None):
        self.config = config
        self._stream = stream or sys.stdout
        self._restarts: dict[str, int] = {}
        self._reported_down: set[str] = set()
        self._interrupts = 0

    def _say(self, text: str) -> None:
        self._output.line("launch", text)

    def run(self) -> int:
        from psclient._cluster.local import (
            LocalCluster,  # Imported here: `psclient --help` stays light.
        )

        c = self.config
        task_names = [f"worker:{i}" for i in range(c.num_workers)] + [f"ps:{i}" for i in range(c.num_ps)]
        self._output = _Output(self._stream, task_names + ["launch", "chief", "evaluator"])
        signals = _Signals()  # Before anything starts: a Ctrl-C from now on is handled.
        children: list[_Child] = []
        tailer = None
        local = None
        # Our own temporary log directory, not LocalCluster's: the tailer reads
        # the tasks' last lines after close(), which would delete LocalCluster's.
        tempdir = tempfile.TemporaryDirectory(prefix="psclient-launch-") if c.log_dir is None else None
        try:
            self._say(local_security_warning())
            self._say(f"starting a local cluster: {c.num_workers} worker(s), {c.num_ps} ps on 127.0.0.1")
            local = LocalCluster(c.num_workers, c.num_ps, log_dir=c.log_dir or tempdir.name)
            tailer = _LogTailer({name: local.log_path(*_split(name)) for name in task_names}, self._output)
            tailer.start()
            self._say(f"cluster ready: {local.cluster.jobs}; task logs in {local.log_dir}")
            early = signals.received()
            if early:  # Interrupted while the cluster started: run nothing.
                self._say(f"{signal.Signals(early[0]).name}: stopping before the script starts")
                return 128 + early[0]
            chief_env = child_env(tf_config=local.cluster.to_tf_config("chief", 0))
            script = _Child("chief", c.command, chief_env, self._output)
            children.append(script)
            self._say(f"started the script (pid {script.process.pid}): {shlex.join(c.command)}")
            evaluator = None
            if c.evaluator:
                jobs = dict(local.cluster.jobs, evaluator=[f"127.0.0.1:{portpicker.pick_unused_port()}"])
                tf_config = Cluster(jobs).to_tf_config("evaluator", 0)
                evaluator = _Child("evaluator", shlex.split(c.evaluator), child_env(tf_config=tf_config), self._output)
                children.append(evaluator)
                self._say(f"started the evaluator (pid {evaluator.process.pid}): {c.evaluator}")
            self._supervise(script, evaluator, local, signals)
            status = exit_status(script.process.wait())
            self._say(f"the script exited with status {status}")
            if evaluator is not None and status == 0:
                self._wait_for_evaluator(evaluator, signals)
            elif evaluator is not None:  # Training failed: no final marker will come.
                self._say("stopping the evaluator: the script failed")
            return status
        finally:
            for child in children:
                child.stop(c.grace)
            if local is not None:
                local.close()
            if tailer is not None:
                tailer.close()
            if tempdir is not None:
                tempdir.cleanup()
            signals.close()

    def _wait_for(self, child: _Child, signals: _Signals, deadline: float | None) -> bool:
        """Blocks until `child` exits (True), a signal arrives or the deadline passes (False)."""
        if child.process.poll() is not None:
            return True
        try:  # Unreaped, so the pid is still this child's.
            fds = [os.pidfd_open(child.process.pid)]
        except (AttributeError, OSError):  # No pidfd: fall back to ticking.
            fds = []
        try:
            timeout = _TICK_S if deadline is None else max(0.0, min(_TICK_S, deadline - time.monotonic()))
            select.select([signals.read_fd, *fds], [], [], timeout)
        finally:
            for fd in fds:
                os.close(fd)
        return child.process.poll() is not None

    def _supervise(self, script: _Child, evaluator: _Child | None, local, signals: _Signals) -> None:
        """Waits for the script; forwards signals; restarts crashed tasks if asked."""
        escalate_at = None
        harder = [signal.SIGTERM, signal.SIGKILL]
        while not self._wait_for(script, signals, None):
            for sig in signals.received():
                self._interrupts += 1
                name = signal.Signals(sig).name
                if self._interrupts == 1:
                    self._say(f"{name}: forwarded to the script and the evaluator; again to stop at once")
                    for child in (script, evaluator):
                        if child is not None:
                            child.send(sig)
                    escalate_at = time.monotonic() + self.config.grace
                else:
                    self._say(f"{name} again: killing the script")
                    script.send(signal.SIGKILL)
            if escalate_at is not None and time.monotonic() >= escalate_at and harder:
                sig = harder.pop(0)
                self._say(f"the script did not exit within {self.config.grace:g} s: sending "
                          f"{signal.Signals(sig).name}")
                script.send(sig)
                escalate_at = time.monotonic() + self.config.grace
            if self._interrupts == 0:
                self._check_tasks(local)

    def _check_tasks(self, local) -> None:
        for job, index, _ in local.cluster.tasks():
            name = f"{job}:{index}"
            if local.is_running(job, index):
                self._reported_down.discard(name)
                continue
            used = self._restarts.get(name, 0)
            if self.config.restart_failed and used < self.config.max_restarts:
                self._restarts[name] = used + 1
                self._say(f"{name} exited; restarting it ({used + 1}/{self.config.max_restarts})")
                try:
                    local.restart(job, index)
                except (TaskUnreachableError, OSError) as e:  # Reported; the next tick tries again.
                    self._say(f"restarting {name} failed: {e}")
            elif name not in self._reported_down:
                self._reported_down.add(name)
                why = "restart budget used up" if self.config.restart_failed else "--restart-failed not set"
                self._say(f"{name} exited and is not restarted ({why})")

    def _wait_for_evaluator(self, evaluator: _Child, signals: _Signals) -> None:
        timeout = self.config.evaluator_timeout
        if self._interrupts:
            return  # Interrupted: the finally clause stops it now.
        self._say(f"waiting up to {timeout:g} s for the evaluator to finish")
        deadline = time.monotonic() + timeout
        while not self._wait_for(evaluator, signals, deadline):
            if signals.received():
                self._say("interrupted: stopping the evaluator")
                return
            if time.monotonic() >= deadline:
                self._say(f"the evaluator did not finish within {timeout:g} s: stopping it")
                return
        self._say(f"the evaluator exited with status {exit_status(evaluator.process.returncode)}")


def _split(name: str) -> tuple[str, int]:
    job, index = name.split(":")
    return job, int(index)


def launch(config: LaunchConfig, stream: IO[str] | None = None) -> int:
    """Runs `config` to the end; returns the script's exit status. Main thread only."""
    return Launcher(config, stream).run()
