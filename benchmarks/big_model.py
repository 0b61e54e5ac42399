"""Models bigger than the coordinator: its memory against the model's size, psclient beside TF's own stack.

The model of a parameter-server job: `Embedding(rows, 32)` on 4 ids per example,
Flatten, `Dense(1)`, Adagrad (one accumulator per weight, as big as the table),
2 workers and 2 ps tasks. Sizes are given in bytes of parameters, table and
accumulator together (default 128 MiB, 512 MiB and 2 GiB: 0.5M, 2M and 8M rows).
For each size and each path, a fresh `LocalCluster` (task servers keep a
finished coordinator's variables for their keep-alive, which would blur the ps
memory of the next run) and one coordinator subprocess that runs the phases in
order:

  psclient     Keras 3 model built and compiled in psclient's
               ParameterServerStrategy scope (default partitioner), its
               optimizer built there too; fit on per-worker datasets.
  tf_keras_pss tf_keras model of the same shapes under TF's
               ParameterServerStrategy (MinSizePartitioner of 128 KiB, at most
               2 shards: psclient's "auto"), data through DatasetCreator.

Phases (`PHASES`, each a function `phase_<name>(run) -> dict`; a phase gets the
`Run` of the earlier ones and adds its own facts):

  build  model, compile and optimizer slots created in scope;
  fit    `--steps` fit steps (default 50).

Each phase reports its seconds, the coordinator's resident memory after it (RSS
and its anonymous part, RssAnon, which pages of files dropped under memory
pressure do not blur) and each ps task's (current, anonymous and peak);
the child reports the coordinator's peak (VmHWM) and the baseline it grew from:
its RSS once connected and after building, compiling and fitting a tiny model
of the same layers (Keras's and TF's first-use costs, the same at any size).
The parent reads each ps task's resident memory before the child starts and
its peak (VmHWM, /proc) once the child is done. Summary per size: coordinator growth (MiB and x parameter
bytes) after each phase, psclient/TF ratios, and the target: psclient's
coordinator grows by at most 0.1x the parameter bytes at every size.

Usage:
  python benchmarks/big_model.py [--sizes-mib 128,512,2048] [--steps 50] [--paths psclient,tf_keras_pss]
  python benchmarks/big_model.py --quick     # 128 MiB only, 10 steps

Prints one JSON object (progress on stderr) and saves it under
benchmarks/results/big_model-<date>.json (big_model-quick-<date>.json with
--quick). Exits 0 when every run finished, whether or not the target is met;
1 if any run failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import sys
import time
import traceback
from typing import Any, Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # _common, and the psclient of this checkout
import _common  # noqa: E402

PATHS = ("psclient", "tf_keras_pss")
SIZES_MIB = (128, 512, 2048)
QUICK_SIZES_MIB = (128,)
DIM, IDS_PER_EXAMPLE, BATCH = 32, 4, 256
LEARNING_RATE = 0.01
NUM_WORKERS, NUM_PS = 2, 2
MIN_SHARD_BYTES = 128 << 10  # psclient's "auto"; TF's path is given the same partitioner
TARGET_GROWTH = 0.1  # coordinator growth over parameter bytes, at most, at every size
MIB = 2**20


def rows_for(size_mib: int) -> int:
    """Rows of a table whose weights plus Adagrad's accumulator take `size_mib` MiB (float32)."""
    return size_mib * MIB // (2 * DIM * 4)


# ----------------------------------------------------------------------------
# Memory of this process and of the tasks (Linux /proc; psutil elsewhere).
def rss_mib(pid: int | None = None) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / MIB


def peak_rss_mib(pid: int | None = None) -> float | None:
    """The process's peak resident memory (VmHWM), or None where /proc has none."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    if pid is None:  # ru_maxrss: KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return None


def anon_rss_mib(pid: int | None = None) -> float | None:
    """Anonymous resident memory (RssAnon): RSS without the pages of mapped files.

    What a copy of the model would occupy. Under memory pressure the kernel
    drops file pages (TensorFlow's libraries) from RSS, which would make RSS
    growth look smaller than it is: this one does not move with them.
    """
    try:
        with open(f"/proc/{pid or 'self'}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def settled_rss_mib() -> float:
    gc.collect()
    return rss_mib()


# ----------------------------------------------------------------------------
# The model and data, the same on both paths (run in the coordinator subprocess).
def make_dataset(rows: int, seed: int = 7):
    import tensorflow as tf

    ids = tf.data.Dataset.random(seed=seed).batch(IDS_PER_EXAMPLE).map(
        lambda x: tf.cast(x % rows, tf.int32))
    labels = tf.data.Dataset.random(seed=seed + 1).map(lambda x: tf.cast(x % 2, tf.float32)[None])
    return tf.data.Dataset.zip((ids, labels)).batch(BATCH, drop_remainder=True).repeat()


def build_model(keras_module, rows: int):
    layers = keras_module.layers
    model = keras_module.Sequential([
        keras_module.Input(shape=(IDS_PER_EXAMPLE,), dtype="int32"),
        layers.Embedding(rows, DIM),
        layers.Flatten(),
        layers.Dense(1),
    ])
    model.compile(optimizer=keras_module.optimizers.Adagrad(learning_rate=LEARNING_RATE),
                  loss=keras_module.losses.BinaryCrossentropy(from_logits=True), steps_per_execution=1)
    model.optimizer.build(model.trainable_variables)  # slots now, not at the first step
    return model


@dataclasses.dataclass
class Run:
    """What the phases of one coordinator share: the path, its strategy, its model, its data."""

    path: str
    rows: int
    cluster: Any
    args: argparse.Namespace
    strategy: Any = None
    keras: Any = None
    model: Any = None
    data: Any = None
    facts: dict = dataclasses.field(default_factory=dict)

    def fit(self, model, steps: int) -> float:
        history = model.fit(self.data, epochs=1, steps_per_epoch=steps, verbose=0)
        return float(history.history["loss"][-1])


def connect(run: Run) -> None:
    """The path's strategy, connected, and its Keras module and per-worker data."""
    import tensorflow as tf

    if run.path == "tf_keras_pss":
        import tf_keras

        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(run.cluster.training_spec()), task_type="chief", task_id=0, rpc_layer="grpc")
        run.strategy = tf.distribute.experimental.ParameterServerStrategy(
            resolver, variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
                min_shard_bytes=MIN_SHARD_BYTES, max_shards=NUM_PS))
        run.keras = tf_keras
        run.data = tf_keras.utils.experimental.DatasetCreator(lambda ctx: make_dataset(run.rows))
    else:
        import keras

        import psclient

        run.strategy = psclient.ParameterServerStrategy(run.cluster)
        run.keras = keras
        run.data = lambda ctx: make_dataset(run.rows)  # noqa: E731 - one dataset per worker


def warm_up(run: Run) -> None:
    """A tiny model of the same layers built, compiled and fitted: first-use costs paid before the baseline."""
    with run.strategy.scope():
        tiny = build_model(run.keras, 64)
    saved, run.rows = run.rows, 64
    try:
        run.fit(tiny, 3)
    finally:
        run.rows = saved
    del tiny


# ----------------------------------------------------------------------------
# Phases. Each returns its facts; the child adds the coordinator's RSS after it.
def phase_build(run: Run) -> dict:
    with run.strategy.scope():
        run.model = build_model(run.keras, run.rows)
    table = run.model.layers[0].embeddings
    table = getattr(table, "value", table) if run.path == "psclient" else table
    shards = getattr(table, "variables", [table])
    return {"embedding_shards": [[int(d) for d in v.shape] for v in shards],
            "embedding_shard_devices": [v.device for v in shards]}


def phase_fit(run: Run) -> dict:
    return {"steps": run.args.steps, "loss_last": round(run.fit(run.model, run.args.steps), 4)}


PHASES: dict[str, Callable[[Run], dict]] = {"build": phase_build, "fit": phase_fit}


def child_main(args: argparse.Namespace) -> None:
    """One coordinator subprocess: one path, one size, every phase; prints one JSON line."""
    _common.exit_with_parent()
    import psclient

    run = Run(args._child, args.rows, psclient.Cluster(json.loads(args.cluster)), args)
    task_pids = json.loads(args.task_pids)
    t0 = time.perf_counter()
    connect(run)
    connected = settled_rss_mib()
    warm_up(run)
    baseline = settled_rss_mib()
    anon_baseline = anon_rss_mib() or 0.0
    result: dict = {"rows": args.rows, "setup_s": round(time.perf_counter() - t0, 2),
                    "coordinator_rss_mib": {"connected": round(connected, 1), "baseline": round(baseline, 1)},
                    "phases": {}}
    for name in args.phases.split(","):
        t0 = time.perf_counter()
        facts = PHASES[name](run)
        seconds = time.perf_counter() - t0
        after = settled_rss_mib()
        result["coordinator_rss_mib"][name] = round(after, 1)
        result.setdefault("ps_rss_mib", {})[name] = {
            task: {"rss": round(rss_mib(pid), 1), "anon": round(anon_rss_mib(pid) or 0.0, 1),
                   "peak": round(peak_rss_mib(pid) or 0.0, 1)}
            for task, pid in sorted(task_pids.items()) if task.startswith("ps:")}
        result["phases"][name] = {"seconds": round(seconds, 2), "coordinator_growth_mib": round(after - baseline, 1),
                                  "coordinator_anon_growth_mib": round((anon_rss_mib() or 0.0) - anon_baseline, 1),
                                  **facts}
    result["coordinator_peak_rss_mib"] = round(peak_rss_mib() or 0.0, 1)
    result["coordinator_peak_growth_mib"] = round(result["coordinator_peak_rss_mib"] - baseline, 1)
    result["load_average_1min"] = round(os.getloadavg()[0], 2)
    _common.child_exit(result)


# ----------------------------------------------------------------------------
def summarize(runs: dict, sizes: list[int], phases: list[str]) -> dict:
    per_size, met = {}, {}
    for size in sizes:
        parameters_mib = rows_for(size) * DIM * 4 * 2 / MIB
        entry: dict = {"rows": rows_for(size), "parameters_mib": round(parameters_mib, 1)}
        for path in PATHS:
            r = runs[str(size)].get(path)
            if not r or "error" in r:
                continue
            facts = {f"coordinator_growth_after_{p}_mib": r["phases"][p]["coordinator_growth_mib"] for p in phases}
            facts.update({f"coordinator_growth_after_{p}_x_parameters":
                          round(r["phases"][p]["coordinator_growth_mib"] / parameters_mib, 4) for p in phases})
            facts.update({f"coordinator_anon_growth_after_{p}_mib": r["phases"][p].get("coordinator_anon_growth_mib")
                          for p in phases})
            facts["coordinator_peak_growth_mib"] = r["coordinator_peak_growth_mib"]
            facts["ps_peak_rss_mib"] = r.get("ps_peak_rss_mib")
            facts["ps_rss_at_start_mib"] = r.get("ps_rss_at_start_mib")
            facts.update({f"{p}_seconds": r["phases"][p]["seconds"] for p in phases})
            entry[path] = facts
        ours, theirs = entry.get("psclient"), entry.get("tf_keras_pss")
        if ours and theirs:
            for p in phases:
                a, b = ours[f"coordinator_growth_after_{p}_mib"], theirs[f"coordinator_growth_after_{p}_mib"]
                entry[f"coordinator growth after {p}, psclient - tf_keras_pss (MiB)"] = round(a - b, 1)
                if b > 0:
                    entry[f"psclient/tf_keras_pss coordinator growth after {p}"] = round(a / b, 4)
            a, b = ours["coordinator_peak_growth_mib"], theirs["coordinator_peak_growth_mib"]
            if b > 0:
                entry["psclient/tf_keras_pss coordinator peak growth"] = round(a / b, 4)
            a, b = (max(r.values()) for r in (ours["ps_peak_rss_mib"], theirs["ps_peak_rss_mib"]))
            entry["psclient/tf_keras_pss largest ps peak RSS"] = round(a / b, 3)
            for p in phases:
                a, b = ours[f"{p}_seconds"], theirs[f"{p}_seconds"]
                if b:
                    entry[f"psclient/tf_keras_pss {p} seconds"] = round(a / b, 3)
        if ours:
            # RSS, or anonymous RSS where larger (file pages dropped under memory pressure).
            worst = max(max(ours[f"coordinator_growth_after_{p}_mib"], ours[f"coordinator_anon_growth_after_{p}_mib"]
                            or 0.0) / parameters_mib for p in phases)
            met[f"psclient coordinator growth <= {TARGET_GROWTH}x parameters at {size} MiB"] = worst <= TARGET_GROWTH
        per_size[f"{size}MiB"] = entry
    return {"per_size": per_size, "targets_met": met}


def ps_peaks(task_pids: dict[str, int]) -> dict[str, float | None]:
    return {task: round(peak_rss_mib(pid) or 0.0, 1) for task, pid in sorted(task_pids.items()) if task.startswith("ps:")}


def parent_main(args: argparse.Namespace, argv: list[str]) -> int:
    sizes = [int(s) for s in args.sizes_mib.split(",")] if args.sizes_mib else list(
        QUICK_SIZES_MIB if args.quick else SIZES_MIB)
    paths = args.paths.split(",")
    phases = args.phases.split(",")
    output = {"config": {
        **_common.environment(argv),
        "model": f"Embedding(rows, {DIM}) on {IDS_PER_EXAMPLE} ids -> Flatten -> Dense(1), Adagrad"
                 f"({LEARNING_RATE}), batch {BATCH}",
        "num_workers": NUM_WORKERS, "num_ps": NUM_PS, "sizes_mib": sizes,
        "rows": {str(s): rows_for(s) for s in sizes}, "paths": paths, "phases": phases, "fit_steps": args.steps,
        "partitioner": f"MinSizePartitioner(min_shard_bytes={MIN_SHARD_BYTES}, max_shards={NUM_PS}) on both paths",
        "baseline": "coordinator RSS after connecting and after building, compiling and fitting (3 steps) a "
                    "64-row model of the same layers; growth = RSS after a phase (after gc) - baseline",
        "order": "a fresh LocalCluster per size and path; paths in the order given",
    }}
    runs: dict = {str(s): {} for s in sizes}
    env = _common.quiet_tf_env(GRPC_FAIL_FAST="use_caller")
    started = time.perf_counter()
    with _common.stop_on_sigterm():
        for size in sizes:
            rows = rows_for(size)
            for path in paths:
                tag = f"{size:>5} MiB ({rows:,} rows) {path:12}"
                _common.log(f"{tag} starting a LocalCluster ({NUM_WORKERS} workers, {NUM_PS} ps)")
                # A long start timeout: the tasks of a busy machine start slowly.
                with _common.local_cluster(NUM_WORKERS, NUM_PS, start_timeout=300.0) as (cluster, task_pids):
                    child = [os.path.abspath(__file__), "--_child", path, "--rows", str(rows),
                             "--cluster", json.dumps(cluster.jobs), "--steps", str(args.steps),
                             "--phases", args.phases, "--task-pids", json.dumps(task_pids)]
                    ps_at_start = {task: {"rss": round(rss_mib(pid), 1), "anon": round(anon_rss_mib(pid) or 0.0, 1)}
                                   for task, pid in sorted(task_pids.items()) if task.startswith("ps:")}
                    try:
                        result = _common.run_child(child, timeout=args.child_timeout, env=env)
                    except _common.ChildError as error:
                        _common.log(f"{tag} FAILED: {error}")
                        result = {"error": str(error)}
                    else:
                        result["ps_rss_at_start_mib"] = ps_at_start
                        result["ps_peak_rss_mib"] = ps_peaks(task_pids)
                        growth = ", ".join(f"{p} +{result['phases'][p]['coordinator_growth_mib']:.0f}"
                                           for p in phases)
                        _common.log(f"{tag} coordinator MiB: {growth}; ps peaks {result['ps_peak_rss_mib']}")
                runs[str(size)][path] = result
    output["config"]["wall_s"] = round(time.perf_counter() - started, 1)
    output["results"] = summarize(runs, sizes, phases)
    output["runs"] = runs
    _common.print_json(output)
    os.makedirs(os.path.join(_HERE, "results"), exist_ok=True)
    partial = (sizes != list(SIZES_MIB) or paths != list(PATHS) or phases != list(PHASES))
    name = "big_model-quick" if args.quick else ("big_model-partial" if partial else "big_model")
    saved = os.path.join(_HERE, "results", f"{name}-{time.strftime('%Y-%m-%d')}.json")
    with open(saved, "w") as f:
        json.dump(output, f, indent=2)
        f.write("\n")
    _common.log(f"saved {os.path.relpath(saved, os.path.dirname(_HERE))}")
    return 1 if any("error" in r for per in runs.values() for r in per.values()) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", help="comma-separated parameter sizes in MiB, table and accumulator "
                                            "together (default 128,512,2048; 128 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--steps", type=int, help="fit steps of the fit phase (default 50; 10 with --quick)")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated paths (default: both)")
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases, in order")
    parser.add_argument("--child-timeout", type=float, default=900.0, help="seconds per run before it is killed")
    # Internal: run one path as a coordinator subprocess.
    parser.add_argument("--_child", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--task-pids", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 10 if args.quick else 50
    if args._child:
        try:
            child_main(args)  # Exits the process.
        except BaseException:
            traceback.print_exc()
            _common.child_exit(None, status=1)
    if args.steps < 1:
        parser.error(f"--steps must be an integer >= 1. Received: {args.steps}.")
    unknown = [p for p in args.paths.split(",") if p not in PATHS]
    if unknown:
        parser.error(f"--paths takes {', '.join(PATHS)}. Received: {args.paths!r}.")
    unknown = [p for p in args.phases.split(",") if p not in PHASES]
    if unknown:
        parser.error(f"--phases takes {', '.join(PHASES)}, in order. Received: {args.phases!r}.")
    if args.sizes_mib and not all(s.strip().isdigit() and int(s) > 0 for s in args.sizes_mib.split(",")):
        parser.error(f"--sizes-mib must be comma-separated integers >= 1. Received: {args.sizes_mib!r}.")
    _common.require_tf_keras(parser, "tf_keras_pss" in args.paths.split(","), "--paths tf_keras_pss")
    return _common.run_parent(parent_main, args, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())
