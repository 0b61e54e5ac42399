"""Adagrad's update of a ps variable from a sparse gradient: the touched rows only.

See `install`. Keras 3.10-3.15 (`psclient._keras.seam` lists the internals).
"""

from __future__ import annotations

import functools

import tensorflow as tf

from psclient._keras import seam

__all__ = ["install", "ps_variable"]


def install() -> None:
    """Adagrad with a `tf.IndexedSlices` gradient of a ps variable: work on the touched rows only.

    Keras's `Adagrad.update_step` (Keras 3.10-3.15) with a row-sparse
    gradient `g` (values `g_i` at row indices `r_i`, duplicates kept) does

        accumulator.scatter_add(r_i, g_i ** 2)
        variable.scatter_sub(r_i, (lr * g_i) / gather(sqrt(accumulator + epsilon), r_i))

    but builds `sqrt(accumulator + epsilon)`, and the zero/NaN test of its
    sparse `divide`, over the whole table: on the ps, CPU per step grows with
    the table, not with the batch. Here the same values come from the
    touched rows alone: `sqrt(gather(accumulator, unique(r)) + epsilon)`,
    gathered per occurrence, with
    Keras's own ops (`keras.ops`, so Keras's dtype rules) on the same
    elements, so the result is the same bit for bit and untouched rows are
    not read or written. Duplicate indices are kept as Keras keeps them (each
    occurrence's square is added, each occurrence's step subtracted; Keras 3
    does not sum them first, unlike tf_keras's OptimizerV2).

    Only for a variable whose value is a `tf.Variable` on a ps task, or a
    partitioned one while its update is traced shard by shard (then the
    shard's), and an IndexedSlices gradient; and only when
    `epsilon > 0` and `initial_accumulator_value >= 0`, so that no row's
    denominator is zero or NaN (with one, Keras's divide writes every such
    row of the table too, which is Keras's code to keep). Dense gradients,
    local variables and other optimizers: Keras's own `update_step`.
    """
    import numbers

    from keras import ops
    from keras.src.optimizers.adagrad import Adagrad

    stock = Adagrad.update_step

    def update_step(self, gradient, variable, learning_rate):
        epsilon, initial = self.epsilon, self.initial_accumulator_value
        if (
            not isinstance(gradient, tf.IndexedSlices)
            or ps_variable(variable) is None
            or not (isinstance(epsilon, numbers.Real) and epsilon > 0)
            or not (isinstance(initial, numbers.Real) and initial >= 0)
        ):
            return stock(self, gradient, variable, learning_rate)
        accumulator = seam.internal(self, "_accumulators")[self._get_variable_index(variable)]
        table = ps_variable(accumulator)
        if table is None:
            return stock(self, gradient, variable, learning_rate)
        lr = ops.cast(learning_rate, variable.dtype)
        values = ops.cast(gradient.values, variable.dtype)
        indices, dense_shape = gradient.indices, gradient.dense_shape
        self.assign_add(accumulator, tf.IndexedSlices(ops.square(values), indices, dense_shape))
        # Each touched row once, read after the scatter_add (ops on one
        # resource run in program order): a ResourceGather on the ps.
        rows, occurrence = tf.unique(indices)
        denominators = ops.sqrt(ops.add(tf.gather(table, rows), epsilon))
        # Gathered per occurrence, as Keras's sparse divide gathers from its
        # full-table sqrt: the Sqrt then does not feed the Div directly, which
        # Grappler would turn into Rsqrt and Mul (not correctly rounded).
        step = ops.divide(ops.multiply(lr, values), tf.gather(denominators, occurrence))
        self.assign_sub(variable, tf.IndexedSlices(step, indices, dense_shape))

    functools.update_wrapper(update_step, stock)
    update_step.__doc__ = (
        f"{stock.__doc__ or ''} A tf.IndexedSlices gradient of a ps variable: touched rows only (psclient)."
    )
    Adagrad.update_step = update_step


def ps_variable(variable):
    """The `tf.Variable` an optimizer update of `variable` writes if it is on a ps task, else None.

    `variable`: a Keras variable or its value (what Keras's TF optimizer
    passes to `update_step`). A partitioned value counts while its update
    is traced shard by shard: the shard's `tf.Variable`.
    """
    import keras
    from psclient._coordinator.runtime import ps_index_of
    from psclient._coordinator.variables.sharding import is_partitioned

    value = seam.internal(variable, "_value") if isinstance(variable, keras.Variable) else variable
    if is_partitioned(value):
        value = value.focused
    if isinstance(value, tf.Variable) and ps_index_of(value.device) is not None:
        return value
    return None
