"""Adam's dense update of a ps variable in one kernel: TF's `ResourceApplyAdam`.

See `install`. Keras 3.10-3.15 (`psclient._keras.seam` lists the internals).
"""

from __future__ import annotations

import functools

import tensorflow as tf

from psclient._keras import seam
from psclient._tf import write_marks

__all__ = ["install"]

#: The dtypes TF's CPU kernel of ResourceApplyAdam is registered for (real ones).
_KERNEL_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def install() -> None:
    """Adam (and AdamW, which inherits its update) with a dense gradient of a ps variable: one op.

    Keras's `Adam.update_step` (Keras 3.10-3.15) updates a weight `w` with
    its slots `m` and `v` as about fifteen ops on its ps, each a pass over
    the weight's bytes:

        m += (g - m) * (1 - beta_1)
        v += (g**2 - v) * (1 - beta_2)
        w -= m * alpha / (sqrt(v) + epsilon),  alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)

    TF's `ResourceApplyAdam` kernel computes the same formula in one pass
    over `w`, `m`, `v` and `g`, and holds the three variables' locks for
    the whole update (`use_locking=True`), so two workers' updates of one
    weight no longer interleave between the slot and the weight writes.
    Measured in one process for the 784-512-512-10 MLP's six weights: 1.9
    against 0.9 ms of CPU an update; on the cluster, a ps's CPU per `fit`
    step fell by about 1.2 ms (docs/benchmarks.md, "Adam in one kernel on
    the ps"). What differs from Keras's ops is rounding: the kernel forms
    `1 - beta_1` and `1 - beta_2` from the betas in the weight's dtype,
    where Keras forms them in Python floats, then rounds: the result is
    Keras's Adam with its betas rounded to float32 (equal at rtol 1e-6;
    `tests/strategy/test_ps_updates.py`), not Keras's bit for bit.

    Only for an optimizer of exactly Keras's `Adam` or `AdamW` class (a
    subclass may change the update or its slots: subclassing is also how to
    keep Keras's own ops), a weight whose value is a `tf.Variable` on a ps
    task (or a partitioned one's shard while its update is traced shard by
    shard), its slots on the same task, a dense gradient, `amsgrad=False`,
    and a dtype the kernel has: everything else runs Keras's own
    `update_step`. The three variables' write marks (a checkpoint's copy
    before its cut) are set as Keras's `assign_*` calls set them: written
    whole.
    """
    import keras
    from keras import ops
    from keras.src.optimizers.adam import Adam

    stock = Adam.update_step

    fused_classes = (keras.optimizers.Adam, keras.optimizers.AdamW)  # exactly these (see above)

    def update_step(self, gradient, variable, learning_rate):
        targets = None
        if type(self) in fused_classes and not self.amsgrad and not isinstance(gradient, tf.IndexedSlices):
            targets = _targets(self, variable)
        if targets is None:
            return stock(self, gradient, variable, learning_rate)
        weight, momentum, velocity = targets
        dtype = weight.dtype
        # The step's powers as Keras forms them (same ops, same dtype).
        local_step = ops.cast(self.iterations + 1, dtype)
        update = tf.raw_ops.ResourceApplyAdam(
            var=weight.handle, m=momentum.handle, v=velocity.handle,
            beta1_power=ops.power(ops.cast(self.beta_1, dtype), local_step),
            beta2_power=ops.power(ops.cast(self.beta_2, dtype), local_step),
            lr=ops.cast(learning_rate, dtype),
            beta1=ops.cast(self.beta_1, dtype), beta2=ops.cast(self.beta_2, dtype),
            epsilon=ops.cast(self.epsilon, dtype),
            grad=ops.cast(gradient, dtype), use_locking=True, use_nesterov=False)
        for written in targets:
            marks = write_marks.marks_of(written)
            if marks is not None and write_marks.marking():
                marks.mark_whole(update)

    functools.update_wrapper(update_step, stock)
    update_step.__doc__ = (
        f"{stock.__doc__ or ''} A dense gradient of a ps variable: TF's ResourceApplyAdam, one op (psclient)."
    )
    Adam.update_step = update_step


def _targets(optimizer, variable):
    """(weight, m, v) as the `tf.Variable`s on ps tasks the update writes, or None where the kernel
    cannot take them (a local weight, a slot elsewhere, a dtype the kernel lacks)."""
    from psclient._keras.sparse_adagrad import ps_variable

    index = optimizer._get_variable_index(variable)
    found = (ps_variable(variable), ps_variable(seam.internal(optimizer, "_momentums")[index]),
             ps_variable(seam.internal(optimizer, "_velocities")[index]))
    if any(v is None for v in found) or found[0].dtype not in _KERNEL_DTYPES:
        return None
    # One kernel reads and writes all three: on one task, of one dtype and shape (slots placed on
    # another ps, as synchronous training's can be, keep Keras's ops, which move the values).
    weight = found[0]
    if any(v.device != weight.device or v.dtype != weight.dtype or v.shape != weight.shape for v in found[1:]):
        return None
    return found
