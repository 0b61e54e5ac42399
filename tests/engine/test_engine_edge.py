"""The engine (`psclient._engine`) against a fake TensorFlow edge: no TensorFlow.

The real scheduler, dispatcher threads, failure probes, recovery thread and
elastic workers, built as the strategy builds them (`Engine`), with every
TensorFlow call going to `_fake_edge.FakeEdge`. Waits are on futures and
events with generous limits, never fixed sleeps.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
from _fake_edge import FakeEdge, fake_engine
from _polling import wait_for

from psclient._cluster.spec import Cluster
from psclient._core.closure import Closure
from psclient._core.future import Future
from psclient._core.scheduler import Scheduler
from psclient._engine import lifecycle

LIMIT = 60.0


@pytest.fixture
def running():
    """A started engine on two fake workers and one fake ps; stopped (and checked stopped) after."""
    edge = FakeEdge(Cluster({"worker": ["fake-worker0:1", "fake-worker1:1"], "ps": ["fake-ps0:1"]}))
    scheduler = Scheduler(2)
    engine = fake_engine(edge, scheduler)
    engine.start_dispatch()
    engine.start_recovery()
    yield edge, engine
    lifecycle.shutdown_quietly(scheduler, engine.dispatcher, engine.recovery, engine.prober, edge, 10.0, engine.probes)
    assert engine.dispatcher.alive_threads == 0
    assert edge.disconnects == 1  # nothing hung: TF's view is left


def submit(engine, fn, *args) -> Future:
    closure = Closure(fn, args, {}, Future(getattr(fn, "__name__", "fn")))
    engine.scheduler.submit(closure)
    return closure.future


def double(x):
    return 2 * x


def test_closures_run_on_the_workers_and_resolve_once(running):
    edge, engine = running
    futures = [submit(engine, double, i) for i in range(20)]
    assert [f.result(timeout=LIMIT) for f in futures] == [2 * i for i in range(20)]
    assert set(edge.calls) <= {0, 1} and len(edge.calls) == 20


def test_a_dead_workers_closures_run_elsewhere_and_it_rejoins_once_back(running):
    edge, engine = running
    edge.state["fake-worker1:1"] = "dead"
    futures = [submit(engine, double, i) for i in range(10)]
    assert [f.result(timeout=LIMIT) for f in futures] == [2 * i for i in range(10)]
    wait_for(lambda: not engine.scheduler.stats()["workers"][1]["up"], LIMIT, "worker 1 taken out")
    edge.state["fake-worker1:1"] = "up"  # restarted: the recovery thread reconnects it
    wait_for(lambda: engine.scheduler.stats()["workers"][1]["up"], LIMIT, "worker 1 back")
    assert any(1 in workers for workers in edge.connects)
    assert submit(engine, double, 21).result(timeout=LIMIT) == 42


def test_an_added_worker_joins_through_the_edge_and_a_removed_one_leaves(running):
    edge, engine = running
    edge.add("fake-worker2:1")
    assert engine.elastic.add_worker("fake-worker2:1", timeout=LIMIT) == 2
    assert engine.roster.cluster.workers[2] == "fake-worker2:1"  # every part reads the grown cluster
    assert engine.elastic.workers == {0: "fake-worker0:1", 1: "fake-worker1:1", 2: "fake-worker2:1"}
    assert 2 in edge.connects[-1]  # the reconnect named it
    engine.elastic.remove_worker(0, drain=True, timeout=LIMIT)
    assert 0 not in edge.connects[-1] and engine.elastic.workers.keys() == {1, 2}
    futures = [submit(engine, double, i) for i in range(10)]
    assert [f.result(timeout=LIMIT) for f in futures] == [2 * i for i in range(10)]
    assert 0 not in edge.calls[-10:]


def test_adding_an_address_nothing_serves_names_it():
    from psclient._core.errors import TaskUnreachableError

    edge = FakeEdge(Cluster({"worker": ["fake-worker0:1"], "ps": ["fake-ps0:1"]}))
    engine = fake_engine(edge, Scheduler(1), hang_timeout=0.5)  # connect_timeout: 0.5 s
    with pytest.raises(TaskUnreachableError, match="fake-worker9:1"):
        engine.elastic.add_worker("fake-worker9:1")


def test_the_real_edge_and_the_fakes_provide_every_name_of_the_protocol():
    import inspect

    from psclient._coordinator.engine_edge import TFEdge
    from psclient._engine.edge import Edge

    names = {n for n, v in vars(Edge).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert {"connect", "disconnect", "probe", "tcp_state", "worker_device"} <= names
    for edge in (TFEdge, FakeEdge):
        missing = sorted(n for n in names if not callable(getattr(edge, n, None)))
        assert not missing, f"{edge.__name__} lacks {missing}"
    # The real edge binds the strategy's choice; the engine passes only the cluster and workers.
    assert list(inspect.signature(TFEdge.connect).parameters)[:3] == ["self", "cluster", "workers"]


def test_a_coordinator_read_of_a_lost_ps_without_checkpoints_reports_it_and_raises_ps_unavailable(running):
    # The engine's side of psclient._core.ps_access: the read's error is classified with the
    # failure probes, the lost ps reported to the real recovery thread, whose give-up (no
    # checkpoint to restore from) wakes the wait at once.
    from _fake_edge import UnavailableError

    from psclient._core.errors import PSUnavailableError

    edge, engine = running
    edge.state["fake-ps0:1"] = "dead"

    def read():
        edge.probe("/job:ps/replica:0/task:0/device:CPU:0")  # a read of a ps variable: the ps is gone
        return "value"

    with pytest.raises(PSUnavailableError, match="reading x on the coordinator failed.*checkpoint") as info:
        engine.coordinator_access.run(read, "reading x")
    assert isinstance(info.value.__cause__, UnavailableError)
    assert engine.recovery.ps_stats[0].failures == 1
    assert engine.recovery.stopped  # given up for good: the next access raises at once
    with pytest.raises(PSUnavailableError):
        engine.coordinator_access.run(read, "reading x")


def test_a_coordinator_access_that_fails_with_an_error_raised_from_tfs_counts_as_tfs(running):
    # A checkpoint a lost ps could not write raises CheckpointWriteError from TF's error: the
    # ps is reported all the same (here the recovery gives up: no checkpoint to restore from).
    from _fake_edge import UnavailableError

    from psclient._core.errors import PSUnavailableError

    edge, engine = running
    edge.state["fake-ps0:1"] = "dead"

    def save():
        try:
            edge.probe("/job:ps/replica:0/task:0/device:CPU:0")
        except UnavailableError as error:
            raise OSError("ps:0 could not write its part of the checkpoint") from error

    with pytest.raises(PSUnavailableError, match="saving on the coordinator failed"):
        engine.coordinator_access.run(save, "saving")
    assert engine.recovery.ps_stats[0].failures == 1
    with pytest.raises(ValueError, match="own"):  # not caused by TF's: raised unchanged
        engine.coordinator_access.run(lambda: (_ for _ in ()).throw(ValueError("own")), "x")


class OutOfRangeError(Exception):
    """Named as TF's: what a dataset iterator raises at its end."""


class _Iterators:
    """Per-worker iterators over datasets that never end (`endless`), or that do."""

    def __init__(self, endless: bool):
        self._endless = endless
        self.renewed: list[int] = []
        self.broken = True

    def generation(self, worker: int) -> int:
        return len(self.renewed)

    def renew_iterators(self, worker: int, seen_generation: int) -> int:
        self.renewed.append(worker)
        self.broken = False
        return 1

    def endless(self, args, kwargs, worker: int) -> bool:
        return self._endless

    def rebuild(self, worker, *, resources_only: bool) -> None:
        pass


@pytest.mark.parametrize("endless", [True, False], ids=["endless dataset", "finite dataset"])
def test_the_end_of_an_endless_dataset_is_a_broken_iterator_made_again(endless):
    # A repeat() whose next pass was being made when a call was cancelled keeps
    # saying "End of sequence": for a dataset that never ends, that is a broken
    # iterator, made again and the closure run again; for one that ends, the
    # end reaches the future as the function's own error.
    edge = FakeEdge(Cluster({"worker": ["fake-worker0:1"], "ps": ["fake-ps0:1"]}))
    iterators = _Iterators(endless)
    scheduler = Scheduler(1)
    engine = fake_engine(edge, scheduler, per_worker=iterators)
    engine.start_dispatch()
    engine.start_recovery()
    try:
        def step(x):
            if iterators.broken:
                raise OutOfRangeError("End of sequence\n\t [[{{node IteratorGetNext}}]]")
            return x + 1

        future = submit(engine, step, 1)
        if endless:
            assert future.result(timeout=LIMIT) == 2
            assert iterators.renewed == [0]
        else:
            with pytest.raises(OutOfRangeError):
                future.result(timeout=LIMIT)
            assert iterators.renewed == []
    finally:
        lifecycle.shutdown_quietly(scheduler, engine.dispatcher, engine.recovery, engine.prober, edge, 10.0, engine.probes)


def test_the_recoverys_steps_run_inside_the_edges_own_executor(running):
    """A reconnect (TF's `update_server_def`) waits for every op on TF's shared default executor:
    the recovery thread's steps go through one of its own (`Edge.own_executor`)."""
    edge, engine = running
    inside = threading.local()
    reconnects_inside = []

    @contextlib.contextmanager
    def own_executor():
        inside.on = True
        try:
            yield
        finally:
            inside.on = False

    stock_connect = edge.connect

    def connect(cluster, workers):
        reconnects_inside.append(getattr(inside, "on", False))
        stock_connect(cluster, workers)

    edge.own_executor, edge.connect = own_executor, connect
    edge.state["fake-worker1:1"] = "dead"
    futures = [submit(engine, double, i) for i in range(6)]
    assert [f.result(timeout=LIMIT) for f in futures] == [2 * i for i in range(6)]
    wait_for(lambda: not engine.scheduler.stats()["workers"][1]["up"], LIMIT, "worker 1 taken out")
    edge.state["fake-worker1:1"] = "up"
    wait_for(lambda: engine.scheduler.stats()["workers"][1]["up"], LIMIT, "worker 1 back")
    assert reconnects_inside and all(reconnects_inside)
