"""Where a key goes and how its row starts: splitmix64 over int64 keys, with TF ops.

`shard_of` splits keys over the ps tasks; `initial_rows` draws a new key's
row from a stream seeded by the key, so it is the same on any ps, worker or
process, with or without a cluster.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["initial_rows", "mix64", "shard_of"]

_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # splitmix64's constants, as int64
_MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_2 = 0x94D049BB133111EB - 2**64


def _shift(x, bits: int):
    """Logical right shift of int64 (TF's is arithmetic on signed types)."""
    return tf.bitwise.bitwise_and(tf.bitwise.right_shift(x, bits), (1 << (64 - bits)) - 1)


def mix64(x):
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic): well-spread bits from any keys."""
    x = x + tf.constant(_GOLDEN, tf.int64)
    x = tf.bitwise.bitwise_xor(x, _shift(x, 30)) * tf.constant(_MIX_1, tf.int64)
    x = tf.bitwise.bitwise_xor(x, _shift(x, 27)) * tf.constant(_MIX_2, tf.int64)
    return tf.bitwise.bitwise_xor(x, _shift(x, 31))


def shard_of(keys, shards: int):
    """The shard of each int64 key."""
    return tf.cast(_shift(mix64(keys), 1) % shards, tf.int32)


def _dim_salts(dim: int, stream: int):
    """`dim` distinct well-spread int64 constants (splitmix64's sequence), one per column of a row."""
    import numpy as np

    with np.errstate(over="ignore"):
        steps = (np.arange(1, dim + 1, dtype=np.uint64) + np.uint64(stream * dim)) * np.uint64(_GOLDEN + 2**64)
        x = steps ^ (steps >> np.uint64(30))
        x = x * np.uint64(_MIX_1 + 2**64)
        x = x ^ (x >> np.uint64(27))
    return tf.constant(x.view(np.int64))


def _unit(x):
    """Uniform floats in [0, 1) from int64 `x`: a multiply-xorshift round, then the product's top 53 bits."""
    x = x * tf.constant(_MIX_1, tf.int64)
    x = tf.bitwise.bitwise_xor(x, _shift(x, 32)) * tf.constant(_MIX_2, tf.int64)
    return tf.cast(_shift(x, 11), tf.float64) * 2.0**-53


def initial_rows(keys, dim: int, init: tuple):
    """A new row per key, drawn from a stream seeded by the key itself.

    So a key's first row is the same on any ps, worker or process, with or
    without a cluster. `init`: ("uniform", low, high, seed),
    ("normal", mean, stddev, seed) or ("constant", value, 0, seed); `low`,
    `high` (...) and `seed` may also be tensors of one value per key (keys
    of several tables drawn at once).

    Few ops, as a step draws rows for every table it touches: the key's
    `mix64` (which `shard_of` computes too: one op in a traced step) xor
    the seed's, then per column one multiply-xorshift round of that xor a
    column constant.
    """
    kind, a, b, seed = init

    def per_key(value, dtype):  # a scalar, or one value per key as a column
        value = tf.convert_to_tensor(value, dtype)
        return value[:, None] if value.shape.rank == 1 else value

    a, b = per_key(a, tf.float64), per_key(b, tf.float64)
    if kind == "constant":
        return tf.cast(a + tf.zeros(tf.stack([tf.size(keys), dim]), tf.float64), tf.float32)
    base = tf.bitwise.bitwise_xor(mix64(keys), mix64(tf.convert_to_tensor(seed, tf.int64)))[:, None]
    u = _unit(tf.bitwise.bitwise_xor(base, _dim_salts(dim, 0)[None, :]))
    if kind == "uniform":
        return tf.cast(a + (b - a) * u, tf.float32)
    u2 = _unit(tf.bitwise.bitwise_xor(base, _dim_salts(dim, 1)[None, :]))
    normal = tf.sqrt(-2.0 * tf.math.log1p(-u)) * tf.cos(2.0 * 3.141592653589793 * u2)  # Box-Muller
    return tf.cast(a + b * normal, tf.float32)
