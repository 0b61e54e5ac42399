"""Train a Keras 3 classifier with psclient's custom loop on a local cluster.

Runs offline: the data is scikit-learn's bundled handwritten digits (8x8
images, 1,797 examples). It starts a LocalCluster (2 workers, 1 ps on
127.0.0.1), places the model and optimizer on the ps, schedules training steps
onto whichever worker is free, and evaluates on held-out data.

    python examples/custom_loop.py [--epochs 15] [--workers 2] [--ps 1]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def load_digits_split(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)

    import keras
    import tensorflow as tf

    import psclient

    keras.utils.set_random_seed(0)
    x_train, x_test, y_train, y_test = load_digits_split()
    steps_per_epoch = len(x_train) // args.batch_size

    print(f"Starting a local cluster: {args.workers} workers, {args.ps} ps (127.0.0.1 only) ...", flush=True)
    with psclient.LocalCluster(num_workers=args.workers, num_ps=args.ps) as cluster:
        strategy = psclient.ParameterServerStrategy(cluster.cluster)
        try:
            with strategy.scope():
                model = keras.Sequential(
                    [keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
                )
                optimizer = keras.optimizers.Adam(3e-3)
                optimizer.build(model.trainable_variables)
                train_accuracy = keras.metrics.SparseCategoricalAccuracy()
            loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

            def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
                # Each worker reads its own shard: ctx says which one.
                return (
                    tf.data.Dataset.from_tensor_slices((x_train, y_train))
                    .shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
                    .shuffle(1024, seed=ctx.input_pipeline_id)
                    .repeat()
                    .batch(args.batch_size)
                )

            iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

            @tf.function
            def train_step(iterator):
                x, y = next(iterator)
                with tf.GradientTape() as tape:
                    logits = model(x, training=True)
                    loss = loss_fn(y, logits)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                train_accuracy.update_state(y, logits)
                return loss

            start = time.monotonic()
            for epoch in range(1, args.epochs + 1):
                train_accuracy.reset_state()
                futures = [strategy.schedule(train_step, args=(iterator,)) for _ in range(steps_per_epoch)]
                strategy.join()
                losses = [f.result() for f in futures]
                print(
                    f"epoch {epoch:2d}/{args.epochs}  loss {np.mean(losses):.4f}  "
                    f"train accuracy {train_accuracy.result().numpy():.3f}  "
                    f"({time.monotonic() - start:.1f} s)",
                    flush=True,
                )

            # The trained weights live on the ps; reading them here copies them over.
            logits = model(x_test, training=False)
            test_accuracy = float(np.mean(np.argmax(np.asarray(logits), axis=1) == y_test))
            stats = strategy.stats()
            done = [w["done"] for w in stats["workers"]]
            print(f"steps per worker: {done}; placement bytes per ps: {strategy.placement()['bytes_per_ps']}")
            print(f"test accuracy: {test_accuracy:.4f}")
        finally:
            strategy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
