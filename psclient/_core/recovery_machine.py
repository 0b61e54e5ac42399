"""Recovery decisions as one state machine: events in, actions out. Pure logic.

`RecoveryMachine.handle(event, now)` is the only way recovery state changes.
It does no I/O, starts no thread and never waits: the clock value comes in
with each event, and what must happen comes out as a list of actions, which
one thread (`psclient._engine.recovery`) carries out in order. Actions
documented as an *operation* report their outcome back as a `Done` event; the
machine starts at most one operation at a time. Dispatcher threads only report what they saw.

The states of a task (`TaskState`) and which event leads to which actions: `recovery_messages`.

Flows, tried after each event in this order, one at a time:
1. ps recovery (`PsLoss`, ps_loss.py): wait for running closures, then for
   every lost ps to accept connections; ReconnectPs -> RenewAndRestore (the
   lost ps only, or every variable: `ps_recovery`) -> Retrace -> RebuildResources ->
   PsRecovered + ResumeDispatch, or FailAll(ps, permanent). Nothing else runs meanwhile;
   a ps lost meanwhile joins the loss (its steps start again from the reconnect).
2. drop gone workers from TF's view: DropWorkers(UP workers).
3. checkpoint (requested, or due by interval/count; one write at a time): with
   `copies_before_cut`, CopyForCheckpoint first (a thread of its own: training and flows 1
   and 2's TakeOut go on, drops and rejoins wait) until CheckpointCopied; then PauseDispatch,
   wait for running closures (hang_timeout, then skipped), Checkpoint (a snapshot),
   ResumeDispatch. A ps loss stops the copy (StopCopy).
4. rejoin: RejoinWorker(UP workers + it) -> CheckAnswers -> RebuildWorker -> BringUp.

A failed drop, checkpoint or rejoin (a probe or a rebuild) is tried again after a pause that
doubles with each failure in a row (`Backoff`, retry.py): a step failing the same way never spins.

Guards: no Reconnect while a worker in TF's view hangs (SUSPECT or HUNG and
not answering): TF's `update_server_def` would wait on it for good. It does
not wait for closures running on other workers (measured), so dispatch goes on
during a Reconnect. Without `checkpoint_while_hung`, no checkpoint while a worker in
the view hangs (registering the saver's function would wait on it).
Reports carry the epoch they were made in (`epoch` of a worker, `ps_epoch`):
one made before the task came back is stale and ignored.
"""

from __future__ import annotations

import functools
from typing import Any

from psclient._core.checkpoint_schedule import CheckpointSchedule, CopyPhase, shut_down_error
from psclient._core.joining import Joins
from psclient._core.machine_config import MachineConfig
from psclient._core.ps_loss import PS_STEPS, GiveUp, PsLoss
from psclient._core.recovery_messages import (
    CheckAnswers,
    Checkpoint,
    CheckpointCopied,
    CheckpointRequested,
    CheckpointWritten,
    Done,
    DropWorkers,
    FailAll,
    Finish,
    PauseDispatch,
    ProbeOverdue,
    PsFailed,
    PsNotAnswering,
    PsRecovered,
    PsSeen,
    RebuildResources,
    RebuildWorker,
    Reconnect,
    ReconnectPs,
    RejoinWorker,
    RenewAndRestore,
    Restored,
    ResumeDispatch,
    Retrace,
    Shutdown,
    TakeOut,
    TaskState,
    Tick,
    WorkerAdded,
    WorkerNotAnswering,
    WorkerRetired,
    WorkerSeen,
)
from psclient._core.retry import Backoff
from psclient._core.tcp_state import TcpState

__all__ = ["MachineConfig", "RecoveryMachine"]


class RecoveryMachine:
    """The recovery state of every task; see the module docstring. Workers join and
    leave at run time (their tickets: `Joins`, joining.py)."""

    def __init__(self, config: MachineConfig, now: float):
        self.config = config
        self.workers = [TaskState.UP] * config.num_workers
        self.ps = [TaskState.UP] * config.num_ps
        #: Workers in TF's current view of the cluster.
        self.view = frozenset(range(config.num_workers))
        #: Per worker, incremented when it comes back; per ps recovery, `ps_epoch`.
        self.epochs = [0] * config.num_workers
        self.ps_epoch = 0
        self.broken = False
        self.closed = False
        self.op: Any = None  # the operation under way
        self._back_since: dict[int, float] = {}
        self._all_down_since: float | None = None
        self._gave_up_since: float | None = None
        self._running = self._completed = 0
        self._ps_loss: PsLoss | None = None  # a ps loss under way
        # Rounds seen, so that a running count from before a pause is never used.
        self._rounds = self._paused_at_round = 0
        self._checkpoints = CheckpointSchedule.of(config, now)  # checkpoints: when each is due
        self._ckpt_waiting_since: float | None = None
        self._ckpt_reason = ""
        self._copy = CopyPhase()
        # A failed checkpoint or drop is tried again after a growing pause, not at once.
        self.backoff = Backoff(base=min(0.5, config.interval), cap=30.0)
        self._joins = Joins()

    # ------------------------------------------------------------ queries
    def blocking(self) -> list[int]:
        """Workers in TF's view that may hang: no Reconnect while there are any."""
        return sorted(
            w for w in self.view
            if self.workers[w] in (TaskState.SUSPECT, TaskState.HUNG) and w not in self._back_since
        )

    def lost_ps(self) -> list[int]:
        return [ps for ps, state in enumerate(self.ps) if state is not TaskState.UP]

    @property
    def draining(self) -> bool:
        """Whether a checkpoint waits for the closures running at its pause to end."""
        return self._ckpt_waiting_since is not None

    def poll_interval(self) -> float:
        """How soon the next round is wanted."""
        if self.draining:
            return 0.02  # waiting for running closures to end (sooner: `Drained`)
        if self.lost_ps():
            return 0.2
        return self.config.interval

    # -------------------------------------------------------------- entry
    def handle(self, event: Any, now: float) -> list:
        """Apply one event; return the actions to carry out, in order."""
        if self.closed:
            if isinstance(event, CheckpointRequested):
                return [Finish(event.ticket, error=shut_down_error())]
            return []
        actions = self._on(event, now)
        if not self.closed:
            actions += self._advance(now)
        return actions

    # ------------------------------------------------------------- events
    @functools.singledispatchmethod
    def _on(self, event: Any, now: float) -> list:
        raise TypeError(f"unknown recovery event {event!r}")

    @_on.register
    def _on_tick(self, event: Tick, now: float) -> list:
        self._running, self._completed = event.running, event.completed
        self._rounds += 1
        if self._ps_loss is not None:
            self._ps_loss.retry_next_round = False
        since = self._all_down_since
        if since is not None and now - since >= self.config.worker_timeout:
            first = self._gave_up_since != since
            self._gave_up_since = since
            # Every round, so work scheduled after giving up fails too, not hangs.
            return [FailAll("workers", waited=now - since, first=first)]
        return []

    @_on.register
    def _on_probe_overdue(self, event: ProbeOverdue, now: float) -> list:
        if self.workers[event.worker] is TaskState.UP and event.waited >= self.config.hang_timeout:
            return self._take_out(event.worker, TaskState.HUNG, event.waited, now, "hung")
        return []

    @_on.register
    def _on_worker_not_answering(self, event: WorkerNotAnswering, now: float) -> list:
        if self.workers[event.worker] is TaskState.UP and event.epoch == self.epochs[event.worker]:
            return self._take_out(event.worker, TaskState.SUSPECT, event.detected_after, now, "not answering")
        return []

    @_on.register
    def _on_worker_seen(self, event: WorkerSeen, now: float) -> list:
        worker = event.worker
        if self.workers[worker] in (TaskState.UP, TaskState.REJOINING, TaskState.RETIRED):
            return []
        if event.tcp == TcpState.CLOSED:
            self.workers[worker] = TaskState.LOST
            self._back_since.pop(worker, None)
        elif event.probe_pending or event.tcp == TcpState.SILENT:
            self.workers[worker] = TaskState.HUNG
            self._back_since.pop(worker, None)
        else:
            self._back_since.setdefault(worker, now)
        return []

    @_on.register
    def _on_ps_not_answering(self, event: PsNotAnswering, now: float) -> list:
        if event.epoch != self.ps_epoch or self.broken:
            return []
        actions = []
        for ps in event.ps:
            if self.ps[ps] is TaskState.UP:
                self.ps[ps] = TaskState.LOST
                actions.append(PsFailed(ps))
        if actions and self._ps_loss is not None:
            self._ps_loss.widened(midway=isinstance(self.op, PS_STEPS))  # not a rejoin still under way
        elif actions:
            self._ps_loss = PsLoss(now, self.config.hang_timeout, self.config.ps_timeout, self.config.ps_attempts,
                                   mode=self.config.ps_recovery)
            # Hold the queue at once: until the recovery, every closure fails against it.
            actions += [PauseDispatch("ps"), *self._copy.stop()]
            if not (self.config.checkpointing and self._checkpoints.has_checkpoint):
                why = ("this strategy has no checkpoint_dir to restore its variables from"
                       if not self.config.checkpointing else "no checkpoint had been written yet")
                actions += self._give_up_ps(why)
        return actions

    @_on.register
    def _on_ps_seen(self, event: PsSeen, now: float) -> list:
        if self.ps[event.ps] is TaskState.LOST and event.tcp == TcpState.OPEN:
            self.ps[event.ps] = TaskState.RECOVERING
        return []

    @_on.register
    def _on_checkpoint_requested(self, event: CheckpointRequested, now: float) -> list:
        if not self.config.checkpointing:
            return [Finish(event.ticket, value=None)]
        return self._checkpoints.request(event.ticket, event.reason)

    @_on.register
    def _on_checkpoint_written(self, event: CheckpointWritten, now: float) -> list:
        self.backoff.succeeded("checkpoint") if event.error is None else self.backoff.failed("checkpoint", now)
        return self._checkpoints.written(now, event.path, event.completed, event.error)

    @_on.register
    def _on_checkpoint_copied(self, event: CheckpointCopied, now: float) -> list:
        current = event.copy == self._copy.under_way
        self._copy.ended(event.copy)
        if event.error is None or not current:
            return []
        # A ps did not answer the copy: a cut would pause dispatch and wait on it as long again.
        self._copy.used()
        self.backoff.failed("checkpoint", now)
        return self._checkpoints.failed(now, event.error)

    @_on.register
    def _on_restored(self, event: Restored, now: float) -> list:
        self._checkpoints.has_checkpoint = True
        return []

    @_on.register
    def _on_shutdown(self, event: Shutdown, now: float) -> list:
        self.closed = True
        return self._checkpoints.closed() + self._joins.shutdown()

    @_on.register
    def _on_worker_added(self, event: WorkerAdded, now: float) -> list:
        refused = self._joins.add(event.worker, event.ticket, self.workers, self.epochs)
        if not refused:
            self._back_since[event.worker] = now  # a rejoin candidate: the rejoin flow brings it in
        return refused

    @_on.register
    def _on_worker_retired(self, event: WorkerRetired, now: float) -> list:
        worker = event.worker
        if worker >= len(self.workers) or self.workers[worker] is TaskState.RETIRED:
            return [Finish(event.ticket, value=worker)]
        actions = self._joins.leave(worker, event.ticket)
        self._back_since.pop(worker, None)
        if not self._up() and self._all_down_since is None:
            self._all_down_since = now
        return actions + self._retire_out_of_view()

    def leaving(self) -> list[int]:
        """Retired workers still in TF's view."""
        return self._joins.leaving()

    def _retire_out_of_view(self) -> list:
        # A Reconnect under way may still put a worker it names into the view.
        coming = self.op.workers if isinstance(self.op, Reconnect) else frozenset()
        actions, left = self._joins.out_of_view(self.view, coming, self.workers)
        for worker in left:
            self._back_since.pop(worker, None)
        return actions

    @_on.register
    def _on_done(self, event: Done, now: float) -> list:
        op, self.op = event.op, None
        actions = self._reconnected(op, event, now) if isinstance(op, Reconnect) else []
        return actions + self._after(op, event, now)

    def _reconnected(self, op: Reconnect, event: Done, now: float) -> list:
        if event.ok:
            self.view = frozenset(op.workers)
        actions = self._retire_out_of_view()
        if not event.ok:
            # Named workers that did not answer: out of rotation, decided next round.
            for worker, tcp in (event.value or {}).items():
                if self.workers[worker] is TaskState.UP:
                    state = TaskState.LOST if tcp == TcpState.CLOSED else TaskState.SUSPECT
                    actions += self._take_out(worker, state, None, now, "not answering before a reconnect")
        return actions

    # The next step of the flow that started the operation (one handler per operation type).
    @functools.singledispatchmethod
    def _after(self, op: Any, event: Done, now: float) -> list:
        raise TypeError(f"unknown recovery operation {op!r}")

    @_after.register
    def _after_drop(self, op: DropWorkers, event: Done, now: float) -> list:
        if event.ok:
            self.backoff.succeeded("drop")
        elif not event.value:
            # Failed, or refused by no worker (a ps not reachable): the same
            # again at once would fail the same way. (Workers named as not
            # answering are taken out: the next try is another one.)
            # At most 2 s apart: a restarted ps is waited for, not minutes.
            self.backoff.failed("drop", now, cap=2.0)
        return []

    @_after.register(Checkpoint)
    def _after_checkpoint(self, op: Checkpoint, event: Done, now: float) -> list:
        if event.ok:  # taken: its requests wait for its write (CheckpointWritten)
            return [self._resume_checkpoint(), *self._checkpoints.started()]
        self.backoff.failed("checkpoint", now)
        return [self._resume_checkpoint(), *self._checkpoints.failed(now, event.error)]

    # -------------------------------------------------------------- flows
    def _advance(self, now: float) -> list:
        if self.op is not None:
            return []
        if self.lost_ps():
            return self._advance_ps(now)
        copying = self._copy.under_way is not None  # no Reconnect beside the copy's calls
        actions = [] if copying else self._advance_drop(now)
        if self.op is None:
            actions += self._advance_checkpoint(now)
        if self.op is None and self._ckpt_waiting_since is None and not copying:
            actions += self._advance_rejoin(now)
        return actions

    def _gone_in_view(self) -> list[int]:
        return [w for w in self.view if self.workers[w] is TaskState.LOST or self._joins.is_leaving(w)]

    def _up(self) -> frozenset:
        """Workers that take work (a leaving one is no longer among them)."""
        return frozenset(w for w, s in enumerate(self.workers) if s is TaskState.UP and not self._joins.is_leaving(w))

    def _reconnect(self, kind: type, workers: frozenset, *returning: int) -> list:
        return self._start(kind(workers, *returning, leaving=self._joins.leaving_in_view(self.view, workers)))

    def _idle_since_pause(self) -> bool:
        """No closure runs, by a round counted after the newest pause."""
        return self._rounds > self._paused_at_round and self._running == 0

    def _start(self, op: Any) -> list:
        self.op = op
        return [op]

    def _advance_drop(self, now: float) -> list:
        target = self._up() & self.view
        if not self._gone_in_view() or not target or not self.backoff.ready("drop", now):
            return []
        # TF fails anything that registers a function on every task (a
        # checkpoint, a new trace) while a gone worker is in its view.
        if self.blocking():
            return []  # no Reconnect while a worker in the view may hang
        return self._reconnect(DropWorkers, target)

    def _advance_rejoin(self, now: float) -> list:
        ready = [w for w in self._back_since
                 if self.backoff.ready(("rejoin", w), now) and not self._joins.is_leaving(w)]
        if self.broken or not ready or self.blocking():
            return []
        # Fewest failed tries first: a worker that accepts connections but does not answer (its step
        # stuck on a restarted ps) came first by index every round and kept the others out (83 s).
        worker = min(ready, key=lambda w: (self.backoff.failures(("rejoin", w)), w))
        self.workers[worker] = TaskState.REJOINING
        return self._reconnect(RejoinWorker, self._up() | {worker}, worker)

    @_after.register(RejoinWorker)
    @_after.register(CheckAnswers)
    @_after.register(RebuildWorker)
    def _rejoin_step(self, op: Any, event: Done, now: float) -> list:
        worker = op.returning if isinstance(op, RejoinWorker) else op.worker
        if self.workers[worker] is not TaskState.REJOINING:
            return []
        if self._joins.is_leaving(worker):  # removed meanwhile: the flow ends, the drop flow takes it out
            self.workers[worker] = TaskState.UP if event.ok else TaskState.SUSPECT
            return []
        if self.lost_ps():
            # A ps was lost meanwhile: its recovery reconnects everything first.
            self.workers[worker] = TaskState.SUSPECT
            return []
        if not event.ok:
            self.workers[worker] = TaskState.SUSPECT  # decided again next round
            self._back_since.pop(worker, None)
            if not isinstance(op, RejoinWorker):  # not at once, nor every round for good; a silent worker briefly
                self.backoff.failed(("rejoin", worker), now, cap=None if isinstance(op, RebuildWorker) else 2.0)
            return []
        if isinstance(op, RejoinWorker):
            return self._start(CheckAnswers(worker))
        if isinstance(op, CheckAnswers):
            return self._start(RebuildWorker(worker))
        since = self._back_since.pop(worker, now)
        self.backoff.succeeded(("rejoin", worker))
        self.workers[worker] = TaskState.UP
        self.epochs[worker] += 1
        self._all_down_since = None
        return self._joins.joined(worker, since, now)

    def _advance_ps(self, now: float) -> list:
        loss = self._ps_loss
        if self.broken or loss is None or loss.retry_next_round:
            return []
        unreachable = any(state is TaskState.LOST for state in self.ps)
        waiting = loss.before_reconnect(now, self._running, unreachable)
        if isinstance(waiting, GiveUp):
            return self._give_up_ps(waiting.why)
        if waiting is not None:
            return waiting
        if self.blocking():
            return []  # a hung worker in the view: wait until it answers or dies
        return self._reconnect(ReconnectPs, self._up())

    @_after.register(ReconnectPs)
    @_after.register(RenewAndRestore)
    @_after.register(Retrace)
    @_after.register(RebuildResources)
    def _ps_step(self, op: Any, event: Done, now: float) -> list:
        lost = tuple(self.lost_ps())
        if self.closed or not lost:
            return []
        loss = self._ps_loss
        if loss.take_restart() and event.ok:  # another ps lost during it: from the start, next round
            return []
        if not event.ok:  # (no error: a worker taken out, or a ps just back not taking connections yet)
            given_up = loss.failed(event.error)
            return self._give_up_ps(given_up.why) if given_up else []
        step = loss.next_step(op, lost)
        if step is not None:
            return self._start(step)
        back_at = loss.back_at if loss.back_at is not None else now
        self._end_ps_loss()
        return [PsRecovered(lost, back_at), ResumeDispatch("ps")]

    def _give_up_ps(self, why: str) -> list:
        lost = tuple(self.lost_ps())
        self.broken = True
        self._end_ps_loss()
        return [FailAll("ps", lost=lost, why=why, permanent=True), ResumeDispatch("ps")]

    def _end_ps_loss(self) -> None:
        self.ps = [TaskState.UP] * len(self.ps)
        self.ps_epoch += 1
        self._ps_loss = None

    def _checkpoint_due(self, now: float) -> str | None:
        return self._checkpoints.due(now, self._completed, periodic=self.config.checkpointing and not self.broken)

    def _advance_checkpoint(self, now: float) -> list:
        reason = self._checkpoint_due(now)
        if reason is None:
            return []
        hung = self.blocking() and not self.config.checkpoint_while_hung
        if self._ckpt_waiting_since is None:
            if hung or self._gone_in_view() or any(s is TaskState.REJOINING for s in self.workers):
                return []  # wait until the view is clean
            if not self.backoff.ready("checkpoint", now):
                return []  # the last one failed: not again at once
            if self.config.copies_before_cut and not self._copy.done:
                return [self._copy.start()] if self._copy.under_way is None else []
            self._ckpt_waiting_since, self._ckpt_reason = now, reason
            self._paused_at_round = self._rounds
            return [PauseDispatch("checkpoint")]
        if hung or self._gone_in_view():
            self._ckpt_waiting_since = None
            return [self._resume_checkpoint()]  # started again once the view is clean
        if self._idle_since_pause():
            self._ckpt_waiting_since = None
            return self._start(Checkpoint(self._ckpt_reason))
        if now - self._ckpt_waiting_since >= self.config.hang_timeout:
            self._ckpt_waiting_since = None
            return [self._resume_checkpoint(), *self._checkpoints.skipped()]
        return []

    def _resume_checkpoint(self) -> ResumeDispatch:
        self._copy.used()  # the engine drops a copy whose cut was not taken
        return ResumeDispatch("checkpoint")

    def _take_out(self, worker: int, state: TaskState, detected_after, now: float, why: str) -> list:
        self.workers[worker] = state
        self._back_since.pop(worker, None)
        if not self._up() and self._all_down_since is None:
            self._all_down_since = now
        return [TakeOut(worker, detected_after, why)]
