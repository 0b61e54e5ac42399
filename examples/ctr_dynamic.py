"""Click prediction over unbounded, drifting ids: DynamicEmbedding against the hashing trick at equal memory.

The clicks are synthetic, drawn (seeded) from a KNOWN generating model whose ids never stop coming. Per
field, an id is either

  - a "head" id: the ids in use at time t are a sliding window [start(t), start(t) + window) of the
    integers, moving by `--drift` windows over the run (new ids appear, old ones stop); within the window
    each id has a fixed popularity, Zipf(0.9) over a rank drawn from a hash of the id; or
  - with probability `--tail`, a one-off id: one of its own per example and field, never seen again (the
    long tail of real logs: new users, typos, one-time queries).

Each id has a fixed weight w_f[id] ~ N(0, 0.8^2) (drawn from a hash of the id: the id space is unbounded),

    logit = -1.0 + sum over fields f of w_f[id_f] + beta . dense,    click ~ Bernoulli(sigmoid(logit))

The stream is cut into `--segments` consecutive parts. Both models train on part k (`fit`, one pass, on
LocalCluster(num_workers=2, num_ps=2), each worker on its own half) and are scored on examples drawn at
the start of part k+1 (progressive validation: the future, as in production). The two models are the same but for the
embedding, and both hold `--rows` rows per field:

  dynamic   DynamicEmbedding(dim, capacity=rows, min_frequency=2) per field: each id seen twice gets a
            row of its own (LRU eviction), one-off ids read the zero row and never take a row
  hashing   Hashing(num_bins=rows) + Embedding(rows, dim) per field: ids share rows by hash, head ids
            with each other and with the one-off ids

Printed per part: each model's AUC with its standard error (Hanley & McNeil) and the dynamic tables'
rows, admissions and evictions; at the end, both models' AUC on the test examples of every part after
the first, pooled, and the difference with its standard error from a paired bootstrap over those
examples (both models scored on the same examples).

    python examples/ctr_dynamic.py                   # the defaults: about 2.5 minutes on a loaded 2-core machine
    python examples/ctr_dynamic.py --segments 2 --examples-per-segment 4000   # quicker, noisier
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ctr_embeddings import auc, auc_standard_error  # noqa: E402  (the same AUC as the hashed-table example)

FIELDS = ("user", "item", "query")
DENSE = 4


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 over uint64 ids: a fixed pseudo-random value per id."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(2**64 - 1)
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(2**64 - 1)
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(2**64 - 1)
    return x ^ (x >> np.uint64(31))


def _unit(h: np.ndarray) -> np.ndarray:
    return (h >> np.uint64(11)).astype("float64") * 2.0**-53


class Stream:
    """The generating model: per field a drifting Zipf head of ids and a tail of one-off ids, per-id weights."""

    def __init__(self, seed: int, window: int, drift: float, total: int, tail: float = 0.0, zipf: float = 0.9):
        self.seed, self.window, self.total, self.tail, self.zipf = seed, window, total, tail, zipf
        self.shift = drift * window / total  # ids the window moves per example
        self.beta = np.random.default_rng(seed).normal(0.0, 0.5, DENSE)

    def weight(self, field: int, ids: np.ndarray) -> np.ndarray:
        h1 = _mix(ids.astype("uint64") ^ np.uint64((self.seed + 1) * 1_000_003 + field * 7919))
        u1, u2 = _unit(h1), _unit(_mix(h1))
        return 0.8 * np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2 * np.pi * u2)

    def popularity(self, field: int, ids: np.ndarray) -> np.ndarray:
        """An id's fixed popularity: Zipf over a rank drawn from a hash of the id."""
        return (1.0 + _unit(_mix(_mix(ids.astype("uint64") ^ np.uint64(field + 17)))) * self.window) ** -self.zipf

    def sample(self, start: int, n: int, seed: int, chunk: int = 500):
        """n examples at stream positions start..start+n: ids (n, fields), dense, clicks, true logits.

        Per chunk of examples the window is fixed and head ids are drawn by
        popularity within it; one-off ids are made from the stream position.
        """
        rng = np.random.default_rng(seed)
        ids = np.empty((n, len(FIELDS)), dtype="int64")
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            first = int((start + lo) * self.shift)
            for f in range(len(FIELDS)):
                window = (f + 1) * 10**12 + first + np.arange(self.window, dtype="int64")
                p = self.popularity(f, window)
                ids[lo:hi, f] = rng.choice(window, size=hi - lo, p=p / p.sum())
        one_off = rng.random(ids.shape) < self.tail
        position = np.arange(start, start + n, dtype="int64")[:, None]
        ids = np.where(one_off, (np.arange(len(FIELDS)) + 1) * 10**12 + 5 * 10**11 + position, ids)
        logit = -1.0 + sum(self.weight(f, ids[:, f]) for f in range(len(FIELDS)))
        dense = rng.standard_normal((n, DENSE)).astype("float32")
        logit = logit + dense.astype("float64") @ self.beta
        clicks = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype("float32")
        return ids, dense, clicks, logit


def paired_difference(labels, first, second, rounds: int = 200, seed: int = 0) -> tuple[float, float]:
    """AUC(first) - AUC(second) on the same examples, and its standard error by a paired bootstrap."""
    labels, first, second = np.asarray(labels), np.asarray(first), np.asarray(second)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(rounds):
        pick = rng.integers(0, len(labels), len(labels))
        draws.append(auc(labels[pick], first[pick]) - auc(labels[pick], second[pick]))
    return auc(labels, first) - auc(labels, second), float(np.std(draws, ddof=1))


def with_error(labels, scores) -> tuple[float, float]:
    value, positives = auc(labels, scores), int(np.sum(labels))
    return value, auc_standard_error(value, positives, len(labels) - positives)


def sharded(ids, dense, clicks, batch_size: int):
    """A dataset function: each worker trains on its own share of the examples (each example once).

    NumPy arrays given to `fit` go whole to every worker, each walking its own
    copy: an id would be seen once per worker, and `min_frequency=2` would
    admit every one-off id.
    """
    import tensorflow as tf

    def dataset_fn(context):
        dataset = tf.data.Dataset.from_tensor_slices(((ids, dense), clicks))
        return dataset.shard(context.num_input_pipelines, context.input_pipeline_id).batch(batch_size)

    return dataset_fn


def build(keras, kind: str, rows: int, dim: int, seed: int):
    from psclient.layers import DynamicEmbedding

    ids = keras.Input((len(FIELDS),), dtype="int64", name="ids")
    dense = keras.Input((DENSE,), name="dense_features")
    parts = []
    for i, name in enumerate(FIELDS):
        column = ids[:, i]
        if kind == "dynamic":
            init = keras.initializers.RandomUniform(-0.05, 0.05, seed=seed + i)
            parts.append(DynamicEmbedding(dim, capacity=rows, min_frequency=2, embeddings_initializer=init,
                                          name=f"{name}_rows")(column))
        else:
            hashed = keras.layers.Hashing(num_bins=rows, name=f"{name}_hash")(column)
            parts.append(keras.layers.Embedding(rows, dim, name=f"{name}_rows")(hashed))
    features = keras.layers.Concatenate()([*parts, dense])
    hidden = keras.layers.Dense(32, activation="relu")(features)
    # A linear path beside the hidden layer: per-id weights, as the generator has, are learnt fast.
    logit = keras.layers.Add()([keras.layers.Dense(1)(hidden), keras.layers.Dense(1)(features)])
    return keras.Model([ids, dense], logit)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segments", type=int, default=4, help="consecutive parts of the stream (epochs)")
    parser.add_argument("--examples-per-segment", type=int, default=15_000)
    parser.add_argument("--test-examples", type=int, default=5_000)
    parser.add_argument("--window", type=int, default=300, help="head ids in use at once, per field")
    parser.add_argument("--tail", type=float, default=0.3, help="share of one-off ids, per field")
    parser.add_argument("--drift", type=float, default=1.0, help="windows the head ids move over the run")
    parser.add_argument("--rows", type=int, default=400, help="rows per field, both models")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--learning-rate", type=float, default=0.5, help="Adagrad's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args(argv)
    for name in ("segments", "examples_per_segment", "test_examples", "window", "rows", "dim", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.tail < 1:
        parser.error(f"--tail must be in [0, 1), got {args.tail}")

    n = args.examples_per_segment
    stream = Stream(args.seed, args.window, args.drift, n * (args.segments + 1), args.tail)
    parts = [stream.sample(k * n, n, seed=args.seed + 10 + k) for k in range(args.segments)]
    tests = [stream.sample((k + 1) * n, args.test_examples, seed=args.seed + 100 + k) for k in range(args.segments)]
    distinct = len(np.unique(np.concatenate([p[0].ravel() for p in parts])))
    print(f"stream: {args.segments} x {n:,} examples, {len(FIELDS)} id fields, {distinct:,} distinct ids "
          f"({args.window:,} head ids in use per field at a time, {args.tail:.0%} one-off ids); "
          f"{args.rows:,} rows per field in both models", flush=True)

    import keras

    import psclient

    keras.utils.set_random_seed(args.seed)
    summary = {"segments": [], "distinct_ids": distinct}
    scored = {"labels": [], "dynamic": [], "hashing": [], "true": []}
    with psclient.LocalCluster(num_workers=2, num_ps=2, start_timeout=300) as cluster:
        strategy = psclient.ParameterServerStrategy(cluster.cluster)
        try:
            models = {}
            with strategy.scope():
                for kind in ("dynamic", "hashing"):
                    models[kind] = build(keras, kind, args.rows, args.dim, args.seed)
                    models[kind].compile(optimizer=keras.optimizers.Adagrad(args.learning_rate),
                                         loss=keras.losses.BinaryCrossentropy(from_logits=True))
            started = time.perf_counter()
            for k, ((ids, dense, clicks, _), (t_ids, t_dense, t_clicks, t_logit)) in enumerate(zip(parts, tests)):
                row = {"segment": k, "true_model_auc": round(auc(t_clicks, t_logit), 4)}
                for kind, model in models.items():
                    model.fit(sharded(ids, dense, clicks, args.batch_size), epochs=1, verbose=0,
                              steps_per_epoch=max(1, n // args.batch_size))
                    scores = model.predict([t_ids, t_dense], batch_size=4096, verbose=0)[:, 0]
                    value, error = with_error(t_clicks, scores)
                    row[f"{kind}_auc"], row[f"{kind}_auc_se"] = round(value, 4), round(error, 4)
                    if k > 0 or args.segments == 1:
                        scored[kind].append(scores)
                if k > 0 or args.segments == 1:
                    scored["labels"].append(t_clicks)
                    scored["true"].append(t_logit)
                tables = strategy.stats()["dynamic_embeddings"]
                for field in FIELDS:
                    per_ps = tables[f"{field}_rows"]
                    for stat in ("rows", "tracked_keys", "admissions", "evictions"):
                        row[f"{field}_{stat}"] = sum(e[stat] for e in per_ps)
                summary["segments"].append(row)
                print(f"part {k}: AUC dynamic {row['dynamic_auc']:.4f} (+-{row['dynamic_auc_se']:.4f})  hashing "
                      f"{row['hashing_auc']:.4f} (+-{row['hashing_auc_se']:.4f})  (true model "
                      f"{row['true_model_auc']:.4f});  "
                      + "  ".join(f"{f}: {row[f'{f}_rows']} rows, +{row[f'{f}_admissions']} "
                                  f"-{row[f'{f}_evictions']}" for f in FIELDS), flush=True)
            summary["seconds"] = round(time.perf_counter() - started, 1)
        finally:
            strategy.shutdown()
    labels = np.concatenate(scored["labels"])
    pooled = {kind: with_error(labels, np.concatenate(scored[kind])) for kind in ("dynamic", "hashing", "true")}
    difference, difference_se = paired_difference(labels, np.concatenate(scored["dynamic"]),
                                                  np.concatenate(scored["hashing"]), seed=args.seed)
    summary["pooled_auc_after_first_part"] = {kind: round(v, 4) for kind, (v, _) in pooled.items()}
    summary["pooled_auc_se"] = {kind: round(e, 4) for kind, (_, e) in pooled.items()}
    summary["dynamic_minus_hashing"] = round(difference, 4)
    summary["dynamic_minus_hashing_se"] = round(difference_se, 4)
    print(f"pooled over {len(labels):,} test examples after the first part: AUC dynamic "
          f"{pooled['dynamic'][0]:.4f}, hashing {pooled['hashing'][0]:.4f}, true model {pooled['true'][0]:.4f}; "
          f"dynamic - hashing = {difference:+.4f} (paired bootstrap standard error {difference_se:.4f})")
    print("summary " + json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
