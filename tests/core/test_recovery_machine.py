"""Every transition of the recovery state machine, with a fake clock (no cluster, no threads).

Each test feeds events as the recovery thread would (its rounds, dispatcher
reports, callers, the outcome of each operation as `Done`) and checks the
actions that come out, including the races found by reading the old code.
"""

import pytest

from psclient._core import recovery_messages as rm
from psclient._core.errors import StrategyClosedError
from psclient._core.recovery_machine import MachineConfig, RecoveryMachine
from psclient._core.recovery_messages import TaskState

UP, SUSPECT, HUNG, LOST, REJOINING, RECOVERING = (
    TaskState.UP, TaskState.SUSPECT, TaskState.HUNG, TaskState.LOST, TaskState.REJOINING,
    TaskState.RECOVERING,
)


class Driver:
    """A machine, a fake clock, and the operation under way."""

    def __init__(self, **config):
        config.setdefault("num_workers", 2)
        config.setdefault("num_ps", 1)
        config.setdefault("hang_timeout", 3.0)
        config.setdefault("worker_timeout", 30.0)
        config.setdefault("ps_timeout", 60.0)
        self.now = 0.0
        self.m = RecoveryMachine(MachineConfig(**config), self.now)

    def __call__(self, event, at=None):
        if at is not None:
            self.now = at
        return self.m.handle(event, self.now)

    def tick(self, running=0, completed=0, at=None):
        return self(rm.Tick(running, completed), at)

    def done(self, ok=True, value=None, error=None):
        op = self.m.op
        assert op is not None, "no operation under way"
        return self(rm.Done(op, ok, value, error))

    def saved(self, path, completed, error=None):
        """The checkpoint op is done (its snapshot taken), then its background write ends."""
        actions = self.done(value=completed)
        return actions + self(rm.CheckpointWritten(path if error is None else None, completed, error))

    def finish_ops(self, first_actions):
        """Complete every operation successfully; return all actions seen."""
        seen = list(first_actions)
        while self.m.op is not None:
            value = 0 if isinstance(self.m.op, rm.Checkpoint) else None
            seen += self.done(True, value)
        return seen


def kinds(actions):
    return [type(a).__name__ for a in actions]


def shut_down(actions):
    """The tickets answered with "the strategy was shut down" (and nothing else among `actions`)."""
    assert all(isinstance(a, rm.Finish) and isinstance(a.error, StrategyClosedError) for a in actions), actions
    return [a.ticket for a in actions]


# ------------------------------------------------------------ hang detection
def test_overdue_heartbeat_takes_the_worker_out_as_hung_at_hang_timeout():
    d = Driver()
    assert d(rm.ProbeOverdue(1, 2.9)) == []
    assert d.m.workers == [UP, UP]
    actions = d(rm.ProbeOverdue(1, 3.0))
    assert actions == [rm.TakeOut(1, 3.0, "hung")]
    assert d.m.workers[1] is HUNG
    assert d(rm.ProbeOverdue(1, 9.0)) == []  # only UP workers are judged by heartbeat


def test_dispatcher_report_takes_the_worker_out_as_suspect_once():
    d = Driver()
    assert d(rm.WorkerNotAnswering(0, 0.4)) == [rm.TakeOut(0, 0.4, "not answering")]
    assert d.m.workers[0] is SUSPECT
    assert d(rm.WorkerNotAnswering(0, 0.5)) == []


def test_a_report_from_before_the_worker_came_back_is_stale():
    d = Driver()
    d.m.epochs[0] = 1  # it rejoined once since the report was made
    assert d(rm.WorkerNotAnswering(0, 0.4, epoch=0)) == []
    assert d.m.workers[0] is UP


# --------------------------------------------------------- observing workers
def test_refused_connect_means_lost_and_a_lost_worker_is_dropped_from_the_view():
    d = Driver()
    d(rm.WorkerNotAnswering(1))
    assert d.m.blocking() == [1]  # not yet known: may hang, no reconnect
    actions = d(rm.WorkerSeen(1, "closed", probe_pending=False))
    assert d.m.workers[1] is LOST
    assert actions == [rm.DropWorkers(frozenset({0}))]
    assert d.done() == []
    assert d.m.view == frozenset({0})


@pytest.mark.parametrize("tcp, pending", [("open", True), ("silent", False), ("silent", True)])
def test_accepted_or_silent_connect_with_no_answer_means_hung(tcp, pending):
    d = Driver()
    d(rm.WorkerNotAnswering(1))
    assert d(rm.WorkerSeen(1, tcp, probe_pending=pending)) == []
    assert d.m.workers[1] is HUNG
    assert d.m.blocking() == [1]


def test_seen_events_about_workers_in_rotation_change_nothing():
    d = Driver()
    assert d(rm.WorkerSeen(0, "closed", False)) == []
    assert d.m.workers[0] is UP


# ------------------------------------------------------------------ rejoin
def test_a_worker_that_answers_again_rejoins_reconnect_check_rebuild_bring_up():
    d = Driver()
    d(rm.WorkerNotAnswering(1))
    d(rm.WorkerSeen(1, "closed", False))
    d.done()  # dropped from the view
    actions = d(rm.WorkerSeen(1, "open", False), at=10.0)
    assert actions == [rm.RejoinWorker(frozenset({0, 1}), 1)]
    assert d.m.workers[1] is REJOINING
    d.now = 10.5
    assert d.done() == [rm.CheckAnswers(1)]
    assert d.done() == [rm.RebuildWorker(1)]
    assert d.done() == [rm.BringUp(1, recovered_after=0.5)]
    assert d.m.workers == [UP, UP]
    assert d.m.view == frozenset({0, 1})
    assert d.m.epochs == [0, 1]


def test_a_rejoining_worker_that_does_not_answer_is_suspect_then_hung_and_blocks_reconnects():
    d = Driver()
    d(rm.ProbeOverdue(1, 5.0))
    d(rm.WorkerSeen(1, "open", False))  # its probe came back: back
    assert d.done() == [rm.CheckAnswers(1)]
    assert d.done(ok=False) == []
    assert d.m.workers[1] is SUSPECT and d.m.blocking() == [1]
    d(rm.WorkerSeen(1, "open", probe_pending=True))
    assert d.m.workers[1] is HUNG


def test_a_rebuild_that_fails_is_tried_again_next_round():
    d = Driver()
    d(rm.WorkerNotAnswering(1))
    d(rm.WorkerSeen(1, "open", False))
    d.done()
    assert d.done() == [rm.RebuildWorker(1)]
    assert d.done(ok=False, error=RuntimeError("x")) == []
    assert d.m.workers[1] is SUSPECT
    # Not at once: a worker whose values keep failing to build (a stale context TF reports
    # for good) must not reconnect and log every round; the pause doubles up to Backoff's cap.
    base = d.m.backoff.base
    assert d(rm.WorkerSeen(1, "open", False)) == []
    actions = d(rm.WorkerSeen(1, "open", False), at=d.now + base)
    assert kinds(actions) == ["RejoinWorker"]
    d.done()
    d.done()
    assert d.done(ok=False, error=RuntimeError("x")) == []
    assert d(rm.WorkerSeen(1, "open", False), at=d.now + base) == []  # the second pause is twice as long
    assert kinds(d(rm.WorkerSeen(1, "open", False), at=d.now + base)) == ["RejoinWorker"]
    d.done()
    d.done()
    assert kinds(d.done()) == ["BringUp"]
    assert d.m.backoff.failures(("rejoin", 1)) == 0


def test_a_worker_that_accepts_connections_but_never_answers_does_not_keep_the_others_out():
    """Chaos seed 302 (synchronous fit): worker 1's step stuck on a restarted ps, its port open but no
    probe answered, was picked first (by index) at every round for 31 s, and worker 2, restarted
    and answering, waited 83 s for its rejoin. The one with fewer failed tries goes first now, and
    a worker that does not answer waits a short pause (at most 2 s) before its next try."""
    d = Driver(num_workers=3)
    for w in (1, 2):
        d(rm.WorkerNotAnswering(w))
    d(rm.WorkerSeen(1, "open", False))
    assert d(rm.WorkerSeen(2, "open", False)) == [rm.RejoinWorker(frozenset({0, 1}), 1)]  # by index
    assert d.done() == [rm.CheckAnswers(1)]
    assert d.done(ok=False) == []  # 1 accepts connections but does not answer
    assert d.m.workers[1] is SUSPECT
    # Its port is open again next round: 2 goes first (no failed try), 1 out of the view.
    assert d(rm.WorkerSeen(1, "open", False)) == [rm.RejoinWorker(frozenset({0, 2}), 2)]
    d.finish_ops([])
    assert d.m.workers[2] is UP
    # 1's pause doubles up to 2 s while it does not answer; once it does it comes back.
    base = d.m.backoff.base
    for pause in (base, 2 * base, 2.0, 2.0):
        assert d(rm.WorkerSeen(1, "open", False), at=d.now + pause - 0.01) == []
        assert kinds(d(rm.WorkerSeen(1, "open", False), at=d.now + 0.01)) == ["RejoinWorker"]
        assert d.done() == [rm.CheckAnswers(1)]
        assert d.done(ok=False) == []
    d(rm.WorkerSeen(1, "open", False), at=d.now + 2.0)
    assert kinds(d.finish_ops([]))[-1] == "BringUp"
    assert d.m.workers[1] is UP and d.m.backoff.failures(("rejoin", 1)) == 0


def test_workers_that_do_not_answer_before_a_reconnect_are_taken_out_and_it_is_retried():
    d = Driver(num_workers=3)
    d(rm.WorkerNotAnswering(2))
    d(rm.WorkerSeen(2, "open", False))
    assert d.m.op == rm.RejoinWorker(frozenset({0, 1, 2}), 2)
    actions = d.done(ok=False, value={1: "closed"})
    assert actions[0] == rm.TakeOut(1, None, "not answering before a reconnect")
    assert d.m.workers[1] is LOST and d.m.workers[2] is SUSPECT
    # 2 is in the view and not judged yet: nothing may reconnect until it is.
    assert d(rm.WorkerSeen(1, "closed", False)) == []
    # Next round it answers: the gone one is dropped first, then 2 rejoins.
    assert d(rm.WorkerSeen(2, "open", False)) == [rm.DropWorkers(frozenset({0}))]
    assert d.done() == [rm.RejoinWorker(frozenset({0, 2}), 2)]


def test_race_rejoin_requested_while_another_worker_hangs_waits_until_it_dies():
    d = Driver()
    d(rm.ProbeOverdue(0, 3.0))  # worker 0 hangs, still in TF's view
    d(rm.WorkerSeen(0, "open", probe_pending=True))
    d(rm.WorkerNotAnswering(1))
    assert d(rm.WorkerSeen(1, "open", False)) == []  # back, but 0 would freeze update_server_def
    assert d.tick() == []
    assert d.m.workers[1] is SUSPECT
    # Worker 0 dies: no longer hangs; worker 1 rejoins with a view without it.
    actions = d(rm.WorkerSeen(0, "closed", False))
    assert actions == [rm.RejoinWorker(frozenset({1}), 1)]


def test_race_a_hung_worker_that_answers_again_rejoins():
    d = Driver()
    d(rm.ProbeOverdue(0, 3.0))
    d(rm.WorkerSeen(0, "open", probe_pending=True))
    actions = d(rm.WorkerSeen(0, "open", probe_pending=False))  # SIGCONT
    assert actions == [rm.RejoinWorker(frozenset({0, 1}), 0)]


# ---------------------------------------------------------------- all gone
def test_every_worker_gone_for_worker_timeout_fails_all_every_round_until_one_is_back():
    d = Driver(worker_timeout=30.0)
    d(rm.WorkerNotAnswering(0), at=1.0)
    d(rm.WorkerNotAnswering(1), at=2.0)
    d(rm.WorkerSeen(0, "closed", False))
    d(rm.WorkerSeen(1, "closed", False))
    assert kinds(d.tick(at=31.9)) == []
    assert d.tick(at=32.0) == [rm.FailAll("workers", waited=30.0, first=True)]
    assert d.tick(at=33.0) == [rm.FailAll("workers", waited=31.0, first=False)]
    d(rm.WorkerSeen(0, "open", False))
    d.finish_ops([])
    assert d.m.workers[0] is UP
    assert d.tick(at=40.0) == []


# ---------------------------------------------------------------- ps loss
def test_lost_ps_without_checkpoint_dir_fails_everything_for_good():
    d = Driver()
    actions = d(rm.PsNotAnswering((0,)))
    assert kinds(actions) == ["PsFailed", "PauseDispatch", "FailAll", "ResumeDispatch"]
    fail = actions[2]
    assert fail.kind == "ps" and fail.permanent and fail.lost == (0,) and "checkpoint_dir" in fail.why
    assert d.m.broken
    assert d(rm.PsNotAnswering((0,), epoch=d.m.ps_epoch)) == []


def test_lost_ps_before_any_checkpoint_gives_up_saying_so():
    d = Driver(checkpointing=True)
    actions = d(rm.PsNotAnswering((0,)))
    assert "no checkpoint had been written yet" in actions[2].why


def test_lost_ps_is_recovered_once_back_and_idle():
    d = Driver(checkpointing=True, has_checkpoint=True)
    assert d(rm.PsNotAnswering((0,)), at=1.0) == [rm.PsFailed(0), rm.PauseDispatch("ps")]
    assert d(rm.PsNotAnswering((0,))) == []  # the same loss, seen by another dispatcher
    assert d.m.poll_interval() == 0.2
    assert d.tick(running=1, at=2.0) == []  # running closures fail against it and come back
    assert d.tick(running=1, at=4.0) == [rm.RequeueRunning()]
    assert d.tick(running=1, at=4.5) == []
    d(rm.PsSeen(0, "closed"))
    assert d.m.ps == [LOST]
    d(rm.PsSeen(0, "closed"))
    assert d.m.ps == [LOST]
    actions = d(rm.PsSeen(0, "open"), at=5.0)
    assert d.m.ps == [RECOVERING]
    assert actions == [rm.ReconnectPs(frozenset({0, 1}))]
    assert d.done() == [rm.RenewAndRestore((0,))]
    assert d.done() == [rm.Retrace()]
    assert d.done() == [rm.RebuildResources()]
    d.now = 6.0
    assert d.done() == [rm.PsRecovered((0,), back_at=5.0), rm.ResumeDispatch("ps")]
    assert d.m.ps == [UP] and d.m.ps_epoch == 1
    # A dispatcher's report made during the loss is stale now.
    assert d(rm.PsNotAnswering((0,), epoch=0)) == []


def test_lost_ps_that_does_not_come_back_within_ps_timeout_fails_everything():
    d = Driver(checkpointing=True, has_checkpoint=True, ps_timeout=10.0)
    d(rm.PsNotAnswering((0,)), at=0.0)
    d(rm.PsSeen(0, "closed"), at=5.0)
    assert d.tick(at=9.0) == []
    actions = d.tick(at=10.5)
    assert kinds(actions) == ["FailAll", "ResumeDispatch"]
    assert "ps_timeout=10" in actions[0].why and actions[0].permanent


def test_ps_recovery_that_keeps_failing_gives_up_after_ps_attempts():
    d = Driver(checkpointing=True, has_checkpoint=True, ps_attempts=2)
    d(rm.PsNotAnswering((0,)))
    d(rm.PsSeen(0, "open"))
    d.done()
    assert d.done(ok=False, error=ValueError("mismatch")) == []
    assert d.m.ps == [RECOVERING]
    assert d.tick() == [rm.ReconnectPs(frozenset({0, 1}))]  # tried again next round
    d.done()
    actions = d.done(ok=False, error=ValueError("mismatch"))
    assert kinds(actions) == ["FailAll", "ResumeDispatch"] and "mismatch" in actions[0].why


def test_a_ps_lost_during_another_ps_recovery_joins_it_and_its_tries_start_again():
    """Chaos seed 321 (`ps_recovery="all"`, 4 ps): ps 3 restarted while ps 0's restore ran; the
    restore, writing every ps, failed on ps 3's old handles at each try and the loss was given up.
    The engine now asks every ps not lost whether it still holds its variables after a step failed
    (`ps_loss.asks_for_restarted_ps`); a PsNotAnswering for ps 3 widens the loss."""
    d = Driver(checkpointing=True, has_checkpoint=True, ps_attempts=2, num_ps=4)
    d(rm.PsNotAnswering((0,)))
    d(rm.PsSeen(0, "open"))
    assert d.done() == [rm.RenewAndRestore((0,))]
    assert d.done(ok=False, error=ValueError("ps:2 did not answer")) == []  # one try of two counted
    assert d.tick() == [rm.ReconnectPs(frozenset({0, 1}))]
    assert d.done() == [rm.RenewAndRestore((0,))]
    assert d(rm.PsNotAnswering((3,), epoch=d.m.ps_epoch)) == [rm.PsFailed(3)]  # found behind the failure
    assert d.done(ok=False, error=ValueError("invalid device")) == []  # not the second try: it started again
    assert d.tick() == []  # ps 3 is not back yet
    assert d(rm.PsSeen(3, "open"), at=2.0) == [rm.ReconnectPs(frozenset({0, 1}))]
    assert d.m._ps_loss.back_at == 2.0  # reported from the last lost ps's return
    assert d.done() == [rm.RenewAndRestore((0, 3))]
    actions = d.finish_ops([])
    assert kinds(actions)[-2:] == ["PsRecovered", "ResumeDispatch"] and actions[-2] == rm.PsRecovered((0, 3), 2.0)


def test_a_ps_lost_during_a_recovery_step_that_succeeds_is_not_left_unrestored():
    """A late closure's report (its dispatcher, after RequeueRunning) that another ps is lost while
    a step runs: the step's success must not carry the flow on to PsRecovered without that ps."""
    d = Driver(checkpointing=True, has_checkpoint=True, num_ps=2)
    d(rm.PsNotAnswering((0,)))
    d(rm.PsSeen(0, "open"))
    assert d.done() == [rm.RenewAndRestore((0,))]
    assert d(rm.PsNotAnswering((1,), epoch=d.m.ps_epoch)) == [rm.PsFailed(1)]
    assert d.done() == []  # the restore of ps 0 alone succeeded: not the end of this loss
    assert d.tick() == []  # ps 1 is not back yet
    assert d(rm.PsSeen(1, "open"), at=3.0) == [rm.ReconnectPs(frozenset({0, 1}))]
    assert d.done() == [rm.RenewAndRestore((0, 1))]
    assert kinds(d.finish_ops([]))[-2:] == ["PsRecovered", "ResumeDispatch"]


def test_a_ps_lost_while_a_rejoin_is_under_way_widens_the_loss_without_a_restart():
    """Only a recovery step's outcome is discarded for a ps lost during it: a rejoin under way
    when the loss grew ends as rejoins do, and the recovery's first reconnect counts."""
    d = Driver(checkpointing=True, has_checkpoint=True, num_ps=2)
    d(rm.WorkerNotAnswering(1))
    assert kinds(d(rm.WorkerSeen(1, "open", False))) == ["RejoinWorker"]
    d(rm.PsNotAnswering((0,)))
    d(rm.PsNotAnswering((1,), epoch=d.m.ps_epoch))
    d.done()  # the rejoin ends: a ps recovery is under way, the worker waits for it
    d(rm.PsSeen(0, "open"))
    d(rm.PsSeen(1, "open"))
    assert d.tick() == [rm.ReconnectPs(frozenset({0}))]
    assert d.done() == [rm.RenewAndRestore((0, 1))]  # not discarded: ps 1 was lost before it began


def test_ps_recovery_reconnect_refused_by_a_worker_takes_it_out_and_tries_again_next_round():
    d = Driver(checkpointing=True, has_checkpoint=True)
    d(rm.PsNotAnswering((0,)))
    d(rm.PsSeen(0, "open"))
    actions = d.done(ok=False, value={1: "closed"})
    assert actions == [rm.TakeOut(1, None, "not answering before a reconnect")]
    assert d(rm.WorkerSeen(1, "closed", False)) == []  # not before the next round
    assert d.tick() == [rm.ReconnectPs(frozenset({0}))]


def test_ps_back_but_not_taking_connections_yet_is_tried_each_round_until_ps_timeout():
    # The edge reports a reconnect that a just-restarted ps did not take yet
    # (gRPC's channel still backing off) as refused by no worker.
    d = Driver(checkpointing=True, has_checkpoint=True, ps_timeout=10.0, ps_attempts=2)
    d(rm.PsNotAnswering((0,)), at=0.0)
    d(rm.PsSeen(0, "open"), at=1.0)
    for at in (1.5, 2.0, 2.5):  # more often than ps_attempts: not counted as failures
        assert d.done(ok=False, value={}) == []
        assert d.m.ps == [RECOVERING]
        assert d.tick(at=at) == [rm.ReconnectPs(frozenset({0, 1}))]
    assert d.done() == [rm.RenewAndRestore((0,))]  # it took the connection
    d.finish_ops([])
    assert d.m.ps == [UP]
    # One that never takes connections fails everything at ps_timeout.
    d = Driver(checkpointing=True, has_checkpoint=True, ps_timeout=10.0)
    d(rm.PsNotAnswering((0,)), at=0.0)
    d(rm.PsSeen(0, "open"), at=1.0)
    assert d.done(ok=False, value={}) == []
    assert d.tick(at=9.0) == [rm.ReconnectPs(frozenset({0, 1}))]
    d.now = 10.5
    assert d.done(ok=False, value={}) == []
    actions = d.tick(at=11.0)
    assert kinds(actions) == ["FailAll", "ResumeDispatch"]
    assert "within ps_timeout=10" in actions[0].why and actions[0].permanent
    assert d.tick(at=12.0) == []  # given up once


def test_ps_recovery_waits_while_a_worker_hangs_in_the_view():
    d = Driver(checkpointing=True, has_checkpoint=True)
    d(rm.ProbeOverdue(1, 3.0))
    d(rm.WorkerSeen(1, "open", probe_pending=True))
    d(rm.PsNotAnswering((0,)))
    assert d(rm.PsSeen(0, "open")) == []
    actions = d(rm.WorkerSeen(1, "closed", False))
    assert actions == [rm.ReconnectPs(frozenset({0}))]


def test_race_ps_lost_while_a_worker_rejoins_the_ps_goes_first():
    d = Driver(checkpointing=True, has_checkpoint=True)
    d(rm.WorkerNotAnswering(1))
    d(rm.WorkerSeen(1, "open", False))
    assert isinstance(d.m.op, rm.RejoinWorker)
    assert d(rm.PsNotAnswering((0,))) == [rm.PsFailed(0), rm.PauseDispatch("ps")]
    assert d.done() == []  # the rejoin stops; no CheckAnswers
    assert d.m.workers[1] is SUSPECT
    actions = d(rm.PsSeen(0, "open"))
    assert actions == [rm.ReconnectPs(frozenset({0}))]
    seen = kinds(d.finish_ops(actions))
    # The ps first, then the worker (it still answers) rejoins.
    assert seen.index("PsRecovered") < seen.index("BringUp")
    assert d.m.workers == [UP, UP] and d.m.ps == [UP]


def test_restored_checkpoint_makes_a_ps_loss_recoverable():
    d = Driver(checkpointing=True)
    d(rm.Restored())
    assert kinds(d(rm.PsNotAnswering((0,)))) == ["PsFailed", "PauseDispatch"]


# ------------------------------------------------------------- checkpoints
def test_requested_checkpoint_pauses_waits_for_idle_saves_and_answers():
    d = Driver(checkpointing=True)
    assert d(rm.CheckpointRequested("t", "new variables")) == [rm.PauseDispatch("checkpoint")]
    assert d.tick(running=1) == []
    assert d.tick(running=0, completed=7) == [rm.Checkpoint("new variables")]
    # Taken: dispatch resumes at once; the caller waits for the background write.
    assert d.done(value=7) == [rm.ResumeDispatch("checkpoint")]
    assert d(rm.CheckpointWritten("ckpt-1", 7)) == [rm.Finish("t", value="ckpt-1")]


def test_checkpoints_come_by_count_and_by_interval_after_the_first():
    d = Driver(checkpointing=True, checkpoint_every=50, checkpoint_interval=100.0)
    assert d.tick(completed=500) == []  # none before the first (taken before scheduling)
    d(rm.CheckpointRequested("t", "new variables"))
    d.tick()
    d.saved("ckpt-1", 10)
    assert d.tick(completed=59) == []
    assert d.tick(completed=60) == [rm.PauseDispatch("checkpoint")]
    assert d.tick(running=0, completed=60) == [rm.Checkpoint("interval")]
    d.saved("ckpt-2", 60)
    assert d.tick(completed=61, at=99.0) == []
    assert d.tick(completed=61, at=100.0) == [rm.PauseDispatch("checkpoint")]


def test_checkpoint_that_cannot_pause_within_hang_timeout_is_skipped():
    d = Driver(checkpointing=True)
    d(rm.CheckpointRequested("t", "requested"), at=1.0)
    assert d.tick(running=1, at=3.9) == []
    assert d.tick(running=1, at=4.0) == [rm.ResumeDispatch("checkpoint"), rm.Finish("t", value=None)]


def test_failed_checkpoint_answers_the_caller_with_its_error():
    d = Driver(checkpointing=True)
    error = OSError("disk full")
    d(rm.CheckpointRequested("t", "requested"))
    d.tick()
    assert d.done(ok=False, error=error) == [rm.ResumeDispatch("checkpoint"), rm.Finish("t", error=error)]


def test_a_checkpoint_that_keeps_failing_is_tried_with_a_growing_pause_never_in_a_loop():
    # A ps restarted unnoticed made every save fail at once: it must not spin.
    d = Driver(checkpointing=True, checkpoint_every=10, interval=1.0)
    d(rm.CheckpointRequested("t", "new variables"))
    d.tick()
    d.saved("ckpt-1", 0)
    tries = []
    while d.now < 120.0:  # the recovery thread's fastest rounds, for two minutes
        d.tick(completed=100, at=d.now + 0.02)
        if isinstance(d.m.op, rm.Checkpoint):
            tries.append(d.now)
            d.done(ok=False, error=OSError("invalid device"))
    pauses = [b - a for a, b in zip(tries, tries[1:])]
    assert 5 <= len(tries) <= 12, tries  # still tried, a handful of times, not thousands
    assert all(b >= a for a, b in zip(pauses, pauses[1:]))  # growing...
    assert 29.0 <= pauses[-1] <= 31.0  # ...up to 30 s
    # A success starts over: the next failure waits the shortest pause again.
    d.tick(completed=100, at=d.now + 31.0)
    d.tick(completed=100, at=d.now + 0.02)
    d.saved("ckpt-2", 100)
    assert d.m.backoff.failures("checkpoint") == 0
    d.tick(completed=200, at=d.now + 0.02)
    d.tick(completed=200, at=d.now + 0.02)
    d.done(ok=False, error=OSError("again"))
    assert not d.m.backoff.ready("checkpoint", d.now + 0.4) and d.m.backoff.ready("checkpoint", d.now + 0.5)


def test_a_drop_refused_by_no_worker_is_tried_again_after_a_pause_not_at_once():
    # A reconnect that a ps not reachable refuses fails the same way if tried at once.
    d = Driver(num_workers=3)
    d(rm.WorkerNotAnswering(1), at=1.0)
    assert d(rm.WorkerSeen(1, "closed", False)) == [rm.DropWorkers(frozenset({0, 2}))]
    assert d.done(ok=False, value={}) == []
    assert d.tick(at=1.1) == []
    assert d.tick(at=1.5) == [rm.DropWorkers(frozenset({0, 2}))]
    assert d.done(ok=False, error=RuntimeError("unavailable")) == []
    assert d.tick(at=2.4) == []
    assert d.tick(at=2.5) == [rm.DropWorkers(frozenset({0, 2}))]
    d.done()
    assert d.m.view == frozenset({0, 2}) and d.m.backoff.failures("drop") == 0


def test_without_checkpoint_dir_a_request_is_answered_at_once():
    d = Driver()
    assert d(rm.CheckpointRequested("t", "requested")) == [rm.Finish("t", value=None)]


def test_race_worker_dies_while_a_checkpoint_waits_for_idle():
    d = Driver(checkpointing=True)
    d(rm.CheckpointRequested("t", "requested"))
    assert d.tick(running=2) == []
    # The dispatcher's report is handled at once (the wait is a state, not a
    # blocking call holding a lock): the worker goes out, its closure is requeued.
    actions = d(rm.WorkerNotAnswering(1, 0.3))
    assert actions == [rm.TakeOut(1, 0.3, "not answering"), rm.ResumeDispatch("checkpoint")]
    assert d.tick(running=1) == []  # no checkpoint while it may hang in the view
    actions = d(rm.WorkerSeen(1, "closed", False))
    assert actions == [rm.DropWorkers(frozenset({0}))]
    assert d.done() == [rm.PauseDispatch("checkpoint")]
    assert d.tick(running=0) == [rm.Checkpoint("requested")]
    assert d.saved("ckpt-1", 3)[-1] == rm.Finish("t", value="ckpt-1")


def test_checkpoint_while_hung_allowed_when_configured():
    d = Driver(checkpointing=True, checkpoint_while_hung=True)
    d(rm.ProbeOverdue(1, 3.0))
    assert d(rm.CheckpointRequested("t", "requested")) == [rm.PauseDispatch("checkpoint")]
    assert d.tick(running=0) == [rm.Checkpoint("requested")]


def test_no_rejoin_starts_while_a_checkpoint_waits():
    d = Driver(checkpointing=True)
    d(rm.WorkerNotAnswering(1))
    d(rm.WorkerSeen(1, "closed", False))
    d.done()  # dropped
    d(rm.CheckpointRequested("t", "requested"))
    assert d(rm.WorkerSeen(1, "open", False)) == []
    assert d.tick(running=0) == [rm.Checkpoint("requested")]
    actions = d.done(value=0)  # taken: its write goes on while the rejoin starts
    assert kinds(actions) == ["ResumeDispatch", "RejoinWorker"]
    assert d(rm.CheckpointWritten("ckpt-1", 0)) == [rm.Finish("t", value="ckpt-1")]


# ---------------------------------------------------------------- shutdown
def test_shutdown_during_ps_recovery_stops_everything_and_answers_waiting_callers():
    d = Driver(checkpointing=True, has_checkpoint=True)
    d(rm.PsNotAnswering((0,)))
    d(rm.PsSeen(0, "open"))
    d(rm.CheckpointRequested("t", "requested"))
    assert d.m.op is not None
    assert shut_down(d(rm.Shutdown())) == ["t"]
    assert d.done() == []
    assert d.tick() == []
    assert d(rm.WorkerNotAnswering(0)) == []
    assert shut_down(d(rm.CheckpointRequested("u", "requested"))) == ["u"]


def test_poll_interval_is_short_only_while_something_waits():
    d = Driver(interval=0.75, checkpointing=True)
    assert d.m.poll_interval() == 0.75
    d(rm.CheckpointRequested("t", "requested"))
    assert d.m.poll_interval() < 0.1


def test_recovery_thread_that_dies_fails_pending_work_and_waiting_callers():
    """The executor side: a bug in carrying out an action must not leave callers waiting."""
    import threading

    from _fake_edge import FakeEdge, fake_engine

    from psclient._cluster.spec import Cluster
    from psclient._core.future import Future
    from psclient._core.closure import Closure
    from psclient._core.scheduler import Scheduler

    scheduler = Scheduler(1)
    closure = Closure(None, (), {}, Future("f"))
    scheduler.submit(closure)
    edge = FakeEdge(Cluster({"worker": ["fake-worker0:1"], "ps": ["fake-ps0:1"]}))
    recovery = fake_engine(edge, scheduler, interval=3600.0).recovery
    died = threading.Event()
    hook = threading.excepthook
    threading.excepthook = lambda args: died.set()
    try:
        recovery.report(rm.PsFailed(0))  # not an event: the machine has no handler, the thread dies
        recovery.start()
        assert died.wait(30)
    finally:
        threading.excepthook = hook
    assert isinstance(recovery.broken, RuntimeError)
    with pytest.raises(RuntimeError, match="recovery thread failed"):
        closure.future.result(timeout=10)
    with pytest.raises(StrategyClosedError):
        recovery.checkpoint("requested")


@pytest.mark.parametrize("mode", ["part", "all"])
def test_a_lost_ps_is_restored_as_the_configured_ps_recovery_says(mode):
    d = Driver(num_ps=2, checkpointing=True, has_checkpoint=True, ps_recovery=mode)
    assert d(rm.PsNotAnswering((1,)), at=1.0) == [rm.PsFailed(1), rm.PauseDispatch("ps")]
    assert d(rm.PsSeen(1, "open"), at=2.0) == [rm.ReconnectPs(frozenset({0, 1}))]
    assert d.done() == [rm.RenewAndRestore((1,), mode)]
    assert d.done() == [rm.Retrace()]
    assert d.done() == [rm.RebuildResources()]
    assert d.done() == [rm.PsRecovered((1,), back_at=2.0), rm.ResumeDispatch("ps")]
    assert d.m.ps == [UP, UP]


def test_an_event_or_operation_of_an_unknown_type_is_an_error_not_ignored():
    d = Driver()
    with pytest.raises(TypeError, match="unknown recovery event"):
        d(object())
    d.m.op = object()
    with pytest.raises(TypeError, match="unknown recovery operation"):
        d(rm.Done(d.m.op, ok=True))
