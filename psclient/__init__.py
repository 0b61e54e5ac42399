"""psclient: parameter-server training for TensorFlow 2 and Keras 3.

One coordinator process drives a cluster of TensorFlow task servers over TF's
own gRPC runtime: ps tasks hold the variables, workers run the steps.

Layout: this module is the whole public API. Implementation lives in private
modules, one idea each: `_cluster` (cluster descriptions), `_local` (local
task processes), `_server`/`_cli` (the `psclient` command), `_strategy` (the
strategy), `_scheduler` and `_failures` (queue and failure policy, pure
logic), `_dispatch` and `_runtime` (the TensorFlow edge), `_placement`,
`_per_worker`, `_future`, `_compat` (TF's ClusterCoordinator API), `_errors`;
fault tolerance in `_health` (probes, hang detection), `_recovery` (rejoin, ps
recovery) and `_checkpoint`; `_tracing` (what a dispatcher calls); the
sidecar evaluator in `_sidecar`/`_sidecar_formats`; `_launch` and `_demo`
behind the `launch` and `demo` commands; Keras 3 `fit`/`evaluate`/`predict`
support in `_keras*` (installed by `strategy.scope()`).
TensorFlow is imported lazily, so `import psclient` is cheap.
"""

from psclient._cluster import Cluster
from psclient._compat import ClusterCoordinator
from psclient._errors import (
    ClusterConfigError,
    PSClientError,
    PSUnavailableError,
    StrategyClosedError,
    TaskUnreachableError,
    WorkerUnavailableError,
)
from psclient._future import (
    ALL_COMPLETED,
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    Future,
    as_completed,
    wait,
)
from psclient._local import LocalCluster
from psclient._per_worker import PerWorker, PerWorkerDataset, PerWorkerIterator
from psclient._sidecar import SidecarEvaluator, SidecarReport, read_final_marker, write_final_marker
from psclient._sidecar_formats import CheckpointMismatchError
from psclient._strategy import ParameterServerStrategy

__version__ = "0.1.0"


def __getattr__(name):
    # Keras-backed names load Keras on first use, so `import psclient` stays cheap.
    if name == "BackupAndRestore":
        from psclient._keras_callbacks import BackupAndRestore

        return BackupAndRestore
    raise AttributeError(f"module 'psclient' has no attribute {name!r}")


__all__ = [
    "ALL_COMPLETED",
    "BackupAndRestore",
    "CheckpointMismatchError",
    "Cluster",
    "ClusterConfigError",
    "ClusterCoordinator",
    "FIRST_COMPLETED",
    "FIRST_EXCEPTION",
    "Future",
    "LocalCluster",
    "ParameterServerStrategy",
    "PSClientError",
    "PSUnavailableError",
    "PerWorker",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "SidecarEvaluator",
    "SidecarReport",
    "StrategyClosedError",
    "TaskUnreachableError",
    "WorkerUnavailableError",
    "as_completed",
    "read_final_marker",
    "wait",
    "write_final_marker",
]
