"""What the engine asks of TensorFlow: the `Edge` protocol.

The engine (dispatch, recovery, probes, elastic workers, lifecycle) decides
and orders; every TensorFlow call it needs goes through one object with these
names, given to each part at construction. The strategy gives the real one
(`psclient._coordinator.engine_edge.TFEdge`); `benchmarks/_sim.py` and
`tests/_fake_edge.py` give fakes, so the real scheduler, dispatcher, probes,
recovery thread and elastic workers run without TensorFlow.

Closures' calls themselves go through the `prepare` callable given to the
dispatcher (tracing is the strategy's). The TensorFlow-side parts the engine
is given are named here too, by what it uses of them: the variables
(`VariableStore`), the per-worker values (`PerWorkerValues`) and the
checkpoints (`CheckpointStore`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, ContextManager, Protocol

from psclient._cluster.spec import Cluster
from psclient._core.tcp_state import TcpState

__all__ = ["CheckpointStore", "Edge", "PerWorkerValues", "Roster", "VariableStore"]


class Edge(Protocol):
    """Every TensorFlow operation the engine uses (see the module docstring)."""

    def worker_device(self, index: int) -> str:
        """The device name of worker `index` (TF's "/job:worker/replica:0/task:N")."""

    def ps_device(self, index: int) -> str:
        """The device name of ps task `index`'s CPU."""

    def tcp_state(self, address: str, timeout: float) -> TcpState:
        """What a TCP connect to "host:port" gets within `timeout`: `TcpState.OPEN`, CLOSED
        (refused: the process is gone) or SILENT (no answer at all)."""

    def tcp_reachable(self, address: str, timeout: float) -> bool:
        """Whether something accepts TCP connections at `address`."""

    def probe(self, device: str) -> None:
        """One round trip to the task of `device`; raises what TF raises when it does not answer."""

    def check_handle(self, variable: Any) -> None:
        """Raises if `variable`'s ps task no longer holds its resource (it restarted)."""

    def device_scope(self, device: str, worker: int) -> ContextManager:
        """Where a dispatcher thread calls a closure's function for `worker`."""

    def cancellable_call(self) -> ContextManager:
        """A call that another thread may cancel: entering gives its `cancel()`."""

    def own_executor(self) -> ContextManager:
        """Inside, this thread's TF ops go through an executor of its own, not TF's default one that
        every thread shares (and that a reconnect waits for: the recovery's steps run inside)."""

    def function_not_registered_yet(self, error: BaseException) -> bool:
        """Whether `error` says the function's registration has not reached the worker yet."""

    def to_numpy(self, outputs: Any) -> Any:
        """A call's outputs copied to the coordinator as numpy values."""

    def name_error(self, error: BaseException, fn_name: str, where: str) -> BaseException:
        """`error` of a scheduled function, its message naming the function and where it ran."""

    def op_error(self) -> type:
        """The base class of TF's op errors (what a failed call or connect raises)."""

    def connect(self, cluster: Cluster, workers: list[int]) -> None:
        """(Re)connect to `cluster` with only `workers` in TF's view (the others are down)."""

    def disconnect(self) -> None:
        """Leave TF's view of the cluster (the coordinator alone again)."""

    def connection_changes(self) -> int:
        """How many changes of TF's view of the cluster began or ended in this process so far."""


class VariableStore(Protocol):
    """What the recovery thread and the probes use of the strategy's variables (`stores.VariableStore`)."""

    def count(self) -> int:
        """Variables created so far."""

    def named(self) -> dict[str, Any]:
        """Live variables by their checkpoint key."""

    def renew(self, lost_ps: set) -> int:
        """New resources for the variables on the lost ps tasks; how many."""

    def one_per_ps(self) -> dict[int, Any]:
        """A live variable on each ps task that holds any."""

    def tables(self) -> dict[str, Any]:
        """Live dynamic tables by their checkpoint key (saved and restored beside the variables)."""


class PerWorkerValues(Protocol):
    """What the engine uses of the per-worker datasets, iterators and resources (`stores.PerWorkerRegistry`)."""

    def generation(self, worker: int) -> int:
        """Changes each time `worker`'s iterators are renewed."""

    def renew_iterators(self, worker: int, seen_generation: int) -> int:
        """Make `worker`'s iterators again, unless renewed since `seen_generation`."""

    def endless(self, args: tuple, kwargs: dict, worker: int) -> bool:
        """Whether a closure's `args`/`kwargs` read only datasets that never end, on `worker`."""

    def rebuild(self, worker: int | None, *, resources_only: bool) -> None:
        """Build the per-worker values of `worker` (every worker: None) again."""


class CheckpointStore(Protocol):
    """What the recovery thread uses of the checkpoint directory (`checkpoint.Checkpoints`)."""

    def latest(self) -> str | None:
        """This run's newest checkpoint, or None."""

    def check_writable(self) -> None:
        """Raise FileExistsError if the directory holds another run's checkpoints."""

    def prepare(self, variables: dict[str, Any], tables: dict | None = None,
                stop: Callable[[], bool] | None = None) -> Any:
        """Before a cut, training going on (a thread of its own; `stop()` ends it early): copies of
        what a `snapshot` then reads only in part, for `use_prepared`."""

    def use_prepared(self, prepared: Any) -> None:
        """The next `snapshot` takes `prepare`'s copies (None: none)."""

    def discard_prepared(self) -> None:
        """The cut `prepare` was for is not taken: drop its copies."""

    def snapshot(self, variables: dict[str, Any], completed: int | None, *, meta: dict | None = None,
                 tables: dict | None = None, delta: bool = False) -> Any:
        """Take a checkpoint of `variables` (and `tables`, with `meta` beside) in a cut: each ps holds its
        snapshot. `delta`: written as what changed since the previous checkpoint, when it can be."""

    def write_in_background(self, pending: Any, on_done: Callable) -> None:
        """Write a snapshot on the store's writer thread; `on_done(pending, path, error)` hears the outcome."""

    def close(self, timeout: float | None = None) -> bool:
        """Join the write in flight."""

    def restore(self, variables: dict[str, Any], *, adopt: bool = False, tables: dict | None = None,
                only_ps: frozenset | None = None) -> dict | None:
        """Assign every variable (those on the `only_ps` tasks only, if given) its newest
        checkpointed value; None if there is no checkpoint."""


@dataclasses.dataclass(frozen=True)
class StrategyParts:
    """What a strategy hands its engine besides the `Edge` (the protocols above say what is used of each).

    `prepare(closure, worker)` -> (function, args, kwargs) for that worker; `store`: the variables;
    `per_worker`: rebuilt on a worker that comes back; `checkpoints`: the checkpoint directory, or
    None; `retrace()`: trace what is queued again (after variables got new resources);
    `checkpoint_meta(variables)`: what joins each checkpoint's layout (the data ledgers);
    `meta_restored(meta)`: told the meta of the checkpoint a lost ps was restored from;
    `renew_trace(closure)`: trace the closure's function anew under a new name (its registration on
    a worker was lost: TF sends a function only once), False when it cannot (a concrete function).
    """

    prepare: Callable[[Any, int], tuple]
    store: "VariableStore"
    per_worker: "PerWorkerValues"
    checkpoints: "CheckpointStore | None" = None
    retrace: Callable[[], None] | None = None
    checkpoint_meta: Callable[[dict], "dict | None"] | None = None
    meta_restored: Callable[["dict | None"], None] | None = None
    renew_trace: Callable[[Any], bool] | None = None


class Roster:
    """The cluster as it is now: elastic workers grow it, everyone else reads it.

    Its workers are every worker slot, removed ones included (a slot and its
    address never move). One object shared at construction by the parts that
    name tasks (recovery, probes, checkpoints' messages), so a worker added
    later is seen by all of them at once.
    """

    def __init__(self, cluster: Cluster):
        self._cluster = cluster
        self._lock = threading.Lock()

    @property
    def cluster(self) -> Cluster:
        return self._cluster

    def address(self, job: str, index: int) -> str:
        return self._cluster.address(job, index)

    def grow(self, address: str) -> int:
        """One more worker slot at `address`; returns its index."""
        with self._lock:
            jobs = self._cluster.jobs
            jobs["worker"].append(address)
            self._cluster = Cluster(jobs)
            return self._cluster.num_workers - 1
