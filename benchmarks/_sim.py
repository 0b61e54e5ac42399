"""A simulated cluster behind psclient's real coordinator logic (no TensorFlow).

`SimCluster` fakes only the TensorFlow edge (`psclient._engine.edge.Edge`:
probes, TCP states, connects; the rest as every fake edge answers it,
`tests/_fake_edge.py`) and the calls dispatcher threads make (through the
`prepare` callable). Everything else is psclient's
own: the `Engine` (`Scheduler`, `Dispatcher`, `Prober`, `Recovery` and its
`RecoveryMachine`) built as `ParameterServerStrategy` builds it, minus tracing,
variables and checkpoints.

A fake worker is up, dead (calls and probes fail at once with an error named
like TF's `UnavailableError`, TCP connects are refused) or hung (calls and
probes block until it resumes, TCP connects are accepted, as a SIGSTOPped
process does). A call sleeps for the worker's latency (a step time, times a
slowness factor for slow workers, times a jitter drawn per call), which
releases the GIL as TF's C++ runtime does. Failures are injected at times and
on workers drawn from the seed: deaths (the worker restarts after a while) and
hangs (it resumes after a while).

`Harness` runs one scenario and measures closures/s, process CPU per closure,
threads, memory, and for every injected failure the time until psclient took
the worker out and until each closure that was running there ran elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import sys
import threading
import time
from typing import Any

from psclient._cluster.spec import Cluster
from psclient._core.closure import Closure
from psclient._core.future import Future
from psclient._core.scheduler import Scheduler
from psclient._engine.assembly import Engine
from psclient._engine.edge import Roster, StrategyParts
from psclient._engine.recovery import RecoveryConfig

# The fake edge's common part, and the empty variable store and per-worker values, are the tests'.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _fake_edge import EmptyStore, FakeEdgeBase, NoPerWorker  # noqa: E402

__all__ = ["SimConfig", "SimCluster", "Harness", "UnavailableError", "AbortedError"]


class UnavailableError(Exception):
    """What a call or probe to a dead fake worker raises (named as TF's, which
    `psclient._core.failures.classify` treats as a connection error)."""


class AbortedError(Exception):
    """What a restarted fake worker raises until the coordinator connects again (TF's
    restarted task no longer knows the coordinator's context)."""


@dataclasses.dataclass
class SimConfig:
    workers: int = 10
    seed: int = 0
    #: Fake step time per call (s), and its jitter (uniform, +- this fraction).
    step_s: float = 0.010
    jitter: float = 0.2
    #: Fraction of workers that are slow, and how much slower.
    slow_fraction: float = 0.05
    slow_factor: float = 3.0
    #: Round trip of a probe to an up worker (s).
    probe_s: float = 0.0005
    hang_timeout: float = 2.0
    #: How long a failure probe (does this worker, or the ps, answer?) waits; None: as a strategy's,
    #: min(10, hang_timeout). A starved probe thread counts as a silent task, so a test that loads
    #: the process with 100 dispatcher threads gives it more than a 0.6 s hang_timeout.
    probe_timeout: float | None = None
    #: A dead worker comes back after this long; a hung one resumes after this long.
    restart_after: float = 1.5
    resume_after: float = 4.0
    pipeline_depth: int = 1


class _Worker:
    __slots__ = ("index", "state", "factor", "rng", "resumed", "changed", "incarnation", "known")

    def __init__(self, index: int, factor: float, seed: int):
        self.index = index
        self.state = "up"
        self.factor = factor
        self.rng = random.Random(seed)
        #: Set while not hung (a hung call waits on it).
        self.resumed = threading.Event()
        self.resumed.set()
        #: Set when the worker dies (a running call notices).
        self.changed = threading.Event()
        #: Restarts so far, and the one the coordinator last connected to.
        self.incarnation = 0
        self.known = 0


class SimCluster(FakeEdgeBase):
    """Fake workers and the fake TF edge (`edge` is this object)."""

    def __init__(self, config: SimConfig):
        self.config = config
        rng = random.Random(config.seed)
        slow = set(rng.sample(range(config.workers), int(config.slow_fraction * config.workers)))
        self.workers = [
            _Worker(w, config.slow_factor if w in slow else 1.0, rng.randrange(2**32))
            for w in range(config.workers)
        ]
        self.slow = sorted(slow)
        self.cluster = Cluster({
            "worker": [f"sim-worker{w}:1" for w in range(config.workers)], "ps": ["sim-ps0:1"],
        })
        self._by_address = {f"sim-worker{w}:1": w for w in range(config.workers)}
        self.calls = 0
        self.probes = 0
        self.connects = 0

    # ------------------------------------------------------------ the edge
    def tcp_state(self, address: str, timeout: float) -> str:
        worker = self._by_address.get(address)
        if worker is None:
            return "open"  # the ps never fails here
        return "closed" if self.workers[worker].state == "dead" else "open"

    # ------------------------------------------------ calls, probes, connects
    def prepare(self, closure: Closure, worker: int) -> tuple:
        return functools.partial(self.call, worker), closure.args, closure.kwargs

    def call(self, worker: int, value: Any) -> Any:
        """One step on `worker`: sleeps its latency, fails if it is or dies dead, blocks while hung."""
        w = self.workers[worker]
        self.calls += 1
        self._pass_hang(w)
        latency = self.config.step_s * w.factor * (1 + self.config.jitter * (2 * w.rng.random() - 1))
        time.sleep(latency)  # the step; a death or hang meanwhile is seen at its end
        if w.changed.is_set():
            self._pass_hang(w)
        return value

    def probe(self, device: str) -> None:
        self.probes += 1
        if "/job:ps/" in device:
            time.sleep(self.config.probe_s)
            return
        w = self.workers[int(device.rsplit(":", 1)[1].split("/")[0])]
        self._pass_hang(w)
        time.sleep(self.config.probe_s)

    def disconnect(self) -> None:
        pass

    def connection_changes(self) -> int:
        """Two per (re)connect (each began and ended)."""
        return 2 * self.connects

    def connect(self, cluster: Cluster, workers: list) -> None:
        """A (re)connect: the named workers know the coordinator's context again."""
        self.connects += 1
        for worker in workers:
            w = self.workers[worker]
            if w.state != "dead":
                w.known = w.incarnation

    def _pass_hang(self, w: _Worker) -> None:
        # Bounded: a hung worker always resumes or dies (the harness ends every hang).
        w.resumed.wait(600)
        if w.state == "dead":
            raise UnavailableError(f"worker {w.index} is gone")
        if w.known != w.incarnation:
            raise AbortedError(f"worker {w.index} restarted: it does not know this coordinator")

    # ------------------------------------------------------------- failures
    def kill(self, worker: int) -> None:
        w = self.workers[worker]
        w.state = "dead"
        w.changed.set()
        w.resumed.set()

    def hang(self, worker: int) -> None:
        w = self.workers[worker]
        w.resumed.clear()
        w.state = "hung"
        w.changed.set()

    def revive(self, worker: int) -> None:
        """A dead worker restarted, or a hung one resumed."""
        w = self.workers[worker]
        if w.state == "dead":
            w.incarnation += 1
        w.changed.clear()
        w.state = "up"
        w.resumed.set()


class _TimedScheduler(Scheduler):
    """The real scheduler, noting when a worker is taken out and when its closures run again."""

    def __init__(self, num_workers: int):
        super().__init__(num_workers)
        self.taken_out: dict[int, list[float]] = {}
        self._requeued: dict[int, tuple[int, float]] = {}  # closure id -> (worker, when)
        self.rerun: dict[int, list[float]] = {}  # worker -> when each of its closures was taken again

    def worker_lost(self, worker: int, *, detected_after: float | None = None) -> list:
        now = time.monotonic()
        requeued = super().worker_lost(worker, detected_after=detected_after)
        self.taken_out.setdefault(worker, []).append(now)
        for closure in requeued:
            self._requeued[closure.id] = (worker, now)
        return requeued

    def take(self, worker: int, timeout: float | None = None):
        closure = super().take(worker, timeout)
        if closure is not None and self._requeued:
            lost = self._requeued.pop(closure.id, None)
            if lost is not None:
                self.rerun.setdefault(lost[0], []).append(time.monotonic())
        return closure


class Harness:
    """One simulated coordinator: start(), run closures, stop(). Owns every thread it starts."""

    def __init__(self, config: SimConfig):
        self.config = config
        self.sim = SimCluster(config)
        self.scheduler = _TimedScheduler(config.workers)
        self.engine = Engine(
            Roster(self.sim.cluster), edge=self.sim, scheduler=self.scheduler,
            recovery_config=RecoveryConfig(hang_timeout=config.hang_timeout,
                                           probe_timeout=(min(10.0, config.hang_timeout)
                                                          if config.probe_timeout is None else config.probe_timeout),
                                           interval=min(1.0, config.hang_timeout / 4)),
            pipeline_depth=config.pipeline_depth, connect_timeout=config.hang_timeout,
            parts=StrategyParts(self.sim.prepare, EmptyStore(), NoPerWorker()),
        )
        self.prober, self.recovery, self.dispatcher = self.engine.prober, self.engine.recovery, self.engine.dispatcher
        #: Closures submitted; per closure number, times its future resolved
        #: with its own value (kept as bytes, not futures, so memory figures
        #: are the coordinator's); and resolutions with anything else.
        self.submitted = 0
        self.resolutions = bytearray()
        self.wrong = 0
        self.thread_errors: list[str] = []
        self.injected: list[dict] = []
        # Closures in flight, for submit_for(): the producer is woken only when
        # they fall to the low-water mark, not at every completion.
        self._flight = threading.Condition()
        self._in_flight = 0
        self._low_water = 0
        self._timers: list[threading.Timer] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        self.engine.start_dispatch()
        self.engine.start_recovery()

    def submit(self, count: int, *, counted: bool = False) -> list[Future]:
        """Schedule `count` closures, each returning its own number (`counted`: in
        submit_for's count of closures in flight). From one thread at a time."""
        futures = []
        for _ in range(count):
            future = Future("sim_step")
            n = self.submitted
            self.submitted += 1
            self.resolutions.append(0)
            future.add_done_callback(functools.partial(self._resolved, n, counted))
            futures.append(future)
            self.scheduler.submit(Closure(None, (n,), {}, future))
        return futures

    def submit_for(self, seconds: float, high: int, low: int, sample=None) -> None:
        """Keep between `low` and `high` closures in flight for `seconds`: refill to
        `high` whenever they fall to `low` (this thread is woken once per batch,
        not per completion)."""
        end = time.monotonic() + seconds
        self._low_water = low
        while True:
            with self._flight:
                self._flight.wait_for(lambda: self._in_flight <= low, max(0.0, end - time.monotonic()))
                room = high - self._in_flight
                self._in_flight += room
            if time.monotonic() >= end:
                with self._flight:
                    self._in_flight -= room
                return
            self.submit(room, counted=True)
            if sample is not None:
                sample()

    def _resolved(self, n: int, counted: bool, future: Future) -> None:
        if future.cancelled() or future.exception() is not None or future.result() != n:
            self.wrong += 1
        else:
            self.resolutions[n] = min(255, self.resolutions[n] + 1)
        if counted:
            with self._flight:
                self._in_flight -= 1
                if self._in_flight == self._low_water:
                    self._flight.notify()

    # ------------------------------------------------------------- failures
    def inject(self, kind: str, worker: int, at: float) -> None:
        """At monotonic time `at`: kill ("death") or hang `worker`; it comes back later."""
        def begin():
            entry = {"kind": kind, "worker": worker, "at": time.monotonic(),
                     "taken_out_before": len(self.scheduler.taken_out.get(worker, ()))}
            with self._lock:
                self.injected.append(entry)
            (self.sim.kill if kind == "death" else self.sim.hang)(worker)
            back = self.config.restart_after if kind == "death" else self.config.resume_after
            self._timer(back, functools.partial(self._revive, worker, entry))

        self._timer(max(0.0, at - time.monotonic()), begin)

    def _revive(self, worker: int, entry: dict) -> None:
        now = time.monotonic()
        if not any(t >= entry["at"] for t in self.scheduler.taken_out.get(worker, ())):
            # Not taken out in time: what psclient saw of it, for the report.
            device = self.sim.worker_device(worker)
            entry["not_taken_out"] = {
                "state": self.recovery._machine.workers[worker].name,  # noqa: SLF001 - diagnostics
                "probe_waited_s": self.prober.overdue(device, now),
                "since_answered_s": now - self.prober.answered_at(device),
                "since_done_s": now - self.scheduler.last_done_times()[worker],
                "probe_threads": self.prober.threads,
            }
        self.sim.revive(worker)

    def _timer(self, delay: float, fn) -> None:
        timer = threading.Timer(delay, fn)
        timer.daemon = True  # joined by stop(); daemon only so a crash can't wedge exit
        with self._lock:
            self._timers.append(timer)
        timer.start()

    def every_future_once(self) -> bool:
        """Whether every closure's future resolved exactly once, with its own value."""
        return self.wrong == 0 and self.resolutions.count(1) == self.submitted

    def failure_report(self) -> list[dict]:
        """Per injected failure: seconds until taken out, until its closures ran elsewhere."""
        report = []
        for entry in self.injected:
            worker, at = entry["worker"], entry["at"]
            outs = [t for t in self.scheduler.taken_out.get(worker, ()) if t >= at]
            out = outs[0] if outs else None
            reruns = [t for t in self.scheduler.rerun.get(worker, ()) if out is not None and t >= out]
            report.append({
                "kind": entry["kind"], "worker": worker,
                "detected_s": None if out is None else round(out - at, 3),
                "requeued_closures": len(reruns),
                "rerun_elsewhere_s": round(max(reruns) - at, 3) if reruns else None,
                **({"not_taken_out": entry["not_taken_out"]} if "not_taken_out" in entry else {}),
            })
        return report

    def stop(self, timeout: float = 30.0) -> list[str]:
        """End every hang, stop recovery, dispatch and probes; names of threads left running."""
        with self._lock:
            timers = list(self._timers)
        for timer in timers:
            timer.cancel()
            timer.join(timeout)
        for worker in range(self.config.workers):
            if self.sim.workers[worker].state != "up":
                self.sim.revive(worker)
        left = []
        if not self.recovery.stop(timeout):
            left.append("psclient-health")
        self.scheduler.close()
        if self.dispatcher is not None:
            left += self.dispatcher.stop(timeout)
        left += self.prober.close(timeout)
        return left


def rss_mib() -> float:
    """This process's resident memory now (MiB)."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
