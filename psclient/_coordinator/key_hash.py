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


def initial_rows(keys, dim: int, init: tuple):
    """A new row per key, drawn from a stream seeded by the key itself.

    So a key's first row is the same on any ps, worker or process, with or
    without a cluster. `init`: ("uniform", low, high, seed),
    ("normal", mean, stddev, seed) or ("constant", value, 0, seed); `low`,
    `high` (...) and `seed` may also be tensors of one value per key (keys
    of several tables drawn at once).
    """
    kind, a, b, seed = init

    def per_key(value, dtype):  # a scalar, or one value per key as a column
        value = tf.convert_to_tensor(value, dtype)
        return value[:, None] if value.shape.rank == 1 else value

    a, b = per_key(a, tf.float64), per_key(b, tf.float64)
    if kind == "constant":
        return tf.cast(a + tf.zeros(tf.stack([tf.size(keys), dim]), tf.float64), tf.float32)
    base = mix64(tf.bitwise.bitwise_xor(keys, tf.convert_to_tensor(seed, tf.int64)))
    h = mix64(base[:, None] + tf.range(dim, dtype=tf.int64)[None, :] * tf.constant(_GOLDEN, tf.int64))
    u = tf.cast(_shift(h, 11), tf.float64) * 2.0**-53  # [0, 1)
    if kind == "uniform":
        return tf.cast(a + (b - a) * u, tf.float32)
    u2 = tf.cast(_shift(mix64(h), 11), tf.float64) * 2.0**-53
    normal = tf.sqrt(-2.0 * tf.math.log1p(-u)) * tf.cos(2.0 * 3.141592653589793 * u2)  # Box-Muller
    return tf.cast(a + b * normal, tf.float32)
