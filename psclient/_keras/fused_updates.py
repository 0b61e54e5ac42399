"""Adam's and SGD's dense update of a ps variable in one kernel: TF's `ResourceApply*` ops.

See `install`. Keras 3.10-3.15 (`psclient._keras.seam` lists the internals).
"""

from __future__ import annotations

import functools

import tensorflow as tf

from psclient._keras import seam
from psclient._keras.sparse_adagrad import ps_variable
from psclient._tf import write_marks

__all__ = ["install"]

#: The dtypes TF's CPU kernels of these ops are registered for (real ones).
_KERNEL_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def install() -> None:
    """Keras's Adam (and AdamW) and SGD with a dense gradient of a ps variable: one op each.

    Keras's `update_step` (Keras 3.10-3.15) updates a weight with element-wise
    ops on its ps, each a pass over the weight's bytes: Adam about fifteen,

        m += (g - m) * (1 - beta_1)
        v += (g**2 - v) * (1 - beta_2)
        w -= m * alpha / (sqrt(v) + epsilon),  alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)

    SGD with momentum five to eight (`m = m * momentum - g * lr`, then
    `w += m`, or Nesterov's `w += m * momentum - g * lr`), plain SGD two
    (`w -= g * lr`). TF's kernels compute the same formulas in one pass:
    `ResourceApplyAdam`, `ResourceApplyKerasMomentum`,
    `ResourceApplyGradientDescent`. Each holds its variables' locks for the
    whole update (`use_locking=True`), so two workers' updates of one
    weight no longer interleave between the slots' and the weight's writes.
    Measured in one process for the 784-512-512-10 MLP's six weights: Adam
    1.9 against 0.9 ms of CPU an update; on the cluster, a ps's CPU per
    `fit` step fell by about 1.1 ms (docs/benchmarks.md, "Adam in one kernel
    on the ps").

    Rounding: the SGD kernels give Keras's results bit for bit (the same
    products and sums, in the same order). Adam's forms `1 - beta_1` and
    `1 - beta_2` from the betas in the weight's dtype, where Keras forms
    them in Python floats, then rounds: the result is Keras's Adam with its
    betas rounded to float32 (equal at rtol 1e-6), not Keras's bit for bit
    (`tests/strategy/test_ps_updates.py` checks both).

    Only for an optimizer of exactly Keras's `Adam`, `AdamW` or `SGD` class
    (a subclass may change the update or its slots: subclassing is also how
    to keep Keras's own ops), a weight whose value is a `tf.Variable` on a
    ps task (or a partitioned one's shard while its update is traced shard
    by shard), its slots on the same task, a dense gradient, Adam's
    `amsgrad=False`, and a dtype the kernels have: everything else runs
    Keras's own `update_step`. The variables' write marks (a checkpoint's
    copy before its cut) are set as Keras's `assign_*` calls set them:
    written whole.
    """
    import keras
    from keras.src.optimizers.adam import Adam
    from keras.src.optimizers.sgd import SGD

    _fuse(Adam, (keras.optimizers.Adam, keras.optimizers.AdamW), _adam, "ResourceApplyAdam")
    _fuse(SGD, (keras.optimizers.SGD,), _sgd, "ResourceApplyKerasMomentum or ResourceApplyGradientDescent")


def _fuse(cls, fused_classes: tuple, apply, kernel: str) -> None:
    """Patch `cls.update_step`: for an optimizer of one of `fused_classes` (exactly) and a dense
    gradient, `apply(optimizer, gradient, weight, learning_rate)` returns (the kernel's op, the
    variables it wrote), or None to leave the update to Keras's own `update_step`."""
    stock = cls.update_step

    def update_step(self, gradient, variable, learning_rate):
        written = None
        if type(self) in fused_classes and not isinstance(gradient, tf.IndexedSlices):
            written = apply(self, gradient, variable, learning_rate)
        if written is None:
            return stock(self, gradient, variable, learning_rate)
        update, variables = written
        if write_marks.marking():
            for each in variables:
                marks = write_marks.marks_of(each)
                if marks is not None:
                    marks.mark_whole(update)

    functools.update_wrapper(update_step, stock)
    update_step.__doc__ = f"{stock.__doc__ or ''} A dense gradient of a ps variable: TF's {kernel} (psclient)."
    cls.update_step = update_step


def _adam(optimizer, gradient, variable, learning_rate):
    if optimizer.amsgrad:
        return None
    index = optimizer._get_variable_index(variable)
    found = _on_one_ps(variable, seam.internal(optimizer, "_momentums")[index],
                       seam.internal(optimizer, "_velocities")[index])
    if found is None:
        return None
    from keras import ops

    weight, momentum, velocity = found
    dtype = weight.dtype
    local_step = ops.cast(optimizer.iterations + 1, dtype)  # the step's powers as Keras forms them
    update = tf.raw_ops.ResourceApplyAdam(
        var=weight.handle, m=momentum.handle, v=velocity.handle,
        beta1_power=ops.power(ops.cast(optimizer.beta_1, dtype), local_step),
        beta2_power=ops.power(ops.cast(optimizer.beta_2, dtype), local_step),
        lr=ops.cast(learning_rate, dtype),
        beta1=ops.cast(optimizer.beta_1, dtype), beta2=ops.cast(optimizer.beta_2, dtype),
        epsilon=ops.cast(optimizer.epsilon, dtype),
        grad=ops.cast(gradient, dtype), use_locking=True, use_nesterov=False)
    return update, found


def _sgd(optimizer, gradient, variable, learning_rate):
    from keras import ops

    if optimizer.momentum == 0:
        found = _on_one_ps(variable)
        if found is None:
            return None
        weight, = found
        update = tf.raw_ops.ResourceApplyGradientDescent(
            var=weight.handle, alpha=ops.cast(learning_rate, weight.dtype),
            delta=ops.cast(gradient, weight.dtype), use_locking=True)
        return update, found
    found = _on_one_ps(variable, optimizer.momentums[optimizer._get_variable_index(variable)])
    if found is None:
        return None
    weight, accumulator = found
    dtype = weight.dtype
    update = tf.raw_ops.ResourceApplyKerasMomentum(
        var=weight.handle, accum=accumulator.handle, lr=ops.cast(learning_rate, dtype),
        grad=ops.cast(gradient, dtype), momentum=ops.cast(optimizer.momentum, dtype),
        use_locking=True, use_nesterov=bool(optimizer.nesterov))
    return update, found


def _on_one_ps(*variables):
    """The `tf.Variable`s on ps tasks that `variables` (a weight, then its slots) write, or None where
    one kernel cannot take them: a local one, a slot on another task (synchronous training's can
    be: Keras's ops then move the values), another dtype or shape, a dtype the kernels lack."""
    found = tuple(ps_variable(v) for v in variables)
    if any(v is None for v in found) or found[0].dtype not in _KERNEL_DTYPES:
        return None
    weight = found[0]
    if any(v.device != weight.device or v.dtype != weight.dtype or v.shape != weight.shape for v in found[1:]):
        return None
    return found
