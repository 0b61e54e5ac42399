"""DynamicEmbedding against the hashing trick at equal memory, side by side on one cluster, over a long stream.

A click model with 26 categorical features (as Criteo's), then Dense(32, relu) and Dense(1), Adagrad,
`model.fit` on LocalCluster(num_workers=2, num_ps=2), in one coordinator process. The embeddings, one
path after the other on the same cluster and the same stream (each path a fresh model):

  dynamic_shared  ONE DynamicEmbedding(dim, capacity=26*rows) for the 26 features: the keys of different
                  features are disjoint (the feature index sits in the high digits), so one lookup per
                  ps task serves all 26 features
  dynamic         26 DynamicEmbedding(dim, capacity=rows), one per feature (26 lookups per ps task)
  hashing         26 Hashing(num_bins=rows) + Embedding(rows, dim), one per feature
  dynamic_shared_hash  dynamic_shared in the storage bounded tables had before the dense one (hash
                  tables per ps: key -> row, key -> slot, key -> counters), for a before/after;
                  `ParameterServerStrategy(dynamic_table_storage="hash")`, a strategy of its own
  dynamic_shared_marked  dynamic_shared in a strategy with a `checkpoint_dir` (none taken): a table
                  above one checkpoint row chunk (8 MiB a ps) then has write marks on its storage
                  (checkpoints copied before their cut): what the marks cost a step
  dynamic_shared_hash_marked  dynamic_shared_hash with a `checkpoint_dir`: hash tables then say which
                  keys each write touches while a checkpoint copies them (`checkpoints/hash_copy`)

Equal memory: 26*rows rows of `dim` floats (and one Adagrad slot each) in every path.

The ids: per feature, a Zipf(1.1) law over the age of ids in a window that drifts by `--drift` ids per
example (1 by default), so new ids keep coming: the distinct keys grow with the steps; with the defaults
most keys of a batch are new, a stream of extreme churn. psclient sends the arrays to every worker
and each worker walks them from the start, so the keys the cluster saw are those of the first
max(steps per worker) batches: at least those of the first ceil(steps/2) batches, the figure printed
(`distinct_keys_over_run`, a lower bound). Each path runs one `fit` of one epoch; its first `--warmup`
steps (tracing) are not timed. The start mark is taken when the warm-up's last step is scheduled (steps
run asynchronously, a few steps ahead at most).

Printed per path: steps/s; CPU per step of the coordinator, the ps tasks and the workers (from /proc);
for dynamic paths keys looked up per second per ps task (distinct keys per batch and feature, summed,
times steps/s, over the ps tasks), rows held, admissions and evictions, and the ps tasks' resident
memory over the run as growth over what they held before the path's model was built, beside the table
payload `capacity * (dim + slots) * 4` bytes (the target's formula) and beside the floats a row and its
slots hold, `capacity * dim * (1 + slots) * 4` bytes; and, exactly, the bytes the dense storage holds
(`table_bytes` of `strategy.stats()`: rows, slots, per-row counters and key index, allocated for the
whole capacity at the start) over the same two. Only the first path runs on ps tasks that hold
nothing else yet, and pays the ps tasks' own warm-up (TensorFlow's runtime on the ps grows by tens of
MiB in its first steps, whatever the model): for a path's memory run the hashing path first, as a
warm-up, then that path (`--paths hashing,dynamic_shared`). The hashing path's bytes per row are over
its `capacity` rows (all held from the start).

    python benchmarks/dynamic_embeddings.py --paths dynamic_shared,hashing   # >= 10 million distinct keys:
                                                   # 12.5 minutes on a loaded 2-core machine
    python benchmarks/dynamic_embeddings.py --quick    # 200 steps, all three paths: about 5 minutes there
    python benchmarks/dynamic_embeddings.py --rows 40000 --steps 600 \
        --paths dynamic_shared,dynamic_shared_marked,dynamic_shared,dynamic_shared_marked   # the marks' cost
    python benchmarks/dynamic_embeddings.py --rows 40000 --steps 600 --paths \
        dynamic_shared_hash,dynamic_shared_hash_marked,dynamic_shared_hash,dynamic_shared_hash_marked

Prints one JSON object (progress on stderr). Noisy machine: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import cpu_seconds, environment, log, median, print_json, task_usage  # noqa: E402

FEATURES = 26
PATHS = ("dynamic_shared", "hashing", "dynamic", "dynamic_shared_hash", "dynamic_shared_marked",
         "dynamic_shared_hash_marked")


def stream(seed: int, n_batches: int, batch: int, window: int, drift: float = 1.0) -> np.ndarray:
    """(n_batches * batch, FEATURES) ids: per feature Zipf(1.1) over the age in a window drifting by `drift` ids per example."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, window + 1, dtype="float64")
    cdf = np.cumsum(ranks**-1.1)
    cdf /= cdf[-1]
    n = n_batches * batch
    out = np.empty((n, FEATURES), dtype="int64")
    for lo in range(0, n, 1 << 16):
        hi = min(n, lo + (1 << 16))
        age = np.searchsorted(cdf, rng.random((hi - lo, FEATURES)))
        newest = (np.arange(lo, hi) * drift).astype("int64")[:, None] + window
        out[lo:hi] = (np.arange(FEATURES)[None, :] + 1) * 10**12 + newest - age
    return out


def build(keras, kind: str, rows: int, dim: int):
    from psclient.layers import DynamicEmbedding

    ids = keras.Input((FEATURES,), dtype="int64")
    if kind.startswith("dynamic_shared"):
        embedded = keras.layers.Flatten()(DynamicEmbedding(dim, capacity=rows * FEATURES, name="shared")(ids))
    else:
        parts = []
        for i in range(FEATURES):
            if kind == "dynamic":
                parts.append(DynamicEmbedding(dim, capacity=rows, name=f"f{i}")(ids[:, i]))
            else:
                hashed = keras.layers.Hashing(rows)(ids[:, i])
                parts.append(keras.layers.Embedding(rows, dim, name=f"f{i}")(hashed))
        embedded = keras.layers.Concatenate()(parts)
    x = keras.layers.Dense(32, activation="relu")(embedded)
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2400, help="timed steps per path (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed first steps of each path (tracing)")
    parser.add_argument("--rows", type=int, default=20_000, help="rows per feature: capacity and num_bins")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--window", type=int, default=50_000, help="ids in use at once per feature")
    parser.add_argument("--drift", type=float, default=1.0, help="ids the window moves per example (fewer: fewer new keys)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {PATHS}")
    parser.add_argument("--quick", action="store_true", help="a short run: 200 steps, 5,000 rows per feature")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rows = 200, 5_000
    paths = [p for p in args.paths.split(",") if p]
    if not paths or any(p not in PATHS for p in paths):
        parser.error(f"--paths must name some of {PATHS}, got {args.paths!r}")

    import keras

    import psclient

    total = args.warmup + args.steps
    log(f"drawing {total} batches of {args.batch} x {FEATURES} ids")
    x = stream(args.seed, total, args.batch, args.window, args.drift)
    y = (x[:, 0] % 3 == 0).astype("float32")
    led = math.ceil(total / 2) * args.batch  # a lower bound of what one worker walked (see the docstring)
    distinct = int(np.unique(x[:led]).size)
    timed = x[args.warmup * args.batch:].reshape(args.steps, args.batch, FEATURES)
    sample = timed[:: max(1, args.steps // 50)]
    keys_per_batch = float(np.mean([sum(np.unique(b[:, f]).size for f in range(FEATURES)) for b in sample]))
    slots = 1  # Adagrad's accumulator
    capacity = args.rows * FEATURES
    payload_mib = capacity * (args.dim + slots) * 4 / 2**20
    floats_mib = capacity * args.dim * (1 + slots) * 4 / 2**20

    result = {"args": vars(args), "environment": environment(sys.argv),
              "distinct_keys_over_run": distinct, "capacity_rows": capacity,
              "table_payload_mib_at_capacity": round(payload_mib, 1),
              "rows_and_slots_mib_at_capacity": round(floats_mib, 1),
              "rows_and_slots_bytes_per_row": args.dim * (1 + slots) * 4}
    with psclient.LocalCluster(num_workers=2, num_ps=2, start_timeout=300, start_method="spawn") as local, \
            tempfile.TemporaryDirectory(prefix="psclient-bench-") as scratch:
        pids = {f"{job}:{i}": local.pid(job, i) for job, i, _ in local.cluster.tasks()}
        ps_pids = [pid for name, pid in pids.items() if name.startswith("ps")]
        worker_pids = [pid for name, pid in pids.items() if name.startswith("worker")]
        strategy, current = None, None
        try:
            for kind in paths:
                # The hash storage is the strategy's setting: a strategy of its own for that path.
                storage = "hash" if kind.startswith("dynamic_shared_hash") else "dense"
                setting = (storage, kind.endswith("_marked"))
                if strategy is None or setting != current:
                    if strategy is not None:
                        strategy.shutdown()
                    directory = os.path.join(scratch, f"{kind}-{len(result.get('runs', []))}")  # one per run
                    more = {"checkpoint_dir": directory} if setting[1] else {}
                    strategy = psclient.ParameterServerStrategy(local.cluster, dynamic_table_storage=storage, **more)
                    current = setting
                gc.collect()
                rss_before = task_usage(ps_pids)["rss_mib"]
                with strategy.scope():
                    model = build(keras, kind, args.rows, args.dim)
                marks, rss = {}, []

                def mark():
                    return (time.perf_counter(), time.process_time(), cpu_seconds(ps_pids), cpu_seconds(worker_pids))

                def on_batch_end(batch, logs, kind=kind):
                    if batch == args.warmup - 1:
                        marks["start"] = mark()
                    if (batch + 1) % max(1, total // 8) == 0:
                        rss.append(round(task_usage(ps_pids)["rss_mib"] - rss_before, 1))
                        log(f"{kind}: {batch + 1} steps scheduled, ps memory +{rss[-1]} MiB")

                timer = keras.callbacks.LambdaCallback(
                    on_train_batch_end=on_batch_end, on_train_end=lambda logs: marks.__setitem__("end", mark()))
                model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
                (w0, c0, p0, k0), (w1, c1, p1, k1) = marks["start"], marks["end"]
                seconds = w1 - w0
                run = {
                    "steps_per_s": round(args.steps / seconds, 2),
                    "coordinator_cpu_ms_per_step": round(1000 * (c1 - c0) / args.steps, 2),
                    "ps_cpu_ms_per_step": round(1000 * (p1 - p0) / args.steps, 2),
                    "worker_cpu_ms_per_step": round(1000 * (k1 - k0) / args.steps, 2),
                }
                run["task_cpu_ms_per_step"] = round(run["ps_cpu_ms_per_step"] + run["worker_cpu_ms_per_step"], 2)
                if kind.startswith("dynamic_shared"):  # whether its shards' storage has write marks
                    run["write_marks"] = all(shard.marked for layer in model.layers if hasattr(layer, "table")
                                             for shard in layer.table.shards)
                if kind != "hashing":
                    run["lookups_per_s_per_ps"] = round(keys_per_batch * args.steps / seconds / len(ps_pids))
                    tables = strategy.stats()["dynamic_embeddings"]
                    names = ["shared"] if kind.startswith("dynamic_shared") else [f"f{i}" for i in range(FEATURES)]
                    for field in ("rows", "admissions", "evictions", "table_bytes"):
                        if all(field in e for name in names for e in tables[name]):
                            run[field] = sum(e[field] for name in names for e in tables[name])
                    if "table_bytes" in run:  # exact: what the storage holds, at any fill
                        run["table_bytes_per_row_at_capacity"] = round(run["table_bytes"] / capacity, 1)
                        run["table_bytes_vs_payload_at_capacity"] = round(run["table_bytes"] / 2**20 / payload_mib, 2)
                        run["table_bytes_vs_rows_and_slots_at_capacity"] = round(
                            run["table_bytes"] / 2**20 / floats_mib, 2)
                rss.append(round(task_usage(ps_pids)["rss_mib"] - rss_before, 1))
                run["ps_rss_growth_mib_over_run"] = rss
                run["ps_rss_growth_vs_payload_at_capacity"] = round(rss[-1] / payload_mib, 2)
                run["ps_rss_growth_vs_rows_and_slots_at_capacity"] = round(rss[-1] / floats_mib, 2)
                held = capacity if kind == "hashing" else run["rows"]
                run["ps_rss_growth_bytes_per_row_held"] = round(rss[-1] * 2**20 / max(1, held))
                result[kind] = run  # a path given twice: the later run here, each in `runs`
                result.setdefault("runs", []).append({"path": kind, "steps_per_s": run["steps_per_s"]})
                log(f"{kind}: {run['steps_per_s']} steps/s")
                del model, timer
        finally:
            if strategy is not None:
                strategy.shutdown()
    for kind in ("dynamic_shared", "dynamic", "dynamic_shared_hash", "dynamic_shared_marked",
                 "dynamic_shared_hash_marked"):
        if kind in result and "hashing" in result:
            result[f"{kind}_vs_hashing_steps_per_s"] = round(
                result[kind]["steps_per_s"] / result["hashing"]["steps_per_s"], 2)
    def median_of(path):
        return median([r["steps_per_s"] for r in result["runs"] if r["path"] == path])

    for unmarked in ("dynamic_shared", "dynamic_shared_hash"):  # medians over the runs of each
        if unmarked in result and f"{unmarked}_marked" in result:
            result[f"{unmarked}_marked_vs_unmarked_steps_per_s"] = round(
                median_of(f"{unmarked}_marked") / median_of(unmarked), 2)
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
