"""The throttle helper: a small process that runs other processes at a fraction of their speed.

`LocalCluster.throttle` starts one of these per cluster (see `throttle.py`)
and runs this file by its path, in isolated mode (`python -I`): it imports
only the standard library, so it starts in a fraction of a second and needs
neither psclient nor TensorFlow on its path. It lives in its own process so
that the coordinator's GIL (held for long stretches by TensorFlow calls)
cannot stretch the stopped part of a cycle.

A throttled process runs a duty cycle of `period` seconds: it runs for
`fraction * period`, then is stopped (SIGSTOP) for the rest and continued
(SIGCONT) at the start of the next period. Over any window of a few periods
it therefore gets at most `fraction` of the time it would otherwise get.

Protocol, one line each way on stdin/stdout:
    "set PID FRACTION PERIOD" -> "ok" (applied: with FRACTION 1 the process
    has been continued) or "gone" (no such process).
EOF on stdin (the owner closed it, or died, however) continues every process
this helper stopped, and exits. So does SIGTERM, SIGINT, and the parent-death
signal (Linux) once the owner process is gone.

The schedule itself (`duty_cycle`, `phase`) is pure and unit-tested.
"""

from __future__ import annotations

import math
import os
import select
import signal
import sys
import time

# Seconds per cycle by default: short enough that a step of a few ms sees the
# average slow-down, long enough that the helper wakes only ~20 times a second.
DEFAULT_PERIOD_S = 0.1


def duty_cycle(fraction: float, period: float) -> tuple[float, float]:
    """(seconds running, seconds stopped) in one period of a task throttled to `fraction`."""
    if not 0 < fraction <= 1 or not period > 0:
        raise ValueError(f"Expected 0 < fraction <= 1 and period > 0. Received: fraction={fraction!r}, "
                         f"period={period!r}.")
    running = fraction * period
    return running, period - running


def phase(now: float, start: float, fraction: float, period: float) -> tuple[bool, float]:
    """Whether a process throttled since `start` runs at time `now`, and when that next changes.

    Each period starts with the running part. With fraction 1 it always runs
    (and the change never comes: `math.inf`). Times are absolute, so a helper
    that wakes late just lands in the right part of the right period.
    """
    running, _ = duty_cycle(fraction, period)
    if fraction >= 1:
        return True, math.inf
    cycles, offset = divmod(max(0.0, now - start), period)
    cycle_start = start + cycles * period
    if offset < running:
        return True, cycle_start + running
    return False, cycle_start + period


class _Target:
    """One throttled process: its schedule and a handle that cannot hit a recycled pid."""

    def __init__(self, pid: int, fraction: float, period: float, start: float):
        self.pid = pid
        self.fraction = fraction
        self.period = period
        self.start = start
        self.stopped = False
        # A pidfd names this very process: once it is gone, signals fail
        # instead of reaching another process that got the same pid.
        self.fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None

    def signal(self, sig: int) -> None:
        if self.fd is not None:
            signal.pidfd_send_signal(self.fd, sig)
        else:
            os.kill(self.pid, sig)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _Helper:
    def __init__(self) -> None:
        self.targets: dict[int, _Target] = {}

    def release(self, pid: int) -> None:
        """Continues the process if this helper stopped it, and forgets it."""
        target = self.targets.pop(pid, None)
        if target is None:
            return
        try:
            if target.stopped:
                target.signal(signal.SIGCONT)
        except ProcessLookupError:
            pass  # Gone: nothing to continue.
        finally:
            target.close()

    def release_all(self) -> None:
        for pid in list(self.targets):
            self.release(pid)

    def command(self, line: str, now: float) -> str:
        parts = line.split()
        if len(parts) != 4 or parts[0] != "set":
            return f"error: unknown command {line.strip()!r}"
        pid, fraction, period = int(parts[1]), float(parts[2]), float(parts[3])
        self.release(pid)
        if fraction >= 1:
            return "ok"
        try:
            self.targets[pid] = _Target(pid, fraction, period, now)
        except ProcessLookupError:
            return "gone"
        return "ok"

    def tick(self, now: float) -> float:
        """Brings every process to the state its schedule says; returns the next change's time."""
        wake = math.inf
        for pid, target in list(self.targets.items()):
            runs, change = phase(now, target.start, target.fraction, target.period)
            if runs == target.stopped:  # It must change state now.
                try:
                    target.signal(signal.SIGCONT if runs else signal.SIGSTOP)
                except ProcessLookupError:
                    target.close()
                    del self.targets[pid]
                    continue
                target.stopped = not runs
            wake = min(wake, change)
        return wake


def _set_parent_death_signal(sig: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass  # EOF on stdin still ends the helper.


def main(owner: int) -> int:
    helper = _Helper()

    def on_signal(signum, frame):
        # The parent-death signal also comes when only the owner's thread that
        # started this helper ended: then the owner is still our parent.
        if signum == signal.SIGHUP and os.getppid() == owner:
            return
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    _set_parent_death_signal(signal.SIGHUP)
    if os.getppid() != owner:
        return 0
    commands = sys.stdin.fileno()
    pending = b""
    clock = time.monotonic
    try:
        while True:
            wake = helper.tick(clock())
            timeout = None if wake == math.inf else max(0.0, wake - clock())
            ready, _, _ = select.select([commands], [], [], timeout)
            if not ready:
                continue
            chunk = os.read(commands, 4096)
            if not chunk:
                return 0  # The owner closed the pipe, or is gone.
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                reply = helper.command(line.decode(), clock())
                os.write(sys.stdout.fileno(), reply.encode() + b"\n")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # A late signal must not cut the release short.
        helper.release_all()


if __name__ == "__main__":
    code = main(int(sys.argv[1]))
    sys.stdout.flush()
    os._exit(code)  # Nothing left to clean up; no late signal can interrupt an interpreter exit.
