"""The data ledger's bookkeeping, without a cluster."""

import json

import pytest

from psclient._core.ledger import Ledger, LedgerMismatchError, ShardKey, shard_order


def shards(n, size=10):
    return [ShardKey(i * size, (i + 1) * size) for i in range(n)]


def drain(ledger):
    slots = []
    while (work := ledger.hand_out()) is not None:
        slots.append(work.slot)
        ledger.finish(work.slot, records=10)
    return slots


def test_every_shard_once_per_epoch_in_a_seeded_order():
    ledger = Ledger(shards(20), seed=7)
    ledger.start_epoch(0)
    first = drain(ledger)
    assert sorted(first) == list(range(20)) and ledger.complete()
    ledger.start_epoch(1)
    second = drain(ledger)
    assert sorted(second) == list(range(20)) and second != first  # reshuffled per epoch
    # Reproducible: another ledger with the same seed hands out the same orders.
    again = Ledger(shards(20), seed=7)
    again.start_epoch(0)
    assert drain(again) == first
    assert shard_order(20, None, 3) == list(range(20))
    assert ledger.stats()["records"] == 400


def test_late_binding_hands_out_only_free_shards():
    ledger = Ledger(shards(3))
    ledger.start_epoch(0)
    a, b, c = ledger.hand_out(), ledger.hand_out(), ledger.hand_out()
    assert [a.slot, b.slot, c.slot] == [0, 1, 2]
    assert ledger.hand_out() is None  # all held
    ledger.finish(1)
    assert ledger.hand_out() is None and not ledger.complete()
    assert ledger.stats()["in_flight"] == 2


def test_give_back_resumes_from_the_last_finished_position():
    ledger = Ledger(shards(3))
    ledger.start_epoch(0)
    work = ledger.hand_out()
    ledger.progress(work.slot, 4)
    ledger.progress(work.slot, 2)  # a late, older report does not move it back
    ledger.give_back(work.slot, replayed=10)
    again = ledger.hand_out()
    assert (again.slot, again.position) == (work.slot, 4)  # first in line, from batch 4
    ledger.finish(again.slot, records=60)
    ledger.finish(again.slot, records=60)  # a late duplicate counts once
    assert drain(ledger) == [1, 2]
    stats = ledger.stats()
    assert stats["replayed_records"] == 10 and stats["given_back"] == 1 and stats["records"] == 80


def test_state_round_trips_through_json_and_resumes_the_epoch():
    ledger = Ledger(shards(6), seed=3)
    ledger.start_epoch(2)
    done = ledger.hand_out()
    ledger.finish(done.slot, records=10)
    held = ledger.hand_out()
    ledger.progress(held.slot, 5)
    state = json.loads(json.dumps(ledger.state()))

    resumed = Ledger(shards(6), seed=3)
    resumed.load(state)
    resumed.start_epoch(2)  # the same epoch: kept, not restarted
    first = resumed.hand_out()
    assert (first.slot, first.position) == (held.slot, 5)  # the held one first, from where it was
    assert resumed.cut_off() == {held.slot}
    resumed.finish(first.slot)
    rest = drain(resumed)
    assert done.slot not in rest and sorted(rest + [first.slot, done.slot]) == list(range(6))
    resumed.start_epoch(3)  # the next epoch starts over
    assert len(drain(resumed)) == 6


def test_a_ledger_of_other_shards_is_refused():
    ledger = Ledger(shards(4))
    ledger.start_epoch(0)
    state = ledger.state()
    with pytest.raises(LedgerMismatchError, match="4 shards.*Expected 5 shards"):
        Ledger(shards(5)).load(state)
    with pytest.raises(LedgerMismatchError, match="does not match"):
        Ledger([ShardKey(0, 10, "a"), ShardKey(0, 10, "b"), ShardKey(0, 10, "c"), ShardKey(0, 10, "d")]).load(state)
    with pytest.raises(LedgerMismatchError, match="seed=None"):
        Ledger(shards(4), seed=1).load(state)
    with pytest.raises(LedgerMismatchError, match="Received: 'junk'"):
        Ledger(shards(4)).load("junk")


def test_bad_calls():
    with pytest.raises(ValueError, match="empty list"):
        Ledger([])
    ledger = Ledger(shards(2))
    with pytest.raises(RuntimeError, match="start_epoch"):
        ledger.hand_out()
    with pytest.raises(ValueError, match="epoch=-1"):
        ledger.start_epoch(-1)
    ledger.start_epoch(0)
    with pytest.raises(IndexError, match="slot 5"):
        ledger.finish(5)


def test_roll_back_to_a_checkpoint_of_this_epoch_hands_out_again_what_was_done_since():
    ledger = Ledger(shards(6), seed=None)
    ledger.start_epoch(0)
    for slot in (0, 1):
        ledger.hand_out()
        ledger.finish(slot, records=10)
    ledger.hand_out()  # slot 2 held
    ledger.progress(2, 3)
    saved = json.loads(json.dumps(ledger.state()))  # the checkpoint: 0 and 1 done, 2 at batch 3
    ledger.finish(2, records=10)
    ledger.hand_out()
    ledger.finish(3, records=10)
    held = ledger.hand_out()  # slot 4, in flight when the ps is lost
    undone, over = ledger.roll_back(saved)
    assert (undone, over) == ([2, 3], False)
    assert ledger.held() == {held.slot}  # its closure runs again from the restored positions
    stats = ledger.stats()
    assert stats["done"] == 2 and stats["records"] == 20 and stats["rolled_back_shards"] == 2
    again = ledger.hand_out()
    assert (again.slot, again.position) == (2, 3)  # from its position at the checkpoint
    assert ledger.hand_out().slot == 3 and ledger.hand_out().slot == 5 and ledger.hand_out() is None


def test_roll_back_to_a_checkpoint_of_an_earlier_epoch_starts_this_epoch_over():
    ledger = Ledger(shards(4), seed=3)
    ledger.start_epoch(0)
    drain(ledger)
    saved = ledger.state()  # taken in epoch 0
    ledger.start_epoch(1)
    ledger.finish(ledger.hand_out().slot, records=10)
    held = ledger.hand_out()
    undone, over = ledger.roll_back(saved)
    assert over and len(undone) == 1 and ledger.stats()["done"] == 0
    assert ledger.roll_back(None)[1]  # a checkpoint without this ledger: the same
    rest = drain(ledger)
    assert sorted(rest + [held.slot]) == [0, 1, 2, 3]
    with pytest.raises(LedgerMismatchError, match="2 shards"):
        ledger.roll_back(Ledger(shards(2), seed=3).state())
