"""psclient: parameter-server training for TensorFlow 2 and Keras 3.

One coordinator process drives a cluster of TensorFlow task servers over TF's
own gRPC runtime: ps tasks hold the variables, workers run the steps.

This module is the whole public API. Behind it, private subpackages, each with
one job, in layers (a layer imports only the layers below it; the rules are
contracts in pyproject.toml, checked by tests/test_layout.py):

  _cli, _demo     the `psclient` command and its demo
  _keras          Keras 3 fit/evaluate/predict on the cluster: the one seam
                  into Keras internals (`_keras/install.py`), installed when
                  a strategy's scope is first entered (hook registered here)
  _sidecar        the sidecar evaluator and the checkpoint formats it reads
  _coordinator    the strategy and everything that calls TensorFlow for it:
                  tracing, per-worker values, variables, checkpoints, TF's
                  ClusterCoordinator API, and `TFEdge`, the engine's edge
                  onto TensorFlow's runtime
  _engine         the orchestration, no TensorFlow: dispatcher threads,
                  failure probes, the recovery thread, elastic workers,
                  the worker watcher, taking a strategy down; every
                  TensorFlow call through its `Edge` (edge.py); the
                  strategy's checked settings (`StrategyConfig`)
  _cluster        cluster descriptions, local task processes, `serve`, `launch`
  _core           pure logic, no TensorFlow or Keras: scheduler, futures,
                  errors, failure classification, health and recovery
                  decisions, placement

TensorFlow is imported lazily, so `import psclient` is cheap.
"""

from psclient._cluster.local import LocalCluster
from psclient._cluster.spec import Cluster
from psclient._engine import registry as _registry
from psclient._coordinator.compat import ClusterCoordinator
from psclient._coordinator.per_worker import (
    PerWorker,
    PerWorkerDataset,
    PerWorkerIterator,
)
from psclient._coordinator.strategy import ParameterServerStrategy
from psclient._engine.watch import WorkerWatcher
from psclient._engine.config import StrategyConfig
from psclient._cluster.k8s_watch import kubernetes_workers
from psclient._core.errors import (
    CheckpointUnreadable,
    ClusterConfigError,
    PSClientError,
    PSUnavailableError,
    StrategyAPIUnsupportedError,
    StrategyClosedError,
    TaskUnreachableError,
    WorkerUnavailableError,
)
from psclient._core.future import (
    ALL_COMPLETED,
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    Future,
    as_completed,
    wait,
)
from psclient._sidecar.evaluator import (
    SidecarEvaluator,
    SidecarReport,
    read_final_marker,
    write_final_marker,
)
from psclient._cluster.exposure import PortExposedError
from psclient._sidecar.formats import CheckpointMismatchError
from psclient._coordinator.checkpoint_parts import CheckpointDirError, CheckpointWriteError

__version__ = "0.1.0"


def _install_keras_support() -> None:
    # Keras is heavy and optional: loaded when a strategy's scope first opens.
    from psclient._keras.install import install

    install()


_registry.add_scope_hook(_install_keras_support)


def __getattr__(name):
    # Keras-backed names load Keras on first use, so `import psclient` stays cheap.
    if name in ("BackupAndRestore", "StalenessLogger"):
        from psclient._keras import callbacks

        return getattr(callbacks, name)
    if name == "ModelCheckpoint":
        from psclient._keras import checkpoints

        return checkpoints.ModelCheckpoint
    if name == "data":  # psclient.data without an explicit import, as for a subpackage
        import importlib

        return importlib.import_module("psclient.data")
    if name == "layers":  # psclient.layers.DynamicEmbedding without importing psclient.layers first
        import importlib

        return importlib.import_module("psclient.layers")
    raise AttributeError(f"module 'psclient' has no attribute {name!r}")


__all__ = [
    "ALL_COMPLETED",
    "BackupAndRestore",
    "CheckpointDirError",
    "CheckpointMismatchError",
    "CheckpointUnreadable",
    "CheckpointWriteError",
    "Cluster",
    "ClusterConfigError",
    "ClusterCoordinator",
    "FIRST_COMPLETED",
    "FIRST_EXCEPTION",
    "Future",
    "LocalCluster",
    "ModelCheckpoint",
    "ParameterServerStrategy",
    "StalenessLogger",
    "PSClientError",
    "PortExposedError",
    "PSUnavailableError",
    "PerWorker",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "SidecarEvaluator",
    "SidecarReport",
    "StrategyAPIUnsupportedError",
    "StrategyConfig",
    "StrategyClosedError",
    "TaskUnreachableError",
    "WorkerUnavailableError",
    "WorkerWatcher",
    "as_completed",
    "kubernetes_workers",
    "read_final_marker",
    "wait",
    "write_final_marker",
]
