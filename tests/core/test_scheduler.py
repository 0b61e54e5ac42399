"""The closure queue and its bookkeeping, without a cluster."""

import concurrent.futures
import threading

import pytest
from _polling import wait_for

from psclient._core.attempts import RunningAttempts
from psclient._core.errors import StrategyClosedError
from psclient._core.future import Future
from psclient._core.closure import Closure
from psclient._core.scheduler import Scheduler


def make(name="fn"):
    return Closure(lambda: None, (), {}, Future(name))


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_fifo_and_running_state():
    s = Scheduler(num_workers=1)
    a, b = make("a"), make("b")
    s.submit(a)
    s.submit(b)
    assert s.take(0, timeout=0) is a
    assert a.future.running()
    assert not b.future.running()
    assert s.take(0, timeout=0) is b


def test_success_resolves_future_and_counts_latency():
    clock = FakeClock()
    s = Scheduler(num_workers=2, clock=clock)
    c = make()
    s.submit(c)
    taken = s.take(1, timeout=0)
    clock.now = 0.25
    s.succeeded(1, taken, {"loss": 1.5})
    assert c.future.result(timeout=0) == {"loss": 1.5}
    stats = s.stats()
    assert stats["workers"][1]["done"] == 1
    assert stats["workers"][1]["latency_mean_s"] == pytest.approx(0.25)
    assert stats["workers"][1]["latency_p99_s"] == pytest.approx(0.25)
    assert stats["unfinished"] == 0
    assert s.done()


def test_take_times_out_when_empty():
    s = Scheduler(num_workers=1)
    assert s.take(0, timeout=0.01) is None


def test_retry_goes_to_front_and_keeps_future_running():
    s = Scheduler(num_workers=2)
    a, b = make("a"), make("b")
    s.submit(a)
    s.submit(b)
    taken = s.take(0, timeout=0)
    s.failed(0, taken, ConnectionError("gone"), retry=True)
    again = s.take(1, timeout=0)
    assert again is a and a.attempts == 2
    assert a.future.running() and not a.future.done()
    assert s.stats()["workers"][0]["retried"] == 1


def test_function_error_cancels_queue_and_is_raised_once_by_join():
    s = Scheduler(num_workers=1)
    a, b, c = make("a"), make("b"), make("c")
    for x in (a, b, c):
        s.submit(x)
    taken = s.take(0, timeout=0)
    error = ValueError("boom")
    s.failed(0, taken, error, retry=False)
    assert a.future.exception(timeout=0) is error
    assert b.future.cancelled() and c.future.cancelled()
    with pytest.raises(concurrent.futures.CancelledError):
        b.future.result(timeout=0)
    with pytest.raises(ValueError, match="boom"):
        s.join(timeout=1)
    # Raised once; the scheduler is usable again.
    assert s.join(timeout=1)
    d = make("d")
    s.submit(d)
    s.succeeded(0, s.take(0, timeout=0), 1)
    assert d.future.result(timeout=0) == 1


def test_pending_error_is_raised_by_next_submit_and_not_scheduled():
    s = Scheduler(num_workers=1)
    a = make("a")
    s.submit(a)
    s.failed(0, s.take(0, timeout=0), KeyError("k"), retry=False)
    late = make("late")
    with pytest.raises(KeyError):
        s.submit(late)
    assert s.stats()["queue_depth"] == 0
    assert s.done()  # error already delivered


def test_done_raises_pending_error():
    s = Scheduler(num_workers=1)
    s.submit(make())
    s.failed(0, s.take(0, timeout=0), RuntimeError("x"), retry=False)
    with pytest.raises(RuntimeError):
        s.done()
    assert s.done() is True


def test_retried_closure_cancelled_by_a_later_error_gets_cancelled_error():
    s = Scheduler(num_workers=2)
    a, b = make("a"), make("b")
    s.submit(a)
    s.submit(b)
    ta = s.take(0, timeout=0)
    tb = s.take(1, timeout=0)
    s.failed(0, ta, ConnectionError(), retry=True)  # a back in the queue, RUNNING
    s.failed(1, tb, ValueError("bad"), retry=False)
    with pytest.raises(concurrent.futures.CancelledError):
        a.future.result(timeout=0)


def test_user_cancel_before_start_is_dropped_and_join_returns():
    s = Scheduler(num_workers=1)
    a = make()
    s.submit(a)
    assert a.future.cancel()
    assert s.join(timeout=1)
    assert s.take(0, timeout=0) is None


def test_down_worker_takes_nothing_until_up():
    s = Scheduler(num_workers=2)
    s.worker_lost(0)
    s.submit(make())
    assert s.take(0, timeout=0.01) is None
    got = []
    t = threading.Thread(target=lambda: got.append(s.take(0, timeout=5)))
    t.start()
    s.worker_up(0)
    t.join(5)
    assert got and got[0] is not None


def test_join_times_out_without_raising():
    s = Scheduler(num_workers=1)
    s.submit(make())
    assert s.join(timeout=0.01) is False


def test_close_cancels_queue_wakes_takers_and_rejects_submit():
    s = Scheduler(num_workers=1)
    first, queued = make("first"), make("queued")
    s.submit(first)
    s.submit(queued)
    assert s.take(0, timeout=0) is first
    s.take(0, timeout=0)  # 'queued' now running too; the queue is empty
    s.submit(waiting := make("waiting"))
    s.pause()  # so the taker below blocks instead of taking 'waiting'
    result = []
    t = threading.Thread(target=lambda: result.append(s.take(0)))
    t.start()
    cancelled = s.close()
    t.join(5)
    assert not t.is_alive() and result == [None]
    assert cancelled == [waiting] and waiting.future.cancelled()
    with pytest.raises(StrategyClosedError, match="shut down"):
        s.submit(make("late"))


def test_concurrent_submit_and_take_resolve_every_future_once():
    s = Scheduler(num_workers=4)
    n = 4000
    futures = []
    lock = threading.Lock()

    def producer():
        for _ in range(n // 4):
            c = make()
            with lock:
                futures.append(c.future)
            s.submit(c)

    def consumer(w):
        while True:
            c = s.take(w, timeout=2)
            if c is None:
                return
            s.succeeded(w, c, c.id)

    consumers = [threading.Thread(target=consumer, args=(w,)) for w in range(4)]
    producers = [threading.Thread(target=producer) for _ in range(4)]
    for t in consumers + producers:
        t.start()
    for t in producers:
        t.join(30)
    assert s.join(timeout=30)
    s.close()
    for t in consumers:
        t.join(30)
    assert len(futures) == n
    assert all(f.done() and not f.cancelled() for f in futures)
    assert sum(w["done"] for w in s.stats()["workers"]) == n


# ----------------------------------------------------------- fault tolerance
def test_worker_lost_requeues_its_running_closures_in_order_and_ignores_their_late_reports():
    s = Scheduler(num_workers=2)
    a, b, c = make("a"), make("b"), make("c")
    for closure in (a, b, c):
        s.submit(closure)
    taken_a = s.take(0, timeout=0)
    s.take(0, timeout=0)  # b, running beside a
    attempt_a = taken_a.attempts
    requeued = s.worker_lost(0, detected_after=1.5)
    assert requeued == [a, b]
    assert not s.worker_is_up(0)
    # The abandoned attempt answers late (a hung worker resumed): ignored.
    s.succeeded(0, taken_a, "stale", attempt=attempt_a)
    assert not a.future.done()
    # The re-run on worker 1 resolves it, once; order is kept (a, b, then c).
    assert s.take(1, timeout=0) is a
    s.succeeded(1, a, "fresh", attempt=a.attempts)
    assert a.future.result(timeout=0) == "fresh"
    assert s.take(1, timeout=0) is b
    stats = s.stats()
    assert stats["stale_reports"] == 1
    assert stats["workers"][0]["failures"] == 1
    assert stats["workers"][0]["last_detection_s"] == 1.5
    assert stats["workers"][0]["retried"] == 2
    assert stats["workers"][0]["in_flight"] == 0


def test_worker_up_counts_rejoins_and_recovery_time():
    s = Scheduler(num_workers=1)
    s.worker_lost(0)
    s.worker_up(0, recovered_after=0.7)
    s.worker_up(0, recovered_after=9.0)  # already up: not a rejoin
    stats = s.stats()["workers"][0]
    assert stats["rejoins"] == 1 and stats["last_recovery_s"] == 0.7


def test_running_counts_and_wait_released_returns_once_the_attempt_is_taken_away():
    s = Scheduler(num_workers=2)
    a = make("a")
    s.submit(a)
    taken = s.take(1, timeout=0)
    assert s.running() == 1
    assert not s.wait_released(1, taken, taken.attempts, timeout=0.01)
    requeuer = threading.Thread(target=s.worker_lost, args=(1,))
    requeuer.start()
    assert s.wait_released(1, taken, 1, timeout=10)  # taken out: requeued
    requeuer.join()
    assert s.running() == 0
    again = s.take(0, timeout=0)
    assert again is a and again.attempts == 2
    assert s.wait_released(1, a, 1, timeout=0)  # an older attempt is released
    s.close()
    assert s.wait_released(0, a, 2, timeout=0)  # closed


def test_pause_holds_work_and_wait_idle_waits_for_running_closures():
    s = Scheduler(num_workers=1)
    a, b = make("a"), make("b")
    s.submit(a)
    s.submit(b)
    taken = s.take(0, timeout=0)
    s.pause()
    assert s.take(0, timeout=0.01) is None
    assert not s.wait_idle(timeout=0.01)
    finisher = threading.Thread(target=s.succeeded, args=(0, taken, 1))
    finisher.start()
    assert s.wait_idle(timeout=5)
    finisher.join()
    s.resume()
    assert s.take(0, timeout=0) is b


def test_fail_all_resolves_queued_and_running_futures_and_join_raises():
    s = Scheduler(num_workers=1)
    a, b = make("a"), make("b")
    s.submit(a)
    s.submit(b)
    taken = s.take(0, timeout=0)
    error = RuntimeError("every worker is gone")
    assert s.fail_all(error) == 2
    assert a.future.exception(timeout=0) is error
    assert b.future.exception(timeout=0) is error
    s.succeeded(0, taken, "late")  # the abandoned attempt: ignored
    with pytest.raises(RuntimeError, match="every worker is gone"):
        s.join(timeout=1)
    assert s.fail_all(error) == 0
    assert s.join(timeout=1)  # nothing pending: no error set again


def test_requeue_running_abandons_every_running_attempt_but_keeps_workers_up():
    s = Scheduler(num_workers=2)
    a, b = make("a"), make("b")
    s.submit(a)
    s.submit(b)
    taken_b = s.take(1, timeout=0)  # a
    taken_a = s.take(0, timeout=0)  # b
    assert s.requeue_running() == [taken_b, taken_a]
    assert s.worker_is_up(0) and s.worker_is_up(1)
    s.failed(0, taken_a, RuntimeError("late"), retry=False)  # stale: ignored
    assert not b.future.done()
    assert s.queued() == [a, b]
    assert s.wait_idle(timeout=0)


# ------------------------------------------------------- wakeups ----------
def _takers(s, workers):
    taken = []

    def take(worker):
        closure = s.take(worker, timeout=30)
        if closure is not None:
            taken.append((worker, closure))

    threads = [threading.Thread(target=take, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    return threads, taken


def test_a_submit_wakes_one_waiting_dispatcher_and_a_completion_wakes_none():
    s = Scheduler(num_workers=50)
    threads, taken = _takers(s, range(50))
    wait_for(lambda: s.waiting_threads() == (50, 0), 10, "50 waiting dispatchers", interval=0.005)
    c = make()
    s.submit(c)
    wait_for(lambda: taken, 10, "a dispatcher to take the closure", interval=0.005)
    assert s.wakeups == 1
    worker, closure = taken[0]
    s.succeeded(worker, closure, "v")
    assert c.future.result(timeout=0) == "v"
    assert s.wakeups == 1  # the completion woke nobody
    assert s.waiting_threads() == (49, 0)  # the other 49 never left their wait
    s.close()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


def test_a_down_workers_dispatcher_is_never_woken_until_it_is_back():
    s = Scheduler(num_workers=2)
    s.worker_lost(0)
    threads, taken = _takers(s, [0])
    wait_for(lambda: s.waiting_threads() == (0, 1), 10, "worker 0's dispatcher parked", interval=0.005)
    s.submit(make("a"))
    assert s.wakeups == 0 and not taken  # nobody who can take it is waiting
    assert s.take(1, timeout=0).name == "a"
    s.submit(make("b"))
    s.worker_up(0)
    wait_for(lambda: taken, 10, "worker 0's dispatcher to take 'b'", interval=0.005)
    assert taken[0][0] == 0 and taken[0][1].name == "b"
    assert s.wakeups == 1
    for t in threads:
        t.join(10)


def test_wakeups_per_closure_stay_flat_with_many_idle_dispatchers():
    s = Scheduler(num_workers=200)
    stop = threading.Event()

    def dispatcher(worker):
        while not stop.is_set():
            closure = s.take(worker, timeout=30)
            if closure is None:
                return
            s.succeeded(worker, closure, None)

    threads = [threading.Thread(target=dispatcher, args=(w,)) for w in range(200)]
    for t in threads:
        t.start()
    wait_for(lambda: s.waiting_threads()[0] == 200, 10, "200 waiting dispatchers", interval=0.005)
    for _ in range(500):
        s.submit(make())
    assert s.join(timeout=60)
    # At most one wakeup per closure (a busy dispatcher takes queued work without one).
    assert s.wakeups <= 500
    assert s.completed() == 500 and s.running() == 0
    stop.set()
    s.close()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


def test_latency_summary_matches_a_sort_of_the_recent_window():
    import random

    from psclient._core.worker_stats import LATENCY_WINDOW, WorkerStats

    rng = random.Random(0)
    stats = WorkerStats()
    values = [rng.expovariate(10) for _ in range(LATENCY_WINDOW * 2 + 77)]
    for v in values:
        stats.record_latency(v)
    window = sorted(values[-LATENCY_WINDOW:])
    summary = stats.summary(in_flight=0)
    assert summary["latency_mean_s"] == pytest.approx(sum(window) / len(window), rel=1e-9)
    assert summary["latency_p99_s"] == window[int(0.99 * len(window))]


def test_running_attempts_end_once_and_count_late_reports_as_stale():
    attempts, a, b = RunningAttempts(2), make("a"), make("b")
    a.attempts = b.attempts = 1
    attempts.start(0, a)
    attempts.start(1, b)
    assert (attempts.total, attempts.on(0), attempts.busy_workers()) == (2, 1, [0, 1])
    assert attempts.end(0, a, attempt=1) and a.worker is None
    assert not attempts.end(0, a, attempt=1)  # reported twice: the second is stale
    assert attempts.abandon(1) == [b] and b.worker is None
    assert not attempts.end(1, b, attempt=1)  # abandoned (its worker was lost), then reported
    assert (attempts.total, attempts.stale, attempts.busy_workers()) == (0, 2, [])
