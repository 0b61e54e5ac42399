"""Keras callbacks that checkpoint a model on the ps tasks without gathering it.

`ModelCheckpoint` writes the strategy's sharded checkpoints from `fit`: each
ps task writes its own variables (`psclient._coordinator.checkpoints.checkpoint`), so a
model larger than the coordinator's memory can be checkpointed. `keras`'s own
`ModelCheckpoint`, `model.save`, `model.save_weights` and `get_weights` read
every value into the coordinator instead.

The variables are saved under their positions in the model (`model/0003`,
the 4th of `model.weights`; `optimizer/0000`), not by creation order: a
model built again, in the same way, in another process finds them, and so
does the sidecar evaluator (psclient._sidecar.formats), which restores the
model's weights by position. The optimizer's iteration count is saved as `step`.
The rows of the model's DynamicEmbedding layers are saved by each ps beside
(`model_table/0000`, the first such layer of the model; see
`psclient._coordinator.checkpoints.table_checkpoint`).
"""

from __future__ import annotations

from typing import Any

import keras

from psclient._coordinator.checkpoints.checkpoint import Checkpoints
from psclient._coordinator.checkpoints.checkpoint_parts import PsTimeout, on_each_ps
from psclient._core.errors import PSUnavailableError
from psclient._coordinator.ps_state import on_ps
from psclient._coordinator.runtime import ps_index_of
from psclient._keras.hung_ps_writes import writes_of
from psclient._keras.step_functions import tf_variable as _tf_variable
from psclient._keras.trainer import cluster_strategy

__all__ = ["ModelCheckpoint", "KEYED_BY_POSITION", "meta_of", "model_tables", "model_variables",
           "sharded_checkpoints", "step_of", "weight_key"]

#: The `keys` entry of the layout of checkpoints keyed by position in the model.
KEYED_BY_POSITION = "keras_position"


def weight_key(index: int) -> str:
    return f"model/{index:04d}"


def meta_of(model) -> dict:
    """What readers need beside the values: how keys are made, the model's weights (paths, for messages)."""
    return {"keys": KEYED_BY_POSITION, "model_weights": [variable.path for variable in model.weights]}


def model_variables(model) -> dict[str, Any]:
    """key -> tf.Variable (or partitioned variable) of the model's weights and its optimizer's.

    Keyed by position, `model/0003` in `model.weights` and `optimizer/0003`
    in `optimizer.variables`, as Keras's own weight files are matched by
    structure: auto-generated names (`dense_7`) differ between two builds of
    the same model, positions do not.
    """
    optimizer = getattr(model, "optimizer", None)
    found: dict[str, Any] = {}
    for prefix, group in (("model", model.weights), ("optimizer", optimizer.variables if optimizer else [])):
        for index, variable in enumerate(group):
            value = _tf_variable(variable)
            if value is not None:
                found[f"{prefix}/{index:04d}"] = value
    return found


def model_tables(model) -> dict[str, Any]:
    """key -> the DynamicTable of each DynamicEmbedding of `model` on the ps tasks, by position.

    `model_table/0000` is the first such layer found walking `model.layers`
    depth first: the same in another build of the same model.
    """
    from psclient._keras.dynamic_embedding import DynamicEmbedding

    found, todo = [], [model]
    while todo:
        layer = todo.pop(0)
        if isinstance(layer, DynamicEmbedding) and layer.table is not None and layer.table.shards[0].device:
            found.append(layer.table)
        todo[:0] = list(getattr(layer, "layers", []))
    return {f"model_table/{index:04d}": table for index, table in enumerate(found)}


def step_of(model, strategy=None) -> dict[str, int]:
    """{"step": the optimizer's iterations} ({} without an optimizer). With `strategy`, read within its
    `hang_timeout` (the count lives on one ps): `PSUnavailableError` naming that ps if it does not
    answer, as the save the count goes into gives up on a hung ps."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return {}
    iterations = optimizer.iterations
    ps = ps_index_of(getattr(_tf_variable(iterations), "device", None))
    if strategy is None or ps is None:
        return {"step": int(iterations.numpy())}
    try:
        value = on_each_ps({ps: iterations.numpy}, timeout=strategy.config.hang_timeout)[ps]
    except PsTimeout as error:
        address = strategy.cluster.address("ps", ps)
        raise PSUnavailableError(
            f"ps:{ps} ({address}) did not answer within hang_timeout={strategy.config.hang_timeout:g} s (hung?) "
            "when the optimizer's step count was read for a checkpoint: nothing was written, the previous "
            "checkpoint stays the newest", task=f"ps:{ps}", address=address) from error
    return {"step": int(value)}


def sharded_checkpoints(model, directory: str, keep: int, overwrite: bool, who: str, deltas: bool = False):
    """(strategy, Checkpoints) for a model on the ps tasks; (None, None) for a local model.
    `deltas`: checkpoints may be deltas of the newest full one (`checkpoint_deltas`)."""
    strategy = cluster_strategy(model, "fit")
    if strategy is None:
        return None, None
    checkpoints = Checkpoints(
        directory, keep=keep, overwrite=overwrite,
        describe_ps=lambda ps: strategy.cluster.address("ps", ps),  # the cluster as it is then (it may grow)
        matched_by=f"position in the model and its optimizer (for {who}): build and compile the same model "
                   "the same way as the run that wrote it", deltas=deltas,
        hang_timeout=strategy.config.hang_timeout)  # a hung ps: given up on (hung_ps_writes), never waited for good
    checkpoints.check_reachable(strategy.num_ps)  # every ps writes its own part
    return strategy, checkpoints


def _open_store(callback, model) -> None:
    """`callback`'s checkpoint store for `model` (a psclient.ModelCheckpoint's), made once."""
    if callback._checkpoints is None:
        callback._strategy, callback._checkpoints = sharded_checkpoints(
            model, callback.directory, callback.max_to_keep, callback.overwrite, "ModelCheckpoint",
            deltas=callback.delta_every is not None)
        if callback._strategy is None:
            raise ValueError(
                f"psclient.ModelCheckpoint writes the checkpoints of a model on the ps tasks. "
                f"Received: model {model.name!r}, whose variables live in this process. "
                "Expected a model created and compiled inside strategy.scope() (use "
                "keras.callbacks.ModelCheckpoint for a local model).")


class ModelCheckpoint(keras.callbacks.Callback):
    """Checkpoints a model on the ps tasks from `fit`, each ps writing its own part.

    `model.fit(..., callbacks=[psclient.ModelCheckpoint("/shared/ckpts")])`
    writes `ckpt-1`, `ckpt-2`, ... (TF's tensor bundle format, one data file
    per ps task) at the end of every epoch (`save_freq="epoch"`) or every
    `save_freq` batches, keeping the newest `max_to_keep`. A checkpoint counts
    once the state file `checkpoint` names it (written last, atomically).
    `directory` must be reachable from every ps task (a shared filesystem or
    a bucket). Checkpoints of another run already there are an error unless
    `overwrite=True` (then they are deleted as new ones are written).

    `delta_every=N`: after each full checkpoint, the next N saves are deltas
    `ckpt-K.delta-1` ... `ckpt-K.delta-N` of it, the strategy's incremental
    checkpoints (`psclient._coordinator.checkpoints.checkpoint_deltas`): each
    ps writes only the rows of its large embedding shards (and their slots,
    and its dynamic tables' entries) changed since the previous save, and the
    other variables whole. A save with no base to diff against (the first,
    after a restore, after a ps loss) is full and starts a new chain. Each ps
    keeps a copy of its row-diffed shards between saves. `max_to_keep` counts
    full checkpoints; each keeps its deltas, pruned with it. `restore(model)`
    reads the newest full checkpoint and its deltas in order.

    `psclient.SidecarEvaluator` reads these checkpoints. A batch-level save
    reads values while later steps still run (asynchronous training).

    Through ps faults, training goes on (`psclient._keras.hung_ps_writes`): a
    ps lost is restored by the strategy first and the save made again; a save
    given up on a ps that hung (after `hang_timeout`; the previous checkpoint
    stays the newest) is noted in `failed_saves` and made again at the first
    batch's end after the ps answered, and at the end of `fit` (at most
    `FINAL_ATTEMPTS` times).
    """

    #: Its batch hook counts batches and never reads their logs: fit may leave them on the workers.
    _psclient_reads_batch_logs = False

    def __init__(self, directory, save_freq: str | int = "epoch", max_to_keep: int = 5,
                 overwrite: bool = False, delta_every: int | None = None):
        super().__init__()
        if save_freq != "epoch" and (not isinstance(save_freq, int) or isinstance(save_freq, bool)
                                     or save_freq < 1):
            raise ValueError(
                f"Invalid value for argument `save_freq`. Received: save_freq={save_freq!r}. "
                "Expected 'epoch' or a positive integer (batches).")
        if not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool) or max_to_keep < 1:
            raise ValueError(
                f"Invalid value for argument `max_to_keep`. Received: max_to_keep={max_to_keep!r}. "
                "Expected a positive integer.")
        if delta_every is not None and (not isinstance(delta_every, int) or isinstance(delta_every, bool)
                                        or delta_every < 1):
            raise ValueError(
                f"Invalid value for argument `delta_every`. Received: delta_every={delta_every!r}. "
                "Expected None (every checkpoint full) or a positive integer (deltas written after each "
                "full checkpoint).")
        self.directory = str(directory)
        self.save_freq = save_freq
        self.max_to_keep = max_to_keep
        self.overwrite = overwrite
        self.delta_every = delta_every
        self._checkpoints = None
        self._strategy = None
        self._batches = 0
        #: Paths of the checkpoints written, oldest first.
        self.saved: list[str] = []
        #: One dict per save given up on a ps that hung ({"task", "error", "at"}); each made again.
        self.failed_saves: list[dict] = writes_of(self, _MODEL_CHECKPOINT).failures

    def on_train_begin(self, logs=None):
        _open_store(self, self.model)
        self._checkpoints.check_writable()  # another run's checkpoints: refused now, not after an epoch

    def on_train_batch_end(self, batch, logs=None):
        due = False
        if self.save_freq != "epoch":
            self._batches += 1
            if self._batches >= self.save_freq:
                self._batches, due = 0, True
        writes = writes_of(self, _MODEL_CHECKPOINT)
        if due or writes.pending:  # pending: given up on a hung ps, made again now
            writes.run(lambda: self.saved.append(_save_once(self)))

    def on_epoch_end(self, epoch, logs=None):
        writes = writes_of(self, _MODEL_CHECKPOINT)
        if self.save_freq == "epoch" or writes.pending:
            writes.run(lambda: self.saved.append(_save_once(self)))

    def on_train_end(self, logs=None):
        writes = writes_of(self, _MODEL_CHECKPOINT)
        if writes.pending:
            writes.run(lambda: self.saved.append(_save_once(self)), final=True)

    def save_now(self):
        """Write a checkpoint of the model now (what fit calls at `save_freq`).

        Through a ps loss: a ps lost since the last step is restored from the strategy's newest
        checkpoint first (psclient._coordinator.ps_state). With `delta_every=N`, a delta unless N
        were written on the newest full checkpoint (the store writes a full one when it has no base)."""
        self.saved.append(on_ps(self._strategy, lambda: _save_once(self), _MODEL_CHECKPOINT))

    def restore(self, model) -> dict | None:
        """Restore the newest checkpoint in `directory` into `model`; None if there is none.

        `model`: built and compiled in `strategy.scope()` the same way as the
        one that wrote it (weights are matched by position); its optimizer is
        built first if it is not, its slots on the ps. Each ps reads and
        assigns its own part: the newest complete full checkpoint, then its
        complete deltas in order (a damaged or missing delta ends the chain
        there, logged). Returns {"path": the full checkpoint, "deltas": the
        deltas applied after it, "skipped": checkpoints or deltas passed over,
        with what was wrong, "step": the optimizer's iterations saved}.
        From then on this callback writes beside these checkpoints.
        """
        if self.overwrite:
            raise ValueError(
                "psclient.ModelCheckpoint.restore reads the checkpoints in its directory. Received: "
                f"overwrite=True (the checkpoints in {self.directory!r} are never read, and are deleted). "
                "Expected a ModelCheckpoint made with overwrite=False to restore from.")
        _open_store(self, model)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            with self._strategy.scope():  # its slots on the ps, beside their variables
                optimizer.build(model.trainable_variables)
        checkpoints = self._checkpoints
        restored = on_ps(self._strategy, lambda: checkpoints.restore(
            model_variables(model), adopt=True, tables=model_tables(model)), "restoring a psclient.ModelCheckpoint")
        if restored is None:
            return None
        return {"path": restored["path"], "deltas": restored.get("deltas", []), "skipped": restored["skipped"],
                "step": step_of(model).get("step")}


def _save_once(callback) -> str:
    """One checkpoint of a `ModelCheckpoint`'s model (a delta when `delta_every` says so); its path."""
    checkpoints = callback._checkpoints  # noqa: SLF001 - its own store
    delta = callback.delta_every is not None and checkpoints.deltas_since_full < callback.delta_every
    return checkpoints.save(model_variables(callback.model), completed=None,
                            scalars=step_of(callback.model, callback._strategy),  # noqa: SLF001 - its own
                            meta=meta_of(callback.model), tables=model_tables(callback.model), delta=delta)


_MODEL_CHECKPOINT = "writing a psclient.ModelCheckpoint"
