"""Click prediction over unbounded, drifting ids: DynamicEmbedding against the hashing trick at equal memory.

The clicks are synthetic, drawn (seeded) from a KNOWN generating model whose ids never stop coming:
per field, the ids in use at time t are a sliding window [start(t), start(t) + window) of the integers,
moving by `--drift` windows over the run, so new ids appear and old ones stop; within the window each id
has a fixed popularity, Zipf(1.1) over a rank drawn from a hash of the id. Each id has a fixed weight
w_f[id] ~ N(0, 0.8^2) (drawn from a hash of the id, so the id space is unbounded), and

    logit = -1.0 + sum over fields f of w_f[id_f] + beta . dense,    click ~ Bernoulli(sigmoid(logit))

The stream is cut into `--segments` consecutive parts. Both models train on part k (`fit`, one pass, on
LocalCluster(num_workers=2, num_ps=2)) and are scored on examples drawn at the start of part k+1
(progressive validation: the future, as in production). Printed per part: each model's AUC and the
dynamic tables' rows, admissions and evictions. The two models are the same but for the embedding:

  dynamic   DynamicEmbedding(dim, capacity=rows) per field: each id its own row, LRU eviction
  hashing   Hashing(num_bins=rows) + Embedding(rows, dim) per field: ids share rows by hash

so both hold `rows` rows per field (the dynamic table's slots sit beside its rows as the Embedding's
Adagrad accumulators do).

    python examples/ctr_dynamic.py                   # the defaults: about 4 minutes on a loaded 2-core machine
    python examples/ctr_dynamic.py --segments 2 --examples-per-segment 4000   # quicker
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

FIELDS = ("user", "item", "query")
DENSE = 4


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 over uint64 ids: a fixed pseudo-random value per id."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(2**64 - 1)
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(2**64 - 1)
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(2**64 - 1)
    return x ^ (x >> np.uint64(31))


class Stream:
    """The generating model: drifting Zipf ids per field, fixed per-id weights, dense features."""

    def __init__(self, seed: int, window: int, drift: float, total: int, zipf: float = 1.1):
        self.seed, self.window, self.total = seed, window, total
        self.shift = drift * window / total  # ids the window moves per example
        self.zipf = zipf
        self.beta = np.random.default_rng(seed).normal(0.0, 0.5, DENSE)

    def weight(self, field: int, ids: np.ndarray) -> np.ndarray:
        salt = np.uint64((self.seed + 1) * 1_000_003 + field * 7919)
        h1 = _mix(ids.astype("uint64") ^ salt)
        h2 = _mix(h1)
        u1 = (h1 >> np.uint64(11)).astype("float64") * 2.0**-53
        u2 = (h2 >> np.uint64(11)).astype("float64") * 2.0**-53
        return 0.8 * np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2 * np.pi * u2)

    def popularity(self, field: int, ids: np.ndarray) -> np.ndarray:
        """An id's fixed popularity: Zipf over a rank drawn from a hash of the id."""
        u = (_mix(_mix(ids.astype("uint64") ^ np.uint64(field + 17))) >> np.uint64(11)).astype("float64") * 2.0**-53
        return (1.0 + u * self.window) ** -self.zipf

    def sample(self, start: int, n: int, seed: int, chunk: int = 500):
        """n examples at stream positions start..start+n: ids (n, fields), dense, clicks, true logits.

        Per chunk of examples the window is fixed and ids are drawn by popularity within it.
        """
        rng = np.random.default_rng(seed)
        ids = np.empty((n, len(FIELDS)), dtype="int64")
        logit = np.full(n, -1.0)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            first = int((start + lo) * self.shift)
            for f in range(len(FIELDS)):
                window = (f + 1) * 10**12 + first + np.arange(self.window, dtype="int64")
                p = self.popularity(f, window)
                ids[lo:hi, f] = rng.choice(window, size=hi - lo, p=p / p.sum())
        for f in range(len(FIELDS)):
            logit += self.weight(f, ids[:, f])
        dense = rng.standard_normal((n, DENSE)).astype("float32")
        logit += dense.astype("float64") @ self.beta
        clicks = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype("float32")
        return ids, dense, clicks, logit


def auc(labels, scores) -> float:
    """Exact ROC AUC (Mann-Whitney, ties counted half)."""
    labels = np.asarray(labels).astype(bool)
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    _, first, counts = np.unique(np.asarray(scores)[order], return_index=True, return_counts=True)
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)
    pos, neg = labels.sum(), (~labels).sum()
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def build(keras, kind: str, rows: int, dim: int, seed: int):
    from psclient.layers import DynamicEmbedding

    ids = keras.Input((len(FIELDS),), dtype="int64", name="ids")
    dense = keras.Input((DENSE,), name="dense_features")
    parts = []
    for i, name in enumerate(FIELDS):
        column = ids[:, i]
        if kind == "dynamic":
            init = keras.initializers.RandomUniform(-0.05, 0.05, seed=seed + i)
            parts.append(DynamicEmbedding(dim, capacity=rows, embeddings_initializer=init, name=f"{name}_rows")(column))
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
    parser.add_argument("--segments", type=int, default=3, help="consecutive parts of the stream (epochs)")
    parser.add_argument("--examples-per-segment", type=int, default=10_000)
    parser.add_argument("--test-examples", type=int, default=5_000)
    parser.add_argument("--window", type=int, default=1_500, help="ids in use at once, per field")
    parser.add_argument("--drift", type=float, default=2.0, help="windows the ids move over the run")
    parser.add_argument("--rows", type=int, default=2_000, help="rows per field, both models")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--learning-rate", type=float, default=0.5, help="Adagrad's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args(argv)
    for name in ("segments", "examples_per_segment", "test_examples", "window", "rows", "dim", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")

    n = args.examples_per_segment
    stream = Stream(args.seed, args.window, args.drift, n * (args.segments + 1))
    parts = [stream.sample(k * n, n, seed=args.seed + 10 + k) for k in range(args.segments)]
    tests = [stream.sample((k + 1) * n, args.test_examples, seed=args.seed + 100 + k) for k in range(args.segments)]
    distinct = len(np.unique(np.concatenate([p[0].ravel() for p in parts])))
    print(f"stream: {args.segments} x {n:,} examples, {len(FIELDS)} id fields, {distinct:,} distinct ids; "
          f"{args.rows:,} rows per field in both models", flush=True)

    import keras

    import psclient

    keras.utils.set_random_seed(args.seed)
    summary = {"segments": [], "distinct_ids": distinct}
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
                    model.fit([ids, dense], clicks, batch_size=args.batch_size, epochs=1, verbose=0)
                    scores = model.predict([t_ids, t_dense], batch_size=4096, verbose=0)[:, 0]
                    row[f"{kind}_auc"] = round(auc(t_clicks, scores), 4)
                tables = strategy.stats()["dynamic_embeddings"]
                for field in FIELDS:
                    per_ps = tables[f"{field}_rows"]
                    row[f"{field}_rows"] = sum(e["rows"] for e in per_ps)
                    row[f"{field}_admissions"] = sum(e["admissions"] for e in per_ps)
                    row[f"{field}_evictions"] = sum(e["evictions"] for e in per_ps)
                summary["segments"].append(row)
                print(f"part {k}: AUC dynamic {row['dynamic_auc']:.4f}  hashing {row['hashing_auc']:.4f}  "
                      f"(true model {row['true_model_auc']:.4f});  "
                      + "  ".join(f"{f}: {row[f'{f}_rows']} rows, +{row[f'{f}_admissions']} "
                                  f"-{row[f'{f}_evictions']}" for f in FIELDS), flush=True)
            summary["seconds"] = round(time.perf_counter() - started, 1)
        finally:
            strategy.shutdown()
    later = summary["segments"][1:] or summary["segments"]
    summary["mean_auc_after_first_part"] = {
        kind: round(float(np.mean([r[f"{kind}_auc"] for r in later])), 4) for kind in ("dynamic", "hashing")}
    print("summary " + json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
