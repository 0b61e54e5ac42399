"""Checkpoints written in the background: the recovery machine's rules, without a cluster.

A checkpoint is taken in a cut (the `Checkpoint` operation: a snapshot), dispatch resumes at
once, and its write ends later (`CheckpointWritten`). The integration (a real LocalCluster) is in
tests/checkpoints/test_checkpoint_nonstop.py.
"""

from psclient._core import recovery_messages as rm
from psclient._core.checkpoint_schedule import CheckpointSchedule
from psclient._core.errors import StrategyClosedError
from psclient._core.recovery_machine import MachineConfig, RecoveryMachine


def machine(**config):
    config.setdefault("num_workers", 2)
    config.setdefault("num_ps", 1)
    config.setdefault("hang_timeout", 3.0)
    return RecoveryMachine(MachineConfig(checkpointing=True, **config), 0.0)


def take(m, ticket, reason="requested", completed=0, now=0.0):
    """Request (when `ticket`), pause, go idle, take: the machine's actions until the snapshot is done."""
    actions = m.handle(rm.CheckpointRequested(ticket, reason), now) if ticket is not None else []
    actions += m.handle(rm.Tick(running=0, completed=completed), now)
    if m.op is None:  # due on this tick (periodic): paused now, taken at the next round
        actions += m.handle(rm.Tick(running=0, completed=completed), now)
    assert isinstance(m.op, rm.Checkpoint), actions
    return actions + m.handle(rm.Done(m.op, True, completed), now)


def test_the_caller_waits_for_the_write_while_dispatch_has_resumed():
    m = machine()
    actions = take(m, "t", completed=4)
    assert actions[-1] == rm.ResumeDispatch("checkpoint")
    assert not any(isinstance(a, rm.Finish) for a in actions)
    assert m.handle(rm.CheckpointWritten("ckpt-1", 4), 1.0) == [rm.Finish("t", value="ckpt-1")]


def test_a_second_request_waits_for_the_first_write_then_gets_its_own_checkpoint():
    m = machine()
    take(m, "first", completed=4)
    # Asked while the first is being written: no pause, no second snapshot yet.
    assert m.handle(rm.CheckpointRequested("second", "requested"), 0.5) == []
    assert m.handle(rm.Tick(running=3, completed=9), 0.6) == []
    assert m.op is None
    actions = m.handle(rm.CheckpointWritten("ckpt-1", 4), 1.0)
    # The first caller gets its path; the second's checkpoint starts (a new cut), not answered with the first.
    assert actions == [rm.Finish("first", value="ckpt-1"), rm.PauseDispatch("checkpoint")]
    assert m.handle(rm.Tick(running=0, completed=9), 1.1) == [rm.Checkpoint("requested")]
    assert m.handle(rm.Done(m.op, True, 9), 1.2) == [rm.ResumeDispatch("checkpoint")]
    assert m.handle(rm.CheckpointWritten("ckpt-2", 9), 2.0) == [rm.Finish("second", value="ckpt-2")]


def test_a_failed_write_answers_its_caller_with_the_error_and_backs_off():
    m = machine()
    take(m, "t")
    error = OSError("ps:1 could not write")
    assert m.handle(rm.CheckpointWritten(None, 0, error), 1.0) == [rm.Finish("t", error=error)]
    assert m.backoff.failures("checkpoint") == 1


def test_a_periodic_write_error_nobody_waited_for_goes_to_the_next_caller_once():
    m = machine(checkpoint_every=10)
    take(m, "first")
    m.handle(rm.CheckpointWritten("ckpt-1", 0), 0.1)
    take(m, None, completed=10, now=0.2)  # periodic: due by count
    error = OSError("disk full")
    assert m.handle(rm.CheckpointWritten(None, 10, error), 0.3) == []  # nobody waited: kept
    assert m.handle(rm.CheckpointRequested("next", "requested"), 0.4) == [rm.Finish("next", error=error)]
    # Raised once: the request after that gets a checkpoint.
    assert m.handle(rm.CheckpointRequested("again", "requested"), 5.0) == [rm.PauseDispatch("checkpoint")]


def test_a_later_successful_write_supersedes_an_unobserved_error():
    schedule = CheckpointSchedule(interval=None, every=1, has_checkpoint=True, now=0.0)
    schedule.started()
    assert schedule.written(1.0, None, 1, OSError("lost")) == []
    schedule.started()
    assert schedule.written(2.0, "ckpt-3", 2, None) == []
    assert schedule.request("t", "requested") == []  # queued, not failed with the old error
    assert schedule.due(2.0, 2, periodic=True) == "requested"


def test_no_periodic_checkpoint_is_due_while_one_is_written():
    schedule = CheckpointSchedule(interval=1.0, every=None, has_checkpoint=True, now=0.0)
    schedule.started()
    schedule.written(0.0, "ckpt-1", 0, None)
    schedule.started()
    assert schedule.due(50.0, 0, periodic=True) is None
    schedule.written(50.0, "ckpt-2", 0, None)
    assert schedule.due(50.5, 0, periodic=True) is None
    assert schedule.due(51.0, 0, periodic=True) == "interval"


def test_shutdown_answers_the_callers_of_the_write_in_flight_and_those_queued():
    m = machine()
    take(m, "writing")
    m.handle(rm.CheckpointRequested("queued", "requested"), 0.5)
    actions = m.handle(rm.Shutdown(), 1.0)
    closed = {a.ticket for a in actions if isinstance(a, rm.Finish) and isinstance(a.error, StrategyClosedError)}
    assert closed == {"writing", "queued"}


def test_draining_from_the_checkpoints_pause_until_its_snapshot_starts():
    """`draining`: what the recovery thread asks before it answers a dispatcher's `Drained` with a
    round at once (the last closure running at the pause ended) instead of at the next round."""
    m = machine()
    assert not m.draining
    assert m.handle(rm.CheckpointRequested("t", "requested"), 0.0) == [rm.PauseDispatch("checkpoint")]
    assert m.draining and m.poll_interval() == 0.02
    assert m.handle(rm.Tick(running=1, completed=0), 0.01) == []  # still running: still draining
    assert m.draining
    assert m.handle(rm.Tick(running=0, completed=1), 0.012) == [rm.Checkpoint("requested")]
    assert not m.draining  # the snapshot is under way: a late `Drained` asks for no round
    m.handle(rm.Done(m.op, True, 1), 0.02)
    assert not m.draining
