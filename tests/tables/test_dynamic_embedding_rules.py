"""Admission and eviction rules of dynamic embedding tables (psclient/_core/dynamic_tables.py): pure logic."""

from __future__ import annotations

import pytest

from psclient._core.dynamic_tables import Policy, choose_evictions, expired, headroom, per_ps, scan_every


@pytest.mark.parametrize("name, kwargs, received", [
    ("min_frequency", {"min_frequency": 0}, "min_frequency=0"),
    ("min_frequency", {"min_frequency": 1.5}, "min_frequency=1.5"),
    ("capacity", {"capacity": 0}, "capacity=0"),
    ("ttl_steps", {"ttl_steps": -3}, "ttl_steps=-3"),
])
def test_bad_arguments_name_the_argument_and_what_was_received(name, kwargs, received):
    with pytest.raises(ValueError, match=rf"argument `{name}`\. Received: {received}\. Expected an integer >= 1"):
        Policy.checked(**kwargs)


def test_capacity_is_split_evenly_over_ps_tasks_rounded_up():
    assert per_ps(None, 3) is None
    assert [per_ps(10, n) for n in (1, 2, 3, 4)] == [10, 5, 4, 3]
    assert per_ps(1, 4) == 1


def test_headroom_and_scan_cadence():
    assert [headroom(n) for n in (1, 15, 16, 160)] == [1, 1, 1, 10]
    assert [scan_every(t) for t in (None, 1, 8, 9, 80)] == [None, 1, 1, 2, 10]
    assert not expired(10, 8, 2) and expired(11, 8, 2) and not expired(10**6, 0, None)


def test_least_recently_used_rows_go_first_down_to_share_minus_headroom():
    policy = Policy(min_frequency=1, capacity=4)
    # (key, count, last seen): 5 rows for a share of 4 -> keep 4 - 1 = 3.
    entries = [(10, 3, 7), (11, 1, 2), (12, 9, 5), (13, 1, 9), (14, 2, 1)]
    assert choose_evictions(entries, clock=9, policy=policy, share=4) == {14, 11}


def test_ties_in_last_seen_evict_the_smaller_key_first():
    entries = [(30, 1, 4), (20, 1, 4), (10, 1, 4)]
    assert choose_evictions(entries, clock=4, policy=Policy(capacity=2), share=2) == {10, 20}


def test_rows_within_share_stay_and_counting_keys_are_bounded_separately():
    policy = Policy(min_frequency=3, capacity=2)
    rows = [(1, 3, 1), (2, 5, 2)]  # admitted, exactly the share
    counting = [(7, 1, 5), (8, 2, 3), (9, 1, 6)]  # 3 keys still counting, share 2 -> keep 1
    assert choose_evictions(rows + counting, clock=6, policy=policy, share=2) == {8, 7}


def test_expired_keys_go_whatever_the_capacity():
    policy = Policy(ttl_steps=3)
    entries = [(1, 1, 10), (2, 1, 6), (3, 1, 7), (4, 0, 2)]
    assert choose_evictions(entries, clock=10, policy=policy, share=None) == {2, 4}
    # Expired ones do not count against the share.
    assert choose_evictions(entries, clock=10, policy=Policy(ttl_steps=3, capacity=2), share=2) == {2, 4}
