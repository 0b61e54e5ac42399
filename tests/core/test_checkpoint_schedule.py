"""When the recovery machine checkpoints (`psclient._core.checkpoint_schedule`): pure, a fake clock."""

from psclient._core.checkpoint_schedule import CheckpointSchedule
from psclient._core.errors import StrategyClosedError
from psclient._core.recovery_messages import Finish


def test_a_request_is_due_at_once_even_when_nothing_is_periodic():
    schedule = CheckpointSchedule(interval=None, every=None, has_checkpoint=False, now=0.0)
    assert schedule.due(0.0, 0, periodic=False) is None
    schedule.request("ticket", "requested")
    assert schedule.due(0.0, 0, periodic=False) == "requested"
    assert schedule.saved(1.0, "/ckpt/1", 0) == [Finish("ticket", value="/ckpt/1")]
    assert schedule.due(1.0, 0, periodic=False) is None and schedule.has_checkpoint


def test_interval_and_count_only_after_a_first_save():
    schedule = CheckpointSchedule(interval=10.0, every=5, has_checkpoint=False, now=0.0)
    assert schedule.due(100.0, 100, periodic=True) is None  # nothing saved yet: nothing periodic
    schedule.saved(100.0, "/ckpt/1", 100)
    assert schedule.due(105.0, 104, periodic=True) is None
    assert schedule.due(105.0, 105, periodic=True) == "interval"  # 5 more closures
    assert schedule.due(110.0, 100, periodic=True) == "interval"  # 10 s later
    assert schedule.due(110.0, 105, periodic=False) is None  # broken, or no checkpoint_dir


def test_failed_skipped_and_closed_finish_every_waiting_request():
    schedule = CheckpointSchedule(interval=None, every=None, has_checkpoint=True, now=0.0)
    error = OSError("disk full")
    schedule.request("a", "requested")
    schedule.request("b", "new variables")
    assert schedule.failed(1.0, error) == [Finish("a", error=error), Finish("b", error=error)]
    schedule.request("c", "requested")
    assert schedule.skipped() == [Finish("c", value=None)]
    schedule.request("d", "requested")
    [closed] = schedule.closed()
    assert closed.ticket == "d" and isinstance(closed.error, StrategyClosedError)
    assert schedule.closed() == []
