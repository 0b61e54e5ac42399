"""Adafactor's update of a partitioned variable, shard by shard on each shard's ps.

Keras's Adafactor is not elementwise, so `sharding.split_update` cannot
trace its update once per shard: for a variable of shape (rows, cols) it
keeps a row factor `r` (rows,), a column factor `c` (cols,) and `v`, and

    alpha = max(epsilon_2, rms(variable)) * rho
    g2 = gradient ** 2 + epsilon_1
    r <- beta * r + (1 - beta) * mean(g2, axis=-1)
    c <- beta * c + (1 - beta) * mean(g2, axis=-2)        # over every row
    v <- (r / mean(r))[:, None] * c[None, :]               # mean over every row
    u = gradient / sqrt(v)
    variable -= alpha * u / max(1, rms(u) / clip_threshold)   # rms over everything

(a variable of one axis keeps `v <- beta * v + (1 - beta) * g2` instead).
The whole-variable terms are sums: each shard's ps computes its part of
them (a scalar, or one vector of `cols`), the parts are added up, and each
ps finishes its own rows with the totals. What travels per step is the
gradient's rows of each shard, `cols + 3` numbers per shard each way, and
`r` when it is not partitioned like the variable; never the variable or `v`.
Keras's ops, in Keras's order, so the results equal Keras's own update up
to the order of the sums (float rounding).

An embedding's `tf.IndexedSlices` gradient keeps Keras's sparse semantics:
the same Keras ops on each shard's rows (its squares densified on that
shard's ps, `u` per occurrence, the variable written with `scatter_sub`).
Only for a partitioned variable of one or two axes whose `v` is partitioned
like it (and `r` like it or not at all); anything else (three or more axes)
keeps Keras's `update_step`, on the whole variable. Keras 3.10-3.15
(`psclient._keras.seam`).
"""

from __future__ import annotations

import functools

import tensorflow as tf

from psclient._keras import seam

__all__ = ["install"]


def install() -> None:
    """Patch `Adafactor.update_step` (idempotent through install.py's guard)."""
    from keras.src.optimizers.adafactor import Adafactor

    stock = Adafactor.update_step

    def update_step(self, gradient, variable, learning_rate):
        plan = _plan(self, gradient, variable)
        if plan is None:
            return stock(self, gradient, variable, learning_rate)
        return _update_shards(self, gradient, variable, learning_rate, *plan)

    functools.update_wrapper(update_step, stock)
    update_step.__doc__ = (
        f"{stock.__doc__ or ''} A partitioned variable: shard by shard on each shard's ps (psclient)."
    )
    Adafactor.update_step = update_step


def _value(variable):
    """The tf.Variable (or partitioned one) of a Keras variable; a TF one as it is
    (Keras's TF optimizer gives `update_step` the weights' values)."""
    import keras

    return seam.internal(variable, "_value") if isinstance(variable, keras.Variable) else variable


def _plan(optimizer, gradient, variable):
    """(value, r, c, v) for a split update, or None for Keras's own."""
    from psclient._coordinator.variables.sharding import is_partitioned

    value = _value(variable)
    if not is_partitioned(value) or value.focused is not None:
        return None
    if len(variable.shape) not in (1, 2):
        return None
    if optimizer._overwrite_variable_with_gradient(variable):
        return None
    index = optimizer._get_variable_index(variable)
    r, c, v = (seam.internal(optimizer, name)[index] for name in ("_r", "_c", "_v"))
    if not _same_rows(_value(v), value):
        return None
    if len(variable.shape) == 2 and is_partitioned(_value(r)) and not _same_rows(_value(r), value):
        return None  # r split otherwise than the variable: Keras's own update
    return value, r, c, v


def _blend(beta, old, new):
    """beta * old + (1 - beta) * new, with Keras's ops in Keras's order."""
    from keras import ops

    return ops.add(ops.multiply(beta, old), ops.multiply(ops.subtract(1, beta), new))


def _rows_per_shard(value) -> tuple:
    return tuple(int(shard.shape[0]) for shard in value.variables)


def _same_rows(other, value) -> bool:
    from psclient._coordinator.variables.sharding import is_partitioned

    return is_partitioned(other) and _rows_per_shard(other) == _rows_per_shard(value)


def _update_shards(optimizer, gradient, variable, learning_rate, value, r, c, v):
    from keras import ops

    from psclient._coordinator.variables.sharding import is_partitioned, per_shard

    dtype = variable.dtype
    lr = ops.cast(learning_rate, dtype)
    epsilon_2 = ops.cast(optimizer.epsilon_2, dtype)
    one = ops.cast(1.0, dtype)
    local_step = ops.cast(optimizer.iterations + 1, dtype)
    if not callable(seam.internal(optimizer, "_learning_rate")) and optimizer.relative_step:
        lr = ops.minimum(lr, 1 / ops.sqrt(local_step))
    rho_t = ops.minimum(lr, 1 / ops.sqrt(local_step))
    beta_2_t = ops.subtract(1, ops.power(local_step, optimizer.beta_2_decay))

    shards = value.variables
    v_shards = _value(v).variables
    grads = [ops.cast(g, dtype) for g in per_shard(gradient, value)]  # sliced on the worker
    numel = float(value.shape.num_elements())
    factored = len(variable.shape) == 2
    rows = float(value.shape[0])
    r_value = _value(r) if factored else None
    r_split = factored and is_partitioned(r_value)

    # Each ps: its part of the sums, and its rows of r (and, one axis, of v).
    squares, row_parts, column_sums, row_sums = [], [], [], []
    start = 0
    for index, shard in enumerate(shards):
        stop = start + int(shard.shape[0])
        # Each slot's arithmetic where that slot (shard) lives: Keras may
        # place r's shards apart from the variable's.
        with tf.device(shard.device):
            squares.append(ops.sum(ops.square(shard)))
            g2 = ops.add(ops.square(grads[index]), optimizer.epsilon_1)
            if factored:
                row_means = ops.mean(g2, axis=-1)
                column_sums.append(ops.sum(g2, axis=-2))
        if factored:
            old_r = r_value.variables[index] if r_split else r_value
            with tf.device(old_r.device):
                old_rows = old_r if r_split else old_r[start:stop]
                new_r = _blend(beta_2_t, old_rows, row_means)
                if r_split:
                    old_r.assign(new_r)
                row_sums.append(ops.sum(new_r))
            row_parts.append(new_r)
        else:
            with tf.device(v_shards[index].device):
                new_v = _blend(beta_2_t, v_shards[index], g2)
                v_shards[index].assign(new_v)
            row_parts.append(new_v)
        start = stop

    alpha_t = ops.multiply(ops.maximum(epsilon_2, ops.sqrt(ops.divide(tf.add_n(squares), numel))), rho_t)
    if factored:
        if not r_split:
            with tf.device(r_value.device):
                optimizer.assign(r, ops.concatenate(row_parts, axis=0))
        new_c = _update_columns(optimizer, c, beta_2_t, ops.divide(tf.add_n(column_sums), rows))
        mean_r = ops.divide(tf.add_n(row_sums), rows)

    # Each ps: v for its rows, u, and its part of rms(u).
    updates, u_squares = [], []
    for index, shard in enumerate(shards):
        if factored:
            with tf.device(v_shards[index].device):
                new_v = ops.multiply(ops.expand_dims(ops.divide(row_parts[index], mean_r), axis=-1),
                                     ops.expand_dims(new_c, -2))
                v_shards[index].assign(new_v)
        else:
            new_v = row_parts[index]
        with tf.device(shard.device):
            u_t = ops.divide(grads[index], ops.sqrt(new_v))
            updates.append(u_t)
            u_squares.append(ops.sum(ops.square(u_t)))
    clip = ops.maximum(one, ops.divide(ops.sqrt(ops.divide(tf.add_n(u_squares), numel)),
                                       optimizer.clip_threshold))
    for shard, u_t in zip(shards, updates):
        with tf.device(shard.device):
            step = ops.multiply(alpha_t, ops.divide(u_t, clip))
            if isinstance(step, tf.IndexedSlices):  # as Keras's `assign_sub` does
                shard.scatter_sub(step)
            else:
                shard.assign_sub(step)


def _update_columns(optimizer, c, beta_2_t, column_means):
    """c <- beta * c + (1 - beta) * column means, where c lives (per shard if partitioned); new c."""
    from keras import ops

    from psclient._coordinator.variables.sharding import is_partitioned, per_shard

    c_value = _value(c)
    if not is_partitioned(c_value):
        with tf.device(c_value.device):
            new_c = _blend(beta_2_t, c_value, column_means)
            optimizer.assign(c, new_c)
        return new_c
    parts = []
    for shard, means in zip(c_value.variables, per_shard(column_means, c_value)):
        with tf.device(shard.device):
            parts.append(_blend(beta_2_t, shard, means))
            shard.assign(parts[-1])
    return ops.concatenate(parts, axis=0)
