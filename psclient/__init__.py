"""psclient: parameter-server training for TensorFlow 2 and Keras 3.

One coordinator process drives a cluster of TensorFlow task servers over TF's
own gRPC runtime: ps tasks hold the variables, workers run the steps.

This module is the whole public API. Behind it, private subpackages, each with
one job, in layers (a layer imports only the layers below it; the rules are
contracts in pyproject.toml, checked by tests/ops/test_layout.py):

  _cli, _demo     the `psclient` command and its demo
  _keras          Keras 3 fit/evaluate/predict on the cluster: the one seam
                  into Keras internals (`_keras/install.py`), installed when
                  a strategy's scope is first entered (hook registered here)
  _sidecar        the sidecar evaluator and the checkpoint formats it reads
  _coordinator    the strategy and everything that calls TensorFlow for it:
                  tracing, per-worker values, variables, checkpoints, TF's
                  ClusterCoordinator API, and `TFEdge`, the engine's edge
                  onto TensorFlow's runtime; public TensorFlow only
  _engine         the orchestration, no TensorFlow: dispatcher threads,
                  failure probes, the recovery thread, elastic workers,
                  the worker watcher, taking a strategy down; every
                  TensorFlow call through its `Edge` (edge.py); the
                  strategy's checked settings (`StrategyConfig`)
  _tf             the one place that touches TF internals (`tensorflow.python`,
                  private attributes, patches): executors, cancellable calls,
                  contexts, partitioned variables, the update router,
                  checkpoint ops
  _cluster        cluster descriptions, local task processes, `serve`, `launch`
  _core           pure logic, no TensorFlow or Keras: scheduler, futures,
                  errors, failure classification, health and recovery
                  decisions, placement

TensorFlow is imported at the top of the modules that use it, and the public
names backed by them load on first use (`__getattr__` below), so
`import psclient` is cheap.
"""

import types as _types

from psclient._cluster.local import LocalCluster
from psclient._cluster.spec import Cluster
from psclient._engine import registry as _registry
from psclient._engine.config import StrategyConfig
from psclient._sidecar.evaluator_config import EvaluatorConfig
from psclient._engine.watch import WorkerWatcher
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
from psclient._cluster.exposure import PortExposedError
from psclient._core.serving_dirs import ServingDirError

#: Public names whose modules import TensorFlow (or Keras) at their top: each
#: loads on first use (PEP 562), so `import psclient` stays cheap.
_LAZY = _types.MappingProxyType({
    "BackupAndRestore": "psclient._keras.callbacks",
    "CheckpointDirError": "psclient._coordinator.checkpoints.checkpoint_parts",
    "CheckpointMismatchError": "psclient._sidecar.formats",
    "CheckpointWriteError": "psclient._coordinator.checkpoints.checkpoint_parts",
    "ClusterCoordinator": "psclient._coordinator.compat",
    "ModelCheckpoint": "psclient._keras.checkpoints",
    "ParameterServerStrategy": "psclient._coordinator.strategy",
    "PerWorker": "psclient._coordinator.data.per_worker",
    "PerWorkerDataset": "psclient._coordinator.data.per_worker",
    "PerWorkerIterator": "psclient._coordinator.data.per_worker",
    "SidecarEvaluator": "psclient._sidecar.evaluator",
    "SidecarReport": "psclient._sidecar.evaluator",
    "ServingExport": "psclient._keras.servable",
    "StalenessLogger": "psclient._keras.callbacks",
    "read_final_marker": "psclient._sidecar.evaluator",
    "write_final_marker": "psclient._sidecar.evaluator",
    "export_servable": "psclient._keras.servable",
})

__version__ = "0.1.0"


def _install_keras_support() -> None:
    # Keras is heavy and optional: loaded when a strategy's scope first opens.
    from psclient._keras.install import install

    install()


_registry.add_scope_hook(_install_keras_support)


def _register_layers() -> None:
    # keras.models.load_model reads a saved psclient layer after `import psclient` alone.
    from psclient._keras.registration import register_when_keras_loads

    register_when_keras_loads()


_register_layers()


#: Public submodules reachable after `import psclient` alone (`psclient.serving.load(...)`).
_SUBMODULES = ("data", "layers", "serving")


def __getattr__(name):
    # TF- and Keras-backed names load on first use, so `import psclient` stays cheap.
    module = _LAZY.get(name)
    if module is not None or name in _SUBMODULES:
        import importlib

        if module is None:  # psclient.data / .layers / .serving without an explicit import, as for a subpackage
            return importlib.import_module(f"psclient.{name}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # found directly from now on
        return value
    raise AttributeError(f"module 'psclient' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


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
    "EvaluatorConfig",
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
    "ServingDirError",
    "ServingExport",
    "StrategyAPIUnsupportedError",
    "StrategyConfig",
    "StrategyClosedError",
    "TaskUnreachableError",
    "WorkerUnavailableError",
    "WorkerWatcher",
    "as_completed",
    "export_servable",
    "kubernetes_workers",
    "read_final_marker",
    "wait",
    "write_final_marker",
]
