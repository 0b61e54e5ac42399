"""What a `LocalCluster` runs before it ends its tasks (kept apart from local.py, which reaches
TensorFlow, so that the TensorFlow-free engine can add a hook: the registry's, which shuts down a
strategy still connected to the tasks while they answer)."""

from __future__ import annotations

from typing import Callable

from psclient._cluster.spec import Cluster

__all__ = ["before_close", "run_before_close"]

#: Called with the closing cluster's `Cluster` before its tasks end. Process-wide, as TF's
#: connection to a cluster is.
_BEFORE_CLOSE: list[Callable[[Cluster], None]] = []


def before_close(hook: Callable[[Cluster], None]) -> None:
    """Have every `LocalCluster.close()` call `hook(cluster)` before it ends the tasks (added once)."""
    if hook not in _BEFORE_CLOSE:
        _BEFORE_CLOSE.append(hook)


def run_before_close(cluster: Cluster) -> None:
    for hook in list(_BEFORE_CLOSE):
        hook(cluster)
