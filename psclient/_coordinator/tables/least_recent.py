"""The least recently used entries of a table shard: what eviction frees (`psclient._core.dynamic_tables`' rules).

A selection, not a sort of the whole shard: the k-th smallest last-seen step
(`top_k`) splits the members into those seen before it (all go) and those
seen at it, of which the keys up to the needed-th smallest go (a second
`top_k`). `least_recent` for one shard (its scans; hash shards too),
`least_recent_rows` for the alike shards of a joint admission at once.
"""

from __future__ import annotations

import tensorflow as tf

from psclient._tf.control_flow import called_cond

__all__ = ["least_recent", "least_recent_rows"]

_NEWEST = 2**63 - 1  # sorts after every step; ~x reverses the order of int64 without overflow


# Up to this many entries the LRU selection runs every step, even with nothing to evict; above, it
# runs under a conditional. Measured on a ps: a conditional in a step cost about a millisecond,
# the selection about 9 ns an entry (2.4 ms of ps CPU a step at 260,000 rows).
_SELECT_WITHOUT_CONDITIONAL_UP_TO = 1 << 17


def least_recent(keys, last, member, k, entries: int | None = None):
    """A mask of the `k` least recently seen `member` entries (ties: the smaller key first; keys unique).

    `entries`: how many there are at most, when known (it decides whether a conditional skips the
    work for k == 0).
    """
    def pick():
        # ~x reverses the order of int64 without overflow; non-members sort last.
        masked = tf.where(member, last, tf.constant(_NEWEST, tf.int64))
        top = tf.math.top_k(tf.bitwise.invert(masked), k=tf.cast(k, tf.int32), sorted=False).values
        threshold = tf.bitwise.invert(tf.reduce_min(top))
        below = member & (last < threshold)
        tie = member & (last == threshold)
        needed = k - tf.reduce_sum(tf.cast(below, tf.int64))
        tie_keys = tf.where(tie, keys, tf.constant(_NEWEST, tf.int64))
        smallest = tf.math.top_k(tf.bitwise.invert(tie_keys), k=tf.cast(needed, tf.int32), sorted=False).values
        upto = tf.bitwise.invert(tf.reduce_min(smallest))
        return below | (tie & (keys <= upto) & (needed > 0))  # nothing for k == 0

    if entries is not None and entries <= _SELECT_WITHOUT_CONDITIONAL_UP_TO:
        return pick()
    return called_cond(k > 0, pick, lambda: tf.zeros_like(member))


def least_recent_rows(keys, last, member, k):
    """Per row of [G, S] `last`: a mask of its `k[g]` least recently seen members (ties: the smaller key)."""
    masked = tf.where(member, last, tf.constant(_NEWEST, tf.int64))
    width = tf.shape(last)[1]
    top_k = tf.cast(tf.clip_by_value(tf.reduce_max(k), 1, tf.cast(width, tf.int64)), tf.int32)
    newest_first = tf.math.top_k(tf.bitwise.invert(masked), k=top_k, sorted=True).values
    # The k-th smallest step of each row (none for k == 0).
    at = tf.maximum(tf.cast(k, tf.int32) - 1, 0)
    threshold = tf.bitwise.invert(tf.gather(newest_first, at[:, None], batch_dims=1)[:, 0])
    threshold = tf.where(k > 0, threshold, tf.constant(-_NEWEST, tf.int64))
    below = member & (last < threshold[:, None])
    tie = member & (last == threshold[:, None])
    needed = k - tf.reduce_sum(tf.cast(below, tf.int64), 1)
    tie_keys = tf.where(tie, keys, tf.constant(_NEWEST, tf.int64))
    smallest = tf.math.top_k(tf.bitwise.invert(tie_keys), sorted=True,
                             k=tf.cast(tf.clip_by_value(tf.reduce_max(needed), 1, tf.cast(width, tf.int64)), tf.int32)).values
    upto = tf.bitwise.invert(tf.gather(smallest, tf.maximum(tf.cast(needed, tf.int32) - 1, 0)[:, None],
                                       batch_dims=1)[:, 0])
    upto = tf.where(needed > 0, upto, tf.constant(-_NEWEST, tf.int64))
    return below | (tie & (keys <= upto[:, None]) & (needed[:, None] > 0))
