"""The strategy connected in this process, and hooks run when a scope opens.

TensorFlow keeps one eager cluster connection per process, so at most one
strategy is connected at a time. The registry holds it by weak reference only:
a forgotten strategy is collected (its finalizer shuts it down) and never
blocks the next one.

A `LocalCluster` closing shuts down the strategy connected to its tasks first
(`closing.before_close`): left connected, TF's view would name tasks that are gone,
every later `tf.function` in the process would log errors about them, and no
next strategy could connect until this one's `shutdown()`.

Scope hooks let a layer above the coordinator (the Keras integration) install
itself when `strategy.scope()` is entered, without the coordinator importing
it: `psclient/__init__.py` registers the hook.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from psclient._cluster import closing
from psclient._cluster.spec import Cluster

__all__ = ["add_scope_hook", "run_scope_hooks", "current", "claim", "release"]

_lock = threading.Lock()
_active: "weakref.ref | None" = None
_scope_hooks: list[Callable[[], None]] = []


def add_scope_hook(hook: Callable[[], None]) -> None:
    """Call `hook()` each time a strategy's scope is entered (hooks are idempotent)."""
    with _lock:
        if hook not in _scope_hooks:
            _scope_hooks.append(hook)


def run_scope_hooks() -> None:
    with _lock:
        hooks = list(_scope_hooks)
    for hook in hooks:
        hook()


def current() -> Any | None:
    """The connected strategy, or None."""
    ref = _active
    strategy = ref() if ref is not None else None
    if strategy is None or strategy.closed:
        return None
    return strategy


def claim(strategy: Any, connect: Callable[[], None]) -> None:
    """Make `strategy` the connected one, calling `connect()` under the lock.

    Raises RuntimeError if another live strategy is connected. If `connect`
    raises, nothing is claimed. A `LocalCluster` holding any of the workers
    or ps of its `cluster` shuts it down when closed.
    """
    global _active
    with _lock:
        other = _active() if _active is not None else None
        if other is not None and not other.closed:
            raise RuntimeError(
                "Another psclient.ParameterServerStrategy is connected in this process "
                f"({other!r}); call its shutdown() first. TensorFlow keeps one cluster "
                "connection per process."
            )
        connect()
        _active = weakref.ref(strategy)
    closing.before_close(_shut_down_if_connected)


def release(strategy: Any) -> None:
    """Forget `strategy` if it is the connected one (called by its shutdown)."""
    global _active
    with _lock:
        if _active is not None and _active() in (strategy, None):
            _active = None


def _tasks_of(cluster: Cluster) -> frozenset:
    return frozenset((*cluster.workers, *cluster.ps))


def _shut_down_if_connected(ending: Cluster) -> None:
    """A `LocalCluster` is about to end the tasks of `ending`: shut down the strategy connected to any of them."""
    strategy = current()
    if strategy is not None and _tasks_of(strategy.cluster) & _tasks_of(ending):
        strategy.shutdown()
