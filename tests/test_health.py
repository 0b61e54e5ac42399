"""Health monitor decisions and probes, with fakes and a fake clock (no cluster)."""

import threading

from psclient._core.health import HealthConfig, HealthMonitor, Prober


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class World:
    """Two workers; probes of worker 1 never answer unless released."""

    def __init__(self, clock):
        self.clock = clock
        self.up = [True, True]
        self.reachable = [True, True]
        self.release = threading.Event()
        self.events = []
        self.prober = Prober(self.run_probe, clock=clock)

    def run_probe(self, device):
        if device == "w1":
            self.release.wait(10)

    def monitor(self, **config):
        return HealthMonitor(
            HealthConfig(**config),
            num_workers=2,
            worker_device=lambda w: f"w{w}",
            prober=self.prober,
            is_up=lambda w: self.up[w],
            reachable=lambda w: self.reachable[w],
            on_hung=lambda w, waited: self.events.append(("hung", w, waited)) or self.down(w),
            try_rejoin=lambda w, since: self.events.append(("rejoin", w, since)) or self.bring_up(w),
            all_down_since=lambda: None if any(self.up) else 0.0,
            on_all_gone=lambda waited: self.events.append(("gone", waited)),
            clock=self.clock,
        )

    def down(self, worker):
        self.up[worker] = False

    def bring_up(self, worker):
        self.up[worker] = True
        return True


def test_a_probe_unanswered_for_hang_timeout_declares_the_worker_hung_then_it_rejoins():
    clock = FakeClock()
    world = World(clock)
    monitor = world.monitor(hang_timeout=5.0)
    monitor.tick()  # starts the heartbeat probes
    assert world.prober.answers("w0", timeout=5)
    clock.now = 4.9
    monitor.tick()
    assert world.events == []
    clock.now = 5.0
    monitor.tick()
    assert world.events == [("hung", 1, 5.0)]
    # Still hung: no rejoin while its probe has not come back.
    clock.now = 6.0
    monitor.tick()
    assert [e for e in world.events if e[0] == "rejoin"] == []
    world.release.set()  # SIGCONT
    assert world.prober.answers("w1", timeout=5)
    clock.now = 7.0
    monitor.tick()
    assert world.events[-1] == ("rejoin", 1, 7.0)
    assert world.up == [True, True]
    assert world.prober.close(timeout=5) == []


def test_an_unreachable_down_worker_is_not_rejoined():
    clock = FakeClock()
    world = World(clock)
    world.release.set()
    world.up[0] = False
    world.reachable[0] = False
    monitor = world.monitor()
    monitor.tick()
    assert world.events == []
    world.reachable[0] = True
    monitor.tick()
    assert world.events == [("rejoin", 0, 0.0)]
    world.prober.close(timeout=5)


def test_every_worker_gone_longer_than_worker_timeout_fails_work_each_round():
    clock = FakeClock()
    world = World(clock)
    world.release.set()
    world.up = [False, False]
    world.reachable = [False, False]
    monitor = world.monitor(worker_timeout=30.0)
    clock.now = 29.0
    monitor.tick()
    assert world.events == []
    clock.now = 30.0
    monitor.tick()
    clock.now = 31.0
    monitor.tick()
    assert world.events == [("gone", 30.0), ("gone", 31.0)]


def test_monitor_thread_stops_and_joins():
    clock = FakeClock()
    world = World(clock)
    world.release.set()
    monitor = world.monitor(interval=0.01)
    monitor.start()
    monitor.stop(timeout=5)
    assert not monitor._thread.is_alive()
    assert world.prober.close(timeout=5) == []
