"""DynamicEmbedding against the hashing trick at equal memory, side by side on one cluster.

A click model with 26 categorical features (as Criteo's), each either

  dynamic   DynamicEmbedding(dim, capacity=rows) (LRU eviction on the ps)
  hashing   Hashing(num_bins=rows) + Embedding(rows, dim)

then Dense(32, relu) and Dense(1), Adagrad, `model.fit` on LocalCluster(num_workers=2, num_ps=2), in one
coordinator process, the two models interleaved (`--repeats` rounds, each one fit per model of two
epochs of `--steps` steps: the first traces and is not timed, the second is). The ids: per feature, a Zipf law over a window of ids that drifts, so new ids
keep coming and the distinct keys over the run grow with `--steps` (printed).

Measured per path (medians over rounds): steps/s, coordinator CPU per step, task CPU per step (workers
and ps together, from /proc), and for the dynamic path the ps tasks' resident memory after each round
(it must stay bounded when capacity is set) beside `capacity * dim * 4 * (1 + slots)` bytes of table
payload, and keys looked up per second per ps task (distinct keys per batch and feature, summed, times
steps/s, over the ps tasks).

    python benchmarks/dynamic_embeddings.py [--steps 60 --repeats 2 --rows 20000 --batch 512]

Prints one JSON object (progress on stderr). Noisy machine: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import cpu_seconds, environment, log, median, print_json, task_usage  # noqa: E402

FEATURES = 26


def batches(rng, n_batches: int, batch: int, window: int, start: int):
    """`n_batches` batches of ids (batch, FEATURES): per feature Zipf(1.1) over a window drifting by one id per example."""
    ranks = np.arange(1, window + 1, dtype="float64")
    p = ranks**-1.1 / np.sum(ranks**-1.1)
    out = []
    for b in range(n_batches):
        t0 = start + b * batch
        age = rng.choice(window, size=(batch, FEATURES), p=p)
        newest = t0 + np.arange(batch)[:, None] + window
        ids = (np.arange(FEATURES)[None, :] + 1) * 10**12 + newest - age
        out.append(ids.astype("int64"))
    return out


def build(keras, kind: str, rows: int, dim: int):
    from psclient.layers import DynamicEmbedding

    ids = keras.Input((FEATURES,), dtype="int64")
    parts = []
    for i in range(FEATURES):
        if kind == "dynamic":
            parts.append(DynamicEmbedding(dim, capacity=rows, name=f"f{i}")(ids[:, i]))
        else:
            parts.append(keras.layers.Embedding(rows, dim, name=f"f{i}")(keras.layers.Hashing(rows)(ids[:, i])))
    x = keras.layers.Dense(32, activation="relu")(keras.layers.Concatenate()(parts))
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rows", type=int, default=20_000, help="rows per feature: capacity and num_bins")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--window", type=int, default=50_000, help="ids in use at once per feature")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import keras

    import psclient

    rng = np.random.default_rng(args.seed)
    result = {"args": vars(args), "environment": environment(sys.argv)}
    with psclient.LocalCluster(num_workers=2, num_ps=2, start_timeout=300) as local:
        pids = {f"{job}:{i}": local.pid(job, i) for job, i, _ in local.cluster.tasks()}
        ps_pids = [pid for name, pid in pids.items() if name.startswith("ps")]
        strategy = psclient.ParameterServerStrategy(local.cluster)
        try:
            with strategy.scope():
                models = {kind: build(keras, kind, args.rows, args.dim) for kind in ("dynamic", "hashing")}
            position, seen = 0, set()

            def data(n):
                nonlocal position
                xs = batches(rng, n, args.batch, args.window, position)
                position += n * args.batch
                for x in xs:
                    seen.update(np.unique(x).tolist())
                x = np.concatenate(xs)
                return x, (x[:, 0] % 3 == 0).astype("float32"), np.mean([
                    sum(len(np.unique(b[:, f])) for f in range(FEATURES)) for b in xs])

            # Each fit traces its step anew (a fit's train function is its own), and tracing 26
            # dynamic tables takes minutes here: so one fit per path and round, of a warm-up epoch
            # (tracing) and a timed one, on the same batches (the timed epoch sees no new keys).
            runs = {kind: [] for kind in models}
            rss = []
            for repeat in range(args.repeats):
                order = list(models) if repeat % 2 == 0 else list(reversed(models))
                for kind in order:
                    x, y, keys_per_batch = data(args.steps)
                    marks = []
                    timer = keras.callbacks.LambdaCallback(
                        on_epoch_begin=lambda epoch, logs: marks.append(
                            (time.perf_counter(), time.process_time(), cpu_seconds(list(pids.values())))))
                    models[kind].fit(x, y, batch_size=args.batch, epochs=2, verbose=0, callbacks=[timer])
                    (wall0, self0, tasks0) = marks[1]
                    seconds = time.perf_counter() - wall0
                    runs[kind].append({
                        "steps_per_s": args.steps / seconds,
                        "coordinator_cpu_ms_per_step": 1000 * (time.process_time() - self0) / args.steps,
                        "task_cpu_ms_per_step": 1000 * (cpu_seconds(list(pids.values())) - tasks0) / args.steps,
                        "lookups_per_s_per_ps": keys_per_batch * args.steps / seconds / len(ps_pids),
                    })
                    if kind == "dynamic":
                        rss.append(task_usage(ps_pids)["rss_mib"])
                    log(f"{kind} round {repeat}: {args.steps / seconds:.1f} steps/s")
            tables = strategy.stats()["dynamic_embeddings"]
            rows_held = sum(e["rows"] for name in tables for e in tables[name] if name.startswith("f"))
        finally:
            strategy.shutdown()
    summary = {kind: {k: round(median([r[k] for r in rs]), 2) for k in rs[0]} for kind, rs in runs.items()}
    summary["hashing"].pop("lookups_per_s_per_ps")
    result.update(summary)
    result["dynamic_vs_hashing_steps_per_s"] = round(
        summary["dynamic"]["steps_per_s"] / summary["hashing"]["steps_per_s"], 2)
    result["distinct_keys_over_run"] = len(seen)
    result["dynamic_rows_held"] = rows_held
    result["dynamic_capacity_rows"] = args.rows * FEATURES
    # Adagrad: one slot beside each row.
    result["table_payload_mib_at_capacity"] = round(args.rows * FEATURES * args.dim * 4 * 2 / 2**20, 1)
    result["ps_rss_mib_after_each_dynamic_round"] = rss
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
