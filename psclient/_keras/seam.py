"""Every private Keras name psclient uses, and the checks that keep them honest.

psclient plugs into Keras 3 through public seams where Keras has them (a
`DataAdapter` passed as `x`, a train function Keras keeps once set, callbacks)
and through a few private names where it has none. Those are all listed in
`KERAS_INTERNALS`, the one place to look when Keras moves something.
`check()` runs when the Keras support is installed (`psclient._keras.install`):
it imports every listed module and finds every listed class attribute, and a
missing one is a `KerasSeamError` naming it and the Keras version, rather than
a patch silently not applied. Attributes that exist only on instances
(`model._compile_metrics`) are read through `internal()`, which fails the
same way. tests/keras/test_keras_seam.py checks the list against the installed
Keras and scans psclient's source for a private Keras name that is not listed.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import warnings
from typing import Any, NamedTuple

from psclient._core.errors import PSClientError

__all__ = [
    "KERAS_INTERNALS",
    "KERAS_VERSIONS",
    "Internal",
    "KerasSeamError",
    "check",
    "internal",
    "keras_range",
    "resolve",
]

#: The Keras versions psclient is tested with; pyproject.toml requires the same
#: range. Tested here with Keras 3.15.1, and with 3.10.0 (`pip install
#: --no-deps --target`): tests/keras/test_keras_seam.py, test_keras_fit.py,
#: test_keras_callbacks.py and tests/serving/test_serving.py pass (`nox -s oldest`
#: runs the seam's and fit's with TF 2.16.1). 3.10 is the lowest: 3.8 and 3.9 have every
#: name of `KERAS_INTERNALS` but not `keras.config.max_steps_per_epoch`, which
#: fit reads. The upper bound is the next minor release, untested yet.
KERAS_VERSIONS = ((3, 10), (3, 16))  # >=3.10, <3.16

_TRAINER = "keras.src.backend.tensorflow.trainer.TensorFlowTrainer"
_BASE_TRAINER = "keras.src.trainers.trainer.Trainer"
_VARIABLE = "keras.src.backend.tensorflow.core.Variable"
_COMMON_VARIABLE = "keras.src.backend.common.variables.Variable"
_BACKUP = "keras.src.callbacks.backup_and_restore.BackupAndRestore"
_TF_OPTIMIZER = "keras.src.backend.tensorflow.optimizer.TFOptimizer"
_BASE_OPTIMIZER = "keras.src.optimizers.base_optimizer.BaseOptimizer"
_ADAGRAD = "keras.src.optimizers.adagrad.Adagrad"
_ADAFACTOR = "keras.src.optimizers.adafactor.Adafactor"
_ADAM = "keras.src.optimizers.adam.Adam"
_SGD = "keras.src.optimizers.sgd.SGD"
_BATCH_NORM = "keras.src.layers.normalization.batch_normalization.BatchNormalization"


def _export_archive() -> tuple[str, str]:
    """Keras's SavedModel export archive: (module, class). Keras 3.14 moved it into a module of its
    own (`saved_model_export_archive.SavedModelExportArchive`); 3.10-3.13 keep it in `saved_model`
    (`ExportArchive`), with the same `write_out` and `_list_variables_used_by_fns`."""
    try:
        moved = importlib.util.find_spec("keras.src.export.saved_model_export_archive") is not None
    except ModuleNotFoundError:  # no Keras at all: the names are never resolved
        moved = True
    if moved:
        return "keras.src.export.saved_model_export_archive", "SavedModelExportArchive"
    return "keras.src.export.saved_model", "ExportArchive"


#: Patched for exports (psclient._keras.serving).
EXPORT_ARCHIVE_MODULE, _EXPORT_ARCHIVE_CLASS = _export_archive()
EXPORT_WRITE_OUT = f"{EXPORT_ARCHIVE_MODULE}.{_EXPORT_ARCHIVE_CLASS}.write_out"
TF_LAYER_CHILDREN = "keras.src.backend.tensorflow.layer.TFLayer._trackable_children"
TF_LAYER_DEFAULT_SIGNATURE = "keras.src.backend.tensorflow.layer.TFLayer._default_save_signature"


class Internal(NamedTuple):
    """One private Keras name: `path` is module.name[.attribute...]."""

    path: str
    why: str
    #: "attr": a module or class attribute; "instance": an attribute set on
    #: instances (by `__init__` or `compile`), not found on the class;
    #: "keyword": a keyword argument named `name` that the function `path`
    #: passes or takes through **kwargs (found in its source).
    kind: str = "attr"
    name: str = ""

    @property
    def last(self) -> str:
        """The name as it appears in psclient's code."""
        return self.name or self.path.rsplit(".", 1)[-1]


KERAS_INTERNALS: tuple[Internal, ...] = (
    # Patched (psclient._keras.install).
    Internal(f"{_VARIABLE}.assign_add", "made atomic on the ps: one tf.Variable.assign_add"),
    Internal(f"{_VARIABLE}.assign_sub", "made atomic on the ps: one tf.Variable.assign_sub"),
    Internal(f"{_VARIABLE}.shape", "follows a partitioned value's shard while its update is traced per shard"),
    Internal(f"{_TRAINER}.fit", "patched: runs on the cluster for a model on the ps"),
    Internal(f"{_TRAINER}.evaluate", "patched: exact-once ranges of batches on the cluster"),
    Internal(f"{_TRAINER}.predict", "patched: ranges of batches on the cluster, in input order"),
    Internal(f"{_TRAINER}.fit", "fit's validation passes it to evaluate; psclient's evaluate drops it",
             kind="keyword", name="_use_cached_eval_dataset"),
    Internal("keras.src.backend.tensorflow.numpy.take",
             "patched: on axis 0 of a ps variable (Embedding's lookup) the rows are gathered on the "
             "ps, so only looked-up rows travel, not the whole table"),
    Internal(f"{_TF_OPTIMIZER}._update_model_variables_moving_average",
             "patched: the EMA's averages (use_ema) updated on their ps, not read to the worker"),
    Internal(f"{_BASE_OPTIMIZER}._model_variables_moving_average", "the EMA's averages, one per weight",
             kind="instance"),
    Internal(f"{_ADAGRAD}.update_step",
             "patched: a tf.IndexedSlices gradient of a ps variable (or shard) updates the touched rows "
             "only, with Keras's arithmetic, not sqrt(accumulator + epsilon) over the whole table"),
    Internal(f"{_ADAGRAD}._accumulators", "Adagrad's accumulators, one per weight: the rows to gather",
             kind="instance"),
    Internal(f"{_ADAM}.update_step",
             "patched: a dense gradient of a ps variable (or shard) is applied with TF's ResourceApplyAdam, "
             "one kernel for the weight and both slots (psclient._keras.fused_updates)"),
    Internal(f"{_SGD}.update_step",
             "patched: a dense gradient of a ps variable (or shard) is applied with TF's "
             "ResourceApplyKerasMomentum or ResourceApplyGradientDescent, one kernel, Keras's results bit for bit"),
    Internal(f"{_ADAM}._momentums", "Adam's first moments, one per weight", kind="instance"),
    Internal(f"{_ADAM}._velocities", "Adam's second moments, one per weight", kind="instance"),
    Internal(f"{_ADAFACTOR}.update_step",
             "patched: a partitioned variable's update runs shard by shard on each shard's ps, the "
             "whole-variable means added up from per-shard sums (psclient._keras.adafactor)"),
    Internal(f"{_ADAFACTOR}._r", "Adafactor's row factors, one per weight", kind="instance"),
    Internal(f"{_ADAFACTOR}._c", "Adafactor's column factors, one per weight", kind="instance"),
    Internal(f"{_ADAFACTOR}._v", "Adafactor's second moments, one per weight", kind="instance"),
    Internal(f"{_BASE_OPTIMIZER}._learning_rate", "Adafactor's relative_step applies to a fixed rate only",
             kind="instance"),
    Internal(f"{_BASE_OPTIMIZER}._overwrite_variable_with_gradient",
             "weights Keras overwrites with their gradient have no Adafactor slots"),
    Internal(f"{_BATCH_NORM}.call", "patched: in training, the moving statistics of a layer on a ps "
             "written with one atomic assign_sub each, renorm's moving_variance assigned from the "
             "updated moving_stddev (psclient._keras.moving_stats)"),
    Internal(f"{_BASE_OPTIMIZER}.apply", "patched: inside a scheduled step, applied under the strategy's "
             "max_staleness / replicas_to_aggregate rule and its staleness measured"),
    Internal(f"{_BASE_OPTIMIZER}._trainable_variables", "the weights of apply(grads) given no variables",
             kind="instance"),
    Internal(f"{_BASE_OPTIMIZER}._get_variable_index", "a weight's index into its optimizer's slot lists"),
    Internal(EXPORT_WRITE_OUT, "patched: Keras's export (model.export) is one export scope, in which a "
             "DynamicEmbedding reads a snapshot of its rows in stock TF variables (psclient._keras.serving)"),
    Internal(TF_LAYER_CHILDREN, "patched: during an export a model's SavedModel children leave out the "
             "optimizer and compiled metrics (training state, not served)"),
    Internal(f"{EXPORT_ARCHIVE_MODULE}._list_variables_used_by_fns", "patched: during `write_out` the "
             "variables an export's endpoints use are named as the Keras variables that hold them, so that "
             "each is saved once, not again as a tf.Variable or as shards; and the endpoints are traced for "
             "it in TF's save context, the one trace TF's save then reuses (psclient._keras.serving)"),
    Internal(TF_LAYER_DEFAULT_SIGNATURE, "patched: None during `write_out`, whose walk for lookup tables "
             "would read it and trace the model once more for a signature it never saves "
             "(psclient._keras.serving)"),
    # Variables.
    Internal(f"{_VARIABLE}._initialize_with_initializer",
             "patched: the variable described (shape, dtype, initializer) to psclient's creator, which "
             "runs the initializer on the variable's ps (psclient._keras.initializers)"),
    Internal(f"{_VARIABLE}._shape", "the shape of a variable being initialised", kind="instance"),
    Internal(f"{_VARIABLE}._dtype", "the dtype of a variable being initialised", kind="instance"),
    Internal("keras.src.initializers.random_initializers.compute_fans",
             "the fans of a partitioned variable's full shape, for each shard's VarianceScaling"),
    Internal(f"{_VARIABLE}._value", "the tf.Variable inside: its device says ps or local; replaced by a ps copy for state made outside the scope (outside_state.py)", kind="instance"),
    Internal("keras.src.backend.backend", "the configured backend, read before Keras is imported"),
    Internal("keras.src.backend.common.stateless_scope.in_stateless_scope",
             "assign_add inside a StatelessScope keeps Keras's own path"),
    Internal("keras.src.backend.common.stateless_scope.StatelessScope",
             "evaluate's metric states, computed without writing the ps; subclassed so that an "
             "unmapped weight reads as itself (its regularizer) and losses are collected"),
    # The model.
    Internal(f"{_BASE_TRAINER}._assert_compile_called", "fit/evaluate before compile(): Keras's own error"),
    Internal(f"{_BASE_TRAINER}._symbolic_build", "build what is unbuilt, on the ps, from the data's spec"),
    Internal("keras.src.layers.layer.Layer._flatten_layers", "is every layer built?"),
    # A cluster model's weights read once per forward pass, not per loop iteration (loop_reads.py).
    Internal("keras.src.layers.layer.Layer.__call__", "patched: marks the outermost layer call traced"),
    Internal(f"{_COMMON_VARIABLE}.value", "patched: inside that call, a trainable ps weight read in a "
             "while loop is read once, outside the outermost loop"),
    Internal(f"{_COMMON_VARIABLE}._maybe_autocast", "that read cast as Keras casts its reads"),
    Internal(f"{_BASE_TRAINER}._compile_metrics", "are the compiled metrics built?", kind="instance"),
    Internal(f"{_BASE_TRAINER}._compile_loss", "is the compiled loss built?", kind="instance"),
    Internal(f"{_BASE_TRAINER}._loss_tracker", "made again by every compile(): fit's step functions "
             "are kept until then", kind="instance"),
    Internal(f"{_BASE_TRAINER}._flatten_metrics_in_order", "evaluate's list result, in Keras's order"),
    Internal(f"{_BASE_TRAINER}.train_function", "fit keeps a train function already set (psclient's)",
             kind="instance"),
    # Data.
    Internal("keras.src.trainers.data_adapters.get_data_adapter", "arrays batched by Keras's own adapter"),
    Internal("keras.src.trainers.data_adapters.array_slicing.train_validation_split",
             "validation_split, done before the data goes to the workers"),
    Internal("keras.src.trainers.data_adapters.data_adapter.DataAdapter",
             "fit's `x`: an adapter over per-worker datasets"),
    Internal("keras.src.utils.python_utils.pythonify_logs", "evaluate's logs as Python numbers, as Keras's"),
    # BackupAndRestore with atomic files (psclient._keras.callbacks).
    Internal(f"{_BACKUP}._save_model", "overridden: write each file, then rename it into place"),
    Internal(f"{_BACKUP}._load_model", "overridden: restore a model on the ps from its sharded checkpoint"),
    Internal(f"{_BACKUP}._weights_path", "where Keras reads the weights back", kind="instance"),
    Internal(f"{_BACKUP}._training_metadata_path", "where Keras reads the epoch back", kind="instance"),
    Internal(f"{_BACKUP}._current_epoch", "the epoch to save", kind="instance"),
    Internal(f"{_BACKUP}._last_batch_seen", "the batch to save", kind="instance"),
)


class KerasSeamError(PSClientError, RuntimeError):
    """A Keras internal that psclient needs is missing from the installed Keras."""


def _keras_version() -> str:
    import keras

    return keras.__version__


def _version_tuple(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def keras_range() -> str:
    """`KERAS_VERSIONS` as a pip requirement's version range."""
    (lo_major, lo_minor), (hi_major, hi_minor) = KERAS_VERSIONS
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def _missing(what: str) -> KerasSeamError:
    return KerasSeamError(
        f"psclient's Keras support needs the Keras internal {what}, which Keras "
        f"{_keras_version()} does not have. psclient is tested with keras{keras_range()}: "
        f"install a Keras in that range (pip install 'keras{keras_range()}'), or a psclient "
        "release that supports this Keras."
    )


def resolve(entry: Internal) -> Any:
    """The object `entry.path` names (for "instance" entries, the class that sets it)."""
    parts = entry.path.split(".")
    target = parts if entry.kind != "instance" else parts[:-1]
    for split in range(len(target), 0, -1):
        module_name = ".".join(target[:split])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and module_name.startswith(error.name):
                continue  # a shorter prefix is the module, the rest are attributes
            raise
        for depth, attribute in enumerate(target[split:], start=split):
            if not hasattr(obj, attribute):
                raise _missing(f"`{'.'.join(target[:depth + 1])}`")
            obj = getattr(obj, attribute)
        if entry.kind == "keyword" and f"{entry.name}=" not in inspect.getsource(obj):
            raise _missing(f"keyword argument `{entry.name}` of `{entry.path}`")
        return obj
    raise _missing(f"module `{entry.path}`")


def check() -> None:
    """Find every class and module name of `KERAS_INTERNALS` in the installed Keras.

    Raises `KerasSeamError` for the first one missing. A Keras outside
    `KERAS_VERSIONS` with every name present gets a warning: it may work, but
    nobody has run psclient's tests with it.
    """
    for entry in KERAS_INTERNALS:
        resolve(entry)
    version = _keras_version()
    low, high = KERAS_VERSIONS
    if not low <= _version_tuple(version) < high:
        warnings.warn(
            f"psclient is tested with keras{keras_range()}; this is Keras {version}. "
            "Every Keras internal psclient uses is present, but fit/evaluate/predict on "
            "the cluster are untested with it.",
            RuntimeWarning,
            stacklevel=3,
        )


_INSTANCE_NAMES = frozenset(e.last for e in KERAS_INTERNALS if e.kind == "instance")


def internal(obj: Any, name: str) -> Any:
    """`obj.<name>` for a listed instance attribute of Keras; `KerasSeamError` if absent."""
    assert name in _INSTANCE_NAMES, f"{name} is not listed in KERAS_INTERNALS"
    try:
        return getattr(obj, name)
    except AttributeError:  # the AttributeError only repeats the name the message gives
        raise _missing(f"attribute `{name}` of {type(obj).__module__}.{type(obj).__qualname__}") from None
