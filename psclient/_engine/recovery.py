"""The recovery thread: carries out what `psclient._core.recovery_machine` decides.

`Recovery` owns one thread (and a checkpoint's copy before its cut, on a
thread of its own: `checkpoint_copy`, stopped and joined by `stop`). Each round
it observes the tasks (heartbeat probes of the workers in rotation, TCP state
of those out of it and of lost ps tasks), feeds what it saw to the
`RecoveryMachine` as events, and carries out the actions that come back, one at
a time, reporting each operation's outcome as a `Done` event. Dispatcher
threads and callers only post events (`report`, `checkpoint`); they never wait
on this thread's work while holding a lock, and this thread holds no lock while
it calls TensorFlow or waits.

It works with narrow collaborators passed in (the scheduler, the prober, the
variable store, the per-worker registry, a retrace and a connect callable):
nothing here keeps the strategy alive.

Dispatcher threads classify a failed call with `FailureProbes`
(psclient._engine.probes).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import queue
import threading
import time
from typing import Any, Callable

from psclient._core.tcp_state import TcpState
from psclient._engine.checkpoint_copy import CopyThread
from psclient._engine.edge import Edge, Roster, StrategyParts
from psclient._engine.probes import FailureProbes, Published
from psclient._engine.ps_restore import PSStats, PsRestore
from psclient._engine.reconnect import Reconnector, Refused
from psclient._engine.recovery_config import RecoveryConfig
from psclient._engine.recovery_endings import finish, unavailable_error
from psclient._core import ps_access, recovery_messages as rm
from psclient._core.errors import first_line, hung_ps_of
from psclient._core.checkpoint_schedule import shut_down_error
from psclient._core.health import Prober
from psclient._core.ps_loss import asks_for_restarted_ps
from psclient._core.recovery_machine import RecoveryMachine
from psclient._core.scheduler import Scheduler

__all__ = ["PSStats", "Recovery", "RecoveryConfig"]

log = logging.getLogger("psclient")


@dataclasses.dataclass(frozen=True)
class Wiring:
    """The engine's pieces the recovery thread works with: the prober and the failure probes, what it
    publishes for them (view, epochs), its inbox (where `report` and the dispatcher post), and the
    dispatcher's `cancel_calls(worker)` for a worker taken out."""

    prober: Prober
    probes: FailureProbes
    published: Published
    inbox: queue.Queue
    cancel_calls: Callable[[int], int]


class Recovery:
    """The recovery thread and the state it keeps for `stats()`, checkpoints and restore."""

    def __init__(
        self,
        config: RecoveryConfig,
        *,
        roster: Roster,
        scheduler: Scheduler,
        edge: Edge,
        parts: StrategyParts,
        wiring: Wiring,
        clock: Callable[[], float] = time.monotonic,
    ):
        # `parts`: what the strategy hands its engine (edge.StrategyParts); `wiring`: the
        # engine's other pieces this thread works with; `edge`: what is asked of TensorFlow.
        store, checkpoints, prober = parts.store, parts.checkpoints, wiring.prober
        self._edge = edge
        self.config = config
        self._roster = roster
        self._scheduler = scheduler
        self._prober = prober
        self._reconnector = Reconnector(edge, roster, prober, probe_timeout=config.probe_timeout)
        self._store = store
        self._per_worker = parts.per_worker
        self._retrace = parts.retrace or _no_retrace
        self._cancel_calls = wiring.cancel_calls
        self._checkpoint_meta = parts.checkpoint_meta or (lambda variables: None)  # nothing saved beside
        self._meta_restored = parts.meta_restored or (lambda meta, lost=None: None)
        self._clock = clock
        self.checkpoints = checkpoints
        cluster = roster.cluster
        self._machine = RecoveryMachine(config.machine(
            cluster.num_workers, cluster.num_ps, checkpointing=self.checkpoints is not None,
            has_checkpoint=self.checkpoints is not None and self.checkpoints.latest() is not None,
        ), clock())
        self._copy = CopyThread(self._copy_for_checkpoint, self.report)
        self._published = wiring.published
        self.probes = wiring.probes
        self._inbox = wiring.inbox
        self.broken: BaseException | None = None
        self._restore = PsRestore(store, checkpoints, cluster.num_ps, scheduler.completed,
                                  self._meta_restored, clock, holding=self.probes.holding)
        self.ps_stats = self._restore.ps_stats
        self.checkpoints_written = 0
        self._paused_at = clock()
        # Variables created when the newest checkpoint was taken (read by schedule()).
        self.saved_created = -1
        self._last_failure: tuple | None = None  # (step, error type, first line), for the log
        self._same_failures = 0
        self._stopping = False
        # Notified whenever what is published changes, or the thread ends: `wait_ps_settled`.
        self._settled = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="psclient-health", daemon=True)

    # ------------------------------------------------------- other threads
    def start(self) -> None:
        self._thread.start()

    def report(self, event: Any) -> None:
        """Post an event (from a dispatcher thread or a caller); never blocks."""
        self._inbox.put(event)

    def checkpoint(self, reason: str) -> str | None:
        """Take a checkpoint between closures on the recovery thread and wait for it.

        Returns its path, or None if running closures did not stop within hang_timeout
        (skipped). Raises what the save raised, or StrategyClosedError if the strategy shuts down first.
        """
        if self.checkpoints is not None:
            self.checkpoints.check_writable()  # another run's checkpoints: refused here, at once
        ticket: concurrent.futures.Future = concurrent.futures.Future()
        if not self._stopping:
            self.report(rm.CheckpointRequested(ticket, reason))
        while not ticket.done():
            if self._stopping and not self._thread.is_alive():
                # Posted after the thread's last look at its inbox: nobody will answer.
                finish(rm.Finish(ticket, error=shut_down_error()))
                break
            concurrent.futures.wait([ticket], timeout=1.0)
        return ticket.result()

    def restore(self) -> dict | None:
        """On the caller's thread (before scheduling): newest complete checkpoint into every variable."""
        created = self._store.count()
        restored = self.checkpoints.restore(self._store.named(), adopt=True, tables=self._store.tables())
        if restored is None:
            return None
        self.saved_created = created
        self.report(rm.Restored())
        log.info("restored %s (%s closures completed)", restored["path"], restored["completed_closures"])
        return restored

    def stop(self, timeout: float | None) -> bool:
        """Stop the thread; False if it is still inside a call after `timeout`."""
        self._stopping = True
        if self.checkpoints is not None:
            self.checkpoints.close(timeout)  # the write in flight ends first: its callers get its path
        self.report(rm.Shutdown())
        if self._thread.ident is not None:
            self._thread.join(timeout)
        copy_ended = self._copy.stop(timeout)
        return not self._thread.is_alive() and copy_ended

    def wait_ps_settled(self, epoch: int, timeout: float) -> bool:
        """Until the ps loss seen at `epoch` is settled (ps_epoch moved on) or the recovery ended."""
        with self._settled:
            return self._settled.wait_for(lambda: self._published.ps_epoch != epoch or self.stopped, timeout)

    @property
    def stopped(self) -> bool:  # shut down, died or given up: nothing will settle a ps loss
        return self._stopping or self.broken is not None

    def hung_in_view(self) -> list[int]:
        """Workers in TF's view that may hang (TCP not refused): no reconnect while any."""
        return [
            w for w in self._machine.blocking()
            if self._edge.tcp_state(self._roster.cluster.address("worker", w), 1.0) != TcpState.CLOSED
        ]

    # ------------------------------------------------------------ the thread
    def _loop(self) -> None:
        ended = False
        try:
            with ps_access.handled_elsewhere():  # its steps' own ps errors fail them: the machine decides
                self._rounds()
            ended = True
        finally:
            self._stopping = True
            if not ended:
                self._died()  # the exception goes on to threading.excepthook, which prints it
            self._answer_leftover_requests()
            with self._settled:
                self._settled.notify_all()

    def _rounds(self) -> None:
        next_round = self._clock()
        while not self._machine.closed:
            timeout = max(0.0, next_round - self._clock())
            try:
                event = self._inbox.get(timeout=timeout)
            except queue.Empty:
                event = None
            if isinstance(event, rm.Drained):  # a checkpoint's pause drained: its round now
                if not self._machine.draining:
                    continue
            elif event is not None:
                self._handle(event)
                # Sooner if the event asked for it (a checkpoint's pause waits for the next round's Tick).
                next_round = min(next_round, self._clock() + self._machine.poll_interval())
                continue
            next_round = self._clock() + self._machine.poll_interval()
            for observed in self._observe():
                self._handle(observed)
                if self._machine.closed:
                    return
            next_round = min(next_round, self._clock() + self._machine.poll_interval())

    def _died(self) -> None:
        error = RuntimeError(
            "psclient's recovery thread failed (traceback in the log): this strategy can no "
            "longer recover from task failures. Call shutdown() and create a new strategy."
        )
        log.error("%s", error)
        self.broken = error
        for action in self._machine.handle(rm.Shutdown(), self._clock()):
            if isinstance(action, rm.Finish):
                finish(rm.Finish(action.ticket, error=error))
        self._scheduler.fail_all(error)

    def _answer_leftover_requests(self) -> None:
        while True:
            try:
                event = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, rm.CheckpointRequested):
                finish(rm.Finish(event.ticket, error=shut_down_error()))

    def _observe(self) -> list:
        now = self._clock()
        events: list = []
        machine = self._machine
        interval = self.config.interval
        # (The scheduler, the prober and this thread read the same monotonic clock.)
        last_done = self._scheduler.last_done_times()
        for worker, state in enumerate(machine.workers):
            device = self._edge.worker_device(worker)
            if state is rm.TaskState.UP:
                waited = self._prober.overdue(device, now)
                if waited is None:
                    if self._prober.last_failed(device) and self._edge.tcp_state(
                            self._roster.cluster.address("worker", worker), 1.0) == TcpState.CLOSED:
                        # Its heartbeat failed and its port refuses: the process is
                        # gone. Without this, a worker that dies with no closure
                        # running stays "up" until a closure is sent to it.
                        events.append(rm.WorkerNotAnswering(worker, None, machine.epochs[worker]))
                        continue
                    # The heartbeat: one round trip per round, unless a closure
                    # finished there within the round (that is a sign of life too).
                    if now - last_done[worker] >= interval:
                        self._prober.start(device)
                    continue
                # Silent since its last sign of life (an answer, a finished
                # closure), counted from at most one round before this probe.
                life = max(self._prober.answered_at(device), last_done[worker])
                if life != float("-inf"):
                    waited = min(now - life, waited + interval)
                events.append(rm.ProbeOverdue(worker, waited))
            elif state not in (rm.TaskState.REJOINING, rm.TaskState.RETIRED):
                pending = self._prober.overdue(device, now) is not None
                tcp = self._edge.tcp_state(self._roster.cluster.address("worker", worker), 1.0)
                events.append(rm.WorkerSeen(worker, tcp, pending))
        for ps in machine.lost_ps():
            events.append(rm.PsSeen(ps, self._edge.tcp_state(self._roster.cluster.address("ps", ps), 1.0)))
        events.append(rm.Tick(running=self._scheduler.running(), completed=self._scheduler.completed()))
        return events

    def _handle(self, event: Any) -> None:
        pending = [event]
        while pending:
            actions = self._machine.handle(pending.pop(0), self._clock())
            self._publish()
            for action in actions:
                done = self._carry_out(action)
                if done is not None:
                    # Before the outcome: the flow that goes on from it must know.
                    pending += self._ps_restarted_behind(done)
                    pending.append(done)
            with self._settled:  # after the actions: FailAll sets `broken`
                self._settled.notify_all()

    def _ps_restarted_behind(self, done: rm.Done) -> list:
        """A PsNotAnswering for each ps that no longer holds its variables, after
        a reconnect (it introduces a restarted ps to the coordinator, and the
        old handles then fail with "invalid device") or a failed step.

        Nothing else notices a ps restarted while no closure runs against it
        (every worker out, say): checkpoints and rebuilds would fail against
        it, and scheduled functions with InvalidArgumentError, for good.
        """
        lost = frozenset(self._machine.lost_ps())  # their recovery renews their handles anyway
        if self._machine.broken or not asks_for_restarted_ps(done.op, done.ok, done.error, bool(lost)):
            return []
        # A step given up on a ps that did not answer: it would not answer the check either (the
        # caller waited probe_timeout more for it), and a hung ps holds its variables.
        hung = hung_ps_of(done.error) if not done.ok else None
        stale = self.probes.stale_ps(skip=lost if hung is None else lost | {hung})
        if not stale:
            return []
        log.warning("ps task(s) %s no longer hold this coordinator's variables (restarted): "
                    "recovering them from the newest checkpoint", list(stale))
        return [rm.PsNotAnswering(stale, self._machine.ps_epoch)]

    def _publish(self) -> None:
        machine = self._machine
        self._published.view = machine.view
        self._published.ps_down = frozenset(machine.lost_ps())
        self._published.epochs = tuple(machine.epochs)
        self._published.ps_epoch = machine.ps_epoch

    def _carry_out(self, action: Any) -> rm.Done | None:
        if not isinstance(action, rm.OPERATIONS):
            self._apply(action)
            return None
        try:
            # Through an executor of this thread's own: a reconnect (TF's `update_server_def`) waits for
            # every op pending on TF's shared default executor, and an error left on that executor's
            # stream to a task reaches whichever thread's op comes next (docs/development.md).
            with self._edge.own_executor():
                value = self._operate(action)
        except Exception as error:  # noqa: BLE001 - the thread must outlive one failed step: the machine decides
            self._log_failure(action, error)
            return rm.Done(action, ok=False, error=error)
        if isinstance(value, Refused):
            return rm.Done(action, ok=False, value=value.workers)
        if value is False:
            return rm.Done(action, ok=False)
        return rm.Done(action, ok=True, value=value)

    def _log_failure(self, action: Any, error: BaseException) -> None:
        """A warning for a step's failure; the same failure again in a row only
        at its 2nd, 4th, 8th... time (the machine backs off between tries)."""
        key = (type(action).__name__, type(error).__name__, first_line(error))
        count = self._same_failures + 1 if key == self._last_failure else 1
        self._last_failure, self._same_failures = key, count
        if count & (count - 1) == 0:
            again = f" ({count} times in a row)" if count > 1 else ""
            log.warning("recovery step %s failed%s: %s: %s", *key[:1], again, *key[1:],
                        exc_info=log.isEnabledFor(logging.DEBUG))

    # Each action and operation has a handler of its own, registered by type.
    @functools.singledispatchmethod
    def _apply(self, action: Any) -> None:
        raise TypeError(f"unknown recovery action {action!r}")

    @_apply.register
    def _take_out(self, action: rm.TakeOut) -> None:
        log.warning("worker %d %s: taking it out and running its closures elsewhere", action.worker, action.why)
        self._scheduler.worker_lost(action.worker, detected_after=action.detected_after)
        # Its closures are queued again: calls still running there (a hung
        # worker's) would hold their threads until it answers.
        self._cancel_calls(action.worker)

    @_apply.register
    def _bring_up(self, action: rm.BringUp) -> None:
        self._scheduler.worker_up(action.worker, recovered_after=action.recovered_after)
        joined, since = ("joined", "was added") if action.joined else ("rejoined", "answered again")
        log.info("worker %d %s (%.2f s after it %s)", action.worker, joined, action.recovered_after, since)

    @_apply.register
    def _copy_before_cut(self, action: rm.CopyForCheckpoint) -> None:
        self._copy.start(action.copy)

    def _copy_for_checkpoint(self, stop: Callable[[], bool]) -> Any:
        # Training goes on while the big sparse-updated variables are copied: the cut then
        # reads again only their rows written since (checkpoints.fuzzy_copy).
        return self.checkpoints.prepare(self._store.named(), self._store.tables(), stop=stop)

    @_apply.register
    def _stop_copy(self, action: rm.StopCopy) -> None:
        self._copy.stop(self.config.hang_timeout)

    @_apply.register
    def _pause(self, action: rm.PauseDispatch) -> None:
        if action.reason == "checkpoint" and self.checkpoints is not None:
            self.checkpoints.use_prepared(self._copy.take())  # CheckpointCopied came first
        self._scheduler.pause()
        if action.reason == "checkpoint":  # a ps loss's pause is not a checkpoint's stall
            self._paused_at = self._clock()
        if action.reason == "checkpoint" and self._scheduler.running() == 0:
            # Nothing runs: the checkpoint need not wait up to a round for the next Tick.
            self.report(rm.Tick(running=0, completed=self._scheduler.completed()))

    @_apply.register
    def _resume(self, action: rm.ResumeDispatch) -> None:
        self._scheduler.resume()
        if action.reason != "checkpoint":  # a checkpoint still pausing stalls training from here on only
            self._paused_at = self._clock()
        elif self.checkpoints is not None:  # how long training stopped for the checkpoint
            self.checkpoints.times["last_stall_seconds"] = self._clock() - self._paused_at
            self.checkpoints.discard_prepared()  # a cut not taken (skipped, failed): its copies go

    @_apply.register
    def _requeue_running(self, action: rm.RequeueRunning) -> None:
        self._scheduler.requeue_running()

    @_apply.register
    def _ps_failed(self, action: rm.PsFailed) -> None:
        self.ps_stats[action.ps].failures += 1
        log.warning("ps task %d (%s) does not answer", action.ps, self._roster.cluster.address("ps", action.ps))

    @_apply.register
    def _ps_recovered(self, action: rm.PsRecovered) -> None:
        self._restore.recovered(action, self.checkpoints.latest() if self.checkpoints else None)

    @_apply.register
    def _fail_all(self, action: rm.FailAll) -> None:
        error = unavailable_error(action, self._roster.cluster, self.config.worker_timeout)
        if action.permanent:
            self.broken = error
        self._scheduler.fail_all(error)

    @_apply.register
    def _answer(self, action: rm.Finish) -> None:
        finish(action)

    @functools.singledispatchmethod
    def _operate(self, action: Any) -> Any:
        raise TypeError(f"unknown recovery operation {action!r}")

    @_operate.register
    def _reconnect(self, action: rm.Reconnect) -> Any:
        return self._reconnector.reconnect(action, self._scheduler.retired())

    @_operate.register
    def _check_answers(self, action: rm.CheckAnswers) -> bool:
        if not self.probes.answers(self._edge.worker_device(action.worker)):
            log.info("worker %d accepts connections but does not answer yet; retrying", action.worker)
            return False
        return True

    @_operate.register(rm.RebuildWorker)
    @_operate.register(rm.RebuildResources)
    def _rebuild(self, action: Any) -> bool:
        worker = action.worker if isinstance(action, rm.RebuildWorker) else None
        self._per_worker.rebuild(worker, resources_only=worker is None)
        return True

    @_operate.register
    def _renew_and_restore(self, action: rm.RenewAndRestore) -> Any:
        return self._restore.renew_and_restore(action)  # the lost ps only, or every variable

    @_operate.register
    def _retrace_functions(self, action: rm.Retrace) -> bool:
        self._retrace()
        return True

    @_operate.register
    def _take_checkpoint(self, action: rm.Checkpoint) -> int:
        return self._checkpoint(action.reason)

    # ------------------------------------------------------------- steps
    def _checkpoint(self, reason: str) -> int:
        """Take a checkpoint in the cut (a snapshot on each ps); its write goes on in the background."""
        created, variables, completed = self._store.count(), self._store.named(), self._scheduler.completed()
        self.checkpoints.times["last_drain_seconds"] = self._clock() - self._paused_at  # running ones ended
        # Taken between closures: the ledgers' positions on the ps match the variables saved.
        # The dynamic tables too: each ps writes its shards beside its variables.
        delta = {"delta": True} if reason == "delta" else {}  # between full ones (checkpoint_deltas)
        pending = self.checkpoints.snapshot(variables, completed, meta=self._checkpoint_meta(variables),
                                            tables=self._store.tables(), **delta)  # failures: _carry_out logs

        def written(pending, path: str | None, error: BaseException | None) -> None:  # on the writer thread
            if error is None:
                self.saved_created = created
                self.checkpoints_written += 1
                # A delta due is written full when it has no base (the first after a restore, a ps
                # recovery or a new slot): the path says which it became.
                kind = "delta due, written full: no base to diff" if reason == "delta" and \
                    ".delta-" not in str(path) else reason
                log.info("checkpoint %s written (%s, %d closures completed)", path, kind, completed)
            else:
                log.warning("checkpoint (%s) could not be written: %s", reason, first_line(error))
            self.report(rm.CheckpointWritten(path, completed, error))
        self.checkpoints.write_in_background(pending, written)
        return completed


def _no_retrace() -> None:
    """Nothing is traced (a fake edge's closures): nothing to trace again."""
