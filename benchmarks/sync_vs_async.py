"""Time to accuracy: asynchronous, bounded-staleness and synchronous training, with and without a straggler.

Same model, data and step function in every run: scikit-learn's bundled
digits (1,797 8x8 images, offline; 80/20 split, stratified, seed 0), a
64-64-10 ReLU MLP, Adam(learning_rate), batch 32 per step, each worker reading
its own shard. A scheduled `train_step` computes the gradients of one batch
and calls `optimizer.apply_gradients`, as in the custom loop of the README's tour.
One LocalCluster of 4 workers and 1 ps; each run is a fresh coordinator
subprocess (one TF cluster connection per process) with these strategies:

  async          ParameterServerStrategy(cluster): every step applies its own
                 gradients when they are ready (psclient's default)
  async_bounded  ParameterServerStrategy(cluster, max_staleness=S)
  sync_k=n       ParameterServerStrategy(cluster, replicas_to_aggregate=4)
  sync_k=n-1     ParameterServerStrategy(cluster, replicas_to_aggregate=3)

each without a straggler and with one: worker 3 throttled to a quarter of its
speed (`LocalCluster.throttle("worker", 3, 0.25)`, held by the parent for the
whole run). A configuration the strategy does not accept (its signature has
no such argument: checked with `inspect.signature`) is recorded as
"not run: needs ..." instead of being measured.

A run first completes one step per worker (tracing, registration on each
worker; not timed), then keeps 2 steps per worker scheduled and measures the
test accuracy on the coordinator (weights read from the ps) every
`--eval-interval` s, without pausing the workers. Reported per run: wall time
from the end of the warm-up to the first evaluation at or above `--target`,
worker steps completed by then, model updates (`optimizer.iterations`, which
counts aggregated updates once in synchronous mode), steps per worker, and
`stats()["staleness"]` where the strategy reports it.

Usage:
  python benchmarks/sync_vs_async.py [--repeats 1] [--target 0.95] [--quick]

`--quick`: target 0.90 and a 60 s budget per run. Prints one JSON object
(progress on stderr) and saves it as benchmarks/results/sync_vs_async-<date>.json.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import _common  # noqa: E402

NUM_WORKERS, NUM_PS = 4, 1
STRAGGLER, STRAGGLER_FRACTION = ("worker", NUM_WORKERS - 1), 0.25
BATCH = 32
# A run in which nothing finishes for this long is a bug: it fails, with the strategy's stats.
STALL_S = 60.0
CONFIGS = {
    "async": {"measure_staleness": True},  # its staleness reported like the others (docs/staleness.md: what it costs)
    "async_bounded": {"max_staleness": None},  # filled from --max-staleness
    "sync_k=n": {"replicas_to_aggregate": NUM_WORKERS},
    "sync_k=n-1": {"replicas_to_aggregate": NUM_WORKERS - 1},
}


def strategy_kwargs(config: str, max_staleness: int) -> dict:
    kwargs = dict(CONFIGS[config])
    if "max_staleness" in kwargs:
        kwargs["max_staleness"] = max_staleness
    return kwargs


def missing_arguments(kwargs: dict) -> list[str]:
    """The arguments of `kwargs` that this checkout's ParameterServerStrategy does not take."""
    import psclient

    # Its keyword arguments are StrategyConfig's fields where that exists (older checkouts: its signature).
    accepted = inspect.signature(getattr(psclient, "StrategyConfig", psclient.ParameterServerStrategy)).parameters
    return [name for name in kwargs if name not in accepted]


# ------------------------------------------------------------------ child
def load_digits_split():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    return train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)


def child_main(args) -> None:
    _common.exit_with_parent()
    import keras
    import numpy as np
    import tensorflow as tf

    import psclient

    keras.utils.set_random_seed(args.seed)
    x_train, x_test, y_train, y_test = load_digits_split()
    cluster = psclient.Cluster(json.loads(args.cluster))
    strategy = psclient.ParameterServerStrategy(cluster, **json.loads(args.kwargs))
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        optimizer = keras.optimizers.Adam(args.learning_rate)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def dataset_fn(ctx):
        return (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                .shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
                .shuffle(1024, seed=args.seed).repeat().batch(BATCH))

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

    @tf.function
    def train_step(iterator):
        x, y = next(iterator)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def accuracy() -> float:
        logits = model(x_test, training=False)  # Reads the weights from the ps.
        return float(np.mean(np.argmax(np.asarray(logits), axis=1) == y_test))

    def done_steps() -> int:
        return sum(w["done"] for w in strategy.stats()["workers"])

    def stalled(what):
        return RuntimeError(f"{what} within {STALL_S} s; strategy.stats(): {json.dumps(strategy.stats())}")

    warm = [strategy.schedule(train_step, args=(iterator,)) for _ in range(NUM_WORKERS)]
    if psclient.wait(warm, timeout=STALL_S).not_done:
        raise stalled("the warm-up steps (one per worker) did not finish")
    steps0, updates0 = done_steps(), int(optimizer.iterations.numpy())
    start = time.perf_counter()
    deadline = start + args.max_seconds
    pending = {strategy.schedule(train_step, args=(iterator,)) for _ in range(2 * NUM_WORKERS)}
    reached_s = reached_steps = reached_updates = None
    last_accuracy, evaluations, next_eval = None, 0, start + args.eval_interval
    last_progress = start
    while time.perf_counter() < deadline:
        done, pending = psclient.wait(pending, timeout=max(0.0, next_eval - time.perf_counter()),
                                      return_when=psclient.FIRST_COMPLETED)
        if done:
            last_progress = time.perf_counter()
        elif time.perf_counter() - last_progress > STALL_S:
            raise stalled("no step finished")
        for future in done:
            future.result()  # A failed step fails the run, loudly.
            pending.add(strategy.schedule(train_step, args=(iterator,)))
        if time.perf_counter() < next_eval:
            continue
        last_accuracy, evaluations = accuracy(), evaluations + 1
        next_eval = time.perf_counter() + args.eval_interval
        if last_accuracy >= args.target:
            reached_s = time.perf_counter() - start
            reached_steps = done_steps() - steps0
            reached_updates = int(optimizer.iterations.numpy()) - updates0
            break
    for future in pending:
        future.cancel()
    strategy.join(timeout=STALL_S)
    stats = strategy.stats()
    result = {
        "reached": reached_s is not None,
        "seconds_to_target": None if reached_s is None else round(reached_s, 3),
        "worker_steps_to_target": reached_steps,
        "model_updates_to_target": reached_updates,
        "final_accuracy": last_accuracy,
        "evaluations": evaluations,
        "steps_per_worker": [w["done"] for w in stats["workers"]],
        "staleness": stats.get("staleness", "not reported by this checkout's strategy"),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    strategy.shutdown()
    _common.child_exit(result)


# ----------------------------------------------------------------- parent
def parent_main(args, argv) -> int:
    import psclient

    runs: dict = {}
    output = {"config": {
        **_common.environment(argv),
        "data": "scikit-learn digits, 80/20 stratified split (seed 0), 1437 train / 360 test",
        "model": "64-64-10 ReLU MLP", "optimizer": f"Adam(learning_rate={args.learning_rate})",
        "batch_per_step": BATCH, "num_workers": NUM_WORKERS, "num_ps": NUM_PS,
        "target_test_accuracy": args.target, "max_staleness": args.max_staleness,
        "straggler": f"{STRAGGLER[0]}:{STRAGGLER[1]} at {STRAGGLER_FRACTION} of its speed",
        "eval_interval_s": args.eval_interval, "max_seconds_per_run": args.max_seconds,
        "repeats": args.repeats, "quick": args.quick,
    }}
    configs = args.configs.split(",") if args.configs else list(CONFIGS)
    output["config"]["configurations"] = configs
    env = _common.quiet_tf_env(GRPC_FAIL_FAST="use_caller")
    started = time.perf_counter()
    failed = False
    with _common.stop_on_sigterm():
        _common.log(f"starting a LocalCluster ({NUM_WORKERS} workers, {NUM_PS} ps)")
        with psclient.LocalCluster(num_workers=NUM_WORKERS, num_ps=NUM_PS, start_method="spawn") as local:
            output["config"]["cluster"] = local.cluster.jobs
            for repeat in range(args.repeats):
                for straggler in (False, True):
                    for config in configs:
                        name = f"{config}{'+straggler' if straggler else ''}"
                        kwargs = strategy_kwargs(config, args.max_staleness)
                        missing = missing_arguments(kwargs)
                        if missing:
                            needs = ", ".join(f"ParameterServerStrategy({m}=)" for m in missing)
                            runs.setdefault(name, []).append({"not run": f"needs {needs}"})
                            continue
                        if straggler:
                            local.throttle(*STRAGGLER, STRAGGLER_FRACTION)
                        child = [os.path.abspath(__file__), "--_child", "--cluster", json.dumps(local.cluster.jobs),
                                 "--kwargs", json.dumps(kwargs), "--target", str(args.target),
                                 "--max-seconds", str(args.max_seconds), "--eval-interval", str(args.eval_interval),
                                 "--learning-rate", str(args.learning_rate), "--seed", str(args.seed + repeat)]
                        tag = f"run {repeat + 1}/{args.repeats} {name:24}"
                        try:
                            result = _common.run_child(child, timeout=args.max_seconds + 180, env=env)
                        except _common.ChildError as error:
                            _common.log(f"{tag} FAILED: {error}")
                            result, failed = {"error": str(error)}, True
                        else:
                            _common.log(f"{tag} " + (
                                f"{result['seconds_to_target']:7.2f} s, {result['worker_steps_to_target']} "
                                f"steps, {result['model_updates_to_target']} updates"
                                if result["reached"] else f"target not reached ({result['final_accuracy']})")
                                + f", steps per worker {result['steps_per_worker']}")
                        finally:
                            if straggler:
                                local.throttle(*STRAGGLER, 1.0)
                        runs.setdefault(name, []).append(result)
    output["config"]["wall_s"] = round(time.perf_counter() - started, 1)
    output["summary"] = summarize(runs)
    output["runs"] = runs
    _common.print_json(output)
    os.makedirs(os.path.join(_HERE, "results"), exist_ok=True)
    saved = args.output or os.path.join(_HERE, "results", f"sync_vs_async-{time.strftime('%Y-%m-%d')}.json")
    with open(saved, "w") as f:
        json.dump(output, f, indent=2)
        f.write("\n")
    _common.log(f"saved {saved}")
    return 1 if failed else 0


def summarize(runs: dict) -> dict:
    """Per configuration: medians over repeats, and the straggler's cost (time with / time without)."""
    summary = {}
    for name, results in runs.items():
        if any("not run" in r for r in results):
            summary[name] = {"not run": results[0]["not run"]}
            continue
        reached = [r for r in results if r.get("reached")]
        summary[name] = {
            "reached": f"{len(reached)}/{len(results)}",
            "median_seconds_to_target": _common.median([r["seconds_to_target"] for r in reached]),
            "median_worker_steps_to_target": _common.median([r["worker_steps_to_target"] for r in reached]),
            "median_model_updates_to_target": _common.median([r["model_updates_to_target"] for r in reached]),
        }
        staleness = [r["staleness"] for r in results if isinstance(r.get("staleness"), dict)]
        if staleness:
            summary[name]["staleness_p99"] = [s.get("p99") for s in staleness]
    for config in CONFIGS:
        clean, slow = summary.get(config, {}), summary.get(f"{config}+straggler", {})
        if clean.get("median_seconds_to_target") and slow.get("median_seconds_to_target"):
            slow["straggler_slowdown"] = round(slow["median_seconds_to_target"] / clean["median_seconds_to_target"], 2)
    return summary


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration (medians)")
    parser.add_argument("--quick", action="store_true", help="target 0.90 and 60 s per run")
    parser.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    parser.add_argument("--max-staleness", type=int, default=NUM_WORKERS, help="S of async_bounded")
    parser.add_argument("--max-seconds", type=float, default=180.0, help="give a run up after this long")
    parser.add_argument("--eval-interval", type=float, default=0.1, help="seconds between accuracy checks")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="save the JSON here instead of benchmarks/results/")
    parser.add_argument("--configs", help=f"comma-separated subset of {','.join(CONFIGS)} (default: all)")
    parser.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--kwargs", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.configs and not set(args.configs.split(",")) <= set(CONFIGS):
        parser.error(f"--configs must be a comma-separated subset of {list(CONFIGS)}. Received: {args.configs!r}.")
    if args.quick:
        args.target, args.max_seconds = min(args.target, 0.90), min(args.max_seconds, 60.0)
    if args._child:
        try:
            child_main(args)  # exits the process
        except BaseException:
            traceback.print_exc()
            _common.child_exit(None, status=1)
    return _common.run_parent(parent_main, args, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())
