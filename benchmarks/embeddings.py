"""Embedding tables under Keras `model.fit`: psclient + Keras 3 against tf_keras + TF's ParameterServerStrategy.

The model parameter servers exist for: `Embedding(rows, 16)` on 4 ids per
example, flattened, then Dense(16, relu) and Dense(1) (a binary label, logits),
batch 256, Adagrad(0.01) (`--optimizer adam` or `sgd`: Adam(0.001), SGD(0.05)), `model.fit` with steps_per_execution 1, for tables
of 20,000, 200,000 and 2,000,000 rows by default (`--rows`). Each table size
gets a fresh LocalCluster of 2 workers and 2 ps (TF's task servers keep the
state of a finished coordinator, a 2M-row table and its accumulator included,
for their 600 s keep-alive), and on it, each path in its own coordinator
subprocess, interleaved (repeat 1: psclient then TF, repeat 2: TF then psclient):

  psclient_keras3  Keras 3 model built and compiled in psclient's
                   ParameterServerStrategy scope; with
                   `variable_partitioner=<the partitioner below>` when
                   psclient's strategy has that argument (JSON:
                   "psclient_partitioned"), without it otherwise.
  tf_keras_pss     tf_keras model under tf.distribute.experimental.
                   ParameterServerStrategy with variable_partitioner=
                   MinSizePartitioner(min_shard_bytes=256 KiB, max_shards=2),
                   data through tf_keras's DatasetCreator.

Data, the same on both paths: 64 distinct batches of seeded synthetic ids
(zipf-like: id rank r has probability ~ 1/r, ranks scattered over the table by
a multiplicative hash so hot rows fall on every shard), repeated; each worker
builds it from a dataset function. A step touches at most 1,024 rows at every
table size.

A run fits `--warmup` steps (tracing, excluded), then a few steps to estimate
its speed, then times one fit of as many steps as take about `--seconds`
(bounded by --min-steps/--max-steps), measuring steps/s, task CPU per step
(workers and ps), coordinator CPU per step and bytes moved per step over the
cluster's connections (TCP counters, see _common.LoopbackBytes). The summary
takes medians per path and size, psclient/TF ratios, and each path's step time
at the largest table over its step time at the smallest.

Usage:
  python benchmarks/embeddings.py [--rows 20000,200000,2000000] [--repeats 2] [--seconds 6]
  python benchmarks/embeddings.py --quick      # smoke run: 20k and 2M rows, 1 repeat, few steps
  python benchmarks/embeddings.py --rows 20000,2000000 --optimizer adam   # Adam, as the collaborative-filtering example fits

Prints one JSON object (progress on stderr) and saves it under
benchmarks/results/embeddings-<date>.json (embeddings-quick-<date>.json with
--quick; the optimizer's name before the date with --optimizer adam or sgd). Exits 0 when every run finished, whether or not the targets are met;
1 if any run failed.
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
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # _common, and the psclient of this checkout
import _common  # noqa: E402

PATHS = ("psclient_keras3", "tf_keras_pss")
ROWS = (20_000, 200_000, 2_000_000)
QUICK_ROWS = (20_000, 2_000_000)
DIM, IDS_PER_EXAMPLE, BATCH, HIDDEN = 16, 4, 256, 16
NUM_BATCHES = 64  # distinct batches, repeated
LEARNING_RATE = 0.01
NUM_WORKERS, NUM_PS = 2, 2
MIN_SHARD_BYTES, MAX_SHARDS = 256 << 10, 2
SEED = 7
# The project's targets for embeddings.
TARGET_GROWTH = 1.2  # psclient step time, largest table / smallest table, at most
TARGET_RATIO = 1.5  # psclient / tf_keras_pss steps/s at the largest table, at least


# ----------------------------------------------------------------------------
# Model and data: the same on both paths. Run in the coordinator subprocess.
def make_arrays(rows: int):
    """(ids int32 [NUM_BATCHES * BATCH, 4], labels float32 [.., 1]), seeded."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    n = NUM_BATCHES * BATCH * IDS_PER_EXAMPLE
    # Log-uniform ranks in [0, rows): P(rank r) ~ 1/(r+1), a zipf(1)-like skew.
    ranks = np.minimum(np.floor(np.exp(rng.uniform(0.0, np.log(rows), n))) - 1, rows - 1).astype(np.int64)
    ranks = np.maximum(ranks, 0)
    # Scatter ranks over the table (2654435761 is prime, so coprime with any rows < it).
    ids = ((ranks * 2654435761) % rows).astype(np.int32).reshape(-1, IDS_PER_EXAMPLE)
    # A label the model can learn something of: from the first id.
    labels = ((ids[:, :1] * 7919) % 3 == 0).astype(np.float32)
    return ids, labels


def data_stats(rows: int) -> dict:
    import numpy as np

    ids, labels = make_arrays(rows)
    unique = [len(np.unique(ids[i * BATCH:(i + 1) * BATCH])) for i in range(NUM_BATCHES)]
    return {"unique_rows_per_batch_median": float(np.median(unique)), "unique_rows_per_batch_max": int(max(unique)),
            "unique_rows_all_batches": int(len(np.unique(ids))), "positive_label_share": round(float(labels.mean()), 3)}


def make_dataset(rows: int):
    import tensorflow as tf

    ids, labels = make_arrays(rows)
    return tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH, drop_remainder=True).repeat()


#: --optimizer: the name -> (Keras's class name, its arguments); Adam and SGD as users write them.
OPTIMIZERS = {"adagrad": ("Adagrad", {"learning_rate": LEARNING_RATE}),
              "adam": ("Adam", {"learning_rate": 0.001}),
              "sgd": ("SGD", {"learning_rate": 0.05})}


def describe_optimizer(name: str) -> str:
    kind, kwargs = OPTIMIZERS[name]
    return f"{kind}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"


def build_model(keras_module, rows: int, optimizer: str = "adagrad"):
    layers = keras_module.layers
    model = keras_module.Sequential([
        keras_module.Input(shape=(IDS_PER_EXAMPLE,), dtype="int32"),
        layers.Embedding(rows, DIM),
        layers.Flatten(),
        layers.Dense(HIDDEN, activation="relu"),
        layers.Dense(1),
    ])
    model.compile(
        optimizer=getattr(keras_module.optimizers, OPTIMIZERS[optimizer][0])(**OPTIMIZERS[optimizer][1]),
        loss=keras_module.losses.BinaryCrossentropy(from_logits=True),
        steps_per_execution=1,
    )
    return model


def make_partitioner():
    import tensorflow as tf

    return tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=MIN_SHARD_BYTES, max_shards=MAX_SHARDS)


def psclient_has_partitioner() -> bool:
    import psclient

    # Its keyword arguments are StrategyConfig's fields where that exists (older checkouts: its signature).
    takes = getattr(psclient, "StrategyConfig", psclient.ParameterServerStrategy)
    return "variable_partitioner" in inspect.signature(takes).parameters


def setup(path: str, cluster, rows: int, optimizer: str = "adagrad"):
    """Returns (fit(steps) -> last loss, strategy, describe() -> facts for the JSON).

    describe() is called after the fits: optimizer slots exist only then.
    """
    import tensorflow as tf

    if path == "tf_keras_pss":
        import tf_keras

        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster.training_spec()), task_type="chief", task_id=0, rpc_layer="grpc"
        )
        strategy = tf.distribute.experimental.ParameterServerStrategy(
            resolver, variable_partitioner=make_partitioner())
        with strategy.scope():
            model = build_model(tf_keras, rows, optimizer)
        data = tf_keras.utils.experimental.DatasetCreator(lambda ctx: make_dataset(rows))

        def describe() -> dict:
            table = model.layers[0].embeddings
            shards = getattr(table, "variables", [table])
            return {"embedding_shards": [[int(d) for d in v.shape] for v in shards],
                    "embedding_shard_devices": [v.device for v in shards]}
    else:
        import keras

        import psclient

        if psclient_has_partitioner():
            strategy = psclient.ParameterServerStrategy(cluster, variable_partitioner=make_partitioner())
        else:
            strategy = psclient.ParameterServerStrategy(cluster)
        with strategy.scope():
            model = build_model(keras, rows, optimizer)
        data = lambda ctx: make_dataset(rows)  # noqa: E731 - one dataset per worker

        def describe() -> dict:
            placement = strategy.placement()
            return {"placement_bytes_per_ps": placement.get("bytes_per_ps"),
                    "placement_entries": len(placement.get("variables", []))}

    def fit(steps: int) -> float:
        history = model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
        return float(history.history["loss"][-1])

    # psclient's owners hold a strategy weakly: the caller keeps it alive.
    return fit, strategy, describe


# ----------------------------------------------------------------------------
def child_main(args: argparse.Namespace) -> None:
    """One coordinator subprocess: one path, one table size; prints one JSON line."""
    _common.exit_with_parent()
    import psclient

    cluster = psclient.Cluster(json.loads(args.cluster))
    task_pids = json.loads(args.task_pids)
    meter = _common.LoopbackBytes(cluster.jobs, coordinator_pid=os.getpid(), task_pids=task_pids)

    t0 = time.perf_counter()
    fit, strategy, describe = setup(args._child, cluster, args.rows, args.optimizer)
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    first_loss = fit(args.warmup)
    warmup_s = time.perf_counter() - t0
    # Estimate the speed on a few steps past tracing, then time ~`seconds`.
    t0 = time.perf_counter()
    fit(args.probe_steps)
    rate = args.probe_steps / (time.perf_counter() - t0)
    steps = int(min(args.max_steps, max(args.min_steps, rate * args.seconds)))

    task_cpu0 = {task: _common.cpu_seconds([pid]) for task, pid in task_pids.items()}
    bytes0 = meter.snapshot()
    busy0, cpu0, t0 = _common.machine_busy_seconds(), time.process_time(), time.perf_counter()
    last_loss = fit(steps)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    busy = _common.machine_busy_seconds() - busy0
    moved = meter.per_step(bytes0, meter.snapshot(), steps)
    task_cpu = {task: _common.cpu_seconds([pid]) - task_cpu0[task] for task, pid in task_pids.items()}
    other = busy - cpu - sum(task_cpu.values())

    per_step_us = lambda s: round(s / steps * 1e6, 1)  # noqa: E731
    by_role: dict[str, float] = {}
    for task, s in task_cpu.items():
        role = "workers" if task.startswith("worker") else "ps"
        by_role[role] = by_role.get(role, 0.0) + s
    result = {
        "rows": args.rows,
        "steps": steps,
        "seconds": round(seconds, 3),
        "steps_per_s": round(steps / seconds, 2),
        "step_ms": round(seconds / steps * 1e3, 3),
        "coordinator_cpu_us_per_step": per_step_us(cpu),
        "tasks_cpu_us_per_step": per_step_us(sum(task_cpu.values())),
        "tasks_cpu_us_per_step_by_role": {role: per_step_us(s) for role, s in sorted(by_role.items())},
        "task_cpu_us_per_step": {task: per_step_us(s) for task, s in task_cpu.items()},
        "bytes_per_step": moved,
        "setup_s": round(setup_s, 2),
        "warmup_s": round(warmup_s, 2),
        "loss_after_warmup": round(first_loss, 4),
        "loss_last": round(last_loss, 4),
        "other_processes_cpu_share": round(max(0.0, other) / (seconds * (os.cpu_count() or 1)), 3),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "tasks_after": _common.task_usage(list(task_pids.values())),
        **describe(),
    }
    del strategy
    _common.child_exit(result)


# ----------------------------------------------------------------------------
def summarize(runs: dict, rows_list: list[int]) -> dict:
    def rounded(value):
        return None if value is None else round(value, 3)

    def med(rs: list, key: str):
        return rounded(_common.median([r[key] for r in rs if key in r]))

    def med_bytes(rs: list, role: str | None = None):
        values = []
        for r in rs:
            moved = r.get("bytes_per_step") or {}
            if moved.get("total") is None:
                continue
            values.append(moved["total"] if role is None else sum(
                v for k, v in moved.get("by_role", {}).items() if role in k.split(" -> ")))
        return rounded(_common.median(values))

    per_size = {}
    for rows in rows_list:
        entry: dict = {}
        for path in PATHS:
            rs = [r for r in runs[str(rows)][path] if "error" not in r]
            entry[path] = {
                "median_steps_per_s": med(rs, "steps_per_s"),
                "median_step_ms": med(rs, "step_ms"),
                "median_tasks_cpu_us_per_step": med(rs, "tasks_cpu_us_per_step"),
                "median_ps_cpu_us_per_step": rounded(_common.median(
                    [r["tasks_cpu_us_per_step_by_role"]["ps"] for r in rs])),
                "median_workers_cpu_us_per_step": rounded(_common.median(
                    [r["tasks_cpu_us_per_step_by_role"]["workers"] for r in rs])),
                "median_coordinator_cpu_us_per_step": med(rs, "coordinator_cpu_us_per_step"),
                "median_bytes_per_step": med_bytes(rs),
                "median_bytes_per_step_to_or_from_ps": med_bytes(rs, "ps"),
                "steps_per_s": [r["steps_per_s"] for r in rs],
                "failed_runs": len(runs[str(rows)][path]) - len(rs),
            }
        ours, theirs = entry["psclient_keras3"], entry["tf_keras_pss"]
        if ours["median_steps_per_s"] and theirs["median_steps_per_s"]:
            entry["psclient/tf_keras_pss steps/s"] = round(ours["median_steps_per_s"] / theirs["median_steps_per_s"], 3)
        for key, name in (("median_tasks_cpu_us_per_step", "task CPU"),
                          ("median_coordinator_cpu_us_per_step", "coordinator CPU"),
                          ("median_bytes_per_step", "bytes")):
            if ours[key] and theirs[key]:
                entry[f"psclient/tf_keras_pss {name} per step"] = round(ours[key] / theirs[key], 3)
        per_size[str(rows)] = entry

    summary: dict = {"per_rows": per_size}
    small, large = str(min(rows_list)), str(max(rows_list))
    if small != large:
        for path in PATHS:
            a, b = per_size[small][path]["median_step_ms"], per_size[large][path]["median_step_ms"]
            if a and b:
                summary[f"{path} step time {large}/{small} rows"] = round(b / a, 3)
        growth = summary.get(f"psclient_keras3 step time {large}/{small} rows")
        ratio = per_size[large].get("psclient/tf_keras_pss steps/s")
        targets = {}
        if growth is not None:
            targets[f"psclient step time {large}/{small} rows <= {TARGET_GROWTH}"] = growth <= TARGET_GROWTH
        if ratio is not None:
            targets[f"psclient/tf_keras_pss steps/s at {large} rows >= {TARGET_RATIO}"] = ratio >= TARGET_RATIO
        summary["targets_met"] = targets
    return summary


def parent_main(args: argparse.Namespace, argv: list[str]) -> int:
    rows_list = [int(r) for r in args.rows.split(",")] if args.rows else list(QUICK_ROWS if args.quick else ROWS)
    partitioned = psclient_has_partitioner()
    output = {"config": {
        **_common.environment(argv),
        "model": f"Embedding(rows, {DIM}) on {IDS_PER_EXAMPLE} ids -> Flatten -> Dense({HIDDEN}, relu) -> Dense(1), "
                 f"binary cross-entropy from logits",
        "optimizer": describe_optimizer(args.optimizer),
        "batch": BATCH, "steps_per_execution": 1, "num_workers": NUM_WORKERS, "num_ps": NUM_PS,
        "rows": rows_list, "embedding_dim": DIM,
        "data": f"{NUM_BATCHES} distinct batches of seeded zipf(1)-like ids (seed {SEED}), repeated",
        "tf_variable_partitioner": f"MinSizePartitioner(min_shard_bytes={MIN_SHARD_BYTES}, max_shards={MAX_SHARDS})",
        "psclient_partitioned": partitioned,
        "psclient_partitioner": (f"MinSizePartitioner(min_shard_bytes={MIN_SHARD_BYTES}, max_shards={MAX_SHARDS})"
                                 if partitioned else
                                 "none: psclient.ParameterServerStrategy has no variable_partitioner argument "
                                 "in this checkout; every variable is whole on one ps"),
        "repeats": args.repeats, "warmup_steps": args.warmup, "probe_steps": args.probe_steps,
        "timed_seconds_target": args.seconds, "min_steps": args.min_steps, "max_steps": args.max_steps,
        "order": "a fresh LocalCluster per table size; paths alternate per repeat (ABBA)",
        "data_stats": {str(rows): data_stats(rows) for rows in rows_list},
    }}
    runs = {str(rows): {path: [] for path in PATHS} for rows in rows_list}
    env = _common.quiet_tf_env(GRPC_FAIL_FAST="use_caller")
    started = time.perf_counter()
    with _common.stop_on_sigterm():
        for rows in rows_list:
            _common.log(f"rows={rows:,}: starting a LocalCluster ({NUM_WORKERS} workers, {NUM_PS} ps)")
            with _common.local_cluster(NUM_WORKERS, NUM_PS) as (cluster, task_pids):
                for repeat in range(args.repeats):
                    order = PATHS if repeat % 2 == 0 else PATHS[::-1]
                    for path in order:
                        child = [os.path.abspath(__file__), "--_child", path, "--rows", str(rows),
                                 "--cluster", json.dumps(cluster.jobs), "--task-pids", json.dumps(task_pids),
                                 "--warmup", str(args.warmup), "--probe-steps", str(args.probe_steps),
                                 "--seconds", str(args.seconds), "--min-steps", str(args.min_steps),
                                 "--max-steps", str(args.max_steps), "--optimizer", args.optimizer]
                        tag = f"rows={rows:>9,} repeat {repeat + 1}/{args.repeats} {path:15}"
                        try:
                            result = _common.run_child(child, timeout=args.child_timeout, env=env)
                        except _common.ChildError as error:
                            _common.log(f"{tag} FAILED: {error}")
                            result = {"error": str(error)}
                        else:
                            moved = result["bytes_per_step"].get("total")
                            _common.log(
                                f"{tag} {result['steps_per_s']:7.1f} steps/s ({result['steps']} steps), tasks "
                                f"{result['tasks_cpu_us_per_step'] / 1e3:.1f} ms/step, coordinator "
                                f"{result['coordinator_cpu_us_per_step'] / 1e3:.2f} ms/step, "
                                + (f"{moved / 1e6:.3f} MB/step" if moved is not None else "bytes n/a")
                                + f", setup {result['setup_s']:.1f} s")
                        runs[str(rows)][path].append(result)
    output["config"]["wall_s"] = round(time.perf_counter() - started, 1)
    output["results"] = summarize(runs, rows_list)
    output["runs"] = runs
    _common.print_json(output)
    os.makedirs(os.path.join(_HERE, "results"), exist_ok=True)
    name = ("embeddings-quick" if args.quick else "embeddings") + ("" if args.optimizer == "adagrad" else f"-{args.optimizer}")
    saved = os.path.join(_HERE, "results", f"{name}-{time.strftime('%Y-%m-%d')}.json")
    with open(saved, "w") as f:
        json.dump(output, f, indent=2)
        f.write("\n")
    _common.log(f"saved {os.path.relpath(saved, os.path.dirname(_HERE))}")
    return 1 if any("error" in r for per in runs.values() for rs in per.values() for r in rs) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", help="comma-separated table sizes (default 20000,200000,2000000; "
                                       "20000,2000000 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (under ~2 minutes)")
    parser.add_argument("--repeats", type=int, help="runs per path and size, interleaved (default 2; 1 with --quick)")
    parser.add_argument("--seconds", type=float, help="timed seconds per run, about (default 6; 1.5 with --quick)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 20; 5 with --quick)")
    parser.add_argument("--probe-steps", type=int, help="steps that estimate the speed (default 20; 5 with --quick)")
    parser.add_argument("--min-steps", type=int, help="fewest timed steps (default 40; 10 with --quick)")
    parser.add_argument("--max-steps", type=int, default=3000, help="most timed steps (default 3000)")
    parser.add_argument("--child-timeout", type=float, default=420.0, help="seconds per run before it is killed")
    # Internal: run one path as a coordinator subprocess.
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad",
                        help="the optimizer of both paths (default adagrad; adam and sgd as users write them)")
    parser.add_argument("--_child", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--task-pids", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, full, quick in (("repeats", 2, 1), ("seconds", 6.0, 1.5), ("warmup", 20, 5),
                              ("probe_steps", 20, 5), ("min_steps", 40, 10)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args._child:
        try:
            args.rows = int(args.rows)
            child_main(args)  # Exits the process.
        except BaseException:
            traceback.print_exc()
            _common.child_exit(None, status=1)
    for name in ("repeats", "warmup", "probe_steps", "min_steps", "max_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be an integer >= 1. Received: {getattr(args, name)}.")
    if args.seconds <= 0:
        parser.error(f"--seconds must be a number > 0. Received: {args.seconds}.")
    if args.rows and not all(r.strip().isdigit() and int(r) > 0 for r in args.rows.split(",")):
        parser.error(f"--rows must be comma-separated integers >= 1. Received: {args.rows!r}.")
    _common.require_tf_keras(parser, True, "this benchmark (its anchor, tf_keras_pss, runs in every repeat)")
    return _common.run_parent(parent_main, args, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())
