"""Workers joining and leaving in the recovery state machine (`psclient._core.joining`).

Fake clock, no cluster, no threads: events in, actions out, as in
tests/core/test_recovery_machine.py (whose driver this uses).
"""

import pytest
from test_recovery_machine import Driver, kinds

from psclient._core import recovery_messages as rm
from psclient._core.errors import StrategyClosedError
from psclient._core.recovery_messages import TaskState

UP, SUSPECT, LOST, REJOINING, RETIRED = (
    TaskState.UP, TaskState.SUSPECT, TaskState.LOST, TaskState.REJOINING, TaskState.RETIRED,
)


def finishes(actions):
    return [a for a in actions if isinstance(a, rm.Finish)]


# ------------------------------------------------------------------- joining
def test_a_new_worker_joins_through_the_rejoin_flow_and_its_ticket_gets_its_index():
    d = Driver()
    actions = d(rm.WorkerAdded(2, "t"), at=5.0)
    assert actions == [rm.RejoinWorker(frozenset({0, 1, 2}), 2)]
    assert d.m.workers == [UP, UP, REJOINING]
    assert d.done() == [rm.CheckAnswers(2)]
    assert d.done() == [rm.RebuildWorker(2)]
    d.now = 5.5
    assert d.done() == [rm.BringUp(2, recovered_after=0.5, joined=True), rm.Finish("t", value=2)]
    assert d.m.workers == [UP, UP, UP]
    assert d.m.view == frozenset({0, 1, 2})
    assert d.m.epochs == [0, 0, 1]


def test_a_joining_worker_whose_step_fails_is_tried_again_once_it_answers():
    d = Driver()
    d(rm.WorkerAdded(2, "t"))
    assert d.done(ok=False, error=RuntimeError("connect failed")) == []  # no Finish: not joined yet
    assert d.m.workers[2] is SUSPECT and d.m.op is None
    actions = d(rm.WorkerSeen(2, "open", False), at=2.0)  # the next round sees it answer
    assert actions == [rm.RejoinWorker(frozenset({0, 1, 2}), 2)]
    seen = d.finish_ops(actions)
    assert rm.Finish("t", value=2) in seen
    assert d.m.workers[2] is UP


@pytest.mark.parametrize("worker", [0, 3])
def test_a_worker_added_at_a_slot_that_is_neither_next_nor_retired_is_refused(worker):
    d = Driver()
    [finish] = d(rm.WorkerAdded(worker, "t"))
    assert finish.ticket == "t" and isinstance(finish.error, ValueError)
    assert f"worker {worker} cannot join" in str(finish.error)
    assert len(d.m.workers) == 2 and d.m.op is None


# ------------------------------------------------------------------- leaving
def test_a_retired_worker_leaves_the_view_then_its_ticket_is_finished():
    d = Driver(num_workers=3)
    actions = d(rm.WorkerRetired(1, "t"))
    assert actions == [rm.DropWorkers(frozenset({0, 2}), leaving=frozenset({1}))]
    assert d.m.leaving() == [1]
    assert d.done() == [rm.Finish("t", value=1)]
    assert d.m.workers == [UP, RETIRED, UP]
    assert d.m.view == frozenset({0, 2}) and d.m.leaving() == []
    # Never observed again, never rejoins.
    assert d(rm.WorkerSeen(1, "open", False)) == []
    assert d(rm.WorkerNotAnswering(1)) == []
    assert d(rm.ProbeOverdue(1, 100.0)) == []
    assert d.m.workers[1] is RETIRED and d.m.op is None


def test_a_leaving_worker_that_does_not_answer_stays_in_the_view_until_it_does():
    d = Driver(num_workers=3)
    d(rm.WorkerRetired(1, "t"))
    # The recovery thread refused the Reconnect: worker 1 accepts connections but did not answer.
    actions = d.done(ok=False, value={1: "open"})
    assert kinds(actions) == ["TakeOut"] and d.m.workers[1] is SUSPECT
    assert d.m.op is None and d.m.blocking() == [1]  # no Reconnect while it may hang
    assert d.tick() == []
    # It answers again: dropped now (not brought back: it is leaving).
    actions = d(rm.WorkerSeen(1, "open", False))
    assert actions == [rm.DropWorkers(frozenset({0, 2}), leaving=frozenset({1}))]
    assert d.done() == [rm.Finish("t", value=1)]
    assert d.m.workers[1] is RETIRED


def test_a_leaving_worker_that_dies_is_dropped_as_gone():
    d = Driver(num_workers=3)
    d(rm.WorkerRetired(1, "t"))
    d.done(ok=False, value={1: "silent"})
    assert d(rm.WorkerSeen(1, "closed", False)) == [
        rm.DropWorkers(frozenset({0, 2}), leaving=frozenset({1}))]
    assert d.done() == [rm.Finish("t", value=1)]


def test_retiring_a_worker_already_out_of_the_view_finishes_at_once():
    d = Driver(num_workers=3)
    d(rm.WorkerNotAnswering(1))
    d(rm.WorkerSeen(1, "closed", False))
    d.done()  # the gone worker was dropped
    assert d(rm.WorkerRetired(1, "t")) == [rm.Finish("t", value=1)]
    assert d.m.workers[1] is RETIRED and d.m.op is None
    assert d(rm.WorkerRetired(1, "again")) == [rm.Finish("again", value=1)]  # idempotent


def test_retiring_a_joining_worker_fails_its_join_ticket():
    d = Driver()
    d(rm.WorkerAdded(2, "join"))
    # Retired while its Reconnect runs: that Reconnect puts it in the view, the drop takes it out.
    actions = d(rm.WorkerRetired(2, "leave"))
    [failed] = finishes(actions)  # and not the other ticket: its Reconnect may add it to the view
    assert failed.ticket == "join" and "removed before it joined" in str(failed.error)
    actions = d.done()  # the rejoin Reconnect succeeded: the flow ends, the drop starts
    assert actions == [rm.DropWorkers(frozenset({0, 1}), leaving=frozenset({2}))]
    assert d.done() == [rm.Finish("leave", value=2)]
    assert d.m.workers[2] is RETIRED and d.m.view == frozenset({0, 1})


def test_retiring_a_joining_worker_whose_reconnect_then_fails_retires_it_at_once():
    d = Driver()
    d(rm.WorkerAdded(2, "join"))
    d(rm.WorkerRetired(2, "leave"))
    actions = d.done(ok=False, error=RuntimeError("connect failed"))
    assert rm.Finish("leave", value=2) in actions
    assert d.m.workers[2] is RETIRED and d.m.leaving() == [] and d.m.view == frozenset({0, 1})


def test_a_retired_slot_joins_again_with_a_new_epoch():
    d = Driver()
    d(rm.WorkerRetired(1, "leave"))
    d.done()
    seen = d.finish_ops(d(rm.WorkerAdded(1, "join")))
    assert rm.Finish("join", value=1) in seen
    assert [a for a in seen if isinstance(a, rm.BringUp)][0].joined
    assert d.m.workers == [UP, UP] and d.m.view == frozenset({0, 1})
    assert d.m.epochs[1] == 2  # one for the new process, one for its BringUp


def test_a_slot_still_leaving_cannot_join_again():
    d = Driver(num_workers=3)
    d(rm.WorkerRetired(1, "leave"))  # its drop Reconnect is under way
    [finish] = d(rm.WorkerAdded(1, "join"))
    assert isinstance(finish.error, ValueError)


def test_every_reconnect_names_the_leaving_workers_it_drops():
    d = Driver(num_workers=3, checkpointing=True, has_checkpoint=True)
    d(rm.PsNotAnswering((0,)))
    d(rm.WorkerRetired(1, "t"))  # a ps recovery goes first; its Reconnect drops worker 1 too
    actions = d(rm.PsSeen(0, "open"))
    assert actions == [rm.ReconnectPs(frozenset({0, 2}), leaving=frozenset({1}))]
    assert d.done() == [rm.Finish("t", value=1), rm.RenewAndRestore((0,))]


def test_a_checkpoint_waits_until_the_leaving_worker_is_out_of_the_view():
    d = Driver(num_workers=3, checkpointing=True)
    d(rm.WorkerRetired(1, "t"))
    assert d(rm.CheckpointRequested("ckpt", "requested")) == []  # the drop is under way
    actions = d.done()
    assert actions == [rm.Finish("t", value=1), rm.PauseDispatch("checkpoint")]


def test_retiring_the_last_worker_in_rotation_starts_the_worker_timeout():
    d = Driver(worker_timeout=30.0)
    d(rm.WorkerNotAnswering(0), at=1.0)
    d(rm.WorkerRetired(1, "t"), at=2.0)
    assert kinds(d.tick(at=20.0)) == []
    assert kinds(d.tick(at=32.5)) == ["FailAll"]


def test_shutdown_fails_the_tickets_of_joining_and_leaving_workers():
    d = Driver(num_workers=3)
    d(rm.WorkerAdded(3, "join"))
    d.m.op = None  # as if its Reconnect were still running when the strategy shuts down
    d(rm.WorkerRetired(1, "leave"))
    actions = d(rm.Shutdown())
    tickets = {a.ticket: a.error for a in finishes(actions)}
    assert set(tickets) == {"join", "leave"}
    assert all(isinstance(e, StrategyClosedError) for e in tickets.values())
