"""Fault tolerance: what the strategy does when a task fails, and its checkpoints.

`FaultTolerance` is owned by the strategy and driven from two sides:

- dispatcher threads ask it, while classifying an error, whether the worker,
  a ps task or another worker is lost (`worker_answers`, `ps_lost`,
  `others_lost`: probes with a timeout, never text matching);
- the health monitor's thread calls `on_hung`, `try_rejoin`, `on_all_gone`
  and `chores` (ps recovery, periodic checkpoints). Everything that changes
  the cluster connection or the variables happens on that one thread.

Rejoin of a worker (restarted at the same address, or a hung one answering
again): reconnect the coordinator (TF's `update_server_def`), probe it, rebuild
its per-worker datasets and resources, then let it take work.

Recovery of a ps task: stop handing out work, wait for what runs to stop,
wait for the task to come back, reconnect, give every variable it held a new
resource, restore *every* variable from the newest checkpoint (so weights,
optimizer state and counters agree), trace the scheduled functions again
(they captured the old resources), rebuild per-worker resources, resume.
Closures that were running re-run; closures that completed after the
checkpoint keep their futures' results but their updates are rolled back.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref

from psclient._coordinator import runtime as _runtime
from psclient._coordinator.checkpoint import Checkpoints
from psclient._coordinator.per_worker import (
    PerWorker,
    PerWorkerDataset,
    PerWorkerIterator,
)
from psclient._core.errors import PSUnavailableError, WorkerUnavailableError
from psclient._core.health import Prober

__all__ = ["FaultTolerance", "RecoveryConfig"]

log = logging.getLogger("psclient")


@dataclasses.dataclass(frozen=True)
class RecoveryConfig:
    checkpoint_dir: str | None = None
    checkpoint_interval: float | None = None
    checkpoint_every: int | None = None
    checkpoints_to_keep: int = 3
    hang_timeout: float = 30.0
    worker_timeout: float = 300.0
    ps_timeout: float = 300.0
    #: How long a probe made while classifying an error may wait.
    probe_timeout: float = 10.0


@dataclasses.dataclass
class PSStats:
    failures: int = 0
    recoveries: int = 0
    last_recovery_s: float | None = None
    rolled_back_closures: int = 0


class FaultTolerance:
    def __init__(self, owner, config: RecoveryConfig, prober: Prober):
        self._owner = weakref.ref(owner)
        self.config = config
        self._cluster = owner.cluster
        self._scheduler = owner._scheduler  # noqa: SLF001 - the owner's, shared on purpose
        self._prober = prober
        self._lock = threading.RLock()  # checkpoints and recoveries, one at a time
        self._lost_ps: set[int] = set()
        self._lost_lock = threading.Lock()
        self.broken: BaseException | None = None
        self.ps_stats = [PSStats() for _ in range(self._cluster.num_ps)]
        self.checkpoints = Checkpoints(config.checkpoint_dir, keep=config.checkpoints_to_keep) if (
            config.checkpoint_dir is not None) else None
        # The workers in TF's current view of the cluster (see _reconnect).
        self._connected = set(range(self._cluster.num_workers))
        # Variables created in scope() when the newest checkpoint was taken.
        self._saved_created = -1
        self._saved_completed = 0
        self._saved_at = time.monotonic()
        self.checkpoints_written = 0

    # ------------------------------------------------------------ probes
    def worker_answers(self, worker: int) -> bool:
        device = _runtime.worker_device(worker)
        if self._answers(device):
            return True
        # A dead worker still in TF's view of the cluster makes calls on the
        # healthy ones fail too: drop the dead from the view, then ask again.
        return self._drop_dead_workers(keep=worker) and self._answers(device)

    def _drop_dead_workers(self, keep: int) -> bool:
        """Reconnect without the workers that refuse connections; True if any were dropped."""
        owner = self._owner()
        with self._lock:
            dead = [
                w for w in sorted(self._connected)
                if w != keep and _runtime.tcp_state(self._cluster.address("worker", w), 1.0) == "closed"
            ]
            if not dead or owner is None:
                return False
            for w in dead:
                self._scheduler.worker_lost(w)
            self._reconnect(owner, returning=None)
            return True

    def _answers(self, device: str, attempts: int = 3, spacing: float = 0.2) -> bool:
        """Whether the task answers one of a few probes.

        Right after one task dies, TF's runtime can fail a call (and a probe)
        on a healthy task for a moment; a dead task fails every probe. A probe
        that times out is not repeated: the task is hung.
        """
        for attempt in range(attempts):
            if attempt:
                time.sleep(spacing)  # spacing between probes, not synchronisation
            probe = self._prober.start(device)
            if not probe.done.wait(self.config.probe_timeout):
                return False
            if probe.ok:
                return True
        return False

    def ps_lost(self) -> bool:
        if self._lost_ps:
            return True
        lost = [
            ps for ps in range(self._cluster.num_ps)
            if not self._answers(_runtime.ps_device(ps).rsplit("/device:", 1)[0])
        ]
        if lost:
            with self._lost_lock:
                if not self._lost_ps:
                    # Hold the queue at once: until the recovery, every
                    # closure would fail against the lost ps straight away.
                    self._scheduler.pause()
                for ps in lost:
                    if ps not in self._lost_ps:
                        self._lost_ps.add(ps)
                        self.ps_stats[ps].failures += 1
                        log.warning("ps task %d (%s) does not answer", ps, self._cluster.address("ps", ps))
            owner = self._owner()
            if owner is not None:
                owner._wake_monitor()  # noqa: SLF001
        return bool(lost)

    def others_lost(self, worker: int) -> bool:
        lost = False
        for other in range(self._cluster.num_workers):
            if other == worker:
                continue
            if not self._scheduler.worker_is_up(other):
                lost = True  # already known to be gone
            elif not self.worker_answers(other):
                self._scheduler.worker_lost(other)
                lost = True
        return lost

    # ------------------------------------------------ health monitor hooks
    def on_hung(self, worker: int, waited: float) -> None:
        self._scheduler.worker_lost(worker, detected_after=waited)

    def on_all_gone(self, waited: float) -> None:
        error = WorkerUnavailableError(
            f"No worker has been available for {waited:.0f} s (worker_timeout="
            f"{self.config.worker_timeout:g} s): every worker of the cluster is gone "
            f"({', '.join(self._cluster.workers)}). Pending scheduled functions "
            "failed; restart the workers, then schedule again.",
            task="worker", address=None,
        )
        self._scheduler.fail_all(error)

    def try_rejoin(self, worker: int, back_since: float) -> bool:
        if self._lost_ps or self.broken is not None:
            return False  # the ps recovery reconnects everything first
        owner = self._owner()
        if owner is None:
            return False
        with self._lock:
            if not self._reconnect(owner, returning=worker):
                return False  # another worker is hung; try again next round
            if not self.worker_answers(worker):
                log.info("worker %d accepts connections but does not answer yet; retrying", worker)
                return False
            try:
                rebuild_per_worker(owner._per_worker_values(), worker, resources_only=False)  # noqa: SLF001
            except Exception as error:  # noqa: BLE001 - try again next round
                log.warning("worker %d answers but rebuilding its datasets failed (%s); retrying",
                            worker, error)
                return False
            recovered = time.monotonic() - back_since
            self._scheduler.worker_up(worker, recovered_after=recovered)
        log.info("worker %d rejoined (%.2f s after it answered again)", worker, recovered)
        return True

    def hung_in_view(self, returning: int | None = None) -> list[int]:
        """Workers in TF's view that are out of rotation and not gone: hung.

        Hung means a TCP connect is accepted (a SIGSTOPped process) or gets no
        answer at all (a network cut); only a refused one means gone. TF's
        `update_server_def` waits on a hung task until it answers, whether the
        new view keeps it or drops it, so no reconnect is tried then.
        """
        return [
            w for w in sorted(self._connected)
            if w != returning and not self._scheduler.worker_is_up(w)
            and _runtime.tcp_state(self._cluster.address("worker", w), 1.0) != "closed"
        ]

    def _reconnect(self, owner, returning: int | None) -> bool:
        """Reconnect the coordinator to the ps tasks and the workers that answer.

        Only workers whose process answers (and the returning one, which
        cannot answer before it is reconnected) are named; an up worker left
        out is taken out of rotation first, so nothing is sent to a worker TF
        no longer knows. Returns False, changing nothing, while a worker in
        the current view is hung (see `hung_in_view`).
        """
        if self.hung_in_view(returning):
            return False
        workers = range(self._cluster.num_workers)
        probes = {
            worker: self._prober.start(_runtime.worker_device(worker))
            for worker in workers
            if worker != returning and self._scheduler.worker_is_up(worker)
        }
        deadline = time.monotonic() + min(2.0, self.config.probe_timeout)
        live, dead = [], []
        for worker in workers:
            if worker == returning:
                live.append(worker)
            elif worker in probes:
                # Any answer, even an error, means the process is there; an
                # error can come from the stale view this reconnect replaces.
                answered = probes[worker].done.wait(max(0.0, deadline - time.monotonic()))
                state = _runtime.tcp_state(self._cluster.address("worker", worker), 1.0)
                if answered and (probes[worker].ok or state == "open"):
                    live.append(worker)
                elif state != "closed":
                    self._scheduler.worker_lost(worker)
                    return False  # hung: not now (see hung_in_view)
                else:
                    dead.append(worker)
        for worker in dead:
            self._scheduler.worker_lost(worker)
        _runtime.connect(self._cluster, streaming_enqueue=owner.pipeline_depth > 1, workers=live)
        self._connected = set(live)
        return True

    def chores(self) -> None:
        if self._lost_ps and self.broken is None:
            self.recover_ps()
            return
        owner = self._owner()
        down = {w for w in self._connected if not self._scheduler.worker_is_up(w)}
        if down and owner is not None and len(down) < len(self._connected):
            # While a lost worker is still in TF's view of the cluster, TF fails
            # anything that registers a function on every task (a checkpoint,
            # a new trace), so it is dropped from the view right away.
            with self._lock:
                if self._reconnect(owner, returning=None):
                    log.info("worker(s) %s left out of the cluster until they answer again",
                             sorted(down))
        if self._checkpoint_due():
            self.checkpoint("interval")

    # ---------------------------------------------------------- checkpoints
    def before_schedule(self) -> None:
        """Checkpoint first if variables were created since the last one.

        So the newest checkpoint always holds every variable a scheduled
        function can touch (a ps recovery needs their values).
        """
        if self.checkpoints is None:
            return
        owner = self._owner()
        # A count, not the variables themselves: this runs on every schedule().
        if owner is not None and owner._variables_created() != self._saved_created:  # noqa: SLF001
            self.checkpoint("new variables")

    def checkpoint(self, reason: str) -> str | None:
        """Pause dispatch, wait for running closures, save, resume.

        Taken between closures, a checkpoint holds the effect of exactly the
        closures that completed before it.
        """
        owner = self._owner()
        if self.checkpoints is None or owner is None:
            return None
        with self._lock:
            self._scheduler.pause()
            try:
                if not self._scheduler.wait_idle(self.config.hang_timeout):
                    log.warning("checkpoint (%s) skipped: closures still running after %g s",
                                reason, self.config.hang_timeout)
                    return None
                created = owner._variables_created()  # noqa: SLF001
                variables = owner._named_variables()  # noqa: SLF001
                completed = self._scheduler.completed()
                try:
                    path = self.checkpoints.save(variables, completed)
                except Exception as error:  # noqa: BLE001 - e.g. every worker gone; try next interval
                    self._saved_at = time.monotonic()
                    log.warning("checkpoint (%s) failed: %s: %s", reason, type(error).__name__,
                                str(error).splitlines()[0] if str(error) else "")
                    if reason != "interval":
                        raise
                    return None
                self._saved_created = created
                self._saved_completed = completed
                self._saved_at = time.monotonic()
                self.checkpoints_written += 1
                log.info("checkpoint %s written (%s, %d closures completed)", path, reason, completed)
                return path
            finally:
                self._scheduler.resume()

    def restore(self) -> dict | None:
        owner = self._owner()
        if self.checkpoints is None or owner is None:
            return None
        with self._lock:
            created = owner._variables_created()  # noqa: SLF001
            variables = owner._named_variables()  # noqa: SLF001
            path = self.checkpoints.latest()
            completed = self.checkpoints.restore(variables, path)
            if completed is None:
                return None
            self._saved_created = created
            return {"path": path, "completed_closures": completed}

    def _checkpoint_due(self) -> bool:
        if self.checkpoints is None or self._saved_created < 0:
            return False  # nothing to save before the first schedule()
        interval, every = self.config.checkpoint_interval, self.config.checkpoint_every
        if interval is not None and time.monotonic() - self._saved_at >= interval:
            return True
        return every is not None and self._scheduler.completed() - self._saved_completed >= every

    # ------------------------------------------------------------ ps recovery
    def recover_ps(self) -> None:
        owner = self._owner()
        if owner is None:
            return
        with self._lock:
            lost = sorted(self._lost_ps)
            self._scheduler.pause()
            try:
                # Running closures fail against the dead ps and are re-queued;
                # any still running then are abandoned (their reports ignored),
                # so nothing traced for the old variables reports afterwards.
                if not self._scheduler.wait_idle(self.config.hang_timeout):
                    self._scheduler.requeue_running()
                if self.checkpoints is None or self.checkpoints.latest() is None:
                    self._give_up(lost, "this strategy has no checkpoint_dir to restore its "
                                  "variables from" if self.checkpoints is None else
                                  "no checkpoint had been written yet")
                    return
                started = time.monotonic()
                back_at = self._wait_for_ps(lost, owner)
                if back_at is None:
                    return
                while not self._reconnect(owner, returning=None):
                    if owner._closed:  # noqa: SLF001
                        return
                    log.warning("ps recovery waits: worker(s) %s hang and TF cannot reconnect "
                                "around them", self.hung_in_view())
                    time.sleep(1.0)  # until the hung worker answers or dies
                renewed = owner._renew_variables(set(lost))  # noqa: SLF001
                variables = owner._named_variables()  # noqa: SLF001
                completed_then = self.checkpoints.restore(variables)
                owner._retrace_all()  # noqa: SLF001
                rebuild_per_worker(owner._per_worker_values(), None, resources_only=True)  # noqa: SLF001
                rolled_back = max(0, self._scheduler.completed() - (completed_then or 0))
                recovery = time.monotonic() - back_at
                for ps in lost:
                    stats = self.ps_stats[ps]
                    stats.recoveries += 1
                    stats.last_recovery_s = recovery
                    stats.rolled_back_closures += rolled_back
                with self._lost_lock:
                    self._lost_ps.clear()
                    self._scheduler.resume()  # the pause taken when the loss was seen
                log.warning(
                    "ps task(s) %s recovered from %s: %d variables re-created, every variable "
                    "restored; %d completed closures rolled back (%.2f s after the task came "
                    "back, %.2f s in all)", lost, self.checkpoints.latest(), renewed, rolled_back,
                    recovery, time.monotonic() - started,
                )
            finally:
                self._scheduler.resume()

    def _wait_for_ps(self, lost: list[int], owner) -> float | None:
        deadline = time.monotonic() + self.config.ps_timeout
        for ps in lost:
            address = self._cluster.address("ps", ps)
            while not _runtime.tcp_reachable(address, timeout=1.0):
                if owner._closed or time.monotonic() > deadline:  # noqa: SLF001
                    if not owner._closed:  # noqa: SLF001
                        self._give_up(lost, f"it did not come back within ps_timeout="
                                      f"{self.config.ps_timeout:g} s")
                    return None
                time.sleep(0.2)  # polling a socket while the task restarts
        return time.monotonic()

    def _give_up(self, lost: list[int], why: str) -> None:
        names = ", ".join(f"ps:{ps} at {self._cluster.address('ps', ps)}" for ps in lost)
        error = PSUnavailableError(
            f"Parameter server task {names} was lost and its variables cannot be recovered: "
            f"{why}. Pass checkpoint_dir= to ParameterServerStrategy to survive ps restarts.",
            task=f"ps:{lost[0]}", address=self._cluster.address("ps", lost[0]),
        )
        self.broken = error
        self._scheduler.fail_all(error)
        with self._lost_lock:
            if self._lost_ps:
                self._scheduler.resume()  # the pause taken when the loss was seen
            self._lost_ps.clear()
        log.error("%s", error)


def rebuild_per_worker(values: list[PerWorker], worker: int | None, *, resources_only: bool) -> None:
    """Build the per-worker values of `worker` (or of every worker) again.

    With `resources_only`, datasets and iterators are kept (their state lives
    on workers that did not fail; after a ps recovery they read on from where
    they were); resources from `create_per_worker_resource` are rebuilt.
    """
    for value in values:
        if resources_only and isinstance(value, (PerWorkerDataset, PerWorkerIterator)):
            continue
        for index in range(value.num_workers) if worker is None else (worker,):
            value.rebuild(index)
