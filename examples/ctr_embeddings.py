"""Click-through-rate prediction with large hashed embedding tables on 2 ps tasks.

The kind of model parameter servers are for: many categorical features (user,
ad, site, ...), each a raw 40-bit id hashed into a large embedding table, plus
a few dense features. Trained with an ordinary `model.fit` on a local cluster
(2 workers, 2 ps on 127.0.0.1); the big tables are split in two, one shard per
ps, by psclient's default partitioner (`variable_partitioner="auto"`);
lookups gather each shard's rows on its ps and Adagrad updates only the rows a
batch touched, there.

The clicks are synthetic, drawn offline (seeded) from a KNOWN generating model:

    logit = bias + sum over fields f of w_f[id_f]  +  <u[user], a[ad]>  +  beta . dense
    click ~ Bernoulli(sigmoid(logit))

with per-id weights w_f ~ N(0, scale_f^2), ids drawn from a Zipf law over each
field's vocabulary (a few ids are frequent, most are rare, as in real logs),
a user x ad interaction through 4-d latent vectors, and dense features
dense ~ N(0, 1). Because the generator is known, the test AUC of the trained
model is judged against two baselines computed from it, on the same test set:

  - the true model's AUC (its own logit as the score): the best any model can
    do on this data, up to sampling noise;
  - the dense-only AUC (beta . dense as the score): the best a model that
    ignores the categorical features can do. A CTR model's embeddings are
    worth something only above this line.

The summary prints the model's AUC, both baselines, the share of the gap
between them that the model closed, steps/s and where the tables live.

    python examples/ctr_embeddings.py                      # 300k examples, 100k-row tables: ~2 min here
    python examples/ctr_embeddings.py --examples 30000 --rows 8192 --dim 8 --vocab-scale 0.1  # ~40 s
    python examples/ctr_embeddings.py --no-partition       # every table whole on one ps
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

#: (name, distinct ids, Zipf exponent, sd of the per-id weight). The first
#: four are the "large" fields hashed into --rows buckets; the others are
#: small vocabularies (hashed into SMALL_ROWS buckets).
FIELDS = (
    ("user", 50_000, 1.05, 0.5),
    ("ad", 20_000, 1.1, 0.6),
    ("site", 10_000, 1.1, 0.5),
    ("advertiser", 5_000, 1.1, 0.4),
    ("app", 2_000, 1.2, 0.3),
    ("device_model", 1_000, 1.2, 0.3),
    ("country", 100, 1.0, 0.3),
    ("hour", 24, 0.0, 0.2),
)
LARGE_FIELDS = 4
SMALL_ROWS = 1024
DENSE = 6
LATENT = 4
BIAS = -1.2


class ClickModel:
    """The generating model: its parameters, and examples drawn from it."""

    def __init__(self, seed: int, vocab_scale: float = 1.0):
        rng = np.random.default_rng(seed)
        self.fields = []
        for name, vocab, zipf, scale in FIELDS:
            vocab = max(2, int(vocab * vocab_scale)) if vocab > 1000 else vocab
            ranks = np.arange(1, vocab + 1, dtype="float64")
            p = ranks ** -zipf
            raw = rng.choice(1 << 40, size=vocab, replace=False)  # what the logs hold: opaque ids
            self.fields.append({"name": name, "p": p / p.sum(), "raw": raw.astype("int64"),
                                "w": rng.normal(0.0, scale, vocab)})
        self.user_latent = rng.normal(0.0, 0.45, (len(self.fields[0]["raw"]), LATENT))
        self.ad_latent = rng.normal(0.0, 0.45, (len(self.fields[1]["raw"]), LATENT))
        self.beta = rng.normal(0.0, 0.4, DENSE)

    def sample(self, n: int, seed: int):
        """n examples: raw ids (n, fields) int64, dense (n, DENSE) float32, clicks, true and dense-only logits."""
        rng = np.random.default_rng(seed)
        index = np.stack([rng.choice(len(f["p"]), size=n, p=f["p"]) for f in self.fields], axis=1)
        ids = np.stack([f["raw"][index[:, i]] for i, f in enumerate(self.fields)], axis=1)
        dense = rng.standard_normal((n, DENSE)).astype("float32")
        dense_logit = dense.astype("float64") @ self.beta
        logit = BIAS + dense_logit + sum(f["w"][index[:, i]] for i, f in enumerate(self.fields))
        logit += np.sum(self.user_latent[index[:, 0]] * self.ad_latent[index[:, 1]], axis=1)
        clicks = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype("float32")
        return ids, dense, clicks, logit, dense_logit


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney, ties counted half)."""
    labels = np.asarray(labels).astype(bool)
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = np.asarray(scores)[order]
    ranks = np.empty(len(scores), dtype="float64")
    # Mid-ranks for runs of equal scores.
    _, start, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    mid = start + (counts + 1) / 2.0
    ranks[order] = np.repeat(mid, counts)
    positives, negatives = labels.sum(), (~labels).sum()
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


def auc_standard_error(value: float, positives: int, negatives: int) -> float:
    """Hanley & McNeil (1982): the sampling error of an AUC on this many examples."""
    q1, q2 = value / (2 - value), 2 * value * value / (1 + value)
    variance = (value * (1 - value) + (positives - 1) * (q1 - value * value)
                + (negatives - 1) * (q2 - value * value)) / (positives * negatives)
    return float(np.sqrt(max(variance, 0.0)))


def build_model(keras, rows: int, dim: int):
    """Wide & deep over hashed ids: per field a Hashing layer, a dim-wide and a 1-wide embedding."""
    ids = keras.Input((len(FIELDS),), dtype="int64", name="ids")
    dense = keras.Input((DENSE,), name="dense_features")
    deep, wide = [], []
    for i, (name, *_rest) in enumerate(FIELDS):
        bins = rows if i < LARGE_FIELDS else SMALL_ROWS
        hashed = keras.layers.Hashing(num_bins=bins, name=f"{name}_hash")(ids[:, i])
        deep.append(keras.layers.Embedding(bins, dim, name=f"{name}_embedding")(hashed))
        wide.append(keras.layers.Embedding(bins, 1, name=f"{name}_weight")(hashed))
    x = keras.layers.Concatenate()([*deep, dense])
    x = keras.layers.Dense(64, activation="relu")(x)
    x = keras.layers.Dense(32, activation="relu")(x)
    logit = keras.layers.Add()([keras.layers.Dense(1)(x), keras.layers.Dense(1)(dense), *wide])
    return keras.Model([ids, dense], logit)


def epoch_timer(keras):
    """A callback that records each epoch's wall time (an epoch ends once its steps are done)."""

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self._start)

    return EpochTimer()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=300_000, help="training examples")
    parser.add_argument("--test-examples", type=int, default=50_000)
    parser.add_argument("--rows", type=int, default=100_000, help="hash buckets (table rows) of the large fields")
    parser.add_argument("--dim", type=int, default=16, help="embedding width")
    parser.add_argument("--vocab-scale", type=float, default=1.0, help="scale the large vocabularies")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps-per-execution", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=0.2, help="Adagrad's")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--no-partition", action="store_true", help="variable_partitioner=None: tables whole")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the summary to this file")
    parser.add_argument("--verbose", type=int, default=2, choices=(0, 1, 2))
    args = parser.parse_args(argv)
    for name in ("examples", "test_examples", "rows", "dim", "epochs", "batch_size", "steps_per_execution"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")

    truth = ClickModel(args.seed, args.vocab_scale)
    ids, dense, clicks, _, _ = truth.sample(args.examples, seed=args.seed + 1)
    test_ids, test_dense, test_clicks, test_logit, test_dense_logit = truth.sample(
        args.test_examples, seed=args.seed + 2)
    oracle_auc, dense_only_auc = auc(test_clicks, test_logit), auc(test_clicks, test_dense_logit)
    print(f"data: {args.examples:,} training and {args.test_examples:,} test examples, {len(FIELDS)} "
          f"categorical fields ({LARGE_FIELDS} hashed into {args.rows:,} rows x {args.dim}), {DENSE} dense; "
          f"click rate {clicks.mean():.3f}", flush=True)

    import keras

    import psclient

    keras.utils.set_random_seed(args.seed)
    print(f"Starting a local cluster: {args.workers} workers, {args.ps} ps (127.0.0.1 only) ...", flush=True)
    with psclient.LocalCluster(num_workers=args.workers, num_ps=args.ps) as cluster:
        # "auto" splits every variable of more than 128 KiB into one shard per
        # ps; None (the default) keeps each variable whole on one ps.
        strategy = psclient.ParameterServerStrategy(
            cluster.cluster, variable_partitioner=None if args.no_partition else "auto")
        try:
            with strategy.scope():
                model = build_model(keras, args.rows, args.dim)
                model.compile(
                    optimizer=keras.optimizers.Adagrad(args.learning_rate),
                    loss=keras.losses.BinaryCrossentropy(from_logits=True),
                    steps_per_execution=args.steps_per_execution,
                )
            timer = epoch_timer(keras)
            started = time.perf_counter()
            history = model.fit(
                [ids, dense], clicks, batch_size=args.batch_size, epochs=args.epochs,
                verbose=args.verbose, callbacks=[timer],
            )
            fit_seconds = time.perf_counter() - started
            scores = model.predict([test_ids, test_dense], batch_size=4096, verbose=0)[:, 0]
            placement = strategy.placement()
        finally:
            strategy.shutdown()

    steps_per_epoch = -(-args.examples // args.batch_size)
    later = timer.seconds[1:]  # the first epoch includes tracing
    model_auc = auc(test_clicks, scores)
    positives = int(test_clicks.sum())
    error = auc_standard_error(model_auc, positives, len(test_clicks) - positives)
    gap = oracle_auc - dense_only_auc
    tables = sorted({entry["of"] for entry in placement["variables"] if entry["of"]})
    summary = {
        "model_auc": round(model_auc, 4),
        "true_model_auc": round(oracle_auc, 4),
        "dense_only_auc": round(dense_only_auc, 4),
        "gap_closed": round((model_auc - dense_only_auc) / gap, 3),
        "auc_standard_error": round(error, 4),
        "final_loss": round(float(history.history["loss"][-1]), 4),
        "steps": steps_per_epoch * args.epochs,
        "steps_per_s": round(steps_per_epoch * args.epochs / fit_seconds, 1),
        "steps_per_s_after_first_epoch": round(steps_per_epoch * len(later) / sum(later), 1) if later else None,
        "fit_seconds": round(fit_seconds, 1),
        "epoch_seconds": [round(t, 1) for t in timer.seconds],
        "partitioned_variables": len(tables),
        "bytes_per_ps": placement["bytes_per_ps"],
    }
    print()
    print(f"test AUC {model_auc:.4f} (+- {error:.4f}): the true model {oracle_auc:.4f}, "
          f"dense features alone {dense_only_auc:.4f}; the model closed {summary['gap_closed']:.0%} of the gap")
    print(f"fit: {summary['steps']} steps of {args.batch_size} in {fit_seconds:.1f} s: {summary['steps_per_s']} "
          f"steps/s ({summary['steps_per_s_after_first_epoch']} after the first epoch, which traces)")
    print(f"partitioned variables: {len(tables)} (tables and their Adagrad accumulators, each split over the "
          f"ps tasks); bytes per ps: "
          f"{placement['bytes_per_ps']}")
    print("summary " + json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
