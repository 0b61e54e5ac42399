"""Synchronous training's state on the ps: gradient accumulators, and psclient's own variables.

`internal_variable` makes a variable that is psclient's, not the user's: it
bypasses the strategy's variable creator (so it is neither placed by the
store nor checkpointed with the user's variables) and is made under
`init_scope` (it is made while a step is traced and must outlive the trace).
After a ps task is rebuilt, `psclient._coordinator.training.sync.Steps.renew` drops
them and the next trace makes them again.

`Accumulators` holds, for the variables one optimizer applies to, a sum of
gradients beside each variable, on its ps task (one per shard of a
partitioned variable, on that shard's task), and a count of the gradients in
them (on ps 0). A `tf.IndexedSlices` gradient (an embedding's) is added with
`scatter_add` into a dense sum, and the mean is dense: Keras's Adam, RMSprop
and the like densify a sparse gradient anyway; plain SGD and Adagrad then
update every row (zeros for the untouched ones) where their own sparse path
would update the touched rows only. The sums cost one more copy of each
trained variable on its ps task.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator import runtime as _runtime
from psclient._coordinator.variables.sharding import is_partitioned, per_shard
from psclient._tf import variables as _variables

__all__ = ["Accumulators", "internal_variable"]


def internal_variable(device: str, make_value: Callable[[], Any], name: str):
    """A variable of psclient's own on `device`: not the user's (not in scope()'s store or checkpoints)."""
    # ResourceVariable itself, not tf.Variable: a subclass bypasses the variable
    # creators in force (the strategy's, which would place and checkpoint it).
    # Under init_scope: it is made while a step is traced, and must outlive the trace.
    with tf.init_scope(), tf.device(device):
        return _variables.uncreated_variable(make_value(), name)


class Accumulators:
    """Gradient sums on the ps, one per variable (one per shard of a partitioned one), and a count."""

    def __init__(self, variables: list):
        self._refs = [weakref.ref(v) for v in variables]
        self.parts: list[list] = []
        for variable in variables:
            shards = variable.variables if is_partitioned(variable) else [variable]
            self.parts.append([
                internal_variable(shard.device, functools.partial(tf.zeros, shard.shape, shard.dtype),
                                   "psclient_accumulator")
                for shard in shards
            ])
            if len(shards) > 1:
                self.parts[-1] = (variable, self.parts[-1])
        self.count = internal_variable(
            _runtime.ps_device(0), lambda: tf.constant(0, tf.int64), "psclient_contributions")

    def holds(self, variables: list) -> bool:
        return len(variables) == len(self._refs) and all(r() is v for r, v in zip(self._refs, variables))

    def _each(self):
        for part in self.parts:
            if isinstance(part, tuple):
                yield part[0], part[1]
            else:
                yield None, part

    def receive(self, grads: list) -> list:
        """Each gradient (or its rows per shard) copied onto its accumulator's ps task."""
        arrived = []
        for grad, (partitioned, accumulators) in zip(grads, self._each()):
            pieces = per_shard(grad, partitioned) if partitioned is not None else [grad]
            for piece, accumulator in zip(pieces, accumulators):
                with tf.device(accumulator.device):
                    if isinstance(piece, tf.IndexedSlices):
                        arrived.append(tf.IndexedSlices(
                            tf.identity(tf.cast(piece.values, accumulator.dtype)), tf.identity(piece.indices)))
                    else:
                        arrived.append(tf.identity(tf.cast(piece, accumulator.dtype)))
        return arrived

    def _flat(self) -> list:
        return [a for _, accumulators in self._each() for a in accumulators]

    def add(self, arrived: list) -> list:
        ops = []
        for accumulator, grad in zip(self._flat(), arrived):
            if isinstance(grad, tf.IndexedSlices):
                ops.append(accumulator.scatter_add(grad))
            else:
                ops.append(accumulator.assign_add(grad))
        return ops

    def means(self, k: int) -> list:
        """The mean gradient of each variable, computed on its accumulators' ps tasks."""
        means = []
        for partitioned, accumulators in self._each():
            parts = []
            for accumulator in accumulators:
                with tf.device(accumulator.device):
                    parts.append(accumulator.read_value() / tf.cast(k, accumulator.dtype))
            means.append(parts[0] if partitioned is None else tf.concat(parts, axis=0))
        return means

    def reset(self) -> list:
        return [a.assign(tf.zeros_like(a)) for a in self._flat()] + [self.count.assign(0)]
