"""Shared parts of psclient's benchmarks: clusters, coordinator subprocesses, output.

A benchmark is one parent process that starts a `psclient.LocalCluster` and
then runs each measured path in its own coordinator subprocess (TensorFlow's
eager context is process-global, so one process can hold one coordinator
connection). The parent collects one JSON line from each child and prints one
JSON object on stdout; progress goes to stderr.

Ownership: the parent owns the cluster and every child. A child watches its
stdin, a pipe only the parent holds, and exits as soon as it sees EOF, so a
parent that dies in any way (even SIGKILL) takes its children with it; the
task processes of `LocalCluster` do the same on their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Iterator, Sequence

__all__ = [
    "ChildError",
    "child_exit",
    "cpu_seconds",
    "environment",
    "exit_with_parent",
    "local_cluster",
    "log",
    "machine_busy_seconds",
    "median",
    "print_json",
    "quiet_tf_env",
    "run_child",
    "stop_on_sigterm",
    "task_usage",
]


# ----------------------------------------------------------------- output
def log(message: str) -> None:
    """A progress line on stderr, timestamped."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")
    sys.stdout.flush()


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def environment(argv: Sequence[str]) -> dict:
    """Versions, machine and command line, for a benchmark's `config`."""
    import importlib.metadata

    import psclient  # Cheap: it imports TensorFlow lazily, as do we here.

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable_cpus = os.cpu_count()
    return {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *argv]),
        "python": platform.python_version(),
        **{name: version(name) for name in ("tensorflow", "keras", "tf-keras", "numpy", "psutil")},
        "psclient": psclient.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus,
    }


# -------------------------------------------------------------- processes
def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds used so far by the processes `pids` together."""
    import psutil

    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def machine_busy_seconds() -> float:
    """CPU seconds all CPUs of this machine have spent busy (not idle) since boot."""
    import psutil

    times = psutil.cpu_times()
    return sum(getattr(times, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))


def task_usage(pids: Sequence[int]) -> dict:
    """Resident memory (MiB) and thread count of the processes `pids` together."""
    import psutil

    processes = [psutil.Process(pid) for pid in pids]
    return {
        "rss_mib": round(sum(p.memory_info().rss for p in processes) / 2**20, 1),
        "threads": sum(p.num_threads() for p in processes),
    }


@contextlib.contextmanager
def local_cluster(num_workers: int, num_ps: int) -> Iterator[tuple[Any, dict[str, int]]]:
    """A running `psclient.LocalCluster`: yields its `Cluster` and {"worker:0": pid, ...}.

    The cluster's tasks run in their own sessions, so a Ctrl-C reaches only
    the parent (and its coordinator children), whose `finally` then closes it.
    """
    import psclient

    with psclient.LocalCluster(num_workers=num_workers, num_ps=num_ps) as local:
        cluster = local.cluster
        pids = {f"{job}:{index}": local.pid(job, index) for job, index, _ in cluster.tasks()}
        yield cluster, pids


def quiet_tf_env(**extra: str) -> dict[str, str]:
    """This environment, with TensorFlow's C++ info logs off, plus `extra`."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra)
    return env


class ChildError(RuntimeError):
    """A benchmark subprocess failed, timed out or printed no JSON result."""


def run_child(argv: Sequence[str], *, timeout: float, env: dict[str, str] | None = None) -> dict:
    """Runs `python argv...` and returns the JSON object on its last stdout line.

    The child's stdin is a pipe held open until it ends (see `exit_with_parent`).
    Raises `ChildError` (with the end of its stderr) if it exits non-zero, runs
    past `timeout` seconds, or prints no JSON. On any exception here, including
    KeyboardInterrupt, the child is killed and reaped before it propagates.
    """
    command = [sys.executable, *argv]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, env=env)
        try:
            try:
                rc = child.wait(timeout)
            except subprocess.TimeoutExpired:
                raise ChildError(
                    f"timed out after {timeout:.0f} s (killed): {_tail(err)}"
                ) from None
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            child.stdin.close()
        if rc != 0:
            raise ChildError(f"exited with status {rc}: {_tail(err)}")
        out.seek(0)
        lines = [line for line in out.read().splitlines() if line.strip()]
        try:
            return json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            raise ChildError(f"printed no JSON result: {_tail(err)}") from None


def _tail(file, lines: int = 15) -> str:
    file.seek(0)
    text = "\n".join(file.read().splitlines()[-lines:])
    return f"stderr ends with:\n{text}" if text else "stderr is empty"


def exit_with_parent() -> None:
    """In a child of `run_child`: exit at once when the parent closes our stdin."""

    def watch() -> None:
        try:
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except OSError:
            pass
        os._exit(3)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def child_exit(result: dict | None, status: int = 0) -> None:
    """Prints a child's result (if any) as one JSON line and exits at once.

    `os._exit` skips TensorFlow's destructors, which can hang a normal exit of
    a process connected to a cluster.
    """
    if result is not None:
        sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Turns SIGTERM into SystemExit(143), so `finally` blocks stop what we started."""

    def handle(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
