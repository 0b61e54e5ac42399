"""When deltas fall due between full checkpoints (`psclient._core.checkpoint_schedule`): pure, a fake clock."""

from psclient._core.checkpoint_schedule import CheckpointSchedule, is_delta
from psclient._core.recovery_machine import MachineConfig


def schedule(**kwargs):
    s = CheckpointSchedule(has_checkpoint=False, now=0.0, **kwargs)
    s.request("first", "requested")  # the first checkpoint: always a full one, asked for
    s.started()
    s.written(0.0, "/c/ckpt-1", 0, None)
    return s


def write(s, now, path, completed):
    s.started()
    return s.written(now, path, completed, None)


def test_a_path_names_a_delta_by_its_suffix():
    assert is_delta("/c/ckpt-3.delta-2") and is_delta("gs://b/c/ckpt-1.delta-10")
    assert not is_delta("/c/ckpt-3") and not is_delta(None) and not is_delta("/c.delta-1/ckpt-3")


def test_deltas_count_from_the_last_checkpoint_and_full_ones_from_the_last_full():
    s = schedule(interval=None, every=10, delta_every=3)
    assert s.due(1.0, 2, periodic=True) is None
    assert s.due(1.0, 3, periodic=True) == "delta"
    write(s, 1.0, "/c/ckpt-1.delta-1", 3)
    assert s.due(2.0, 5, periodic=True) is None  # 2 since the delta
    assert s.due(2.0, 6, periodic=True) == "delta"
    write(s, 2.0, "/c/ckpt-1.delta-2", 6)
    assert s.due(3.0, 9, periodic=True) == "delta"
    write(s, 3.0, "/c/ckpt-1.delta-3", 9)
    assert s.due(4.0, 10, periodic=True) == "interval"  # 10 since the full one: a full one wins
    write(s, 4.0, "/c/ckpt-2", 10)
    assert s.due(5.0, 12, periodic=True) is None and s.due(5.0, 13, periodic=True) == "delta"


def test_delta_interval_in_seconds_and_a_request_stays_full():
    s = schedule(interval=100.0, every=None, delta_interval=10.0)
    assert s.due(9.0, 0, periodic=True) is None
    assert s.due(10.0, 0, periodic=True) == "delta"
    s.request("user", "requested")
    assert s.due(10.0, 0, periodic=True) == "requested"  # what a caller asks for is a full checkpoint
    write(s, 10.0, "/c/ckpt-2", 0)
    assert s.due(19.0, 0, periodic=True) is None and s.due(20.0, 0, periodic=True) == "delta"


def test_no_delta_before_a_first_checkpoint_while_one_is_written_or_when_not_periodic():
    s = CheckpointSchedule(interval=None, every=None, has_checkpoint=False, now=0.0, delta_every=1)
    assert s.due(50.0, 50, periodic=True) is None  # nothing saved yet: no base for a delta
    s = schedule(interval=None, every=None, delta_every=1)
    assert s.due(1.0, 5, periodic=False) is None  # broken, or no checkpoint_dir
    s.started()
    assert s.due(1.0, 5, periodic=True) is None  # one write at a time


def test_a_store_that_wrote_a_full_checkpoint_instead_restarts_both_counts():
    s = schedule(interval=None, every=10, delta_every=3)
    write(s, 1.0, "/c/ckpt-2", 3)  # asked for a delta, written full (no base: a ps was lost)
    assert s.due(2.0, 12, periodic=True) == "delta" and s.due(2.0, 13, periodic=True) == "interval"


def test_a_failed_delta_is_tried_again_after_its_interval():
    s = schedule(interval=None, every=None, delta_every=3, delta_interval=5.0)
    s.started()
    s.written(2.0, None, None, OSError("disk full"))
    assert s.due(2.0, 2, periodic=True) is None
    assert s.due(7.0, 2, periodic=True) == "delta"


def test_the_machine_config_carries_the_delta_rule():
    config = MachineConfig(num_workers=1, num_ps=1, checkpointing=True, delta_checkpoint_every=4)
    s = CheckpointSchedule.of(config, 0.0)
    s.saved(0.0, "/c/ckpt-1", 0)
    assert s.due(1.0, 4, periodic=True) == "delta"
