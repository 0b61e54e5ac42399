"""Stragglers on demand: `LocalCluster.throttle` runs a task at a fraction of its speed.

A `Throttler` owns one helper process (`throttle_helper.py`) that stops and
continues throttled tasks on a duty cycle (SIGSTOP/SIGCONT). Why a process of
its own: a thread of the coordinator would be held up by the GIL, which
TensorFlow calls keep for long stretches, and the stopped part of each cycle
would stretch with them.

Ownership, as for the task processes (`local.py`): the helper exits, after
continuing every process it stopped, when `close()` closes its command pipe,
when this process dies however it dies (EOF on that pipe: only this process
holds its write end, children forked from here close theirs at once), and on
Linux by its parent-death signal as well.
"""

from __future__ import annotations

import math
import os
import select
import subprocess
import sys
import threading
import weakref

from psclient._cluster import throttle_helper
from psclient._cluster.throttle_helper import DEFAULT_PERIOD_S

# How long a command may wait for the helper's answer (it answers in
# microseconds; this bounds a helper that was itself stopped or starved).
_REPLY_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0


def check_fraction(fraction: object) -> float:
    """Returns `fraction` as a float if 0 < fraction <= 1; raises ValueError naming it otherwise."""
    ok = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
    if ok and not (math.isfinite(fraction) and 0 < fraction <= 1):
        ok = False
    if not ok:
        raise ValueError(
            f"Invalid value for argument `fraction`. Received: fraction={fraction!r}. "
            "Expected a number with 0 < fraction <= 1: the share of its normal speed the task "
            "runs at (1.0 restores full speed)."
        )
    return float(fraction)


def check_period(period: object) -> float:
    ok = isinstance(period, (int, float)) and not isinstance(period, bool)
    if not ok or not (math.isfinite(period) and 0.005 <= period <= 10):
        raise ValueError(
            f"Invalid value for argument `period`. Received: period={period!r}. "
            "Expected a number of seconds in [0.005, 10]: the length of one run/stop cycle."
        )
    return float(period)


# Every throttler whose pipe this process holds: a forked child closes its
# copies at once, so that only this process keeps the helper alive.
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _forget_in_child() -> None:
    for throttler in list(_LIVE):
        throttler._forget()
    _LIVE.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class Throttler:
    """Sets the duty cycle of processes through one helper process, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._owner = os.getpid()
        _LIVE.add(self)

    @property
    def pid(self) -> int | None:
        """The helper's process id, or None when none runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def set(self, pid: int, fraction: float, period: float = DEFAULT_PERIOD_S) -> bool:
        """Runs process `pid` at `fraction` of its speed (1.0: full speed, continued now).

        Returns False if that process is gone. Returns once the helper applied it.
        """
        with self._lock:
            if fraction >= 1 and self.pid is None:
                return True  # Nothing is throttled: nothing to undo.
            process = self._ensure_started()
            try:
                process.stdin.write(f"set {pid} {fraction!r} {period!r}\n".encode())
                process.stdin.flush()
            except BrokenPipeError as e:
                raise RuntimeError(f"The throttle helper (pid {process.pid}) exited: "
                                   f"{process.poll()}") from e
            reply = self._read_reply(process)
        if reply not in ("ok", "gone"):
            raise RuntimeError(f"The throttle helper answered {reply!r} to a request for pid {pid}.")
        return reply == "ok"

    def _ensure_started(self) -> subprocess.Popen:
        if self._process is not None and self._process.poll() is None:
            return self._process
        if self._process is not None:
            self._process.stdin.close()
            self._process.stdout.close()
        # -I: isolated mode, standard library only; the helper needs nothing else.
        self._process = subprocess.Popen(
            [sys.executable, "-I", throttle_helper.__file__, str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
        )
        return self._process

    def _read_reply(self, process: subprocess.Popen) -> str:
        fd = process.stdout.fileno()
        line = b""
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([fd], [], [], _REPLY_TIMEOUT_S)
            if not ready:
                raise RuntimeError(f"The throttle helper (pid {process.pid}) did not answer "
                                   f"within {_REPLY_TIMEOUT_S} s.")
            chunk = os.read(fd, 64)
            if not chunk:
                raise RuntimeError(f"The throttle helper (pid {process.pid}) exited: {process.wait()}")
            line += chunk
        return line.decode().strip()

    def close(self) -> None:
        """Ends the helper (it continues every process it stopped first) and reaps it.

        Only in the process that started it: a forked child leaves it alone.
        """
        with self._lock:
            process, self._process = self._process, None
        if process is None or os.getpid() != self._owner:
            return
        process.stdin.close()  # EOF: the helper continues its processes and exits.
        try:
            process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=_STOP_TIMEOUT_S)
        process.stdout.close()

    def _forget(self) -> None:
        """In a forked child: drops this process's copies of the pipes, touches nothing else."""
        process, self._process = self._process, None
        if process is not None:
            process.stdin.close()
            process.stdout.close()
        self._lock = threading.Lock()  # The parent's may have been held at the fork.
