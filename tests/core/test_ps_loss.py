"""`PsLoss`: the waits, steps and giving up of one loss of ps tasks. Pure logic: times are given."""

from __future__ import annotations

from psclient._core import recovery_messages as rm
from psclient._core.ps_loss import GiveUp, PsLoss, asks_for_restarted_ps


def loss(**overrides) -> PsLoss:
    return PsLoss(**{"since": 0.0, "hang_timeout": 5.0, "ps_timeout": 30.0, "attempts": 2, **overrides})


def test_running_closures_are_waited_for_then_requeued_once():
    ps = loss()
    assert ps.before_reconnect(1.0, running=3, unreachable=False) == []
    assert ps.before_reconnect(5.0, running=3, unreachable=False) == [rm.RequeueRunning()]
    # Requeued once: closures still counted as running no longer hold the recovery.
    assert ps.before_reconnect(5.5, running=3, unreachable=False) is None
    assert ps.back_at == 5.5


def test_an_unreachable_ps_is_waited_for_until_ps_timeout():
    ps = loss()
    assert ps.before_reconnect(10.0, running=0, unreachable=True) == []
    assert ps.back_at is None
    given_up = ps.before_reconnect(30.5, running=0, unreachable=True)
    assert given_up == GiveUp("it did not come back within ps_timeout=30 s")


def test_the_steps_follow_in_order_and_end_recovered():
    ps, lost = loss(), (1,)
    assert ps.next_step(rm.ReconnectPs(frozenset({0})), lost) == rm.RenewAndRestore(lost)
    assert ps.next_step(rm.RenewAndRestore(lost), lost) == rm.Retrace()
    assert ps.next_step(rm.Retrace(), lost) == rm.RebuildResources()
    assert ps.next_step(rm.RebuildResources(), lost) is None


def test_failures_with_an_error_count_and_give_up_refusals_do_not():
    ps = loss(attempts=2)
    for _ in range(5):  # a task that did not answer: tried again, never counted
        assert ps.failed(None) is None
    assert ps.retry_next_round and ps.failures == 0
    assert ps.failed(RuntimeError("restore failed")) is None
    assert ps.failed(RuntimeError("restore failed")) == GiveUp("restoring it failed 2 times: restore failed")


def test_the_restore_step_carries_the_loss_mode():
    lost = (1,)
    assert loss(mode="part").next_step(rm.ReconnectPs(frozenset({0})), lost) == rm.RenewAndRestore(lost, "part")
    # "all" by default: today's global rollback, for code that builds a PsLoss without a mode.
    assert loss().next_step(rm.ReconnectPs(frozenset({0})), lost) == rm.RenewAndRestore(lost, "all")


def test_who_asks_whether_a_ps_was_restarted_behind_the_coordinators_back():
    reconnect, reconnect_ps, restore = rm.Reconnect(frozenset({0})), rm.ReconnectPs(frozenset({0})), rm.RenewAndRestore((0,))
    error = RuntimeError("invalid device")
    # No loss under way: after a reconnect that introduced the tasks, and after any failed step.
    assert asks_for_restarted_ps(reconnect, True, None, recovering=False)
    assert not asks_for_restarted_ps(reconnect, False, error, recovering=False)
    assert not asks_for_restarted_ps(reconnect_ps, True, None, recovering=False)
    assert asks_for_restarted_ps(rm.Retrace(), False, error, recovering=False)
    assert not asks_for_restarted_ps(rm.Retrace(), True, None, recovering=False)
    # During a loss: a step that failed with an error (another ps may be behind it), not a refusal.
    assert asks_for_restarted_ps(restore, False, error, recovering=True)
    assert not asks_for_restarted_ps(restore, False, None, recovering=True)
    assert not asks_for_restarted_ps(restore, True, None, recovering=True)


def test_a_widened_loss_counts_its_tries_from_none():
    ps = loss(attempts=2)
    assert ps.failed(RuntimeError("x")) is None and ps.failures == 1
    ps.widened(midway=False)
    assert ps.failures == 0 and ps.retry_next_round and not ps.take_restart()
    assert ps.failed(RuntimeError("x")) is None  # one of two again
    ps.widened(midway=True)  # during a step: whatever it ends with, the steps start again, once
    assert ps.take_restart() and not ps.take_restart()
