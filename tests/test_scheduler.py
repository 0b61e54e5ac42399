"""The closure queue and its bookkeeping, without a cluster."""

import concurrent.futures
import threading

import pytest

from psclient._errors import StrategyClosedError
from psclient._future import Future
from psclient._scheduler import Closure, Scheduler


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
    s.worker_down(0)
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
    s.worker_down(0)  # so the taker below blocks instead of taking 'waiting'
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
