"""Where a DynamicEmbedding training step spends its CPU, in one process (no cluster: the ps's share alone).

One table (a local shard: what one ps task runs) fed the stream of `dynamic_embeddings.py` (26 features'
ids in one table, `--batch` examples a step, most keys new), a `tf.function` step of lookup, gradient and
Adagrad update. Printed, CPU ms per step (this process, after `--warmup` steps):

  unique            tf.unique_with_counts of the batch's keys (every path does it)
  lookup_only       the training lookup (counters, admission, new rows, rows read), no update
  step_unbounded    lookup + update, capacity=None (no eviction)
  step_capacity     lookup + update with `--capacity` (dense storage: the LRU eviction runs inside the
                    admission when the new rows would not fit)
  step_capacity_hash  the same in hash tables, the storage bounded tables had before (the LRU scan runs
                    when the shard is over its share)

and the LRU scan on a full shard of `--capacity` rows whose keys were last seen at random steps, in ms per
scan: `scan` (all of it: export of the counters, selection, removal from the tables), `scan_select`
(choosing the victims as the scan does now: the k-th least recent step by `top_k`, ties by key),
`scan_select_by_sorting` (the former way: a stable sort of the whole shard by key, then by step), and
`export_counters` and `remove_from_3_tables` alone. Also the graph's op count per table (one shard).

    python benchmarks/dynamic_step_profile.py [--capacity 130000 --batch 512 --steps 40]

Prints one JSON object. CPU time of this process, so load from other jobs matters less than for wall
time, but still some: compare the figures within one run.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import environment, print_json  # noqa: E402
from dynamic_embeddings import FEATURES, stream  # noqa: E402


def cpu_ms(fn, args_list) -> float:
    start = time.process_time()
    for args in args_list:
        fn(*args)
    return round(1000 * (time.process_time() - start) / len(args_list), 2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", type=int, default=130_000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)

    import keras
    import tensorflow as tf

    from psclient._coordinator.tables.dense_shard import least_recent
    from psclient._coordinator.tables.dynamic_tables import DynamicTable
    from psclient._coordinator.tables.hash_shard import export as _export
    from psclient._core.dynamic_tables import Policy
    from psclient.layers import DynamicEmbedding

    batches = [tf.constant(b) for b in stream(0, args.warmup + args.steps, args.batch, 50_000).reshape(
        -1, args.batch, FEATURES)]
    warm, timed = [(b,) for b in batches[: args.warmup]], [(b,) for b in batches[args.warmup:]]
    out = {"args": vars(args), "environment": environment(sys.argv), "cpu_ms_per_step": {}, "cpu_ms_per_scan": {}}

    unique = tf.function(lambda ids: tf.size(tf.unique_with_counts(tf.reshape(ids, [-1]))[0]))
    cpu_ms(unique, warm)
    out["cpu_ms_per_step"]["unique"] = cpu_ms(unique, timed)

    def layer_step(capacity, update: bool, name: str):
        layer = DynamicEmbedding(args.dim, capacity=capacity, name=name)
        layer.build()
        if name.endswith("_hash"):  # a layer without a strategy: its table made again in the hash storage
            layer.table = DynamicTable(name, args.dim, [None], layer._init, layer._policy, storage="hash")
        layer(batches[0], training=False)
        optimizer = keras.optimizers.Adagrad(0.05)

        @tf.function
        def step(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(ids, training=True) ** 2)
            if update:
                optimizer.apply(tape.gradient(loss, layer.trainable_variables), layer.trainable_variables)
            return loss

        return layer, step

    for key, capacity, update in (("lookup_only", None, False), ("step_unbounded", None, True),
                                  ("step_capacity", args.capacity, True),
                                  ("step_capacity_hash", args.capacity, True)):
        layer, step = layer_step(capacity, update, key)
        cpu_ms(step, warm)
        out["cpu_ms_per_step"][key] = cpu_ms(step, timed)
        if key.startswith("step_capacity"):
            graph = step.get_concrete_function(batches[0]).graph
            ops = collections.Counter(op.type for op in graph.get_operations())
            out.setdefault("ops_in_step_graph", {})[key] = sum(ops.values())
            out.setdefault("table_ops_in_step_graph", {})[key] = {
                k: v for k, v in sorted(ops.items()) if k.startswith("LookupTable")}
            out.setdefault("rows_after", {})[key] = layer.table_stats()[0]["rows"]
            out.setdefault("evictions", {})[key] = layer.table_stats()[0]["evictions"]

    # The scan on a full shard: capacity + one headroom's worth of rows over it.
    n = args.capacity + args.capacity // 8
    rng = np.random.default_rng(0)
    keys = tf.constant(rng.integers(0, 2**62, n))
    last = tf.constant(rng.integers(0, 200, n))
    table = DynamicTable("scan", args.dim, [None], ("uniform", -0.05, 0.05, 0), Policy(1, args.capacity, None),
                         storage="hash")
    table.ensure_slots({"accumulator": 0.1})
    shard = table.shards[0]

    def fill():
        shard.counters.insert(keys, tf.stack([tf.ones_like(last), last], 1))
        shard.values.insert(keys, tf.zeros([n, args.dim]))
        shard.slots["accumulator"].insert(keys, tf.zeros([n, args.dim]))

    def timed_after_fill(fn, rounds=5):
        total = 0.0
        for _ in range(rounds):
            fill()
            start = time.process_time()
            fn()
            total += time.process_time() - start
        return round(1000 * total / rounds, 2)

    evict = tf.function(lambda: table._evict(shard))
    excess = tf.constant(n - (args.capacity - args.capacity // 16), tf.int64)
    member = tf.ones([n], tf.bool)
    select = tf.function(lambda: least_recent(keys, last, member, excess))

    @tf.function
    def select_by_sorting():
        order = tf.argsort(keys, stable=True)
        order = tf.gather(order, tf.argsort(tf.gather(last, order), stable=True))
        return tf.scatter_nd(order[:, None], tf.range(n, dtype=tf.int64) < excess, [n])

    export = tf.function(lambda: _export(shard.counters)[0])
    victims = keys[: int(excess)]
    remove = tf.function(lambda: [shard.values.remove(victims), shard.counters.remove(victims),
                                  shard.slots["accumulator"].remove(victims)] and None)
    for name, fn in (("scan", evict), ("scan_select", select), ("scan_select_by_sorting", select_by_sorting),
                     ("export_counters", export), ("remove_from_3_tables", remove)):
        fill()
        fn()
        out["cpu_ms_per_scan"][name] = timed_after_fill(fn)
    out["scan_rows"], out["scan_evicts"] = n, int(excess)
    assert bool(tf.reduce_all(select() == select_by_sorting())), "the two selections differ"
    print_json(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
