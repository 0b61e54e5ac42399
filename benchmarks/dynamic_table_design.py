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

    python benchmarks/dynamic_table_design.py --memory [--rows 200000 --dims 8,32 --cycles 50]

measures instead, in one process per layout and no cluster, the resident
memory a shard's storage takes per row (RSS growth / rows), after filling
`--rows` rows (keys, one Adagrad slot, counters) and again after `--cycles`
churn cycles (each removes the oldest tenth of the rows and admits as many
new keys), for four layouts:

  three_tables  the storage of a table without capacity: MutableHashTables key -> counters int64[2],
                key -> row float32[dim], key -> slot float32[dim]
  concat_table  key -> row and slot concatenated float32[2 * dim], beside
                the counters table
  index_dense   preallocated tf.Variables [rows, dim] for the rows and the
                slot, int64[rows] sightings and last-seen indexed by row,
                and one MutableHashTable key -> row index; a victim's row
                is reused by the next new key (the storage with capacity
                before the open-addressing index)
  index_open    what a table with capacity holds now: the same variables
                without the sightings (key and last-seen per row) and
                psclient's open-addressing key index (`KeyIndex`: TF's
                DenseHashTable, rebuilt when removals wear it)

Payload: `dim * (1 + slots) * 4` bytes per row (the floats that must be
held), and the target's formula `(dim + slots) * 4`; both ratios are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _memory_one(layout: str, dim: int, rows: int, cycles: int) -> dict:
    """RSS growth per row of one storage layout, in this process (run in a fresh one)."""
    import psutil
    import tensorflow as tf

    proc = psutil.Process()
    tf.constant(0) + 1  # TF's runtime up before the baseline
    batch = 10_000
    before = proc.memory_info().rss
    if layout == "index_open":
        from psclient._coordinator.tables.key_index import KeyIndex

        open_index = KeyIndex(rows, "memory")
        values = tf.Variable(tf.zeros([rows, dim]))
        slot = tf.Variable(tf.zeros([rows, dim]))
        row_key = tf.Variable(tf.zeros([rows], tf.int64))
        last = tf.Variable(tf.fill([rows], tf.constant(-1, tf.int64)))

        def admit(keys, at):
            open_index.insert(keys, at)
            row_key.scatter_update(tf.IndexedSlices(keys, at))
            values.scatter_update(tf.IndexedSlices(tf.random.uniform([len(at), dim]), at))
            slot.scatter_update(tf.IndexedSlices(tf.fill([len(at), dim], 0.1), at))
            last.scatter_update(tf.IndexedSlices(tf.fill([len(at)], tf.constant(1, tf.int64)), at))

        def evict(keys):
            at = open_index.lookup(keys)
            open_index.remove(keys)
            last.scatter_update(tf.IndexedSlices(tf.fill([len(keys)], tf.constant(-1, tf.int64)), at))
            held = tf.reshape(tf.where(last >= 0), [-1])
            open_index.rebuild_if_worn(lambda: (tf.gather(row_key, held), held))
            return at
    elif layout == "index_dense":
        index = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, -1)
        values = tf.Variable(tf.zeros([rows, dim]))
        slot = tf.Variable(tf.zeros([rows, dim]))
        counts = tf.Variable(tf.zeros([rows], tf.int64))
        last = tf.Variable(tf.fill([rows], tf.constant(-1, tf.int64)))

        def admit(keys, at):
            index.insert(keys, at)
            values.scatter_update(tf.IndexedSlices(tf.random.uniform([len(at), dim]), at))
            slot.scatter_update(tf.IndexedSlices(tf.fill([len(at), dim], 0.1), at))
            counts.scatter_update(tf.IndexedSlices(tf.ones([len(at)], tf.int64), at))
            last.scatter_update(tf.IndexedSlices(tf.fill([len(at)], tf.constant(1, tf.int64)), at))

        def evict(keys):
            at = index.lookup(keys)
            index.remove(keys)
            return at
    else:
        width = 2 * dim if layout == "concat_table" else dim
        counters = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, tf.constant([0, -1], tf.int64))
        tables = [tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, tf.zeros([width]))]
        if layout == "three_tables":
            tables.append(tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, tf.zeros([dim])))

        def admit(keys, at):
            counters.insert(keys, tf.ones([len(keys), 2], tf.int64))
            for table in tables:
                table.insert(keys, tf.random.uniform([len(keys), int(table._default_value.shape[0])]))

        def evict(keys):
            for table in (counters, *tables):
                table.remove(keys)
            return None

    def added(n):
        return round((proc.memory_info().rss - before) / n)

    order = np.arange(rows, dtype="int64") * 7919 + 1  # keys in admission order
    for start in range(0, rows, batch):
        admit(tf.constant(order[start:start + batch]), tf.range(start, min(rows, start + batch), dtype=tf.int64))
    filled = added(rows)
    next_key = int(order[-1]) + 7919
    churn = rows // 10
    for cycle in range(cycles):
        oldest, order = order[:churn], order[churn:]
        freed = evict(tf.constant(oldest))
        new = np.arange(next_key, next_key + churn * 7919, 7919, dtype="int64")[:churn]
        next_key += churn * 7919
        admit(tf.constant(new), freed)
        order = np.concatenate([order, new])
    return {"bytes_per_row_filled": filled, "bytes_per_row_after_churn": added(rows)}


def memory(args) -> int:
    """Run `_memory_one` for every layout and dim, each in a fresh process; print JSON."""
    import subprocess
    import sys

    result = {"rows": args.rows, "cycles": args.cycles, "churned_keys": args.cycles * (args.rows // 10),
              "slots": 1, "layouts": {}}
    for dim in [int(d) for d in args.dims.split(",")]:
        payload, formula = dim * 2 * 4, (dim + 1) * 4
        for layout in args.layouts.split(","):
            out = subprocess.run(
                [sys.executable, __file__, "--memory-one", layout, "--dim", str(dim), "--rows", str(args.rows),
                 "--cycles", str(args.cycles)], check=True, capture_output=True, text=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            for key in ("filled", "after_churn"):
                got[f"vs_payload_{key}"] = round(got[f"bytes_per_row_{key}"] / payload, 2)
                got[f"vs_formula_{key}"] = round(got[f"bytes_per_row_{key}"] / formula, 2)
            result["layouts"][f"{layout}_dim{dim}"] = {"payload_bytes_per_row": payload,
                                                       "formula_bytes_per_row": formula, **got}
            print(json.dumps({f"{layout}_dim{dim}": result["layouts"][f"{layout}_dim{dim}"]}), file=sys.stderr)
    print(json.dumps(result))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--memory", action="store_true", help="memory per row of storage layouts (no cluster)")
    parser.add_argument("--layouts", default="three_tables,concat_table,index_dense,index_open",
                        help="with --memory: which layouts, comma-separated")
    parser.add_argument("--memory-one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dims", default="8,32")
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    if args.memory_one:
        print(json.dumps(_memory_one(args.memory_one, args.dim, args.rows, args.cycles)))
        return 0
    if args.memory:
        if args.rows == parser.get_default("rows"):
            args.rows = 200_000
        return memory(args)

    import tensorflow as tf

    import psclient

    rng = np.random.default_rng(0)
    keys = rng.choice(1 << 40, size=args.rows, replace=False).astype("int64")
    with psclient.LocalCluster(num_workers=2, num_ps=2, start_method="spawn") as cluster:
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
