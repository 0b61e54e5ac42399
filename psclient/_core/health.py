"""Probes: is a task there and answering? Pure Python threads, no TensorFlow.

`Prober` asks a task to run a tiny op (a real round trip through TF's
  eager runtime, unlike a TCP connect, which a SIGSTOPped process still
  accepts) and waits at most a timeout for the answer. A probe that does not
  answer keeps its thread until the task answers or dies; the prober never
  starts a second one for the same task meanwhile, so a hung task costs one
  thread, not one per probe.

What an unanswered probe means (hung, gone, back) is decided by the recovery
state machine (`psclient._core.recovery`); the TensorFlow call that a probe
makes comes in as a callable (`psclient._coordinator.runtime.probe`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

__all__ = ["Prober"]

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
        except Exception as error:  # noqa: BLE001 - any failure (TF's error types vary) means "does not answer"
            log.debug("probe of %s failed: %s: %s", device, type(error).__name__, error)
            probe.ok = False
        finally:
            probe.done.set()
