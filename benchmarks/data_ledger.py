"""Cost of `psclient.data.ShardedDataset` against today's per-worker datasets, side by side.

Two comparisons, each path in its own coordinator process on one LocalCluster:

1. steps/s over the same data and step: a `ShardedDataset` epoch (one
   closure per shard) against the per-worker repeated dataset (one closure
   per step, as `fit` with `steps_per_epoch` runs it). Ratio sharded/repeated.
   A shard costs a fixed amount besides its batches (its closure, its
   dataset's iterator made on the worker: about 10 ms on a loaded 2-core
   machine), so the ratio depends on batches per shard: the defaults give
   32 batches a shard and 8 shards a worker.
2. epoch time with worker 1 throttled to `--throttle` of its speed
   (`LocalCluster.throttle`): the ShardedDataset (late binding) against a
   static `shard(num_workers, index)` split, where each worker reads its own
   half to its end. Each is also given unthrottled, and the ratios
   throttled/unthrottled are printed. The static path's steps/s is not
   comparable with the other two: each worker runs its whole half in one
   closure (an in-graph loop, no dispatch per step or per shard), so only its
   own throttled/unthrottled ratio is quoted.

    python benchmarks/data_ledger.py [--records 16384] [--batch 32] [--shard 1024] [--work 4]

One JSON object on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def _step_and_data(args):
    import tensorflow as tf

    with _STRATEGY.scope():
        weights = tf.Variable(tf.zeros([64, 1]))

    def features(i):
        x = tf.random.stateless_uniform([64], seed=tf.stack([i, i]))
        return x, tf.reduce_sum(x)

    def step(batch):
        x, y = batch
        h = tf.random.uniform([128, 128])
        for _ in range(args.work):  # some compute per step, so a throttled worker is slower
            h = tf.linalg.matmul(h, h) / 128.0
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.matmul(x, weights)[:, 0] - y) ** 2) + 0.0 * tf.reduce_sum(h)
        weights.assign_sub(0.01 * tape.gradient(loss, weights))

    return step, features


_STRATEGY = None


def child_main(args) -> None:
    global _STRATEGY
    _common.exit_with_parent()
    import tensorflow as tf

    import psclient

    _STRATEGY = strategy = psclient.ParameterServerStrategy(psclient.Cluster.coerce(args.cluster_json))
    step, features = _step_and_data(args)
    batches = args.records // args.batch
    result = {"path": args.path, "batches": batches}
    if args.path == "sharded":
        data = psclient.data.ShardedDataset(
            psclient.data.range_shards(args.records, args.shard),
            lambda shard: tf.data.Dataset.range(shard.start, shard.end).map(features).batch(args.batch))
        feed = psclient.data.ShardFeed(strategy, data)
        run_shard = feed.shard_function(step)
        feed.run_epoch(run_shard, 0)  # warm-up: traces, datasets
        times = []
        for epoch in range(1, args.epochs + 1):
            start = time.perf_counter()
            stats = feed.run_epoch(run_shard, epoch)
            times.append(time.perf_counter() - start)
        result["replayed_records"] = stats["replayed_records"]
    elif args.path == "repeated":
        dataset = strategy.distribute_datasets_from_function(
            lambda ctx: tf.data.Dataset.range(args.records).map(features).batch(args.batch).repeat())
        iterator = iter(dataset)

        @tf.function
        def one(iterator):
            step(next(iterator))

        times = []
        for epoch in range(args.epochs + 1):
            start = time.perf_counter()
            for _ in range(batches):
                strategy.schedule(one, args=(iterator,))
            strategy.join()
            times.append(time.perf_counter() - start)
        times = times[1:]  # the first is the warm-up
    else:  # static: each worker reads its own shard(num_workers, index) to its end, in one closure
        num_workers = strategy.num_workers

        def per_worker(ctx):
            return tf.data.Dataset.range(args.records).shard(ctx.num_input_pipelines, ctx.input_pipeline_id) \
                .map(features).batch(args.batch)

        @tf.function
        def whole(iterator):
            def body(i, optional):
                step(optional.get_value())
                return i + 1, iterator.get_next_as_optional()

            n, _ = tf.while_loop(lambda i, o: o.has_value(), body, (tf.constant(0), iterator.get_next_as_optional()))
            return n

        times, read = [], []
        for epoch in range(args.epochs + 1):
            iterator = iter(strategy.distribute_datasets_from_function(per_worker))
            start = time.perf_counter()
            futures = [strategy.schedule(whole, args=(iterator,)) for _ in range(num_workers)]
            read.append(sum(int(f.result()) for f in futures))
            times.append(time.perf_counter() - start)
        times = times[1:]
        result["batches_read"] = read[1:]  # each worker must take one closure for the split to hold
    result["epoch_s"] = _common.median(times)
    result["epoch_times_s"] = [round(t, 3) for t in times]
    result["steps_per_s"] = batches / result["epoch_s"]
    _common.child_exit(result)


def parent_main(args, argv) -> int:
    import json

    import psclient

    out = {"benchmark": "data_ledger", "config": {**_common.environment(argv), **vars(args)}}
    with psclient.LocalCluster(num_workers=2, num_ps=1) as local:
        spec = json.dumps(local.cluster.training_spec())

        def throttle(fraction):
            local.throttle("worker", 1, fraction)

        runs = {}
        for name, path, fraction in (("repeated", "repeated", 1.0), ("sharded", "sharded", 1.0),
                                     ("static", "static", 1.0), ("sharded_throttled", "sharded", args.throttle),
                                     ("static_throttled", "static", args.throttle)):
            _common.log(f"{name}: worker 1 at {fraction}")
            throttle(fraction)
            try:
                runs[name] = _common.run_child(
                    [__file__, "--child", path, "--cluster-json", spec, *_passed(args)], timeout=args.timeout)
            finally:
                throttle(1.0)
        out["runs"] = runs
        out["ratios"] = {
            "sharded_vs_repeated_steps_per_s": runs["sharded"]["steps_per_s"] / runs["repeated"]["steps_per_s"],
            "sharded_throttled_vs_unthrottled_epoch": runs["sharded_throttled"]["epoch_s"] / runs["sharded"]["epoch_s"],
            "static_throttled_vs_unthrottled_epoch": runs["static_throttled"]["epoch_s"] / runs["static"]["epoch_s"],
        }
    _common.print_json(out)
    return 0


def _passed(args) -> list[str]:
    return ["--records", str(args.records), "--batch", str(args.batch), "--shard", str(args.shard),
            "--work", str(args.work), "--epochs", str(args.epochs)]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--shard", type=int, default=1024)
    parser.add_argument("--work", type=int, default=4, help="128x128 matmuls per step")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--throttle", type=float, default=0.25)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--child", choices=("sharded", "repeated", "static"))
    parser.add_argument("--cluster-json")
    args = parser.parse_args(argv)
    if args.child:
        args.path = args.child
        import json

        args.cluster_json = json.loads(args.cluster_json)
        child_main(args)
        return 0
    return parent_main(args, ["benchmarks/data_ledger.py", *argv])


if __name__ == "__main__":
    sys.exit(main())
