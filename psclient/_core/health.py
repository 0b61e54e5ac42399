"""Probes: is a task there and answering? Pure Python threads, no TensorFlow.

`Prober` asks a task to run a tiny op (a real round trip through TF's
  eager runtime, unlike a TCP connect, which a SIGSTOPped process still
  accepts) and waits at most a timeout for the answer. At most one probe is
  outstanding per task: asking again while one waits returns that one.

Probes run on a small pool of long-lived threads, not a thread per probe (at
1,000 workers and a heartbeat a second, that was a thousand threads created
every second). The pool keeps `threads` of them; a probe that does not answer
keeps its thread until the task answers or dies, so when every thread is busy
and some have been inside one probe for `stuck_after` seconds or more, the
pool grows by one thread per such stuck probe: a hung task costs one thread,
and it never holds up the probes of the others. Threads above `threads` exit
after `idle_exit` seconds without work. At idle, no thread is created.

What an unanswered probe means (hung, gone, back) is decided by the recovery
state machine (`psclient._core.recovery_machine`); the TensorFlow call that a probe
makes comes in as a callable (`psclient._coordinator.runtime.probe`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

__all__ = ["Prober"]

log = logging.getLogger("psclient")


class _Probe:
    __slots__ = ("device", "started_at", "running_since", "done", "ok")

    def __init__(self, device: str, started_at: float):
        self.device = device
        #: When it was asked for, and when a pool thread began it (None while queued).
        self.started_at = started_at
        self.running_since: float | None = None
        self.done = threading.Event()
        self.ok = False


class Prober:
    """Round-trip probes of tasks, at most one outstanding per task, on a bounded pool."""

    def __init__(
        self, run_probe: Callable[[str], None], *, clock: Callable[[], float] = time.monotonic,
        threads: int = 4, stuck_after: float = 1.0, idle_exit: float = 30.0,
    ):
        # `run_probe(device)` returns if the task answered and raises otherwise.
        self._run_probe = run_probe
        self._clock = clock
        self._base = threads
        self._stuck_after = stuck_after
        self._idle_exit = idle_exit
        self._cond = threading.Condition()
        self._probes: dict[str, _Probe] = {}
        #: When each task last answered a probe (the prober's clock).
        self._answered: dict[str, float] = {}
        self._requests: collections.deque[_Probe] = collections.deque()
        #: Pool threads serving now; and every one started and not joined yet.
        self._threads: set[threading.Thread] = set()
        self._started: list[threading.Thread] = []
        self._busy: dict[threading.Thread, _Probe] = {}
        self._idle = 0
        self._closing = False
        #: Pool threads started so far (flat at idle: tests and benchmarks read it).
        self.threads_started = 0
        #: The most probes seen stuck at once when the pool grew: each thread above `threads` was
        #: started for one (a hung task, or on a starved machine a probe descheduled that long).
        self.most_stuck = 0

    def start(self, device: str, *, urgent: bool = False) -> _Probe:
        """The outstanding probe of `device`, or a new one if none is outstanding.

        `urgent`: a new probe goes to the front of the queue (a failed call waits on it),
        ahead of the heartbeats."""
        with self._cond:
            probe = self._probes.get(device)
            if probe is not None and not probe.done.is_set():
                return probe
            probe = _Probe(device, self._clock())
            self._probes[device] = probe
            if self._closing:
                probe.done.set()  # nobody runs it: the task counts as not answering
                return probe
            if urgent:
                self._requests.appendleft(probe)
            else:
                self._requests.append(probe)
            if self._idle:
                self._cond.notify()
            if len(self._requests) > self._idle:
                self._grow_locked()
        return probe

    def answers(self, device: str, timeout: float) -> bool:
        """Whether `device`'s task answers a probe within `timeout` seconds."""
        probe = self.start(device)
        return probe.done.wait(timeout) and probe.ok

    def overdue(self, device: str, now: float) -> float | None:
        """Seconds the outstanding probe of `device` has waited, or None if none waits."""
        with self._cond:
            probe = self._probes.get(device)
            if probe is not None and len(self._requests) > self._idle:
                self._grow_locked()  # queued behind probes that hang
        if probe is None or probe.done.is_set():
            return None
        return now - probe.started_at

    def last_failed(self, device: str) -> bool:
        """Whether the latest probe of `device` has ended without an answer."""
        with self._cond:
            probe = self._probes.get(device)
        return probe is not None and probe.done.is_set() and not probe.ok

    def answered_at(self, device: str) -> float:
        """When `device`'s task last answered a probe; -inf if it never did."""
        return self._answered.get(device, float("-inf"))

    @property
    def threads(self) -> int:
        """Pool threads alive now."""
        with self._cond:
            return len(self._threads)

    def close(self, timeout: float) -> list[str]:
        """Stop the pool: join its threads; return the devices whose probe still hangs.

        Probes already asked for still run (the threads exit once none is
        left). Can be called again (after a hung task answered) to join what was left.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closing = True
            threads = list(self._started)
            self._cond.notify_all()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._started = [t for t in self._started if t.is_alive()]
            running = [probe.device for thread, probe in self._busy.items() if thread.is_alive()]
            return sorted(running + [probe.device for probe in self._requests])

    # ---------------------------------------------------------------- private
    def _grow_locked(self) -> None:
        """Start a thread if there are fewer than `threads`, or if every one is
        busy and some are stuck in a probe (one more per stuck probe)."""
        now = self._clock()
        # Time inside the probe, not in the queue: a burst of heartbeats waiting
        # their turn is no reason to grow.
        stuck = sum(now - p.running_since >= self._stuck_after for p in self._busy.values())
        if len(self._threads) >= self._base + stuck:
            return
        self.most_stuck = max(self.most_stuck, stuck)
        thread = threading.Thread(target=self._serve, name=f"psclient-probe-{self.threads_started}",
                                  daemon=True)  # joined by close(); daemon only so a hang can't wedge exit
        self._threads.add(thread)
        self._started = [t for t in self._started if t.is_alive()]  # exited extras, joined
        self._started.append(thread)
        self.threads_started += 1
        thread.start()

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                self._busy.pop(me, None)
                while not self._requests:
                    if self._closing:
                        self._threads.discard(me)
                        return
                    self._idle += 1
                    woken = self._cond.wait(self._idle_exit)
                    self._idle -= 1
                    if not woken and not self._requests and len(self._threads) > self._base:
                        self._threads.discard(me)  # an extra thread with nothing to do
                        return
                probe = self._requests.popleft()
                probe.running_since = self._clock()
                self._busy[me] = probe
            self._run(probe)

    def _run(self, probe: _Probe) -> None:
        try:
            self._run_probe(probe.device)
            probe.ok = True
            self._answered[probe.device] = self._clock()
        except Exception as error:  # noqa: BLE001 - any failure (TF's error types vary) means "does not answer"
            log.debug("probe of %s failed: %s: %s", probe.device, type(error).__name__, error)
            probe.ok = False
        finally:
            probe.done.set()
