"""The copy before a checkpoint's cut runs beside the recovery machine's other flows
(`MachineConfig.copies_before_cut`): a fake clock, no cluster, no threads.

The copy of the big variables takes time in proportion to them; the machine starts it
(`CopyForCheckpoint`), keeps handling failures meanwhile, and pauses dispatch for the cut
only once it ended (`CheckpointCopied`). A ps loss stops it (`StopCopy`).
"""

from psclient._core import recovery_messages as rm
from psclient._core.recovery_machine import MachineConfig, RecoveryMachine


class Machine:
    def __init__(self, **config):
        config = {"num_workers": 2, "num_ps": 1, "hang_timeout": 3.0, "checkpointing": True,
                  "copies_before_cut": True, **config}
        self.m = RecoveryMachine(MachineConfig(**config), 0.0)
        self.now = 0.0

    def __call__(self, event, at=None):
        self.now = self.now if at is None else at
        return self.m.handle(event, self.now)

    def tick(self, running=0, completed=0):
        return self(rm.Tick(running, completed))

    def done(self, ok=True, value=None):
        return self(rm.Done(self.m.op, ok, value))


def test_a_checkpoint_copies_first_then_pauses_once_the_copy_ended():
    m = Machine()
    assert m(rm.CheckpointRequested("t", "requested")) == [rm.CopyForCheckpoint(1)]
    assert m.tick(running=2) == []  # copying: training goes on, nothing paused
    assert m.tick(running=2) == []  # and no second copy
    assert m(rm.CheckpointCopied(1)) == [rm.PauseDispatch("checkpoint")]
    assert m.tick(running=0, completed=5) == [rm.Checkpoint("requested")]
    assert m.done(value=5) == [rm.ResumeDispatch("checkpoint")]
    assert m(rm.CheckpointWritten("ckpt-1", 5)) == [rm.Finish("t", value="ckpt-1")]
    # The next checkpoint copies again (the last copy went with its cut).
    assert m(rm.CheckpointRequested("u", "requested")) == [rm.CopyForCheckpoint(2)]


def test_a_worker_lost_during_the_copy_is_taken_out_at_once_and_dropped_after_it():
    m = Machine()
    m(rm.CheckpointRequested("t", "requested"))
    # Handled while the copy runs (before: the copy ran on the recovery thread, and this
    # report waited for its end): the worker's closures go elsewhere now.
    assert m(rm.WorkerNotAnswering(1, 0.2)) == [rm.TakeOut(1, 0.2, "not answering")]
    # No reconnect beside the copy's calls: the drop waits for its end.
    assert m(rm.WorkerSeen(1, "closed", False)) == []
    assert m.tick() == []
    assert m(rm.CheckpointCopied(1)) == [rm.DropWorkers(frozenset({0}))]
    assert m.done() == [rm.PauseDispatch("checkpoint")]
    assert m.tick(running=0) == [rm.Checkpoint("requested")]


def test_a_ps_lost_during_the_copy_stops_it_and_a_late_end_is_ignored():
    m = Machine()
    m(rm.Restored())  # a checkpoint exists: the ps can be recovered
    m(rm.CheckpointRequested("t", "requested"))
    assert m(rm.PsNotAnswering((0,))) == [rm.PsFailed(0), rm.PauseDispatch("ps"), rm.StopCopy()]
    assert m(rm.CheckpointCopied(1)) == []  # that copy's end, after it was stopped
    m(rm.PsSeen(0, "open"))
    actions = m.tick()
    while m.m.op is not None:
        actions += m.done()
    # The checkpoint still asked for copies again, from the renewed variables.
    assert [type(a).__name__ for a in actions][-3:] == ["PsRecovered", "ResumeDispatch", "CopyForCheckpoint"]
    assert actions[-1] == rm.CopyForCheckpoint(2)
    assert m.tick() == []
    assert m(rm.CheckpointCopied(2)) == [rm.PauseDispatch("checkpoint")]


def test_a_ps_lost_with_no_copy_under_way_stops_nothing():
    m = Machine()
    m(rm.Restored())
    assert m(rm.PsNotAnswering((0,))) == [rm.PsFailed(0), rm.PauseDispatch("ps")]


def test_a_copy_whose_pause_was_skipped_is_made_again_for_the_next_try():
    m = Machine()
    m(rm.CheckpointRequested("t", "requested"))
    m(rm.CheckpointCopied(1))
    assert m.tick(running=1) == []  # paused, a closure still runs
    assert m.tick(running=1, completed=0) == []
    actions = m(rm.Tick(1, 0), at=3.0)  # hang_timeout: skipped, the engine drops the copy
    assert actions == [rm.ResumeDispatch("checkpoint"), rm.Finish("t", value=None)]
    assert m(rm.CheckpointRequested("u", "requested")) == [rm.CopyForCheckpoint(2)]


def test_without_copies_before_cut_the_pause_comes_at_once():
    m = Machine(copies_before_cut=False)
    assert m(rm.CheckpointRequested("t", "requested")) == [rm.PauseDispatch("checkpoint")]


def test_a_ps_that_does_not_answer_the_copy_fails_the_checkpoint_without_a_cut():
    """The copy gave up on a hung ps after hang_timeout: a cut would pause dispatch and wait on that
    ps as long again (a save took 2 x hang_timeout). The request gets the copy's error at once."""
    m = Machine()
    assert m(rm.CheckpointRequested("t", "requested")) == [rm.CopyForCheckpoint(1)]
    error = OSError("ps:0 could not copy its variables before a checkpoint's cut: no answer within 3 s")
    assert m(rm.CheckpointCopied(1, error), at=3.0) == [rm.Finish("t", error=error)]
    assert m.tick() == []  # no pause, no cut
    # The next request backs off as after any failed checkpoint, then copies again.
    assert m(rm.CheckpointRequested("u", "requested"), at=3.1) == []
    assert m(rm.Tick(0, 0), at=4.0) == [rm.CopyForCheckpoint(2)]
    assert m(rm.CheckpointCopied(2)) == [rm.PauseDispatch("checkpoint")]


def test_the_error_of_a_copy_stopped_for_a_ps_loss_is_ignored():
    m = Machine()
    m(rm.Restored())
    m(rm.CheckpointRequested("t", "requested"))
    m(rm.PsNotAnswering((0,)))  # stops the copy
    assert m(rm.CheckpointCopied(1, OSError("no answer within 3 s"))) == []  # the recovery decides
