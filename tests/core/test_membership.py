"""Workers joining and retiring in the scheduler (`psclient._core.membership`), without a cluster."""

import threading

import pytest
from _polling import wait_for
from _sequencer import HeldBackLock

from psclient._core.future import Future
from psclient._core.closure import Closure
from psclient._core.scheduler import Scheduler


def make(name="fn"):
    return Closure(lambda: None, (), {}, Future(name))


def take_in_thread(scheduler, worker, timeout=10.0):
    """Starts take(worker) in a thread; returns (thread, box) with box[0] its result."""
    box = []
    thread = threading.Thread(target=lambda: box.append(scheduler.take(worker, timeout=timeout)))
    thread.start()
    return thread, box


def test_a_new_worker_gets_the_next_slot_down_and_takes_work_once_up():
    s = Scheduler(num_workers=2)
    assert s.add_worker() == 2
    assert s.num_workers == 3
    assert not s.worker_is_up(2)
    s.submit(make("a"))
    assert s.take(2, timeout=0) is None  # down until brought up
    s.worker_up(2, recovered_after=0.5)
    taken = s.take(2, timeout=0)
    assert taken is not None and taken.worker == 2
    s.succeeded(2, taken, 7)
    assert taken.future.result(timeout=0) == 7
    stats = s.stats()["workers"][2]
    assert stats["up"] and stats["done"] == 1
    assert stats["rejoins"] == 0 and stats["last_recovery_s"] is None  # joining is no rejoin
    s.worker_lost(2)
    s.worker_up(2, recovered_after=0.25)
    assert s.stats()["workers"][2]["rejoins"] == 1  # later ups are


def test_a_waiting_thread_of_a_new_worker_is_woken_when_it_comes_up():
    s = Scheduler(num_workers=1)
    s.add_worker()
    thread, box = take_in_thread(s, 1)
    c = make()
    s.worker_lost(0)  # only the new worker can take it
    s.submit(c)
    s.worker_up(1)
    thread.join(10)
    assert box == [c]


def test_retire_with_drain_lets_running_closures_finish_there_and_takes_nothing_new():
    s = Scheduler(num_workers=2)
    a, b = make("a"), make("b")
    s.submit(a)
    assert s.take(1, timeout=0) is a
    assert s.retire_worker(1, drain=True) == []
    assert s.is_retired(1) and s.retired() == frozenset({1})
    assert s.running_on(1) == 1
    s.submit(b)
    assert s.take(1, timeout=0) is None  # a retired worker's thread ends
    assert not s.wait_drained(1, timeout=0)
    s.succeeded(1, a, "from 1")  # its report counts: it was not abandoned
    assert a.future.result(timeout=0) == "from 1"
    assert s.wait_drained(1, timeout=0)
    assert s.take(0, timeout=0) is b
    stats = s.stats()["workers"][1]
    assert stats["retired"] and not stats["up"] and stats["done"] == 1
    assert stats["failures"] == 0  # retiring is no failure


def test_retire_without_drain_hands_running_closures_back_and_ignores_their_late_reports():
    s = Scheduler(num_workers=3)
    first, second, third = make("1"), make("2"), make("3")
    for c in (first, second, third):
        s.submit(c)
    assert s.take(2, timeout=0) is first
    assert s.take(2, timeout=0) is second
    handed_back = s.retire_worker(2, drain=False)
    assert handed_back == [first, second]
    assert s.running_on(2) == 0 and s.wait_drained(2, timeout=0)
    # Back at the front, in order, before the one never taken.
    assert [s.take(0, timeout=0), s.take(1, timeout=0), s.take(0, timeout=0)] == [first, second, third]
    s.succeeded(2, first, "late, from the retired worker")  # stale: ignored
    assert not first.future.done()
    s.succeeded(0, first, "from 0")
    s.failed(2, second, RuntimeError("late"), retry=False)  # stale too
    s.succeeded(1, second, "from 1")
    s.succeeded(0, third, "from 0")
    assert [c.future.result(timeout=0) for c in (first, second, third)] == ["from 0", "from 1", "from 0"]
    assert s.stats()["stale_reports"] == 2
    assert s.join(timeout=0)


def test_retire_ends_the_threads_waiting_for_that_worker_only():
    s = Scheduler(num_workers=2)
    waiting_1, box_1 = take_in_thread(s, 1)
    waiting_0, box_0 = take_in_thread(s, 0)
    s.worker_lost(1)  # a down worker's waiting threads are parked: they end too
    down_thread, down_box = take_in_thread(s, 1)
    s.retire_worker(1, drain=True)
    waiting_1.join(10)
    down_thread.join(10)
    assert box_1 == [None] and down_box == [None]
    assert waiting_0.is_alive()  # the other worker's thread still waits for work
    c = make()
    s.submit(c)
    waiting_0.join(10)
    assert box_0 == [c]
    assert s.waiting_threads() == (0, 0)


def test_a_wakeup_given_to_a_worker_retired_before_it_took_goes_to_another_worker():
    lock = HeldBackLock()
    s = Scheduler(num_workers=2, lock=lock)
    waiting_0, box_0 = take_in_thread(s, 0)
    # Worker 0's thread waits first, so the submit below wakes it (the longest idle is woken first).
    wait_for(lambda: s.waiting_threads() == (1, 0), 10, "worker 0's thread to wait in take()")
    waiting_1, box_1 = take_in_thread(s, 1, timeout=60)
    wait_for(lambda: s.waiting_threads() == (2, 0), 10, "worker 1's thread to wait in take()")
    lock.hold_back(waiting_0)
    c = make()
    s.submit(c)  # wakes worker 0's thread, which then waits for the lock at the gate
    assert lock.arrived.wait(10), "the woken thread never asked for the lock back"
    s.retire_worker(0, drain=True)  # retired between its wakeup and its look at the queue
    lock.let_go()
    waiting_0.join(10)
    assert box_0 == [None]
    # The wakeup went on to worker 1's thread, which took the closure (it would sleep out its 60 s
    # and take nothing had the wakeup been dropped with the retired worker).
    waiting_1.join(10)
    assert not waiting_1.is_alive() and box_1 == [c]


def test_a_late_worker_up_does_not_bring_a_retired_worker_back():
    s = Scheduler(num_workers=2)
    s.retire_worker(1, drain=True)
    s.worker_up(1, recovered_after=1.0)
    assert not s.worker_is_up(1)
    s.submit(make())
    assert s.take(1, timeout=0) is None


def test_a_retired_slot_rejoins_as_a_joining_worker():
    s = Scheduler(num_workers=2)
    s.retire_worker(1, drain=True)
    with pytest.raises(ValueError, match="not retired"):
        s.rejoin_slot(0)
    s.rejoin_slot(1)
    assert not s.is_retired(1) and not s.worker_is_up(1)
    assert not s.stats()["workers"][1]["retired"]
    s.worker_up(1)
    c = make()
    s.submit(c)
    assert s.take(1, timeout=0) is c
    assert s.stats()["workers"][1]["rejoins"] == 0


def test_hand_back_after_a_drain_that_took_too_long():
    s = Scheduler(num_workers=2)
    c = make()
    s.submit(c)
    assert s.take(1, timeout=0) is c
    s.retire_worker(1, drain=True)
    assert not s.wait_drained(1, timeout=0.01)
    assert s.hand_back(1) == [c]
    assert s.take(0, timeout=0) is c
    s.succeeded(0, c, 1)
    assert c.future.result(timeout=0) == 1


def test_wait_drained_is_woken_by_the_last_closure_there_ending():
    s = Scheduler(num_workers=2)
    a, b = make("a"), make("b")
    s.submit(a)
    s.submit(b)
    assert s.take(1, timeout=0) is a
    assert s.take(0, timeout=0) is b  # keeps running_total above 0 when a ends
    s.retire_worker(1, drain=True)
    result = []
    waiter = threading.Thread(target=lambda: result.append(s.wait_drained(1, timeout=10)))
    waiter.start()
    s.succeeded(1, a, None)
    waiter.join(10)
    assert result == [True]


def test_retire_without_drain_while_an_error_is_pending_cancels_what_it_hands_back():
    s = Scheduler(num_workers=2)
    bad, running = make("bad"), make("running")
    s.submit(bad)
    s.submit(running)
    assert s.take(0, timeout=0) is bad
    assert s.take(1, timeout=0) is running
    s.failed(0, bad, ValueError("boom"), retry=False)
    assert s.retire_worker(1, drain=False) == []  # cancelled, as a requeue is while an error waits
    assert running.future.cancelled() or isinstance(running.future.exception(timeout=0), Exception)
    with pytest.raises(ValueError, match="boom"):
        s.join(timeout=5)
