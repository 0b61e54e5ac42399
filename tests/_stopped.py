"""A task SIGSTOPped for the length of a `with` block, with a watchdog that resumes it.

A coordinator that freezes while a task hangs could never resume the task
itself, and the test would hang with it: a process of its own sends SIGCONT
after `watchdog_s` at the latest. Leaving the block resumes the task and
stops the watchdog.
"""

import contextlib
import subprocess

__all__ = ["stopped"]


@contextlib.contextmanager
def stopped(cluster, job: str, index: int, *, watchdog_s: float):
    cluster.stop(job, index)
    watchdog = subprocess.Popen(["sh", "-c", f"sleep {watchdog_s}; kill -CONT {cluster.pid(job, index)}"])
    try:
        yield
    finally:
        cluster.resume(job, index)
        watchdog.kill()
        watchdog.wait()
