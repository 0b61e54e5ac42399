"""A task SIGSTOPped for the length of a `with` block, with a watchdog that resumes it.

A coordinator that freezes while a task hangs could never resume the task
itself, and the test would hang with it: a process of its own sends SIGCONT
after `watchdog_s` at the latest. Leaving the block resumes the task and
stops the watchdog.
"""

import contextlib
import os
import signal
import subprocess

import psutil

__all__ = ["is_stopped", "resume_later", "stopped"]


@contextlib.contextmanager
def stopped(cluster, job: str, index: int, *, watchdog_s: float):
    cluster.stop(job, index)
    watchdog = resume_later(cluster.pid(job, index), watchdog_s)
    try:
        yield
    finally:
        cluster.resume(job, index)
        watchdog()


def resume_later(pid: int, seconds: float):
    """A process of its own that sends SIGCONT to `pid` after `seconds`; returns what stops it.

    In a session of its own, so that stopping it ends its `sleep` too (killing only the shell
    left the `sleep` running, holding any pipe it inherited: a parent reading this process's
    output waited for it), and with no output of its own.
    """
    watchdog = subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {pid}"], start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop():
        with contextlib.suppress(ProcessLookupError):  # it already ended
            os.killpg(watchdog.pid, signal.SIGKILL)
        watchdog.wait()

    return stop


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP); False once it has ended."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False
