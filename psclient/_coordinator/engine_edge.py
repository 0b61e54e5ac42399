"""`TFEdge`: the engine's `Edge` (psclient._engine.edge) on TensorFlow's runtime.

Each name is `runtime`'s function of that name (`own_executor`: `executors.on_thread_executor`);
only `connect` binds what the strategy chose (streaming enqueue with a pipeline deeper than one call).
"""

from __future__ import annotations

from psclient._cluster.spec import Cluster
from psclient._coordinator import runtime as _runtime
from psclient._tf import executors as _executors

__all__ = ["TFEdge"]


class TFEdge:
    """TensorFlow behind the engine's `Edge` protocol."""

    worker_device = staticmethod(_runtime.worker_device)
    ps_device = staticmethod(_runtime.ps_device)
    tcp_state = staticmethod(_runtime.tcp_state)
    tcp_reachable = staticmethod(_runtime.tcp_reachable)
    probe = staticmethod(_runtime.probe)
    check_handle = staticmethod(_runtime.check_handle)
    device_scope = staticmethod(_runtime.device_scope)
    cancellable_call = staticmethod(_runtime.cancellable_call)
    own_executor = staticmethod(_executors.on_thread_executor)
    function_not_registered_yet = staticmethod(_runtime.function_not_registered_yet)
    to_numpy = staticmethod(_runtime.to_numpy)
    name_error = staticmethod(_runtime.name_error)
    op_error = staticmethod(_runtime.op_error)
    disconnect = staticmethod(_runtime.disconnect)
    connection_changes = staticmethod(_runtime.connection_changes)

    def __init__(self, *, streaming_enqueue: bool):
        self.streaming_enqueue = streaming_enqueue

    def connect(self, cluster: Cluster, workers: list[int] | None = None, patience: float = 0.0) -> None:
        """Connect (or reconnect with only `workers` in TF's view); `patience`: seconds
        a first connect waits for tasks still starting."""
        _runtime.connect(cluster, streaming_enqueue=self.streaming_enqueue, workers=workers, patience=patience)
