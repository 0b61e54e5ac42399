"""Checkpoint save and restore of a big embedding model: psclient against TF's own stack.

For each size (parameter bytes: the table and its Adagrad slot, on 2 ps), a
fresh LocalCluster (1 worker, 2 ps) and, in turn, one coordinator subprocess
per path:

  psclient     Keras 3 model in psclient.ParameterServerStrategy(checkpoint_dir=...);
               strategy.save_checkpoint() (each ps writes its own part) and
               strategy.restore() (each ps reads its own).
  tf_pss       tf_keras model in tf.distribute.experimental.ParameterServerStrategy;
               tf.train.Checkpoint(model=..., optimizer=...).save() and .restore().

Model: Embedding(rows, 32) -> Flatten -> Dense(1), Adagrad, 2 fit steps
first (so the slots exist), both partitioned over the 2 ps
(MinSizePartitioner, 2 shards). Per path: the first save (TF traces its
saver then), the median of the next saves, the median of restores, and the
coordinator's resident memory before and at its peak during them. Prints one
JSON object; the ratios psclient/tf_pss are side by side per size.

psclient also checkpoints while `model.fit` trains in another thread
(`while_training`): per save, how long dispatch was paused (`stall_s`,
stats()["checkpoints"]["last_stall_seconds"]), of which waiting for the
closures running then to end (`drain_s`: they go on training) and the rest,
when nothing runs (`idle_s`: the cut and the snapshot, `snapshot_s`); how
long the background write took (`write_s`),
how many closures completed during the save_checkpoint() call, the longest
time without any closure completing from the save's start to a second after
it returned (`longest_no_progress_s`, beside the median time between
completions over 2 s without a save: a copy moved out of the cut into the
first step after it shows here), and each
ps's resident memory before the saves and at its peak during them, beside
the bytes of the variables it holds (`ps_peak_over_variables`: peak RSS
over variable bytes; `ps_growth_over_variables`: the growth during the
saves over variable bytes).

During the restores, each ps's resident memory before them and at its peak
(`ps_during_restores`): `peak_over_variables` is (its variables + the
growth) over its variables. TF's default CPU allocator (oneDNN's) keeps what
it frees, so a restore reuses the saves' freed memory unseen; `--ps-malloc`
runs the tasks with TF_ENABLE_ONEDNN_OPTS=0 and MALLOC_MMAP_THRESHOLD_=1 MiB
(plain malloc, which then gives every block of 1 MiB or more back), so that
the growth is what the restore holds at once.
`--checkpoint-cut copy` runs psclient with `StrategyConfig(checkpoint_cut="copy")` (the embedding and
its slot read whole in the cut) instead of "rows" (copied before the cut, training going on; the cut
reads again only the rows written since): run both for the stall's dependence on the model's size.
`--shards N` cuts each partitioned variable into N shards (default one per ps).
`--deltas N` (psclient only): incremental checkpoints on (`delta_checkpoint_every`);
after the timed saves, N phases of fit steps each write a delta of the newest
full checkpoint (each phase trains new rows), then the restores apply the full
checkpoint and its N deltas. A first restore, not measured, drops the deltas'
base (the previous cut's rows each ps keeps for the next diff: a restore ends
the chain), so that the measured restores start from the variables alone.

    nice -n 10 python benchmarks/big_model_checkpoint.py               # 128 MB, 512 MB, 2 GB
    nice -n 10 python benchmarks/big_model_checkpoint.py --sizes-mb 128 --saves 2
    nice -n 10 python benchmarks/big_model_checkpoint.py --sizes-mb 244,977 --paths psclient   # stall vs write
    nice -n 10 python benchmarks/big_model_checkpoint.py --sizes-mb 244 --paths psclient --saves 1 --restores 2 \
        --ps-malloc --shards 10    # restore peak
    nice -n 10 python benchmarks/big_model_checkpoint.py --sizes-mb 244 --paths psclient --saves 1 --restores 2 \
        --ps-malloc --shards 2 --deltas 2    # restore peak, full checkpoint + 2 deltas
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
PATHS = ("psclient", "tf_pss")
DIM = 32
NUM_WORKERS, NUM_PS = 1, 2
BATCH = 64
#: Parameter bytes per row: the table's float32 row and its Adagrad accumulator's.
ROW_BYTES = DIM * 4 * 2
TARGET = "psclient save no slower than tf_pss at the largest size (ratio <= 1.0)"
STALL_TARGET = "psclient stops training <= 0.2 s per checkpoint at every size (median idle_s)"
PS_MEMORY_TARGET = "ps peak RSS during a save <= 2x its variables (growth during the saves <= 1x)"
RESTORE_MEMORY_TARGET = "ps peak during a restore <= 1.2x its variables (--ps-malloc: RSS follows live memory)"


def build_model(keras_module, rows: int):
    layers = keras_module.layers
    model = keras_module.Sequential([
        keras_module.Input(shape=(4,), dtype="int32"),
        layers.Embedding(rows, DIM),
        layers.Flatten(),
        layers.Dense(1),
    ])
    model.compile(optimizer=keras_module.optimizers.Adagrad(learning_rate=0.05),
                  loss=keras_module.losses.BinaryCrossentropy(from_logits=True))
    return model


def make_dataset(rows: int):
    import tensorflow as tf

    ids = tf.random.stateless_uniform([BATCH * 4, 4], seed=[1, 2], maxval=rows, dtype=tf.int32)
    labels = tf.cast(ids[:, :1] % 2, tf.float32)
    return tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH, drop_remainder=True).repeat()


#: Shards per partitioned variable (`--shards`): NUM_PS by default, one per ps.
SHARDS = {"count": NUM_PS}
#: Fit steps between two deltas (`--deltas`): the steps of one phase.
DELTA_STEPS = 4


def partitioner():
    import tensorflow as tf

    return tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=1 << 20,
                                                                      max_shards=SHARDS["count"])


class PeakRss:
    """A process's peak resident memory while the block runs (sampled every 5 ms); this one by default."""

    def __init__(self, pid: int | None = None):
        import psutil

        self._process = psutil.Process(pid)
        self.before = self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil

        while not self._stop.wait(0.005):
            try:
                self.peak = max(self.peak, self._process.memory_info().rss)
            except psutil.Error:  # the process ended: its peak so far stands
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


class CompletionGaps:
    """When the strategy's completed-closure count moved (polled every 5 ms), while the block runs.

    `longest(t0, t1)`: the longest time without a closure completing that overlaps [t0, t1]: how long
    training made no progress around a save, the cut's pause and the first steps after it included
    (a copy moved out of the cut into a step shows there)."""

    def __init__(self, completed):
        self._completed = completed
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        last = self._completed()
        self.times.append(time.perf_counter())
        while not self._stop.wait(0.005):
            now = self._completed()
            if now != last:
                last = now
                self.times.append(time.perf_counter())

    def longest(self, t0: float, t1: float) -> float:
        spans = [b - a for a, b in zip(self.times, self.times[1:]) if b >= t0 and a <= t1]
        return max(spans, default=0.0)

    def median(self, t0: float, t1: float) -> float:
        spans = [b - a for a, b in zip(self.times, self.times[1:]) if a >= t0 and b <= t1]
        return _common.median(spans) if spans else 0.0

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


def _settle(pids: list[int], timeout: float = 30.0) -> None:
    """Wait until no ps's resident memory moved by 1 MiB in 0.3 s (at most `timeout`)."""
    import psutil

    processes = [psutil.Process(pid) for pid in pids]
    last = [p.memory_info().rss for p in processes]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.3)  # a benchmark's wait for the ps tasks' memory to stop moving
        now = [p.memory_info().rss for p in processes]
        if all(abs(a - b) < 1 << 20 for a, b in zip(now, last)):
            return
        last = now


def write_deltas(strategy, model, rows: int, count: int) -> list[dict]:
    """`count` phases of DELTA_STEPS fit steps, each on rows of its own: each writes one delta."""
    import tensorflow as tf

    written = []
    for phase in range(count):
        def phase_data(ctx, phase=phase):
            start = (phase + 1) * rows // (count + 2)  # this phase's rows, apart from the others'
            ids = start + tf.random.stateless_uniform([BATCH * 4, 4], seed=[3, phase], maxval=BATCH * 16,
                                                      dtype=tf.int32)
            labels = tf.cast(ids[:, :1] % 2, tf.float32)
            return tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH, drop_remainder=True).repeat()

        before = strategy.stats(read_ps=False)["checkpoints"]["deltas_written"]
        model.fit(phase_data, epochs=1, steps_per_epoch=DELTA_STEPS, verbose=0)
        deadline = time.monotonic() + 300
        while strategy.stats(read_ps=False)["checkpoints"]["deltas_written"] <= before:
            if time.monotonic() > deadline:
                raise TimeoutError(f"delta {phase + 1} was not written within 300 s")
            time.sleep(0.05)  # a benchmark's wait for the background write
        stats = strategy.stats(read_ps=False)["checkpoints"]
        written.append({"bytes": stats["last_delta_bytes"], "rows": stats["last_delta_rows"],
                        "write_s": round(stats["last_delta_seconds"], 3)})
    return written


def setup(path: str, cluster, rows: int, directory: str, saves: int, deltas: int = 0, checkpoint_cut: str = "rows"):
    """(save() -> None, restore() -> None, strategy) for one path."""
    import tensorflow as tf

    if path == "tf_pss":
        import tf_keras

        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster.training_spec()), task_type="chief", task_id=0, rpc_layer="grpc")
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner())
        with strategy.scope():
            model = build_model(tf_keras, rows)
        data = tf_keras.utils.experimental.DatasetCreator(lambda ctx: make_dataset(rows))
        model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        saved = []

        def save():
            saved.append(checkpoint.save(os.path.join(directory, "ckpt")))
            return saved[-1]

        def restore():
            checkpoint.restore(saved[-1]).assert_existing_objects_matched()
        return save, restore, strategy, model

    import keras

    import psclient

    # Every checkpoint kept, as tf.train.Checkpoint.save keeps them: neither path deletes files while timed
    # (+1: the strategy checkpoints new variables before the first fit step; then the saves while training).
    # With deltas, one falls due every DELTA_STEPS completed steps (`write_deltas`).
    more = {"delta_checkpoint_every": DELTA_STEPS} if deltas else {}
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=directory, variable_partitioner=partitioner(),
                                                checkpoints_to_keep=2 * saves + 1, checkpoint_cut=checkpoint_cut, **more)
    with strategy.scope():
        model = build_model(keras, rows)
    model.fit(lambda ctx: make_dataset(rows), epochs=1, steps_per_epoch=2, verbose=0)
    return strategy.save_checkpoint, strategy.restore, strategy, model


def while_training(strategy, model, rows: int, saves: int, ps_pids: list[int]) -> dict:
    """psclient's saves while `model.fit` trains in another thread (see the module docstring)."""
    import keras

    stop = threading.Event()

    class StopWhenAsked(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if stop.is_set():
                self.model.stop_training = True

    failure = []

    def train():
        try:
            model.fit(lambda ctx: make_dataset(rows), epochs=1, steps_per_epoch=10**7, verbose=0,
                      callbacks=[StopWhenAsked()])
        except Exception as error:  # noqa: BLE001 - reported in the results
            failure.append(f"{type(error).__name__}: {error}")

    def completed() -> int:
        return strategy.stats(read_ps=False)["completed"]

    trainer = threading.Thread(target=train, name="bench-fit")
    start = completed()
    trainer.start()
    deadline = time.monotonic() + 300
    while completed() < start + 20 and not failure and time.monotonic() < deadline:
        time.sleep(0.05)  # a benchmark's warm-up: training runs before the first save
    samples = []
    with contextlib.ExitStack() as stack:
        memory = [stack.enter_context(PeakRss(pid)) for pid in ps_pids]
        gaps = stack.enter_context(CompletionGaps(completed))
        baseline_from = time.perf_counter()
        time.sleep(2.0)  # steps without a save: the usual time between completions
        baseline = (baseline_from, time.perf_counter())
        for _ in range(saves):
            before, t0 = completed(), time.perf_counter()
            strategy.save_checkpoint()
            call_s = time.perf_counter() - t0
            time.sleep(1.0)  # the first steps after the cut (a copy moved out of it lands there)
            stats = strategy.stats(read_ps=False)["checkpoints"]
            samples.append({"stall_s": round(stats["last_stall_seconds"], 4),
                            "drain_s": round(stats["last_drain_seconds"], 4),
                            "idle_s": round(stats["last_stall_seconds"] - stats["last_drain_seconds"], 4),
                            "snapshot_s": round(stats["last_snapshot_seconds"], 4),
                            # checkpoint_cut="rows": the copy before the pause (training went on) and
                            # the rows its cut read again.
                            "copy_s": round(stats.get("last_copy_seconds") or 0.0, 4),
                            "copied_mb": round((stats.get("last_copied_bytes") or 0) / 2**20, 1),
                            "rows_read_again": stats.get("last_rows_read_again"),
                            "write_s": round(stats["last_write_seconds"], 3), "save_call_s": round(call_s, 3),
                            "closures_completed_during_save": completed() - before,
                            # The write runs on; the window is the cut and the second after the call.
                            "longest_no_progress_s": round(gaps.longest(t0, t0 + call_s + 1.0), 4)})
    stop.set()
    trainer.join(300)
    variables = rows * ROW_BYTES / NUM_PS  # per ps: its shard of the table and of the accumulator
    return {
        "saves": samples,
        "median_stall_s": _common.median([s["stall_s"] for s in samples]),
        "median_idle_s": _common.median([s["idle_s"] for s in samples]),
        "median_copy_s": _common.median([s["copy_s"] for s in samples]),
        "median_write_s": _common.median([s["write_s"] for s in samples]),
        "median_longest_no_progress_s": _common.median([s["longest_no_progress_s"] for s in samples]),
        "median_time_between_completions_s": round(gaps.median(*baseline), 4),
        "ps": [{"variables_mb": round(variables / 2**20, 1), "rss_mb_before": round(m.before / 2**20, 1),
                "rss_mb_peak": round(m.peak / 2**20, 1),
                "ps_peak_over_variables": round(m.peak / variables, 2),
                "ps_growth_over_variables": round((m.peak - m.before) / variables, 2)} for m in memory],
        "training_error": failure[0] if failure else None,
    }


def child_main(args: argparse.Namespace) -> None:
    _common.exit_with_parent()
    SHARDS["count"] = args.shards
    import psclient

    cluster = psclient.Cluster(json.loads(args.cluster))
    directory = tempfile.mkdtemp(prefix=f"big-model-ckpt-{args._child}-", dir=args.scratch)
    try:
        t0 = time.perf_counter()
        save, restore, strategy, model = setup(args._child, cluster, args.rows, directory, args.saves, args.deltas,
                                               args.checkpoint_cut)
        setup_s = time.perf_counter() - t0
        ps_pids = list(json.loads(args.ps_pids))
        # First, while the ps tasks' memory is that of training alone (TF keeps what it freed).
        during = while_training(strategy, model, args.rows, args.saves, ps_pids) if args._child == "psclient" else None
        saves, restores = [], []
        with PeakRss() as save_memory:
            for _ in range(args.saves):
                t0 = time.perf_counter()
                newest = save()  # psclient: returns once written (nothing trains meanwhile here)
                saves.append(time.perf_counter() - t0)
        deltas = None
        if args.deltas:
            deltas = write_deltas(strategy, model, args.rows, args.deltas)
            restore()  # not measured: it drops the deltas' base kept on each ps (a restore ends the chain)
        _settle(ps_pids)  # what the saves freed is given back (asynchronously) before the restores' baseline
        with PeakRss() as restore_memory, contextlib.ExitStack() as stack:
            ps_memory = [stack.enter_context(PeakRss(pid)) for pid in ps_pids]
            for _ in range(args.restores):
                t0 = time.perf_counter()
                last_restore = restore() or {}
                restores.append(time.perf_counter() - t0)
        stem = os.path.basename(newest) + "."
        on_disk = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory) if n.startswith(stem))
        result = {
            "setup_s": round(setup_s, 2),
            "first_save_s": round(saves[0], 3),
            "median_save_s": round(_common.median(saves[1:] or saves), 3),
            "saves_s": [round(s, 3) for s in saves],
            "median_restore_s": round(_common.median(restores), 3),
            "restores_s": [round(s, 3) for s in restores],
            "coordinator_rss_mb_before_saves": round(save_memory.before / 2**20, 1),
            "coordinator_rss_mb_growth_during_saves": round((save_memory.peak - save_memory.before) / 2**20, 1),
            "coordinator_rss_mb_growth_during_restores":
                round((restore_memory.peak - restore_memory.before) / 2**20, 1),
            "newest_checkpoint_mb": round(on_disk / 2**20, 1),
            "ps_rss_mb": _common.task_usage(ps_pids)["rss_mib"],
            # peak_over_variables: (its variables + the growth) over its variables, the variables being
            # in its RSS before. Honest with --ps-malloc only: TF's default (oneDNN) CPU allocator keeps
            # what was freed (the saves' snapshots), which a restore then reuses unseen.
            "ps_during_restores": [{"rss_mb_before": round(m.before / 2**20, 1), "rss_mb_peak": round(m.peak / 2**20, 1),
                                    "growth_over_variables": round((m.peak - m.before) / (args.rows * ROW_BYTES / NUM_PS),
                                                                   3),
                                    "peak_over_variables": round(1 + (m.peak - m.before)
                                                                 / (args.rows * ROW_BYTES / NUM_PS), 3)}
                                   for m in ps_memory],
        }
        if during is not None:
            result["while_training"] = during
        if deltas is not None:
            result["deltas_written"] = deltas
            result["deltas_restored"] = len(last_restore.get("deltas") or [])
        del strategy
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # before child_exit: it ends the process at once
    _common.child_exit(result)


def summarize(runs: dict) -> dict:
    results = {}
    for size, per_path in runs.items():
        ours, theirs = per_path.get("psclient", {}), per_path.get("tf_pss", {})
        entry = {"psclient": ours, "tf_pss": theirs}
        if "error" not in ours and "error" not in theirs and ours and theirs:
            for key in ("first_save_s", "median_save_s", "median_restore_s"):
                entry[f"psclient/tf_pss {key}"] = round(ours[key] / theirs[key], 3)
        results[size] = entry
    return results


def parent_main(args: argparse.Namespace, argv: list[str]) -> int:
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    output = {"config": {
        **_common.environment(argv),
        "model": f"Embedding(rows, {DIM}) -> Flatten -> Dense(1), Adagrad; 2 fit steps before the saves",
        "sizes_mb": sizes, "rows": {str(s): s * 2**20 // ROW_BYTES for s in sizes},
        "parameter_bytes": "table + Adagrad accumulator (float32)",
        "num_workers": NUM_WORKERS, "num_ps": NUM_PS, "partitioner": f"MinSizePartitioner(1 MiB, {args.shards} shards)",
        "ps_allocator": ("malloc (TF_ENABLE_ONEDNN_OPTS=0, MALLOC_MMAP_THRESHOLD_=1 MiB: freed blocks of 1 MiB "
                         "or more go back to the system, so RSS follows what is live)") if args.ps_malloc else "TF's default (oneDNN: keeps what it frees)",
        "saves": args.saves, "restores": args.restores, "scratch": args.scratch,
        "deltas": (f"{args.deltas} deltas of the newest full checkpoint ({DELTA_STEPS} fit steps each), "
                   "applied by each measured restore") if args.deltas else None,
        "pruning": "none while timed: every checkpoint is kept on both paths",
        "checkpoint_cut": f"psclient: StrategyConfig(checkpoint_cut={args.checkpoint_cut!r})",
        "paths": {"psclient": "strategy.save_checkpoint() / strategy.restore()",
                  "tf_pss": "tf_keras + TF ParameterServerStrategy, tf.train.Checkpoint(model, optimizer)"},
    }}
    runs: dict = {}
    env = _common.quiet_tf_env(GRPC_FAIL_FAST="use_caller")
    started = time.perf_counter()
    with _common.stop_on_sigterm():
        for size in sizes:
            rows = size * 2**20 // ROW_BYTES
            runs[str(size)] = {}
            for path in args.paths.split(","):
                # A fresh cluster per run: the ps memory of one path does not carry into the other's.
                # glibc's malloc keeps freed blocks under its mmap threshold (which rises to 32 MiB as
                # blocks are freed): fixed at 1 MiB, every block of 1 MiB or more goes back when freed.
                tasks_env = {"TF_ENABLE_ONEDNN_OPTS": "0", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)} if args.ps_malloc else None
                with _common.local_cluster(NUM_WORKERS, NUM_PS, start_timeout=300, env=tasks_env) as (cluster, task_pids):
                    ps_pids = [pid for name, pid in task_pids.items() if name.startswith("ps:")]
                    child = [os.path.abspath(__file__), "--_child", path, "--rows", str(rows),
                             "--cluster", json.dumps(cluster.jobs), "--ps-pids", json.dumps(ps_pids),
                             "--saves", str(args.saves), "--restores", str(args.restores),
                             "--scratch", args.scratch, "--shards", str(args.shards), "--deltas", str(args.deltas),
                             "--checkpoint-cut", args.checkpoint_cut]
                    tag = f"{size:>5} MB {path:9}"
                    try:
                        result = _common.run_child(child, timeout=args.child_timeout, env=env)
                    except _common.ChildError as error:
                        _common.log(f"{tag} FAILED: {error}")
                        result = {"error": str(error)}
                    else:
                        _common.log(f"{tag} save {result['median_save_s']:.2f} s (first {result['first_save_s']:.2f} s)"
                                    f", restore {result['median_restore_s']:.2f} s, coordinator +"
                                    f"{result['coordinator_rss_mb_growth_during_saves']:.0f} MB during saves")
                        if "while_training" in result:
                            during = result["while_training"]
                            _common.log(f"{tag} while training: stall {during['median_stall_s']:.3f} s, "
                                        f"write {during['median_write_s']:.2f} s, no progress for "
                                        f"{during['median_longest_no_progress_s']:.3f} s around a save (usual "
                                        f"{during['median_time_between_completions_s']:.3f} s)")
                    runs[str(size)][path] = result
    output["config"]["wall_s"] = round(time.perf_counter() - started, 1)
    output["results"] = summarize(runs)
    largest = output["results"].get(str(max(sizes)), {})
    ratio = largest.get("psclient/tf_pss median_save_s")
    output["targets"] = {TARGET: None if ratio is None else ratio <= 1.0}
    nonstop = [per.get("psclient", {}).get("while_training") for per in output["results"].values()]
    nonstop = [n for n in nonstop if n]
    output["stall_vs_write"] = {
        size: {key: per["psclient"]["while_training"][key] for key in (
            "median_stall_s", "median_idle_s", "median_write_s", "median_longest_no_progress_s",
            "median_time_between_completions_s")}
        for size, per in output["results"].items() if per.get("psclient", {}).get("while_training")}
    output["targets"][STALL_TARGET] = all(n["median_idle_s"] <= 0.2 for n in nonstop) if nonstop else None
    restores = [p for per in output["results"].values() for p in per.get("psclient", {}).get("ps_during_restores", [])]
    output["targets"][RESTORE_MEMORY_TARGET] = (all(p["peak_over_variables"] <= 1.2 for p in restores)
                                                if restores and args.ps_malloc else None)
    output["targets"][PS_MEMORY_TARGET] = all(p["ps_growth_over_variables"] <= 1.0 for n in nonstop
                                              for p in n["ps"]) if nonstop else None
    _common.print_json(output)
    if args.save_results:
        os.makedirs(os.path.join(_HERE, "results"), exist_ok=True)
        name = args.results_name or f"big-model-checkpoint-{time.strftime('%Y-%m-%d')}"
        saved = os.path.join(_HERE, "results", f"{name}.json")
        with open(saved, "w") as f:
            json.dump(output, f, indent=2)
            f.write("\n")
        _common.log(f"saved {os.path.relpath(saved, os.path.dirname(_HERE))}")
    return 1 if any("error" in r for per in runs.values() for r in per.values()) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", default="128,512,2048", help="parameter sizes in MiB, comma-separated")
    parser.add_argument("--saves", type=int, default=3, help="saves per run (the first is reported apart)")
    parser.add_argument("--restores", type=int, default=2, help="restores per run")
    parser.add_argument("--paths", default=",".join(PATHS), help="which paths to run, comma-separated")
    parser.add_argument("--scratch", default=tempfile.gettempdir(), help="where the checkpoints are written")
    parser.add_argument("--child-timeout", type=float, default=900.0, help="seconds per run before it is killed")
    parser.add_argument("--save-results", action="store_true", help="also write benchmarks/results/...json")
    parser.add_argument("--shards", type=int, default=NUM_PS, help="shards per partitioned variable")
    parser.add_argument("--deltas", type=int, default=0,
                        help="psclient only: write this many deltas after the saves; the restores apply them")
    parser.add_argument("--ps-malloc", action="store_true",
                        help="run the cluster's tasks with TF_ENABLE_ONEDNN_OPTS=0 (plain malloc: RSS follows "
                             "live memory; TF's default allocator keeps freed memory, hiding a restore's peak)")
    parser.add_argument("--results-name", default=None, help="the name of the results file (with --save-results)")
    parser.add_argument("--checkpoint-cut", choices=("rows", "copy"), default="rows",
                        help="psclient's StrategyConfig(checkpoint_cut=...): how the cut reads the embedding")
    parser.add_argument("--_child", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--ps-pids", default="[]", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        try:
            child_main(args)  # Exits the process.
        except BaseException:
            traceback.print_exc()
            _common.child_exit(None, status=1)
    if not args.paths or not set(args.paths.split(",")) <= set(PATHS):
        parser.error(f"--paths must name some of {', '.join(PATHS)}. Received: {args.paths!r}.")
    if not all(s.strip().isdigit() and int(s) > 0 for s in args.sizes_mb.split(",")):
        parser.error(f"--sizes-mb must be comma-separated integers >= 1. Received: {args.sizes_mb!r}.")
    for name in ("saves", "restores", "shards"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be an integer >= 1. Received: {getattr(args, name)}.")
    if args.deltas < 0 or (args.deltas and args.paths != "psclient"):
        parser.error(f"--deltas must be an integer >= 0, with --paths psclient. Received: --deltas {args.deltas}, "
                     f"--paths {args.paths}.")
    return _common.run_parent(parent_main, args, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())
