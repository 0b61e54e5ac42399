"""Which storage for dynamic embedding rows on a ps: measured, not guessed.

Three ways to hold `rows` int64 keys -> float32[dim] on ps task 0, each used
from a tf.function that psclient's `strategy.schedule` runs on a worker: look
up a batch of keys (some new) and write the touched rows back, as a training
step does.

  mutable_hash   tf.lookup.experimental.MutableHashTable, the row is the value
  dense_hash     tf.lookup.experimental.DenseHashTable (open addressing)
  index_variable MutableHashTable key -> row index beside a fixed-capacity
                 tf.Variable [capacity, dim]: gather / scatter_update the rows
                 (new keys get a row index from a counter; no free list here,
                 which only makes this path cheaper than a real one)

    python benchmarks/dynamic_table_design.py [--rows 100000 --batch 4096 --dim 16 --steps 40]

Prints one JSON object: milliseconds per step (median of `--steps` scheduled
calls, each joined) and the ratio to mutable_hash.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)

    import tensorflow as tf

    import psclient

    rng = np.random.default_rng(0)
    keys = rng.choice(1 << 40, size=args.rows, replace=False).astype("int64")
    with psclient.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = psclient.ParameterServerStrategy(cluster.cluster, variable_partitioner=None)
        try:
            with strategy.scope(), tf.device("/job:ps/task:0"):
                zeros = tf.zeros([args.dim])
                mutable = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, zeros)
                dense = tf.lookup.experimental.DenseHashTable(
                    tf.int64, tf.float32, zeros, empty_key=-1, deleted_key=-2)
                index = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, -1)
                values = tf.Variable(tf.zeros([2 * args.rows, args.dim]))
                next_row = tf.Variable(tf.constant(args.rows, tf.int64))
                init = tf.random.uniform([args.rows, args.dim])
                mutable.insert(keys, init)
                dense.insert(keys, init)
                index.insert(keys, tf.range(args.rows, dtype=tf.int64))
                values[: args.rows].assign(init)

            def batch():
                # 90% known keys, 10% new ones, as a stream of ids does.
                known = tf.gather(keys, tf.random.uniform([args.batch * 9 // 10], 0, args.rows, tf.int64))
                new = tf.random.uniform([args.batch // 10], 1 << 41, 1 << 42, tf.int64)
                unique, _ = tf.unique(tf.concat([known, new], 0))
                return unique

            def hash_step(table):
                @tf.function
                def step():
                    ids = batch()
                    with tf.device("/job:ps/task:0"):
                        rows = table.lookup(ids)
                    updated = rows - 0.01  # the "optimizer", on the worker
                    with tf.device("/job:ps/task:0"):
                        table.insert(ids, updated)
                    return tf.reduce_sum(rows)
                return step

            @tf.function
            def index_step():
                ids = batch()
                with tf.device("/job:ps/task:0"):
                    rows_at = index.lookup(ids)
                    missing = rows_at < 0
                    n_new = tf.reduce_sum(tf.cast(missing, tf.int64))
                    start = next_row.assign_add(n_new) - n_new
                    fresh = start + tf.cumsum(tf.cast(missing, tf.int64), exclusive=True)
                    rows_at = tf.where(missing, fresh, rows_at) % (2 * args.rows)
                    index.insert(ids, rows_at)
                    rows = tf.gather(values, rows_at)
                updated = rows - 0.01
                with tf.device("/job:ps/task:0"):
                    values.scatter_update(tf.IndexedSlices(updated, rows_at))
                return tf.reduce_sum(rows)

            result = {"rows": args.rows, "batch": args.batch, "dim": args.dim, "steps": args.steps}
            for name, fn in (("mutable_hash", hash_step(mutable)), ("dense_hash", hash_step(dense)),
                             ("index_variable", index_step)):
                strategy.schedule(fn).result()  # trace and warm up
                times = []
                for _ in range(args.steps):
                    started = time.perf_counter()
                    strategy.schedule(fn).result()
                    times.append(time.perf_counter() - started)
                result[f"{name}_ms_per_step"] = round(1000 * statistics.median(times), 2)
            base = result["mutable_hash_ms_per_step"]
            for name in ("dense_hash", "index_variable"):
                result[f"{name}_vs_mutable_hash"] = round(result[f"{name}_ms_per_step"] / base, 2)
            result["rows_after"] = {"mutable_hash": int(mutable.size()), "dense_hash": int(dense.size()),
                                    "index_variable": int(index.size())}
        finally:
            strategy.shutdown()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
