"""Incremental checkpoints (`delta_checkpoint_every`): a delta's bytes and stall against a full checkpoint's.

One LocalCluster (1 worker, 2 ps), one coordinator (this process): a Keras 3
`Embedding(rows, 32)` partitioned over the 2 ps, GlobalAveragePooling1D, Dense(1),
Adagrad. The strategy writes a full checkpoint before the first step; then each
phase trains `--touched` distinct rows (steps of 1000 ids) and the strategy writes a
delta after it. Per checkpoint: bytes on disk, stall (dispatch paused for the cut),
background write seconds (and a last full checkpoint after training, for a like-for-like
stall); for each delta, its bytes over the bound of the issue,
`touched x (row + slot bytes) + keys` (an int64 index per row written, for the
table and its accumulator). Then a second strategy restores full + deltas.

    nice -n 10 python benchmarks/delta_checkpoint.py                     # 1M rows (256 MB), 10k rows a phase
    nice -n 10 python benchmarks/delta_checkpoint.py --rows 200000 --touched 5000 --deltas 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

DIM, IDS = 32, 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--touched", type=int, default=10_000, help="distinct rows trained between checkpoints")
    parser.add_argument("--deltas", type=int, default=3)
    args = parser.parse_args()
    steps = max(1, args.touched // IDS)
    touched = steps * IDS

    import keras
    import numpy as np
    import tensorflow as tf

    import psclient

    directory = tempfile.mkdtemp(prefix="psclient-delta-bench-")
    partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)
    result = {"rows": args.rows, "dim": DIM, "touched_per_delta": touched,
              "parameter_mb": round(args.rows * DIM * 4 * 2 / 2**20, 1), "checkpoints": []}

    def build():
        inputs = keras.Input((IDS,), dtype="int32")
        x = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(args.rows, DIM)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1)(x))
        optimizer = keras.optimizers.Adagrad(0.1)
        optimizer.build(model.trainable_variables)
        return model, optimizer

    with psclient.LocalCluster(num_workers=1, num_ps=2, start_method="spawn") as cluster:
        strategy = psclient.ParameterServerStrategy(
            cluster.cluster, checkpoint_dir=directory, delta_checkpoint_every=steps, hang_timeout=60.0,
            variable_partitioner=partitioner)
        try:
            with strategy.scope():
                model, optimizer = build()

            def step_for(ids):
                x = tf.constant(ids.reshape(1, IDS))

                @tf.function
                def step():
                    with tf.GradientTape() as tape:
                        loss = tf.reduce_sum(model(x, training=True))
                    grads = tape.gradient(loss, model.trainable_variables)
                    optimizer.apply_gradients(zip(grads, model.trainable_variables))
                    return loss
                return step

            rng = np.random.default_rng(0)
            for phase in range(1, args.deltas + 1):
                # The first schedule() takes the full checkpoint first (before any update: its reads
                # copied nothing), then `steps` steps make a delta fall due.
                ids = rng.choice(args.rows, touched, replace=False).astype("int32")
                for s in range(steps):
                    strategy.schedule(step_for(ids[s * IDS:(s + 1) * IDS]))
                strategy.join(timeout=600)
                deadline = time.monotonic() + 600
                while strategy.stats()["checkpoints"]["background_writes"] < phase + 1:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"checkpoint {phase + 1} was not written in 600 s")
                    time.sleep(0.05)
                stats = strategy.stats()
                c = stats["checkpoints"]
                if phase == 1:
                    result["checkpoints"].append({"kind": "full, before training",
                                                  "bytes": stats["checkpoint"]["last_bytes"],
                                                  "write_s": stats["checkpoint"]["last_seconds"]})
                bound = touched * (2 * DIM * 4) + 2 * touched * 8
                entry = {"kind": "delta", "bytes": c["last_delta_bytes"], "stall_s": c["last_stall_seconds"],
                         "write_s": c["last_delta_seconds"], "rows_written": c["last_delta_rows"],
                         "bound_bytes": bound, "over_bound": round(c["last_delta_bytes"] / bound, 3)}
                result["checkpoints"].append(entry)
                print(json.dumps(entry), file=sys.stderr)
            chain = directory + "-chain"  # the full checkpoint and its deltas, for the restore below
            shutil.copytree(directory, chain)
            # A full checkpoint after training, for a like-for-like stall (the first one's reads copied
            # nothing: no variable had been updated by scatter ops yet, see docs/fault_tolerance.md).
            ids = rng.choice(args.rows, touched, replace=False).astype("int32")
            for s in range(steps - 1):  # fewer than a delta's count: no delta falls due
                strategy.schedule(step_for(ids[s * IDS:(s + 1) * IDS]))
            strategy.join(timeout=600)
            strategy.save_checkpoint()
            stats = strategy.stats()
            entry = {"kind": "full, after training", "bytes": stats["checkpoint"]["last_bytes"],
                     "stall_s": stats["checkpoints"]["last_stall_seconds"],
                     "write_s": stats["checkpoint"]["last_seconds"]}
            result["checkpoints"].append(entry)
            print(json.dumps(entry), file=sys.stderr)
        finally:
            strategy.shutdown()

        strategy = psclient.ParameterServerStrategy(cluster.cluster, checkpoint_dir=chain,
                                                    hang_timeout=60.0, variable_partitioner=partitioner)
        try:
            with strategy.scope():
                build()
            started = time.monotonic()
            restored = strategy.restore()
            result["restore"] = {"seconds": round(time.monotonic() - started, 3),
                                 "deltas": len(restored["deltas"])}
        finally:
            strategy.shutdown()
    shutil.rmtree(directory, ignore_errors=True)
    shutil.rmtree(chain, ignore_errors=True)
    full = result["checkpoints"][0]
    for entry in result["checkpoints"][1:]:
        if entry["kind"] == "delta":
            entry["bytes_over_full"] = round(entry["bytes"] / full["bytes"], 4)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
