"""What each DynamicEmbedding layer adds to a step, against an Embedding behind the hashing trick.

A click model with N categorical features, one embedding layer per feature (`--tables`, e.g. 1, 4 and
26), then Dense(32, relu) and Dense(1), Adagrad, `model.fit` on LocalCluster(num_workers=2, num_ps=2),
in one coordinator process. For each N, two fresh models on the same cluster (`--fresh-cluster`: each
on a cluster of its own) and the same stream
(the ids of `dynamic_embeddings.py`: Zipf over a drifting window, most keys of a batch new):

  dynamic   N DynamicEmbedding(dim, capacity=rows), one per feature
  hashing   N Hashing(num_bins=rows) + Embedding(rows, dim), one per feature
  dynamic_dict  ONE DynamicEmbedding(dim, capacity=N*rows) called on a dict of the N features (their
            keys salted apart by the feature's name; the features share the capacity)

Printed per path and N: steps/s; CPU per step of the coordinator, the ps tasks and the workers, and
of every process apart (`cpu_ms_per_step`: `by_process`, `by_role`, `all`; psutil, as
benchmarks/step_cpu.py reads it, `_common.ProcessCPU`), with the share of the CPUs other processes
used meanwhile and the load average (a shared machine); and `ps_ops_in_step` / `other_ops_in_step`:
the operations placed on ps tasks in the traced training step, and the rest (a custom step of the
same model: forward, gradient, `optimizer.apply`; the ops of the conditionals' branches included, as
they are in the step's graph whether a branch runs or not). With `--repeats`, every figure is the
median of the interleaved runs, each run kept under `runs`. Then per path, what one more table costs:
`ms_per_step_per_table` and `ps_ops_per_table` (the difference between the largest and the smallest
N, over the tables between them), and the ratios of dynamic to hashing steps/s and CPU per step (all
processes) per N.

    python benchmarks/dynamic_many_tables.py                  # N = 1, 4, 26: about 6 minutes on a loaded 2-core machine
    python benchmarks/dynamic_many_tables.py --tables 1,8 --steps 60
    python benchmarks/dynamic_many_tables.py --tables 1 --paths hashing,dynamic --steps 200 --repeats 3
    python benchmarks/dynamic_many_tables.py --tables 26 --min-frequency 2 --ttl-steps 400   # the policies with a scan
    python benchmarks/dynamic_many_tables.py --tables 26 --paths dynamic --perf   # where the tasks' CPU goes
    python benchmarks/dynamic_many_tables.py --tables 1 --paths hashing,dynamic --repeats 3 --fresh-cluster

With `--perf` (Linux `perf`, as root), each run also samples the ps tasks and the workers over its
timed steps (`perf record -F 1999 -p <pids>`, one recording per job) and adds `ps_perf` and
`worker_perf`: their CPU per step by kind of code (the
categories of `PERF_KINDS`: TF's executor, its thread pool, malloc/free, hash tables, gRPC and
rendezvous, ...; the rest is the kernels' own work), and the symbols that took the most, in ms per
step over all tasks of the job. Sampling costs the tasks some CPU: compare runs that all used it.
`--perf-kernels` also records call graphs (`-F 999 --call-graph dwarf`) and adds
`op_kernels_with_callees_ms_per_step`: each op kernel's `Compute` with all it calls (its mallocs and
copies too), i.e. what each kind of op costs the job a step.

Prints one JSON object (progress on stderr). Noisy machine: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import ProcessCPU, environment, log, median, print_json  # noqa: E402
from dynamic_embeddings import FEATURES, stream  # noqa: E402

PATHS = ("dynamic", "hashing", "dynamic_dict")

# Kinds of code in a ps task's samples, by symbol (the first that matches; unmatched: the kernels' own work).
PERF_KINDS = (
    ("executor", r"ExecutorState|PropagatorState|NodeDone|ScheduleReady|tensorflow::Entry|ExecutorImpl|OpKernelContext"
                 r"|ThreadPoolDevice::Compute|InputRange|Tensor::|TensorBuffer|RefCounted"),
    ("thread_pool", r"Eigen::RunQueue|ThreadPoolTempl|EigenEnvironment|MaybeGetTask|GlobalSteal|LocalSteal"),
    ("malloc_free", r"malloc|free|_int_|unlink_chunk|consolidate|memalign|Allocator|operator new|operator delete"),
    ("hash_tables", r"lookup::|_Hashtable|HashTable"),
    ("memory_copies", r"mem(move|cpy|set|cmp)"),
    ("locks", r"Mutex|mutex|futex|spin"),
    ("grpc_rendezvous", r"grpc|gpr_|protobuf|Rendezvous|Recv|Send|Rpc|Proto"),
    ("top_k_sort", r"TopK|sort|heap"),
)


class TaskPerf:
    """`perf record` of each job's tasks (one recording per job) between `start()` and `stop()`;
    `summary(steps)`: per job, its tasks' CPU ms per step by kind of code and by symbol."""

    def __init__(self, pids_by_job: dict[str, list[int]], call_graphs: bool = False):
        self.pids_by_job, self.processes, self.call_graphs = pids_by_job, {}, call_graphs
        self.directory = tempfile.mkdtemp(prefix="task_perf_")

    def _path(self, job: str) -> str:
        return os.path.join(self.directory, f"{job}.data")

    def start(self) -> None:
        self.processes = {
            job: subprocess.Popen(["perf", "record", *self._sampling(), "-o", self._path(job), "-p", ",".join(map(str, pids))],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for job, pids in self.pids_by_job.items()}

    def _sampling(self) -> list[str]:
        # With call graphs: stacks unwound from DWARF (TF's libraries have no frame pointers, so `-g`
        # breaks off inside them), so fewer samples, each with 16 kB of the stack.
        return ["-F", "999", "--call-graph", "dwarf,16384"] if self.call_graphs else ["-F", "1999"]

    def stop(self) -> None:
        """Stop the recordings (a no-op when none runs: `one_run` also calls it after a failed fit)."""
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGINT)  # perf writes its file and exits
                process.wait(timeout=120)

    def summary(self, steps: int) -> dict:
        try:
            return {job: self._summary(self._path(job), steps, self.call_graphs) for job in self.processes}
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)  # the recordings too, when a report failed

    @staticmethod
    def _summary(path: str, steps: int, call_graphs: bool = False) -> dict:
        report = subprocess.run(["perf", "report", "-i", path, "--no-children", "--sort", "sym", "--stdio", "-g", "none",
                                 "--no-inline"],
                                capture_output=True, text=True, check=True).stdout
        kernels = TaskPerf._kernels(path, steps) if call_graphs else None
        os.remove(path)
        per_step = TaskPerf._ms_per_step(report, steps)
        kinds, symbols = collections.Counter(), collections.Counter()
        for line in report.splitlines():
            match = re.match(r"\s+([\d.]+)%\s+\[(.)\]\s+(.*)", line)
            if not match:
                continue
            ms = float(match.group(1)) / 100 * per_step
            symbol = match.group(3).strip()
            symbols[symbol[:100]] += ms
            kind = next((name for name, pattern in PERF_KINDS if re.search(pattern, symbol)),
                        "os_kernel" if match.group(2) == "k" else "kernels_own_work")
            kinds[kind] += ms
        summary = {"ms_per_step": round(per_step, 2),
                   "by_kind_ms_per_step": {kind: round(ms, 2) for kind, ms in kinds.most_common()},
                   "top_symbols_ms_per_step": {name: round(ms, 2) for name, ms in symbols.most_common(25)}}
        if kernels is not None:
            summary["op_kernels_with_callees_ms_per_step"] = kernels
        return summary

    @staticmethod
    def _ms_per_step(report: str, steps: int) -> float:
        """ms of the job's tasks' CPU a step, all of them, from a `perf report`'s event count (ns)."""
        count = re.search(r"Event count \(approx\.\): (\d+)", report)
        if count is None:  # `perf report` exits 0 on a recording without samples
            raise RuntimeError("perf recorded no samples of the tasks (perf record -p attached to their pids, "
                               f"but its report reads: {report.strip()[:200]!r}); run `perf record -p <pid>` by "
                               "hand to see why, or leave out --perf")
        return float(count.group(1)) / 1e6 / steps

    @staticmethod
    def _kernels(path: str, steps: int) -> dict:
        """ms a step in each op kernel's `Compute` with everything it calls (malloc and copies
        included), from the call graphs: what each kind of op costs, where `top_symbols` has only
        the innermost frames. Kernels nest (a function call's kernel runs others), so they overlap."""
        # --no-inline: without it, perf resolves inlined frames of TF's libraries by addr2line, which
        # had not finished one recording of 100 steps after 14 minutes (10 s with it).
        report = subprocess.run(["perf", "report", "-i", path, "--children", "--sort", "sym", "--stdio", "-g", "none",
                                 "--no-inline"],
                                capture_output=True, text=True, check=True).stdout
        per_step = TaskPerf._ms_per_step(report, steps)
        kernels = collections.Counter()
        for line in report.splitlines():
            match = re.match(r"\s+([\d.]+)%\s+[\d.]+%\s+\[.\]\s+(.*)", line)
            symbol = match.group(2).strip() if match else ""
            # A kernel's entry (`...Op<...>::Compute`), not the device's, which runs every kernel.
            if re.search(r"::Compute(Async)?$", symbol) and "Device::" not in symbol:
                kernels[symbol[:120]] += float(match.group(1)) / 100 * per_step
        return {name: round(ms, 2) for name, ms in kernels.most_common(30)}


def build(keras, kind: str, tables: int, rows: int, dim: int, **policy):
    from psclient.layers import DynamicEmbedding

    ids = keras.Input((tables,), dtype="int64")
    parts = []
    if kind == "dynamic_dict":
        embedded = DynamicEmbedding(dim, capacity=rows * tables, name="features", **policy)(
            {f"f{i}": ids[:, i] for i in range(tables)})
        parts = [embedded[f"f{i}"] for i in range(tables)]
    for i in range(tables if kind != "dynamic_dict" else 0):
        if kind == "dynamic":
            parts.append(DynamicEmbedding(dim, capacity=rows, name=f"f{i}", **policy)(ids[:, i]))
        else:
            parts.append(keras.layers.Embedding(rows, dim, name=f"f{i}")(keras.layers.Hashing(rows)(ids[:, i])))
    embedded = keras.layers.Concatenate()(parts) if tables > 1 else parts[0]
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Dense(32, activation="relu")(embedded)))
    model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def ops_in_step(tf, keras, model, batch: int, tables: int) -> dict:
    """Operations in a traced training step of `model` (branch functions included): those placed on
    a ps task (`ps_ops_in_step`) and the rest (`other_ops_in_step`: the worker's, or placed there by
    TF's placer at run time)."""
    optimizer = model.optimizer

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(model.loss(y, model(x, training=True)))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    graph = step.get_concrete_function(tf.TensorSpec((batch, tables), tf.int64),
                                       tf.TensorSpec((batch,), tf.float32)).graph.as_graph_def()
    nodes = [*graph.node, *(node for function in graph.library.function for node in function.node_def)]
    on_ps = sum("/job:ps/" in node.device for node in nodes)
    return {"ps_ops_in_step": on_ps, "other_ops_in_step": len(nodes) - on_ps}


def one_run(keras, tf, strategy, meter, kind: str, n: int, x, y, args, policy: dict, count_ops: bool,
            perf: TaskPerf | None = None) -> dict:
    """One fit of a fresh model of `kind` with `n` tables: its figures, CPU per step of every process
    (and with `perf`, where the ps tasks' CPU went)."""
    gc.collect()
    with strategy.scope():
        model = build(keras, kind, n, args.rows, args.dim, **(policy if kind != "hashing" else {}))
    marks = {}

    def on_batch_end(batch, logs):
        if batch == args.warmup - 1:
            if perf is not None:
                perf.start()
            marks["start"] = meter.read()

    def on_train_end(logs):
        marks["end"] = meter.read()
        if perf is not None:
            perf.stop()

    timer = keras.callbacks.LambdaCallback(on_train_batch_end=on_batch_end, on_train_end=on_train_end)
    try:
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    finally:
        if perf is not None:
            perf.stop()
    cpu = meter.per_step(marks["start"], marks["end"], args.steps)
    roles = cpu["cpu_ms_per_step"]["by_role"]
    run = {
        "steps_per_s": round(args.steps / (marks["end"]["wall"] - marks["start"]["wall"]), 2),
        "coordinator_cpu_ms_per_step": roles["coordinator"],
        "ps_cpu_ms_per_step": roles["ps"],
        "worker_cpu_ms_per_step": roles["worker"],
        **cpu,
    }
    if perf is not None:
        run.update({f"{job}_perf": summary for job, summary in perf.summary(args.steps).items()})
    if count_ops:  # the same graph every repeat: traced once (a step of 26 layers takes a while)
        run.update(ops_in_step(tf, keras, model, args.batch, n))
    del model, timer
    return run


def _medians(runs: list) -> dict:
    """The runs' medians, field by field (numbers, and numbers in nested dicts)."""
    first = runs[0]
    if isinstance(first, dict):
        return {key: _medians([run[key] for run in runs if key in run]) for key in first}
    return round(median(runs), 3) if isinstance(first, (int, float)) else first


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", default="1,4,26", help=f"comma-separated numbers of features, each 1..{FEATURES}")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed first steps of each run (tracing)")
    parser.add_argument("--rows", type=int, default=20_000, help="rows per feature: capacity and num_bins")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {PATHS}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every path and N, interleaved (figures: medians; each run under `runs`)")
    parser.add_argument("--min-frequency", type=int, default=1, help="the dynamic tables' min_frequency")
    parser.add_argument("--ttl-steps", type=int, default=None, help="the dynamic tables' ttl_steps (default: none)")
    parser.add_argument("--perf", action="store_true", help="sample the ps tasks and the workers with Linux perf over the timed steps")
    parser.add_argument("--perf-kernels", action="store_true",
                        help="with --perf: record call graphs and add each job's CPU per op kernel, callees included")
    parser.add_argument("--fresh-cluster", action="store_true",
                        help="start a LocalCluster for each run (about 10 s more a run), not one for all")
    args = parser.parse_args(argv)
    try:
        counts = sorted({int(n) for n in args.tables.split(",") if n})
    except ValueError:
        parser.error(f"--tables must be comma-separated integers, got {args.tables!r}")
    if not counts or any(not 1 <= n <= FEATURES for n in counts):
        parser.error(f"--tables must name numbers between 1 and {FEATURES}, got {args.tables!r}")
    paths = [p for p in args.paths.split(",") if p]
    if not paths or any(p not in PATHS for p in paths):
        parser.error(f"--paths must name some of {PATHS}, got {args.paths!r}")
    if args.min_frequency < 1 or (args.ttl_steps is not None and args.ttl_steps < 1):
        parser.error(f"--min-frequency and --ttl-steps must be >= 1, got {args.min_frequency} and {args.ttl_steps}")
    if args.perf_kernels and not args.perf:
        parser.error("--perf-kernels needs --perf")
    if args.perf and shutil.which("perf") is None:
        parser.error("--perf needs Linux `perf` on the PATH")
    policy = {"min_frequency": args.min_frequency, "ttl_steps": args.ttl_steps}

    import keras
    import tensorflow as tf

    import psclient

    total = args.warmup + args.steps
    x_all = stream(args.seed, total, args.batch, 50_000)
    y = (x_all[:, 0] % 3 == 0).astype("float32")
    result = {"args": vars(args), "environment": environment(sys.argv)}
    runs = [(repeat, n, kind) for repeat in range(args.repeats) for n in counts for kind in paths]
    # One cluster for every run, or (`--fresh-cluster`) one per run: a model built after others on the
    # same tasks may run at another speed than the first one did.
    for group in ([[run] for run in runs] if args.fresh_cluster else [runs]):
        with psclient.LocalCluster(num_workers=2, num_ps=2, start_timeout=300, start_method="spawn") as local:
            pids = {"coordinator": os.getpid(), **{f"{job}:{i}": local.pid(job, i) for job, i, _ in local.cluster.tasks()}}
            meter = ProcessCPU(pids)
            strategy = psclient.ParameterServerStrategy(local.cluster)
            try:
                for repeat, n, kind in group:
                    x = np.ascontiguousarray(x_all[:, :n])
                    perf = TaskPerf({job: [local.pid(job, i) for i in range(2)] for job in ("ps", "worker")},
                                    call_graphs=args.perf_kernels) if args.perf else None
                    run = one_run(keras, tf, strategy, meter, kind, n, x, y, args, policy, count_ops=repeat == 0,
                                  perf=perf)
                    result.setdefault(kind, {}).setdefault(str(n), {"runs": []})["runs"].append(run)
                    log(f"{kind} x{n} (repeat {repeat + 1}): {run}")
            finally:
                strategy.shutdown()
    for kind in paths:
        for n in counts:
            entry = result[kind][str(n)]
            entry.update(_medians(entry["runs"]))
    low, high = str(counts[0]), str(counts[-1])
    for kind in paths:
        runs = result[kind]
        if high != low:
            added = counts[-1] - counts[0]
            runs["ms_per_step_per_table"] = round(
                1000 * (1 / runs[high]["steps_per_s"] - 1 / runs[low]["steps_per_s"]) / added, 2)
            runs["ps_cpu_ms_per_step_per_table"] = round(
                (runs[high]["ps_cpu_ms_per_step"] - runs[low]["ps_cpu_ms_per_step"]) / added, 2)
            runs["ps_ops_per_table"] = round((runs[high]["ps_ops_in_step"] - runs[low]["ps_ops_in_step"]) / added, 1)
    for kind in ("dynamic", "dynamic_dict"):
        if kind in paths and "hashing" in paths:
            result[f"{kind}_vs_hashing_steps_per_s"] = {
                str(n): round(result[kind][str(n)]["steps_per_s"] / result["hashing"][str(n)]["steps_per_s"], 2)
                for n in counts}
            result[f"{kind}_vs_hashing_cpu_per_step"] = {
                str(n): round(result[kind][str(n)]["cpu_ms_per_step"]["all"]
                              / result["hashing"][str(n)]["cpu_ms_per_step"]["all"], 2)
                for n in counts}
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
