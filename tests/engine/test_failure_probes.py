"""`FailureProbes`' probe rounds with a real `Prober` and fake tasks (no TensorFlow): a task that
never answers is hung (asked once, its round bounded by probe_timeout), one that fails is asked
again, and `hung_ps` (shutdown's check) names the hung ones only."""

from __future__ import annotations

import threading
import time

import pytest

from psclient._cluster.spec import Cluster
from psclient._core.health import Prober
from psclient._core.scheduler import Scheduler
from psclient._engine.edge import Roster
from psclient._engine.probes import FailureProbes, Published

from _fake_edge import FakeEdgeBase, UnavailableError

PROBE_TIMEOUT = 0.3


class _Tasks:
    """run_probe for a Prober: "hung" devices block until released, "dead" ones raise, others answer."""

    def __init__(self, hung=(), dead=()):
        self.hung, self.dead = set(hung), set(dead)
        self.asked: dict[str, int] = {}
        self.release = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, device: str) -> None:
        with self._lock:
            self.asked[device] = self.asked.get(device, 0) + 1
        if device in self.hung:
            assert self.release.wait(30), "the test never released a hung probe"
            raise UnavailableError("was hung")
        if device in self.dead:
            raise UnavailableError(f"{device} is gone")


@pytest.fixture
def probes_of():
    made = []

    def make(tasks: _Tasks, num_ps: int = 3, num_workers: int = 2) -> FailureProbes:
        cluster = Cluster({"worker": [f"127.0.0.1:{2000 + w}" for w in range(num_workers)],
                           "ps": [f"127.0.0.1:{3000 + p}" for p in range(num_ps)]})
        prober = Prober(tasks, threads=4)
        made.append((prober, tasks))
        return FailureProbes(Roster(cluster), prober, Scheduler(num_workers), Published(num_workers),
                             PROBE_TIMEOUT, FakeEdgeBase())

    yield make
    for prober, tasks in made:
        tasks.release.set()
        assert prober.close(timeout=10) == []


def test_hung_ps_names_the_silent_ps_only_within_one_probe_timeout(probes_of):
    tasks = _Tasks(hung={"/job:ps/replica:0/task:1"}, dead={"/job:ps/replica:0/task:2"})
    probes = probes_of(tasks)
    started = time.monotonic()
    assert probes.hung_ps() == (1,)  # ps 2 fails at once: gone, not hung
    assert time.monotonic() - started < PROBE_TIMEOUT + 2.0
    assert tasks.asked["/job:ps/replica:0/task:1"] == 1


def test_lost_ps_asks_a_failing_ps_again_but_a_hung_one_once(probes_of):
    tasks = _Tasks(hung={"/job:ps/replica:0/task:0"}, dead={"/job:ps/replica:0/task:2"})
    probes = probes_of(tasks)
    assert probes.lost_ps() == (0, 2)
    assert tasks.asked["/job:ps/replica:0/task:0"] == 1  # timed out: not asked again
    assert tasks.asked["/job:ps/replica:0/task:2"] == 3  # failed: asked in each of the 3 rounds
    assert tasks.asked["/job:ps/replica:0/task:1"] == 1  # answered the first round


def test_a_ps_that_fails_once_and_then_answers_is_not_lost(probes_of):
    class FlakyOnce(_Tasks):
        def __call__(self, device):
            first = device not in self.asked
            super().__call__(device)
            if first and device.endswith("task:1"):
                raise UnavailableError("a healthy task's call failed right after another died")

    tasks = FlakyOnce()
    probes = probes_of(tasks)
    assert probes.lost_ps() == ()
    assert tasks.asked["/job:ps/replica:0/task:1"] == 2
