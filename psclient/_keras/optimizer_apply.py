"""The optimizer's `apply`: psclient's one wrapper of Keras's `BaseOptimizer.apply`.

Two things happen where Keras applies gradients, and both need the list of
variables the optimizer was given:

1. The rows of every `DynamicEmbedding` whose anchor weight is among them are
   updated from the gradients their lookups kept (one admission and update per
   ps for the alike tables of the step, with the scans that are due).
2. Inside a step traced for `schedule()`, the other weights are applied under
   the strategy's rule for model versions: a ticket, `max_staleness`, or
   `replicas_to_aggregate` (`psclient._coordinator.training.sync`). Keras's own apply
   otherwise.

Installed by the strategy's Keras support (`psclient._keras.install`) or by the
first `DynamicEmbedding` (which works without a strategy), whichever comes
first: one wrapper, so nothing depends on the order. Guarded like every patch
(`seam.check()` first; the private names it reads are in `seam.KERAS_INTERNALS`).
This module imports no other Keras-support module, so both can import it.
"""

from __future__ import annotations

import functools
import threading

from psclient._coordinator.training import sync
from psclient._coordinator.tables.fused_admission import apply_parts
from psclient._coordinator.tables.ps_saves import prepare as prepare_saves
from psclient._keras import seam

__all__ = ["install"]

_lock = threading.Lock()
_done = False


def install() -> None:
    """Wrap `BaseOptimizer.apply` once (idempotent, thread-safe)."""
    global _done
    with _lock:
        if _done:
            return
        seam.check()
        _wrap_apply()
        _done = True


def _apply_rows(optimizer, trainable_variables: list) -> None:
    parts, rule, tables = [], None, []
    for variable in trainable_variables:
        ref = getattr(variable, "_psclient_dynamic_layer", None)  # set on a DynamicEmbedding's anchor
        layer = ref() if ref is not None else None
        if layer is not None:
            layer_parts, layer_rule = layer.apply_kept_gradients(optimizer)
            parts += layer_parts
            rule = rule or layer_rule
            tables.append(layer.table)
    if parts:
        apply_parts(parts, rule)  # the scans due run in the same sections
    # Every table's slots made (above): each ps's one checkpoint save is traced now, not in a cut.
    prepare_saves(tables)


def _wrap_apply() -> None:
    import keras
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    stock = BaseOptimizer.apply

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            _apply_rows(self, trainable_variables)
        step = sync.current_step()
        grads = list(grads)
        if step is None or step.busy or not grads:
            if step is None:
                sync.note_untracked_apply()
            return stock(self, grads, trainable_variables)
        if trainable_variables is None:
            variables = list(seam.internal(self, "_trainable_variables"))
        else:
            variables = trainable_variables
        if not self.built:  # as Keras's apply does, before any of it runs under a condition
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        tf_variables = [seam.internal(v, "_value") if isinstance(v, keras.Variable) else v for v in variables]
        return step.apply(grads, tf_variables, lambda mean: stock(self, mean, variables))

    functools.update_wrapper(apply, stock)
    BaseOptimizer.apply = apply
