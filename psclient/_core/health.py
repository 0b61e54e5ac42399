"""Watching the tasks: probes, hang detection, rejoin, and the periodic chores.

Two parts:

- `Prober` asks a task to run a tiny op (a real round trip through TF's
  eager runtime, unlike a TCP connect, which a SIGSTOPped process still
  accepts) and waits at most a timeout for the answer. A probe that does not
  answer keeps its thread until the task answers or dies; the prober never
  starts a second one for the same task meanwhile, so a hung task costs one
  thread, not one per probe.
- `HealthMonitor.tick()` is one round of decisions: declare a worker whose
  probe is overdue hung, try to bring back workers that are down, give up
  when every worker has been gone too long, and run the strategy's due chores
  (ps recovery, periodic checkpoints). The TensorFlow calls and the strategy's
  state changes come in as callables, so a tick can be tested with fakes and
  a fake clock. `start()` runs ticks on one owned thread until `stop()`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

__all__ = ["Prober", "HealthMonitor", "HealthConfig"]

log = logging.getLogger("psclient")


class _Probe:
    __slots__ = ("thread", "started_at", "done", "ok")

    def __init__(self, started_at: float):
        self.thread: threading.Thread | None = None
        self.started_at = started_at
        self.done = threading.Event()
        self.ok = False


class Prober:
    """Round-trip probes of tasks, at most one outstanding per task."""

    def __init__(self, run_probe: Callable[[str], None], *, clock: Callable[[], float] = time.monotonic):
        # `run_probe(device)` returns if the task answered and raises otherwise.
        self._run_probe = run_probe
        self._clock = clock
        self._lock = threading.Lock()
        self._probes: dict[str, _Probe] = {}

    def start(self, device: str) -> _Probe:
        """The outstanding probe of `device`, or a new one if none is outstanding."""
        with self._lock:
            probe = self._probes.get(device)
            if probe is not None and not probe.done.is_set():
                return probe
            probe = _Probe(self._clock())
            probe.thread = threading.Thread(
                target=self._run, args=(device, probe), name=f"psclient-probe{device}", daemon=True
            )
            self._probes[device] = probe
        probe.thread.start()
        return probe

    def answers(self, device: str, timeout: float) -> bool:
        """Whether `device`'s task answers a probe within `timeout` seconds."""
        probe = self.start(device)
        return probe.done.wait(timeout) and probe.ok

    def overdue(self, device: str, now: float) -> float | None:
        """Seconds the outstanding probe of `device` has waited, or None if none waits."""
        with self._lock:
            probe = self._probes.get(device)
        if probe is None or probe.done.is_set():
            return None
        return now - probe.started_at

    def close(self, timeout: float) -> list[str]:
        """Join finished probe threads; return the devices whose probe still hangs."""
        deadline = time.monotonic() + timeout
        with self._lock:
            probes = dict(self._probes)
        hanging = []
        for device, probe in probes.items():
            probe.thread.join(max(0.0, deadline - time.monotonic()))
            if probe.thread.is_alive():
                hanging.append(device)
        return hanging

    def _run(self, device: str, probe: _Probe) -> None:
        try:
            self._run_probe(device)
            probe.ok = True
        except Exception:  # noqa: BLE001 - any failure means "does not answer"
            probe.ok = False
        finally:
            probe.done.set()


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    #: A worker whose probe has not answered for this long is declared hung.
    hang_timeout: float = 30.0
    #: With every worker gone this long, pending work fails with WorkerUnavailableError.
    worker_timeout: float = 300.0
    #: Seconds between ticks (probes of every up worker, rejoin attempts).
    interval: float = 1.0


class HealthMonitor:
    """One thread that probes workers, detects hangs, rejoins, and runs chores."""

    def __init__(
        self,
        config: HealthConfig,
        *,
        num_workers: int,
        worker_device: Callable[[int], str],
        prober: Prober,
        is_up: Callable[[int], bool],
        reachable: Callable[[int], bool],
        on_hung: Callable[[int, float], None],
        try_rejoin: Callable[[int, float], bool],
        all_down_since: Callable[[], float | None],
        on_all_gone: Callable[[float], None],
        chores: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self._num_workers = num_workers
        self._device = worker_device
        self._prober = prober
        self._is_up = is_up
        self._reachable = reachable
        self._on_hung = on_hung
        self._try_rejoin = try_rejoin
        self._all_down_since = all_down_since
        self._on_all_gone = on_all_gone
        self._chores = chores
        self._clock = clock
        # When a down worker was first seen answering again (for recovery time).
        self._back_since: dict[int, float] = {}
        self._gave_up_at: float | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------- the thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="psclient-health", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Run the next tick now (e.g. a ps was reported lost)."""
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stopping:
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the monitor must outlive one bad round
                log.exception("psclient health check failed; retrying")
            self._wake.wait(self.config.interval)
            self._wake.clear()

    # ------------------------------------------------------------ one round
    def tick(self) -> None:
        now = self._clock()
        for worker in range(self._num_workers):
            if self._stopping:
                return
            if self._is_up(worker):
                self._back_since.pop(worker, None)
                self._check_hang(worker, now)
            else:
                self._check_return(worker, now)
        self._check_all_gone(now)
        self._chores()

    def _check_hang(self, worker: int, now: float) -> None:
        device = self._device(worker)
        waited = self._prober.overdue(device, now)
        if waited is None:
            self._prober.start(device)  # the heartbeat: one round trip per tick
        elif waited >= self.config.hang_timeout:
            log.warning(
                "worker %d has not answered a probe for %.1f s (hang_timeout=%g s): taking it "
                "out and running its closures elsewhere", worker, waited, self.config.hang_timeout,
            )
            self._on_hung(worker, waited)

    def _check_return(self, worker: int, now: float) -> None:
        device = self._device(worker)
        if self._prober.overdue(device, now) is not None:
            return  # still hung: its last probe has not come back
        if not self._reachable(worker):
            self._back_since.pop(worker, None)
            return
        since = self._back_since.setdefault(worker, now)
        if self._try_rejoin(worker, since):
            self._back_since.pop(worker, None)

    def _check_all_gone(self, now: float) -> None:
        since = self._all_down_since()
        if since is None:
            self._gave_up_at = None
            return
        if now - since >= self.config.worker_timeout:
            if self._gave_up_at != since:
                self._gave_up_at = since
                log.error(
                    "every worker has been unavailable for %.0f s (worker_timeout=%g s): "
                    "failing pending work", now - since, self.config.worker_timeout,
                )
            # Every round, so work scheduled after giving up fails too, not hangs.
            self._on_all_gone(now - since)
