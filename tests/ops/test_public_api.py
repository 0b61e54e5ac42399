"""The public surface is deliberate: a change to `psclient.__all__` or to its
exception tree must change this file too."""

import psclient
import psclient.data
import psclient.layers

PUBLIC = {
    "ALL_COMPLETED", "BackupAndRestore", "CheckpointDirError", "CheckpointMismatchError",
    "CheckpointUnreadable", "CheckpointWriteError", "Cluster", "ClusterConfigError",
    "ClusterCoordinator", "FIRST_COMPLETED", "FIRST_EXCEPTION", "Future", "LocalCluster",
    "ModelCheckpoint", "ParameterServerStrategy", "StalenessLogger", "PSClientError",
    "PortExposedError", "PSUnavailableError", "PerWorker", "PerWorkerDataset", "PerWorkerIterator",
    "SidecarEvaluator", "SidecarReport", "EvaluatorConfig", "ServingDirError", "ServingExport", "export_servable", "StrategyAPIUnsupportedError", "StrategyClosedError", "StrategyConfig",
    "TaskUnreachableError", "WorkerUnavailableError", "WorkerWatcher", "as_completed",
    "kubernetes_workers", "read_final_marker", "wait", "write_final_marker",
}

#: Each public exception: its psclient parent and the builtin it also is.
TREE = {
    "PSClientError": (None, Exception),
    "ClusterConfigError": ("PSClientError", ValueError),
    "TaskUnreachableError": ("PSClientError", ConnectionError),
    "WorkerUnavailableError": ("TaskUnreachableError", ConnectionError),
    "PSUnavailableError": ("TaskUnreachableError", ConnectionError),
    "StrategyClosedError": ("PSClientError", RuntimeError),
    "StrategyAPIUnsupportedError": ("PSClientError", NotImplementedError),
    "CheckpointUnreadable": ("PSClientError", OSError),
    "CheckpointMismatchError": ("PSClientError", ValueError),
    "CheckpointDirError": ("PSClientError", ValueError),
    "CheckpointWriteError": ("PSClientError", OSError),
    "ServingDirError": ("PSClientError", ValueError),
    "PortExposedError": ("PSClientError", RuntimeError),
}


def test_all_is_the_public_surface():
    assert set(psclient.__all__) == PUBLIC
    assert len(psclient.__all__) == len(PUBLIC), "a name listed twice"
    for name in psclient.__all__:
        assert getattr(psclient, name) is not None, name


def test_the_exception_tree():
    exported = {n for n in psclient.__all__ if isinstance(getattr(psclient, n), type)
                and issubclass(getattr(psclient, n), BaseException)}
    assert exported == set(TREE)
    for name, (parent, builtin) in TREE.items():
        cls = getattr(psclient, name)
        assert issubclass(cls, builtin), name
        if parent is not None:
            assert cls.__bases__[0] is getattr(psclient, parent), name


def test_every_exception_psclient_defines_is_one_family():
    # Also the ones reached through submodules: data, layers, the Keras seam, partitioning, sync.
    from psclient._coordinator.data.datasets import NotADatasetError
    from psclient._coordinator.data.finite import NondeterministicDatasetError
    from psclient._core.partitioning import PartitionError
    from psclient._coordinator.training.sync import UnsupportedStep
    from psclient._keras.seam import KerasSeamError
    from psclient._sidecar.formats import CheckpointUnreadableError

    for cls in (PartitionError, UnsupportedStep, KerasSeamError, NotADatasetError, NondeterministicDatasetError, psclient.data.LedgerMismatchError,
                psclient.layers.UnsupportedOptimizerError):
        assert issubclass(cls, psclient.PSClientError), cls
    assert CheckpointUnreadableError is psclient.CheckpointUnreadable  # one class, two names
