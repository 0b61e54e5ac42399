"""A fake of the engine's TensorFlow edge (`psclient._engine.edge.Edge`), for tests
of the real engine (scheduler, dispatcher, probes, recovery thread, elastic
workers) without TensorFlow. `FakeEdgeBase` holds what every fake edge answers
the same way; the benchmarks' simulated cluster (`benchmarks/_sim.py`) builds on
it too, with workers that hang, die and restart, and calls that take time.

A fake task is "up" (calls run, probes answer, TCP open) or "dead" (calls and
probes raise `UnavailableError`, named as TF's UnavailableError, which the
failure classification treats as a connection error; TCP refused).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from psclient._cluster.spec import Cluster
from psclient._core.closure import Closure
from psclient._engine.assembly import Engine
from psclient._engine.edge import Roster, StrategyParts
from psclient._engine.recovery import RecoveryConfig


class FakeOpError(Exception):
    """The fake's base of failed-op errors (TF's OpError)."""


class UnavailableError(FakeOpError):
    """What a call, probe or connect to a dead fake task raises."""

    error_code = 14  # TF's (and gRPC's) UNAVAILABLE


class FakeEdgeBase:
    """The `Edge` names every fake answers alike: TF's device names, no variables,
    no device scopes, outputs as they are. A subclass gives `tcp_state`, `probe`,
    `connect`, `disconnect` and the calls (`prepare`)."""

    @staticmethod
    def worker_device(index: int) -> str:
        return f"/job:worker/replica:0/task:{index}"

    @staticmethod
    def ps_device(index: int) -> str:
        return f"/job:ps/replica:0/task:{index}/device:CPU:0"

    def tcp_state(self, address: str, timeout: float) -> str:
        raise NotImplementedError

    def tcp_reachable(self, address: str, timeout: float) -> bool:
        return self.tcp_state(address, timeout) == "open"

    @staticmethod
    def check_handle(variable: Any) -> None:
        """No variables here: never asked."""

    @staticmethod
    def device_scope(device: str, worker: int):
        return contextlib.nullcontext()

    @staticmethod
    def cancellable_call():
        return contextlib.nullcontext(lambda: None)

    @staticmethod
    def own_executor():
        return contextlib.nullcontext()

    @staticmethod
    def function_not_registered_yet(error: BaseException) -> bool:
        return False

    @staticmethod
    def to_numpy(outputs: Any) -> Any:
        return outputs

    @staticmethod
    def name_error(error: BaseException, fn_name: str, where: str) -> BaseException:
        return error

    @staticmethod
    def op_error() -> type:
        return FakeOpError


class FakeEdge(FakeEdgeBase):
    """Fake tasks at "fake-<job><index>:1" and every `Edge` name over them."""

    def __init__(self, cluster: Cluster):
        self.state: dict[str, str] = {a: "up" for addresses in cluster.jobs.values() for a in addresses}
        self.cluster = cluster
        self.connects: list[tuple[int, ...]] = []
        self.disconnects = 0
        self.calls: list[int] = []
        self.connected = threading.Event()
        self._lock = threading.Lock()

    # ------------------------------------------------------------ the Edge
    def tcp_state(self, address: str, timeout: float) -> str:
        return "closed" if self.state.get(address, "dead") == "dead" else "open"

    def probe(self, device: str) -> None:
        job = "ps" if "/job:ps/" in device else "worker"
        index = int(device.split("/task:")[1].split("/")[0])
        self._answer(self.address(job, index))

    def connect(self, cluster: Cluster, workers: list[int]) -> None:
        for worker in workers:
            self._answer(cluster.address("worker", worker))
        with self._lock:
            self.cluster = cluster
            self.connects.append(tuple(workers))
        self.connected.set()

    def disconnect(self) -> None:
        self.disconnects += 1

    def connection_changes(self) -> int:
        """Two per connect and disconnect made (each began and ended)."""
        return 2 * (len(self.connects) + self.disconnects)

    # ------------------------------------------------- calls and the tasks
    def address(self, job: str, index: int) -> str:
        return self.cluster.address(job, index)

    def prepare(self, closure: Closure, worker: int) -> tuple:
        """The dispatcher's `prepare`: the closure's function, called as if on `worker`."""
        return self._on(worker, closure.fn), closure.args, closure.kwargs

    def _on(self, worker: int, fn):
        def call(*args, **kwargs):
            self._answer(self.address("worker", worker))
            with self._lock:
                self.calls.append(worker)
            return fn(*args, **kwargs)

        return call

    def add(self, address: str) -> None:
        """A new fake task at `address`, up."""
        self.state[address] = "up"

    def _answer(self, address: str) -> None:
        if self.state.get(address, "dead") == "dead":
            raise UnavailableError(f"{address} is gone (fake UnavailableError)")


class EmptyStore:
    """No variables: what recovery and the probes ask of the variable store."""

    def count(self) -> int:
        return 0

    def named(self) -> dict:
        return {}

    def renew(self, lost_ps) -> int:
        return 0

    def one_per_ps(self) -> dict:
        return {}

    def tables(self) -> dict:
        return {}


class NoPerWorker:
    """No per-worker values: what recovery rebuilds on a worker, and the dispatcher renews."""

    def generation(self, worker: int) -> int:
        return 0

    def renew_iterators(self, worker: int, seen_generation: int) -> int:
        return 0

    def endless(self, args, kwargs, worker: int) -> bool:
        return False

    def rebuild(self, worker, *, resources_only: bool) -> None:
        pass


def fake_engine(edge: FakeEdge, scheduler, *, hang_timeout: float = 2.0, interval: float = 0.1,
                pipeline_depth: int = 1, per_worker=None) -> Engine:
    """The real engine on `edge`, built as the strategy builds it (nothing started)."""
    return Engine(
        Roster(edge.cluster), edge=edge, scheduler=scheduler,
        recovery_config=RecoveryConfig(hang_timeout=hang_timeout, probe_timeout=min(10.0, hang_timeout),
                                       interval=interval),
        pipeline_depth=pipeline_depth, connect_timeout=hang_timeout,
        parts=StrategyParts(edge.prepare, EmptyStore(), per_worker or NoPerWorker()),
    )
