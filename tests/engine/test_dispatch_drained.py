"""The dispatcher tells the recovery thread when a checkpoint's pause has drained.

Under a paused dispatch (a checkpoint waits for the closures already running)
the closure that ends last posts `Drained`, so the checkpoint goes on at once
instead of at the recovery thread's next 20 ms round. Real scheduler and
dispatcher threads, fake edge (no TensorFlow).
"""

from __future__ import annotations

import threading

from _fake_edge import FakeEdge, NoPerWorker
from _polling import wait_for

from psclient._cluster.spec import Cluster
from psclient._core.closure import Closure
from psclient._core.future import Future
from psclient._core.recovery_messages import Drained
from psclient._core.scheduler import Scheduler
from psclient._engine import lifecycle
from psclient._engine.dispatch import Dispatcher

LIMIT = 60.0


def test_the_closure_that_ends_last_under_a_pause_posts_drained_and_no_other_does():
    edge = FakeEdge(Cluster({"worker": ["fake-worker0:1", "fake-worker1:1"], "ps": ["fake-ps0:1"]}))
    scheduler = Scheduler(2)
    reports: list = []
    dispatcher = Dispatcher(scheduler, num_workers=2, pipeline_depth=1, prepare=edge.prepare, probes=None,
                            report=reports.append, release_timeout=5.0, iterators=NoPerWorker(), edge=edge)
    releases = [threading.Event(), threading.Event()]

    def held(index):
        assert releases[index].wait(LIMIT)
        return index

    def submit(fn, *args) -> Future:
        closure = Closure(fn, args, {}, Future(fn.__name__))
        scheduler.submit(closure)
        return closure.future

    dispatcher.start()
    try:
        futures = [submit(held, 0), submit(held, 1)]
        wait_for(lambda: scheduler.running() == 2, LIMIT, "both closures running")
        scheduler.pause()  # what a checkpoint does first
        releases[0].set()
        assert futures[0].result(timeout=LIMIT) == 0
        releases[1].set()
        assert futures[1].result(timeout=LIMIT) == 1
        wait_for(lambda: reports, LIMIT, "a Drained report")
        scheduler.resume()
        # Unpaused, a closure's end tells nothing.
        assert submit(held, 0).result(timeout=LIMIT) == 0
        assert [type(r) for r in reports] == [Drained], reports
    finally:
        for release in releases:
            release.set()
        lifecycle.stop_dispatch(scheduler, dispatcher, 10.0)
    assert dispatcher.alive_threads == 0
