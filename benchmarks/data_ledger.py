"""Cost of `psclient.data.ShardedDataset` against today's per-worker datasets, side by side.

Two comparisons, in coordinator processes on one LocalCluster:

1. steps/s over the same data and step: a `ShardedDataset` epoch (one
   closure per shard) against the per-worker repeated dataset (one closure
   per step, as `fit` with `steps_per_epoch` runs it), in one coordinator
   process, their epochs alternating (a shared machine's changing load
   weighs on both alike). Ratio sharded/repeated.
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


def _sharded(strategy, step, features, args):
    """One ShardedDataset epoch per call (after a warm-up epoch: traces, datasets)."""
    import tensorflow as tf

    import psclient

    data = psclient.data.ShardedDataset(
        psclient.data.range_shards(args.records, args.shard),
        lambda shard: tf.data.Dataset.range(shard.start, shard.end).map(features).batch(args.batch))
    feed = psclient.data.ShardFeed(strategy, data)
    run_shard = feed.shard_function(step)
    epochs = iter(range(1_000_000))
    feed.run_epoch(run_shard, next(epochs))
    return lambda: feed.run_epoch(run_shard, next(epochs))["replayed_records"]


def _repeated(strategy, step, features, args):
    """One epoch of the per-worker repeated dataset per call: one closure per step."""
    import tensorflow as tf

    dataset = strategy.distribute_datasets_from_function(
        lambda ctx: tf.data.Dataset.range(args.records).map(features).batch(args.batch).repeat())
    iterator = iter(dataset)

    @tf.function
    def one(iterator):
        step(next(iterator))

    def epoch():
        for _ in range(args.records // args.batch):
            strategy.schedule(one, args=(iterator,))
        strategy.join()

    epoch()
    return epoch


def _static(strategy, step, features, args):
    """One epoch of a static shard(num_workers, index) split per call: each worker reads its
    own part to its end, in one closure. Returns the batches read (each worker must take one
    closure for the split to hold)."""
    import tensorflow as tf

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

    def epoch():
        iterator = iter(strategy.distribute_datasets_from_function(per_worker))
        futures = [strategy.schedule(whole, args=(iterator,)) for _ in range(strategy.num_workers)]
        return sum(int(f.result()) for f in futures)

    epoch()
    return epoch


def child_main(args) -> None:
    global _STRATEGY
    _common.exit_with_parent()
    import psclient

    _STRATEGY = strategy = psclient.ParameterServerStrategy(psclient.Cluster.coerce(args.cluster_json))
    step, features = _step_and_data(args)
    batches = args.records // args.batch
    # "pair": the repeated and the sharded paths in one coordinator, their epochs alternating,
    # so that a machine whose load changes (a shared one) weighs on both alike.
    paths = ("repeated", "sharded") if args.path == "pair" else (args.path,)
    make = {"sharded": _sharded, "repeated": _repeated, "static": _static}
    epochs = {path: make[path](strategy, step, features, args) for path in paths}
    times = {path: [] for path in paths}
    extra = {path: [] for path in paths}
    for _ in range(args.epochs):
        for path in paths:
            start = time.perf_counter()
            extra[path].append(epochs[path]())
            times[path].append(time.perf_counter() - start)
    results = {}
    for path in paths:
        result = {"path": path, "batches": batches}
        if path == "sharded":
            result["replayed_records"] = sum(extra[path])
        if path == "static":
            result["batches_read"] = extra[path]
        result["epoch_s"] = _common.median(times[path])
        result["epoch_times_s"] = [round(t, 3) for t in times[path]]
        result["steps_per_s"] = batches / result["epoch_s"]
        results[path] = result
    _common.child_exit(results if args.path == "pair" else results[args.path])


def parent_main(args, argv) -> int:
    import json

    import psclient

    out = {"benchmark": "data_ledger", "config": {**_common.environment(argv), **vars(args)}}
    with psclient.LocalCluster(num_workers=2, num_ps=1, start_method="spawn") as local:
        spec = json.dumps(local.cluster.training_spec())

        def throttle(fraction):
            local.throttle("worker", 1, fraction)

        runs = {}
        for name, path, fraction in (("repeated and sharded", "pair", 1.0), ("static", "static", 1.0),
                                     ("sharded_throttled", "sharded", args.throttle),
                                     ("static_throttled", "static", args.throttle)):
            _common.log(f"{name}: worker 1 at {fraction}")
            throttle(fraction)
            try:
                result = _common.run_child(
                    [__file__, "--child", path, "--cluster-json", spec, *_passed(args)], timeout=args.timeout)
            finally:
                throttle(1.0)
            runs.update(result if path == "pair" else {name: result})
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
    parser.add_argument("--child", choices=("sharded", "repeated", "static", "pair"))
    parser.add_argument("--cluster-json")
    args = parser.parse_args(argv)
    if args.child:
        args.path = args.child
        import json

        args.cluster_json = json.loads(args.cluster_json)
        child_main(args)
        return 0
    return _common.run_parent(parent_main, args, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())
