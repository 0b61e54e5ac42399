"""Delta versions: how fresh `psclient.serving` serves, how big a delta is, how long it pauses training.

One coordinator (this process) on a LocalCluster(num_workers=2, num_ps=2). Model: a
DynamicEmbedding(32) holding `dynamic_rows` rows (filled through `import_state`, setup) -> Dense(1),
Adagrad; with `--embedding-rows N` also a `keras.layers.Embedding(N, 32)` partitioned over the two
ps tasks (`FixedShardsPartitioner(2)`), read at each key modulo N, whose deltas hold its changed rows.
`ServingExport(base, delta_every_seconds=S)` writes a full version (timed: the pause a full version
costs), then training runs on keys drawn from the held rows while deltas are written every S seconds, and `psclient.serving.load(base, poll_seconds=0.2)` follows them in this process. Halfway a
key no step saw before enters every batch; a thread calls the loader until it serves that key's row.

Prints one JSON object: the full version's pause; per delta the pause (the steps in flight finish,
the ps tasks copy the cut), the time the ps tasks then take to diff and write it while training
goes on, its bytes, rows changed and removed, and, for deltas of at least 100 rows, the bytes of its
rows' files over (changed rows x (row bytes + key) + removed keys x key bytes), and the same for the
Embedding's rows (row bytes + an int64 index); the freshness (seconds from the first step that trained
the new key to the loader serving it); the ps tasks' resident memory (VmRSS) before the first full
version, after it (the cut kept from then on), after the deltas and after `release()`.

    nice -n 10 python benchmarks/serving_deltas.py                   # 200k rows, S = 2 s, 20 s of training
    nice -n 10 python benchmarks/serving_deltas.py --dynamic-rows 1000000 --seconds 40
    nice -n 15 python benchmarks/serving_deltas.py --embedding-rows 1000000     # + a 122 MB Embedding

Noisy shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import environment, log, print_json  # noqa: E402

DIM = 32
NEW_KEY = 3 * 10**9
UNSEEN = 10**12


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dynamic-rows", type=int, default=200_000, help="rows held by the DynamicEmbedding")
    parser.add_argument("--delta-every-seconds", type=float, default=2.0, help="S")
    parser.add_argument("--embedding-rows", type=int, default=0, help="rows of a partitioned Embedding beside it "
                        "(0: none)")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of training (twice: before the new key "
                        "and with it)")
    args = parser.parse_args(argv)

    import keras
    import tensorflow as tf

    import psclient
    import psclient.serving
    from psclient.layers import DynamicEmbedding

    work = tempfile.mkdtemp(prefix="psclient-deltas-bench-")
    base = os.path.join(work, "model")
    result = {"config": {**environment(sys.argv), "dynamic_rows": args.dynamic_rows, "dim": DIM,
                         "embedding_rows": args.embedding_rows, "delta_every_seconds": args.delta_every_seconds,
                         "seconds": args.seconds}}
    try:
        with psclient.LocalCluster(num_workers=2, num_ps=2, start_method="spawn") as cluster:
            partitioner = (tf.distribute.experimental.partitioners.FixedShardsPartitioner(2) if args.embedding_rows
                           else None)
            strategy = psclient.ParameterServerStrategy(cluster.cluster, variable_partitioner=partitioner)
            with strategy.scope():
                ids = keras.Input((2,), dtype="int64")
                dynamic = DynamicEmbedding(DIM, name="dynamic")
                features = keras.layers.Flatten()(dynamic(ids))
                if args.embedding_rows:
                    wrapped = keras.layers.Lambda(lambda x: x % args.embedding_rows)(ids)
                    embedded = keras.layers.Embedding(args.embedding_rows, DIM, name="embedding")(wrapped)
                    features = keras.layers.Concatenate()([features, keras.layers.Flatten()(embedded)])
                model = keras.Model(ids, keras.layers.Dense(1)(features))
                model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="mse")
            rng = np.random.default_rng(0)
            model.fit(rng.integers(0, 1000, (256, 2)), np.zeros((256, 1), "float32"), batch_size=64, verbose=0)
            log("filling the dynamic table")
            keys = np.arange(args.dynamic_rows, dtype="int64")
            dynamic.import_state([{"keys": keys, "counters": np.stack([np.ones_like(keys), np.zeros_like(keys)], 1),
                                   "row_keys": keys, "rows": rng.standard_normal((len(keys), DIM)).astype("float32"),
                                   "slots": {}, "clock": 1, "admissions": len(keys), "evictions": 0}])
            callback = psclient.ServingExport(base, every_seconds=10**6, delta_every_seconds=args.delta_every_seconds)
            callback.set_model(model)
            callback.on_train_begin()
            result["ps_rss_mb_before"] = [ps_rss_mb(cluster, k) for k in range(2)]
            log("full version")
            start = time.perf_counter()
            callback.export_now()
            result["full_version_pause_seconds"] = round(time.perf_counter() - start, 3)
            result["full_version_mb"] = round(tree_bytes(callback.exported[-1]) / 2**20, 1)
            result["ps_rss_mb_after_full_version"] = [ps_rss_mb(cluster, k) for k in range(2)]

            def batches(new_key):
                x = rng.integers(0, args.dynamic_rows, (64 * 20_000, 2))
                if new_key:
                    x[:, 1] = NEW_KEY
                y = rng.standard_normal((len(x), 1)).astype("float32")  # rows keep changing
                return tf.data.Dataset.from_tensor_slices((x, y)).batch(64)

            class Until(keras.callbacks.Callback):
                def __init__(self, seconds, seen=None):
                    super().__init__()
                    self.seconds, self.seen, self.began = seconds, seen, None

                def on_train_batch_begin(self, batch, logs=None):
                    self.began = self.began or time.monotonic()

                def on_train_batch_end(self, batch, logs=None):
                    if time.monotonic() - self.began > self.seconds or (self.seen and self.seen.is_set()):
                        self.model.stop_training = True

            log("training, deltas")
            model.fit(batches(False), steps_per_epoch=20_000, verbose=0, callbacks=[callback, Until(args.seconds)])
            with psclient.serving.load(base, poll_seconds=0.2) as loader:
                seen, seen_at = threading.Event(), []

                def watch():
                    pair = tf.constant([[NEW_KEY, NEW_KEY], [UNSEEN, UNSEEN]], tf.int64)
                    while not seen.is_set() and not stop.wait(0.02):
                        out = loader(pair).numpy()
                        if out[0, 0] != out[1, 0]:
                            seen_at.append(time.monotonic())
                            seen.set()

                stop = threading.Event()
                watcher = threading.Thread(target=watch, name="bench-watch")
                watcher.start()
                until = Until(args.seconds + 10, seen)
                log("training with a new key")
                try:
                    model.fit(batches(True), steps_per_epoch=20_000, verbose=0, callbacks=[callback, until])
                finally:
                    stop.set()
                    watcher.join()
                result["freshness_seconds"] = round(seen_at[0] - until.began, 3) if seen_at else None
                result["loader"] = loader.statistics()
            result["ps_rss_mb_after_deltas"] = [ps_rss_mb(cluster, k) for k in range(2)]
            callback.release()  # the kept cut's copies on the ps are freed
            result["ps_rss_mb_after_release"] = [ps_rss_mb(cluster, k) for k in range(2)]
            deltas = callback.deltas
            pauses = [d["seconds"] for d in deltas]
            result["deltas"] = {
                "count": len(deltas),
                "pause_seconds_median": round(float(np.median(pauses)), 3),
                "pause_seconds_max": round(max(pauses), 3),
                "write_seconds_median": round(float(np.median([d["write_seconds"] for d in deltas])), 3),
                "changed_rows_median": int(np.median([d["changed"] for d in deltas])),
                "bytes_median": int(np.median([d["bytes"] for d in deltas])),
                "table_bytes_over_touched_max": round(max(
                    table_bytes(d["path"]) / (d["changed"] * (DIM * 4 + 8) + d["removed"] * 8)
                    for d in deltas if d["changed"] + d["removed"] >= 100), 3) if any(
                    d["changed"] + d["removed"] >= 100 for d in deltas) else None,
                "embedding_rows_changed_median": int(np.median([d["dense_rows_changed"] for d in deltas])),
                "embedding_bytes_over_touched_max": round(max(
                    embedding_bytes(d["path"]) / (d["dense_rows_changed"] * (DIM * 4 + 8))
                    for d in deltas if d["dense_rows_changed"] >= 100), 3) if any(
                    d["dense_rows_changed"] >= 100 for d in deltas) else None,
                "each": [{key: (round(d[key], 3) if isinstance(d[key], float) else d[key])
                          for key in ("seq", "seconds", "join_seconds", "write_seconds", "changed", "removed",
                                      "dense_rows_changed", "bytes")}
                         for d in deltas],
            }
            strategy.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_json(result)


def table_bytes(path: str) -> int:
    """A delta's files of dynamic rows (t<i>_s<k>_...): its dense variables and manifest aside."""
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.name.startswith("t"))


def embedding_bytes(path: str) -> int:
    """A delta's files of the Embedding's rows (manifest entry "form" "rows"), indices included."""
    import json

    with open(os.path.join(path, "delta.json")) as f:
        dense = json.load(f)["dense"]
    prefixes = tuple(f"d{j}_" for j, entry in enumerate(dense) if entry.get("form") == "rows")
    return sum(entry.stat().st_size for entry in os.scandir(path) if prefixes and entry.name.startswith(prefixes))


def ps_rss_mb(cluster, index: int) -> float | None:
    """Resident memory of ps task `index` (VmRSS, MB), or None where /proc does not say."""
    try:
        with open(f"/proc/{cluster.pid('ps', index)}/status") as f:
            return next(round(int(line.split()[1]) / 1024, 1) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


if __name__ == "__main__":
    main()
