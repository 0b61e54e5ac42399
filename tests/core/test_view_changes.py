"""The record of TF's view changes (pure): counts, the slow ones, the one under way, when to warn."""

import itertools
import types

import pytest

from psclient._core.view_changes import ViewChanges, warning_times


def test_a_change_under_way_is_reported_until_it_ends_then_counted():
    clock = types.SimpleNamespace(now=0.0)
    record = ViewChanges(slow_s=10.0, clock=lambda: clock.now)
    assert record.stats() == {"changes": 0, "slow_changes": 0, "longest_s": 0.0, "changing_for_s": 0.0,
                              "changing_tasks": []}
    record.began(["worker:1", "ps:0"])
    clock.now = 4.5
    assert record.stats()["changing_for_s"] == 4.5
    assert record.stats()["changing_tasks"] == ["ps:0", "worker:1"]
    assert record.ended() == 4.5
    clock.now = 100.0
    record.began(["ps:0"])
    clock.now = 125.0
    assert record.ended() == 25.0
    assert record.stats() == {"changes": 2, "slow_changes": 1, "longest_s": 25.0, "changing_for_s": 0.0,
                              "changing_tasks": []}


def test_ended_without_began_is_a_bug_said_as_such():
    with pytest.raises(RuntimeError, match="without began"):
        ViewChanges(clock=lambda: 0.0).ended()


def test_warnings_come_at_10_30_60_s_then_at_each_doubling():
    assert list(itertools.islice(warning_times(), 6)) == [10.0, 30.0, 60.0, 120.0, 240.0, 480.0]
    assert list(itertools.islice(warning_times((1.0,)), 3)) == [1.0, 2.0, 4.0]
