"""`WorkerWatcher`: a strategy's workers kept equal to a watched source's.

The counterpart of `Cluster.from_env()` for a cluster that changes: a
TF_CONFIG-style JSON file that an operator (or a script) rewrites, or any
callable that returns the worker addresses (`kubernetes_workers` lists a
job's ready worker pods). Every `interval` seconds the watcher reads the
source and calls `strategy.add_worker` for each address that appeared and
`strategy.remove_worker` for each worker whose address vanished (new ones
first, so the strategy is never left without a worker).

A source that cannot be read or says something impossible (no such file,
half-written JSON, a bad address, ps tasks other than the strategy's) is
logged once, as an error naming the file and the problem, and changes
nothing: the previous workers stay until the source is right again. An add
or remove that fails (the new worker does not answer yet) is logged and
tried again at the next poll. The source is the truth: a worker removed by
hand but still in the file comes back.

The thread holds the strategy weakly and ends with it (shutdown or
collected), or with `stop()`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from psclient._cluster.spec import Cluster
from psclient._core.checks import check_positive
from psclient._core.errors import ClusterConfigError, StrategyClosedError, TaskUnreachableError

__all__ = ["WorkerWatcher"]

log = logging.getLogger("psclient")


class WorkerWatcher:
    """Keeps `strategy`'s workers equal to those `source` names (module docstring).

    Args:
        strategy: a `ParameterServerStrategy`.
        source: the path of a JSON cluster file (its "worker" job is the
            wanted set; its "ps" tasks must be the strategy's), or a callable
            returning the wanted worker addresses.
        interval: seconds between polls.
        drain: passed to `remove_worker` for workers that vanish.

    `start()` runs the polls in a thread until `stop()`; `poll()` runs one
    on the caller's thread. Also a context manager (start, then stop and join).
    """

    def __init__(self, strategy: Any, source: str | os.PathLike | Callable[[], Iterable[str]], *,
                 interval: float = 1.0, drain: bool = True):
        check_positive("interval", interval, unit="seconds")
        if not isinstance(drain, bool):
            raise TypeError(f"Invalid value for argument `drain`. Received: drain={drain!r}. "
                            "Expected True or False.")
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            self._read: Callable[[], list[str]] = lambda: self._file_workers(path)
            self._name = f"cluster file {path!r}"
        elif callable(source):
            self._read = lambda: list(source())
            self._name = f"worker source {getattr(source, '__name__', source)!r}"
        else:
            raise TypeError(
                f"Invalid value for argument `source`. Received: source={source!r} of type "
                f"{type(source).__name__}. Expected a path to a JSON cluster file or a callable "
                "returning worker addresses.")
        self._strategy = weakref.ref(strategy)
        self._ps = strategy.cluster.ps
        self._interval = float(interval)
        self._drain = drain
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one poll at a time
        #: The problem the last poll met (None after a clean one).
        self.last_error: str | None = None
        #: Every change made: (monotonic time, "added" or "removed", index, address).
        self.changes: list[tuple[float, str, int, str]] = []

    def _file_workers(self, path: str) -> list[str]:
        cluster = Cluster.from_file(path)
        if cluster.ps != self._ps:
            raise ClusterConfigError(
                f"cluster file {path!r} names the ps tasks {list(cluster.ps)}, but the strategy's "
                f"are {list(self._ps)}: ps tasks cannot change while training. Expected the same "
                "ps tasks; its workers were not applied.")
        return list(cluster.workers)

    # ------------------------------------------------------------ the thread
    def start(self) -> WorkerWatcher:
        if self._thread is not None:
            raise RuntimeError("This WorkerWatcher was started already; create another one.")
        self._thread = threading.Thread(target=self._run, name="psclient-worker-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the thread to end (after the add or remove it may be inside)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; False if it still runs after `timeout`."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self._interval)

    def __enter__(self) -> WorkerWatcher:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()
        self.join()

    # -------------------------------------------------------------- a poll
    def poll(self) -> dict:
        """Read the source once and add and remove workers to match it.

        Returns {"added": [index...], "removed": [index...], "error": str or None}.
        """
        with self._lock:
            result: dict = {"added": [], "removed": [], "error": None}
            strategy = self._strategy()
            if strategy is None or strategy.closed:
                self._stop.set()  # the strategy is gone: so is the watcher's purpose
                return result
            try:
                wanted = self._wanted()
            except ClusterConfigError as e:
                return self._failed(result, str(e))
            problems = []
            current = strategy.workers
            try:
                for address in [a for a in wanted if a not in current.values()]:
                    try:
                        index = strategy.add_worker(address)
                    except (TaskUnreachableError, TimeoutError, ValueError) as e:
                        problems.append(f"adding {address}: {e}")
                        continue
                    result["added"].append(index)
                    self.changes.append((time.monotonic(), "added", index, address))
                for index, address in current.items():
                    if address in wanted:
                        continue
                    try:
                        strategy.remove_worker(index, drain=self._drain)
                    except (TimeoutError, ValueError) as e:
                        problems.append(f"removing worker {index} ({address}): {e}")
                        continue
                    result["removed"].append(index)
                    self.changes.append((time.monotonic(), "removed", index, address))
            except StrategyClosedError:
                self._stop.set()
                return result
            if problems:
                return self._failed(result, f"{self._name}: " + "; ".join(problems))
            self.last_error = None
            return result

    def _wanted(self) -> list[str]:
        try:
            wanted = self._read()
        except ClusterConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a user's source failing must not end the watcher: logged, kept
            raise ClusterConfigError(f"{self._name} failed: {type(e).__name__}: {e}") from e
        bad = [a for a in wanted if not isinstance(a, str)]
        if bad or len(set(wanted)) != len(wanted):
            raise ClusterConfigError(
                f"{self._name} returned {wanted!r}. Expected distinct 'host:port' strings.")
        if not wanted:
            raise ClusterConfigError(f"{self._name} names no worker. Expected at least one.")
        return wanted

    def _failed(self, result: dict, message: str) -> dict:
        if message != self.last_error:  # once per problem, not once per poll
            log.error("worker watcher: %s (the workers stay as they are)", message)
        self.last_error = result["error"] = message
        return result
